"""Block-scaled dot products: MX and DeepSeek-V3 recipes, a custom VJP that requantizes.

A :class:`BlockScaling` recipe says how each operand of a dot is cut into blocks:
activations (``lhs``) and output gradients in 1-D blocks of ``block`` values along the axis
the dot contracts, weights (``rhs``) either the same way (``weight_block`` an int, MX) or in
fixed 2-D tiles (``weight_block=(128, 128)``, DeepSeek-V3), each block with its own
power-of-two scale (``jdls.fp8._block``). Scaling is current: each step's scales come from
that step's values, there is no history.

:func:`block_dot_general` is ``lax.dot_general`` on the dequantized operands with float32
accumulation. Its VJP quantizes again, from the saved high-precision operands, along the
contraction axes of the two backward dots (a block of a row is not a block of a column), as
MX and DeepSeek-V3 hardware recipes do:

- ``dlhs = g @ rhs.T`` contracts the rhs's free axes: ``g`` and ``rhs`` are blocked along them;
- ``drhs = lhs.T @ g`` contracts the lhs's free axes: ``lhs`` and ``g`` are blocked along them.

A 2-D weight tile is a tile of the transposed weight too, so DeepSeek-V3 weights quantize the
same way in all three dots. A non-finite value gives its block the NaN scale, so it reaches
the output and the gradients as NaN and a finiteness check skips the step.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
from flax import struct
from jax import lax

from jdls.fp8._block import (
    dequantize_blocks,
    element_format,
    quantize_and_measure,
    quantize_blocks,
)
from jdls.fp8._e8m0 import ROUNDINGS
from jdls.fp8._recipe import Measurement, Quantized, Role, check_role

__all__ = ["BlockScaling", "BlockState", "block_dot_general", "deepseek", "mx"]

DimensionNumbers = tuple[tuple[tuple[int, ...], tuple[int, ...]], tuple[tuple[int, ...], ...]]


@struct.dataclass
class BlockState:
    """The (empty) state of one tensor under block scaling: its scales are current."""


@dataclasses.dataclass(frozen=True)
class BlockScaling:
    """A block-scaled FP8 recipe: block shapes, element formats and the exponent's rounding.

    Configuration only (frozen, hashable, static under ``jax.jit``); block scaling keeps no
    state between steps. It is a ``jdls.fp8`` recipe: give it to ``jdls.fp8.init`` (or a
    linen / NNX / Equinox FP8 layer) in place of a per-tensor recipe, nothing else changes.
    Its :class:`jdls.fp8.Measurement` reports ``saturated`` as the fraction of *blocks* whose
    largest value was clipped and ``flushed`` as the fraction of values flushed to zero.

    Args:
      block: length of the 1-D blocks of activations and output gradients along the axis each
        dot contracts (32 for MX, 128 for DeepSeek-V3's 1x128 tiles).
      weight_block: an int for 1-D weight blocks along each dot's contraction axis (MX), or
        a square tile ``(n, n)``, the same tiles in the forward and both backward dots
        (DeepSeek-V3: ``(128, 128)``).
      forward: element format of activations and weights (``jdls.fp8._block``).
      backward: element format of the output gradient.
      rounding: the shared exponent's rule: ``"up"``, ``"down"`` or ``"outlier_aware"``.

    Example:
      >>> import jdls.fp8._block_dot as bd
      >>> bd.mx("e4m3", rounding="down")
      BlockScaling(block=32, weight_block=32, forward='e4m3', backward='e4m3', rounding='down')
    """

    block: int = 32
    weight_block: int | tuple[int, int] = 32
    forward: str = "e4m3"
    backward: str = "e4m3"
    rounding: str = "up"

    def __post_init__(self) -> None:
        object.__setattr__(self, "forward", element_format(self.forward).name)
        object.__setattr__(self, "backward", element_format(self.backward).name)
        if self.rounding not in ROUNDINGS:
            raise ValueError(
                f"rounding must be one of {ROUNDINGS} (how the shared exponent is rounded), "
                f"got {self.rounding!r}"
            )
        given = self.weight_block
        wb: Any = tuple(int(v) for v in given) if isinstance(given, (tuple, list)) else int(given)
        object.__setattr__(self, "weight_block", wb)
        sizes = [self.block, *(wb if isinstance(wb, tuple) else (wb,))]
        if not all(isinstance(v, int) and v >= 1 for v in sizes) or (
            isinstance(wb, tuple) and (len(wb) != 2 or wb[0] != wb[1])
        ):
            raise ValueError(
                f"block must be a positive int and weight_block a positive int (1-D blocks) or "
                f"a square tile (n, n), got block={self.block!r}, "
                f"weight_block={self.weight_block!r}"
            )

    # -- The jdls.fp8 recipe protocol (jdls/fp8/_recipe.py). ---------------------------------

    @property
    def compute_dtype(self) -> Any:
        """The dot dequantizes the blocks and accumulates in float32."""
        return jnp.dtype(jnp.float32)

    @property
    def requantize_backward(self) -> bool:
        """The backward dots quantize again along their own contraction axes."""
        return True

    def init(self, role: Role) -> BlockState:
        check_role(role)
        return BlockState()

    def block_shape(
        self, shape: tuple[int, ...], role: Role, axes: tuple[int, ...]
    ) -> tuple[int, ...]:
        """The block of a tensor of ``shape`` in ``role`` whose ``axes`` a dot contracts.

        ``block`` values along the last contracted axis (a 1-D block; several contracted axes:
        along the last one), or for a weight (``"rhs"``) with a 2-D ``weight_block``, a tile of
        ``weight_block`` along the last contracted axis and the last other axis.

        Example:
          >>> import jdls
          >>> jdls.fp8.deepseek().block_shape((256, 512), "rhs", (0,))
          (128, 128)
          >>> jdls.fp8.mx().block_shape((8, 64), "grad", (0,))  # dw contracts the tokens
          (32, 1)
        """
        block = [1] * len(shape)
        if not shape:
            return tuple(block)
        along = axes[-1] if axes else len(shape) - 1
        wb = self.weight_block
        if role != "rhs":
            block[along] = self.block
        elif isinstance(wb, tuple):
            block[along] = wb[0]
            others = [d for d in range(len(shape)) if d not in axes]
            if others:
                block[others[-1]] = wb[1]
        else:
            block[along] = wb
        return tuple(block)

    def quantize(
        self, x: jax.Array, state: BlockState, role: Role, axes: tuple[int, ...] = ()
    ) -> tuple[Quantized, Measurement]:
        """``x`` in blocks along the contracted ``axes``, with one power-of-two scale each.

        ``Quantized.values`` are the dequantized values, exact in float32 (``values * 2**e``
        computed on bit patterns, so a block whose scale is ``2**-127``, below float32's
        normal range, keeps its values), and ``scale`` is 1: the dot multiplies the values
        as the hardware's block-scaled dot does. A block holding inf or NaN dequantizes to
        NaN.
        """
        del state
        fmt = self.backward if role == "grad" else self.forward
        shape = self.block_shape(x.shape, role, tuple(axes))
        q, stats = quantize_and_measure(x, shape, fmt, self.rounding)
        measurement = Measurement(
            amax=stats["amax"], saturated=stats["clipped"], flushed=stats["flushed"]
        )
        values = dequantize_blocks(q)
        return Quantized(values=values, scale=jnp.ones((), jnp.float32)), measurement

    def update(
        self, state: BlockState, measurement: Measurement, role: Role, skipped: Any = False
    ) -> BlockState:
        del measurement, role, skipped
        return state


def mx(fmt: str = "e4m3", rounding: str = "up", backward: str | None = None) -> BlockScaling:
    """The OCP MX recipe: 32-element blocks along each contraction axis, E8M0 scales.

    Args:
      fmt: element format: ``"e4m3"`` (MXFP8, default), ``"e5m2"``, ``"e2m3"``, ``"e3m2"``
        (MXFP6) or ``"e2m1"`` (MXFP4).
      rounding: ``"up"`` (default, NVIDIA), ``"down"`` (the OCP spec) or ``"outlier_aware"``.
      backward: element format of the output gradient; defaults to ``fmt``.

    Example:
      >>> import jdls.fp8._block_dot as bd
      >>> bd.mx("e2m1").block
      32
    """
    return BlockScaling(32, 32, fmt, backward or fmt, rounding)


def deepseek(rounding: str = "up") -> BlockScaling:
    """DeepSeek's fine-grained FP8: 1x128 activation and gradient tiles, 128x128 weight
    blocks, e4m3 everywhere, power-of-two (E8M0) scales, rounded up by default.

    The tiles are DeepSeek-V3's. Its released inference code scales each tile by
    ``amax / 448``, a float32 scale that is not a power of two; DeepSeek-V3.1 moved to the
    UE8M0 scale format, powers of two, as here (and as TransformerEngine's
    ``Float8BlockScaling``).

    References:
      DeepSeek-AI, "DeepSeek-V3 Technical Report", arXiv 2412.19437, section 3.3;
      ``deepseek-ai/DeepSeek-V3`` ``inference/kernel.py`` (``act_quant``); the DeepSeek-V3.1
      release (2025-08-21, "UE8M0 FP8 scale data format").

    Example:
      >>> import jdls.fp8._block_dot as bd
      >>> bd.deepseek().weight_block
      (128, 128)
    """
    return BlockScaling(128, (128, 128), "e4m3", "e4m3", rounding)


def _qd(x: jax.Array, block_shape: tuple[int, ...], fmt: str, rounding: str) -> jax.Array:
    """Quantize then dequantize: the float32 values the hardware dot would multiply."""
    return dequantize_blocks(quantize_blocks(x, block_shape, fmt, rounding))


def _weight_tile(recipe: BlockScaling, along_contraction: bool) -> tuple[int, int, int]:
    """The rhs's block in its canonical ``(B, K, N)`` layout."""
    wb = recipe.weight_block
    if isinstance(wb, tuple):
        return (1, wb[0], wb[1])
    return (1, wb, 1) if along_contraction else (1, 1, wb)


def _dot(a: jax.Array, b: jax.Array, contract: tuple[int, int]) -> jax.Array:
    """A batched dot of dequantized operands, accumulated in float32.

    The operands go in as bfloat16, which holds every dequantized value exactly (at most three
    mantissa bits times a power of two; values below ``2**-126`` are already zero), as
    ``jax.lax.scaled_dot`` does: the results are the same bit for bit.
    """
    dn = (((contract[0],), (contract[1],)), ((0,), (0,)))
    return lax.dot_general(
        a.astype(jnp.bfloat16),
        b.astype(jnp.bfloat16),
        dn,
        precision=lax.Precision.HIGHEST,
        preferred_element_type=jnp.float32,
    )


def _canonical(shape_l, shape_r, dn: DimensionNumbers):
    (lc, rc), (lb, rb) = dn
    lf = tuple(d for d in range(len(shape_l)) if d not in lc and d not in lb)
    rf = tuple(d for d in range(len(shape_r)) if d not in rc and d not in rb)
    size = lambda shape, dims: math.prod(shape[d] for d in dims)  # noqa: E731
    perm_l, perm_r = tuple(lb) + lf + tuple(lc), tuple(rb) + tuple(rc) + rf
    b, m, k, n = size(shape_l, lb), size(shape_l, lf), size(shape_l, lc), size(shape_r, rf)
    out = tuple(shape_l[d] for d in lb) + tuple(shape_l[d] for d in lf)
    out += tuple(shape_r[d] for d in rf)
    return perm_l, perm_r, (b, m, k), (b, k, n), out


def _to3(x: jax.Array, perm: tuple[int, ...], shape3: tuple[int, int, int]) -> jax.Array:
    return jnp.transpose(x, perm).reshape(shape3)


def _from3(x3: jax.Array, perm: tuple[int, ...], shape: tuple[int, ...]) -> jax.Array:
    permuted = tuple(shape[d] for d in perm)
    inverse = tuple(sorted(range(len(perm)), key=lambda i: perm[i]))
    return jnp.transpose(x3.reshape(permuted), inverse)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _block_dot(recipe: BlockScaling, dn: DimensionNumbers, out_dtype: Any, lhs, rhs):
    y, _ = _block_dot_fwd(recipe, dn, out_dtype, lhs, rhs)
    return y


# The rules are compiled as one program each, also when called eagerly: op by op, one dot's
# value and gradients lowered 637 small programs (18.7 s the first time on a 2-core CPU,
# 1.4 s as two). Inside a user's jit they are inlined (``inline=True``): the program is the
# operations', with no inner call.
@functools.partial(jax.jit, static_argnums=(0, 1, 2), inline=True)
def _block_dot_fwd(recipe: BlockScaling, dn: DimensionNumbers, out_dtype: Any, lhs, rhs):
    perm_l, perm_r, s_l, s_r, out = _canonical(lhs.shape, rhs.shape, dn)
    l3 = _to3(lhs.astype(jnp.float32), perm_l, s_l)
    r3 = _to3(rhs.astype(jnp.float32), perm_r, s_r)
    x = _qd(l3, (1, 1, recipe.block), recipe.forward, recipe.rounding)
    w = _qd(r3, _weight_tile(recipe, True), recipe.forward, recipe.rounding)
    y = _dot(x, w, (2, 1)).reshape(out).astype(out_dtype)
    return y, (l3, r3, lhs, rhs)


@functools.partial(jax.jit, static_argnums=(0, 1, 2), inline=True)
def _block_dot_bwd(recipe: BlockScaling, dn: DimensionNumbers, out_dtype: Any, res, g):
    l3, r3, lhs, rhs = res
    perm_l, perm_r, s_l, s_r, _ = _canonical(lhs.shape, rhs.shape, dn)
    b, m, _ = s_l
    g3 = g.astype(jnp.float32).reshape(b, m, s_r[2])
    fwd, bwd, rule, n = recipe.forward, recipe.backward, recipe.rounding, recipe.block
    # dlhs = g @ rhs^T contracts N: g and rhs in blocks along N.
    g_n = _qd(g3, (1, 1, n), bwd, rule)
    w_n = _qd(r3, _weight_tile(recipe, False), fwd, rule)
    dl3 = _dot(g_n, w_n, (2, 2))
    # drhs = lhs^T @ g contracts M: lhs and g in blocks along M.
    x_m = _qd(l3, (1, n, 1), fwd, rule)
    g_m = _qd(g3, (1, n, 1), bwd, rule)
    dr3 = _dot(x_m, g_m, (1, 1))
    dlhs = _from3(dl3, perm_l, lhs.shape).astype(lhs.dtype)
    drhs = _from3(dr3, perm_r, rhs.shape).astype(rhs.dtype)
    return dlhs, drhs


_block_dot.defvjp(_block_dot_fwd, _block_dot_bwd)


def block_dot_general(
    lhs: jax.Array,
    rhs: jax.Array,
    dimension_numbers: DimensionNumbers,
    recipe: BlockScaling | None = None,
    preferred_element_type: Any = None,
) -> jax.Array:
    """``lax.dot_general`` with block-scaled FP8 operands and float32 accumulation.

    ``lhs`` is the activation, ``rhs`` the weight. Multiple contracting (or free) axes are
    flattened, in the order given, into one axis that the blocks follow.

    Args:
      lhs: activations, float32, bfloat16 or float16.
      rhs: weights.
      dimension_numbers: as ``lax.dot_general``.
      recipe: a :class:`BlockScaling` (default: :func:`mx`, MXFP8 with rounding up).
      preferred_element_type: the output dtype; default: the operands' result type.

    Returns:
      The product, with gradients from the requantized backward dots (module docstring).

    Example:
      >>> import jax, jax.numpy as jnp
      >>> import jdls.fp8._block_dot as bd
      >>> x, w = jnp.ones((4, 64)), jnp.full((64, 8), 0.5)
      >>> dn = (((1,), (0,)), ((), ()))
      >>> float(jax.jit(lambda x, w: bd.block_dot_general(x, w, dn))(x, w)[0, 0])
      32.0
      >>> loss = lambda x: bd.block_dot_general(x, w, dn, bd.deepseek()).sum()
      >>> dx = jax.jit(jax.grad(loss))(x)
      >>> float(dx[0, 0])
      4.0
    """
    recipe = mx() if recipe is None else recipe
    (lc, rc), (lb, rb) = dimension_numbers
    dn = ((tuple(lc), tuple(rc)), (tuple(lb), tuple(rb)))
    out_dtype = jnp.dtype(preferred_element_type or jnp.result_type(lhs, rhs))
    return _block_dot(recipe, dn, out_dtype, jnp.asarray(lhs), jnp.asarray(rhs))
