"""What a skipped step returns: ``-0.0`` updates and the inner state as it was.

``p + (-0.0)`` is ``p`` bit for bit (``-0.0`` included), so ``optax.apply_updates`` leaves
every parameter as it was. Inside ``shard_map`` both ``lax.cond`` branches must agree on which
outputs vary across devices, so the constants built here are marked like the values they stand
for.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jdls._numerics.axes import vary_like

__all__ = ["cond_branches", "keep_dtypes", "select", "skip_value"]


def skip_value(s: Any) -> jax.Array:
    """The update of a skipped step for one leaf: ``-0.0`` (zero for non-float leaves)."""
    if s.dtype == jax.dtypes.float0:
        return np.zeros(s.shape, jax.dtypes.float0)  # type: ignore[return-value]
    fill: complex = -0.0 if jnp.issubdtype(s.dtype, jnp.inexact) else 0
    if jnp.issubdtype(s.dtype, jnp.complexfloating):
        fill = complex(-0.0, -0.0)  # both parts: p + u keeps a -0.0 imaginary part too
    return vary_like(jnp.full_like(s, fill), s)  # full_like keeps an explicit sharding


def _types(tree: Any) -> tuple[Any, ...]:
    """A hashable key of the abstract types (shape, dtype, sharding, varying axes) of a tree."""
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    return (treedef, *(jax.typeof(x) for x in leaves))


def _struct(x: Any) -> Any:
    """A traced output as ``jax.eval_shape`` would give it (from its type: asking a tracer for
    its sharding walks the whole trace)."""
    t = jax.typeof(x)
    if hasattr(jax.ShapeDtypeStruct, "like"):  # jax >= 0.10.2
        return jax.ShapeDtypeStruct.like(t)
    sharding = None if t.sharding.mesh.empty else t.sharding
    varying = {"vma": t.vma} if hasattr(t, "vma") else {"manual_axis_type": t.manual_axis_type}
    return jax.ShapeDtypeStruct(
        t.shape, t.dtype, sharding=sharding, weak_type=t.weak_type, **varying
    )


@functools.lru_cache(maxsize=64)
def cond_branches(
    apply: Callable[[tuple[Any, ...]], tuple[Any, Any]],
) -> tuple[
    Callable[[tuple[Any, ...]], tuple[Any, Any]], Callable[[tuple[Any, ...]], tuple[Any, Any]]
]:
    """The two ``lax.cond`` branches ``(apply, skip)`` for ``apply(operands) -> (updates,
    inner_state)``; ``skip`` returns ``-0.0`` updates and ``operands[1]`` (the inner state)
    as it was.

    ``lax.cond`` traces ``apply`` first; the ``apply`` returned here records the types of its
    outputs as it is traced, so that ``skip`` finds them instead of tracing the inner update
    a second time with ``jax.eval_shape`` (which it still does when nothing was recorded).
    Cached per ``apply``, so that ``lax.cond`` finds both branches in its cache outside ``jit``.
    """
    seen: dict[Any, Any] = {}

    def recording(operands: tuple[Any, ...]) -> tuple[Any, Any]:
        out = apply(operands)
        if len(seen) > 16:
            seen.clear()
        seen[_types(operands)] = jax.tree_util.tree_map(_struct, out)
        return out

    def skip(operands: tuple[Any, ...]) -> tuple[Any, Any]:
        found = seen.get(_types(operands))
        shapes, state_shapes = found if found is not None else jax.eval_shape(apply, operands)
        old_state = jax.tree_util.tree_map(vary_like, operands[1], state_shapes)
        return jax.tree_util.tree_map(skip_value, shapes), old_state

    return recording, skip


def select(finite: jax.Array, computed: tuple[Any, Any], old_state: Any) -> tuple[Any, Any]:
    """``skip_with="select"``: keep the computed step where ``finite``, else skip it."""
    updates, state = computed
    # jnp.asarray: outside jit the inner state may hold Python scalars (a count, a flag).
    updates = jax.tree_util.tree_map(
        lambda u: jnp.where(finite, u, skip_value(jnp.asarray(u))), updates
    )

    def keep(new: Any, old: Any) -> jax.Array:
        new = jnp.asarray(new)
        return jnp.where(finite, new, old).astype(new.dtype)

    state = jax.tree_util.tree_map(keep, state, old_state)
    return updates, state


def keep_dtypes(new_state: Any, old_state: Any) -> Any:
    """``new_state`` with each float leaf cast back to the dtype it had in ``old_state``.

    Unscaled gradients are float32 while a bfloat16 or float16 model's optimizer state starts
    in the parameter dtype; the inner update would promote the state, and the two branches of
    ``lax.cond`` (like the carry of a ``lax.scan``) must keep one type.
    """

    def cast(new: Any, old: Any) -> Any:
        old_dtype, new_dtype = getattr(old, "dtype", None), getattr(new, "dtype", None)
        if old_dtype is None or new_dtype is None or old_dtype == new_dtype:
            return new
        if jnp.issubdtype(old_dtype, jnp.inexact) and jnp.issubdtype(new_dtype, jnp.inexact):
            return new.astype(old_dtype)
        return new

    try:
        return jax.tree_util.tree_map(cast, new_state, old_state)
    except ValueError:  # the inner state changed structure: leave it to lax.cond to report
        return new_state
