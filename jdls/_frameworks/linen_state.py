"""Flax linen integration: a ``TrainState`` with the loss scale at hand.

``jdls.wrap`` is an optax transformation, so it already works unchanged in Flax:
``flax.training.train_state.TrainState.create(..., tx=jdls.wrap(optax.adam(...)))``;
``apply_gradients`` checks the gradients, skips the update on inf/NaN and adjusts the scale.
:class:`TrainState` adds only reading the scale and a ``value_and_grad`` that uses it (and,
with sites, their update), and :func:`from_flax_train_state` converts a Flax-example state.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import serialization
from flax.training import train_state

from jdls._frameworks.linen_scope import SITES
from jdls._frameworks.linen_step import split_gradients
from jdls._frameworks.linen_step import value_and_grad as variables_value_and_grad
from jdls._scales.grad import reject_axis_name
from jdls._scales.scale import LossScale
from jdls._sites.update import update_sites
from jdls._transforms.stats import (
    Stats,
    WrapState,
    get_scale,
    keep_if_skipped,
    stats,
    step_applied,
)

__all__ = ["TrainState", "from_flax_train_state"]


class TrainState(train_state.TrainState):
    """A Flax linen ``TrainState`` for an optimizer built with :func:`jdls.wrap`.

    Identical to ``flax.training.train_state.TrainState`` (same fields, ``create`` and
    ``apply_gradients``: ``apply_gradients`` is where ``jdls.wrap`` checks the gradients,
    skips a non-finite step and adjusts the scale), with the loss scale at hand: the
    properties :attr:`scale`, :attr:`loss_scale` and :attr:`stats`, and
    :meth:`value_and_grad`. A plain ``TrainState`` works just as well with
    ``jdls.get_scale(state)``; this class saves that line.

    Example:
      >>> import jax, jax.numpy as jnp, optax, jdls
      >>> import flax.linen as nn
      >>> model = nn.Dense(1)
      >>> x, y = jnp.ones((4, 3)), jnp.ones((4, 1))
      >>> state = jdls.linen.TrainState.create(
      ...     apply_fn=model.apply,
      ...     params=model.init(jax.random.key(0), x)["params"],
      ...     tx=jdls.wrap(optax.sgd(0.1), jdls.DynamicScale(1024.0)),
      ... )
      >>> def loss_fn(params):
      ...     pred = state.apply_fn({"params": params}, x.astype(jnp.float16))
      ...     return jnp.mean((pred.astype(jnp.float32) - y) ** 2)
      >>> loss, grads = state.value_and_grad(loss_fn)(state.params)
      >>> state = state.apply_gradients(grads=grads)
      >>> float(state.loss_scale), int(state.stats.skipped_steps)
      (1024.0, 0)
    """

    def __init_subclass__(cls, **kwargs: Any) -> None:
        # A field named like one of the properties would hide it, silently: refuse it.
        own = set(inspect.get_annotations(cls))
        clash = sorted(own & {"scale", "loss_scale", "stats"})
        if clash:
            raise TypeError(
                f"{cls.__name__} declares the field(s) {clash}, which would hide the property "
                f"of jdls.linen.TrainState of that name (the loss scale, read from opt_state). Rename "
                "the field; a Flax-style dynamic_scale field is fine but not needed: the scale "
                "lives in opt_state (see docs/migration/flax.md)"
            )
        super().__init_subclass__(**kwargs)

    # No default here (a subclass may add fields without one, as Flax's examples add
    # ``batch_stats``): ``create`` gives None.
    sites: Any

    @classmethod
    def create(  # type: ignore[override]
        cls, *, apply_fn: Any, params: Any, tx: Any, sites: Any = None, **kwargs: Any
    ) -> Any:
        """Flax's ``TrainState.create``, with the model's sites (its ``"jdls"`` collection,
        e.g. ``variables["jdls"]`` of a model from ``jdls.linen.probes``), None without."""
        return super().create(apply_fn=apply_fn, params=params, tx=tx, sites=sites, **kwargs)

    def apply_gradients(self, *, grads: Any, value: Any = None, **kwargs: Any) -> TrainState:
        """Flax's ``apply_gradients``; other fields given (e.g. ``batch_stats``) keep their old
        values on a skipped step, as the parameters and the optimizer state do.

        With :attr:`sites`, ``grads`` is shaped like :attr:`variables` (what
        :meth:`value_and_grad` returns): ``grads["params"]`` go to the optimizer, and every
        site is updated by its kind from its measurement ``grads["jdls"]``, knowing whether
        the step was taken (never given to the optimizer, never clipped or decayed).
        Without sites, ``grads`` is either the parameters' gradients or shaped like
        :attr:`variables`, ``{"params": ...}``.

        ``value=loss`` passes the step's loss to the wrap (``tx.update(..., value=loss)``), so
        that ``jdls.skip_cause`` tells a non-finite loss from an overflow of the scaled
        gradients (see docs/guides/debugging.md).

        ``step`` still counts every call, as in Flax.
        """
        grads, measured = split_gradients(grads, self.params, self.sites)
        if value is None:
            new = super().apply_gradients(grads=grads, **kwargs)
        else:
            updates, opt_state = self.tx.update(grads, self.opt_state, self.params, value=value)
            params = optax.apply_updates(self.params, updates)
            new = self.replace(step=self.step + 1, params=params, opt_state=opt_state, **kwargs)
        kept = {k: keep_if_skipped(new.opt_state, v, getattr(self, k)) for k, v in kwargs.items()}
        if measured is not None:
            kept["sites"] = update_sites(self.sites, measured, step_applied(new.opt_state))
        return new.replace(**kept) if kept else new

    @property
    def variables(self) -> dict[str, Any]:
        """``{"params": params, "jdls": sites}`` (without ``"jdls"`` when there are no sites):
        what ``apply_fn`` takes and :meth:`value_and_grad` differentiates."""
        if self.sites is None:
            return {"params": self.params}
        return {"params": self.params, SITES: self.sites}

    @property
    def scale(self) -> LossScale:
        """The loss scale for the next step (``jdls.get_scale(self.opt_state)``)."""
        return get_scale(self.opt_state)

    @property
    def loss_scale(self) -> jax.Array:
        """The current loss scale, a float32 scalar."""
        return self.scale.loss_scale

    @property
    def stats(self) -> Stats:
        """Statistics of the last step (``jdls.stats(self.opt_state)``)."""
        return stats(self.opt_state)

    def value_and_grad(
        self,
        fun: Callable[..., Any],
        argnums: int | Sequence[int] = 0,
        has_aux: bool = False,
        *,
        axis_name: Any = None,
    ) -> Callable[..., Any]:
        """``jax.value_and_grad`` of ``fun`` with this state's loss scale applied.

        The loss is multiplied by the scale before differentiation; the returned loss is the
        unscaled one and the gradients are unscaled (16-bit gradients come back as float32).
        Pass the gradients to :meth:`apply_gradients` unchanged.

        Args:
          fun: the loss function; returns a scalar loss, or ``(loss, aux)`` with ``has_aux``.
          argnums: which positional arguments to differentiate, as in ``jax.value_and_grad``.
          has_aux: whether ``fun`` returns ``(loss, aux)``.
          axis_name: not accepted, as in :meth:`jdls.LossScale.value_and_grad` (a TypeError
            says where the axis goes).

        Returns:
          A function with the signature of ``fun`` returning ``(loss, grads)``, or
          ``((loss, aux), grads)`` with ``has_aux``.

        Example:
          >>> import jax.numpy as jnp, optax, jdls
          >>> state = jdls.linen.TrainState.create(apply_fn=None, params={"w": jnp.ones(2)},
          ...                                tx=jdls.wrap(optax.sgd(0.1)))
          >>> loss, grads = state.value_and_grad(lambda p: jnp.sum(p["w"] ** 2))(state.params)
          >>> float(loss), grads["w"].tolist()
          (2.0, [2.0, 2.0])
        """
        reject_axis_name(axis_name)
        if self.sites is None:
            return self.scale.value_and_grad(fun, argnums=argnums, has_aux=has_aux)
        if argnums != 0:
            raise ValueError(
                "a TrainState with sites differentiates fun(variables, ...) in its first "
                f"argument (state.variables); got argnums={argnums}"
            )
        return variables_value_and_grad(fun, self.scale, has_aux=has_aux)


def from_flax_train_state(
    old: Any,
    tx: Any,
    *,
    apply_fn: Any = None,
    flax_scale_options: dict[str, Any] | None = None,
) -> TrainState:
    """A :class:`TrainState` from a Flax-example ``TrainState`` with a ``dynamic_scale`` field.

    Flax's ImageNet example keeps a ``flax.training.dynamic_scale.DynamicScale`` beside a
    plain optax ``opt_state``. Its checkpoints do not fit a jdls state, whose ``opt_state`` is
    a :class:`jdls.WrapState` holding the scale (``flax.serialization`` refuses the mismatch,
    naming the keys). This converts one: the optimizer state becomes the wrap's inner state,
    the Flax scale (``scale``, ``fin_steps``) becomes :func:`jdls.presets.flax` with the same
    configuration, and ``step`` and ``params`` are kept.

    Args:
      old: the Flax ``TrainState`` object, or its state dict
        (``flax.serialization.to_state_dict(state)``, or ``msgpack_restore`` of its bytes).
      tx: ``jdls.wrap(inner)``, with ``inner`` the optimizer of the old state (its ``init``
        must give the old ``opt_state``'s structure); the wrap must be the whole optimizer.
      apply_fn: the model's apply function (default: the old object's; None for a dict).
      flax_scale_options: for a state dict, the configuration of the saved scale that the
        dict does not hold (``growth_factor``, ``backoff_factor``, ``growth_interval``,
        ``minimum_scale``; default Flax's defaults). Read from the object otherwise.

    Returns:
      A :class:`jdls.linen.TrainState` with the old step, parameters, optimizer state and scale.

    Raises:
      ValueError: ``tx`` is not a wrap at the root, or the old optimizer state does not match
        ``inner``'s structure (the message names the keys).

    Example:
      >>> import jax.numpy as jnp, optax, jdls
      >>> from typing import Any
      >>> from flax.training import train_state, dynamic_scale
      >>> class FlaxState(train_state.TrainState):
      ...     dynamic_scale: Any = None
      >>> tx = optax.sgd(0.1, momentum=0.9)
      >>> old = FlaxState.create(apply_fn=None, params={"w": jnp.ones(2)}, tx=tx,
      ...                        dynamic_scale=dynamic_scale.DynamicScale(scale=1024.0))
      >>> new = jdls.linen.from_train_state(old, jdls.wrap(tx))
      >>> float(new.loss_scale), new.scale.rule == jdls.presets.flax().rule
      (1024.0, True)
    """
    from jdls.presets import flax as flax_preset

    state_dict = old if isinstance(old, dict) else serialization.to_state_dict(old)
    expected = {"step", "params", "opt_state"}
    if not expected <= set(state_dict):
        raise ValueError(
            f"jdls.linen.from_train_state expects a Flax TrainState or its state dict, with keys "
            f"{sorted(expected)} (and dynamic_scale); got {sorted(state_dict)}"
        )
    params = state_dict["params"] if isinstance(old, dict) else old.params
    if apply_fn is None and not isinstance(old, dict):
        apply_fn = old.apply_fn
    new = TrainState.create(apply_fn=apply_fn, params=params, tx=tx)
    wrap_state = new.opt_state
    if not isinstance(wrap_state, WrapState):
        raise ValueError(
            "jdls.linen.from_train_state needs tx = jdls.wrap(inner) with inner the old optimizer, "
            f"got a transformation whose state is a {type(wrap_state).__name__}; wrap the whole "
            "old optimizer once"
        )
    try:
        inner_state = serialization.from_state_dict(
            wrap_state.inner_state, state_dict["opt_state"], "opt_state"
        )
    except ValueError as e:
        raise ValueError(
            f"the old optimizer state does not match jdls.wrap(inner)'s inner state: {e}. Pass "
            "jdls.wrap(old_optimizer) with the optimizer the checkpoint was trained with"
        ) from None
    scale = wrap_state.scale
    saved_scale = state_dict.get("dynamic_scale")
    if saved_scale is not None:
        if isinstance(old, dict):
            options = dict(flax_scale_options or {})
        else:
            flax_scale = old.dynamic_scale
            options = {
                k: getattr(flax_scale, k)
                for k in ("growth_factor", "backoff_factor", "growth_interval", "minimum_scale")
            }
            options.update(flax_scale_options or {})
        scale = flax_preset(
            scale=float(np.asarray(saved_scale["scale"])),
            fin_steps=int(np.asarray(saved_scale["fin_steps"])),
            **options,
        )
    step = (
        jnp.asarray(state_dict["step"])
        if not isinstance(state_dict["step"], int)
        else state_dict["step"]
    )
    return new.replace(
        step=step, opt_state=wrap_state._replace(scale=scale, inner_state=inner_state)
    )
