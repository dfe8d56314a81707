"""Recipes that reproduce other libraries' FP8 scaling, as data.

``flax_fp8_ops`` gives, on the same inputs, Flax's ``fp8_ops`` scales, amax histories,
outputs and gradients bit for bit (finite inputs; on an inf or NaN jdls keeps it out of the
history, where Flax keeps the old scale for a whole window). ``transformer_engine`` uses
TransformerEngine's delayed-scaling formulas: the same window of ``amax_history_len`` amaxes,
``max`` or ``most_recent``, and ``(FP8_MAX / amax) / 2**margin``.
"""

from __future__ import annotations

from typing import Literal

import jax.numpy as jnp

from jdls.fp8._delayed import DelayedScaling

__all__ = ["flax_fp8_ops", "transformer_engine"]


def flax_fp8_ops(
    amax_history_length: int = 1024,
    op: Literal["direct", "qdq", "nanoo"] = "direct",
) -> DelayedScaling:
    """The delayed scaling of Flax's ``fp8_ops`` (flax.linen).

    Args:
      amax_history_length: as Flax's ``Fp8DotGeneralBase.amax_history_length``.
      op: ``"direct"`` for ``Fp8DirectDotGeneralOp`` / ``Fp8Einsum`` (float8 operands
        multiplied, float8_e4m3fn / float8_e5m2), ``"qdq"`` for ``Fp8DotGeneralOp``
        (quantize, dequantize, then multiply), ``"nanoo"`` for ``NANOOFp8DotGeneralOp`` (the
        quantize-dequantize op with the ``fnuz`` formats).

    Returns:
      A :class:`jdls.fp8.DelayedScaling`: maximum over the history, no margin, the
      arithmetic in the operands' dtype.

    Example:
      >>> import jdls
      >>> recipe = jdls.fp8.flax_fp8_ops(16)
      >>> recipe.history_length, recipe.algorithm, recipe.compute_dtype
      (16, 'max', None)
    """
    if op not in ("direct", "qdq", "nanoo"):
        raise ValueError(f"op must be 'direct', 'qdq' or 'nanoo', got {op!r}")
    return DelayedScaling(
        history_length=amax_history_length,
        algorithm="max",
        margin=0,
        formats="fnuz" if op == "nanoo" else "hybrid",
        compute_dtype=None,
        dequantize_first=op != "direct",
    )


def transformer_engine(
    amax_history_len: int = 1024,
    amax_compute_algo: Literal["max", "most_recent"] = "max",
    margin: int = 0,
    fp8_format: Literal["HYBRID", "E4M3"] = "HYBRID",
) -> DelayedScaling:
    """TransformerEngine's ``DelayedScaling`` recipe, with its argument names and defaults.

    The quantization arithmetic and accumulation are float32. TE multiplies by the scaling
    factor where jdls divides by its reciprocal; the scaling factors are TE's.

    Example:
      >>> import jdls
      >>> recipe = jdls.fp8.transformer_engine(amax_compute_algo="most_recent")
      >>> recipe.history_length, recipe.algorithm
      (1024, 'most_recent')
    """
    formats = {"HYBRID": "hybrid", "E4M3": "e4m3"}
    if fp8_format not in formats:
        raise ValueError(
            f"fp8_format must be 'HYBRID' or 'E4M3' (TransformerEngine-JAX does not train in "
            f"pure E5M2), got {fp8_format!r}"
        )
    return DelayedScaling(
        history_length=amax_history_len,
        algorithm=amax_compute_algo,
        margin=margin,
        formats=formats[fp8_format],
        compute_dtype=jnp.float32,
    )
