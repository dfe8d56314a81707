"""A value recorded for a sequence of arrays, found again by the identity of those very arrays.

``jdls.clip`` hands the wrap behind it the norm it measured before clipping, and
``jdls.retrying`` hands the wrap the measurement its loop made: each is recorded for the arrays
it came with, and found only for the same objects, in the same order. Identity is a property
of the traced program's graph (the same wiring on every trace of a function), and a record
lives as long as its first array (a weak reference), so no value outlives its trace.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any, Generic, TypeVar

__all__ = ["ByIdentity"]

T = TypeVar("T")


class ByIdentity(Generic[T]):
    """Values recorded for sequences of arrays.

    Example:
      >>> import jax.numpy as jnp
      >>> from jdls._numerics.by_identity import ByIdentity
      >>> norms: ByIdentity[str] = ByIdentity()
      >>> a, b = jnp.ones(2), jnp.zeros(3)
      >>> norms.put([a, b], "measured")
      >>> norms.get([a, b]), norms.get([b, a]), norms.get([a, jnp.zeros(3)])
      ('measured', None, None)
    """

    def __init__(self) -> None:
        self._records: dict[int, tuple[tuple[weakref.ref[Any], ...], T]] = {}

    def put(self, arrays: Sequence[Any], value: T) -> None:
        """Record ``value`` for ``arrays`` (nothing for none, or for an array that takes no
        weak reference)."""
        if not arrays:
            return
        try:
            refs = tuple(weakref.ref(x) for x in arrays)
        except TypeError:
            return
        key = id(arrays[0])
        self._records[key] = (refs, value)
        weakref.finalize(arrays[0], self._drop, key, refs[0])

    def get(self, arrays: Sequence[Any]) -> T | None:
        """The value recorded for exactly these ``arrays`` (the same objects, in order)."""
        if not arrays:
            return None
        record = self._records.get(id(arrays[0]))
        if record is None:
            return None
        refs, value = record
        if len(refs) != len(arrays) or any(r() is not x for r, x in zip(refs, arrays, strict=True)):
            return None
        return value

    def _drop(self, key: int, ref: weakref.ref[Any]) -> None:
        record = self._records.get(key)
        if record is not None and record[0][0] is ref:
            del self._records[key]
