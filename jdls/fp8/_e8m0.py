"""Shared exponents of block scaling: three rounding rules, exact on float32 bit patterns.

A block of values shares one power-of-two scale ``2**e``, stored as an E8M0 code
``e + 127`` (0 to 254; 255 is NaN). The rules differ in how ``e`` follows from the block's
largest magnitude ``amax`` and the element format's largest value ``fmax``:

- ``"up"`` (NVIDIA, JAX's cuDNN path): the E8M0 value of ``amax / fmax`` (float32 quotient)
  rounded up, so the block's maximum does not exceed ``fmax`` after scaling (except for
  the one amax just above ``fmax * 2**-127``, whose quotient rounds to ``2**-127``);
- ``"down"`` (OCP MX v1.0 as its reference emulator computes it):
  ``floor(log2(amax)) - floor(log2(fmax))``, so the maximum can exceed ``fmax``, up to
  ``2**(floor(log2(fmax)) + 1)`` (1.14x for e4m3, 1.33x for e2m1), and is clipped;
- ``"outlier_aware"`` (qwix): ``amax / fmax`` times a format constant ``c`` (60/31 for
  three mantissa bits, 12/7 for one) rounded to bfloat16, then rounded down to a power of two.

Every rule reads the float32 bits of ``amax`` with integer operations, so XLA's
flush-to-zero of float32 subnormals on CPU never changes a scale. A non-finite ``amax`` gives
the NaN code 255 under every rule. How each rule agrees with its source, and where the
sources themselves differ for non-finite blocks: docs/fp8-blocks.md.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

__all__ = ["NAN_CODE", "ROUNDINGS", "amax_bits", "ldexp", "outlier_constant", "shared_exponent"]

ROUNDINGS = ("up", "down", "outlier_aware")
NAN_CODE = 255

_ABS = 0x7FFFFFFF
_INF = 0x7F800000
_MANT = 0x7FFFFF


def amax_bits(x: jax.Array, axes: tuple[int, ...]) -> jax.Array:
    """The float32 bit pattern of ``max(|x|)`` over ``axes``, as uint32 (exact, NaN wins).

    The bits of ``|x|`` order like the values, and every NaN pattern is above inf, so an
    integer maximum gives the largest magnitude exactly, subnormals included, and a NaN
    anywhere gives a NaN pattern (a float maximum on XLA CPU can drop a NaN).
    """
    bits = lax.bitcast_convert_type(x.astype(jnp.float32), jnp.uint32) & jnp.uint32(_ABS)
    return jnp.max(bits, axis=axes)


def _exponent(a: jax.Array) -> jax.Array:
    """``floor(log2(v))`` of the positive finite float32 values with bit patterns ``a``."""
    field = (a >> 23).astype(jnp.int32)
    lead = lax.clz(a & jnp.uint32(_MANT)).astype(jnp.int32)  # subnormals: 31 - lead = top bit
    return jnp.where(field > 0, field - 127, -118 - lead)


def _odd_part(v: float) -> tuple[int, int]:
    """``v = odd * 2**k`` for a positive float with an integer odd part below 128."""
    k = math.floor(math.log2(v)) - 52
    odd = int(v / 2.0**k)
    while odd % 2 == 0:
        odd, k = odd // 2, k + 1
    if odd >= 128 or odd * 2.0**k != v:
        raise ValueError(f"block scaling needs fmax = odd * 2**k with odd < 128, got {v}")
    return odd, k


def _quotient_bits(a: jax.Array, fmax: float) -> jax.Array:
    """The bits of the float32 quotient ``amax / fmax``, correctly rounded (ties to even), for
    positive finite ``amax`` with bits ``a``; 0 where the quotient is below ``2**-126``.

    Integer arithmetic only: XLA on CPU computes a float division by a constant as a
    multiplication by its reciprocal, which is not correctly rounded.
    """
    odd, k = _odd_part(fmax)
    field = a >> 23
    mant = a & jnp.uint32(_MANT)
    shift = lax.clz(mant) - jnp.uint32(8)
    sig = jnp.where(field > 0, mant | jnp.uint32(1 << 23), mant << jnp.minimum(shift, 31))
    num = sig << 8  # in [2**31, 2**32)
    q, rem = num // jnp.uint32(odd), num % jnp.uint32(odd)
    drop = (jnp.uint32(8) - lax.clz(q)).astype(jnp.int32)  # q has 24 + drop bits, drop >= 1
    dropped = q & ((jnp.uint32(1) << drop.astype(jnp.uint32)) - jnp.uint32(1))
    half = jnp.uint32(1) << (drop - 1).astype(jnp.uint32)
    kept = q >> drop.astype(jnp.uint32)
    up = (dropped > half) | ((dropped == half) & ((rem != 0) | ((kept & jnp.uint32(1)) != 0)))
    kept = kept + up.astype(jnp.uint32)
    carry = kept >> 24  # rounding up to 2**24
    kept = jnp.where(carry > 0, kept >> 1, kept)
    biased = _exponent(a) - 8 - k + drop + carry.astype(jnp.int32) + 127
    bits = (jnp.clip(biased, 0, 254).astype(jnp.uint32) << 23) | (kept & jnp.uint32(_MANT))
    return jnp.where(biased >= 1, bits, jnp.uint32(0))


def outlier_constant(mantissa_bits: int) -> float:
    """qwix's outlier-aware constant ``c = 2 * (2**(m+2) - 2) / (2**(m+2) - 1)``.

    60/31 for three mantissa bits (MXFP8 e4m3, FP6 e2m3), 28/15 for two, 12/7 for one (FP4).
    """
    k = 2 ** (mantissa_bits + 2)
    return 2.0 * (k - 2) / (k - 1)


def _rule_down(a: jax.Array, emax: int) -> jax.Array:
    e = jnp.where(a == 0, -126, _exponent(a)) - emax
    return jnp.maximum(e, -127) + 127


def _rule_up(a: jax.Array, fmax: float) -> jax.Array:
    q = _quotient_bits(a, fmax)
    field = (q >> 23).astype(jnp.int32)
    normal = jnp.minimum(field + ((q & jnp.uint32(_MANT)) != 0), 254)
    # Below 2**-126 the float32 quotient is subnormal: it is <= 2**-127 (code 0) exactly when
    # amax <= fmax * 2**-127 * (1 + 2**-23) (the tie rounds to even, to 2**-127).
    limit = np.float64(fmax) * 2.0**-127 * (1.0 + 2.0**-23)
    limit32 = np.float32(limit)
    if float(limit32) > limit:
        limit32 = np.nextafter(limit32, np.float32(0))
    sub = jnp.where(a > jnp.uint32(limit32.view(np.uint32)), 1, 0)
    return jnp.where(a == 0, 0, jnp.where(field == 0, sub, normal))


def _rule_outlier_aware(a: jax.Array, fmax: float, mantissa_bits: int) -> jax.Array:
    s = lax.bitcast_convert_type(_quotient_bits(a, fmax), jnp.float32)
    s = jnp.where(s < np.float32(2.0**-63), np.float32(1.0), s)  # qwix: sqrt(tiny) -> 1
    t = (s * np.float32(outlier_constant(mantissa_bits))).astype(jnp.bfloat16)
    return ((lax.bitcast_convert_type(t, jnp.uint16) & jnp.uint16(0x7F80)) >> 7).astype(jnp.int32)


def shared_exponent(a: jax.Array, rounding: str, fmax: float, mantissa_bits: int) -> jax.Array:
    """The E8M0 code (int32, 0 to 255) of blocks whose ``amax`` has float32 bits ``a``.

    Args:
      a: uint32 bit patterns of each block's ``max(|x|)`` (see :func:`amax_bits`).
      rounding: ``"up"``, ``"down"`` or ``"outlier_aware"`` (module docstring).
      fmax: the element format's largest finite value.
      mantissa_bits: the element format's mantissa bits (``"outlier_aware"`` only).

    Returns:
      ``e + 127`` where ``2**e`` is the block's scale; 255 (NaN) where ``amax`` is inf or NaN.

    Example:
      >>> import jax.numpy as jnp, numpy as np
      >>> from jdls.fp8._e8m0 import shared_exponent
      >>> a = jnp.asarray(np.float32([448.0, 449.0, 0.0]).view(np.uint32))
      >>> shared_exponent(a, "up", 448.0, 3).tolist(), shared_exponent(a, "down", 448.0, 3).tolist()
      ([127, 128, 0], [127, 127, 0])
    """
    a = jnp.asarray(a, jnp.uint32)
    if rounding == "up":
        code = _rule_up(a, fmax)
    elif rounding == "down":
        code = _rule_down(a, math.floor(math.log2(fmax)))
    elif rounding == "outlier_aware":
        code = _rule_outlier_aware(a, fmax, mantissa_bits)
    else:
        raise ValueError(
            f"rounding must be one of {ROUNDINGS} (how the shared exponent is rounded), "
            f"got {rounding!r}"
        )
    return jnp.where(a >= jnp.uint32(_INF), NAN_CODE, code).astype(jnp.int32)


def ldexp(x: jax.Array, k: jax.Array) -> jax.Array:
    """``x * 2**k`` for float32 ``x`` and int32 ``k``, exact on bit patterns.

    Subnormal inputs are normalised first (XLA CPU would read them as zero); results below
    ``2**-126`` become zero of the same sign, as XLA CPU's float32 arithmetic makes them;
    inf and NaN pass through; results above the float32 range become inf.
    """
    b = lax.bitcast_convert_type(x.astype(jnp.float32), jnp.uint32)
    sign = b & jnp.uint32(0x80000000)
    mag = b & jnp.uint32(_ABS)
    field = (mag >> 23).astype(jnp.int32)
    mant = mag & jnp.uint32(_MANT)
    shift = lax.clz(mant) - jnp.uint32(8)
    sub = field == 0
    mant = jnp.where(sub, (mant << jnp.minimum(shift, 31)) & jnp.uint32(_MANT), mant)
    field = jnp.where(sub, 1 - shift.astype(jnp.int32), field) + k
    out = sign | (jnp.clip(field, 0, 255).astype(jnp.uint32) << 23) | mant
    out = jnp.where(field <= 0, sign, out)
    out = jnp.where(field >= 255, sign | jnp.uint32(_INF), out)
    out = jnp.where((mag == 0) | (mag >= jnp.uint32(_INF)), b, out)
    return lax.bitcast_convert_type(out, jnp.float32)
