"""Reference state machines, written line by line from ``shared/reference/scaling-policies.md``.

They are deliberately independent of jdls's general mechanism: plain Python, one class per
library, arithmetic in float32 (numpy) where the library computes in float32 and in Python
floats (float64) where the library does (DeepSpeed). Each ``step(finite)`` returns the new
loss scale. Real peers (torch's kernel, Flax, jmp) are driven in ``test_presets.py``.
"""

from __future__ import annotations

import numpy as np

f32 = np.float32


def _f32(x: float) -> np.float32:
    """Round to float32 and flush subnormals to zero, as XLA does on CPU and GPU."""
    with np.errstate(over="ignore"):
        y = f32(x)
    if 0 < abs(y) < np.finfo(np.float32).tiny:
        return f32(0.0)
    return y


class Keras:
    def __init__(self, initial_scale=2.0**15, dynamic_growth_steps=2000):
        self.dynamic_scale = _f32(initial_scale)
        self.step_counter = 0
        self.dynamic_growth_steps = dynamic_growth_steps

    def step(self, finite):
        if finite:
            if self.step_counter == self.dynamic_growth_steps - 1:
                with np.errstate(over="ignore"):
                    self.dynamic_scale = _f32(self.dynamic_scale * f32(2.0))
                self.step_counter = 0
            else:
                self.step_counter += 1
        else:
            self.dynamic_scale = _f32(self.dynamic_scale / f32(2.0))
            self.step_counter = 0
        return self.dynamic_scale


class DeepSpeed:
    """DynamicLossScaler: Python float arithmetic (float64), as in DeepSpeed."""

    def __init__(
        self,
        init_scale=2.0**32,
        scale_factor=2.0,
        scale_window=1000,
        min_scale=1.0,
        delayed_shift=2,
        consecutive_hysteresis=False,
        raise_error_at_min_scale=True,
    ):
        self.cur_scale = float(init_scale)
        self.cur_iter = 0
        self.last_overflow_iter = -1
        self.scale_factor = scale_factor
        self.scale_window = scale_window
        self.min_scale = min_scale
        self.delayed_shift = delayed_shift
        self.cur_hysteresis = delayed_shift
        self.consecutive_hysteresis = consecutive_hysteresis
        self.raise_error_at_min_scale = raise_error_at_min_scale
        self.errors = 0

    def step(self, finite):
        if not finite:
            if self.delayed_shift == 1 or self.cur_hysteresis == 1:
                if self.cur_scale == self.min_scale and self.raise_error_at_min_scale:
                    self.errors += 1  # DeepSpeed raises here
                self.cur_scale = max(self.cur_scale / self.scale_factor, self.min_scale)
            else:
                self.cur_hysteresis -= 1
            self.last_overflow_iter = self.cur_iter
        else:
            if self.consecutive_hysteresis:
                self.cur_hysteresis = self.delayed_shift
            stable = (self.cur_iter - self.last_overflow_iter) - 1
            if stable > 0 and stable % self.scale_window == 0:
                if not self.consecutive_hysteresis:
                    self.cur_hysteresis = self.delayed_shift
                self.cur_scale = self.cur_scale * self.scale_factor
        self.cur_iter += 1
        return self.cur_scale


class Megatron:
    """DynamicGradScaler: float32 tensors."""

    def __init__(
        self,
        initial_scale=2.0**32,
        min_scale=1.0,
        growth_factor=2.0,
        backoff_factor=0.5,
        growth_interval=1000,
        hysteresis=2,
    ):
        self.scale = _f32(initial_scale)
        self.min_scale = _f32(min_scale)
        self.growth_factor = f32(growth_factor)
        self.backoff_factor = f32(backoff_factor)
        self.growth_interval = growth_interval
        self.hysteresis = hysteresis
        self.growth_tracker = 0
        self.hysteresis_tracker = hysteresis

    def step(self, finite):
        if not finite:
            self.growth_tracker = 0
            self.hysteresis_tracker -= 1
            if self.hysteresis_tracker <= 0:
                self.scale = max(_f32(self.scale * self.backoff_factor), self.min_scale)
        else:
            self.growth_tracker += 1
            if self.growth_tracker == self.growth_interval:
                self.growth_tracker = 0
                self.hysteresis_tracker = self.hysteresis
                with np.errstate(over="ignore"):  # no maximum: the scale may reach inf
                    self.scale = _f32(self.scale * self.growth_factor)
        return self.scale


class Cerebras:
    """cstorch.amp.GradScaler(loss_scale="dynamic"); the ratio is compared in float32."""

    def __init__(
        self,
        init_scale=None,
        steps_per_increase=2000,
        min_loss_scale=2.0**-14,
        max_loss_scale=2.0**15,
        overflow_tolerance=0.0,
    ):
        start = max_loss_scale if init_scale is None else init_scale
        self.loss_scale = min(_f32(start), _f32(max_loss_scale))
        self.steps_per_increase = steps_per_increase
        self.min_loss_scale = _f32(min_loss_scale)
        self.max_loss_scale = _f32(max_loss_scale)
        self.overflow_tolerance = f32(overflow_tolerance)
        self.steps_since_rescale = 0
        self.overflows_since_rescale = 0
        self.num_skipped_steps = 0

    def step(self, finite):
        self.num_skipped_steps += int(not finite)
        self.steps_since_rescale += 1
        self.overflows_since_rescale += int(not finite)
        ratio = f32(self.overflows_since_rescale) / f32(self.steps_since_rescale)
        if ratio > self.overflow_tolerance:
            self.loss_scale = _f32(self.loss_scale / f32(2.0))
            self.steps_since_rescale = 0
            self.overflows_since_rescale = 0
        if self.steps_since_rescale > self.steps_per_increase:
            self.loss_scale = _f32(self.loss_scale * f32(2.0))
            self.steps_since_rescale = 0
            self.overflows_since_rescale = 0
        self.loss_scale = min(self.loss_scale, self.max_loss_scale)
        self.loss_scale = max(self.loss_scale, self.min_loss_scale)
        return self.loss_scale


class PyTorch:
    """``_amp_update_scale_``, for when torch itself is absent (the kernel computes in double
    and rounds to float32 once; for float32-representable factors that equals float32)."""

    def __init__(
        self, init_scale=2.0**16, growth_factor=2.0, backoff_factor=0.5, growth_interval=2000
    ):
        self.scale = _f32(init_scale)
        self.growth_tracker = 0
        self.growth_factor = growth_factor
        self.backoff_factor = backoff_factor
        self.growth_interval = growth_interval

    def step(self, finite):
        if not finite:
            self.scale = _f32(float(self.scale) * self.backoff_factor)
            self.growth_tracker = 0
        else:
            n = self.growth_tracker + 1
            if n == self.growth_interval:
                candidate = _f32(float(self.scale) * self.growth_factor)
                if np.isfinite(candidate):
                    self.scale = candidate
                self.growth_tracker = 0
            else:
                self.growth_tracker = n
        return self.scale
