"""Cerebras' rule: back off when the fraction of overflowing steps exceeds a tolerance."""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jdls._numerics.checks import check_int, check_number
from jdls.rules._rule import Rule, check_bounds, check_counter

__all__ = ["OverflowTolerance"]

_F32 = jnp.float32
_I32 = jnp.int32


class OverflowToleranceState(NamedTuple):
    """The counters of :class:`OverflowTolerance` (int32 scalars).

    Attributes:
      counter: steps since the scale last changed (Cerebras' ``steps_since_rescale``).
      overflows: non-finite steps among them (``overflows_since_rescale``).
    """

    counter: jax.Array
    overflows: jax.Array


@dataclasses.dataclass(frozen=True)
class OverflowTolerance(Rule):
    """Count every step since the last change; back off when too many overflowed.

    Each step, ``counter`` and (on a non-finite step) ``overflows`` count up. When
    ``overflows / counter`` (in float32) exceeds ``tolerance`` the scale is multiplied by
    ``backoff_factor``; otherwise, once ``counter`` reaches ``growth_interval``, by
    ``growth_factor``. Either change restarts both counters. The scale is clamped to
    ``[min_loss_scale, max_loss_scale]`` after every step, and the initial scale to the
    maximum.

    Args:
      growth_factor: multiplier on growth, > 1.
      backoff_factor: multiplier on backoff, in (0, 1).
      growth_interval: steps since the last change that trigger a growth, >= 1.
      min_loss_scale: lower clamp (None: none).
      max_loss_scale: upper clamp (None: none).
      tolerance: tolerated fraction of non-finite steps, >= 0.

    Example:
      >>> import jdls
      >>> rule = jdls.rules.OverflowTolerance(tolerance=0.5, growth_interval=10)
      >>> scale = jdls.DynamicScale(64.0, rule)
      >>> float(scale.adjust(True).adjust(False).loss_scale)  # 1 overflow in 2 steps: kept
      64.0
    """

    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2001
    min_loss_scale: float | None = 2.0**-14
    max_loss_scale: float | None = 2.0**15
    tolerance: float = 0.0

    State = OverflowToleranceState

    def __post_init__(self) -> None:
        growth = check_number("growth_factor", self.growth_factor)
        if not (math.isfinite(growth) and growth > 1):
            raise ValueError(f"growth_factor must be > 1, got {self.growth_factor!r}")
        backoff = check_number("backoff_factor", self.backoff_factor)
        if not 0 < backoff < 1:
            raise ValueError(f"backoff_factor must be in the open interval (0, 1), got {backoff!r}")
        check_int("growth_interval", self.growth_interval, 1)
        check_bounds(self.min_loss_scale, self.max_loss_scale)
        tol = check_number("tolerance", self.tolerance)
        if not (math.isfinite(tol) and tol >= 0):
            raise ValueError(f"tolerance must be >= 0, got {tol!r}")

    def initial_state(  # type: ignore[override]
        self, counter: int = 0, overflows: int = 0
    ) -> OverflowToleranceState:
        """Counters to start from (default: a fresh run).

        Example:
          >>> import jdls
          >>> int(jdls.rules.OverflowTolerance().initial_state(counter=3).counter)
          3
        """
        counter = check_counter(counter, self.growth_interval)
        overflows = check_int("overflows", overflows, 0)
        return OverflowToleranceState(jnp.asarray(counter, _I32), jnp.asarray(overflows, _I32))

    def start(self, loss_scale: float) -> float:
        """The initial scale, clamped to the maximum as Cerebras does."""
        if self.max_loss_scale is not None:
            return min(loss_scale, self.max_loss_scale)
        return loss_scale

    def adjust(
        self, loss_scale: jax.Array, state: OverflowToleranceState, finite: jax.Array
    ) -> tuple[jax.Array, OverflowToleranceState]:
        """The next scale and counters (pure; see the class docstring for the rule)."""
        counted = state.counter + 1
        overflows = state.overflows + (~finite).astype(_I32)
        backoff = overflows.astype(_F32) / counted.astype(_F32) > _F32(self.tolerance)
        grow = ~backoff & (counted >= self.growth_interval)
        new_scale = jnp.where(
            backoff,
            loss_scale * _F32(self.backoff_factor),
            jnp.where(grow, loss_scale * _F32(self.growth_factor), loss_scale),
        )
        if self.max_loss_scale is not None:
            new_scale = jnp.minimum(new_scale, _F32(self.max_loss_scale))
        if self.min_loss_scale is not None:
            new_scale = jnp.maximum(new_scale, _F32(self.min_loss_scale))
        changed = backoff | grow
        return new_scale.astype(_F32), OverflowToleranceState(
            jnp.where(changed, _I32(0), counted), jnp.where(changed, _I32(0), overflows)
        )

    def back_off(
        self, loss_scale: jax.Array, state: OverflowToleranceState
    ) -> tuple[jax.Array, OverflowToleranceState]:
        """:meth:`adjust` on an overflow after as many overflows as push the fraction above
        ``tolerance`` (the counters restart at the backoff, so their number does not matter);
        with ``tolerance >= 1`` no number does: one overflow."""
        if self.tolerance >= 1:
            return self.adjust(loss_scale, state, jnp.zeros((), jnp.bool_))
        every = state._replace(overflows=state.counter)  # every step since the change overflowed
        return self.adjust(loss_scale, every, jnp.zeros((), jnp.bool_))
