"""A thread-local stack of the collectors active while a function is being traced.

``jdls.probe`` and ``jdls.layer_boundary`` are the identity outside a collecting call; inside
``probed_value_and_grad`` or ``layer_scaled_value_and_grad`` they find the innermost collector
here; the NNX output hooks (``_nnx_hooks``) keep theirs here too. Each module keeps its own
:class:`ContextStack`.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Generic, TypeVar

__all__ = ["ContextStack"]

T = TypeVar("T")


class ContextStack(Generic[T]):
    """A per-thread stack: ``push`` for the duration of a ``with``, ``current`` the innermost."""

    def __init__(self) -> None:
        self._local = threading.local()

    def current(self) -> T | None:
        """The innermost pushed item of this thread, or None outside any ``push``."""
        stack: list[T] = getattr(self._local, "stack", [])
        return stack[-1] if stack else None

    def all(self) -> tuple[T, ...]:
        """Every pushed item of this thread, outermost first."""
        return tuple(getattr(self._local, "stack", []))

    @contextlib.contextmanager
    def push(self, item: T) -> Iterator[T]:
        """Make ``item`` the innermost item until the ``with`` block ends."""
        stack: list[T] = self._local.__dict__.setdefault("stack", [])
        stack.append(item)
        try:
            yield item
        finally:
            stack.pop()
