"""Manual mesh axes inside ``shard_map`` and ``pmap``: which axes are bound, which a value
varies over (where JAX tracks it, ``check_vma``), and values marked, summed or agreed over
them. A no-op outside a mapped function."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

__all__ = [
    "agree",
    "bound_axes",
    "manual_axes",
    "sum_like",
    "tracked_axes",
    "vary_like",
    "vary_over",
    "varying_axes",
]


def _varying_axes(t: Any) -> frozenset[Any]:
    """The manual mesh axes a value varies over, inside ``shard_map`` (empty elsewhere)."""
    mat = getattr(t, "manual_axis_type", None)  # jax >= 0.9; ``vma`` before
    varying = getattr(mat, "varying", None) if mat is not None else getattr(t, "vma", None)
    return frozenset(varying or ())


def varying_axes(x: Any) -> frozenset[Any]:
    """The manual mesh axes the value ``x`` varies over (inside ``shard_map``; empty elsewhere)."""
    return _varying_axes(jax.typeof(x))


def bound_axes() -> tuple[Any, ...]:
    """The named axes bound where this runs (``pmap``, ``shard_map``, a ``vmap`` with an
    ``axis_name``): what a collective may reduce over. Empty under plain ``jit``, where a
    sharded array's reductions are global already."""
    try:  # jax >= 0.9
        from jax.extend.core import (  # type: ignore[attr-defined]
            unsafe_get_axis_names_DO_NOT_USE as names,
        )
    except ImportError:  # pragma: no cover - jax < 0.9
        from jax.core import (  # type: ignore[attr-defined,no-redef]
            unsafe_get_axis_names_DO_NOT_USE as names,
        )
    return tuple(names())


def manual_axes() -> tuple[Any, ...]:
    """The manual mesh axes of the ``shard_map`` (or ``pmap``, which JAX builds on it) this runs
    inside; empty elsewhere, a ``vmap`` with an ``axis_name`` included."""
    return tuple(getattr(jax.sharding.get_abstract_mesh(), "manual_axes", ()))


def vary_like(x: Any, like: Any) -> Any:
    """``x`` marked as varying over the axes ``like`` varies over (a no-op outside shard_map)."""
    if not isinstance(like, jax.ShapeDtypeStruct):
        like = jax.typeof(like)
    missing = tuple(sorted(_varying_axes(like) - _varying_axes(jax.typeof(x)), key=str))
    if not missing:
        return x
    return vary_over(x, missing)


def vary_over(x: Any, axes: tuple[Any, ...]) -> Any:
    """``x`` marked as varying over the manual mesh ``axes`` (``lax.pcast``; ``lax.pvary``
    before jax 0.8.2)."""
    if not axes:
        return x
    if hasattr(lax, "pcast"):
        return lax.pcast(x, axes, to="varying")
    return lax.pvary(x, axes)  # type: ignore[attr-defined]  # pragma: no cover - jax < 0.8.2


def sum_like(x: Any, like: Any) -> Any:
    """``x`` summed over the manual axes it varies over and ``like`` does not (inside
    ``shard_map``; a no-op elsewhere): the cotangent JAX gives a value replicated over them."""
    if not isinstance(like, jax.ShapeDtypeStruct):
        like = jax.typeof(like)
    extra = tuple(sorted(_varying_axes(jax.typeof(x)) - _varying_axes(like), key=str))
    return lax.psum(x, extra) if extra else x


def tracked_axes(axes: tuple[Any, ...]) -> frozenset[Any]:
    """Those of the bound ``axes`` whose variation JAX tracks (``shard_map`` with
    ``check_vma``): there a value's type says whether it varies; under ``pmap`` and
    ``check_vma=False`` every value may."""
    return frozenset(a for a in axes if a in varying_axes(lax.axis_index(a)))


def agree(ok: Any) -> jax.Array:
    """The boolean ``ok`` of every device combined by ``all`` over the bound axes it may vary
    over: the same decision on every device, as one device on the whole batch would make."""
    ok = jnp.asarray(ok)
    axes = bound_axes()
    if not axes:
        return ok
    tracked = tracked_axes(axes)
    over = tuple(a for a in axes if a in varying_axes(ok) or a not in tracked)
    if not over:
        return ok
    return lax.pmin(ok.astype(jnp.int32), over) > 0
