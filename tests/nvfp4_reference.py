"""An independent host reference of NVFP4 quantization, its decoding and the 16-point random
Hadamard transform (numpy and ml_dtypes only; written from the formulas, never from jdls code).

Not a test module (no ``test_`` prefix); ``tests/test_nvfp4.py`` holds jdls to it bit for bit.

Arithmetic: IEEE float32, round to nearest even, with FTZ/DAZ. A float32 subnormal input reads as
zero of the same sign and every float32 operation whose result is subnormal gives zero of the
same sign (what XLA:CPU does). numpy keeps subnormals, so :func:`ftz` is applied to every input
and after every float32 operation below.

Quantization (``docs``: /work/shared/reference/nvfp4-training.md, sections 2 and 5; TE's CUDA
kernel order), per tensor x with blocks of ``block_shape`` (zero padding at the ends):

1. x = ftz(x); a block holding an inf or a NaN is *non-finite*.
2. A = max |x| over the finite values (0 if none), or the given ``amax`` (ftz'd).
3. S_enc = min(fp32(2688 / A), FLT_MAX); 1 when A == 0 or S_enc == 0.
4. S_dec = ftz(fp32(1 / S_enc)).
5. S_dec_b = ftz(fp32(amax_b * ftz(fp32(S_enc * fp32(1/6))))) per finite block.
6. code = e4m3_rne(min(S_dec_b, 448)); 0x7F (E4M3 NaN) for a non-finite block.
7. e_b = min(fp32(1 / ftz(fp32(s_b * S_dec))), FLT_MAX), s_b the code's value.
8. y = ftz(fp32(x * e_b)), clamped to [-6, 6]; q = e2m1_rne(y), or e2m1_sr(y, bits); 0 in a
   non-finite block.

Decoding: ftz(fp32(fp32(q * s_b) * S_dec)), NaN in a non-finite block.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import ml_dtypes
import numpy as np

F32 = np.float32
TINY = F32(np.finfo(np.float32).tiny)  # 2**-126, the smallest normal float32
FLT_MAX = F32(np.finfo(np.float32).max)
ONE_SIXTH = F32(1 / 6)  # the float32 constant fp32(1/6)
E4M3_MAX = F32(448.0)
E2M1_MAX = F32(6.0)
E4M3_NAN_CODE = 0x7F
#: The E2M1 magnitudes; the index is the 3-bit magnitude code (bit 3 of the code is the sign).
E2M1_GRID = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=np.float32)
#: TransformerEngine's sign vector of the random Hadamard transform.
TE_SIGNS = np.array([1, 1, 1, -1, 1, -1, -1, -1, -1, -1, -1, 1, -1, 1, -1, -1], dtype=np.float32)


# ------------------------------------------------------------------------------------------
# Float32 with FTZ/DAZ.
# ------------------------------------------------------------------------------------------


def ftz(a) -> np.ndarray:
    """Subnormal float32 values to zero of the same sign (NaN and inf are kept)."""
    a = np.asarray(a, dtype=np.float32)
    with np.errstate(invalid="ignore"):
        return np.where(np.abs(a) < TINY, np.copysign(F32(0), a), a).astype(np.float32)


def widen(x) -> np.ndarray:
    """float32, bfloat16 or float16 values widened exactly to float32, then read with DAZ."""
    x = np.asarray(x)
    if x.dtype not in (np.float32, np.float16, ml_dtypes.bfloat16):
        raise TypeError(f"not a float32, bfloat16 or float16 array: {x.dtype}")
    return ftz(x.astype(np.float32))


def _mul(a, b) -> np.ndarray:
    with np.errstate(all="ignore"):
        return ftz(np.multiply(np.asarray(a, np.float32), np.asarray(b, np.float32)))


def _div(a, b) -> np.ndarray:
    with np.errstate(all="ignore"):
        return ftz(np.divide(np.asarray(a, np.float32), np.asarray(b, np.float32)))


# ------------------------------------------------------------------------------------------
# Element and scale rounding.
# ------------------------------------------------------------------------------------------


def e2m1_rne(y) -> np.ndarray:
    """Round float32 values to the E2M1 grid, nearest with ties to the even code, after
    clamping to [-6, 6] (satfinite; inf gives 6). The sign is kept, also for a zero. Returned as
    float32 values; written from the grid, independently of ml_dtypes (the self-checks compare).
    Not defined for NaN (a non-finite block never reaches the rounding)."""
    y = np.asarray(y, dtype=np.float32)
    a = np.minimum(np.abs(y).astype(np.float64), 6.0)
    grid = E2M1_GRID.astype(np.float64)
    hi = np.clip(np.searchsorted(grid, a, side="left"), 1, 7)  # grid[hi-1] <= a <= grid[hi]
    lo = hi - 1
    d_lo, d_hi = a - grid[lo], grid[hi] - a
    up = (d_hi < d_lo) | ((d_hi == d_lo) & (hi % 2 == 0))  # tie: the even code
    mag = np.where(up, grid[hi], grid[lo])
    mag = np.where(a == 6.0, 6.0, mag)
    return np.copysign(mag, y).astype(np.float32)


def e2m1_sr(y, bits) -> np.ndarray:
    """Stochastic rounding onto the E2M1 grid with one uint32 word per element:
    u = (bits >> 8) * 2**-24 in [0, 1); a = min(|y|, 6); step 0.5, 1 or 2 below 2, below 4,
    from 4; lo = floor(a / step) * step; up to lo + step iff u < (a - lo) / step. y's sign is
    kept (also for a zero)."""
    y = np.asarray(y, dtype=np.float32)
    bits = np.asarray(bits)
    if bits.dtype != np.uint32 or bits.shape != y.shape:
        raise ValueError(f"bits must be uint32 of shape {y.shape}: {bits.dtype}{bits.shape}")
    u = (bits >> np.uint32(8)).astype(np.float64) * 2.0**-24
    a = np.minimum(np.abs(y), E2M1_MAX).astype(np.float64)  # exact
    step = np.where(a < 2, 0.5, np.where(a < 4, 1.0, 2.0))
    lo = np.floor(a / step) * step
    frac = (a - lo) / step  # exact: a, lo and step are float32 of the same binade or so
    mag = np.where(u < frac, lo + step, lo)
    return np.copysign(mag, y).astype(np.float32)


def e4m3_code(v) -> np.ndarray:
    """The float8_e4m3fn byte of non-negative float32 values: clamp to 448, then round to
    nearest even (ml_dtypes; a value above 464 would otherwise become NaN)."""
    v = np.minimum(np.asarray(v, dtype=np.float32), E4M3_MAX)
    return v.astype(ml_dtypes.float8_e4m3fn).view(np.uint8)


def e4m3_values() -> np.ndarray:
    """Every finite non-negative E4M3 value, indexed by its code 0..126 (float64), from the bit
    layout: 4 exponent bits (bias 7), 3 mantissa bits, subnormals at exponent field 0."""
    codes = np.arange(127)
    e, m = codes >> 3, codes & 7
    return np.where(e == 0, m / 8 * 2.0**-6, (1 + m / 8) * 2.0 ** (e - 7.0))


def e4m3_rne_independent(v) -> np.ndarray:
    """The E4M3 byte of non-negative finite values, nearest with ties to the even code, values
    above 448 saturated: an enumeration of the grid (float64), independent of ml_dtypes."""
    v = np.asarray(v, dtype=np.float64)
    grid = e4m3_values()
    hi = np.clip(np.searchsorted(grid, v, side="left"), 1, 126)
    lo = hi - 1
    d_lo, d_hi = v - grid[lo], grid[hi] - v
    up = (d_hi < d_lo) | ((d_hi == d_lo) & (hi % 2 == 0))
    code = np.where(up, hi, lo)
    return np.where(v >= 448, 126, code).astype(np.uint8)


def e4m3_value(code) -> np.ndarray:
    """float32 value of E4M3 bytes (0x7F is NaN)."""
    return np.asarray(code, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)


# ------------------------------------------------------------------------------------------
# Blocks.
# ------------------------------------------------------------------------------------------


def _blocked(x: np.ndarray, block_shape: Sequence[int]) -> np.ndarray:
    """x zero-padded to whole blocks and reshaped to (m0, b0, m1, b1, ...)."""
    if len(block_shape) != x.ndim:
        raise ValueError(f"block_shape {tuple(block_shape)} for a {x.ndim}-d array")
    counts = [-(-n // b) for n, b in zip(x.shape, block_shape, strict=True)]
    pad = [(0, m * b - n) for n, m, b in zip(x.shape, counts, block_shape, strict=True)]
    xp = np.pad(x, pad)
    return xp.reshape([d for m, b in zip(counts, block_shape, strict=True) for d in (m, b)])


def _block_axes(ndim: int) -> tuple[int, ...]:
    return tuple(range(1, 2 * ndim, 2))


def _per_element(per_block: np.ndarray, shape, block_shape) -> np.ndarray:
    """A per-block array (m0, m1, ...) spread to the elements of ``shape``."""
    out = per_block
    for axis, b in enumerate(block_shape):
        out = np.repeat(out, b, axis=axis)
    return out[tuple(slice(0, n) for n in shape)]


# ------------------------------------------------------------------------------------------
# Quantize, dequantize.
# ------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Quantized:
    """The reference's result: what jdls returns (``values``, ``codes``, ``amax``, ``decode``)
    and intermediates for the tests (``block_scale``: S_dec_b before the E4M3 cast, NaN for a
    non-finite block; ``encode``: e_b per block; ``scaled``: y = ftz(x * e_b) before the
    clamp, 0 in a non-finite block)."""

    values: np.ndarray  # float4_e2m1fn, x's shape
    codes: np.ndarray  # uint8, one per block
    amax: np.float32
    decode: np.float32
    block_shape: tuple[int, ...]
    block_scale: np.ndarray
    encode: np.ndarray
    scaled: np.ndarray
    nonfinite: np.ndarray  # bool, per block

    @property
    def value_bytes(self) -> np.ndarray:
        return self.values.view(np.uint8)


def tensor_scales(x32: np.ndarray, amax=None) -> tuple[np.float32, np.float32, np.float32]:
    """(A, S_enc, S_dec) of ftz'd float32 values."""
    if amax is None:
        finite = np.isfinite(x32)
        a = np.max(np.abs(x32), where=finite, initial=F32(0)) if x32.size else F32(0)
    else:
        a = np.asarray(amax, dtype=np.float32)
    a = ftz(a)[()]
    s_enc = _div(F32(2688.0), a)
    s_enc = np.minimum(s_enc, FLT_MAX)
    if a == 0 or s_enc == 0:
        s_enc = F32(1.0)
    s_dec = _div(F32(1.0), s_enc)[()]
    return F32(a), F32(s_enc), F32(s_dec)


def quantize(
    x,
    block_shape: Sequence[int] = (1, 16),
    *,
    bits=None,
    amax=None,
    order: str = "kernel",
) -> Quantized:
    """NVFP4 quantization of ``x`` (float32, bfloat16 or float16).

    ``order="kernel"`` is TE's kernel order (and jdls's): ``amax_b * fp32(S_enc * fp32(1/6))``.
    ``order="div6"`` is the other order, ``fp32(amax_b / 6) * S_enc`` (TE-JAX's pure-JAX
    quantizer), only to show that the tests tell the two apart."""
    block_shape = tuple(int(b) for b in block_shape)
    x32 = widen(x)
    a, s_enc, s_dec = tensor_scales(x32, amax)

    blocks = _blocked(x32, block_shape)
    axes = _block_axes(x32.ndim)
    nonfinite = np.any(~np.isfinite(blocks), axis=axes)
    with np.errstate(invalid="ignore"):
        amax_b = np.max(np.abs(np.where(np.isfinite(blocks), blocks, F32(0))), axis=axes)
    amax_b = amax_b.astype(np.float32)
    if order == "kernel":
        s_dec_b = _mul(amax_b, _mul(s_enc, ONE_SIXTH))
    elif order == "div6":
        s_dec_b = _mul(_div(amax_b, F32(6.0)), s_enc)
    else:
        raise ValueError(order)
    codes = np.where(nonfinite, np.uint8(E4M3_NAN_CODE), e4m3_code(s_dec_b)).astype(np.uint8)
    s_b = e4m3_value(np.where(nonfinite, np.uint8(0), codes))
    with np.errstate(all="ignore"):
        e_b = np.minimum(_div(F32(1.0), _mul(s_b, s_dec)), FLT_MAX).astype(np.float32)

    bad = _per_element(nonfinite, x32.shape, block_shape)
    y = _mul(np.where(bad, F32(0), x32), _per_element(e_b, x32.shape, block_shape))
    y = np.where(bad, F32(0), y)
    clamped = np.clip(y, -E2M1_MAX, E2M1_MAX)
    q = e2m1_rne(clamped) if bits is None else e2m1_sr(clamped, bits)
    q = np.where(bad, F32(0), q)  # +0 in a non-finite block
    return Quantized(
        values=q.astype(ml_dtypes.float4_e2m1fn),
        codes=codes,
        amax=F32(a),
        decode=F32(s_dec),
        block_shape=block_shape,
        block_scale=np.where(nonfinite, F32(np.nan), s_dec_b).astype(np.float32),
        encode=e_b,
        scaled=y,
        nonfinite=nonfinite,
    )


def dequantize(q: Quantized) -> np.ndarray:
    """ftz(fp32(fp32(q * s_b) * S_dec)); NaN for every element of a non-finite block."""
    vals = q.values.astype(np.float32)
    s_b = _per_element(e4m3_value(q.codes), vals.shape, q.block_shape)  # NaN for 0x7F
    return _mul(_mul(vals, s_b), q.decode)


def dequantize_parts(values, codes, decode, block_shape) -> np.ndarray:
    """:func:`dequantize` from raw parts (float4 values, uint8 codes, float32 S_dec)."""
    vals = np.asarray(values).astype(np.float32)
    s_b = _per_element(e4m3_value(codes), vals.shape, tuple(block_shape))
    return _mul(_mul(vals, s_b), np.float32(decode))


# ------------------------------------------------------------------------------------------
# Random Hadamard transform.
# ------------------------------------------------------------------------------------------


def hadamard_matrix(n: int = 16) -> np.ndarray:
    """The Sylvester Hadamard matrix, H[i, j] = (-1)**popcount(i & j) (float64)."""
    i = np.arange(n)
    pop = np.vectorize(lambda k: bin(k).count("1"))(i[:, None] & i[None, :])
    return np.where(pop % 2 == 0, 1.0, -1.0)


def hadamard(x, axis: int = -1, signs=None, *, order: Sequence[int] = (1, 2, 4, 8)) -> np.ndarray:
    """``(v * s) @ H16 / 4`` on each tile of 16 along ``axis`` (zero-padded at the end to a
    multiple of 16), in float32 with FTZ, by the in-order fast Walsh-Hadamard butterfly:
    w = v * s; for h in (1, 2, 4, 8), for every i with i & h == 0:
    (w[i], w[i+h]) = (w[i] + w[i+h], w[i] - w[i+h]); result w * 0.25.

    ``order`` permutes the stages, only to show that the tests tell orders apart."""
    x32 = widen(x)
    s = TE_SIGNS if signs is None else widen(np.asarray(signs, dtype=np.float32))
    if s.shape != (16,):
        raise ValueError(f"signs must have 16 entries: {s.shape}")
    axis = axis % x32.ndim
    xm = np.moveaxis(x32, axis, -1)
    n = xm.shape[-1]
    padded = -(-n // 16) * 16
    xm = np.pad(xm, [(0, 0)] * (xm.ndim - 1) + [(0, padded - n)])
    w = _mul(xm.reshape((*xm.shape[:-1], padded // 16, 16)), s)
    with np.errstate(all="ignore"):
        for h in order:
            i = np.array([k for k in range(16) if k & h == 0])
            a, b = w[..., i], w[..., i + h]
            w = w.copy()
            w[..., i] = ftz(a + b)
            w[..., i + h] = ftz(a - b)
    out = _mul(w, F32(0.25)).reshape(xm.shape)
    return np.moveaxis(out, -1, axis)


def e4m3_midpoints() -> np.ndarray:
    """The midpoints between consecutive finite non-negative E4M3 values (float64, all exact in
    float32), from 2**-10 to 432."""
    v = e4m3_values()
    return (v[:-1] + v[1:]) / 2


def next_f32(a, n: int) -> np.ndarray:
    """The float32 ``n`` ulps above (n > 0) or below ``a`` (positive finite values)."""
    a = np.asarray(a, dtype=np.float32)
    return (a.view(np.int32) + np.int32(n)).view(np.float32)


def midpoint_amaxes(tensor_amax, ulps: int = 1, search: int = 3) -> tuple[np.ndarray, np.ndarray]:
    """Block amaxes aimed at E4M3 rounding midpoints for a tensor amax A: for every E4M3
    midpoint m, the float32 values near m / fp32(S_enc * fp32(1/6)) whose kernel-order product
    ``fp32(amax_b * fp32(S_enc * fp32(1/6)))`` is m or within ``ulps`` ulps of it, each kept at
    most once; only those not above A. Returns (amaxes, the midpoint each aims at)."""
    _, s_enc, _ = tensor_scales(np.zeros(0, np.float32), amax=tensor_amax)
    c = _mul(s_enc, ONE_SIXTH)
    mids = e4m3_midpoints().astype(np.float32)
    guess = _div(mids, c)
    cand = np.stack([next_f32(guess, k) for k in range(-search, search + 1)], axis=-1)
    prod = _mul(cand, c)
    prod_bits = prod.view(np.int32).astype(np.int64)
    mid_bits = mids.view(np.int32).astype(np.int64)[:, None]
    keep = (np.abs(prod_bits - mid_bits) <= ulps) & (cand <= F32(tensor_amax)) & (cand > 0)
    keep &= np.isfinite(cand)
    amaxes = cand[keep]
    aims = np.broadcast_to(mids[:, None], cand.shape)[keep]
    _, first = np.unique(amaxes, return_index=True)
    return amaxes[np.sort(first)], aims[np.sort(first)]


__all__ = [
    "E2M1_GRID",
    "E4M3_NAN_CODE",
    "FLT_MAX",
    "ONE_SIXTH",
    "TE_SIGNS",
    "TINY",
    "Quantized",
    "dequantize",
    "dequantize_parts",
    "e2m1_rne",
    "e2m1_sr",
    "e4m3_code",
    "e4m3_midpoints",
    "e4m3_rne_independent",
    "e4m3_value",
    "e4m3_values",
    "ftz",
    "hadamard",
    "hadamard_matrix",
    "midpoint_amaxes",
    "next_f32",
    "quantize",
    "tensor_scales",
    "widen",
]
