"""FP8 element formats: which format each tensor is cast to, and its largest finite value.

An element format is either a float8 dtype of ``ml_dtypes`` (``jnp.float8_e4m3fn``,
``jnp.float8_e5m2``, their ``fnuz`` variants) or an emulated :class:`jdls.FloatFormat`, whose
values are held exactly in float32. :class:`Formats` names the format of the forward operands
and the format of the output gradient, the two roles every FP8 recipe distinguishes.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jdls._floats.formats import FloatFormat

__all__ = ["Formats", "cast", "format_max", "format_name"]

_FLOAT8 = {
    "e4m3": jnp.float8_e4m3fn,
    "e4m3fn": jnp.float8_e4m3fn,
    "e5m2": jnp.float8_e5m2,
    "e4m3fnuz": jnp.float8_e4m3fnuz,
    "e5m2fnuz": jnp.float8_e5m2fnuz,
}


def _element(fmt: Any) -> Any:
    """The element format named by ``fmt``: a float8 numpy dtype or a FloatFormat."""
    if isinstance(fmt, FloatFormat):
        return fmt
    if isinstance(fmt, str) and fmt.removeprefix("float8_") in _FLOAT8:
        return np.dtype(_FLOAT8[fmt.removeprefix("float8_")])
    try:
        dtype = np.dtype(fmt)
    except TypeError:
        dtype = None
    if dtype is not None and dtype.itemsize == 1 and jnp.issubdtype(dtype, jnp.floating):
        return dtype
    raise ValueError(
        f"an FP8 element format must be a float8 dtype (jnp.float8_e4m3fn, jnp.float8_e5m2, "
        f"jnp.float8_e4m3fnuz, jnp.float8_e5m2fnuz, or their names such as 'e4m3') or a "
        f"jdls.FloatFormat, got {fmt!r}"
    )


def format_name(fmt: Any) -> str:
    """A short name of an element format: ``'float8_e4m3fn'`` or the FloatFormat's name."""
    return fmt.name if isinstance(fmt, FloatFormat) else str(np.dtype(fmt))


def format_max(fmt: Any) -> float:
    """The largest finite value of an element format, as a Python float.

    Example:
      >>> import jax.numpy as jnp
      >>> from jdls.fp8 import format_max
      >>> format_max(jnp.float8_e4m3fn), format_max(jnp.float8_e5m2)
      (448.0, 57344.0)
    """
    if isinstance(fmt, FloatFormat):  # IEEE-style: the all-ones exponent is inf and NaN
        return (2.0 - 2.0**-fmt.mantissa_bits) * 2.0**fmt.emax
    return float(jnp.finfo(fmt).max)


def saturation_limit(fmt: Any) -> tuple[float, bool]:
    """Where clipping to the format's largest value ``fmax`` starts to change a value:
    ``(limit, inclusive)``. A value above ``fmax`` but below the midpoint to the next binade
    step (``fmax`` plus half its spacing) rounds to ``fmax`` anyway; the midpoint itself
    rounds away from ``fmax`` (round to nearest even) when ``fmax``'s last mantissa bit is
    odd. So ``|x| > limit`` (``>=`` when ``inclusive``) is what the clip changes.

    Example:
      >>> import jax.numpy as jnp
      >>> from jdls.fp8._formats import saturation_limit
      >>> saturation_limit(jnp.float8_e4m3fn), saturation_limit(jnp.float8_e5m2)
      ((464.0, False), (61440.0, True))
    """
    fmax = format_max(fmt)
    nmant = fmt.mantissa_bits if isinstance(fmt, FloatFormat) else int(jnp.finfo(fmt).nmant)
    _, exponent = math.frexp(fmax)  # fmax = f * 2**exponent, f in [0.5, 1)
    spacing = 2.0 ** (exponent - 1 - nmant)
    odd = int(fmax / spacing) % 2 == 1
    return fmax + spacing / 2, odd


def cast(x: jax.Array, fmt: Any) -> jax.Array:
    """Rounds ``x`` (already scaled and clipped) to the element format ``fmt``.

    A float8 dtype gives a float8 array; a :class:`jdls.FloatFormat` gives a float32 array
    holding the format's values exactly.
    """
    if isinstance(fmt, FloatFormat):
        return fmt.round(x.astype(jnp.float32))
    return x.astype(fmt)


@dataclasses.dataclass(frozen=True)
class Formats:
    """The element formats of an FP8 dot: ``forward`` for both operands, ``backward`` for the
    output gradient.

    The default is the "hybrid" choice of TransformerEngine and Flax: e4m3 (more precision)
    for activations and weights, e5m2 (more range) for gradients. ``Formats.parse`` reads the
    names ``"hybrid"``, ``"e4m3"`` (e4m3 everywhere, as DeepSeek-V3), ``"fnuz"`` (the
    ``fnuz`` variants of AMD MI300) and ``"e4m3fnuz"``.

    Args:
      forward: element format of the operands (a float8 dtype or a jdls.FloatFormat).
      backward: element format of the output gradient.

    Example:
      >>> import jdls
      >>> jdls.fp8.Formats.parse("e4m3")
      Formats(forward=float8_e4m3fn, backward=float8_e4m3fn)
    """

    forward: Any = jnp.float8_e4m3fn
    backward: Any = jnp.float8_e5m2

    def __post_init__(self) -> None:
        object.__setattr__(self, "forward", _element(self.forward))
        object.__setattr__(self, "backward", _element(self.backward))

    def __repr__(self) -> str:
        return (
            f"Formats(forward={format_name(self.forward)}, backward={format_name(self.backward)})"
        )

    @classmethod
    def parse(cls, spec: Formats | str) -> Formats:
        """A :class:`Formats` from itself or one of the names listed above."""
        if isinstance(spec, Formats):
            return spec
        named = {
            "hybrid": ("e4m3fn", "e5m2"),
            "e4m3": ("e4m3fn", "e4m3fn"),
            "fnuz": ("e4m3fnuz", "e5m2fnuz"),
            "e4m3fnuz": ("e4m3fnuz", "e4m3fnuz"),
        }
        if isinstance(spec, str) and spec in named:
            return cls(*named[spec])
        raise ValueError(
            f"formats must be a jdls.fp8.Formats or one of {sorted(named)}, got {spec!r}"
        )
