"""Loss scales: the no-op, static and dynamic kinds (the interface is in ``scale_interface``).

Every scale is an immutable pytree: its data (the float32 ``loss_scale`` and, for a dynamic
scale, the rule's int32 counters) are children; its configuration (the rule) is static.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any, TypeGuard, TypeVar

import jax
import jax.numpy as jnp
import numpy as np

from jdls._numerics.checks import check_positive_finite, finite_flag
from jdls._scales.scale_interface import LossScale, check_scale, new_scale, register_scale, show
from jdls.rules import Adaptive, GrowBackoff, Rule
from jdls.rules._rule import check_within

__all__ = [
    "AdaptiveScale",
    "DynamicScale",
    "LossScale",
    "NoOpScale",
    "StaticScale",
    "adjust_observed",
    "check_scale",
    "missing_measurement",
    "observes",
]

_F32 = jnp.float32
T = TypeVar("T")


class NoOpScale(LossScale):
    """A scale of exactly 1 that never changes: no loss scaling, same interface.

    ``unscale`` still promotes 16-bit gradients to float32, like the other scales.

    Example:
      >>> import jdls
      >>> scale = jdls.NoOpScale()
      >>> float(scale.loss_scale), scale.adjust(False) is scale
      (1.0, True)
    """

    @property
    def loss_scale(self) -> jax.Array:  # type: ignore[override]
        """The scale: always 1.0 (float32)."""
        return jnp.ones((), _F32)

    def __repr__(self) -> str:
        return "NoOpScale()"

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) or NotImplemented

    def __hash__(self) -> int:  # type: ignore[override]
        return hash(type(self))

    def scale(self, tree: T) -> T:
        """Return ``tree`` unchanged (the scale is 1)."""
        return tree

    def adjust(self, grads_finite: jax.Array | bool) -> NoOpScale:
        """Return the same scale: a no-op scale never changes."""
        finite_flag(grads_finite)
        return self


@dataclasses.dataclass(frozen=True, eq=False, init=False)
class StaticScale(LossScale):
    """A fixed loss scale that never changes.

    Args:
      loss_scale: the scale, a normal float32 number > 0.

    Example:
      >>> import jdls
      >>> float(jdls.StaticScale(128.0).adjust(False).loss_scale)
      128.0
    """

    loss_scale: jax.Array

    def __init__(self, loss_scale: float | jax.Array) -> None:
        value = check_positive_finite("loss_scale", loss_scale)
        object.__setattr__(self, "loss_scale", jnp.asarray(value, _F32))

    def __repr__(self) -> str:
        return f"StaticScale({show(self.loss_scale)})"

    def adjust(self, grads_finite: jax.Array | bool) -> StaticScale:
        """Return the same scale: a static scale never changes."""
        finite_flag(grads_finite)
        return self


@dataclasses.dataclass(frozen=True, eq=False, init=False)
class DynamicScale(LossScale):
    """A loss scale that a rule changes after every step.

    ``DynamicScale()`` is jdls's classic rule for float16: it starts at ``2**15``, halves on every
    non-finite step, doubles after 2000 finite steps in a row and stays within
    ``[1, 2**24]`` (the defaults of :class:`jdls.rules.GrowBackoff`). Other rules, and the
    exact rules of PyTorch, Flax, jmp, Keras, DeepSpeed, Megatron-LM and Cerebras
    (:mod:`jdls.presets`), plug in as ``rule``.

    Data (pytree children): ``loss_scale`` (float32) and ``state``, the rule's counters.
    Configuration (static): ``rule``.

    Args:
      loss_scale: initial scale, a normal float32 number > 0 within the rule's bounds.
      rule: a :class:`jdls.rules.Rule`; default ``jdls.rules.GrowBackoff(**options)``.
      state: the rule's counters to start from (``rule.initial_state(...)``); default fresh.
      **options: arguments of :class:`jdls.rules.GrowBackoff`, when ``rule`` is not given.

    Example:
      >>> import jdls
      >>> scale = jdls.DynamicScale(1024.0, growth_interval=2)
      >>> float(scale.adjust(False).loss_scale)                # overflow: back off
      512.0
      >>> float(scale.adjust(True).adjust(True).loss_scale)    # two finite steps: grow
      2048.0
    """

    loss_scale: jax.Array
    state: Any
    rule: Rule

    def __init__(
        self,
        loss_scale: float = 2.0**15,
        rule: Rule | None = None,
        *,
        state: Any = None,
        **options: Any,
    ) -> None:
        if rule is None:
            _check_options(options)
            rule = GrowBackoff(**options)
            # jdls's own scale starts within its bounds; a rule given explicitly (a preset)
            # accepts what the library it mirrors accepts, e.g. a start below the minimum.
            check_within(check_positive_finite("loss_scale", loss_scale), *rule.bounds)
        elif options:
            raise TypeError(
                f"give a rule or the options of the default rule, not both: got rule={rule!r} "
                f"and {sorted(options)}; set them on the rule instead"
            )
        if not isinstance(rule, Rule):
            raise TypeError(f"rule must be a jdls.rules.Rule, got {type(rule).__name__}")
        value = rule.start(check_positive_finite("loss_scale", loss_scale))
        fresh = rule.initial_state()
        if state is None:
            state = fresh
        elif jax.tree_util.tree_structure(state) != jax.tree_util.tree_structure(fresh):  # type: ignore[operator]
            raise TypeError(
                f"state must be the counters of {type(rule).__name__}, made by "
                f"rule.initial_state(...), got {state!r}"
            )
        object.__setattr__(self, "loss_scale", jnp.asarray(value, _F32))
        object.__setattr__(self, "state", state)
        object.__setattr__(self, "rule", rule)

    def __getattr__(self, name: str) -> Any:
        # Reached only when normal lookup fails: say where moved attributes live now.
        if name in ("init", "update"):  # the descriptor's own error says how to use a scale
            return LossScale.__dict__[name].__get__(self, type(self))
        moved = {"skipped": "jdls.stats(opt_state).skipped_steps, a statistic of jdls.wrap"}
        where = moved.get(name, f"scale.state.{name}, the rule's counters")
        fields = getattr(self.__dict__.get("state"), "_fields", ())  # no recursion when unset
        hint = f": see {where}" if name in (*moved, *fields) else ""
        raise AttributeError(f"DynamicScale has no attribute {name!r}{hint}")

    def replace(self, **changes: Any) -> DynamicScale:
        """A copy with some fields replaced, unvalidated (for advanced use and tests).

        Example:
          >>> import jax.numpy as jnp, jdls
          >>> float(jdls.DynamicScale().replace(loss_scale=jnp.float32(8.0)).loss_scale)
          8.0
        """
        fields = {"loss_scale": self.loss_scale, "state": self.state, "rule": self.rule}
        unknown = set(changes) - set(fields)
        if unknown:
            raise TypeError(
                f"DynamicScale.replace got unknown fields {sorted(unknown)}; fields are "
                f"{sorted(fields)}"
            )
        return new_scale(DynamicScale, **{**fields, **changes})

    def adjust(
        self, grads_finite: jax.Array | bool, grad_amax: jax.Array | float | None = None
    ) -> DynamicScale:
        """The next scale after a step, as the rule says (pure, traceable).

        Args:
          grads_finite: boolean scalar, whether the unscaled gradients were all finite
            (:func:`all_finite`).
          grad_amax: the largest magnitude of the step's unscaled gradients
            (``optax.tree_utils.tree_norm(grads, ord=jnp.inf)``), for rules that use it
            (``rule.observes``, e.g. :class:`jdls.rules.Adaptive`: :func:`jdls.wrap`,
            :func:`jdls.wrap_groups`, :func:`jdls.update_sites` (per-layer scales) and
            :func:`jdls.adjust_loss_scales` pass it to them);
            ignored by a rule that does not use it.

        Raises:
          ValueError: the rule observes (``rule.observes``) and ``grad_amax`` is None, unless
            ``grads_finite`` is the Python ``False`` (an overflow needs no measurement): the
            rule cannot set the scale without it, and silently falling back to another rule
            would leave the scale where it started.

        Example:
          >>> import jdls
          >>> float(jdls.DynamicScale(64.0).adjust(False).loss_scale)
          32.0
        """
        finite = finite_flag(grads_finite)
        if grad_amax is None:
            if self.rule.observes and not _known_overflow(grads_finite):
                raise ValueError(missing_measurement(self.rule))
            loss_scale, state = _ruled(self.rule, "adjust", self.loss_scale, self.state, finite)
        else:
            amax = jnp.asarray(grad_amax, _F32)
            if amax.shape != ():
                raise ValueError(
                    f"grad_amax must be a scalar (the largest |gradient|), got shape {amax.shape}"
                )
            loss_scale, state = _ruled(
                self.rule, "observe", self.loss_scale, self.state, finite, amax
            )
        return self.replace(loss_scale=loss_scale, state=state)

    def back_off(self) -> DynamicScale:
        """The scale the rule backs off to: after as many overflows as it takes to lower it.

        What :func:`jdls.retrying` and :func:`jdls.accumulate` recompute at. Without
        hysteresis it is ``adjust(False)``; a rule that forgives overflows (``hysteresis``,
        DeepSpeed's ``delayed_shift``, Cerebras' ``overflow_tolerance``) counts the ones it
        would forgive at once, so the scale is lower (unless it is at its minimum): the scale
        and counters of that many non-finite steps in a row.

        Example:
          >>> import jdls
          >>> scale = jdls.presets.megatron(initial_scale=64.0)   # hysteresis 2
          >>> float(scale.adjust(False).loss_scale), float(scale.back_off().loss_scale)
          (64.0, 32.0)
          >>> scale.back_off() == scale.adjust(False).adjust(False)
          True
        """
        loss_scale, state = _ruled(self.rule, "back_off", self.loss_scale, self.state)
        return self.replace(loss_scale=loss_scale, state=state)

    def check(self) -> DynamicScale:
        """Raise on the host the error the rule recorded, if any (reads the device).

        Only :class:`jdls.rules.GrowBackoff` with ``error_at_min_scale`` (DeepSpeed) records
        one: :class:`jdls.MinimumScaleError`. Works on batched (vmapped, pmapped) scales.

        Returns:
          ``self``, so that it can be chained.

        Example:
          >>> import jdls
          >>> scale = jdls.presets.deepspeed(init_scale=1.0, delayed_shift=1).adjust(False)
          >>> try:
          ...     scale.check()
          ... except jdls.MinimumScaleError as e:
          ...     print("stopped:", type(e).__name__)
          stopped: MinimumScaleError
        """
        self.rule.check(self.loss_scale, self.state)
        return self

    def __repr__(self) -> str:
        fields = getattr(self.state, "_asdict", lambda: {"state": self.state})()
        counters = ", ".join(f"{k}={show(v)}" for k, v in fields.items())
        return f"DynamicScale(loss_scale={show(self.loss_scale)}, {counters}, rule={self.rule!r})"


# A rule's arithmetic (the adaptive rule's is about 170 scalar operations) is one program per
# rule and shapes. Inside a user's jit it is inlined (``inline=True``: the same operations, no
# inner call) and its trace is kept, so a second program with the same rule (the evaluation
# step, a retrace, another test) does not trace it again; called eagerly it is one compiled
# program, not one per operation.
@functools.partial(jax.jit, static_argnums=(0, 1), inline=True)
def _compiled_rule(rule: Rule, method: str, *args: Any) -> tuple[jax.Array, Any]:
    return getattr(rule, method)(*args)


def _ruled(rule: Rule, method: str, *args: Any) -> tuple[jax.Array, Any]:
    """``rule.method(*args)``, compiled once per rule and shapes (a rule that does not hash,
    which a user's own may not, runs as written)."""
    try:
        hash(rule)
    except TypeError:
        return getattr(rule, method)(*args)
    return _compiled_rule(rule, method, *args)


def _known_overflow(grads_finite: Any) -> bool:
    """Whether ``grads_finite`` is a Python (or numpy) ``False``: an overflow, known on the host."""
    return isinstance(grads_finite, bool | np.bool_) and not bool(grads_finite)


def missing_measurement(rule: Rule) -> str:
    """The error for adjusting a rule that observes (``rule.observes``) without a measurement."""
    name = type(rule).__name__
    return (
        f"the rule {name} sets the scale from the largest magnitude of the unscaled gradients, "
        f"and none was given: pass it, scale.adjust(finite, "
        "grad_amax=optax.tree_utils.tree_norm(grads, ord=jnp.inf)); or let jdls measure it: "
        "jdls.wrap, jdls.wrap_groups and jdls.linen.TrainState do, per layer "
        "jdls.update_sites(sites, measurements, finite) with the measurements of "
        "jdls.layer_scaled_value_and_grad, per loss jdls.adjust_loss_scales(scales, "
        "finite, grad_amax) with jdls.multi_loss_value_and_grad(..., with_amax=True). "
        "(scale.adjust(False) needs no measurement: an overflow backs off.)"
    )


def observes(scale: LossScale) -> TypeGuard[DynamicScale]:
    """Whether ``scale``'s rule sets it from the gradients' largest magnitude
    (``rule.observes``): every path that adjusts such a scale measures it and passes it."""
    return isinstance(scale, DynamicScale) and scale.rule.observes


def adjust_observed(scale: LossScale, finite: Any, amax: Callable[[], Any]) -> LossScale:
    """The next scale after a step, ``scale.adjust(finite)``; a rule that observes also gets
    the step's measurement, ``amax()`` (called only for such a rule)."""
    if observes(scale):
        return scale.adjust(finite, amax())
    return scale.adjust(finite)


register_scale(StaticScale, ("loss_scale",), ())
register_scale(DynamicScale, ("loss_scale", "state"), ("rule",))
register_scale(NoOpScale, (), ())


def AdaptiveScale(
    loss_scale: float = 1.0,
    compute_dtype: Any = "float16",
    **options: Any,
) -> DynamicScale:
    """A :class:`DynamicScale` whose rule sets the scale from the gradients it measures: the
    default scale of :func:`jdls.wrap` and :func:`jdls.wrap_groups`.

    ``jdls.DynamicScale(loss_scale, jdls.rules.Adaptive(compute_dtype, **options))``: after
    every finite step the scale becomes the power of two that puts the largest scaled
    gradient a few bits (the adaptive margin) below the maximum of ``compute_dtype``, so it
    reaches the useful scale in a step or two from any start; an overflow backs off and
    raises the margin. :func:`jdls.wrap` (and :class:`jdls.linen.TrainState`, ``nnx.Optimizer``),
    :func:`jdls.wrap_groups` and :func:`jdls.update_sites` (per-layer scales) measure the gradients for
    it; adjusted by hand, it needs the measurement: ``scale.adjust(finite, grad_amax)``
    (``scale.adjust(True)`` alone is a ValueError).

    Args:
      loss_scale: initial scale (default 1: the first step measures, the second is scaled).
      compute_dtype: the format the backward pass computes in (default ``"float16"``).
      **options: the other arguments of :class:`jdls.rules.Adaptive` (``margin``,
        ``min_loss_scale``, ...).

    Example:
      >>> import jax.numpy as jnp, optax, jdls
      >>> tx = jdls.wrap(optax.sgd(0.1), jdls.AdaptiveScale())
      >>> params = {"w": jnp.zeros(2)}
      >>> _, state = tx.update({"w": jnp.array([2.0**-20, 0.0])}, tx.init(params), params)
      >>> float(jdls.get_scale(state).loss_scale) == 2.0**(15 - 6 + 20)  # float16, margin 6
      True
    """
    return DynamicScale(loss_scale, Adaptive(compute_dtype, **options))


#: Other libraries' names for the first argument and the default rule's options.
_SPELLINGS = {
    "initial_scale": "loss_scale",
    "init_scale": "loss_scale",
    "scale": "loss_scale",
    "initial_loss_scale": "loss_scale",
    "growth_rate": "growth_factor",
    "backoff_rate": "backoff_factor",
    "dynamic_growth_steps": "growth_interval",
    "period": "growth_interval",
    "factor": "growth_factor",
}


def _check_options(options: dict[str, Any]) -> None:
    """Unknown options of the default rule: an error that names the accepted ones (and the
    jdls spelling of another library's name)."""
    accepted = [f.name for f in dataclasses.fields(GrowBackoff)]
    unknown = sorted(set(options) - set(accepted))
    if not unknown:
        return
    hints = [f"{n} -> {_SPELLINGS[n]}" for n in unknown if n in _SPELLINGS]
    raise TypeError(
        f"DynamicScale got unknown options {unknown}: the default rule takes "
        f"{accepted}, and the first argument is the starting scale, "
        "jdls.DynamicScale(loss_scale, ...)"
        + (f" (jdls's names: {', '.join(hints)})" if hints else "")
    )
