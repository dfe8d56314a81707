"""Loss scales: the ``LossScale`` interface and its no-op, static and dynamic kinds.

Every scale is an immutable pytree: its data (the float32 ``loss_scale`` and, for a dynamic
scale, the rule's int32 counters) are children; its configuration (the rule) is static.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Sequence
from typing import Any, TypeVar

import jax
import jax.numpy as jnp
import numpy as np

from jdls._checks import check_positive_finite, finite_flag, is_float
from jdls._grad import reject_axis_name, scaled_value_and_grad
from jdls.rules import Adaptive, GrowBackoff, Rule
from jdls.rules._rule import check_within

__all__ = ["AdaptiveScale", "DynamicScale", "LossScale", "NoOpScale", "StaticScale", "check_scale"]

_F32 = jnp.float32
T = TypeVar("T")


class _NotATransformation:
    """``init``/``update`` of a loss scale: an error saying how to use the scale instead.

    ``optax.chain(jdls.DynamicScale(), ...)`` is a common mistake. The error is an
    ``AttributeError``, so ``hasattr(scale, "init")`` stays False.
    """

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, obj: Any, owner: type | None = None) -> Any:
        what = (type(obj) if obj is not None or owner is None else owner).__name__
        instance = f"jdls.{what}" + ("" if obj is None else "(...)")
        raise AttributeError(
            f"{instance} is a loss scale, not an optax transformation (it has no "
            f".{self.name}); wrap the optimizer with it instead: "
            f"jdls.wrap(optax.adam(1e-3), jdls.{what}(...)), and put jdls.wrap(...) in "
            "optax.chain"
        )


class LossScale:
    """The interface of :class:`DynamicScale`, :class:`StaticScale` and :class:`NoOpScale`:
    ``loss_scale`` (a float32 scalar), ``scale``, ``unscale``, ``adjust``, ``value_and_grad``.
    """

    loss_scale: jax.Array

    init = _NotATransformation()
    update = _NotATransformation()

    def scale(self, tree: T) -> T:
        """Multiply every float leaf of ``tree`` by the scale, rounding once to its dtype.

        Example:
          >>> import jax.numpy as jnp, jdls
          >>> jdls.StaticScale(8.0).scale(jnp.float16(0.5))
          Array(4., dtype=float16)
        """
        loss_scale = self.loss_scale

        def scale_leaf(x: Any) -> Any:
            if not is_float(x):
                return x
            x = jnp.asarray(x)
            return (x.astype(jnp.promote_types(x.dtype, _F32)) * loss_scale).astype(x.dtype)

        return jax.tree_util.tree_map(scale_leaf, tree)

    def unscale(self, tree: T) -> T:
        """Divide every float leaf by the scale; leaves narrower than float32 become float32.

        Example:
          >>> import jax.numpy as jnp, jdls
          >>> jdls.StaticScale(1024.0).unscale(jnp.float16(2.0))
          Array(0.00195312, dtype=float32)
        """
        loss_scale = self.loss_scale

        def unscale_leaf(x: Any) -> Any:
            if not is_float(x):
                return x
            x = jnp.asarray(x)
            dtype = jnp.promote_types(x.dtype, _F32)
            return x.astype(dtype) / loss_scale.astype(dtype)

        return jax.tree_util.tree_map(unscale_leaf, tree)

    def adjust(self, grads_finite: jax.Array | bool) -> LossScale:  # pragma: no cover
        """The next state after a step whose gradients were finite (or not)."""
        raise NotImplementedError

    def value_and_grad(
        self,
        fun: Callable[..., Any],
        argnums: int | Sequence[int] = 0,
        has_aux: bool = False,
        *,
        axis_name: Any = None,
    ) -> Callable[..., Any]:
        """``jax.value_and_grad`` of ``fun`` with the loss scaled and the results unscaled.

        The value returned is the loss ``fun`` computed (not ``scaled / scale``), so it is
        exact even when the scaled loss overflowed.

        Args:
          fun: the loss function; returns a scalar, or ``(scalar, aux)`` with ``has_aux``.
          argnums: positional argument(s) to differentiate, as in ``jax.value_and_grad``.
          has_aux: whether ``fun`` returns ``(loss, aux)``.
          axis_name: not accepted (Flax's ``DynamicScale.value_and_grad`` takes it): a
            TypeError says what to do instead (``lax.pmean`` the gradients yourself, and pass
            the axis to ``jdls.wrap``).

        Returns:
          A function with ``fun``'s arguments returning ``(loss, grads)``, or
          ``((loss, aux), grads)`` with ``has_aux`` (two values: Flax's four-value unpacking
          ``dyn_scale, is_fin, loss, grads = ...`` does not apply, see docs/migration/flax.md).

        Example:
          >>> import jax.numpy as jnp, jdls
          >>> loss, grads = jdls.DynamicScale().value_and_grad(lambda w: jnp.sum(w**2))(jnp.ones(2))
          >>> float(loss), grads.tolist()
          (2.0, [2.0, 2.0])
        """
        reject_axis_name(axis_name)
        return scaled_value_and_grad(
            self,
            fun,
            has_aux,
            lambda scaled: jax.value_and_grad(scaled, argnums=argnums, has_aux=True),
        )


def check_scale(scale: Any, what: str = "scale", wrapping: bool = False) -> LossScale:
    """``scale`` if it is a loss scale instance, else an error saying what to pass."""
    if isinstance(scale, LossScale):
        return scale
    if isinstance(scale, type) and issubclass(scale, LossScale):
        raise TypeError(
            f"{what} must be a loss scale instance: pass jdls.{scale.__name__}(...), not the "
            f"class jdls.{scale.__name__}"
        )
    if isinstance(scale, int | float | np.number) and not isinstance(scale, bool):
        raise TypeError(
            f"{what} must be a jdls loss scale, got the number {scale!r}: for a fixed scale "
            f"pass jdls.StaticScale({scale!r})"
        )
    if callable(getattr(scale, "init", None)) and callable(getattr(scale, "update", None)):
        hint = (
            "the optimizer is the first argument: jdls.wrap(optax.adam(1e-3), jdls.DynamicScale())"
            if wrapping
            else "pass a loss scale such as jdls.DynamicScale(...)"
        )
        raise TypeError(f"{what} must be a jdls loss scale, got an optax transformation; {hint}")
    raise TypeError(
        f"{what} must be a jdls loss scale: jdls.DynamicScale(...), a jdls.presets scale, "
        f"jdls.StaticScale(...) or jdls.NoOpScale(); got {type(scale).__name__}"
    )


def _show(x: Any) -> str:
    """A readable value for ``repr``: numbers and small arrays as lists, tracers by type."""
    try:
        value = np.asarray(x)
    except Exception:  # tracers and other stand-ins
        return type(x).__name__
    return repr(value.item()) if value.ndim == 0 else repr(value.tolist())


def _register(cls: type, data: tuple[str, ...], static: tuple[str, ...]) -> None:
    """Register a scale class as a pytree: ``data`` fields are children, ``static`` aux data.

    Unflattening builds the object without validation (the children may be tracers).
    """

    def flatten_with_keys(obj: Any) -> tuple[list[Any], tuple[Any, ...]]:
        children = [(jax.tree_util.GetAttrKey(f), getattr(obj, f)) for f in data]
        return children, tuple(getattr(obj, f) for f in static)

    def unflatten(aux: tuple[Any, ...], children: Iterable[Any]) -> Any:
        return _new(
            cls,
            **dict(zip(static, aux, strict=True)),
            **dict(zip(data, list(children), strict=True)),
        )

    def flatten(obj: Any) -> tuple[list[Any], tuple[Any, ...]]:
        return [getattr(obj, f) for f in data], tuple(getattr(obj, f) for f in static)

    jax.tree_util.register_pytree_with_keys(cls, flatten_with_keys, unflatten, flatten)


def _new(cls: type[T], **fields: Any) -> T:
    """An instance of ``cls`` with these fields, unvalidated: the one way past ``__init__``."""
    obj = object.__new__(cls)
    for name, value in fields.items():
        object.__setattr__(obj, name, value)
    return obj


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
        return f"StaticScale({_show(self.loss_scale)})"

    def adjust(self, grads_finite: jax.Array | bool) -> StaticScale:
        """Return the same scale: a static scale never changes."""
        finite_flag(grads_finite)
        return self


@dataclasses.dataclass(frozen=True, eq=False, init=False)
class DynamicScale(LossScale):
    """A loss scale that a rule changes after every step.

    ``DynamicScale()`` is a safe default for float16: it starts at ``2**15``, halves on every
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
        return _new(DynamicScale, **{**fields, **changes})

    def adjust(
        self, grads_finite: jax.Array | bool, grad_amax: jax.Array | float | None = None
    ) -> DynamicScale:
        """The next scale after a step, as the rule says (pure, traceable).

        Args:
          grads_finite: boolean scalar, whether the unscaled gradients were all finite
            (:func:`all_finite`).
          grad_amax: the largest magnitude of the step's unscaled gradients, for rules that
            use it (``rule.observes``, e.g. :class:`jdls.rules.Adaptive`; :func:`jdls.wrap`
            passes it to them); None, or a rule that does not use it: ignored.

        Example:
          >>> import jdls
          >>> float(jdls.DynamicScale(64.0).adjust(False).loss_scale)
          32.0
        """
        finite = finite_flag(grads_finite)
        if grad_amax is None:
            loss_scale, state = self.rule.adjust(self.loss_scale, self.state, finite)
        else:
            amax = jnp.asarray(grad_amax, _F32)
            if amax.shape != ():
                raise ValueError(
                    f"grad_amax must be a scalar (the largest |gradient|), got shape {amax.shape}"
                )
            loss_scale, state = self.rule.observe(self.loss_scale, self.state, finite, amax)
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
        counters = ", ".join(f"{k}={_show(v)}" for k, v in fields.items())
        return f"DynamicScale(loss_scale={_show(self.loss_scale)}, {counters}, rule={self.rule!r})"


_register(StaticScale, ("loss_scale",), ())
_register(DynamicScale, ("loss_scale", "state"), ("rule",))
_register(NoOpScale, (), ())


def AdaptiveScale(
    loss_scale: float = 1.0,
    compute_dtype: Any = "float16",
    **options: Any,
) -> DynamicScale:
    """A :class:`DynamicScale` whose rule sets the scale from the gradients it measures.

    ``jdls.DynamicScale(loss_scale, jdls.rules.Adaptive(compute_dtype, **options))``: after
    every finite step the scale becomes the power of two that puts the largest scaled
    gradient a few bits (the adaptive margin) below the maximum of ``compute_dtype``, so it
    reaches the useful scale in a step or two from any start; an overflow backs off and
    raises the margin. Use it with :func:`jdls.wrap` (or :class:`jdls.TrainState`), which
    measures the gradients for it.

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
