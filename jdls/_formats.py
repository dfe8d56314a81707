"""IEEE-754 style float formats, emulated exactly with integer operations on float32 bits.

A :class:`FloatFormat` describes a binary floating-point format with one sign bit,
``exponent_bits`` exponent bits and ``mantissa_bits`` explicit mantissa bits, laid out and
interpreted as IEEE-754 does: exponent bias ``2**(exponent_bits - 1) - 1`` unless given,
subnormals (gradual underflow), signed zeros, ``+-inf`` (all-ones exponent, zero mantissa) and
NaN (all-ones exponent, non-zero mantissa). Values live in ordinary float32 arrays;
:meth:`FloatFormat.round` snaps them to the format's grid.

How the emulation works (``round``):

* The float32 bit pattern is split into sign, biased exponent ``E`` and significand. Rounding
  to ``mantissa_bits`` bits is an integer rounding of the significand (round half to even) at
  a bit position ``k`` that is ``23 - mantissa_bits`` for the format's normal numbers and grows
  by one per binade below the format's smallest normal number, so that the absolute quantum
  there is the format's smallest subnormal (gradual underflow).
* A carry out of the significand moves into the exponent field, as in hardware; a result
  beyond the largest finite value becomes ``inf``. NaN is returned unchanged.
* Nothing uses float32 arithmetic, so the result does not depend on the floating-point
  environment: XLA on CPU treats float32 subnormals as zero in arithmetic
  (denormals-are-zero / flush-to-zero), but bit operations see the true bit pattern.

Which formats are accepted (the exact rule): ``2 <= exponent_bits <= 8``,
``1 <= mantissa_bits <= 23`` and a bias such that every *normal* number of the format is a
normal float32 number, i.e. ``emin = 1 - bias >= -126`` and
``emax = 2**exponent_bits - 2 - bias <= 127``. Then every value of the format, subnormals
included, is exactly a float32 value, and ``round``, ``to_bits`` and ``from_bits`` are exact.
With the default bias this holds for every ``exponent_bits <= 8``; with ``exponent_bits == 8``
the bias must be 127.

When the format's smallest subnormal is below float32's smallest normal ``2**-126`` (only
formats with ``emin - mantissa_bits < -126``, e.g. bfloat16 = ``FloatFormat(8, 7)``), those
subnormals are float32 *subnormals*. ``round``/``to_bits``/``from_bits`` still produce them
exactly (bit patterns), but later float32 arithmetic on XLA CPU flushes them to zero, as it
does for native bfloat16 arithmetic. Formats with ``emin - mantissa_bits >= -126`` (float16,
cbfloat16, all float8 formats) never meet this: their subnormals are normal float32 numbers.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any, TypeVar

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from jax import lax

__all__ = [
    "FloatFormat",
    "FormatInfo",
    "cbfloat16",
    "compress",
    "decompress",
    "finfo",
]

T = TypeVar("T")

_U32 = jnp.uint32
_F32_ABS = 0x7FFFFFFF
_F32_SIGN = 0x80000000
_F32_INF = 0x7F800000
_F32_QNAN = 0x7FC00000


# --------------------------------------------------------------------------------------------
# The format.
# --------------------------------------------------------------------------------------------


def _check_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer):
        raise TypeError(f"{name} must be an int, got {value!r} ({type(value).__name__})")
    return int(value)


@dataclasses.dataclass(frozen=True, init=False)
class FloatFormat:
    """An IEEE-754 style binary float format, emulated exactly on float32 values.

    The format has 1 sign bit, ``exponent_bits`` exponent bits and ``mantissa_bits`` explicit
    mantissa bits; the all-ones exponent encodes ``+-inf`` (zero mantissa) and NaN (non-zero
    mantissa), the all-zeros exponent encodes signed zeros and subnormals. It is frozen and
    hashable, so it can be static configuration (``jax.jit`` ``static_argnums``, a pytree's
    auxiliary data). Two formats are equal when their bits and bias are equal; the name is a
    label and does not take part in equality.

    Args:
      exponent_bits: number of exponent bits, 2 to 8.
      mantissa_bits: number of explicit mantissa (fraction) bits, 1 to 23.
      bias: exponent bias; defaults to ``2**(exponent_bits - 1) - 1`` (IEEE-754). It must keep
        every normal number of the format a normal float32 number:
        ``1 - bias >= -126`` and ``2**exponent_bits - 2 - bias <= 127``.
      name: a label used in ``repr``, :func:`finfo` and policy strings; defaults to
        ``"float{bits}_e{exponent_bits}m{mantissa_bits}"`` (with ``"_b{bias}"`` when the bias
        is not the default).

    Raises:
      TypeError: an argument is not an int (or, for ``name``, not a str).
      ValueError: the format is outside what float32 can emulate exactly (see above).

    References:
      IEEE Std 754-2019, Standard for Floating-Point Arithmetic (binary interchange formats,
      roundTiesToEven). ml_dtypes (https://github.com/jax-ml/ml_dtypes), whose IEEE-style
      types this agrees with bit for bit.

    Example:
      >>> import jdls
      >>> fmt = jdls.FloatFormat(5, 10)  # IEEE float16
      >>> fmt.bias, fmt.bits, fmt.name
      (15, 16, 'float16_e5m10')
      >>> float(fmt.round(1.0 + 2.0**-11))  # a tie: rounds to even
      1.0
      >>> float(fmt.round(70000.0))  # beyond the overflow threshold
      inf
    """

    exponent_bits: int
    mantissa_bits: int
    bias: int
    name: str = dataclasses.field(compare=False)

    def __init__(
        self,
        exponent_bits: int,
        mantissa_bits: int,
        bias: int | None = None,
        name: str | None = None,
    ) -> None:
        e = _check_int("exponent_bits", exponent_bits)
        m = _check_int("mantissa_bits", mantissa_bits)
        if e < 2:
            raise ValueError(
                f"exponent_bits must be >= 2 (one exponent code for subnormals, one for "
                f"inf/NaN, at least one for normal numbers), got {e}"
            )
        if e > 8:
            raise ValueError(
                f"exponent_bits must be <= 8: float32, which holds the emulated values, has "
                f"8 exponent bits, got {e}"
            )
        if m < 1:
            raise ValueError(
                f"mantissa_bits must be >= 1 (an IEEE-style format needs a mantissa bit to "
                f"tell NaN from inf), got {m}"
            )
        if m > 23:
            raise ValueError(
                f"mantissa_bits must be <= 23: float32, which holds the emulated values, has "
                f"23 mantissa bits, got {m}"
            )
        b = 2 ** (e - 1) - 1 if bias is None else _check_int("bias", bias)
        lo, hi = 2**e - 129, 127
        if not lo <= b <= hi:
            raise ValueError(
                f"bias must be in [{lo}, {hi}] for exponent_bits={e}, so that every normal "
                f"number of the format is a normal float32 number (emin = 1 - bias >= -126, "
                f"emax = 2**exponent_bits - 2 - bias <= 127), got {b}"
            )
        if name is None:
            name = f"float{1 + e + m}_e{e}m{m}"
            if b != 2 ** (e - 1) - 1:
                name += f"_b{b}"
        elif not isinstance(name, str) or not name:
            raise TypeError(f"name must be a non-empty str or None, got {name!r}")
        object.__setattr__(self, "exponent_bits", e)
        object.__setattr__(self, "mantissa_bits", m)
        object.__setattr__(self, "bias", b)
        object.__setattr__(self, "name", name)

    # -- derived constants ---------------------------------------------------------------

    @property
    def bits(self) -> int:
        """Total number of bits, ``1 + exponent_bits + mantissa_bits``."""
        return 1 + self.exponent_bits + self.mantissa_bits

    @property
    def storage_dtype(self) -> np.dtype:
        """The smallest unsigned integer dtype that holds an encoding (uint8/uint16/uint32)."""
        for dtype in (np.uint8, np.uint16, np.uint32):
            if self.bits <= 8 * np.dtype(dtype).itemsize:
                return np.dtype(dtype)
        raise AssertionError("unreachable: bits <= 32")  # pragma: no cover

    @property
    def emin(self) -> int:
        """Exponent of the smallest normal number, ``1 - bias``."""
        return 1 - self.bias

    @property
    def emax(self) -> int:
        """Exponent of the largest finite number, ``2**exponent_bits - 2 - bias``."""
        return 2**self.exponent_bits - 2 - self.bias

    @property
    def finfo(self) -> FormatInfo:
        """Machine limits of the format, with the attributes of ``ml_dtypes.finfo``."""
        return _format_info(self)

    # -- conversions -----------------------------------------------------------------------

    def round(self, x: Any) -> jax.Array:
        """Rounds float32 values to the nearest value of this format.

        Round to nearest, ties to even; values at or beyond the overflow threshold
        ``(2 - 2**-(mantissa_bits + 1)) * 2**emax`` become ``+-inf`` (IEEE-754 rounding);
        gradual underflow through subnormals; signed zeros kept; NaN returned unchanged.
        Implemented with integer operations on the float32 bit pattern, so it is exact
        on every backend (no float32 subnormal arithmetic is involved). It works under
        ``jax.jit`` and ``jax.vmap``; its derivative is the identity (straight-through).

        Args:
          x: floating-point array or Python float. float16 and bfloat16 inputs are converted
            to float32 first (exactly); float64 is rejected (that would round twice).

        Returns:
          A float32 array of the same shape holding values of this format.

        Raises:
          TypeError: ``x`` is not floating-point, or is float64.

        Example:
          >>> import jax.numpy as jnp
          >>> import jdls
          >>> x = jnp.array([1.0 + 2.0**-10, 3e-12, 2.0**-40])  # tie, subnormal, tie at 0
          >>> [float(v) / 2.0**-39 for v in jdls.cbfloat16.round(x)][1:]  # in subnormal steps
          [2.0, 0.0]
          >>> float(jdls.cbfloat16.round(x)[0])
          1.0
        """
        return _round_fn(self.exponent_bits, self.mantissa_bits, self.bias)(_as_float32(x, "round"))

    def to_bits(self, x: Any) -> jax.Array:
        """Encodes float32 values in this format (after rounding them with :meth:`round`).

        NaN is encoded as the canonical quiet NaN: sign 0, all-ones exponent, mantissa with
        only its top bit set (``0x7E00`` for float16 as in numpy; ``0x7F00`` =
        ``0 111111 100000000`` for cbfloat16). The sign and payload of a NaN are not kept.

        Args:
          x: floating-point array or Python float (as for :meth:`round`).

        Returns:
          An array of :attr:`storage_dtype` (uint16 for 16-bit formats, uint8 for 8-bit ones)
          with the same shape; unused high bits are zero.

        Example:
          >>> import jdls
          >>> hex(int(jdls.cbfloat16.to_bits(1.0)))
          '0x3e00'
          >>> hex(int(jdls.FloatFormat(5, 10).to_bits(-2.0)))
          '0xc000'
        """
        fn = _to_bits_fn(self.exponent_bits, self.mantissa_bits, self.bias)
        return fn(_as_float32(x, "to_bits"))

    def from_bits(self, bits: Any) -> jax.Array:
        """Decodes encodings of this format to float32 values.

        Only the low :attr:`bits` bits of each integer are read. Every encoding decodes to
        its exact value; NaN encodings decode to a quiet float32 NaN that keeps the sign and
        the mantissa payload (shifted to the top of the float32 mantissa).

        Args:
          bits: integer array (any integer dtype; usually :attr:`storage_dtype`).

        Returns:
          A float32 array of the same shape.

        Raises:
          TypeError: ``bits`` is not an integer array.

        Example:
          >>> import jdls
          >>> float(jdls.cbfloat16.from_bits(0x0001)) == 2.0**-39  # smallest subnormal
          True
        """
        arr = jnp.asarray(bits)
        if not jnp.issubdtype(arr.dtype, jnp.integer):
            raise TypeError(
                f"from_bits expects an integer array of encodings (e.g. {self.storage_dtype}), "
                f"got dtype {arr.dtype}"
            )
        return _from_bits_fn(self.exponent_bits, self.mantissa_bits, self.bias)(arr)


def _as_float32(x: Any, what: str) -> jax.Array:
    """Checks that ``x`` is floating-point no wider than float32 and returns it as float32."""
    if isinstance(x, bool | int) or (
        hasattr(x, "dtype") and not jnp.issubdtype(np.dtype(x.dtype), jnp.floating)
    ):
        dtype = x.dtype if hasattr(x, "dtype") else type(x).__name__
        raise TypeError(
            f"{what} expects floating-point values (float32, or float16/bfloat16 which are "
            f"converted exactly), got {dtype}"
        )
    if hasattr(x, "dtype") and np.dtype(x.dtype).itemsize > 4:
        raise TypeError(
            f"{what} expects float32 values, got {x.dtype}: convert to float32 first "
            f"(float64 -> float32 -> format rounds twice and is not exact emulation)"
        )
    arr = jnp.asarray(x)
    if not jnp.issubdtype(arr.dtype, jnp.floating):
        raise TypeError(f"{what} expects floating-point values, got {arr.dtype}")
    return arr.astype(jnp.float32)


# --------------------------------------------------------------------------------------------
# The bit manipulations. All constants are Python ints derived from (e, m, bias); the
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
def _round_fn(e: int, m: int, bias: int) -> Callable[[jax.Array], jax.Array]:
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
def _to_bits_fn(e: int, m: int, bias: int) -> Callable[[jax.Array], jax.Array]:
    storage = FloatFormat(e, m, bias).storage_dtype

    def to_bits(x: jax.Array) -> jax.Array:
        u = lax.bitcast_convert_type(x, _U32)
        return _encode(_round_bits(u, e, m, bias), e, m, bias).astype(storage)

    return jax.jit(to_bits)


@functools.cache
def _from_bits_fn(e: int, m: int, bias: int) -> Callable[[jax.Array], jax.Array]:
    nbits = 1 + e + m

    def from_bits(b: jax.Array) -> jax.Array:
        b32 = b.astype(_U32) & _u32((1 << nbits) - 1)
        return lax.bitcast_convert_type(_decode(b32, e, m, bias), jnp.float32)

    return jax.jit(from_bits)


# --------------------------------------------------------------------------------------------
# cbfloat16 and machine limits.
# --------------------------------------------------------------------------------------------

cbfloat16 = FloatFormat(6, 9, name="cbfloat16")
"""Cerebras CB16: 1 sign, 6 exponent, 9 mantissa bits, **bias 31 (assumed)**.

Cerebras documents the bit widths but not the bias or the special values; jdls assumes the
IEEE-754 reading (bias ``2**5 - 1 = 31``, subnormals, inf/NaN), which matches Cerebras'
default maximum loss scale of 2**31 for cbfloat16. Then the largest finite value is
``(2 - 2**-9) * 2**31``, the smallest normal ``2**-30``, the smallest subnormal ``2**-39``.
For another bias use ``jdls.FloatFormat(6, 9, bias=..., name=...)``.

Reference: Cerebras documentation, "Data formats" (CB16 half-precision).
"""


@dataclasses.dataclass(frozen=True)
class FormatInfo:
    """Machine limits of a :class:`FloatFormat`, with the attributes of ``ml_dtypes.finfo``.

    Values are float32 scalars (every value of the format is exactly a float32).
    ``precision`` and ``resolution`` follow numpy's definition, ``precision =
    int(-log10(eps))`` and ``resolution = 10**-precision`` rounded to the format; ml_dtypes
    hard-codes ``precision = 1`` for its float8 types, where this gives 0 for e4m3 and e5m2.

    Attributes:
      bits: total bits. nexp / iexp: exponent bits. nmant: mantissa bits.
      max / min: largest / most negative finite value. eps: ``2**-nmant``, the gap between
        1 and the next value. epsneg: ``2**-(nmant + 1)``, the gap below 1.
      smallest_normal / tiny: ``2**minexp``. smallest_subnormal: ``2**(minexp - nmant)``.
      machep / negep: exponents of eps / epsneg. minexp: exponent of the smallest normal.
      maxexp: the smallest power of 2 that overflows (``emax + 1``).
      precision / resolution: approximate decimal digits and ``10**-precision``.
      dtype: the :class:`FloatFormat`. name: its name.

    Example:
      >>> import jdls
      >>> info = jdls.finfo("cbfloat16")
      >>> info.minexp, info.maxexp, float(info.smallest_subnormal) == 2.0**-39
      (-30, 32, True)
    """

    bits: int
    nexp: int
    iexp: int
    nmant: int
    machep: int
    negep: int
    minexp: int
    maxexp: int
    precision: int
    eps: np.float32
    epsneg: np.float32
    max: np.float32
    min: np.float32
    smallest_normal: np.float32
    tiny: np.float32
    smallest_subnormal: np.float32
    resolution: np.float32
    dtype: FloatFormat
    name: str

    def __str__(self) -> str:
        return (
            f"Machine parameters for {self.name} (emulated: {self.dtype})\n"
            f"precision = {self.precision}   resolution = {self.resolution:.6g}\n"
            f"machep = {self.machep}   eps = {self.eps:.6g}\n"
            f"negep = {self.negep}   epsneg = {self.epsneg:.6g}\n"
            f"minexp = {self.minexp}   tiny = {self.tiny:.6g}\n"
            f"maxexp = {self.maxexp}   max = {self.max:.6g}\n"
            f"nexp = {self.nexp}   min = -max\n"
            f"smallest_normal = {self.smallest_normal:.6g}   "
            f"smallest_subnormal = {self.smallest_subnormal:.6g}"
        )


@functools.cache
def _format_info(fmt: FloatFormat) -> FormatInfo:
    e, m = fmt.exponent_bits, fmt.mantissa_bits
    f32 = np.float32
    max_ = math.ldexp(2.0 - 2.0**-m, fmt.emax)
    precision = int(-math.log10(2.0**-m))
    resolution = np.asarray(fmt.round(np.float32(10.0**-precision)))
    return FormatInfo(
        bits=fmt.bits,
        nexp=e,
        iexp=e,
        nmant=m,
        machep=-m,
        negep=-m - 1,
        minexp=fmt.emin,
        maxexp=fmt.emax + 1,
        precision=precision,
        eps=f32(2.0**-m),
        epsneg=f32(2.0 ** (-m - 1)),
        max=f32(max_),
        min=f32(-max_),
        smallest_normal=f32(math.ldexp(1.0, fmt.emin)),
        tiny=f32(math.ldexp(1.0, fmt.emin)),
        smallest_subnormal=f32(math.ldexp(1.0, fmt.emin - m)),
        resolution=f32(resolution),
        dtype=fmt,
        name=fmt.name,
    )


_NAMED_FORMATS = {"cbfloat16": cbfloat16}


def finfo(dtype: Any) -> FormatInfo | np.finfo:
    """Machine limits of a float format: emulated formats here, others from ml_dtypes.

    Args:
      dtype: a :class:`FloatFormat`, the string ``"cbfloat16"``, or anything
        ``ml_dtypes.finfo`` accepts (``"float16"``, ``jnp.bfloat16``,
        ``np.dtype("float32")``, ``"float8_e4m3"``, ...).

    Returns:
      A :class:`FormatInfo` for emulated formats, else ``ml_dtypes.finfo(dtype)``.

    Raises:
      TypeError: ``dtype`` is not a floating-point type or format.

    Example:
      >>> import jdls
      >>> float(jdls.finfo("cbfloat16").max) == (2 - 2**-9) * 2.0**31
      True
      >>> float(jdls.finfo("float16").max)
      65504.0
    """
    if isinstance(dtype, FloatFormat):
        return dtype.finfo
    if isinstance(dtype, str) and dtype in _NAMED_FORMATS:
        return _NAMED_FORMATS[dtype].finfo
    try:
        return ml_dtypes.finfo(dtype)
    except (TypeError, ValueError) as err:
        raise TypeError(
            f"finfo expects a floating-point dtype, a jdls.FloatFormat or one of "
            f"{sorted(_NAMED_FORMATS)}, got {dtype!r} ({err})"
        ) from None


# --------------------------------------------------------------------------------------------
# 16-bit storage.
# --------------------------------------------------------------------------------------------


def _is_float_array(x: Any) -> bool:
    return isinstance(x, np.ndarray | jax.Array) and jnp.issubdtype(x.dtype, jnp.floating)


def compress(tree: T, fmt: FloatFormat = cbfloat16) -> T:
    """Encodes the floating-point leaves of a pytree in a format's bits (e.g. uint16).

    Each float array leaf becomes ``fmt.to_bits(leaf)`` (rounded to the format, then
    encoded), halving the memory of float32 leaves for 16-bit formats. Other leaves (integer
    arrays, Python scalars, strings) are returned unchanged and ``None`` stays ``None``.
    Works under ``jax.jit``.

    Args:
      tree: a pytree; its float array leaves must be float32, float16 or bfloat16.
      fmt: the format to store in; defaults to :data:`cbfloat16`.

    Returns:
      A pytree of the same structure with float leaves replaced by arrays of
      ``fmt.storage_dtype``.

    Example:
      >>> import jax.numpy as jnp
      >>> import jdls
      >>> packed = jdls.compress({"w": jnp.ones((2, 3)), "step": jnp.array(3)})
      >>> packed["w"].dtype, packed["step"].dtype
      (dtype('uint16'), dtype('int32'))
    """
    if not isinstance(fmt, FloatFormat):
        raise TypeError(f"fmt must be a jdls.FloatFormat (e.g. jdls.cbfloat16), got {fmt!r}")
    return jax.tree_util.tree_map(lambda x: fmt.to_bits(x) if _is_float_array(x) else x, tree)


def decompress(tree: T, fmt: FloatFormat = cbfloat16) -> T:
    """Decodes the leaves that :func:`compress` produced back to float32.

    Every array leaf whose dtype is ``fmt.storage_dtype`` is decoded with ``fmt.from_bits``;
    all other leaves are returned unchanged. A tree that had its own integer leaves of that
    dtype (e.g. uint16 token ids with a 16-bit format) would have them decoded too: keep such
    leaves out of the tree you compress. ``decompress(compress(t, f), f)`` equals
    ``fmt.round`` on every float leaf, bit for bit.

    Args:
      tree: a pytree produced by :func:`compress` with the same ``fmt``.
      fmt: the format the tree was stored in; defaults to :data:`cbfloat16`.

    Returns:
      A pytree of the same structure with encoded leaves replaced by float32 arrays.

    Example:
      >>> import jax.numpy as jnp
      >>> import jdls
      >>> tree = {"w": jnp.array([0.1, 1e-12])}
      >>> back = jdls.decompress(jdls.compress(tree))
      >>> bool((back["w"] == jdls.cbfloat16.round(tree["w"])).all())
      True
    """
    if not isinstance(fmt, FloatFormat):
        raise TypeError(f"fmt must be a jdls.FloatFormat (e.g. jdls.cbfloat16), got {fmt!r}")
    storage = fmt.storage_dtype

    def leaf(x: Any) -> Any:
        if isinstance(x, np.ndarray | jax.Array) and x.dtype == storage:
            return fmt.from_bits(x)
        return x

    return jax.tree_util.tree_map(leaf, tree)
