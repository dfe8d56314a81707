"""What a skipped step returns: ``-0.0`` updates and the inner state as it was.

``p + (-0.0)`` is ``p`` bit for bit (``-0.0`` included), so ``optax.apply_updates`` leaves
every parameter as it was. Inside ``shard_map`` both ``lax.cond`` branches must agree on which
outputs vary across devices, so the constants built here are marked like the values they stand
for.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

__all__ = ["select", "skip_branch", "skip_value", "vary_like"]


def _varying_axes(t: Any) -> frozenset[Any]:
    """The manual mesh axes a value varies over, inside ``shard_map`` (empty elsewhere)."""
    mat = getattr(t, "manual_axis_type", None)  # jax >= 0.9; ``vma`` before
    varying = getattr(mat, "varying", None) if mat is not None else getattr(t, "vma", None)
    return frozenset(varying or ())


def vary_like(x: Any, like: Any) -> Any:
    """``x`` marked as varying over the axes ``like`` varies over (a no-op outside shard_map)."""
    if not isinstance(like, jax.ShapeDtypeStruct):
        like = jax.typeof(like)
    missing = tuple(sorted(_varying_axes(like) - _varying_axes(jax.typeof(x)), key=str))
    if not missing:
        return x
    if hasattr(lax, "pcast"):
        return lax.pcast(x, missing, to="varying")
    return lax.pvary(x, missing)  # type: ignore[attr-defined]  # pragma: no cover - older jax


def skip_value(s: jax.ShapeDtypeStruct) -> jax.Array:
    """The update of a skipped step for one leaf: ``-0.0`` (zero for non-float leaves)."""
    if s.dtype == jax.dtypes.float0:
        return np.zeros(s.shape, jax.dtypes.float0)  # type: ignore[return-value]
    if jnp.issubdtype(s.dtype, jnp.inexact):
        return vary_like(jnp.full(s.shape, -0.0, s.dtype), s)
    return vary_like(jnp.zeros(s.shape, s.dtype), s)


def skip_branch(
    apply: Callable[[tuple[Any, ...]], tuple[Any, Any]],
) -> Callable[[tuple[Any, ...]], tuple[Any, Any]]:
    """The ``lax.cond`` branch that skips ``apply(operands) -> (updates, inner_state)``.

    ``operands[1]`` must be the inner state, returned as it was.
    """

    def skip(operands: tuple[Any, ...]) -> tuple[Any, Any]:
        shapes, state_shapes = jax.eval_shape(apply, operands)
        old_state = jax.tree_util.tree_map(vary_like, operands[1], state_shapes)
        return jax.tree_util.tree_map(skip_value, shapes), old_state

    return skip


def select(finite: jax.Array, computed: tuple[Any, Any], old_state: Any) -> tuple[Any, Any]:
    """``skip_with="select"``: keep the computed step where ``finite``, else skip it."""
    updates, state = computed
    updates = jax.tree_util.tree_map(lambda u: jnp.where(finite, u, skip_value(u)), updates)
    state = jax.tree_util.tree_map(
        lambda new, old: jnp.where(finite, new, old).astype(new.dtype), state, old_state
    )
    return updates, state
