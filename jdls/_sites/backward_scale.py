"""The loss scale of the backward pass being traced, for the sites that measure cotangents.

A site that quantizes or measures the cotangent of a loss-scaled backward pass (an FP8 dot's
output gradient) sees the gradient times the loss scale. Its history should not move when the
loss scale does (a growth of the loss scale would clip the next step, a back-off leave the
history too high for a window), so it divides what it measures by the loss scale and
multiplies its scale by it.

jdls's scaled ``value_and_grad`` opens a :func:`backward_scale` context with its loss scale
around the whole differentiation. A site reads it in its forward pass
(:func:`current_loss_scale`) and passes it on as an argument of its ``custom_vjp`` (so that it
reaches the backward rule as data, through ``lax.scan``, remat and ``jit``). A 16-bit loss is
seeded with at most the format's largest power of two (its cotangent must be finite), which
is known only once the forward pass returned the loss: the context then records that cap
(:func:`set_seed_cap`, a Python number), and the backward rule, traced after the forward pass
and inside the same ``value_and_grad`` call, applies it (:func:`seeded`). Outside such a call
(``jax.grad`` by hand, per-layer and per-loss scales) there is no context and the site
measures the cotangent as it is (a scale of 1).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import jax.numpy as jnp

__all__ = ["backward_scale", "current_loss_scale", "seeded", "set_seed_cap"]

_local = threading.local()


def _stack() -> list[list[Any]]:
    stack = getattr(_local, "stack", None)
    if stack is None:
        stack = _local.stack = []
    return stack


@contextlib.contextmanager
def backward_scale(loss_scale: Any) -> Iterator[None]:
    """The context of one differentiation of a loss scaled by ``loss_scale``."""
    stack = _stack()
    stack.append([loss_scale, None])
    try:
        yield
    finally:
        stack.pop()


def current_loss_scale() -> Any:
    """The innermost context's loss scale (float32), or None outside any."""
    stack = _stack()
    return jnp.asarray(stack[-1][0], jnp.float32) if stack else None


def set_seed_cap(cap: float | None) -> None:
    """The largest scale the innermost context's loss could be seeded with (a 16-bit
    loss's largest power of two; None for a wider loss)."""
    stack = _stack()
    if stack:
        stack[-1][1] = cap


def seeded(loss_scale: Any) -> Any:
    """The scale the backward pass is seeded with: ``loss_scale``, capped by the innermost
    context's :func:`set_seed_cap`."""
    stack = _stack()
    cap = stack[-1][1] if stack else None
    return loss_scale if cap is None else jnp.minimum(loss_scale, jnp.float32(cap))
