"""The exact kernels of emulated float formats: round, encode and decode.

Every kernel takes the format as ``(e, m, bias)`` (exponent bits, mantissa bits, bias). The
device kernels work on float32 bit patterns with integer operations only, so XLA's
flush-to-zero of float32 subnormals never touches them; :func:`round_float64` rounds float64
values on the host. How and why they are exact: docs/formats.md, "How it is exact".
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

__all__ = ["from_bits_fn", "round_float64", "round_fn", "storage_dtype", "to_bits_fn"]

_U32 = jnp.uint32
_F32_ABS = 0x7FFFFFFF
_F32_INF = 0x7F800000
_F32_QNAN = 0x7FC00000


def storage_dtype(nbits: int) -> np.dtype:
    """The smallest unsigned integer dtype (uint8/uint16/uint32) that holds ``nbits`` bits."""
    for dtype in (np.uint8, np.uint16, np.uint32):
        if nbits <= 8 * np.dtype(dtype).itemsize:
            return np.dtype(dtype)
    raise AssertionError("unreachable: a format has at most 32 bits")  # pragma: no cover


# --------------------------------------------------------------------------------------------
# Host: float64 values, rounded once.
# --------------------------------------------------------------------------------------------


def round_float64(x: Any, e: int, m: int, bias: int) -> np.ndarray:
    """Rounds float64 values to the format exactly (ties to even) on the host; float32 out.

    ``x / quantum`` is a power-of-two scaling (exact) to an integer part below ``2**(m + 1)``,
    so ``np.rint`` rounds it exactly: one rounding, no float32 in between.
    """
    x = np.asarray(x, np.float64)
    finite = np.isfinite(x)
    xf = np.where(finite, x, 0.0)
    _, exp = np.frexp(xf)  # |x| = f * 2**exp with 0.5 <= f < 1 (exp = 0 for zeros)
    q = np.maximum(exp - 1, 1 - bias) - m  # log2 of the quantum; subnormals: 2**(emin - m)
    with np.errstate(over="ignore"):
        r = np.ldexp(np.rint(np.ldexp(xf, -q)), q)
    largest = math.ldexp(2.0 - 2.0**-m, 2**e - 2 - bias)
    r = np.where(np.abs(r) > largest, np.copysign(np.inf, xf), r)
    return np.where(finite, r, x).astype(np.float32)  # exact: the values are float32 values


# --------------------------------------------------------------------------------------------
# Device: float32 bit patterns. All constants are Python ints derived from (e, m, bias); the
# functions are cached per format so each format is traced once per shape.
# --------------------------------------------------------------------------------------------


def _consts(e: int, m: int, bias: int) -> tuple[int, int, int]:
    """Returns (k0, emin_f, max_bits): float32 bits dropped for normals, float32 biased
    exponent of the smallest normal, float32 bit pattern of the largest finite value."""
    k0 = 23 - m
    emin_f = 128 - bias  # = (1 - bias) + 127, >= 1 by the bias rule
    emax_f = (2**e - 2 - bias) + 127  # <= 254
    max_bits = (emax_f << 23) | (((1 << m) - 1) << k0)
    return k0, emin_f, max_bits


def _u32(v: int) -> jax.Array:
    return jnp.asarray(v, _U32)


def _split(a: jax.Array, k0: int, emin_f: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """For |x| bits ``a``: returns (base, sig, k) with ``a == base + sig``, where ``sig`` is the
    significand (implicit bit included) at exponent ``max(E, 1)`` and ``k`` the number of low
    significand bits below the format's quantum at that exponent (clamped to 25)."""
    e_eff = jnp.maximum(a >> 23, _u32(1))
    base = (e_eff - _u32(1)) << 23
    sig = a - base
    below = _u32(emin_f) - jnp.minimum(e_eff, _u32(emin_f))  # binades below the smallest normal
    k = jnp.minimum(below + _u32(k0), _u32(25))
    return base, sig, k


def _round_bits(u: jax.Array, e: int, m: int, bias: int) -> jax.Array:
    """Rounds float32 bit patterns ``u`` (uint32) to the format; returns uint32 bit patterns."""
    k0, emin_f, max_bits = _consts(e, m, bias)
    a = u & _u32(_F32_ABS)
    sign = u ^ a
    base, sig, k = _split(a, k0, emin_f)
    mask = (_u32(1) << k) - _u32(1)
    lsb = (sig >> k) & _u32(1)
    if k0 == 0:  # 23-bit mantissa: normal numbers need no rounding (k == 0)
        lsb = lsb & jnp.minimum(k, _u32(1))
    sig_r = (sig + (mask >> 1) + lsb) & ~mask  # round half to even at bit k
    out = jnp.where(sig_r == 0, _u32(0), base + sig_r)
    # Overflow (and inf, NaN): finite values beyond max_bits become inf; NaN (a > inf) stays.
    out = jnp.where(out > _u32(max_bits), jnp.maximum(a, _u32(_F32_INF)), out)
    return sign | out


def _encode(r: jax.Array, e: int, m: int, bias: int) -> jax.Array:
    """Encodes rounded float32 bit patterns ``r`` (uint32); returns uint32 encodings."""
    k0, emin_f, _ = _consts(e, m, bias)
    a = r & _u32(_F32_ABS)
    sign = (r >> 31) << (e + m)
    base, sig, k = _split(a, k0, emin_f)
    e_eff = (base >> 23) + _u32(1)
    # Normal: exponent field E - emin_f + 1, mantissa sig >> k0 (its implicit bit adds the 1).
    # Subnormal (E < emin_f): exponent field 0, mantissa sig >> k.
    field = (e_eff - jnp.minimum(e_eff, _u32(emin_f))) << m
    enc = sign | (field + (sig >> k))
    inf_code = ((1 << e) - 1) << m
    nan_code = inf_code | (1 << (m - 1))
    special = jnp.where(a == _u32(_F32_INF), sign | _u32(inf_code), _u32(nan_code))
    return jnp.where(a >= _u32(_F32_INF), special, enc)


def _decode(b: jax.Array, e: int, m: int, bias: int) -> jax.Array:
    """Decodes uint32 encodings ``b``; returns float32 bit patterns (uint32)."""
    k0, emin_f, _ = _consts(e, m, bias)
    emask = (1 << e) - 1
    ef = (b >> m) & _u32(emask)
    mf = b & _u32((1 << m) - 1)
    sign = ((b >> (e + m)) & _u32(1)) << 31
    normal = ((ef + _u32(emin_f - 1)) << 23) | (mf << k0)
    special = jnp.where(mf == 0, _u32(_F32_INF), _u32(_F32_QNAN) | (mf << k0))
    # Subnormal value mf * 2**t. Below 2**-125 float32 bit patterns are linear in the value
    # (bits = value * 2**149); above, normalise with an exact int -> float32 conversion and
    # add t to the exponent field. Which applies is decided per format where possible.
    t = emin_f - 127 - m
    lin_limit = -125 - t  # mf < 2**lin_limit  <=>  mf * 2**t < 2**-125
    lin = mf << (t + 149)
    if lin_limit >= m:
        sub = lin
    else:
        as_float = lax.bitcast_convert_type(mf.astype(jnp.int32).astype(jnp.float32), _U32)
        scaled = as_float + _u32((t << 23) & 0xFFFFFFFF)
        sub = jnp.where(mf < _u32(1 << max(lin_limit, 0)), lin, scaled)
    out = jnp.where(ef == _u32(emask), special, jnp.where(ef == 0, sub, normal))
    return sign | out


@functools.cache
def round_fn(e: int, m: int, bias: int) -> Callable[[jax.Array], jax.Array]:
    """Jitted float32 -> float32 rounding to the format, with a straight-through derivative."""

    @jax.custom_jvp
    def rnd(x: jax.Array) -> jax.Array:
        u = lax.bitcast_convert_type(x, _U32)
        return lax.bitcast_convert_type(_round_bits(u, e, m, bias), jnp.float32)

    @rnd.defjvp
    def _rnd_jvp(primals: tuple[jax.Array], tangents: tuple[jax.Array]) -> Any:
        (x,), (t,) = primals, tangents
        return rnd(x), t  # straight-through

    return jax.jit(rnd)


@functools.cache
def to_bits_fn(e: int, m: int, bias: int) -> Callable[[jax.Array], jax.Array]:
    """Jitted float32 -> encodings (rounded first), in :func:`storage_dtype`."""
    storage = storage_dtype(1 + e + m)

    def to_bits(x: jax.Array) -> jax.Array:
        u = lax.bitcast_convert_type(x, _U32)
        return _encode(_round_bits(u, e, m, bias), e, m, bias).astype(storage)

    return jax.jit(to_bits)


@functools.cache
def from_bits_fn(e: int, m: int, bias: int) -> Callable[[jax.Array], jax.Array]:
    """Jitted integer encodings (low ``1 + e + m`` bits read) -> float32 values."""
    nbits = 1 + e + m

    def from_bits(b: jax.Array) -> jax.Array:
        b32 = b.astype(_U32) & _u32((1 << nbits) - 1)
        return lax.bitcast_convert_type(_decode(b32, e, m, bias), jnp.float32)

    return jax.jit(from_bits)
