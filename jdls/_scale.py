"""Loss-scale states: dynamic, static and no-op, sharing one interface.

Every scale is an immutable pytree. Its *data* (the loss scale, a float32 scalar, and the
counters, int32 scalars) are pytree children, so a scale can be passed through ``jax.jit``,
``jax.vmap`` and ``lax.cond`` and stored in an optimizer state. Its *configuration* (a
:class:`ScaleRule` for the dynamic scale) is static auxiliary data: changing it recompiles.

The data path of one step reads top to bottom::

    loss, grads = scale.value_and_grad(loss_fn)(params)  # scale, differentiate, unscale
    finite = jdls.all_finite(grads)                       # check
    ...                                                   # update only if finite
    scale = scale.adjust(finite)                          # next scale
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any, TypeVar

import jax
import jax.numpy as jnp
import numpy as np

__all__ = [
    "DynamicScale",
    "LossScale",
    "MinimumScaleError",
    "NoOpScale",
    "ScaleRule",
    "StaticScale",
    "all_finite",
]

_F32 = jnp.float32
_I32 = jnp.int32
_F32_MAX = float(np.finfo(np.float32).max)

T = TypeVar("T")


class MinimumScaleError(RuntimeError):
    """Raised by :meth:`DynamicScale.check` when an overflow happened at the minimum scale.

    DeepSpeed raises this condition inside its scaler and stops the run; jdls cannot raise from
    inside a compiled step, so it counts the event in ``DynamicScale.min_scale_overflows`` and
    raises here, on the host, when you ask.
    """


# --------------------------------------------------------------------------------------------
# Checks of arguments (shared by the rule, the scales and the presets).
# --------------------------------------------------------------------------------------------


def _check_number(name: str, value: Any) -> float:
    if isinstance(value, str | bytes):  # float("1024") would succeed: say it is the wrong type
        raise TypeError(f"{name} must be a real number, got {value!r}")
    if isinstance(value, bool) or not isinstance(value, int | float | np.number):
        try:
            value = float(np.asarray(value))  # also accepts 0-d arrays
        except (TypeError, ValueError):
            raise TypeError(f"{name} must be a real number, got {value!r}") from None
    value = float(value)
    if math.isnan(value):
        raise ValueError(f"{name} must be a number, got nan")
    return value


def _check_positive_finite(name: str, value: Any) -> float:
    value = _check_number(name, value)
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
    if value > _F32_MAX:
        raise ValueError(f"{name} must fit in float32 (<= {_F32_MAX:.6g}), got {value!r}")
    return value


def _check_int(name: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer):
        raise TypeError(f"{name} must be an int, got {value!r}")
    value = int(value)
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    if value > np.iinfo(np.int32).max:
        raise ValueError(f"{name} must fit in int32 (<= {np.iinfo(np.int32).max}), got {value}")
    return value


# --------------------------------------------------------------------------------------------
# The rule: configuration of a dynamic scale, with the presets as data.
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ScaleRule:
    """How a :class:`DynamicScale` changes after each step (static configuration).

    One general state machine covers every library jdls mirrors; a preset is a ``ScaleRule``
    with particular values. On each step, given ``finite`` (were the unscaled gradients all
    finite?):

    * **finite step**: the growth counter counts it; when the counter reaches
      ``growth_interval`` the scale is multiplied by ``growth_factor`` and the counter restarts
      at ``counter_after_growth``.
    * **non-finite step**: the counter restarts at 0 and one unit of hysteresis is used; once
      none is left (``hysteresis=1`` means none at all) the scale backs off: it is multiplied
      by ``backoff_factor``, or divided by ``growth_factor`` when ``backoff_factor`` is None.
    * **overflow tolerance** (Cerebras): when ``overflow_tolerance`` is set the counter counts
      *every* step since the last change of scale, and the scale backs off only when the
      fraction of non-finite steps among them exceeds the tolerance.

    Args:
      growth_factor: multiplier applied on growth, > 1.
      backoff_factor: multiplier applied on backoff, in (0, 1); None divides by growth_factor
        instead (jmp, Keras, DeepSpeed compute ``scale / factor``).
      growth_interval: counted steps (the current one included) that trigger a growth, >= 1.
      counter_after_growth: value of the counter right after a growth, 0 or 1. DeepSpeed
        counts the growth step itself (1): it grows after ``window + 1`` finite steps and then
        every ``window``.
      min_loss_scale: lower clamp applied on backoff (None: no clamp).
      max_loss_scale: upper clamp applied on growth (None: no clamp).
      clamp_every_step: apply both clamps after every step, not only on a change (Cerebras).
      keep_scale_if_growth_overflows: a growth whose float32 result is inf keeps the old scale
        (PyTorch, jmp). Without it and without a maximum, the scale may become inf (Keras,
        DeepSpeed, Megatron do this).
      hysteresis: number of consecutive non-finite steps needed before a backoff, >= 1.
      refill_hysteresis_on_finite: refill the hysteresis on every finite step (DeepSpeed's
        ``consecutive_hysteresis``); otherwise it is refilled only on growth.
      overflow_tolerance: Cerebras' tolerated fraction of non-finite steps, >= 0; None for the
        classic rule.
      error_at_min_scale: a backoff wanted while the scale already equals ``min_loss_scale``
        is an error (DeepSpeed's ``raise_error_at_min_scale``); see
        :meth:`DynamicScale.check`.
      max_gradient_norm: Cerebras' global-norm clipping limit, used by ``jdls.wrap`` when it
        is given no ``max_norm`` of its own (None: no clipping).
      finite_from_norm: ``jdls.wrap`` decides finiteness as Cerebras does, from the float32
        global norm of the gradients (``norm < inf``): a step whose gradients are all finite
        but whose float32 sum of squares overflows counts as non-finite (skipped, and the
        scale backs off). Otherwise only an inf or NaN element makes a step non-finite.
      name: the preset's name, for messages and documentation.

    Example:
      >>> import jdls
      >>> rule = jdls.ScaleRule(growth_interval=100, hysteresis=2)
      >>> scale = jdls.DynamicScale.from_rule(rule, loss_scale=1024.0)
      >>> float(scale.loss_scale)
      1024.0
    """

    growth_factor: float = 2.0
    backoff_factor: float | None = 0.5
    growth_interval: int = 2000
    counter_after_growth: int = 0
    min_loss_scale: float | None = 1.0
    max_loss_scale: float | None = 2.0**24
    clamp_every_step: bool = False
    keep_scale_if_growth_overflows: bool = False
    hysteresis: int = 1
    refill_hysteresis_on_finite: bool = False
    overflow_tolerance: float | None = None
    error_at_min_scale: bool = False
    max_gradient_norm: float | None = None
    finite_from_norm: bool = False
    name: str = "custom"

    def __post_init__(self) -> None:
        growth = _check_number("growth_factor", self.growth_factor)
        if not (math.isfinite(growth) and growth > 1):
            raise ValueError(f"growth_factor must be > 1, got {self.growth_factor!r}")
        if self.backoff_factor is not None:
            backoff = _check_number("backoff_factor", self.backoff_factor)
            if not 0 < backoff < 1:
                raise ValueError(
                    f"backoff_factor must be in the open interval (0, 1), got {backoff!r}"
                )
        _check_int("growth_interval", self.growth_interval, 1)
        if self.counter_after_growth not in (0, 1):
            raise ValueError(
                f"counter_after_growth must be 0 or 1, got {self.counter_after_growth!r}"
            )
        if self.min_loss_scale is not None:
            _check_positive_finite("min_loss_scale", self.min_loss_scale)
        if self.max_loss_scale is not None:
            _check_positive_finite("max_loss_scale", self.max_loss_scale)
        if (
            self.min_loss_scale is not None
            and self.max_loss_scale is not None
            and self.min_loss_scale > self.max_loss_scale
        ):
            raise ValueError(
                f"min_loss_scale must be <= max_loss_scale, got min_loss_scale="
                f"{self.min_loss_scale!r} > max_loss_scale={self.max_loss_scale!r}"
            )
        _check_int("hysteresis", self.hysteresis, 1)
        if self.overflow_tolerance is not None:
            tol = _check_number("overflow_tolerance", self.overflow_tolerance)
            if not (math.isfinite(tol) and tol >= 0):
                raise ValueError(f"overflow_tolerance must be >= 0, got {tol!r}")
        if self.max_gradient_norm is not None:
            norm = _check_number("max_gradient_norm", self.max_gradient_norm)
            if not (math.isfinite(norm) and norm > 0):
                raise ValueError(f"max_gradient_norm must be a finite number > 0, got {norm!r}")
        if self.error_at_min_scale and self.min_loss_scale is None:
            raise ValueError("error_at_min_scale=True needs a min_loss_scale, got None")

    def clamp(self, loss_scale: jax.Array) -> jax.Array:
        """Clamp a loss scale to ``[min_loss_scale, max_loss_scale]`` (the bounds that are set)."""
        if self.max_loss_scale is not None:
            loss_scale = jnp.minimum(loss_scale, _F32(self.max_loss_scale))
        if self.min_loss_scale is not None:
            loss_scale = jnp.maximum(loss_scale, _F32(self.min_loss_scale))
        return loss_scale


# --------------------------------------------------------------------------------------------
# Tree helpers.
# --------------------------------------------------------------------------------------------


def _is_float(x: Any) -> bool:
    return jnp.issubdtype(jnp.result_type(x), jnp.inexact)


def all_finite(tree: Any) -> jax.Array:
    """Whether every element of every floating-point leaf of ``tree`` is finite.

    Integer and boolean leaves are ignored, ``None`` leaves are empty subtrees, and an empty
    tree is finite.

    Args:
      tree: a pytree of arrays.

    Returns:
      A boolean scalar array: False when any float leaf holds an inf, -inf or NaN.

    Example:
      >>> import jax.numpy as jnp, jdls
      >>> bool(jdls.all_finite({"w": jnp.ones(3), "step": jnp.array(7)}))
      True
      >>> bool(jdls.all_finite([jnp.array([1.0, jnp.inf])]))
      False
    """
    flags = [jnp.all(jnp.isfinite(x)) for x in jax.tree_util.tree_leaves(tree) if _is_float(x)]
    if not flags:
        return jnp.array(True)
    if len(flags) == 1:
        return flags[0]
    return jnp.all(jnp.stack(flags))


def _unscaled_dtype(dtype: Any) -> Any:
    """Result dtype of unscaling: half-precision floats are promoted to float32."""
    return jnp.promote_types(dtype, _F32)


def _finite_flag(grads_finite: Any) -> jax.Array:
    """``grads_finite`` as a boolean scalar, or an error that says what to pass instead."""
    hint = "pass jdls.all_finite(grads), whether the unscaled gradients were all finite"
    try:
        flag = jnp.asarray(grads_finite)
    except (TypeError, ValueError):  # a dict of gradients gives a ValueError
        raise TypeError(
            f"adjust expects a boolean scalar, got {type(grads_finite).__name__}: {hint}"
        ) from None
    if flag.shape != ():
        raise ValueError(
            f"adjust expects a boolean scalar, got an array of shape {flag.shape}: {hint}"
        )
    if not (flag.dtype == jnp.bool_ or jnp.issubdtype(flag.dtype, jnp.integer)):
        raise TypeError(
            f"adjust expects a boolean scalar, got a {flag.dtype} value (the loss?): {hint}"
        )
    return flag.astype(jnp.bool_)


class NotATransformationError(AttributeError):
    """A loss scale was used where an optax transformation is expected (``optax.chain``)."""


class _NotATransformation:
    """``init``/``update`` of a loss scale: raise, on the class and on instances, an error that
    says how to use the scale (``optax.chain(jdls.DynamicScale(), ...)`` is a common mistake).

    The error is an ``AttributeError``, so ``hasattr(scale, "init")`` stays False.
    """

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, obj: Any, owner: type | None = None) -> Any:
        what = (type(obj) if obj is not None or owner is None else owner).__name__
        instance = f"jdls.{what}" + ("" if obj is None else "(...)")
        raise NotATransformationError(
            f"{instance} is a loss scale, not an optax transformation (it has no "
            f".{self.name}); wrap the optimizer with it instead: "
            f"jdls.wrap(optax.adam(1e-3), jdls.{what}(...)), and put jdls.wrap(...) in "
            "optax.chain"
        )


# --------------------------------------------------------------------------------------------
# The shared interface.
# --------------------------------------------------------------------------------------------


class LossScale:
    """The interface shared by :class:`DynamicScale`, :class:`StaticScale` and :class:`NoOpScale`.

    User code written against it never branches on the kind of scale.

    * ``loss_scale``: the current scale, a float32 scalar array.
    * ``scale(tree)``: multiply every float leaf by the scale, keeping its dtype. The product
      is formed in float32 and rounded once to the leaf's dtype, so a float16 loss overflows
      only where the scaled value really exceeds float16's range.
    * ``unscale(tree)``: divide every float leaf by the scale. Leaves narrower than float32
      (float16, bfloat16, float8) come back as **float32**, so that dividing by a large scale
      never underflows or loses bits in half precision; float32 and float64 leaves keep their
      dtype. Integer and boolean leaves pass through untouched; ``None`` leaves are preserved.
    * ``adjust(grads_finite)``: the next state after a step.
    * ``value_and_grad(fun, argnums, has_aux)``: ``jax.value_and_grad`` with the loss scaled
      and the value and gradients unscaled.
    """

    loss_scale: jax.Array

    init = _NotATransformation()
    update = _NotATransformation()

    def scale(self, tree: T) -> T:
        """Multiply every floating-point leaf of ``tree`` by the loss scale.

        Args:
          tree: a pytree, usually the loss.

        Returns:
          The tree with float leaves scaled, each in its own dtype.

        Example:
          >>> import jax.numpy as jnp, jdls
          >>> jdls.StaticScale(8.0).scale(jnp.float16(0.5))
          Array(4., dtype=float16)
        """
        loss_scale = self.loss_scale

        def scale_leaf(x: Any) -> Any:
            if not _is_float(x):
                return x
            x = jnp.asarray(x)
            return (x.astype(jnp.promote_types(x.dtype, _F32)) * loss_scale).astype(x.dtype)

        return jax.tree_util.tree_map(scale_leaf, tree)

    def unscale(self, tree: T) -> T:
        """Divide every floating-point leaf of ``tree`` by the loss scale.

        Args:
          tree: a pytree, usually the gradients of a scaled loss.

        Returns:
          The tree with float leaves divided by the scale; 16-bit and narrower float leaves
          come back as float32, wider ones keep their dtype; other leaves are untouched.

        Example:
          >>> import jax.numpy as jnp, jdls
          >>> jdls.StaticScale(1024.0).unscale(jnp.float16(2.0))
          Array(0.00195312, dtype=float32)
        """
        loss_scale = self.loss_scale

        def unscale_leaf(x: Any) -> Any:
            if not _is_float(x):
                return x
            x = jnp.asarray(x)
            dtype = _unscaled_dtype(x.dtype)
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
    ) -> Callable[..., Any]:
        """``jax.value_and_grad`` of ``fun`` with the loss scaled and the results unscaled.

        The loss returned by ``fun`` is multiplied by the scale before differentiation; the
        gradients are unscaled (see :meth:`unscale`), and the value returned is the loss
        ``fun`` computed, untouched by scaling, so it is exact even when the scaled loss
        overflowed.

        Args:
          fun: the loss function; returns a scalar, or ``(scalar, aux)`` with ``has_aux``.
          argnums: positional argument(s) to differentiate, as in ``jax.value_and_grad``.
          has_aux: whether ``fun`` returns ``(loss, aux)``.

        Returns:
          A function with ``fun``'s arguments returning ``(loss, grads)``, or
          ``((loss, aux), grads)`` with ``has_aux``: the structure ``jax.value_and_grad``
          returns.

        Example:
          >>> import jax.numpy as jnp, jdls
          >>> scale = jdls.DynamicScale()
          >>> loss, grads = scale.value_and_grad(lambda w: jnp.sum(w**2))(jnp.ones(2))
          >>> float(loss), grads.tolist()
          (2.0, [2.0, 2.0])
        """

        return _scaled_value_and_grad(
            self,
            fun,
            has_aux,
            lambda scaled: jax.value_and_grad(scaled, argnums=argnums, has_aux=True),
        )


def _scaled_value_and_grad(
    scale: LossScale,
    fun: Callable[..., Any],
    has_aux: bool,
    differentiate: Callable[[Callable[..., Any]], Callable[..., Any]],
) -> Callable[..., Any]:
    """``value_and_grad`` of ``fun`` with the loss scaled and the results unscaled.

    ``differentiate(scaled)`` builds the gradient function of ``scaled`` (with
    ``has_aux=True``): ``jax.value_and_grad`` for :meth:`LossScale.value_and_grad`,
    ``nnx.value_and_grad`` for ``jdls.nnx_value_and_grad``.
    """

    def scaled(*args: Any, **kwargs: Any) -> tuple[Any, tuple[Any, Any]]:
        out = fun(*args, **kwargs)
        if has_aux:
            if not (isinstance(out, tuple) and len(out) == 2):
                raise TypeError(
                    "with has_aux=True, fun must return a pair (loss, aux), got "
                    + (
                        f"an array of shape {out.shape}: return (loss, aux), or drop has_aux"
                        if isinstance(out, jax.Array)
                        else type(out).__name__
                    )
                )
            loss, aux = out
        else:
            loss, aux = out, None
        return scale.scale(loss), (loss, aux)

    grad_fn = differentiate(scaled)

    def value_and_grad_fn(*args: Any, **kwargs: Any) -> Any:
        (_, (loss, aux)), grads = grad_fn(*args, **kwargs)
        grads = scale.unscale(grads)
        return ((loss, aux), grads) if has_aux else (loss, grads)

    return value_and_grad_fn


def _register(cls: type, data_fields: tuple[str, ...], meta_fields: tuple[str, ...]) -> None:
    """Register a dataclass as a pytree: ``data_fields`` are children, the rest static."""

    def flatten_with_keys(obj: Any) -> tuple[list[Any], tuple[Any, ...]]:
        children = [(jax.tree_util.GetAttrKey(f), getattr(obj, f)) for f in data_fields]
        return children, tuple(getattr(obj, f) for f in meta_fields)

    def flatten(obj: Any) -> tuple[list[Any], tuple[Any, ...]]:
        return [getattr(obj, f) for f in data_fields], tuple(getattr(obj, f) for f in meta_fields)

    def unflatten(meta: tuple[Any, ...], children: Iterable[Any]) -> Any:
        obj: Any = object.__new__(cls)  # no validation: children may be tracers or sentinels
        for name, value in zip(meta_fields, meta, strict=True):
            object.__setattr__(obj, name, value)
        for name, value in zip(data_fields, children, strict=True):
            object.__setattr__(obj, name, value)
        return obj

    jax.tree_util.register_pytree_with_keys(cls, flatten_with_keys, unflatten, flatten)


# --------------------------------------------------------------------------------------------
# No-op and static scales.
# --------------------------------------------------------------------------------------------


class NoOpScale(LossScale):
    """A scale of exactly 1 that never changes: no loss scaling, same interface.

    ``unscale`` still promotes 16-bit gradients to float32, like the other scales, so switching
    the kind of scale never changes the dtypes of a train step.

    Example:
      >>> import jax.numpy as jnp, jdls
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
        _finite_flag(grads_finite)
        return self


@dataclasses.dataclass(frozen=True, eq=False, init=False)
class StaticScale(LossScale):
    """A fixed loss scale that never changes.

    Args:
      loss_scale: the scale, a finite number > 0.

    Example:
      >>> import jdls
      >>> scale = jdls.StaticScale(128.0)
      >>> float(scale.adjust(False).loss_scale)
      128.0
    """

    loss_scale: jax.Array

    def __init__(self, loss_scale: float | jax.Array) -> None:
        value = _check_positive_finite("loss_scale", loss_scale)
        object.__setattr__(self, "loss_scale", jnp.asarray(value, _F32))

    def adjust(self, grads_finite: jax.Array | bool) -> StaticScale:
        """Return the same scale: a static scale never changes."""
        _finite_flag(grads_finite)
        return self


# --------------------------------------------------------------------------------------------
# The dynamic scale.
# --------------------------------------------------------------------------------------------

_DYNAMIC_DATA = (
    "loss_scale",
    "counter",
    "hysteresis",
    "overflows",
    "skipped",
    "min_scale_overflows",
)


@dataclasses.dataclass(frozen=True, eq=False, init=False)
class DynamicScale(LossScale):
    """A loss scale that backs off on overflow and grows after a run of finite steps.

    ``DynamicScale()`` with no arguments is a safe default for float16 training: it starts at
    ``2**15``, halves on every step with a non-finite gradient, doubles after 2000 finite steps
    in a row, and stays within ``[1, 2**24]``, so it never becomes 0, inf or NaN however long
    overflows or finite steps go on. Other rules, including the exact rules of PyTorch, Flax,
    jmp, Keras, DeepSpeed, Megatron-LM and Cerebras, are in :mod:`jdls.presets`.

    Data (pytree children): ``loss_scale`` (float32), and int32 counters: ``counter`` (steps
    counted towards the next growth), ``hysteresis`` (non-finite steps still forgiven),
    ``overflows`` (non-finite steps since the scale last changed), ``skipped`` (non-finite
    steps in total) and ``min_scale_overflows`` (backoffs wanted at the minimum scale).
    Configuration (static): ``rule``, a :class:`ScaleRule`.

    Args:
      loss_scale: initial scale, a finite number > 0.
      growth_factor: multiplier on growth, > 1.
      backoff_factor: multiplier on backoff, in (0, 1).
      growth_interval: finite steps in a row that trigger a growth, >= 1.
      min_loss_scale: smallest scale (None: no minimum).
      max_loss_scale: largest scale (None: no maximum; a growth that would give inf is
        then dropped).
      hysteresis: non-finite steps in a row needed before a backoff, >= 1.

    Example:
      >>> import jdls
      >>> scale = jdls.DynamicScale(loss_scale=1024.0, growth_interval=2)
      >>> scale = scale.adjust(False)          # overflow: back off
      >>> float(scale.loss_scale)
      512.0
      >>> scale = scale.adjust(True).adjust(True)  # two finite steps: grow
      >>> float(scale.loss_scale)
      1024.0
    """

    loss_scale: jax.Array
    counter: jax.Array
    hysteresis: jax.Array
    overflows: jax.Array
    skipped: jax.Array
    min_scale_overflows: jax.Array
    rule: ScaleRule

    def __init__(
        self,
        loss_scale: float = 2.0**15,
        *,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        min_loss_scale: float | None = 1.0,
        max_loss_scale: float | None = 2.0**24,
        hysteresis: int = 1,
    ) -> None:
        rule = ScaleRule(
            growth_factor=growth_factor,
            backoff_factor=backoff_factor,
            growth_interval=growth_interval,
            min_loss_scale=min_loss_scale,
            max_loss_scale=max_loss_scale,
            keep_scale_if_growth_overflows=max_loss_scale is None,
            hysteresis=hysteresis,
            name="jdls",
        )
        value = _check_positive_finite("loss_scale", loss_scale)
        low = -math.inf if min_loss_scale is None else min_loss_scale
        high = math.inf if max_loss_scale is None else max_loss_scale
        if not low <= value <= high:
            raise ValueError(
                f"loss_scale must be within [min_loss_scale, max_loss_scale] = "
                f"[{min_loss_scale!r}, {max_loss_scale!r}], got {loss_scale!r}: start inside the "
                "bounds, or widen them (None for no bound)"
            )
        _init_dynamic(self, rule, loss_scale)

    @classmethod
    def from_rule(
        cls,
        rule: ScaleRule,
        loss_scale: float,
        *,
        counter: int = 0,
        hysteresis: int | None = None,
        overflows: int = 0,
        skipped: int = 0,
    ) -> DynamicScale:
        """A dynamic scale following ``rule``, starting at ``loss_scale``.

        Args:
          rule: the configuration.
          loss_scale: initial scale, a finite number > 0.
          counter: initial growth counter, in ``[0, rule.growth_interval)``.
          hysteresis: initial hysteresis, in ``[1, rule.hysteresis]`` (default: full).
          overflows: initial count of non-finite steps since the last change, >= 0.
          skipped: initial count of skipped steps, >= 0.

        Returns:
          The scale.

        Example:
          >>> import jdls
          >>> s = jdls.DynamicScale.from_rule(jdls.ScaleRule(), 256.0, counter=5)
          >>> int(s.counter)
          5
        """
        scale = object.__new__(cls)
        _init_dynamic(
            scale,
            rule,
            loss_scale,
            counter=counter,
            hysteresis=hysteresis,
            overflows=overflows,
            skipped=skipped,
        )
        return scale

    def replace(self, **changes: Any) -> DynamicScale:
        """A copy with some fields replaced (no validation; for advanced use and tests).

        Example:
          >>> import jax.numpy as jnp, jdls
          >>> float(jdls.DynamicScale().replace(loss_scale=jnp.float32(8.0)).loss_scale)
          8.0
        """
        unknown = set(changes) - set(_DYNAMIC_DATA) - {"rule"}
        if unknown:
            raise TypeError(
                f"DynamicScale.replace got unknown fields {sorted(unknown)}; "
                f"fields are {[*_DYNAMIC_DATA, 'rule']}"
            )
        data = {name: changes.get(name, getattr(self, name)) for name in _DYNAMIC_DATA}
        return DynamicScale._make(changes.get("rule", self.rule), **data)

    def adjust(self, grads_finite: jax.Array | bool) -> DynamicScale:
        """The next state after a step.

        Pure and traceable: works under ``jit``, ``vmap`` and inside ``lax.cond``.

        Args:
          grads_finite: boolean scalar, whether the unscaled gradients were all finite
            (see :func:`all_finite`).

        Returns:
          The new :class:`DynamicScale`.

        Example:
          >>> import jdls
          >>> float(jdls.DynamicScale(64.0).adjust(False).loss_scale)
          32.0
        """
        rule = self.rule
        finite = _finite_flag(grads_finite)
        scale = self.loss_scale
        one = jnp.ones((), _I32)
        zero = jnp.zeros((), _I32)
        overflow = ~finite
        skipped = self.skipped + overflow.astype(_I32)
        overflows = self.overflows + overflow.astype(_I32)

        if rule.backoff_factor is None:
            # ``scale / factor``, as XLA compiles a division by a constant: a multiplication by
            # the float32 reciprocal. Written out, it gives the same bits jitted or not.
            backed_off = scale * (np.float32(1.0) / np.float32(rule.growth_factor))
        else:
            backed_off = scale * _F32(rule.backoff_factor)
        grown = scale * _F32(rule.growth_factor)
        if rule.keep_scale_if_growth_overflows:
            grown = jnp.where(jnp.isfinite(grown), grown, scale)
        if not rule.clamp_every_step:
            if rule.min_loss_scale is not None:
                backed_off = jnp.maximum(backed_off, _F32(rule.min_loss_scale))
            if rule.max_loss_scale is not None:
                grown = jnp.minimum(grown, _F32(rule.max_loss_scale))

        if rule.overflow_tolerance is None:
            # Classic rule: count finite steps; hysteresis forgives some non-finite ones.
            counted = self.counter + 1
            grow = finite & (counted >= rule.growth_interval)
            exhausted = self.hysteresis <= 1
            backoff = overflow & exhausted
            counter = jnp.where(
                overflow, zero, jnp.where(grow, _I32(rule.counter_after_growth), counted)
            )
            refill = grow | finite if rule.refill_hysteresis_on_finite else grow
            hysteresis = jnp.where(
                refill,
                _I32(rule.hysteresis),
                jnp.where(overflow, jnp.maximum(self.hysteresis - 1, one), self.hysteresis),
            )
        else:
            # Cerebras: count every step since the last change; back off when the fraction of
            # non-finite ones exceeds the tolerance (compared in float32).
            counted = self.counter + 1
            ratio = overflows.astype(_F32) / counted.astype(_F32)
            backoff = ratio > _F32(rule.overflow_tolerance)
            grow = ~backoff & (counted >= rule.growth_interval)
            counter = jnp.where(backoff | grow, zero, counted)
            hysteresis = self.hysteresis

        new_scale = jnp.where(backoff, backed_off, jnp.where(grow, grown, scale))
        if rule.clamp_every_step:
            new_scale = rule.clamp(new_scale)
        changed = backoff | grow
        overflows = jnp.where(changed, zero, overflows)

        min_scale_overflows = self.min_scale_overflows
        if rule.min_loss_scale is not None:
            at_min = scale == _F32(rule.min_loss_scale)
            min_scale_overflows = min_scale_overflows + (backoff & at_min).astype(_I32)

        return DynamicScale._make(
            rule,
            loss_scale=new_scale.astype(_F32),
            counter=counter.astype(_I32),
            hysteresis=jnp.asarray(hysteresis, _I32),
            overflows=overflows.astype(_I32),
            skipped=skipped.astype(_I32),
            min_scale_overflows=min_scale_overflows.astype(_I32),
        )

    def check(self) -> DynamicScale:
        """Raise on the host if a backoff was wanted at the minimum scale, where the rule says so.

        DeepSpeed stops the run with an error when an overflow needs a backoff while the scale
        is already at ``min_scale`` (``raise_error_at_min_scale=True``). jdls records those
        events in ``min_scale_overflows`` on device and leaves the scale at the minimum; call
        ``check()`` outside ``jit`` (it reads one integer from the device) to get the error.
        For rules without ``error_at_min_scale`` it never raises.

        Returns:
          ``self``, so that it can be chained.

        Raises:
          MinimumScaleError: the rule has ``error_at_min_scale`` and an event was recorded.

        Example:
          >>> import jdls
          >>> scale = jdls.presets.deepspeed(init_scale=1.0, delayed_shift=1)
          >>> scale = scale.adjust(False)
          >>> try:
          ...     scale.check()
          ... except jdls.MinimumScaleError as e:
          ...     print("stopped:", type(e).__name__)
          stopped: MinimumScaleError
        """
        if self.rule.error_at_min_scale:
            count = int(jax.device_get(self.min_scale_overflows))
            if count:
                raise MinimumScaleError(
                    f"the loss scale is already at its minimum ({self.rule.min_loss_scale}) and "
                    f"{count} step(s) overflowed there: gradients overflow even unscaled. "
                    "Look for the source of the inf/NaN (jdls.stats, jdls.nonfinite_paths), "
                    "lower min_loss_scale, or pass raise_error_at_min_scale=False."
                )
        return self

    @classmethod
    def _make(cls, rule: ScaleRule, **data: Any) -> DynamicScale:
        obj = object.__new__(cls)
        object.__setattr__(obj, "rule", rule)
        for name in _DYNAMIC_DATA:
            object.__setattr__(obj, name, data[name])
        return obj

    def __repr__(self) -> str:
        def show(x: Any) -> str:
            try:
                return repr(np.asarray(x).item())
            except Exception:  # tracers and other stand-ins
                return type(x).__name__

        data = ", ".join(f"{name}={show(getattr(self, name))}" for name in _DYNAMIC_DATA)
        return f"DynamicScale({data}, rule={self.rule.name!r})"


def _init_dynamic(
    obj: DynamicScale,
    rule: ScaleRule,
    loss_scale: float,
    *,
    counter: int = 0,
    hysteresis: int | None = None,
    overflows: int = 0,
    skipped: int = 0,
) -> None:
    if not isinstance(rule, ScaleRule):
        raise TypeError(f"rule must be a jdls.ScaleRule, got {type(rule).__name__}")
    value = _check_positive_finite("loss_scale", loss_scale)
    if rule.clamp_every_step and rule.max_loss_scale is not None:
        value = min(value, rule.max_loss_scale)
    counter = _check_int("counter", counter, 0)
    if counter >= rule.growth_interval:
        raise ValueError(
            f"counter must be < growth_interval ({rule.growth_interval}), got {counter}"
        )
    hysteresis = rule.hysteresis if hysteresis is None else _check_int("hysteresis", hysteresis, 1)
    if hysteresis > rule.hysteresis:
        raise ValueError(
            f"hysteresis must be in [1, {rule.hysteresis}] (the rule's hysteresis), "
            f"got {hysteresis}"
        )
    overflows = _check_int("overflows", overflows, 0)
    skipped = _check_int("skipped", skipped, 0)
    object.__setattr__(obj, "rule", rule)
    object.__setattr__(obj, "loss_scale", jnp.asarray(value, _F32))
    object.__setattr__(obj, "counter", jnp.asarray(counter, _I32))
    object.__setattr__(obj, "hysteresis", jnp.asarray(hysteresis, _I32))
    object.__setattr__(obj, "overflows", jnp.asarray(overflows, _I32))
    object.__setattr__(obj, "skipped", jnp.asarray(skipped, _I32))
    object.__setattr__(obj, "min_scale_overflows", jnp.zeros((), _I32))


_register(NoOpScale, (), ())
_register(StaticScale, ("loss_scale",), ())
_register(DynamicScale, _DYNAMIC_DATA, ("rule",))


# --------------------------------------------------------------------------------------------
# flax.serialization: ``to_bytes``/``from_bytes``/``to_state_dict`` of any state holding a scale.
# --------------------------------------------------------------------------------------------


def _register_flax_serialization() -> None:
    """Teach ``flax.serialization`` the three scales (data only; the rule comes from the target).

    Without this, ``flax.serialization.to_bytes`` of a ``TrainState`` whose optimizer state
    holds a scale fails with "can not serialize 'DynamicScale' object".
    """
    try:
        from flax import serialization
    except ImportError:  # pragma: no cover - flax is a dependency
        return

    def restore(target: Any, state: dict[str, Any], fields: tuple[str, ...]) -> dict[str, Any]:
        if set(state) != set(fields):
            raise ValueError(
                f"cannot restore a {type(target).__name__} from the saved fields "
                f"{sorted(state)} (a {type(target).__name__} has {sorted(fields)}): build the "
                "target with the same kind of scale as the one that was saved"
            )
        return {f: serialization.from_state_dict(getattr(target, f), state[f], f) for f in fields}

    def dynamic_from(target: DynamicScale, state: dict[str, Any]) -> DynamicScale:
        return DynamicScale._make(target.rule, **restore(target, state, _DYNAMIC_DATA))

    def static_from(target: StaticScale, state: dict[str, Any]) -> StaticScale:
        obj = object.__new__(StaticScale)
        object.__setattr__(obj, "loss_scale", restore(target, state, ("loss_scale",))["loss_scale"])
        return obj

    serialization.register_serialization_state(
        DynamicScale,
        lambda s: {f: serialization.to_state_dict(getattr(s, f)) for f in _DYNAMIC_DATA},
        dynamic_from,
    )
    serialization.register_serialization_state(
        StaticScale, lambda s: {"loss_scale": s.loss_scale}, static_from
    )

    def noop_from(target: NoOpScale, state: dict[str, Any]) -> NoOpScale:
        restore(target, state, ())
        return target

    serialization.register_serialization_state(NoOpScale, lambda s: {}, noop_from)


_register_flax_serialization()
