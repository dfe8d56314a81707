"""The NNX train step with sites: the sites' measurements in the gradients, and the
optimizer that updates the sites from them.

A model's sites are :class:`SiteVariable`s (``nnx_sites``); in the gradients that
``jdls.nnx.value_and_grad`` and :func:`nnx_layer_scaled_value_and_grad` return, their
measurements are :class:`SiteMeasurement`s, a ``SiteVariable`` that is also an
``nnx.Param``: :class:`Optimizer` takes them apart and updates the sites, and a plain
``nnx.Optimizer(..., wrt=nnx.Param)``, which would drop them without a word, hands them to
``tx`` with the parameters, where ``jdls.wrap`` refuses them, naming ``jdls.nnx.Optimizer``
(and a plain optax transformation fails on the extra leaves).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import jax
from flax import nnx

from jdls._frameworks.nnx_model import SiteVariable, modules_in_order
from jdls._scales.layer_scales import scale_layers
from jdls._scales.layer_site import applied_in_order
from jdls._sites.update import update_sites
from jdls._transforms.stats import step_applied

__all__ = ["Optimizer", "SiteMeasurement", "measurements", "nnx_layer_scaled_value_and_grad"]


class SiteMeasurement(SiteVariable, nnx.Param):  # type: ignore[misc]
    """A site's measurement in the gradients of an NNX model: a :class:`SiteVariable` (the
    site's own type, so ``nnx.state(grads, jdls.nnx.SiteVariable)`` finds it) that is also an
    ``nnx.Param``, so that an optimizer that filters the gradients by ``nnx.Param`` never
    drops it silently. :class:`Optimizer` updates the sites from these.

    Example:
      >>> import jax.numpy as jnp, jdls
      >>> from flax import nnx
      >>> model = jdls.nnx.probes(nnx.Linear(2, 1, rngs=nnx.Rngs(0)))
      >>> loss = lambda m: jnp.mean(m(jnp.ones((4, 2))) ** 2)
      >>> _, grads = jdls.nnx.value_and_grad(loss, jdls.StaticScale(1.0))(model)
      >>> type(grads["jdls_probe"]).__name__
      'SiteMeasurement'
    """


def measurements(grads: Any, back: bool = False) -> Any:
    """``grads`` (an ``nnx.State``, or a tuple of them) with each :class:`SiteVariable` a
    :class:`SiteMeasurement` holding the same value; with ``back``, each a plain
    ``SiteVariable`` again (shaped as the model's sites)."""

    def retag(v: Any) -> Any:
        if not isinstance(v, SiteVariable):
            return v
        if back:
            return SiteVariable(v.get_value()) if isinstance(v, SiteMeasurement) else v
        return v if isinstance(v, SiteMeasurement) else SiteMeasurement(v.get_value())

    return jax.tree_util.tree_map(retag, grads, is_leaf=lambda x: isinstance(x, nnx.Variable))


class Optimizer(nnx.Optimizer):  # type: ignore[type-arg]
    """``nnx.Optimizer`` that also updates the model's sites: ``update(model, grads)`` gives
    the parameters' gradients to ``tx`` (built with :func:`jdls.wrap`) and updates every
    :class:`SiteVariable` from its measurement in ``grads``, knowing whether the step was
    taken. Sites never reach ``tx``.

    Example:
      >>> import jax.numpy as jnp, optax, jdls
      >>> from flax import nnx
      >>> model = jdls.nnx.probes(nnx.Linear(2, 1, rngs=nnx.Rngs(0)))
      >>> optimizer = jdls.nnx.Optimizer(model, jdls.wrap(optax.sgd(0.1)), wrt=nnx.Param)
      >>> loss = lambda m: jnp.mean(m(jnp.ones((4, 2))) ** 2)
      >>> _, grads = jdls.nnx.value_and_grad(loss, jdls.get_scale(optimizer))(model)
      >>> _ = optimizer.update(model, grads)
      >>> float(jdls.Telemetry.of(nnx.state(model, jdls.nnx.SiteVariable)).uses[0])
      1.0
    """

    def __init__(self, model: Any, *args: Any, **kwargs: Any) -> None:
        modules_in_order(model, "jdls.nnx.Optimizer")  # refuses a shared site
        wrt = kwargs.get("wrt", args[1] if len(args) > 1 else None)
        if wrt is not None:
            chosen = nnx.filterlib.to_predicate(wrt)
            for path, variable in nnx.to_flat_state(nnx.state(model, SiteVariable)):
                if chosen(path, variable):
                    raise ValueError(
                        f"jdls.nnx.Optimizer: wrt={wrt!r} selects the model's sites (at "
                        f"{'/'.join(map(str, path))}), which are not parameters: the optimizer "
                        "would step them as weights. Select the parameters, wrt=nnx.Param"
                    )
        super().__init__(model, *args, **kwargs)

    def update(self, model: Any, grads: Any, /, **kwargs: Any) -> Any:
        measured = measurements(nnx.state(grads, SiteVariable), back=True)
        sites = nnx.state(model, SiteVariable)
        if len(sites) and not len(measured):
            raise ValueError(
                "jdls.nnx.Optimizer: the model holds sites (probes, per-layer scales, FP8 "
                "state) but the gradients hold none of their measurements, so the sites would "
                "never move: pass the whole gradients of jdls.nnx.value_and_grad (not "
                "nnx.state(grads, nnx.Not(jdls.nnx.SiteVariable)), which is for logging), or "
                "differentiate the sites too (nnx.grad(..., argnums=nnx.DiffState(0, "
                "nnx.Any(nnx.Param, jdls.nnx.SiteVariable))))"
            )
        updates = super().update(model, nnx.state(grads, nnx.Not(SiteVariable)), **kwargs)
        if len(measured):
            finite = step_applied(self.opt_state)  # reads the Variables' values
            nnx.update(model, update_sites(sites, measured, finite))
        return updates


#: How to number NNX layers in forward order, in the error of :func:`applied_in_order`.
_FIX_ORDER = (
    "jdls.nnx.layer_scales numbers the layers in the order their attributes were assigned, "
    "which nnx.split / nnx.merge, nnx.jit and a restore rebuild sorted by name: call it where "
    "the model is built (before any of those), or number the layers with "
    "jdls.nnx.layer_scale(module, scale, position)"
)


def nnx_layer_scaled_value_and_grad(
    loss_fn: Callable[..., Any], has_aux: bool = False
) -> Callable[..., tuple[Any, Any]]:
    """Per-layer scales for an NNX model with per-layer sites (:func:`jdls.nnx.layer_scales`,
    :func:`jdls.nnx.layer_scale`): ``loss_fn(model, *args)`` differentiated with the loss
    scaled by the last layer's scale, each layer's parameters (those of the module holding
    the site) unscaled by its own scale.

    Returns:
      A function ``(model, *args) -> (value, grads)``: ``grads`` an ``nnx.State`` of the
      parameters' gradients and the sites' measurements, for :class:`Optimizer`.

    Example:
      >>> import jax.numpy as jnp, optax, jdls
      >>> from flax import nnx
      >>> model = nnx.Sequential(nnx.Linear(3, 4, rngs=nnx.Rngs(0)), nnx.tanh,
      ...                        nnx.Linear(4, 1, rngs=nnx.Rngs(1)))
      >>> model = jdls.nnx.layer_scales(model, jdls.StaticScale(2.0**12))
      >>> loss_fn = lambda m, x: jnp.mean(m(x) ** 2)
      >>> value, grads = jdls.nnx.layer_scaled_value_and_grad(loss_fn)(model, jnp.ones((2, 3)))
      >>> grads["layers"][0]["kernel"].shape
      (3, 4)
    """

    def value_and_grad_fn(model: Any, *args: Any, **kwargs: Any) -> Any:
        graphdef, params, sites, rest = cast(Any, nnx.split(model, nnx.Param, SiteVariable, ...))
        p, s = nnx.to_pure_dict(params), nnx.to_pure_dict(sites)

        def fun(p: Any, s: Any, *a: Any, **kw: Any) -> Any:
            # fresh Variables (a tree_map rebuilds them): the traced values never reach the
            # model's own Variables
            params_now, sites_now = jax.tree_util.tree_map(lambda v: v, (params, sites))
            nnx.replace_by_pure_dict(params_now, p)
            nnx.replace_by_pure_dict(sites_now, s)
            copy = nnx.merge(graphdef, params_now, sites_now, rest, copy=True)
            with applied_in_order("jdls.nnx.layer_scaled_value_and_grad", _FIX_ORDER):
                out = loss_fn(copy, *a, **kw)
            loss, aux = out if has_aux else (out, None)
            return loss, (aux, nnx.state(copy, nnx.Not(nnx.Any(nnx.Param, SiteVariable))))

        (loss, (aux, new_rest)), (g_params, g_sites) = scale_layers(
            fun,
            (p, s, *args),
            kwargs,
            (0, 1),
            layer_of=lambda path: (0, *path[1:-1]),  # the module holding the site
            param_path=lambda path: path,
            has_aux=True,
            who="jdls.nnx.layer_scaled_value_and_grad",
        )
        if len(new_rest):
            nnx.update(model, new_rest)
        grads_params, grads_sites = jax.tree_util.tree_map(lambda v: v, (params, sites))
        nnx.replace_by_pure_dict(grads_params, g_params)
        nnx.replace_by_pure_dict(grads_sites, g_sites)
        grads = nnx.merge_state(grads_params, measurements(grads_sites))
        return ((loss, aux) if has_aux else loss), grads

    return value_and_grad_fn
