"""The exact global norm of the float leaves of a gradient tree, and clipping by it.

One sum of squares (in float32 or wider) does two jobs: it is finite exactly when every
element is finite and the sum did not overflow, and its square root is the global norm, as
``optax.clip_by_global_norm`` computes it. When the sum is not finite, a second pass inside a
``lax.cond`` (free on ordinary steps) sums the squares of the gradients times ``2**-96`` (``2**-768`` in float64),
which cannot overflow: a leaf's scaled sum is finite exactly when all its elements are, and
when all are, the scaled sum gives the norm. ``jdls.clip`` and ``jdls.wrap`` both use it;
docs/optax.md explains the choices.

A rule that observes the largest gradient magnitude (:func:`jdls.AdaptiveScale`) gets it in
the same pass as one more reduction per leaf, ``max(abs(x))``: exact (``abs`` and ``max`` round
nothing), so no second measurement is ever needed, and XLA reads each leaf for it beside the
sum of squares without writing the squares out. Where nothing clips (``exact_overflow=False``)
it also makes the second pass needless: it is inf exactly when an element is, the sum is NaN
exactly when an element is, and the norm is then optax's (inf past ``2**64``). Not compiling
that pass is most of what the default's update compiles faster than it did.

Many leaves: the per-leaf sums and maxima are combined over one stacked vector behind an
optimization barrier (:func:`_stacked`), the sum in a loop that keeps optax's order
``((0 + s0) + s1) + ...``. Combined as a chain of scalar operations, XLA fuses the chain (one
operation per leaf) and copies it into every scalar kernel that reads the result; on XLA:CPU
those kernels took most of the compile time of a many-leaf update (docs/performance.md).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Hashable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jdls._numerics.axes import vary_like
from jdls._numerics.leaves import FloatLeaves, flatten_floats, sharded_flags

__all__ = [
    "AxisName",
    "GlobalNorm",
    "amax",
    "clip_by_norm",
    "global_norm",
    "tree_amax",
    "tree_norm",
    "wide",
]

AxisName = Hashable
_F32 = jnp.float32


def _down_exponent(dtype: Any) -> int:
    """``k`` such that squares of elements times ``2**-k`` cannot overflow ``dtype``: 96 for
    float32 (``|g| < 2**128``), 768 for float64 (``|g| < 2**1024``)."""
    return 3 * int(jnp.finfo(dtype).maxexp) // 4


# --------------------------------------------------------------------------------------------
# The norm.
# --------------------------------------------------------------------------------------------


def wide(x: jax.Array) -> jax.Array:
    """The leaf in float32 or wider: squares of float16 overflow at 256."""
    return x.astype(jnp.promote_types(x.dtype, _F32))


def _squares(x: jax.Array) -> jax.Array:
    """The elementwise squared magnitudes of the leaf, in float32 or wider."""
    x = wide(x)
    if jnp.iscomplexobj(x):
        return jnp.square(x.real) + jnp.square(x.imag)
    return jnp.square(x)


def _square_sum(x: jax.Array) -> jax.Array:
    return jnp.sum(_squares(x))


def _leaf_amax(x: jax.Array) -> jax.Array:
    """The largest magnitude of one leaf as float32, from ``abs``."""
    return jnp.max(jnp.abs(x)).astype(_F32)


#: Up to this many per-leaf scalars are combined as a chain of scalar operations; more are
#: stacked into one vector first (:func:`_stacked`).
_CHAIN = 16


def _stacked(values: Sequence[jax.Array]) -> jax.Array:
    """The per-leaf scalars ``values`` (one dtype) as one vector that XLA keeps as it is.

    Without the barrier, XLA's simplifier turns a reduction over a stack of per-leaf results
    back into a chain of scalar operations, fuses the chain (one parameter and one operation
    per leaf) and copies it into every scalar kernel that reads the result."""
    return lax.optimization_barrier(jnp.stack(values))


def _add(total: jax.Array, value: jax.Array) -> tuple[jax.Array, None]:
    """One step of :func:`_ordered_sum`'s loop (one function, so that ``lax.scan`` traces it
    once per dtype)."""
    return total + value, None


def _ordered_sum(values: Sequence[jax.Array]) -> jax.Array | float:
    """``((0 + v0) + v1) + ...``: the order optax uses, for bit-identical norms; over more
    than ``_CHAIN`` values of one dtype, a loop over their stacked vector."""
    values = list(values)
    if len(values) > _CHAIN and len({jnp.result_type(v) for v in values}) == 1:
        stacked = _stacked(values)
        init = vary_like(jnp.zeros((), stacked.dtype), stacked)
        looped, _ = lax.scan(_add, init, stacked)
        return looped
    total: jax.Array | float = 0.0
    for v in values:
        total = total + v
    return total


def _stacked_max(values: Sequence[jax.Array]) -> jax.Array:
    """The largest of the scalars ``values`` (one dtype)."""
    if len(values) > _CHAIN:
        return jnp.max(_stacked(values))
    return jnp.max(jnp.stack(values))


def _largest(xs: Sequence[jax.Array]) -> jax.Array:
    """The largest magnitude of the leaves ``xs`` as float32: exact (``abs`` and ``max`` round
    nothing; the cast to float32 rounds a float64 maximum as it would round each element).
    An inf gives inf; a NaN may be dropped (the step is not finite then, and the norm says so)."""
    return _stacked_max([_leaf_amax(x) for x in xs])


class GlobalNorm(NamedTuple):
    """The result of :func:`global_norm` (identical on every device of ``axis_name``)."""

    finite: jax.Array  # every float element is finite
    norm: jax.Array  # global L2 norm; inf above the dtype's max or with an inf; NaN with a NaN
    robust: jax.Array  # the sum of squares overflowed: clip with ``down`` and ``scaled_norm``
    down: jax.Array  # 2**-96 (float32) when robust (a runtime value: XLA must not fold it)
    scaled_norm: jax.Array  # the norm of the gradients multiplied by ``down``
    leaf_nonfinite: jax.Array | None  # bool[number of float leaves], when asked for
    #: the largest magnitude (float32; meaningless on a non-finite step), when asked for
    amax: jax.Array | None = None


_Operands = tuple[list[jax.Array], jax.Array, list[jax.Array]]


@functools.lru_cache(maxsize=256)
def _branches(
    axis_name: AxisName | None, is_sharded: tuple[bool, ...], largest: bool
) -> tuple[Callable[..., jax.Array], Callable[..., Any], Callable[..., Any]]:
    """The reduction and the two ``lax.cond`` branches for one configuration, built once so
    that ``lax.cond`` finds them in its cache outside ``jit``. The operands are the leaves,
    the sum of squares and, with ``largest``, the largest magnitude measured beside it."""

    def reduce(parts: list[jax.Array]) -> jax.Array:
        local = [p for p, s in zip(parts, is_sharded, strict=True) if not s]
        split = [p for p, s in zip(parts, is_sharded, strict=True) if s]
        total = _ordered_sum(local)
        if split:
            total = total + lax.psum(_ordered_sum(split), axis_name)
        return jnp.asarray(total)

    def largest_of(xs: list[jax.Array], fast: list[jax.Array]) -> jax.Array:
        if not largest:
            return jnp.zeros((), _F32)
        return vary_like(fast[0], xs[0])  # exact, measured beside the sum

    def usual(operands: _Operands) -> tuple[jax.Array, ...]:
        xs, total, fast = operands
        one = jnp.ones((), total.dtype)
        flags = jnp.zeros((len(xs),), jnp.bool_)
        yes, no = jnp.array(True), jnp.array(False)
        if axis_name is None:  # in shard_map, ``careful``'s local flags vary like ``total``
            yes, no, flags = (vary_like(x, total) for x in (yes, no, flags))
        # ``careful``'s scaled norm varies across devices like ``total``
        top = largest_of(xs, fast)
        return yes, jnp.sqrt(total), no, one, vary_like(one, total), flags, top

    def careful(operands: _Operands) -> tuple[jax.Array, ...]:
        xs, total, fast = operands
        k = _down_exponent(total.dtype)
        # a runtime value: a constant would let XLA fold it through the square of a
        # one-element leaf, (x * c)**2 -> x * x * c * c, which overflows where x > 2**64
        down = lax.optimization_barrier(jnp.asarray(2.0**-k, total.dtype))
        sums = [
            _square_sum(x.astype(jnp.promote_types(wide(x).dtype, total.dtype)) * down) for x in xs
        ]
        flags = ~jnp.isfinite(_stacked(sums) if len(sums) > _CHAIN else jnp.stack(sums))
        if axis_name is not None:
            flags = lax.pmax(flags.astype(jnp.int32), axis_name) > 0
        finite = ~jnp.any(flags)
        scaled = jnp.sqrt(reduce(sums))
        norm = jnp.where(finite, scaled * 2.0**k, jnp.sqrt(total))  # may overflow to inf: right
        return finite, norm, finite, down, scaled, flags, largest_of(xs, fast)

    return reduce, usual, careful


def global_norm(
    leaves: Sequence[jax.Array],
    *,
    axis_name: AxisName | None = None,
    sharded: Sequence[bool] | None = None,
    per_leaf: bool = False,
    largest: bool = False,
    exact_overflow: bool = True,
    known_largest: jax.Array | None = None,
) -> GlobalNorm:
    """Finiteness and global norm of float ``leaves`` from one sum of squares.

    Args:
      leaves: the floating-point gradient leaves.
      axis_name: a mapped axis (``pmap``, ``shard_map``) to agree across, or None.
      sharded: per leaf, whether it is split across ``axis_name`` (its squared norm is then
        summed with ``psum``); None with an ``axis_name``: the norm is unknown (NaN) but the
        finiteness decision is still agreed.
      per_leaf: also return one flag per leaf (exact, agreed across ``axis_name``).
      largest: also return the largest magnitude (exact, float32, a ``pmax`` across
        ``axis_name``), measured in the same pass as the sum.
      exact_overflow: when the sum of squares is not finite, run the second, scaled pass
        that gives the norm exactly up to float32's largest value (clipping needs it). False
        (with ``largest`` and without ``per_leaf`` only): finiteness comes from the largest
        magnitude (inf exactly when an element is) and the sum (NaN exactly when an element
        is), with no second pass to compile; the norm is then ``optax.global_norm``'s, bit
        for bit: inf once the float32 sum of squares overflows (a norm past ``2**64``).
        Leaves of float64 or complex keep the second pass (their magnitude may overflow
        float32).
      known_largest: with ``largest``, the largest magnitude of ``leaves`` on this device
        (float32; inf where an element is not finite), already measured by whoever computed
        them (per-layer scales measure each layer): the first pass then reads the sums alone.
    """
    n = len(leaves)
    keep = [i for i, x in enumerate(leaves) if x.size > 0]
    no_flags = jnp.zeros((n,), jnp.bool_) if per_leaf else None
    if not keep:
        one = jnp.ones((), _F32)
        zero = jnp.zeros((), _F32)
        return GlobalNorm(
            jnp.array(True), zero, jnp.array(False), one, one, no_flags, zero if largest else None
        )
    xs = [leaves[i] for i in keep]
    is_sharded = (False,) * len(xs) if sharded is None else tuple(sharded[i] for i in keep)
    reduce, usual, careful = _branches(axis_name, is_sharded, largest)
    first = first_pass(xs, largest=largest and known_largest is None)
    total = reduce(list(first.sums))
    top = first.largest if known_largest is None else known_largest
    fast = [top] if largest and top is not None else []
    if not exact_overflow:
        if not largest or per_leaf:
            raise ValueError("exact_overflow=False needs largest=True and per_leaf=False")
        if all(_fits_float32(x) for x in xs):
            return _from_largest(total, fast[0], axis_name, sharded is None)
    unsure = ~jnp.isfinite(total)
    if axis_name is not None and not all(is_sharded):
        # the cond below must branch alike on every device
        unsure = lax.pmax(unsure.astype(jnp.int32), axis_name) > 0
    finite, norm, robust, down, scaled, flags, top = lax.cond(
        unsure, careful, usual, (xs, total, fast)
    )
    if axis_name is not None and sharded is None:
        norm = jnp.full((), jnp.nan, total.dtype)
    leaf_flags = None
    if per_leaf:
        leaf_flags = jnp.zeros((n,), jnp.bool_).at[np.asarray(keep)].set(flags)
    if largest and axis_name is not None:
        top = lax.pmax(top, axis_name)
    return GlobalNorm(finite, norm, robust, down, scaled, leaf_flags, top if largest else None)


class FirstPass(NamedTuple):
    """What :func:`global_norm` reads the leaves for, before any decision: the sum of squares
    of each non-empty leaf (float32 or wider) and, when asked for, their largest magnitude
    (float32, this device's). Everything else it computes from these scalars, or from the
    leaves again only when the sum overflowed."""

    sums: tuple[jax.Array, ...]
    largest: jax.Array | None


def _finite_from(nan: jax.Array, top: jax.Array) -> jax.Array:
    """Finiteness from the first pass: the sum of squares is NaN exactly when an element is,
    and the largest magnitude is inf exactly when an element is."""
    return ~nan & (top < jnp.inf)


def first_pass(leaves: Sequence[jax.Array], *, largest: bool) -> FirstPass:
    """The one read of the non-empty float ``leaves`` that :func:`global_norm` makes."""
    return _first_pass(tuple(x for x in leaves if x.size > 0), largest)


# One program per leaves' shapes: inlined inside a user's jit with its trace kept, one
# compiled program when called eagerly (not one per operation and leaf).
@functools.partial(jax.jit, static_argnums=(1,), inline=True)
def _first_pass(xs: tuple[jax.Array, ...], largest: bool) -> FirstPass:
    sums = tuple(_square_sum(x) for x in xs)
    if not largest:
        return FirstPass(sums, None)
    return FirstPass(sums, _largest(xs) if xs else jnp.zeros((), _F32))


def _fits_float32(x: jax.Array) -> bool:
    """Whether every finite element of ``x`` has a finite float32 magnitude: a real float of
    32 bits or fewer (a float64 or complex magnitude may overflow float32 and read as inf)."""
    dtype = jnp.dtype(x.dtype)
    return dtype.itemsize <= 4 and not jnp.issubdtype(dtype, jnp.complexfloating)


def _from_largest(
    total: jax.Array, top: jax.Array, axis_name: AxisName | None, unknown: bool
) -> GlobalNorm:
    """:func:`global_norm` without its second pass: a square, a sum and a ``max`` round no
    NaN away and make none from finite values, and ``max(abs)`` is inf exactly when an element
    is, so the two reductions of the first pass decide finiteness exactly on their own."""
    nan = jnp.isnan(total)
    if axis_name is not None:
        nan = lax.pmax(nan.astype(jnp.int32), axis_name) > 0
        top = lax.pmax(top, axis_name)
    finite = _finite_from(nan, top)
    robust = finite & ~jnp.isfinite(total)
    norm = jnp.sqrt(total)
    if unknown and axis_name is not None:
        norm = jnp.full((), jnp.nan, total.dtype)
    one = jnp.ones((), total.dtype)
    return GlobalNorm(finite, norm, robust, one, norm, None, top)


def tree_norm(
    tree: FloatLeaves,
    *,
    axis_name: AxisName | None = None,
    sharded: Any = None,
    per_leaf: bool = False,
    largest: bool = False,
    exact_overflow: bool = True,
    known_largest: jax.Array | None = None,
) -> GlobalNorm:
    """:func:`global_norm` of the float leaves of ``tree``, with ``sharded`` given per subtree
    (a bool, a pytree prefix of bools, or a function of the tree returning one)."""
    flags = sharded_flags(sharded, tree.unflatten())
    return global_norm(
        tree.floats,
        axis_name=axis_name,
        sharded=None if flags is None else [flags[i] for i in tree.float_idx],
        per_leaf=per_leaf,
        largest=largest,
        exact_overflow=exact_overflow,
        known_largest=known_largest,
    )


def clip_by_norm(
    tree: FloatLeaves, n: GlobalNorm, max_norm: Any, *, fused: bool = False
) -> FloatLeaves:
    """Clip the float leaves by the global norm ``n``; others pass through.

    ``fused=False`` (``jdls.clip``): optax's ``g / norm * max_norm``, bit for bit.
    ``fused=True`` (``jdls.wrap(max_norm=...)``): ``g * a * b`` with two scalars, so that XLA
    fuses it into every consumer instead of writing the clipped gradients out; it may differ
    from optax's result in the last bit. On the overflow path both multiply by ``2**-96``
    (``2**-768`` in float64)
    first: XLA rewrites ``g / norm`` into ``g * (1 / norm)``, and ``1 / norm`` of a huge norm
    is subnormal, flushed to zero.
    """
    keep = ~n.finite | (n.norm < max_norm)
    out = []
    if fused:
        one = jnp.ones((), n.norm.dtype)
        a = jnp.where(keep | ~n.robust, one, n.down)
        b = jnp.where(keep, one, max_norm / jnp.where(n.robust, n.scaled_norm, n.norm))
        for g in tree.floats:
            x = g.astype(jnp.promote_types(wide(g).dtype, a.dtype))  # float64 with x64 only
            out.append(((x * a) * b.astype(x.dtype)).astype(g.dtype))
        return tree.with_floats(out)
    for g in tree.floats:
        x = g.astype(jnp.promote_types(wide(g).dtype, n.norm.dtype))
        usual = (x / n.norm.astype(x.dtype)) * max_norm  # optax's expression, for equal results
        robust = (x * n.down.astype(x.dtype)) * (max_norm / n.scaled_norm).astype(x.dtype)
        out.append(jnp.where(keep, x, jnp.where(n.robust, robust, usual)).astype(g.dtype))
    return tree.with_floats(out)


def amax(leaves: Sequence[jax.Array], *, axis_name: AxisName | None = None) -> jax.Array:
    """The largest magnitude of the float ``leaves`` as float32 (0 for none), agreed across
    ``axis_name`` (a ``pmax``: right whether the leaves are split or not). An inf gives inf;
    a NaN may be dropped (XLA's max reduction on CPU drops it in large arrays), so decide
    finiteness with ``all_finite`` or the norm, not with this."""
    xs = [x for x in leaves if x.size > 0]
    out = _stacked_max([_leaf_amax(x) for x in xs]) if xs else jnp.zeros((), _F32)
    if axis_name is not None:
        out = lax.pmax(out, axis_name)
    return out


def tree_amax(tree: Any) -> jax.Array:
    """:func:`amax` of the float leaves of ``tree`` (float32; 0 for none; not a finiteness
    test: a NaN may be dropped)."""
    return amax(flatten_floats(tree).floats)
