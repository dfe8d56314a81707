"""The classic rule: back off on an overflow, grow after a run of finite steps, with hysteresis.

The rule of PyTorch, Flax, jmp, Keras, DeepSpeed and Megatron-LM; each preset in
:mod:`jdls.presets` is this rule with particular parameters.
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jdls._numerics.checks import check_int, check_number
from jdls._numerics.scalars import pick
from jdls.rules._rule import Rule, check_bounds, check_counter

__all__ = ["GrowBackoff", "MinimumScaleError"]

_F32 = jnp.float32
_I32 = jnp.int32


class MinimumScaleError(RuntimeError):
    """Raised by :meth:`jdls.DynamicScale.check` when an overflow happened at the minimum scale.

    DeepSpeed stops the run there; jdls cannot raise inside a compiled step, so the rule
    counts the event on device and ``check()`` raises it on the host.
    """


class GrowBackoffState(NamedTuple):
    """The counters of :class:`GrowBackoff` (int32 scalars).

    Attributes:
      counter: steps counted towards the next growth.
      hysteresis: non-finite steps still forgiven before a backoff.
      min_scale_overflows: backoffs wanted while the scale was at its minimum (counted only
        with ``error_at_min_scale``).
    """

    counter: jax.Array
    hysteresis: jax.Array
    min_scale_overflows: jax.Array


@dataclasses.dataclass(frozen=True)
class GrowBackoff(Rule):
    """Back off on a non-finite step, grow after ``growth_interval`` finite steps.

    On a **finite** step the counter counts it; when it reaches ``growth_interval`` the scale
    is multiplied by ``growth_factor`` (not above ``max_loss_scale``) and the counter restarts
    at ``counter_after_growth``. On a **non-finite** step the counter restarts at 0 and one
    unit of hysteresis is used; once none is left (``hysteresis=1``: none at all) the scale is
    multiplied by ``backoff_factor`` (divided by ``growth_factor`` when it is None), not below
    ``min_loss_scale``. The hysteresis refills on growth (on every finite step with
    ``refill_hysteresis_on_finite``), so ``hysteresis=h`` forgives ``h - 1`` overflows between
    two growths, consecutive or not.

    Args:
      growth_factor: multiplier on growth, > 1.
      backoff_factor: multiplier on backoff, in (0, 1); None divides by ``growth_factor``.
      growth_interval: counted steps (the current one included) that trigger a growth, >= 1.
      counter_after_growth: the counter right after a growth, 0 or 1 (DeepSpeed: 1).
      min_loss_scale: lower clamp applied on backoff (None: none).
      max_loss_scale: upper clamp applied on growth (None: none).
      keep_scale_if_growth_overflows: a growth whose float32 result is inf keeps the old
        scale; otherwise, without a maximum, the scale may become inf (Keras, DeepSpeed and
        Megatron-LM do this).
      hysteresis: overflows forgiven between growths plus one, >= 1.
      refill_hysteresis_on_finite: refill the hysteresis on every finite step (DeepSpeed's
        ``consecutive_hysteresis``: then ``hysteresis`` counts non-finite steps in a row).
      error_at_min_scale: a backoff wanted at ``min_loss_scale`` is an error, raised by
        :meth:`jdls.DynamicScale.check` (DeepSpeed's ``raise_error_at_min_scale``).

    Example:
      >>> import jdls
      >>> scale = jdls.DynamicScale(1024.0, jdls.rules.GrowBackoff(growth_interval=2))
      >>> float(scale.adjust(True).adjust(True).loss_scale)
      2048.0
    """

    growth_factor: float = 2.0
    backoff_factor: float | None = 0.5
    growth_interval: int = 2000
    counter_after_growth: int = 0
    min_loss_scale: float | None = 1.0
    max_loss_scale: float | None = 2.0**24
    keep_scale_if_growth_overflows: bool = True
    hysteresis: int = 1
    refill_hysteresis_on_finite: bool = False
    error_at_min_scale: bool = False

    State = GrowBackoffState

    def __post_init__(self) -> None:
        growth = check_number("growth_factor", self.growth_factor)
        if not (math.isfinite(growth) and growth > 1):
            raise ValueError(f"growth_factor must be > 1, got {self.growth_factor!r}")
        if self.backoff_factor is not None:
            backoff = check_number("backoff_factor", self.backoff_factor)
            if not 0 < backoff < 1:
                raise ValueError(
                    f"backoff_factor must be in the open interval (0, 1), got {backoff!r}"
                )
        check_int("growth_interval", self.growth_interval, 1)
        if self.counter_after_growth not in (0, 1):
            raise ValueError(
                f"counter_after_growth must be 0 or 1, got {self.counter_after_growth!r}"
            )
        check_bounds(self.min_loss_scale, self.max_loss_scale)
        check_int("hysteresis", self.hysteresis, 1)
        if self.error_at_min_scale and self.min_loss_scale is None:
            raise ValueError("error_at_min_scale=True needs a min_loss_scale, got None")

    def initial_state(  # type: ignore[override]
        self, counter: int = 0, hysteresis: int | None = None
    ) -> GrowBackoffState:
        """Counters to start from (default: a fresh run).

        Args:
          counter: steps already counted towards the next growth, in
            ``[0, growth_interval)``.
          hysteresis: hysteresis left, in ``[1, self.hysteresis]`` (default: full).

        Example:
          >>> import jdls
          >>> int(jdls.rules.GrowBackoff().initial_state(counter=5).counter)
          5
        """
        counter = check_counter(counter, self.growth_interval)
        left = self.hysteresis if hysteresis is None else check_int("hysteresis", hysteresis, 1)
        if left > self.hysteresis:
            raise ValueError(
                f"hysteresis must be in [1, {self.hysteresis}] (the rule's hysteresis), got {left}"
            )
        return GrowBackoffState(
            jnp.asarray(counter, _I32), jnp.asarray(left, _I32), jnp.zeros((), _I32)
        )

    def adjust(
        self, loss_scale: jax.Array, state: GrowBackoffState, finite: jax.Array
    ) -> tuple[jax.Array, GrowBackoffState]:
        """The next scale and counters (pure; see the class docstring for the rule)."""
        overflow = ~finite
        counted = state.counter + 1
        grow = finite & (counted >= self.growth_interval)
        backoff = overflow & (state.hysteresis <= 1)

        grown = loss_scale * _F32(self.growth_factor)
        if self.keep_scale_if_growth_overflows:
            grown = pick(jnp.isfinite(grown), grown, loss_scale)
        if self.max_loss_scale is not None:
            grown = jnp.minimum(grown, _F32(self.max_loss_scale))
        if self.backoff_factor is None:
            # ``scale / factor`` as XLA compiles a division by a constant: a multiplication by
            # the float32 reciprocal, written out so that eager and jitted bits agree.
            backed_off = loss_scale * (np.float32(1.0) / np.float32(self.growth_factor))
        else:
            backed_off = loss_scale * _F32(self.backoff_factor)
        if self.min_loss_scale is not None:
            backed_off = jnp.maximum(backed_off, _F32(self.min_loss_scale))
        new_scale = pick(backoff, backed_off, pick(grow, grown, loss_scale))

        counter = pick(overflow, _I32(0), pick(grow, _I32(self.counter_after_growth), counted))
        refill = grow | finite if self.refill_hysteresis_on_finite else grow
        hysteresis = pick(
            refill,
            _I32(self.hysteresis),
            pick(overflow, jnp.maximum(state.hysteresis - 1, _I32(1)), state.hysteresis),
        )
        at_min = state.min_scale_overflows
        if self.error_at_min_scale:
            at_min = at_min + (backoff & (loss_scale == _F32(self.min_loss_scale))).astype(_I32)
        return new_scale.astype(_F32), GrowBackoffState(
            counter.astype(_I32), hysteresis.astype(_I32), at_min
        )

    def back_off(
        self, loss_scale: jax.Array, state: GrowBackoffState
    ) -> tuple[jax.Array, GrowBackoffState]:
        """:meth:`adjust` on an overflow with the hysteresis left used up: the overflows it
        would forgive are counted at once, so the scale backs off now (the same scale and
        counters as that many non-finite steps in a row)."""
        used_up = state._replace(hysteresis=jnp.ones_like(state.hysteresis))
        return self.adjust(loss_scale, used_up, jnp.zeros((), jnp.bool_))

    def check(self, loss_scale: jax.Array, state: GrowBackoffState) -> None:
        """Raise :class:`MinimumScaleError` if an overflow wanted a backoff at the minimum."""
        del loss_scale
        if not self.error_at_min_scale:
            return
        count = int(np.sum(jax.device_get(state.min_scale_overflows)))  # batched scales too
        if count:
            raise MinimumScaleError(
                f"the loss scale is already at its minimum ({self.min_loss_scale}) and "
                f"{count} step(s) overflowed there: gradients overflow even unscaled. Look for "
                "the source of the inf/NaN (jdls.stats, jdls.nonfinite_paths), lower "
                "min_loss_scale, or pass raise_error_at_min_scale=False."
            )
