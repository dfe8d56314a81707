"""Gradient clipping that keeps non-finite gradients detectable, and the global norm behind it.

One reduction does two jobs. The sum of the squares of every gradient element (in float32 or
wider) is finite exactly when every element is finite and the sum did not overflow. So:

* **finite sum** (the common case): every gradient is finite, and its square root is the
  global norm, computed exactly as ``optax.clip_by_global_norm`` computes it;
* **inf or NaN sum** (rare): a second pass decides, exactly. It sums the squares of the
  gradients scaled down by ``2**-96`` (exact: a power of two), which cannot overflow, so a
  leaf's sum is finite exactly when all its elements are; when all are finite the first sum
  merely overflowed (elements around ``1e19`` and more) and the scaled sum gives the norm.
  That pass sits in a ``lax.cond`` and costs nothing on ordinary steps.

Clipping a gradient whose norm overflowed multiplies it by the runtime scalars ``2**-96`` and
then ``max_norm / scaled_norm``, in that order. Dividing by a huge norm would not work: XLA
rewrites ``g / norm`` into ``g * (1 / norm)``, and ``1 / norm`` is a subnormal number, flushed
to zero on CPU and GPU. (Elements below about ``2**-30`` become zero on that rare path; their
clipped values would be far below ``1e-20 * max_norm`` anyway.)

Non-finite gradients are never turned into finite numbers: ``clip`` passes them through
untouched, so ``jdls.wrap`` behind it still sees them, skips the step and, with
``track_nonfinite``, names the same leaves.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Hashable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

__all__ = ["clip"]

AxisName = Hashable
_F32 = jnp.float32
_F32_MAX = float(np.finfo(np.float32).max)
_DOWN, _UP = 2.0**-96, 2.0**96  # exact scalings of the overflow path


# --------------------------------------------------------------------------------------------
# Arguments.
# --------------------------------------------------------------------------------------------


def _check_limit(name: str, value: Any) -> Any:
    """A clipping limit: a finite number > 0 (traced values, from inject_hyperparams, pass)."""
    if isinstance(value, jax.Array):
        if value.shape != ():
            raise ValueError(f"{name} must be a scalar, got an array of shape {value.shape}")
        try:
            value = value.item()
        except jax.errors.ConcretizationTypeError:
            return value  # a traced hyperparameter: cannot be checked here
    if isinstance(value, bool) or not isinstance(value, int | float | np.number):
        raise TypeError(f"{name} must be a number, got {type(value).__name__} {value!r}")
    value = float(value)
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
    return value


def _check_sharded(axis_name: Any, sharded: Any, clipping: bool, where: str) -> None:
    if axis_name is None and sharded is not None:
        raise ValueError(f"{where}: sharded={sharded!r} needs an axis_name")
    if axis_name is not None and clipping and sharded is None:
        raise ValueError(
            f"{where}: with axis_name={axis_name!r} and clipping, say how the gradients are laid "
            "out across that axis: sharded=True when each device holds a different part of every "
            "leaf (shard_map with sharded parameters: the squared norms are summed with psum), "
            "sharded=False when every device holds the whole gradient (after lax.pmean, as in "
            "pmap data parallelism), or a pytree prefix of bools for a mix. "
            "See docs/multi-device.md."
        )


def _sharded_flags(sharded: Any, grads: Any) -> list[bool] | None:
    """One bool per leaf of ``grads`` from ``sharded`` (None, a bool, a prefix tree, a callable)."""
    if sharded is None:
        return None
    if callable(sharded):
        sharded = sharded(grads)
    if isinstance(sharded, bool | np.bool_):
        return [bool(sharded)] * len(jax.tree_util.tree_leaves(grads))
    try:
        full = jax.tree_util.tree_map(
            lambda flag, sub: jax.tree_util.tree_map(lambda _: bool(flag), sub), sharded, grads
        )
    except ValueError as e:
        raise ValueError(
            "sharded must be a bool or a pytree prefix of the gradients with one bool per "
            f"subtree: {e}"
        ) from None
    return [bool(f) for f in jax.tree_util.tree_leaves(full)]


# --------------------------------------------------------------------------------------------
# The global norm.
# --------------------------------------------------------------------------------------------


def _is_float(x: Any) -> bool:
    return jnp.issubdtype(jnp.result_type(x), jnp.inexact)


def _wide(x: jax.Array) -> jax.Array:
    """The leaf in float32 or wider: squares of float16 overflow at 256."""
    return x.astype(jnp.promote_types(x.dtype, _F32))


def _square_sum(x: jax.Array) -> jax.Array:
    x = _wide(x)
    if jnp.iscomplexobj(x):
        return jnp.sum(jnp.square(x.real) + jnp.square(x.imag))
    return jnp.sum(jnp.square(x))


def _ordered_sum(values: Sequence[jax.Array]) -> jax.Array | float:
    """``((0 + v0) + v1) + ...``: the order optax uses, for bit-identical norms."""
    total: jax.Array | float = 0.0
    for v in values:
        total = total + v
    return total


def _any_across(flag: jax.Array, axis_name: AxisName | None) -> jax.Array:
    if axis_name is None:
        return flag
    return lax.pmax(flag.astype(jnp.int32), axis_name) > 0


class _Norm(NamedTuple):
    """The result of :func:`_global_norm` (identical on every device of ``axis_name``)."""

    finite: jax.Array  # every float element is finite
    norm: jax.Array  # global L2 norm; inf above float32 max or with an inf; NaN with a NaN
    robust: jax.Array  # the sum of squares overflowed: clip with down and scaled_norm
    down: jax.Array  # 2**-96 when robust (a runtime value: XLA must not fold it)
    scaled_norm: jax.Array  # the norm of the gradients multiplied by ``down``
    leaf_nonfinite: jax.Array | None  # bool[number of float leaves], when asked for


@functools.lru_cache(maxsize=256)
def _norm_branches(
    axis_name: AxisName | None, is_sharded: tuple[bool, ...]
) -> tuple[Callable[..., jax.Array], Callable[..., Any], Callable[..., Any]]:
    """The reduction and the two branches of :func:`_global_norm` for one configuration.

    Built once per configuration so that ``lax.cond`` finds its branches in its cache when
    called outside ``jit`` (closures made anew on every call would be compiled every call).
    """

    def reduce(parts: list[jax.Array]) -> jax.Array:
        local = [p for p, s in zip(parts, is_sharded, strict=True) if not s]
        split = [p for p, s in zip(parts, is_sharded, strict=True) if s]
        total = _ordered_sum(local)
        if split:
            total = total + lax.psum(_ordered_sum(split), axis_name)
        return jnp.asarray(total)

    def usual(operands: tuple[list[jax.Array], jax.Array]) -> tuple[jax.Array, ...]:
        xs, total = operands
        norm = jnp.sqrt(total)
        one = jnp.ones((), total.dtype)
        flags = jnp.zeros((len(xs),), jnp.bool_)
        return jnp.array(True), norm, jnp.array(False), one, one, flags

    def careful(operands: tuple[list[jax.Array], jax.Array]) -> tuple[jax.Array, ...]:
        # One pass: squares of the gradients scaled by 2**-96 cannot overflow (|g| < 2**128),
        # so a leaf's scaled sum is finite exactly when all of its elements are.
        xs, total = operands
        dtype = total.dtype
        down = jnp.asarray(_DOWN, dtype)
        sums = [_square_sum(_wide(x) * down.astype(_wide(x).dtype)) for x in xs]
        flags = ~jnp.isfinite(jnp.stack(sums))
        if axis_name is not None:
            flags = lax.pmax(flags.astype(jnp.int32), axis_name) > 0
        finite = ~jnp.any(flags)
        scaled = jnp.sqrt(reduce(sums))
        norm = jnp.where(finite, scaled * _UP, jnp.sqrt(total))  # may overflow to inf: right
        return finite, norm, finite, down, scaled, flags

    return reduce, usual, careful


def _global_norm(
    leaves: Sequence[jax.Array],
    *,
    axis_name: AxisName | None = None,
    sharded: Sequence[bool] | None = None,
    per_leaf: bool = False,
) -> _Norm:
    """Finiteness and global norm of float ``leaves`` from one sum of squares.

    Args:
      leaves: the floating-point gradient leaves.
      axis_name: a mapped axis (``pmap``, ``shard_map``) to agree across, or None.
      sharded: per leaf, whether it is split across ``axis_name`` (its squared norm is then
        summed with ``psum``); None with an ``axis_name``: the norm is not known (NaN) but the
        finiteness decision is still agreed.
      per_leaf: also return a flag per leaf (exact, agreed across ``axis_name``).

    Returns:
      A :class:`_Norm`.
    """
    n = len(leaves)
    keep = [i for i, x in enumerate(leaves) if x.size > 0]
    no_flags = jnp.zeros((n,), jnp.bool_) if per_leaf else None
    if not keep:
        one = jnp.ones((), _F32)
        return _Norm(jnp.array(True), jnp.zeros((), _F32), jnp.array(False), one, one, no_flags)
    xs = [leaves[i] for i in keep]
    is_sharded = (False,) * len(xs) if sharded is None else tuple(sharded[i] for i in keep)
    norm_known = axis_name is None or sharded is not None
    reduce, usual, careful = _norm_branches(axis_name, is_sharded)
    total = reduce([_square_sum(x) for x in xs])
    unsure = ~jnp.isfinite(total)
    if axis_name is not None and not all(is_sharded):
        unsure = _any_across(unsure, axis_name)  # the cond below must branch alike everywhere
    finite, norm, robust, down, scaled, flags = lax.cond(unsure, careful, usual, (xs, total))
    if not norm_known:
        norm = jnp.full((), jnp.nan, total.dtype)
    leaf_flags = None
    if per_leaf:
        leaf_flags = jnp.zeros((n,), jnp.bool_).at[np.asarray(keep)].set(flags)
    return _Norm(finite, norm, robust, down, scaled, leaf_flags)


def _clip_leaf(g: jax.Array, keep: jax.Array, n: _Norm, max_norm: Any) -> jax.Array:
    """``g`` when ``keep``, else ``g / norm * max_norm`` (as optax, in float32 or wider)."""
    x = _wide(g)
    usual = (x / n.norm.astype(x.dtype)) * max_norm  # optax's expression, for equal results
    factor = (max_norm / n.scaled_norm).astype(x.dtype)
    robust = (x * n.down.astype(x.dtype)) * factor
    return jnp.where(keep, x, jnp.where(n.robust, robust, usual)).astype(g.dtype)


def _clip_value_leaf(g: jax.Array, max_value: Any) -> jax.Array:
    clipped = jnp.clip(g, -max_value, max_value).astype(g.dtype)
    return jnp.where(jnp.isinf(g), g, clipped)  # NaN stays NaN through clip


def _clip_by_norm(
    leaves: list[Any], float_idx: list[int], n: _Norm, max_norm: Any, *, fused: bool = False
) -> list[Any]:
    """Clip the float leaves by the global norm ``n``; others pass through.

    ``fused=False`` (``jdls.clip``): optax's ``g / norm * max_norm``, bit for bit.
    ``fused=True`` (``jdls.wrap(max_norm=...)``): ``g * a * b`` with two scalars, ``(1, 1)``
    to keep, ``(1, max_norm / norm)`` to clip, ``(2**-96, max_norm / scaled_norm)`` on the
    overflow path. No element-wise division, so XLA fuses it into every consumer (adam reads
    the gradient twice) instead of writing the clipped gradients out; it may differ from
    optax's result in the last bit.
    """
    keep = ~n.finite | (n.norm < max_norm)
    out = list(leaves)
    if not fused:
        for i in float_idx:
            out[i] = _clip_leaf(leaves[i], keep, n, max_norm)
        return out
    dtype = n.norm.dtype
    one = jnp.ones((), dtype)
    a = jnp.where(keep | ~n.robust, one, n.down)
    b = jnp.where(keep, one, max_norm / jnp.where(n.robust, n.scaled_norm, n.norm))
    for i in float_idx:
        x = _wide(leaves[i])
        out[i] = ((x * a.astype(x.dtype)) * b.astype(x.dtype)).astype(leaves[i].dtype)
    return out


# --------------------------------------------------------------------------------------------
# The transformation.
# --------------------------------------------------------------------------------------------


def clip(
    max_norm: float | None = None,
    max_value: float | None = None,
    *,
    axis_name: AxisName | None = None,
    sharded: bool | Any | Callable[[Any], Any] | None = None,
) -> optax.GradientTransformation:
    """Clip gradients by global norm or by value, keeping non-finite gradients detectable.

    Put it in front of :func:`jdls.wrap`: ``optax.chain(jdls.clip(1.0), jdls.wrap(adam))``.
    On finite gradients ``jdls.clip(max_norm=c)`` gives exactly what
    ``optax.clip_by_global_norm(c)`` gives (same reduction, same formula: ``g * c / norm``
    when ``norm >= c``), with three differences:

    * **non-finite gradients pass through untouched** (optax turns them into NaN and zeros,
      and per-value clipping would turn inf into a finite ``max_value``), so the wrap behind
      sees the same inf/NaN in the same leaves and skips the step;
    * **a finite gradient whose norm overflows float32** (elements around ``1e20`` or more)
      is still clipped to norm ``max_norm``; optax's norm is inf there and every update
      silently becomes zero. The overflow is detected from the sum of squares and handled by
      a second pass that divides by the largest element first (see the module docstring);
    * 16-bit leaves are squared and clipped in float32, then cast back.

    Exactly one of ``max_norm`` and ``max_value`` must be given, as in Cerebras'
    ``optimizer_step``; a ``jdls.clip()`` with neither would do nothing, so it is an error
    too (leave the transformation out instead). Integer and boolean leaves pass through.

    Args:
      max_norm: largest global L2 norm, a finite number > 0.
      max_value: largest absolute value of each element, a finite number > 0.
      axis_name: with ``max_norm`` inside ``pmap``/``shard_map``: the mapped axis across which
        every device must see the same global norm.
      sharded: with ``axis_name``: True when each device holds a different part of the
        gradients (squared norms are summed with ``psum``), False when each holds all of them
        (after ``lax.pmean``), or a pytree prefix of bools (or a function of the gradients
        returning one) for a mix. See ``docs/multi-device.md``.

    Returns:
      An ``optax.GradientTransformation`` with an empty state.

    Raises:
      ValueError: neither or both limits given, or a limit that is not a finite number > 0
        (the message names the argument).

    Example:
      >>> import jax.numpy as jnp, jdls
      >>> tx = jdls.clip(max_norm=1.0)
      >>> g, _ = tx.update({"w": jnp.array([3.0, 4.0])}, tx.init(None))
      >>> g["w"].tolist()
      [0.6000000238418579, 0.800000011920929]
      >>> g, _ = tx.update({"w": jnp.array([jnp.inf, 4.0])}, tx.init(None))
      >>> g["w"].tolist()
      [inf, 4.0]

    References:
      Pascanu et al., `On the difficulty of training Recurrent Neural Networks
      <https://arxiv.org/abs/1211.5063>`_, 2012; Cerebras ``cerebras.pytorch.optim``
      ``optimizer_step(max_gradient_norm, max_gradient_value)``.
    """
    if max_norm is not None and max_value is not None:
        raise ValueError(
            f"give max_norm or max_value, not both (got max_norm={max_norm!r} and "
            f"max_value={max_value!r})"
        )
    if max_norm is None and max_value is None:
        raise ValueError(
            "give max_norm (global-norm clipping) or max_value (per-element clipping); "
            "for no clipping leave jdls.clip out of the chain"
        )
    if max_norm is not None:
        max_norm = _check_limit("max_norm", max_norm)
        _check_sharded(axis_name, sharded, True, "jdls.clip")
    else:
        max_value = _check_limit("max_value", max_value)

    def update_fn(updates: Any, state: Any, params: Any = None) -> tuple[Any, Any]:
        del params
        leaves, treedef = jax.tree_util.tree_flatten(updates)
        float_idx = [i for i, x in enumerate(leaves) if _is_float(x)]
        leaves = [jnp.asarray(x) if i in float_idx else x for i, x in enumerate(leaves)]
        if max_value is not None:
            for i in float_idx:
                leaves[i] = _clip_value_leaf(leaves[i], max_value)
            return jax.tree_util.tree_unflatten(treedef, leaves), state
        flags = _sharded_flags(sharded, updates)
        n = _global_norm(
            [leaves[i] for i in float_idx],
            axis_name=axis_name,
            sharded=None if flags is None else [flags[i] for i in float_idx],
        )
        leaves = _clip_by_norm(leaves, float_idx, n, max_norm)
        return jax.tree_util.tree_unflatten(treedef, leaves), state

    return optax.GradientTransformation(optax.init_empty_state, update_fn)
