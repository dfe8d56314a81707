"""NVFP4 quantization: E2M1 values, one E4M3 scale per block of 16, one float32 scale per tensor.

The arithmetic is TransformerEngine's CUDA kernel, step by step, in float32 with round to
nearest even (NVIDIA, "Pretraining Large Language Models with NVFP4", arXiv 2509.25149,
App. B; TransformerEngine ``common/cast/nvfp4/core_nvfp4.cuh``):

1. the tensor amax ``A`` (of the finite values);
2. ``S_enc = 2688 / A`` (``2688 = 6 * 448``), at most ``FLT_MAX``, and 1 when ``A`` is 0;
   ``S_dec = 1 / S_enc``;
3. per block, ``s_b = e4m3(amax_b * (S_enc * fp32(1/6)))``, rounded to nearest even after a
   clamp to 448: the stored scale. The order of the products decides the byte at E4M3
   rounding midpoints (``amax_b / 6 * S_enc`` gives another byte there);
4. ``e_b = min(1 / (s_b * S_dec), FLT_MAX)`` and ``q = e2m1(clamp(x * e_b, -6, 6))``,
   rounded to nearest even, or stochastically given random bits;
5. the value is ``q * s_b * S_dec``.

Two departures from TransformerEngine, both deliberate:

- **Non-finite blocks.** A block holding an inf or NaN gets the E4M3 NaN scale (byte
  ``0x7F``) and dequantizes to NaN, and the tensor amax is taken over the finite values.
  TransformerEngine's ``fmaxf`` drops a NaN and its saturating cast turns it into ``+6``, a
  finite value: here it reaches the gradients and ``jdls.wrap`` skips the step.
- **Subnormals** are flushed: a float32 subnormal input reads as zero and every operation
  whose float32 result is subnormal gives zero (as XLA on CPU computes, and GPUs built with
  flush-to-zero). jdls applies it explicitly, so every backend gives the same bytes. A tensor
  whose amax is below ``2688 * 2**-126`` (about ``3.2e-35``) therefore quantizes to zeros.

The E4M3 scale is rounded and decoded with integer operations on its bits, and the E2M1
rounding is arithmetic on exact float32 values, so a compiler cannot remove a round trip
through a narrow dtype (TransformerEngine's pure-JAX quantizer reports XLA removing one).

:func:`hadamard` is the random Hadamard transform of the weight-gradient dot's inputs:
``(v * s) @ H16 / 4`` on each 16 values along an axis, by the in-order butterfly.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jdls.fp8._block import blocked, check_blocks, expand_blocks, split_axis, unblocked

__all__ = [
    "BLOCK",
    "TE_SIGNS",
    "NVFP4Array",
    "checked_signs",
    "dequantize_nvfp4",
    "hadamard",
    "quantize_nvfp4",
    "quantize_parts",
]

#: Values per block of activations and gradients (and the side of a weight tile).
BLOCK = 16
#: TransformerEngine's fixed sign vector of the random Hadamard transform
#: (``transformer_engine/jax/quantize/hadamard.py``), used by every layer in every step.
TE_SIGNS = (1, 1, 1, -1, 1, -1, -1, -1, -1, -1, -1, 1, -1, 1, -1, -1)

E2M1_MAX = 6.0
E4M3_MAX = 448.0
NAN_SCALE = 0x7F
_FLT_MAX = np.float32(np.finfo(np.float32).max)
_SIXTH = np.float32(1.0 / 6.0)
_ENCODE = np.float32(E2M1_MAX * E4M3_MAX)  # 2688
_SIGN = 0x80000000
_EXPONENT = 0x7F800000
_ABS = 0x7FFFFFFF


def _bits(x: jax.Array) -> jax.Array:
    return lax.bitcast_convert_type(x, jnp.uint32)


def _float(b: jax.Array) -> jax.Array:
    return lax.bitcast_convert_type(b, jnp.float32)


def ftz(x: jax.Array) -> jax.Array:
    """float32 ``x`` with subnormals replaced by zeros of the same sign (exact, bit ops)."""
    b = _bits(x.astype(jnp.float32))
    return _float(jnp.where((b & jnp.uint32(_EXPONENT)) == 0, b & jnp.uint32(_SIGN), b))


def e4m3_code(v: jax.Array) -> jax.Array:
    """The float8_e4m3fn byte (uint8) of float32 ``v`` in ``[0, 448]``, round to nearest even.

    Integer arithmetic on the float32 bits for normal E4M3 values; below ``2**-6`` the value
    times ``2**9`` (exact) rounded to an integer is the subnormal code.
    """
    b = _bits(v)
    normal = b >= jnp.uint32(121 << 23)  # 2**-6 and up
    half = jnp.uint32((1 << 19) - 1) + ((b >> 20) & jnp.uint32(1))
    code_normal = ((b + half) >> 20) - jnp.uint32((127 - 7) << 3)
    code_sub = jnp.round(v * np.float32(512.0)).astype(jnp.uint32)
    return jnp.where(normal, code_normal, code_sub).astype(jnp.uint8)


def e4m3_value(code: jax.Array) -> jax.Array:
    """The float32 value of float8_e4m3fn bytes (no sign bit; ``0x7F`` is NaN)."""
    c = code.astype(jnp.uint32)
    exponent, mantissa = c >> 3, c & jnp.uint32(7)
    normal = _float(((exponent + jnp.uint32(120)) << 23) | (mantissa << 20))
    sub = mantissa.astype(jnp.float32) * np.float32(2.0**-9)
    value = jnp.where(exponent > 0, normal, sub)
    return jnp.where(c == NAN_SCALE, jnp.nan, value)


def _grid_step(a: jax.Array) -> jax.Array:
    """The spacing of the E2M1 grid at magnitude ``a`` in ``[0, 6]``: 0.5, 1 or 2."""
    return jnp.where(a < 2.0, np.float32(0.5), jnp.where(a < 4.0, np.float32(1.0), np.float32(2.0)))


def round_e2m1(y: jax.Array, bits: jax.Array | None = None) -> jax.Array:
    """float32 ``y`` clamped to ``[-6, 6]`` and rounded onto the E2M1 grid, as float32.

    Without ``bits``: to nearest, ties to even (as ``float4_e2m1fn`` casts). With ``bits``
    (uint32, ``y``'s shape): stochastically, up to the next grid value with probability
    ``frac``, the distance from the value below in grid steps, when
    ``u = (bits >> 8) * 2**-24 < frac``. The sign (and a zero's sign) is kept.
    """
    a = jnp.minimum(jnp.abs(y), np.float32(E2M1_MAX))  # NaN stays NaN; inf clamps to 6
    step = _grid_step(a)
    if bits is None:
        q = jnp.round(a / step) * step
    else:
        u = (bits >> 8).astype(jnp.float32) * np.float32(2.0**-24)
        low = jnp.floor(a / step) * step
        q = low + jnp.where(u < (a - low) / step, step, np.float32(0.0))
    return jnp.copysign(q, y)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class NVFP4Array:
    """An NVFP4 tensor: E2M1 values, E4M3 block scales and the float32 tensor scale.

    Attributes:
      values: ``float4_e2m1fn``, the shape of the quantized array.
      codes: uint8, the E4M3 byte of each block's scale (``0x7F``, NaN, for a block that held
        an inf or NaN), ``ceil(n / b)`` along each axis.
      amax: float32 scalar, the tensor amax the scales were computed from.
      decode: float32 scalar, ``S_dec = 1 / S_enc``.
      block_shape: the block length along each axis (static).
    """

    values: jax.Array
    codes: jax.Array
    amax: jax.Array
    decode: jax.Array
    block_shape: tuple[int, ...] = dataclasses.field(metadata=dict(static=True))

    @property
    def scales(self) -> jax.Array:
        """The block scales as ``float8_e4m3fn``."""
        return lax.bitcast_convert_type(self.codes, jnp.float8_e4m3fn)

    @property
    def scales_float32(self) -> jax.Array:
        """The block scales in float32 (NaN for a non-finite block)."""
        return e4m3_value(self.codes)


@dataclasses.dataclass(frozen=True)
class Parts:
    """What :func:`quantize_parts` computes, blocked as ``jdls.fp8._block.blocked`` lays out."""

    q: jax.Array  # float32 E2M1 values, blocked
    codes: jax.Array  # uint8, one per block
    amax: jax.Array  # the tensor amax used
    decode: jax.Array  # S_dec
    dequantized: jax.Array  # float32, blocked, NaN in non-finite blocks
    clipped: jax.Array  # bool, blocked: |x * e_b| > 6 for a finite value
    flushed: jax.Array  # bool, blocked: a non-zero finite value that dequantized to zero
    nonfinite: jax.Array  # bool, blocked (x is inf or NaN)


def _abs_bits(xb: jax.Array) -> jax.Array:
    return _bits(xb) & jnp.uint32(_ABS)


def _encode_scale(amax: jax.Array) -> jax.Array:
    """``S_enc = min(2688 / A, FLT_MAX)``, 1 where ``A`` is 0 (or the quotient is)."""
    s = jnp.minimum(ftz(_ENCODE / amax), _FLT_MAX)
    return jnp.where((amax == 0) | (s == 0), np.float32(1.0), s)


def quantize_parts(
    x: jax.Array,
    block_shape: tuple[int, ...],
    bits: jax.Array | None = None,
    amax: jax.Array | None = None,
) -> Parts:
    """The NVFP4 quantization of ``x`` (module docstring), blocked, with what it did.

    ``bits`` are the random bits of stochastic rounding, blocked like ``x``; ``amax``
    replaces the tensor amax (e.g. one reduced over devices).
    """
    return Parts(*_parts(x, block_shape, bits, amax))


# Compiled as one program, also when called eagerly: op by op quantize_nvfp4 lowered 73 small
# programs (2.2 s the first time on a 2-core CPU, 0.35 s as one). Inside a user's jit it is
# inlined (``inline=True``): the program is the operations'.
@functools.partial(jax.jit, static_argnums=(1,), inline=True)
def _parts(
    x: jax.Array, block_shape: tuple[int, ...], bits: jax.Array | None, amax: jax.Array | None
) -> tuple[jax.Array, ...]:
    xb = ftz(blocked(x.astype(jnp.float32), block_shape))
    inner = tuple(range(1, xb.ndim, 2))
    mag = _abs_bits(xb)
    nonfinite = mag >= jnp.uint32(_EXPONENT)
    finite_mag = jnp.where(nonfinite, jnp.uint32(0), mag)
    amax_b = _float(jnp.max(finite_mag, axis=inner)) if xb.size else jnp.zeros((), jnp.float32)
    bad = jnp.max(nonfinite, axis=inner) if xb.size else jnp.zeros((), bool)
    if amax is None:
        tensor_amax = jnp.max(amax_b) if amax_b.size else jnp.float32(0.0)
    else:
        tensor_amax = ftz(jnp.asarray(amax, jnp.float32))
    s_enc = _encode_scale(tensor_amax)
    s_dec = ftz(np.float32(1.0) / s_enc)
    per_block = ftz(amax_b * ftz(s_enc * _SIXTH))
    codes = e4m3_code(jnp.minimum(per_block, np.float32(E4M3_MAX)))
    codes = jnp.where(bad, jnp.uint8(NAN_SCALE), codes)
    s_b = e4m3_value(codes)
    e_b = jnp.minimum(np.float32(1.0) / ftz(s_b * s_dec), _FLT_MAX)
    y = ftz(xb * expand_blocks(e_b))
    q = round_e2m1(y, bits)
    bad_b = expand_blocks(bad)
    q = jnp.where(bad_b, np.float32(0.0), q)
    dequantized = ftz((q * expand_blocks(s_b)) * s_dec)
    dequantized = jnp.where(bad_b, jnp.nan, dequantized)
    finite = ~nonfinite
    clipped = finite & ~bad_b & (jnp.abs(y) > np.float32(E2M1_MAX))
    flushed = finite & (mag != 0) & (dequantized == 0)
    return q, codes, tensor_amax, s_dec, dequantized, clipped, flushed, nonfinite


def _check_bits(bits: Any, shape: tuple[int, ...]) -> jax.Array:
    bits = jnp.asarray(bits)
    if bits.shape != shape or bits.dtype != jnp.uint32:
        raise ValueError(
            f"bits must be uint32 random bits of x's shape {shape} (one word per value, e.g. "
            f"jax.random.bits(key, x.shape)), got {bits.dtype}{list(bits.shape)}"
        )
    return bits


def quantize_nvfp4(
    x: jax.Array,
    block_shape: tuple[int, ...] | None = None,
    *,
    bits: jax.Array | None = None,
    amax: jax.Array | float | None = None,
) -> NVFP4Array:
    """Quantizes ``x`` to NVFP4, exactly as TransformerEngine's kernel (module docstring).

    Args:
      x: a float array (float32, bfloat16 or float16, read exactly as float32).
      block_shape: the block along each axis; default ``(1, ..., 1, 16)``, 16 values along the
        last axis. ``(16, 16)`` gives the 2-D weight tiles. Axes that are not a multiple are
        zero-padded at the end (zeros never change an amax).
      bits: uint32 random bits of ``x``'s shape for stochastic rounding (default: round to
        nearest even).
      amax: the tensor amax to scale with (default: ``x``'s, over its finite values).

    Returns:
      An :class:`NVFP4Array`.

    Example:
      >>> import jax.numpy as jnp, jdls
      >>> q = jdls.fp8.quantize_nvfp4(jnp.array([[1.0, -3.0, 0.2, 6.5] * 4]))
      >>> q.codes.tolist(), float(q.amax)  # scale byte 126 is 448: the amax maps to 6
      ([[126]], 6.5)
      >>> jdls.fp8.dequantize_nvfp4(q)[0, :4].tolist()
      [1.0833333730697632, -3.25, 0.0, 6.5]
    """
    x = jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(f"quantize_nvfp4 takes a float array, got {x.dtype}")
    if block_shape is None:
        block_shape = (1,) * (x.ndim - 1) + (BLOCK,) if x.ndim else ()
    block_shape = check_blocks(x.shape, block_shape)
    if bits is not None:
        bits = blocked(_check_bits(bits, x.shape), block_shape)
    if isinstance(amax, (int, float, np.floating)) and not amax >= 0:
        raise ValueError(
            f"amax must be the tensor's largest magnitude, >= 0 (or None: x's own), got {amax!r}"
        )
    parts = quantize_parts(x, block_shape, bits, None if amax is None else jnp.asarray(amax))
    values = unblocked(parts.q, x.shape).astype(jnp.float4_e2m1fn)
    return NVFP4Array(values, parts.codes, parts.amax, parts.decode, block_shape)


def dequantize_nvfp4(q: NVFP4Array) -> jax.Array:
    """The float32 values ``q * s_b * S_dec`` of an :class:`NVFP4Array` (one rounding; NaN in
    blocks that held an inf or NaN; subnormal results flushed to zero).

    Example:
      >>> import jax.numpy as jnp, jdls
      >>> x = jnp.array([[0.0, 1.0, jnp.nan, 2.0] + [0.0] * 12, [4.0] * 16])
      >>> jdls.fp8.dequantize_nvfp4(jdls.fp8.quantize_nvfp4(x))[:, :4].tolist()
      [[nan, nan, nan, nan], [4.0, 4.0, 4.0, 4.0]]
    """
    vb = blocked(q.values.astype(jnp.float32), q.block_shape)
    s_b = expand_blocks(e4m3_value(q.codes))
    out = ftz((vb * s_b) * q.decode)
    return unblocked(out, q.values.shape)


def _holds_bool(signs: Any) -> bool:
    """Whether a sequence of signs holds a bool (``True`` among ints becomes 1 in an array;
    an array's own dtype already says it)."""
    if signs is None or isinstance(signs, np.ndarray | jax.Array | str):
        return False
    try:
        return any(isinstance(v, bool | np.bool_) for v in signs)
    except TypeError:  # not a sequence: the shape check refuses it
        return False


def checked_signs(signs: Any) -> tuple[float, ...]:
    """The 16 signs, checked, as the static argument of the compiled transform (``None``:
    TransformerEngine's). Numbers only, each exactly +1 or -1: a bool, a string or 1.5 is
    refused, not rounded."""
    if isinstance(signs, jax.core.Tracer):
        raise TypeError(
            "signs must be known while tracing (they are part of the compiled transform): give "
            f"{BLOCK} values of +1 or -1 as a tuple or a NumPy array, not a traced array (a "
            "jitted function's argument: close over them, or pass a tuple as a static argument)"
        )
    s = np.asarray(TE_SIGNS if signs is None else signs)
    if (
        s.shape != (BLOCK,)
        or s.dtype.kind not in "iuf"
        or _holds_bool(signs)
        or not np.all(np.abs(s) == 1)
    ):
        raise ValueError(
            f"signs must be {BLOCK} values, each +1 or -1 (the default is TransformerEngine's "
            f"jdls.fp8.TE_SIGNS), got {signs!r}"
        )
    return tuple(float(v) for v in s)


def hadamard(x: jax.Array, axis: int = -1, signs: Any = None) -> jax.Array:
    """The random Hadamard transform of ``x`` along ``axis``, in tiles of 16.

    Each 16 consecutive values ``v`` become ``(v * s) @ H16 / 4``, ``H16`` the Sylvester
    Hadamard matrix (``H[i, j] = (-1)**popcount(i & j)``), ``s`` the sign vector: an
    orthogonal map, so a dot contracting ``axis`` is unchanged when both operands are
    transformed. Computed in float32 by the in-order butterfly (for ``h`` in 1, 2, 4, 8:
    ``(w[i], w[i+h]) = (w[i] + w[i+h], w[i] - w[i+h])``), then times 1/4, subnormals
    flushed. The axis is zero-padded at the end to a multiple of 16 (the result is that long).

    Args:
      x: a float array.
      axis: the axis to transform (the axis the weight-gradient dot contracts, tokens).
      signs: 16 values of +1 or -1 (default: TransformerEngine's :data:`TE_SIGNS`).

    Example:
      >>> import jax.numpy as jnp, jdls
      >>> a, b = jnp.arange(32.0).reshape(32, 1), jnp.ones((32, 1))
      >>> ha, hb = jdls.fp8.hadamard(a, 0), jdls.fp8.hadamard(b, 0)
      >>> float((ha.T @ hb)[0, 0]), float((a.T @ b)[0, 0])
      (496.0, 496.0)
    """
    x = jnp.asarray(x)
    if not -x.ndim <= axis < x.ndim:
        raise ValueError(
            f"axis {axis} is out of bounds for an array of {x.ndim} dimensions: give an axis "
            f"from {-x.ndim} to {x.ndim - 1}"
        )
    return _hadamard(x, axis % x.ndim, checked_signs(signs))


# Compiled as one program, also when called eagerly (op by op it lowered 70 programs for one
# shape, 4.5 s the first time on a busy 2-core CPU; 3 and 0.6 s compiled), the signs static
# (host values, never traced); inlined inside a user's jit (``inline=True``).
@functools.partial(jax.jit, static_argnums=(1, 2), inline=True)
def _hadamard(x: jax.Array, axis: int, signs: tuple[float, ...]) -> jax.Array:
    s = np.asarray(signs, np.float32)
    w = ftz(x.astype(jnp.float32))
    size = w.shape[axis]
    pad = -size % BLOCK
    if pad:
        widths = [(0, 0)] * w.ndim
        widths[axis] = (0, pad)
        w = jnp.pad(w, widths)
    # In place along ``axis`` (no transpose): (..., tiles, 16, ...), the butterfly on the 16.
    before, after = w.shape[:axis], w.shape[axis + 1 :]
    tiles = (size + pad) // BLOCK
    w = split_axis(w, axis, BLOCK) * s.reshape((BLOCK,) + (1,) * len(after))
    pair_axis = len(before) + 2  # the axis of (w[i], w[i + h]) below
    for h in (1, 2, 4, 8):
        pairs = w.reshape(*before, tiles, BLOCK // (2 * h), 2, h, *after)
        a = lax.index_in_dim(pairs, 0, pair_axis, keepdims=False)
        b = lax.index_in_dim(pairs, 1, pair_axis, keepdims=False)
        w = jnp.stack([ftz(a + b), ftz(a - b)], axis=pair_axis)
        w = w.reshape(*before, tiles, BLOCK, *after)
    return ftz(w * np.float32(0.25)).reshape(*before, size + pad, *after)


def padded_length(n: int) -> int:
    """``n`` rounded up to a multiple of 16."""
    return math.ceil(n / BLOCK) * BLOCK
