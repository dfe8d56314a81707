"""The FP8 dot: ``lax.dot_general`` on quantized operands, with a custom VJP.

Forward: both operands are quantized by the recipe (``lhs``, ``rhs`` roles), multiplied with
accumulation in the recipe's ``compute_dtype`` and dequantized. Backward: the output gradient
is quantized (the ``grad`` role, e5m2 by default) and the two transposed dots run on quantized
values. The measurements of the three quantize points leave as the cotangent of the state's
meter; the recipe states themselves get zero cotangents.

On XLA:CPU a float8 dot is computed by upcasting to float32, so results are exact emulation;
on a GPU with FP8 units XLA fuses the scaled dot.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jdls._numerics.axes import sum_like, vary_like, varying_axes
from jdls._sites.backward_scale import backward_level, current_loss_scale, site_factor
from jdls._sites.dropped import watched
from jdls._sites.site import Site
from jdls.fp8._recipe import Quantized
from jdls.fp8._state import DotState, Fp8, Meter

__all__ = ["dot_general"]

Dims = tuple[tuple[tuple[int, ...], tuple[int, ...]], tuple[tuple[int, ...], tuple[int, ...]]]


def _scaled_dot(
    a: Quantized,
    b: Quantized,
    dims: Any,
    acc: Any,
    precision: Any,
    dequantize_first: bool,
    out_sharding: Any = None,
    perm: tuple[int, ...] | None = None,
) -> jax.Array:
    """``dequantize(a) . dequantize(b)`` accumulated in ``acc``, transposed by ``perm``.

    With one scale per operand the float8 values are multiplied and the product is scaled
    once; with block scales (or ``dequantize_first``) each operand is dequantized first.
    """
    # out_sharding only when given: older callers and automatic meshes never see the keyword.
    sharding = {} if out_sharding is None else {"out_sharding": out_sharding}
    if a.scale.ndim == 0 and b.scale.ndim == 0 and not dequantize_first:
        out = lax.dot_general(
            a.values, b.values, dims, precision=precision, preferred_element_type=acc, **sharding
        )
        if perm is not None:  # transposed before it is scaled: see _grad_of
            out = jnp.transpose(out, perm)
        return out.astype(acc) * (a.scale * b.scale).astype(acc)
    out = lax.dot_general(
        a.dequantize(acc),
        b.dequantize(acc),
        dims,
        precision=precision,
        preferred_element_type=acc,
        **sharding,
    )
    return out if perm is None else jnp.transpose(out, perm)


def _sharding_of(x: jax.Array) -> tuple[Any, tuple[Any, ...] | None]:
    sharding = getattr(jax.typeof(x), "sharding", None)
    mesh, spec = getattr(sharding, "mesh", None), getattr(sharding, "spec", None)
    if mesh is None or spec is None or mesh.empty:
        return None, None
    return mesh, tuple(spec) + (None,) * (jnp.ndim(x) - len(spec))


def _sharding_before(like: jax.Array, perm: tuple[int, ...], *operands: jax.Array) -> Any:
    """Under an explicit mesh, the sharding of the dot whose transpose by ``perm`` is sharded
    as ``like`` (replicated when ``like`` has no mesh); ``None`` elsewhere."""
    mesh, spec = _sharding_of(like)
    if mesh is None:
        meshes = [m for m, _ in map(_sharding_of, operands) if m is not None]
        if not meshes:
            return None
        mesh, spec = meshes[0], (None,) * len(perm)
    assert spec is not None
    inverse = np.argsort(perm)
    return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(*(spec[i] for i in inverse)))


def _kept(ndim: int, contract: Sequence[int], batch: Sequence[int]) -> list[int]:
    return [i for i in range(ndim) if i not in contract and i not in batch]


def _transpose_dims(
    own_ndim: int, other_ndim: int, dims: Dims, own_is_lhs: bool
) -> tuple[Any, tuple[int, ...], list[int], tuple[int, ...]]:
    """How the gradient of one operand is the dot of the output gradient with the other.

    Returns the dimension numbers of ``dot(g, other)``, the axes of ``g`` it contracts, the
    other's contracted axes, and the permutation that puts the result in the operand's order.
    """
    (lc, rc), (lb, rb) = dims
    own_c, other_c, own_b, other_b = (lc, rc, lb, rb) if own_is_lhs else (rc, lc, rb, lb)
    own_kept = _kept(own_ndim, own_c, own_b)
    other_kept = _kept(other_ndim, other_c, other_b)
    n_batch = len(lb)
    # The output's axes: batch, then the lhs's kept axes, then the rhs's kept axes.
    lhs_kept_n = len(own_kept) if own_is_lhs else len(other_kept)
    start = n_batch + lhs_kept_n if own_is_lhs else n_batch
    g_other = tuple(range(start, start + len(other_kept)))
    dot_dims = ((g_other, tuple(other_kept)), (tuple(range(n_batch)), tuple(other_b)))
    # dot(g, other) has the axes: batch, the operand's kept axes, then the other's remaining
    # (contracted) axes in their own order, which are the operand's contracted axes.
    own_c_in_other_order = [own_c[j] for j in np.argsort(other_c)]
    perm = tuple(int(i) for i in np.argsort([*own_b, *own_kept, *own_c_in_other_order]))
    return dot_dims, g_other, other_kept, perm


def _grad_of(
    g: Quantized,
    other: Quantized,
    own: jax.Array,
    dims: Dims,
    own_is_lhs: bool,
    acc: Any,
    dequantize_first: bool,
    scale_last: bool = False,
) -> jax.Array:
    """The gradient of one operand. ``scale_last``: the product of the float8 values is
    transposed, then scaled, as Flax's ``fp8_ops`` (``quantized_dot_bwd``) do. The values are
    the same, but in a 16-bit ``acc`` XLA:CPU computes the scaling in float32 and drops its
    rounding to ``acc`` when a cast to float32 follows it (a float32 kernel cast to bfloat16
    by ``nn.Dense(dtype=...)``), and keeps it when a transpose comes between them."""
    dot_dims, _, _, perm = _transpose_dims(own.ndim, other.values.ndim, dims, own_is_lhs)
    hp = lax.Precision.HIGHEST
    sharding = _sharding_before(own, perm, g.values, other.values)
    if scale_last:
        return _scaled_dot(g, other, dot_dims, acc, hp, dequantize_first, sharding, perm)
    out = _scaled_dot(g, other, dot_dims, acc, hp, dequantize_first, sharding)
    return jnp.transpose(out, perm)


def _dequantize_first(kind: Fp8) -> bool:
    # An optional recipe attribute: recipes without it multiply float8 values.
    return bool(getattr(kind.recipe, "dequantize_first", False))


def _acc_dtype(kind: Fp8, out_dtype: Any) -> Any:
    compute = kind.recipe.compute_dtype
    return out_dtype if compute is None else compute


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7, 8, 9))
def _fp8_dot(
    lhs: jax.Array,
    rhs: jax.Array,
    state: DotState,
    loss_scale: jax.Array | None,
    factor: jax.Array | None,
    kind: Fp8,
    dims: Dims,
    precision: Any,
    out_dtype: Any,
    out_sharding: Any,
) -> jax.Array:
    return _fp8_dot_fwd(
        lhs, rhs, state, loss_scale, factor, kind, dims, precision, out_dtype, out_sharding
    )[0]


def _fp8_dot_fwd(
    lhs: jax.Array,
    rhs: jax.Array,
    state: DotState,
    loss_scale: jax.Array | None,
    factor: jax.Array | None,
    kind: Fp8,
    dims: Dims,
    precision: Any,
    out_dtype: Any,
    out_sharding: Any,
) -> tuple[jax.Array, Any]:
    out, (ql, qr, ml, mr) = _forward(
        kind, dims, precision, out_dtype, out_sharding, lhs, rhs, state
    )
    return out, (lhs, rhs, ql, qr, state, ml, mr, loss_scale, factor)


# The rules' arithmetic is one compiled program each, their configuration static. Called
# eagerly (outside a user's jit), JAX compiled every operation apart: one dot's value and
# gradients lowered 72 programs with CurrentScaling, 50 with DelayedScaling (3 s the first
# time on a 2-core CPU; 4 programs, 0.5 to 0.7 s, compiled). Inside a user's jit they are
# inlined (``inline=True``): the program is the operations', as before, with no inner call
# (XLA:CPU rounds a 16-bit graph differently across one: see _grad_of). What the backward
# rule reads while tracing (the loss scale's seed cap, backward_level) is read outside it.
@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3, 4), inline=True)
def _forward(
    kind: Fp8,
    dims: Dims,
    precision: Any,
    out_dtype: Any,
    out_sharding: Any,
    lhs: jax.Array,
    rhs: jax.Array,
    state: DotState,
) -> tuple[jax.Array, Any]:
    recipe = kind.recipe
    (lc, rc), _ = dims
    ql, ml = _quantize(recipe, lhs, state.lhs, "lhs", lc, "fprop")
    qr, mr = _quantize(recipe, rhs, state.rhs, "rhs", rc, "fprop")
    acc = _acc_dtype(kind, out_dtype)
    first = _dequantize_first(kind)
    out = _scaled_dot(ql, qr, dims, acc, precision, first, out_sharding).astype(out_dtype)
    return out, (ql, qr, ml, mr)


def _fp8_dot_bwd(
    kind: Fp8,
    dims: Dims,
    precision: Any,
    out_dtype: Any,
    out_sharding: Any,
    residuals: Any,
    g: jax.Array,
) -> tuple[jax.Array, jax.Array, DotState, Any, Any]:
    del precision, out_sharding
    lhs, rhs, ql, qr, state, ml, mr, loss_scale, factor = residuals
    # The output gradient of a loss-scaled backward pass is the gradient times the loss
    # scale: a recipe that keeps a scale (``rescaled``) keeps it for the unscaled gradient,
    # and every recipe reports the unscaled amax, so that the history does not move with the
    # loss scale (jdls/_sites/backward_scale.py). The scale is the context's, seeded (a
    # 16-bit loss caps it), times the factor the site was told on the per-layer and
    # per-loss paths (its layer's or its region's scale over the loss's).
    level = backward_level(loss_scale, factor)
    grads = _backward(kind, dims, out_dtype, (lhs, rhs, ql, qr, state, ml, mr), level, g)
    ls_cotangent = None if loss_scale is None else jnp.zeros_like(loss_scale)
    factor_cotangent = None if factor is None else jnp.zeros_like(factor)
    return (*grads, ls_cotangent, factor_cotangent)


@functools.partial(jax.jit, static_argnums=(0, 1, 2), inline=True)
def _backward(
    kind: Fp8, dims: Dims, out_dtype: Any, residuals: Any, level: Any, g: jax.Array
) -> tuple[jax.Array, jax.Array, DotState]:
    lhs, rhs, ql, qr, state, ml, mr = residuals
    recipe = kind.recipe
    acc = _acc_dtype(kind, out_dtype)
    grad_state = state.grad
    rescaled = getattr(recipe, "rescaled", None)
    if level is not None and rescaled is not None:
        grad_state = rescaled(grad_state, level)
    if recipe.requantize_backward:
        # Block scales follow the contraction: quantize again along the backward dots' axes.
        _, g_axes_l, rhs_axes, _ = _transpose_dims(lhs.ndim, rhs.ndim, dims, True)
        _, g_axes_r, lhs_axes, _ = _transpose_dims(rhs.ndim, lhs.ndim, dims, False)
        qg_l, mg_l = _quantize(recipe, g, grad_state, "grad", g_axes_l, "dgrad")
        qg_r, mg_r = _quantize(recipe, g, grad_state, "grad", g_axes_r, "wgrad")
        qr, _ = _quantize(recipe, rhs, state.rhs, "rhs", tuple(rhs_axes), "dgrad")
        ql, _ = _quantize(recipe, lhs, state.lhs, "lhs", tuple(lhs_axes), "wgrad")
        mg = mg_l.combine(mg_r)
    else:
        qg_l, mg = recipe.quantize(g, grad_state, "grad", ())
        qg_r = qg_l
    if level is not None:
        mg = dataclasses.replace(mg, amax=mg.amax / level)
    first = _dequantize_first(kind)
    # The arithmetic in the operands' dtype is Flax's (jdls.fp8.flax_fp8_ops): its graph too.
    flax = recipe.compute_dtype is None
    grad_lhs = _grad_of(qg_l, qr, lhs, dims, True, acc, first, flax).astype(lhs.dtype)
    grad_rhs = _grad_of(qg_r, ql, rhs, dims, False, acc, first, flax)
    if getattr(recipe, "measures_error", False):
        mg = dataclasses.replace(mg, error=_wgrad_error(grad_rhs, g, lhs, rhs, dims, acc))
    grad_rhs = grad_rhs.astype(rhs.dtype)
    meter = Meter(lhs=ml, rhs=mr, grad=mg)
    uses = _one_like(meter)
    zeros = jax.tree.map(jnp.zeros_like, state)
    # Inside shard_map, an operand the device did not vary over (replicated weights) gets the
    # sum of the devices' gradients, as JAX's own transpose gives it; a measurement the maximum.
    # typed as the meter it is the cotangent of (a constant field, such as an unmeasured
    # error, varies over the state's axes too)
    meter = jax.tree.map(lambda m, s: vary_like(_max_like(m, s), s), meter, state.meter)
    uses = _max_like(uses, state.uses)
    grad_lhs, grad_rhs = sum_like(grad_lhs, lhs), sum_like(grad_rhs, rhs)
    return grad_lhs, grad_rhs, dataclasses.replace(zeros, meter=meter, uses=uses)


def _quantize(
    recipe: Any, x: jax.Array, state: Any, role: str, axes: tuple[int, ...], gemm: str
) -> tuple[Quantized, Any]:
    """``x`` quantized for one of the three dots (``"fprop"``, ``"dgrad"``, ``"wgrad"``): a
    recipe whose dots differ (NVFP4's transform and random bits) has ``quantize_gemm``."""
    by_gemm = getattr(recipe, "quantize_gemm", None)
    if by_gemm is not None:
        return by_gemm(x, state, role, axes, gemm)
    return recipe.quantize(x, state, role, axes)


def _wgrad_error(
    grad_rhs: jax.Array, g: jax.Array, lhs: jax.Array, rhs: jax.Array, dims: Dims, acc: Any
) -> jax.Array:
    """The weight gradient's relative L2 error: ``|dW - dW_exact| / |dW_exact|``, where
    ``dW_exact`` is the same dot of the unquantized operands (0 when it is zero)."""
    one = jnp.ones((), jnp.float32)
    exact_g, exact_lhs = Quantized(g.astype(acc), one), Quantized(lhs.astype(acc), one)
    exact = _grad_of(exact_g, exact_lhs, rhs, dims, False, acc, False).astype(jnp.float32)
    diff = jnp.sum(jnp.square(grad_rhs.astype(jnp.float32) - exact))
    norm = jnp.sum(jnp.square(exact))
    return jnp.where(norm > 0, jnp.sqrt(diff / jnp.where(norm > 0, norm, 1.0)), 0.0)


def _one_like(meter: Meter) -> jax.Array:
    """1.0: this use of the site. JAX sums the cotangents of a site used several times, so
    the sum counts the uses. It is computed from the measurement so that it is batched (under
    ``vmap``) and device-varying (inside ``shard_map``) exactly as the measurement is: an
    unbatched site under ``vmap`` gets both summed over the batch (``jnp.ones_like`` would be
    a constant, never summed)."""
    x = meter.lhs.amax + meter.rhs.amax + meter.grad.amax
    return jnp.where(jnp.isnan(x), 1.0, 1.0).astype(jnp.float32)


def _max_like(x: jax.Array, like: jax.Array) -> jax.Array:
    """``x`` maximised over the manual axes it varies over and ``like`` does not."""
    extra = tuple(sorted(varying_axes(x) - varying_axes(like), key=str))
    return lax.pmax(x, extra) if extra else x


_fp8_dot.defvjp(_fp8_dot_fwd, _fp8_dot_bwd)


def _normalize_dims(dimension_numbers: Any) -> Dims:
    (lc, rc), (lb, rb) = dimension_numbers
    return ((tuple(lc), tuple(rc)), (tuple(lb), tuple(rb)))


def dot_general(
    lhs: Any,
    rhs: Any,
    dimension_numbers: Any,
    precision: Any = None,
    preferred_element_type: Any = None,
    *,
    site: Site,
    out_sharding: Any = None,
) -> jax.Array:
    """``lax.dot_general`` computed in FP8 with the scales of ``state``.

    Both operands are quantized by ``state.recipe`` (e4m3 by default), multiplied with
    float32 accumulation and dequantized. In the backward pass the output gradient is
    quantized (e5m2 by default) and both operand gradients are FP8 dots. An inf or NaN at
    any quantize point reaches the output or the gradients (it is never clipped to a finite
    value), so ``jdls.wrap`` skips the step. The gradient with respect to ``site`` is the
    step's measurement: ``jdls.update_sites`` (or a framework's train step) turns it into the
    next step's scales.

    Args:
      lhs: the left operand, as for ``jax.lax.dot_general``.
      rhs: the right operand.
      dimension_numbers: as for ``jax.lax.dot_general``.
      precision: the forward dot's precision (the backward dots use ``HIGHEST``).
      preferred_element_type: the output dtype.
      out_sharding: the forward dot's output sharding, as for ``jax.lax.dot_general``.
      site: the dot's FP8 site (from :func:`jdls.fp8.init`), one site (inside a scan over
        layers, this layer's slice of the stacked sites).

    Returns:
      The dot, of dtype ``preferred_element_type`` (default: the operands' result type).

    Example:
      >>> import jax.numpy as jnp, jdls
      >>> site = jdls.fp8.init(jdls.fp8.CurrentScaling())
      >>> x, w = jnp.array([[1.0, 2.0]]), jnp.array([[3.0], [0.1]])
      >>> y = jdls.fp8.dot_general(x, w, (((1,), (0,)), ((), ())), site=site)
      >>> round(float(y[0, 0]), 4)  # 0.1 is not an e4m3 value: the exact dot is 3.2
      3.2009
    """
    if not (isinstance(site, Site) and isinstance(site.kind, Fp8)):
        raise TypeError(
            f"site must be an FP8 site (make one with jdls.fp8.init(recipe)), got "
            f"{type(site).__name__}"
            + (f" of kind {type(site.kind).__name__}" if isinstance(site, Site) else "")
        )
    if jnp.ndim(site.value.meter.lhs.amax) != 0:
        raise ValueError(
            "dot_general got a stack of FP8 sites: pass one site, e.g. the slice lax.scan "
            "gives each iteration (scan over the stacked sites with the stacked parameters)"
        )
    lhs, rhs = jnp.asarray(lhs), jnp.asarray(rhs)
    out_dtype = (
        jnp.result_type(lhs, rhs)
        if preferred_element_type is None
        else jnp.dtype(preferred_element_type)
    )
    dims = _normalize_dims(dimension_numbers)
    # within jdls's value_and_grad: what g is scaled by (the loss's scale, times the
    # factor the per-layer and per-loss paths told the site; jdls/_sites/backward_scale.py)
    loss_scale, factor = current_loss_scale(), site_factor(site)
    lhs, rhs = watched("an FP8 site", [lhs, rhs], site.value)
    return _fp8_dot(
        lhs,
        rhs,
        site.value,
        loss_scale,
        factor,
        site.kind,
        dims,
        precision,
        out_dtype,
        out_sharding,
    )
