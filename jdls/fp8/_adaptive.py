"""Adaptive scaling: a delayed per-tensor scale chosen from what the last steps measured.

Delayed scaling trades one failure for another. With ``"max"`` over a long history one
gradient spike holds the scale far above the amax for the whole window (small values flush);
with ``"most_recent"`` every rise of the amax clips, and the step after a spike is scaled
for the spike. In FP8 the two errors do not cost the same: the formats are floating point, so
a scale a little too high only moves the flush threshold (a few of the smallest values),
while a scale too low clips the largest ones.

The recipe therefore keeps the last ``window`` finite amaxes (newest first) and maps
``headroom`` times a robust level of them to the format's maximum:

* an *outlier* is an amax more than ``outlier`` times the window's median, unless outliers
  are frequent (over a quarter of the window: then they are part of the distribution);
* the level is the largest of the newest ``recent`` (4) amaxes that are not outliers. A
  single spike is clipped where it happens (the scale had no way to know) and never coarsens
  the steps after it; a falling amax brings the scale down within ``recent`` steps;
* two outliers in a row are a jump, not a spike: from the second step on the level follows
  the run of outliers, so a lasting jump clips two steps;
* the headroom (2 by default, one binade) absorbs step-to-step noise and slow drift, so that
  steady training rarely clips, at the cost of one bit at the bottom of the range.

The cost is delayed scaling's: no pass over the tensor before the cast, one sort of
``window`` numbers per tensor per step.
"""

from __future__ import annotations

import dataclasses
from typing import Any

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

__all__ = ["AdaptiveScaling", "AdaptiveState", "robust_level"]


@struct.dataclass
class AdaptiveState:
    """The state of one tensor under adaptive scaling.

    Attributes:
      scale: float32 scalar, the dequantization scale of the next step.
      history: float32 ``[window]``, the finite amaxes of the last steps, newest first
        (0 where no step has been recorded yet).
    """

    scale: jax.Array
    history: jax.Array


def robust_level(history: jax.Array, outlier: float, recent: int) -> jax.Array:
    """The amax that the next step's scale is for, from ``history`` (newest first, 0 for
    empty entries); rank-polymorphic over leading axes, 0 when the history is empty.

    An entry more than ``outlier`` times the entries' median is an outlier, unless outliers
    are frequent (two or more, and more than a quarter of the entries: then they are part
    of the distribution). The level is the largest of the newest ``recent`` entries that are not
    outliers (of the whole window where the newest are all outliers); when the two newest
    entries are both outliers (a jump), the largest of the newest run of outliers.

    Example:
      >>> import jax.numpy as jnp
      >>> from jdls.fp8._adaptive import robust_level
      >>> float(robust_level(jnp.array([1e4, 2.0, 3.0, 2.5, 2.0]), 16.0, 4))  # a spike
      3.0
      >>> float(robust_level(jnp.array([300.0, 250.0, 3.0, 2.5, 2.0]), 16.0, 4))  # a jump
      300.0
      >>> float(robust_level(jnp.array([1.0, 1.5, 1.0, 1.0, 9.0]), 16.0, 4))  # forgotten
      1.5
    """
    window = history.shape[-1]
    present = history > 0
    count = jnp.sum(present, axis=-1, keepdims=True)
    ascending = jnp.sort(history, axis=-1)  # empty entries (0) first
    lower_median = jnp.clip(window - count + (count - 1) // 2, 0, window - 1)
    median = jnp.take_along_axis(ascending, lower_median, axis=-1)
    outliers = present & (history > outlier * median)
    n_outliers = jnp.sum(outliers, axis=-1, keepdims=True)
    frequent = (4 * n_outliers > count) & (n_outliers >= 2)
    outliers = outliers & ~frequent
    regular = present & ~outliers
    newest = jnp.arange(window) < recent
    level = jnp.max(jnp.where(regular & newest, history, 0.0), axis=-1)
    anywhere = jnp.max(jnp.where(regular, history, 0.0), axis=-1)
    level = jnp.where(level > 0, level, anywhere)
    run = jnp.cumprod(outliers, axis=-1).astype(bool)  # the newest entries, while outliers
    jump = run[..., 1]
    run_max = jnp.max(jnp.where(run, history, 0.0), axis=-1)
    return jnp.where(jump, jnp.maximum(level, run_max), level)


@dataclasses.dataclass(frozen=True)
class AdaptiveScaling:
    """Per-tensor delayed scaling that follows the amax and ignores its spikes.

    Each step quantizes with the scale in the state (as :class:`DelayedScaling`: no pass
    before the cast). The next scale maps ``headroom`` times a robust level of the last
    ``window`` finite amaxes to the format's maximum: the largest of the newest ``recent``
    amaxes that is not an outlier (more than ``outlier`` times the window's median, where
    outliers are rare), or, after two outliers in a row (a jump), the newest outliers'
    largest. A spike is clipped in its own step and forgotten; a jump is followed from the
    second step; a falling amax brings the scale down within ``recent`` steps. See
    docs/fp8.md for what it measures against delayed scaling.

    With a loss scale (``jdls.DynamicScale`` and a ``value_and_grad`` of jdls), the output
    gradient's history holds unscaled amaxes and its scale follows the loss scale, as every
    per-tensor recipe's does.

    Args:
      window: how many steps' amaxes are kept (at least 3): the median's window.
      recent: how many of the newest amaxes the level is taken from (default
        ``min(4, window)``).
      headroom: the level times ``headroom`` maps to the format's maximum (> 0; 2 is one
        binade of room above the level).
      outlier: an amax more than ``outlier`` times the window's median is a spike (> 1).
      power_of_two: round the scaling factor down to a power of two (the scale up).
      formats: the element formats (a :class:`jdls.fp8.Formats` or its name).
      compute_dtype: dtype of the quantization arithmetic and of the dot's accumulation;
        ``None`` uses the operands' dtype.
      dequantize_first: dequantize both operands, then multiply them in ``compute_dtype``.

    Example:
      >>> import jax.numpy as jnp, jdls
      >>> recipe = jdls.fp8.AdaptiveScaling(window=4)
      >>> state = recipe.init("grad")
      >>> for amax in (2.0, 1e4, 2.5):  # a spike between two ordinary steps
      ...     m = jdls.fp8.Measurement(jnp.float32(amax), jnp.float32(0), jnp.float32(0))
      ...     state = recipe.update(state, m, "grad")
      >>> round(float(state.scale) * 57344, 4)  # e5m2 maximum stands for 2 x 2.5: no spike
      5.0
    """

    window: int = 16
    recent: int | None = None
    headroom: float = 2.0
    outlier: float = 16.0
    power_of_two: bool = False
    formats: Formats | str = "hybrid"
    compute_dtype: Any = jnp.float32
    dequantize_first: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.window, int) or self.window < 3:
            raise ValueError(
                f"window must be an int >= 3 (the median needs a few steps), got {self.window!r}"
            )
        if self.recent is None:
            object.__setattr__(self, "recent", min(4, self.window))
        if not isinstance(self.recent, int) or not 1 <= self.recent <= self.window:
            raise ValueError(
                f"recent must be an int in [1, window={self.window}], got {self.recent!r}"
            )
        if not self.headroom > 0:
            raise ValueError(f"headroom must be > 0, got {self.headroom!r}; 2.0 is one binade")
        if not self.outlier > 1:
            raise ValueError(
                f"outlier must be > 1 (a multiple of the median amax), got {self.outlier!r}"
            )
        object.__setattr__(self, "formats", Formats.parse(self.formats))
        object.__setattr__(self, "compute_dtype", canonical_compute_dtype(self.compute_dtype))

    @property
    def requantize_backward(self) -> bool:
        return False

    def init(self, role: Role) -> AdaptiveState:
        """Scale 1 and an empty history, as delayed scaling starts."""
        check_role(role)
        return AdaptiveState(
            scale=jnp.ones((), jnp.float32), history=jnp.zeros((self.window,), jnp.float32)
        )

    def quantize(
        self, x: jax.Array, state: AdaptiveState, role: Role, axes: tuple[int, ...] = ()
    ) -> tuple[Quantized, Measurement]:
        """Quantizes ``x`` with the scale held in ``state``."""
        del axes  # one scale for the whole tensor
        fmt = element_format(self.formats, role)
        return quantize_with_scale(x, state.scale, fmt, self.compute_dtype)

    def rescaled(self, state: AdaptiveState, factor: jax.Array) -> AdaptiveState:
        """``state`` for a tensor multiplied by ``factor`` (a loss scale): see
        :func:`rescaled_history_state`."""
        return rescaled_history_state(state, factor)

    def update(
        self, state: AdaptiveState, measurement: Measurement, role: Role, skipped: Any = False
    ) -> AdaptiveState:
        """Records a finite amax in the history and computes the next scale from it."""
        del skipped  # the measured amaxes hold whether or not the step was applied
        check_role(role)
        amax = measurement.amax
        pushed = jnp.roll(state.history, 1, axis=-1).at[..., 0].set(amax)
        usable = jnp.isfinite(amax) & (amax > 0)
        history = jnp.where(usable[..., None], pushed, state.history)
        assert self.recent is not None  # set in __post_init__
        level = robust_level(history, self.outlier, self.recent)
        fmax = format_max(element_format(self.formats, role))
        scale = scale_from_amax(level * self.headroom, state.scale, fmax, 0, self.power_of_two)
        return AdaptiveState(scale=scale, history=history)
