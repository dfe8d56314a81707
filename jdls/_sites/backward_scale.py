"""The loss scale of the backward pass being traced, for the sites that measure cotangents.

A site that quantizes or measures the cotangent of a loss-scaled backward pass (an FP8 dot's
output gradient) sees the gradient times the loss scale. Its history should not move when the
loss scale does (a growth of the loss scale would clip the next step, a back-off leave the
history too high for a window), so it divides what it measures by the loss scale and
multiplies its scale by it.

jdls's scaled ``value_and_grad`` knows the loss scale the backward pass is seeded with only
after the forward pass (a 16-bit loss caps it), so it opens a :func:`backward_scale` context
around the whole differentiation and :func:`set_backward_scale` fills it in once the loss is
known; a site reads it with :func:`current_backward_scale` in its backward rule, which JAX
traces after the forward pass and inside the same ``value_and_grad`` call. Outside such a call
(``jax.grad`` by hand, per-layer and per-loss scales) there is no context and the site
measures the cotangent as it is (a scale of 1).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

__all__ = ["backward_scale", "current_backward_scale", "set_backward_scale"]

_local = threading.local()


def _stack() -> list[list[Any]]:
    stack = getattr(_local, "stack", None)
    if stack is None:
        stack = _local.stack = []
    return stack


@contextlib.contextmanager
def backward_scale() -> Iterator[None]:
    """A context for one differentiation at a loss scale (set with
    :func:`set_backward_scale`)."""
    stack = _stack()
    stack.append([None])
    try:
        yield
    finally:
        stack.pop()


def set_backward_scale(loss_scale: Any) -> None:
    """The loss scale the innermost :func:`backward_scale` context's backward pass is seeded
    with (a float32 scalar)."""
    stack = _stack()
    if stack:
        stack[-1][0] = loss_scale


def current_backward_scale() -> Any:
    """The innermost context's loss scale, or None outside any (or before it is set)."""
    stack = _stack()
    return stack[-1][0] if stack else None
