"""What ``jdls.clip`` measured, handed to the ``jdls.wrap`` right behind it.

``optax.chain(jdls.clip(c), jdls.wrap(inner))`` gives the wrap only the clipped gradients. A
rule that sets the scale from the largest gradient would then aim up to ``norm / c`` too high
for the next backward pass, which computes the gradients before clipping, and
``Stats.grad_norm`` would be the clipped norm. So ``jdls.clip`` records, for the leaves it
returns, the :class:`GlobalNorm` of the leaves it received (:func:`remember`), and
``jdls.wrap`` looks it up by the identity of the leaves it receives (:func:`recall`): the two
forms then take the decisions of ``jdls.wrap(inner, max_norm=c)``.

Only the very objects ``jdls.clip`` returned match, all of them, in the same order: a
transformation in between or a ``jit`` boundary makes new objects, and the wrap then measures
what it receives, as before. A record lives as long as the leaves it describes (a weak
reference removes it), so no value outlives its trace.
"""

from __future__ import annotations

import weakref
from collections.abc import Hashable, Sequence
from typing import Any, NamedTuple

from jdls._norm import GlobalNorm

__all__ = ["recall", "remember"]


class _Record(NamedTuple):
    leaves: tuple[weakref.ref[Any], ...]
    norm: GlobalNorm
    axis_name: Hashable | None


_records: dict[int, _Record] = {}


def remember(leaves: Sequence[Any], norm: GlobalNorm, axis_name: Hashable | None) -> None:
    """Record ``norm``, measured before clipping, for the float ``leaves`` a clip returns."""
    if not leaves:
        return
    try:
        refs = tuple(weakref.ref(x) for x in leaves)
    except TypeError:  # a leaf that takes no weak reference: nothing is handed over
        return
    key = id(leaves[0])
    _records[key] = _Record(refs, norm, axis_name)
    weakref.finalize(leaves[0], _forget, key, refs[0])


def _forget(key: int, ref: weakref.ref[Any]) -> None:
    record = _records.get(key)
    if record is not None and record.leaves[0] is ref:
        del _records[key]


def recall(leaves: Sequence[Any], axis_name: Hashable | None) -> GlobalNorm | None:
    """The norm recorded for exactly these ``leaves`` (the same objects, in order, measured
    across the same ``axis_name``), or None."""
    if not leaves:
        return None
    record = _records.get(id(leaves[0]))
    if record is None or len(record.leaves) != len(leaves) or record.axis_name != axis_name:
        return None
    if any(ref() is not x for ref, x in zip(record.leaves, leaves, strict=True)):
        return None
    return record.norm
