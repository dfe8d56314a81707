"""A rule driven by measurements: the next scale puts this step's largest gradient just below
the compute format's maximum, with a headroom margin that adapts to the overflows it sees."""

from __future__ import annotations

import dataclasses
import math
from typing import Any, ClassVar, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from jdls._floats.formats import FloatFormat
from jdls._floats.lookup import canonical_format, finfo
from jdls._numerics.checks import check_int
from jdls._numerics.scalars import clamp, one_kernel, pick
from jdls.rules._rule import Rule, check_bounds, check_within

__all__ = ["Adaptive", "AdaptiveState"]

_F32 = jnp.float32
_I32 = jnp.int32
_EXP_MIN, _EXP_MAX = -126, 127  # the normal powers of two of float32
_NONE = -(2**30)  # AdaptiveState.settled before the rule settled anywhere


class AdaptiveState(NamedTuple):
    """The counters of :class:`Adaptive` (int32 scalars).

    Attributes:
      margin: headroom in bits kept between the predicted largest scaled gradient and the
        compute format's maximum.
      counter: finite steps since the start or the last overflow (saturating at ``2**30``;
        without measurements: since the last growth).
      overflows: non-finite steps in a row up to the last one.
      settled: the exponent of the scale the rule last settled on from evidence (the
        prediction of the last measurement, or the start it returns to after a look found
        only zeros); ``-2**30`` before either.
      looking: 1 when the last step raised the scale by the whole usable range to look for
        gradients that all flushed, else 0.
      learning: 1 during a run of overflows that began at a predicted scale soon after a
        measurement (the measurement may understate what the backward pass computes), else 0.
    """

    margin: jax.Array
    counter: jax.Array
    overflows: jax.Array
    settled: jax.Array
    looking: jax.Array
    learning: jax.Array


@dataclasses.dataclass(frozen=True)
class Adaptive(Rule):
    """Set the scale from the largest gradient of this step; back off on an overflow.

    With a measurement (``scale.adjust(finite, grad_amax)``, which :func:`jdls.wrap` makes for
    this rule), a finite step sets the next scale to the largest power of two ``2**k`` with
    ``amax * 2**k <= fmax * 2**-margin``, where ``amax`` is the largest magnitude of the
    unscaled gradients and ``fmax`` the compute format's largest finite value: the scaled
    gradients then use as much of the format's range as the margin allows, whatever the
    scale was, so the useful scale is reached in one step.

    A step whose gradients are all zero measured nothing: they may be exactly zero (a loss
    weight of 0, a frozen phase) or all flushed. Before any measurement the scale rises by
    the whole usable range for one step, to look (:func:`jdls.wrap` skips the all-zero step
    when its loss was not zero, ``jdls.SkipCause.UNDERFLOW``, so that it does not count;
    :meth:`looks_for_flushed`): if the gradients had flushed, that step measures them; if
    it is all zero too, they are zeros, and the scale comes back to where it was, raised to
    at most ``2**15`` (the classic rule's start; the format's largest power
    of two when that is smaller), and settles there. Right after a run of overflows (a burst
    of bad batches backs off far), an all-zero step returns to the scale the rule had settled
    on (one binade below it when the run began there). Otherwise it holds. A held scale doubles every ``growth_interval`` finite steps in a
    row, as the classic rule's would.

    A non-finite step backs off by ``2**-b``, where ``b`` doubles with each overflow in a
    row (1, 2, 4, ... bits, at most ``max_backoff_bits``): a start far too high is left in a
    few steps, and the next finite step measures again. An overflow at a predicted scale that
    comes soon after the previous one (within ``margin_window`` finite steps) raises the
    margin by one bit (at most ``max_margin``): the gradients vary from step to step by more
    than the margin. An isolated overflow (a loss spike, a bad batch) leaves the margin as it
    is: a wider margin would not have avoided it, would cost every later step some range, and
    would let the next spike's gradient through instead of skipping it. Every
    ``margin_interval`` finite steps in a row lower the margin by one bit (at least
    ``min_margin``); an overflow within ``margin_window`` steps of that counts as soon too.

    The rule learns from the overflows it causes: when a run of overflows that began at a
    predicted scale, soon after a measurement, ends, and this step's measurement would put
    the scale again at or above the lowest scale that overflowed in the run, the margin rises
    by as many bits as keep it below (at most ``max_margin``). The measurement then
    understates the backward pass by a steady factor (a backward intermediate larger than
    every parameter gradient; gradients clipped in front of the wrap where the wrap cannot see
    what the backward pass computed, e.g. computed under an inner ``jit``): once learned, it
    costs no more overflows. (:func:`jdls.wrap` gives the rule the gradients of the backward
    pass whenever it can: those ``jdls.clip`` received, or those the scale's own
    ``value_and_grad`` returned in the same trace.)

    Without a measurement, :meth:`jdls.DynamicScale.adjust` refuses a finite step (a
    ValueError that says how to give one) and backs off on an overflow (``adjust(False)``).
    (The rule's own :meth:`adjust`, which only :meth:`jdls.DynamicScale.adjust` calls, then
    and only then, doubles after ``growth_interval`` finite steps in a row.)

    The scale always stays within ``[min_loss_scale, max_loss_scale]`` and within the normal
    powers of two of float32 (``2**-126`` to ``2**127``).

    Args:
      compute_dtype: the format the scaled gradients are computed in: ``"float16"``
        (default), ``"bfloat16"``, ``"float8_e4m3fn"``, ``"cbfloat16"``, a dtype or a
        :class:`jdls.FloatFormat`; kept in one form whatever the spelling (numpy's dtype, or
        the :class:`jdls.FloatFormat` of an emulated format), so that equal rules are equal.
      margin: initial headroom in bits, within ``[min_margin, max_margin]``.
      min_margin: smallest headroom, >= 0.
      max_margin: largest headroom.
      margin_interval: finite steps in a row after which the margin is lowered, >= 1.
      margin_window: an overflow at a predicted scale raises the margin only if at most
        this many finite steps came since the start or the previous overflow, >= 1.
      growth_interval: without measurements, finite steps in a row before a doubling, >= 1.
      max_backoff_bits: the largest backoff on one step, in bits, >= 1.
      min_loss_scale: lower bound (None: ``2**-126``).
      max_loss_scale: upper bound (None: ``2**127``).

    Example:
      >>> import jdls
      >>> scale = jdls.DynamicScale(1.0, jdls.rules.Adaptive(margin=4))
      >>> # float16's max is about 2**16: a largest gradient of 2**-30 wants 2**(16-4+30)
      >>> float(scale.adjust(True, grad_amax=2.0**-30).loss_scale) == 2.0**41
      True

    References:
      NVIDIA Transformer Engine, delayed scaling (``scale = fmax * 2**-margin / amax``);
      Graphcore PopART, automatic loss scaling; Zhao et al., `Adaptive Loss Scaling for
      Mixed Precision Training <https://arxiv.org/abs/1910.12385>`_, 2019.
    """

    compute_dtype: Any = "float16"
    margin: int = 6
    min_margin: int = 2
    max_margin: int = 24
    margin_interval: int = 2000
    growth_interval: int = 2000
    max_backoff_bits: int = 8
    min_loss_scale: float | None = None
    max_loss_scale: float | None = None
    margin_window: int = 16

    State = AdaptiveState
    #: :func:`jdls.wrap` measures the gradients' largest magnitude for this rule.
    observes: ClassVar[bool] = True

    def __post_init__(self) -> None:
        self.format_range()  # validates compute_dtype
        # One spelling per format (jnp.float16, "float16", np.dtype("float16")), so that equal
        # rules compare, hash and key jit's cache alike.
        object.__setattr__(self, "compute_dtype", canonical_format(self.compute_dtype))
        check_int("min_margin", self.min_margin, 0)
        check_int("max_margin", self.max_margin, self.min_margin)
        margin = check_int("margin", self.margin, -(2**31))
        if not self.min_margin <= margin <= self.max_margin:
            raise ValueError(
                f"margin must be within [min_margin, max_margin] = [{self.min_margin}, "
                f"{self.max_margin}], got {margin}"
            )
        check_int("margin_interval", self.margin_interval, 1)
        check_int("growth_interval", self.growth_interval, 1)
        check_int("margin_window", self.margin_window, 1)
        check_int("max_backoff_bits", self.max_backoff_bits, 1)
        check_bounds(self.min_loss_scale, self.max_loss_scale)

    def format_range(self) -> tuple[float, float]:
        """``(log2 of the format's max, log2 of its smallest subnormal)`` of ``compute_dtype``.

        Example:
          >>> import jdls
          >>> hi, lo = jdls.rules.Adaptive().format_range()  # float16: max 65504
          >>> round(hi, 4), lo
          (15.9993, -24.0)
        """
        dtype = self.compute_dtype
        try:
            info = finfo(dtype)
        except TypeError:
            raise TypeError(
                "compute_dtype must be a float format: 'float16', 'bfloat16', 'float8_e4m3fn', "
                f"'cbfloat16', a dtype or a jdls.FloatFormat, got {dtype!r}"
            ) from None
        if not isinstance(dtype, FloatFormat) and info.bits > 32:
            raise ValueError(f"compute_dtype must be at most 32 bits wide, got {dtype!r}")
        return math.log2(float(info.max)), math.log2(float(info.smallest_subnormal))

    def initial_state(  # type: ignore[override]
        self,
        margin: int | None = None,
        counter: int = 0,
        overflows: int = 0,
        settled: int | None = None,
        looking: int = 0,
        learning: int = 0,
    ) -> AdaptiveState:
        """Counters to start from (default: a fresh run with the initial ``margin``).

        Example:
          >>> import jdls
          >>> int(jdls.rules.Adaptive(margin=5).initial_state().margin)
          5
        """
        m = self.margin if margin is None else check_int("margin", margin, self.min_margin)
        if m > self.max_margin:
            raise ValueError(f"margin must be <= max_margin ({self.max_margin}), got {m}")
        counter = check_int("counter", counter, 0)
        overflows = check_int("overflows", overflows, 0)
        flags = [check_int(k, v, 0) for k, v in (("looking", looking), ("learning", learning))]
        if max(flags) > 1:
            raise ValueError(f"looking and learning must be 0 or 1, got {flags}")
        settled = _NONE if settled is None else check_int("settled", settled, _EXP_MIN)
        values = (m, counter, overflows, settled, *flags)
        return AdaptiveState(*(jnp.asarray(v, _I32) for v in values))

    def start(self, loss_scale: float) -> float:
        """``loss_scale`` if it lies within ``[min_loss_scale, max_loss_scale]``."""
        check_within(loss_scale, self.min_loss_scale, self.max_loss_scale)
        return loss_scale

    def looks_for_flushed(self, state: AdaptiveState) -> jax.Array:
        """Whether an all-zero step now is the one that looks (before any measurement and
        any look): :func:`jdls.wrap` skips it when the loss was not zero.

        Example:
          >>> import jdls
          >>> scale = jdls.AdaptiveScale()
          >>> bool(scale.rule.looks_for_flushed(scale.state))
          True
          >>> measured = scale.adjust(True, grad_amax=2.0**-10)
          >>> bool(measured.rule.looks_for_flushed(measured.state))
          False
        """
        return (state.settled == _NONE) & (state.looking == 0)

    def _exponent_bounds(self) -> tuple[int, int]:
        lo = _EXP_MIN if self.min_loss_scale is None else math.ceil(math.log2(self.min_loss_scale))
        hi = _EXP_MAX if self.max_loss_scale is None else math.floor(math.log2(self.max_loss_scale))
        return max(lo, _EXP_MIN), min(hi, _EXP_MAX)

    def _clamp(self, loss_scale: jax.Array) -> jax.Array:
        lo = 2.0**_EXP_MIN if self.min_loss_scale is None else self.min_loss_scale
        hi = 2.0**_EXP_MAX if self.max_loss_scale is None else self.max_loss_scale
        return clamp(loss_scale, _F32(lo), _F32(hi))

    def _soon(self, state: AdaptiveState) -> jax.Array:
        """Whether an overflow now is the first of a run and comes soon after a prediction:
        within ``margin_window`` finite steps of the start, of the previous overflow, or of
        a lowering of the margin."""
        c, window, interval = state.counter, _I32(self.margin_window), self.margin_interval
        after_lowering = (c >= interval) & (lax.rem(c, _I32(interval)) <= window)
        return (state.overflows == 0) & (c > 0) & ((c <= window) | after_lowering)

    def _overflow(
        self, loss_scale: jax.Array, state: AdaptiveState
    ) -> tuple[jax.Array, AdaptiveState]:
        """Back off ``2**-b`` bits, ``b`` doubling with consecutive overflows; raise the margin
        on the first overflow that comes soon after a prediction, and remember that the run
        began so (``learning``)."""
        bits = jnp.minimum(
            jnp.left_shift(_I32(1), jnp.minimum(state.overflows, _I32(30))),
            _I32(self.max_backoff_bits),
        )
        backed_off = self._clamp(loss_scale * _pow2(-bits))
        # At a predicted scale and soon after it: the gradients vary by more than the margin,
        # or the measurement understates the backward pass. An isolated overflow (a spike)
        # keeps the margin, so that the next spike overflows and is skipped too.
        soon = self._soon(state)
        margin = pick(soon, jnp.minimum(state.margin + 1, _I32(self.max_margin)), state.margin)
        learning = pick(state.overflows == 0, soon.astype(_I32), state.learning)
        overflows = jnp.minimum(state.overflows, _I32(2**30)) + 1
        return backed_off, AdaptiveState(
            margin, _I32(0), overflows, state.settled, _I32(0), learning
        )

    def adjust(
        self, loss_scale: jax.Array, state: AdaptiveState, finite: jax.Array
    ) -> tuple[jax.Array, AdaptiveState]:
        """Without a measurement: back off on an overflow, double after ``growth_interval``
        finite steps in a row (pure)."""
        backed_off, on_overflow = self._overflow(loss_scale, state)
        counted = state.counter + 1
        grow = counted >= self.growth_interval
        grown = self._clamp(pick(grow, loss_scale * _F32(2.0), loss_scale))
        on_finite = AdaptiveState(
            state.margin,
            pick(grow, _I32(0), counted),
            _I32(0),
            state.settled,
            _I32(0),
            _I32(0),
        )
        return _select(finite, (grown, on_finite), (backed_off, on_overflow))

    def observe(
        self,
        loss_scale: jax.Array,
        state: AdaptiveState,
        finite: jax.Array,
        grad_amax: jax.Array,
    ) -> tuple[jax.Array, AdaptiveState]:
        """With the largest magnitude ``grad_amax`` of the unscaled gradients: the scale that
        puts it ``margin`` bits below the format's maximum (pure; see the class docstring)."""
        backed_off, on_overflow = self._overflow(loss_scale, state)
        lo, hi = self._exponent_bounds()
        amax = jnp.abs(grad_amax).astype(_F32)
        measured = (amax > 0) & jnp.isfinite(amax)
        # The largest k with amax * 2**k <= fmax * 2**-margin, in integers (exact; a float
        # log2 is off by one near the boundary): with amax = a * 2**e and fmax = f * 2**g,
        # a and f in [0.5, 1), k = g - margin - e, one less when a > f.
        f, g = math.frexp(float(finfo(self.compute_dtype).max))  # exact, not 2**log2_max
        a, e = jnp.frexp(pick(measured, amax, 1))
        k_at_zero_margin = _I32(g) - e - (a > _F32(f)).astype(_I32)
        # The first finite step after a run of overflows this rule caused: the lowest scale
        # that overflowed was this one times 2**(the last backoff's bits); the margin rises
        # so that the prediction stays below it.
        _, e_scale = jnp.frexp(loss_scale.astype(_F32))
        log2_scale = e_scale - 1  # floor(log2(scale)): exact for the powers of two it sets
        last_bits = jnp.minimum(
            jnp.left_shift(_I32(1), clamp(state.overflows - 1, 0, 30)),
            _I32(self.max_backoff_bits),
        )
        lowest_overflow = log2_scale + last_bits
        learn = (state.learning > 0) & (state.overflows > 0) & measured
        needed = jnp.minimum(k_at_zero_margin - lowest_overflow + 1, _I32(self.max_margin))
        margin = pick(learn, jnp.maximum(state.margin, needed), state.margin)
        counted = jnp.minimum(state.counter, _I32(2**30)) + 1
        lower = lax.rem(counted, _I32(self.margin_interval)) == 0  # counted >= 1
        k = clamp(k_at_zero_margin - margin, lo, hi)
        margin = pick(lower, jnp.maximum(margin - 1, _I32(self.min_margin)), margin)

        # All zero: no measurement (see the class docstring).
        log2_max, log2_sub = self.format_range()
        jump = math.floor(log2_max - log2_sub + 1) - state.margin  # the whole usable range
        never = state.settled == _NONE
        look = never & (state.looking == 0)
        back = jnp.maximum(log2_scale - jump, _I32(min(15, g - 1)))  # the look found zeros
        after_overflows = ~never & (state.overflows > 0)
        target = pick(
            look,
            log2_scale + jump,
            pick(
                state.looking > 0,
                back,
                pick(after_overflows, state.settled - state.learning, log2_scale),
            ),
        )
        moved = look | (state.looking > 0) | after_overflows
        held = pick(moved, _pow2(clamp(target, lo, hi)), loss_scale)
        grow = ~moved & (lax.rem(counted, _I32(self.growth_interval)) == 0)
        held = pick(grow, held * _F32(2.0), held)
        predicted = pick(measured, _pow2(k), held)
        settled = pick(measured, k, pick(state.looking > 0, clamp(back, lo, hi), state.settled))
        # An inf or NaN measurement (a hand-made adjust on a non-finite step): the lowest.
        predicted = self._clamp(pick(jnp.isfinite(amax), predicted, _pow2(_I32(lo))))

        on_finite = AdaptiveState(
            margin, counted, _I32(0), settled, (look & ~measured).astype(_I32), _I32(0)
        )
        return _select(finite, (predicted, on_finite), (backed_off, on_overflow))


def _pow2(exponent: jax.Array) -> jax.Array:
    """``2.0**exponent`` exactly, for int32 exponents in [-126, 127] (built from the bits)."""
    e = clamp(exponent, _EXP_MIN, _EXP_MAX).astype(_I32)
    return lax.bitcast_convert_type(jnp.left_shift(e + 127, 23), _F32)


def _select(
    finite: jax.Array, taken: tuple[jax.Array, Any], skipped: tuple[jax.Array, Any]
) -> tuple[jax.Array, Any]:
    """``taken`` where ``finite``, else ``skipped`` (the scale and the state, leaf by leaf),
    computed in one kernel (:func:`jdls._numerics.scalars.one_kernel`): the rule's seven
    outputs would otherwise cost seven kernels, each with its own copy of the shared chain."""
    chosen = jax.tree_util.tree_map(
        lambda a, b: pick(finite, a, b).astype(jnp.asarray(a).dtype), taken, skipped
    )
    return one_kernel(chosen)
