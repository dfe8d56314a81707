"""A float format by name or dtype: ``finfo`` (the machine limits of an emulated format or of
a native dtype) and ``canonical_format`` (one object per format, however it is spelled)."""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np

from jdls._floats.formats import FloatFormat, FormatInfo, cbfloat16

__all__ = ["canonical_format", "finfo"]

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


def canonical_format(dtype: Any) -> np.dtype | FloatFormat:
    """The one spelling of a float format that static configuration keeps.

    Equal formats spelled differently (``jnp.float16``, ``np.dtype("float16")``,
    ``"float16"``; ``"cbfloat16"`` and ``jdls.cbfloat16``) become one value, so that the
    objects holding them compare, hash and key ``jax.jit``'s cache alike: a
    :class:`FloatFormat` for an emulated format (given as one, or by the name
    ``"cbfloat16"``), else numpy's dtype object.

    Args:
      dtype: anything :func:`finfo` accepts.

    Returns:
      ``dtype`` as a :class:`FloatFormat` or a ``numpy.dtype``.

    Raises:
      TypeError: ``dtype`` is not a floating-point type or format.

    Example:
      >>> import jax.numpy as jnp, numpy as np, jdls
      >>> from jdls._floats.lookup import canonical_format
      >>> canonical_format(jnp.float16) == canonical_format("float16") == np.dtype("float16")
      True
      >>> canonical_format("cbfloat16") is jdls.cbfloat16
      True
    """
    if isinstance(dtype, FloatFormat):
        return dtype
    info = finfo(dtype)  # a clear error for anything else
    if isinstance(info, FormatInfo):  # a name: "cbfloat16"
        return info.dtype
    return np.dtype(info.dtype)
