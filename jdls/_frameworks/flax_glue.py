"""Flax integration: a linen ``TrainState`` with the loss scale at hand, and NNX helpers.

``jdls.wrap`` is an optax transformation, so it already works unchanged in Flax:

* linen: ``flax.training.train_state.TrainState.create(..., tx=jdls.wrap(optax.adam(...)))``;
  ``apply_gradients`` checks the gradients, skips the update on inf/NaN and adjusts the scale.
  :class:`TrainState` adds only reading the scale and a ``value_and_grad`` that uses it.
* NNX: ``nnx.Optimizer(model, jdls.wrap(optax.adam(...)), wrt=nnx.Param)``, with
  :func:`jdls.nnx.value_and_grad` (the scaled ``nnx.value_and_grad``) and :func:`jdls.nnx.set_scale`
  (replace the scale, its rule included).

It is also the one module that imports flax: it registers the loss scales with
``flax.serialization`` so that ``to_bytes``/``from_bytes`` of any state holding one work.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import serialization
from flax.training import train_state

from jdls._frameworks.linen_sites import SITES
from jdls._scales.grad import reject_axis_name, scaled_value_and_grad
from jdls._scales.layer_scales import LayerScale, scale_layers
from jdls._scales.scale import DynamicScale, LossScale, NoOpScale, StaticScale, check_scale
from jdls._sites.site import Site, is_site, update_sites
from jdls._transforms.stats import (
    Stats,
    WrapState,
    get_scale,
    keep_if_skipped,
    replace_scale,
    snapshot,
    stats,
    step_applied,
)

__all__ = ["TrainState", "from_flax_train_state", "nnx_value_and_grad", "set_nnx_scale"]


def _same_structure(a: Any, b: Any) -> bool:
    """Whether two pytrees have one structure."""
    same: bool = jax.tree.structure(a) == jax.tree.structure(b)  # type: ignore[operator]
    return same


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

    def apply_gradients(self, *, grads: Any, **kwargs: Any) -> TrainState:
        """Flax's ``apply_gradients``; other fields given (e.g. ``batch_stats``) keep their old
        values on a skipped step, as the parameters and the optimizer state do.

        With :attr:`sites`, ``grads`` is shaped like :attr:`variables` (what
        :meth:`value_and_grad` returns): ``grads["params"]`` go to the optimizer, and every
        site is updated by its kind from its measurement ``grads["jdls"]``, knowing whether
        the step was taken (never given to the optimizer, never clipped or decayed).
        Without sites, ``grads`` is either the parameters' gradients or shaped like
        :attr:`variables`, ``{"params": ...}``.

        ``step`` still counts every call, as in Flax.
        """
        measured = None
        if self.sites is not None:
            if not isinstance(grads, Mapping) or set(grads) != {"params", SITES}:
                raise ValueError(
                    "this TrainState holds sites (its 'jdls' collection): pass the gradients "
                    "of state.variables, {'params': ..., 'jdls': ...}, as "
                    "state.value_and_grad(loss_fn)(state.variables) returns them"
                )
            grads, measured = grads["params"], grads[SITES]
        elif (
            isinstance(grads, Mapping)
            and set(grads) == {"params"}
            and _same_structure(grads["params"], self.params)
        ):
            grads = grads["params"]  # the gradients of state.variables, {"params": ...}
        new = super().apply_gradients(grads=grads, **kwargs)
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
        layered = any(
            isinstance(site, Site) and isinstance(site.kind, LayerScale)
            for site in jax.tree_util.tree_leaves(self.sites, is_leaf=is_site)
        )
        if not layered:
            return self.scale.value_and_grad(fun, has_aux=has_aux)

        def value_and_grad_fn(*args: Any, **kwargs: Any) -> Any:
            # per-layer scales: the site at ("jdls", *path, "layer_scale") scales the
            # parameters under ("params", *path)
            value, (grads,) = scale_layers(
                fun,
                args,
                kwargs,
                (0,),
                layer_of=lambda path: ("params", *path[2:-1]),
                param_path=lambda path: path[1:],
                has_aux=has_aux,
                who="jdls.linen.TrainState.value_and_grad",
            )
            return value, grads

        return value_and_grad_fn


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


# --------------------------------------------------------------------------------------------
# NNX.
# --------------------------------------------------------------------------------------------


def nnx_value_and_grad(
    fun: Callable[..., Any],
    scale: LossScale,
    argnums: int | Sequence[int] = 0,
    *,
    has_aux: bool = False,
    wrt: Any = None,
) -> Callable[..., Any]:
    """``nnx.value_and_grad`` of ``fun`` with the loss scaled and the gradients unscaled.

    The NNX counterpart of :meth:`jdls.LossScale.value_and_grad`: it differentiates NNX
    modules with ``nnx.value_and_grad`` (only the variables selected by ``wrt``, so modules
    holding RNG streams or batch statistics work, and their updates propagate), multiplies
    the loss by ``scale`` before differentiation, and divides the gradients by it after
    (16-bit gradients come back as float32). Pass the gradients to ``optimizer.update``.

    Args:
      fun: the loss function; returns a scalar loss, or ``(loss, aux)`` with ``has_aux``.
      scale: the loss scale, usually ``jdls.get_scale(optimizer)``.
      argnums: which positional arguments to differentiate, as in ``nnx.value_and_grad``.
      has_aux: whether ``fun`` returns ``(loss, aux)``.
      wrt: the NNX filter of the variables to differentiate (default ``nnx.Param``); it
        should match the ``wrt`` of the ``nnx.Optimizer``.

    Returns:
      A function with the signature of ``fun`` returning ``(loss, grads)``, or
      ``((loss, aux), grads)`` with ``has_aux``; ``loss`` is the unscaled loss.

    Example:
      >>> import jax.numpy as jnp, optax, jdls
      >>> from flax import nnx
      >>> model = nnx.Linear(2, 1, rngs=nnx.Rngs(0))
      >>> optimizer = nnx.Optimizer(model, jdls.wrap(optax.sgd(0.1)), wrt=nnx.Param)
      >>> loss_fn = lambda m: jnp.mean(m(jnp.ones((4, 2)).astype(jnp.float16)) ** 2)
      >>> scale = jdls.get_scale(optimizer)
      >>> loss, grads = jdls.nnx.value_and_grad(loss_fn, scale)(model)
      >>> _ = optimizer.update(model, grads)
      >>> grads["kernel"].dtype, int(jdls.stats(optimizer).skipped_steps)
      (dtype('float32'), 0)
    """
    from flax import nnx

    scale = snapshot(check_scale(scale))

    argnums_spec: Any = argnums if isinstance(argnums, int) else tuple(argnums)
    from jdls._frameworks.nnx_sites import SiteVariable

    if wrt is None:
        wrt = nnx.Param
    wrt = nnx.Any(wrt, SiteVariable)  # the sites' gradients: their measurements
    if isinstance(argnums_spec, int):
        argnums_spec = nnx.DiffState(argnums_spec, wrt)
    else:
        argnums_spec = tuple(nnx.DiffState(i, wrt) for i in argnums_spec)
    return scaled_value_and_grad(
        scale,
        fun,
        has_aux,
        lambda scaled: nnx.value_and_grad(scaled, argnums=argnums_spec, has_aux=True),
    )


def set_nnx_scale(optimizer: Any, scale: LossScale) -> None:
    """Replace, in place, the loss scale of an ``nnx.Optimizer`` built with :func:`jdls.wrap`.

    The NNX counterpart of :func:`jdls.set_scale`. Use this rather than
    ``nnx.update``: ``nnx.update`` copies array values only, so it would keep the old scale's
    rule (its growth interval, factors and bounds) and silently mix it with the new values.
    Call it outside ``nnx.jit``, between steps (e.g. after restoring a checkpoint).

    Args:
      optimizer: an ``nnx.Optimizer`` whose ``tx`` holds exactly one ``jdls.wrap``.
      scale: the new loss scale (any :class:`jdls.LossScale`, any rule).

    Returns:
      None; ``optimizer.opt_state`` holds the new scale.

    Example:
      >>> import optax, jdls
      >>> from flax import nnx
      >>> model = nnx.Linear(2, 1, rngs=nnx.Rngs(0))
      >>> optimizer = nnx.Optimizer(model, jdls.wrap(optax.sgd(0.1)), wrt=nnx.Param)
      >>> jdls.nnx.set_scale(optimizer, jdls.presets.pytorch(init_scale=8.0))
      >>> scale = jdls.get_scale(optimizer)
      >>> float(scale.loss_scale), scale.rule.min_loss_scale
      (8.0, None)
    """
    scale = check_scale(scale)
    if not hasattr(optimizer, "opt_state"):
        raise TypeError(
            f"optimizer must be an nnx.Optimizer, got {type(optimizer).__name__}; for an optax "
            "state or a linen TrainState use jdls.set_scale"
        )
    from flax import nnx
    from flax.nnx.training.optimizer import to_opt_state

    get_scale(optimizer.opt_state)  # exactly one wrap, or a clear error
    new_scale = to_opt_state(scale)  # its arrays as Variables, as nnx.Optimizer stores them
    is_variable = lambda x: isinstance(x, nnx.Variable)  # noqa: E731
    optimizer.opt_state = replace_scale(optimizer.opt_state, new_scale, is_leaf=is_variable)


# --------------------------------------------------------------------------------------------
# flax.serialization of the loss scales (data only; the rule comes from the target).
# --------------------------------------------------------------------------------------------


def _restore(target: Any, state: dict[str, Any], fields: tuple[str, ...]) -> dict[str, Any]:
    if set(state) != set(fields):
        raise ValueError(
            f"cannot restore a {type(target).__name__} from the saved fields {sorted(state)} (a "
            f"{type(target).__name__} has {sorted(fields)}): build the target with the same "
            "kind of scale as the one that was saved"
        )
    return {f: serialization.from_state_dict(getattr(target, f), state[f], f) for f in fields}


def _register_serialization(cls: type, fields: tuple[str, ...]) -> None:
    def to_state(scale: Any) -> dict[str, Any]:
        return {f: serialization.to_state_dict(getattr(scale, f)) for f in fields}

    def from_state(target: Any, state: dict[str, Any]) -> Any:
        leaves = _restore(target, state, fields)
        return jax.tree_util.tree_unflatten(
            jax.tree_util.tree_structure(target),
            jax.tree_util.tree_leaves([leaves[f] for f in fields]),
        )

    serialization.register_serialization_state(cls, to_state, from_state)


_register_serialization(DynamicScale, ("loss_scale", "state"))
_register_serialization(StaticScale, ("loss_scale",))
_register_serialization(NoOpScale, ())


def _site_to_state(site: Site) -> dict[str, Any]:
    return {"value": serialization.to_state_dict(site.value)}


def _site_from_state(target: Site, state: dict[str, Any]) -> Site:
    # the kind (configuration) comes from the target, as a scale's rule does
    return Site(target.kind, serialization.from_state_dict(target.value, state["value"], "value"))


serialization.register_serialization_state(Site, _site_to_state, _site_from_state)
