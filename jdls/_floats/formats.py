"""Emulated float formats: :class:`FloatFormat`, :data:`cbfloat16` and their machine limits
(:class:`FormatInfo`). Looking a format up by name or dtype is in ``lookup``, 16-bit storage
of a tree in ``storage``.

A :class:`FloatFormat` is an IEEE-754 style binary format (sign, exponent, mantissa bits;
subnormals, signed zeros, inf and NaN) whose values live in float32 arrays; the rounding,
encoding and decoding kernels are in ``jdls._floats.bits``. How the emulation is exact, which formats
are accepted and where float32 subnormals meet XLA's flush-to-zero: docs/formats.md.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, TypeVar

import jax
import jax.numpy as jnp
import numpy as np

from jdls._floats.bits import from_bits_fn, round_float64, round_fn, storage_dtype, to_bits_fn
from jdls._numerics.checks import I32_MAX, check_int

__all__ = ["FloatFormat", "FormatInfo", "cbfloat16", "format_info"]

T = TypeVar("T")


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
      ValueError: an argument is outside the ranges above (float32 could not hold the format).

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
        # check_int checks the type; the ranges are checked below, with their reasons.
        e = check_int("exponent_bits", exponent_bits, -I32_MAX)
        m = check_int("mantissa_bits", mantissa_bits, -I32_MAX)
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
        b = 2 ** (e - 1) - 1 if bias is None else check_int("bias", bias, -I32_MAX)
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
        return storage_dtype(self.bits)

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
        return format_info(self)

    # -- conversions -----------------------------------------------------------------------

    def round(self, x: Any) -> jax.Array:
        """Rounds values to the nearest value of this format.

        Round to nearest, ties to even; values at or beyond the overflow threshold
        ``(2 - 2**-(mantissa_bits + 1)) * 2**emax`` become ``+-inf``; gradual underflow
        through subnormals; signed zeros kept; NaN returned unchanged. Exact on every
        backend (integer operations on the float32 bit pattern); works under ``jax.jit`` and
        ``jax.vmap``; its derivative is the identity (straight-through).

        Args:
          x: a float32, float16 or bfloat16 array (the latter two converted to float32
            exactly), or a Python float or list of them (or a ``np.float64`` scalar), which
            is rounded once, exactly, from its float64 value on the host. float64 arrays
            are rejected: convert them to float32 first.

        Returns:
          A float32 array of the same shape holding values of this format.

        Raises:
          TypeError: ``x`` is not floating-point, or is a float64 array.

        Example:
          >>> import jax.numpy as jnp
          >>> import jdls
          >>> x = jnp.array([1.0 + 2.0**-10, 3e-12, 2.0**-40])  # tie, subnormal, tie at 0
          >>> [float(v) / 2.0**-39 for v in jdls.cbfloat16.round(x)][1:]  # in subnormal steps
          [2.0, 0.0]
          >>> float(jdls.cbfloat16.round(x)[0])
          1.0
          >>> float(jdls.FloatFormat(5, 10).round(1 + 2**-11 + 2**-40))  # not a tie in float64
          1.0009765625
        """
        e, m, bias = self.exponent_bits, self.mantissa_bits, self.bias
        host = _as_float64(x)
        if host is not None:
            return jnp.asarray(round_float64(host, e, m, bias))
        return round_fn(e, m, bias)(_as_float32(x, "round"))

    def to_bits(self, x: Any) -> jax.Array:
        """Encodes values in this format (after rounding them with :meth:`round`).

        NaN is encoded as the canonical quiet NaN: sign 0, all-ones exponent, mantissa with
        only its top bit set (``0x7E00`` for float16 as in numpy; ``0x7F00`` for cbfloat16).

        Args:
          x: as for :meth:`round`.

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
        if _as_float64(x) is not None:
            x = self.round(x)  # rounded once on the host; to_bits keeps it as it is
        fn = to_bits_fn(self.exponent_bits, self.mantissa_bits, self.bias)
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
        return from_bits_fn(self.exponent_bits, self.mantissa_bits, self.bias)(arr)


def _as_float64(x: Any) -> np.ndarray | None:
    """``x`` as a float64 array if it is a Python float or a list of them, else None."""
    if isinstance(x, float):  # np.float64 too
        return np.asarray(x, np.float64)
    if isinstance(x, list | tuple):
        try:
            arr = np.asarray(x)
        except (TypeError, ValueError):  # e.g. a list of tracers: jnp.asarray handles it
            return None
        if arr.dtype == np.float64:
            return arr
    return None


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
# cbfloat16 and machine limits.
# --------------------------------------------------------------------------------------------


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
def format_info(fmt: FloatFormat) -> FormatInfo:
    """The :class:`FormatInfo` of ``fmt`` (cached: one object per format)."""
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


cbfloat16 = FloatFormat(6, 9, name="cbfloat16")
"""Cerebras CB16: 1 sign, 6 exponent, 9 mantissa bits, **bias 31 (assumed)**.

Cerebras documents the bit widths only; jdls assumes the IEEE-754 reading (bias 31,
subnormals, inf/NaN): docs/formats.md, "cbfloat16 and its bias". For another bias use
``jdls.FloatFormat(6, 9, bias=..., name=...)``.
"""
