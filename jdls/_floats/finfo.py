"""Machine limits of an emulated float format (:class:`FormatInfo`), as ``ml_dtypes.finfo``."""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from jdls._floats.formats import FloatFormat

__all__ = ["FormatInfo", "format_info"]


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
