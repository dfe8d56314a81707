"""Delayed scaling: each tensor's scale comes from the amaxes of the steps before.

The state of one tensor is its scale and a history of its last ``history_length`` amaxes.
A step quantizes with the scale in the state; its measured amax then enters the history,
and the scale of the next step is computed from the history's maximum (``"max"``) or its
newest entry (``"most_recent"``). The history's layout is Flax's: the newest amax at index 0.

An amax that is inf or NaN (the step overflowed) does not enter the history, so the next
finite step's scale follows the tensor again. (Flax and TransformerEngine write it into the
history, where it keeps the old scale for a whole window.)

References:
  TransformerEngine ``DelayedScaling`` recipe (``amax_history_len``, ``amax_compute_algo``,
  ``margin``; the scaling factor ``(FP8_MAX / amax) / 2**margin``); Flax
  ``flax/linen/fp8_ops.py`` (``compute_scale``, ``compute_amax_history``).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

import jax
import jax.numpy as jnp
from flax import struct

from jdls.fp8._formats import Formats, format_max
from jdls.fp8._recipe import (
    Measurement,
    Quantized,
    Role,
    canonical_compute_dtype,
    check_role,
    element_format,
    quantize_with_scale,
    rescaled_history_state,
    scale_from_amax,
)

__all__ = ["DelayedScaling", "DelayedState"]


@struct.dataclass
class DelayedState:
    """The state of one tensor under delayed scaling.

    Attributes:
      scale: float32 scalar, the dequantization scale of the next step.
      history: float32 ``[history_length]``, the amaxes of the last steps, newest first.
    """

    scale: jax.Array
    history: jax.Array


@dataclasses.dataclass(frozen=True)
class DelayedScaling:
    """Per-tensor delayed scaling: the scale of step t comes from the amaxes of earlier steps.

    Args:
      history_length: how many steps' amaxes are kept.
      algorithm: ``"max"`` (the history's maximum) or ``"most_recent"`` (its newest entry).
      margin: the scaling factor ``fmax / amax`` is divided by ``2**margin``.
      power_of_two: round the scaling factor down to a power of two (the scale up), so that
        scaling is exact.
      formats: the element formats (a :class:`jdls.fp8.Formats` or its name, e.g.
        ``"hybrid"``, ``"e4m3"``, ``"fnuz"``).
      compute_dtype: dtype of the quantization arithmetic and of the dot's accumulation;
        ``None`` uses the operands' dtype (Flax's choice).
      dequantize_first: dequantize both operands, then multiply them in ``compute_dtype``
        (Flax's quantize-dequantize ops); by default the float8 values are multiplied and the
        product is scaled once.

    Example:
      >>> import jax.numpy as jnp, jdls
      >>> recipe = jdls.fp8.DelayedScaling(history_length=4)
      >>> state = recipe.init("lhs")
      >>> m = jdls.fp8.Measurement(jnp.float32(3.5), jnp.float32(0), jnp.float32(0))
      >>> state = recipe.update(state, m, "lhs")
      >>> state.history.tolist(), float(state.scale)  # 3.5 / 448
      ([3.5, 0.0, 0.0, 0.0], 0.0078125)
    """

    history_length: int = 1024
    algorithm: Literal["max", "most_recent"] = "max"
    margin: float = 0
    power_of_two: bool = False
    formats: Formats | str = "hybrid"
    compute_dtype: Any = jnp.float32
    dequantize_first: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.history_length, int) or self.history_length < 1:
            raise ValueError(f"history_length must be a positive int, got {self.history_length!r}")
        if self.algorithm not in ("max", "most_recent"):
            raise ValueError(f"algorithm must be 'max' or 'most_recent', got {self.algorithm!r}")
        object.__setattr__(self, "formats", Formats.parse(self.formats))
        object.__setattr__(self, "compute_dtype", canonical_compute_dtype(self.compute_dtype))

    @property
    def requantize_backward(self) -> bool:
        return False

    def init(self, role: Role) -> DelayedState:
        """Scale 1 and an empty (zero) history, as Flax and TransformerEngine start."""
        check_role(role)
        return DelayedState(
            scale=jnp.ones((), jnp.float32),
            history=jnp.zeros((self.history_length,), jnp.float32),
        )

    def quantize(
        self, x: jax.Array, state: DelayedState, role: Role, axes: tuple[int, ...] = ()
    ) -> tuple[Quantized, Measurement]:
        """Quantizes ``x`` with the scale held in ``state``."""
        del axes  # one scale for the whole tensor
        fmt = element_format(self.formats, role)
        return quantize_with_scale(x, state.scale, fmt, self.compute_dtype)

    def rescaled(self, state: DelayedState, factor: jax.Array) -> DelayedState:
        """``state`` for a tensor multiplied by ``factor`` (a loss scale): see
        :func:`rescaled_history_state`."""
        return rescaled_history_state(state, factor)

    def update(
        self, state: DelayedState, measurement: Measurement, role: Role, skipped: Any = False
    ) -> DelayedState:
        """Records a finite amax in the history and computes the next scale from it."""
        del skipped  # the measured amaxes hold whether or not the step was applied
        check_role(role)
        amax = measurement.amax
        # Rank-polymorphic: a stack of states (one per scanned layer) updates at once.
        pushed = jnp.roll(state.history, -1, axis=-1).at[..., 0].set(amax)
        history = jnp.where(jnp.isfinite(amax)[..., None], pushed, state.history)
        chosen = jnp.max(history, axis=-1) if self.algorithm == "max" else history[..., 0]
        fmax = format_max(element_format(self.formats, role))
        scale = scale_from_amax(chosen, state.scale, fmax, self.margin, self.power_of_two)
        return DelayedState(scale=scale, history=history)
