"""The interface every scale-update rule implements.

A rule is static configuration (a frozen dataclass: changing it recompiles). The changing part,
its counters, is a small pytree of arrays that :class:`jdls.DynamicScale` carries beside the
loss scale. ``adjust`` maps (loss scale, counters, was the step finite?) to the next pair, and
must be pure and traceable (it runs inside ``jit``, ``vmap`` and ``lax.cond``). jdls traces
it once per rule and shapes and keeps the trace: inlined in a jitted step, one compiled
program when called eagerly (a rule that does not hash runs as written, every call). Rules
that compare equal share the trace, so every field the arithmetic reads takes part in the
dataclass's equality (no ``compare=False``).
"""

from __future__ import annotations

import math
from typing import Any, ClassVar

import jax
import jax.numpy as jnp

from jdls._numerics.checks import check_int, check_positive_finite

__all__ = ["Rule", "check_bounds", "check_counter", "check_within"]


class Rule:
    """Base class of the rules of :class:`jdls.DynamicScale`.

    A new rule is a frozen dataclass subclass in a file of its own in ``jdls/rules/`` that
    implements :meth:`initial_state`, :meth:`start` and :meth:`adjust` (and :meth:`check`
    when it has a host-side error to raise); a preset is then a function choosing its
    parameters. See docs/contributing.md.

    Example:
      >>> import jdls
      >>> rule = jdls.rules.GrowBackoff(growth_interval=2)
      >>> isinstance(rule, jdls.rules.Rule)
      True
    """

    min_loss_scale: float | None = None
    max_loss_scale: float | None = None
    #: Whether the rule uses the largest magnitude of the gradients (:meth:`observe`):
    #: every jdls path that adjusts a scale measures it for rules that set this, and
    #: :meth:`jdls.DynamicScale.adjust` refuses a finite step of such a rule without it.
    observes: ClassVar[bool] = False

    @property
    def bounds(self) -> tuple[float | None, float | None]:
        """``(min_loss_scale, max_loss_scale)``; None where there is no bound."""
        return self.min_loss_scale, self.max_loss_scale

    def initial_state(self, **counts: Any) -> Any:
        """The rule's counters (a pytree of int32 scalars): fresh, or from ``counts``."""
        raise NotImplementedError

    def start(self, loss_scale: float) -> float:
        """The initial loss scale the rule accepts for ``loss_scale`` (or a ValueError)."""
        return loss_scale

    def adjust(self, loss_scale: jax.Array, state: Any, finite: jax.Array) -> tuple[jax.Array, Any]:
        """The next loss scale and counters after a step whose gradients were ``finite``."""
        raise NotImplementedError

    def back_off(self, loss_scale: jax.Array, state: Any) -> tuple[jax.Array, Any]:
        """The scale and counters after as many overflows as it takes the rule to back off
        (the scale a retry recomputes at): one overflow by default, :meth:`adjust` with
        ``finite`` False. A rule that forgives overflows (hysteresis, a tolerance)
        counts the ones it forgives at once, so that a retry never recomputes at the same
        scale (unless the scale is at its minimum)."""
        return self.adjust(loss_scale, state, jnp.zeros((), jnp.bool_))

    def observe(
        self, loss_scale: jax.Array, state: Any, finite: jax.Array, grad_amax: jax.Array
    ) -> tuple[jax.Array, Any]:
        """:meth:`adjust` given also ``grad_amax``, the largest magnitude of the unscaled
        gradients of the step (default: ignores it)."""
        del grad_amax
        return self.adjust(loss_scale, state, finite)

    def looks_for_flushed(self, state: Any) -> jax.Array:
        """Whether the rule, on a step whose gradients are all zero, would raise the scale to
        look for gradients that flushed (a bool, traceable): then such a step of a loss that
        is not zero is skipped (``jdls.SkipCause.UNDERFLOW``) rather than counted.
        Default: never; :class:`Adaptive` before its first measurement."""
        del state
        return jnp.zeros((), jnp.bool_)

    def check(self, loss_scale: jax.Array, state: Any) -> None:
        """Raise on the host if the counters record an error the rule reports (default: none)."""
        del loss_scale, state


def check_bounds(low: float | None, high: float | None) -> None:
    """Validate a pair of optional scale bounds: each a normal float32 > 0, low <= high."""
    if low is not None:
        check_positive_finite("min_loss_scale", low)
    if high is not None:
        check_positive_finite("max_loss_scale", high)
    if low is not None and high is not None and low > high:
        raise ValueError(
            f"min_loss_scale must be <= max_loss_scale, got min_loss_scale={low!r} > "
            f"max_loss_scale={high!r}"
        )


def check_within(loss_scale: float, low: float | None, high: float | None) -> None:
    """An initial scale must lie within the rule's bounds."""
    lo = -math.inf if low is None else low
    hi = math.inf if high is None else high
    if not lo <= loss_scale <= hi:
        raise ValueError(
            f"loss_scale must be within [min_loss_scale, max_loss_scale] = [{low!r}, {high!r}], "
            f"got {loss_scale!r}: start inside the bounds, or widen them (None for no bound)"
        )


def check_counter(counter: int, growth_interval: int) -> int:
    """A restored growth counter: an int in ``[0, growth_interval)``."""
    counter = check_int("counter", counter, 0)
    if counter >= growth_interval:
        raise ValueError(f"counter must be < growth_interval ({growth_interval}), got {counter}")
    return counter
