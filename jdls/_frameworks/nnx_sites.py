"""Sites in a Flax NNX model: probes and per-layer scales as ``SiteVariable``s of the modules.

:func:`probes_nnx` and :func:`layer_scales_nnx` give modules of an NNX model a
:class:`SiteVariable` attribute (``jdls_probe``, ``jdls_layer_scale``) holding a
:class:`jdls.Site`, and swap each such module's class for a subclass whose ``__call__`` passes
the output through the site(s) the instance holds. The sites are the model's state: they are
split, merged, stacked (``nnx.vmap``), scanned (``nnx.scan``), rematerialised (``nnx.remat``)
and jitted (``nnx.jit``) with it, and a module acts on its sites whenever it holds them: no
Python state is read while tracing. :class:`Optimizer` (``nnx.Optimizer`` that also updates
the sites, skip-aware) and :func:`nnx_layer_scaled_value_and_grad` complete a train step.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, cast

import jax
from flax import nnx

from jdls._scales.layer_scales import layer_site, scale_layers
from jdls._scales.scale import LossScale, check_scale
from jdls._sites.apply import apply_site
from jdls._sites.probe import Probe
from jdls._sites.site import Site
from jdls._sites.update import update_sites
from jdls._transforms.stats import step_applied

__all__ = [
    "Optimizer",
    "SiteVariable",
    "layer_scale_nnx",
    "layer_scales_nnx",
    "nnx_layer_scaled_value_and_grad",
    "probes_nnx",
]

PROBE = "jdls_probe"
LAYER_SCALE = "jdls_layer_scale"
_ORIGINAL = "_jdls_sites_of"


class SiteVariable(nnx.Variable):  # type: ignore[type-arg]
    """An NNX ``Variable`` holding a :class:`jdls.Site`: the model's state, not a parameter
    (``nnx.Optimizer(..., wrt=nnx.Param)`` leaves it alone; :class:`Optimizer` updates it).

    Example:
      >>> import jdls
      >>> v = jdls.nnx.SiteVariable(jdls.Site(jdls.Probe()))
      >>> v.get_value().value.shape
      (6,)
    """


def _has_call(cls: type) -> bool:
    return any("__call__" in vars(c) for c in cls.__mro__ if c is not object)


@functools.cache
def _with_sites(cls: type) -> type:
    original = cls.__call__

    @functools.wraps(original)  # the signature NNX inspects (``rngs``) stays the original's
    def __call__(self: Any, *args: Any, **kwargs: Any) -> Any:
        out = original(self, *args, **kwargs)
        for name in (PROBE, LAYER_SCALE):  # the probe sees the layer's own scale
            variable = vars(self).get(name)
            if isinstance(variable, SiteVariable):
                out = apply_site(out, variable.get_value())
        return out

    namespace = {"__call__": __call__, "__module__": cls.__module__, _ORIGINAL: cls}
    return type(cls.__name__, (cls,), namespace)


def _attach(module: Any, name: str, site: Site) -> None:
    cls: Any = type(module)
    if _ORIGINAL not in vars(cls):
        object.__setattr__(module, "__class__", _with_sites(cls))
    setattr(module, name, SiteVariable(site))


def probes_nnx(model: Any, compute_dtype: Any = "float16") -> Any:
    """Give every module of the NNX ``model`` (the model included) that has a ``__call__`` a
    :class:`jdls.Probe` on its output, in place; returns ``model``.

    The probes are :class:`SiteVariable` attributes ``jdls_probe`` (a module probed already
    keeps its probe); their gradients
    (``jdls.nnx.value_and_grad``) are what they measured (:meth:`jdls.Telemetry.of`). For a
    stack made by ``nnx.vmap``, call it inside the vmapped constructor: the probes are then
    stacked with the layers, one per layer.

    Example:
      >>> import jax.numpy as jnp, jdls
      >>> from flax import nnx
      >>> model = jdls.nnx.probes(nnx.Sequential(nnx.Linear(3, 4, rngs=nnx.Rngs(0)),
      ...                                        nnx.Linear(4, 1, rngs=nnx.Rngs(1))))
      >>> loss = lambda m, x: jnp.sum(m(x))
      >>> _, grads = jdls.nnx.value_and_grad(loss, jdls.StaticScale(8.0))(model, jnp.ones((2, 3)))
      >>> jdls.Telemetry.of(grads).names  # the model, then its layers
      ('', 'layers/0', 'layers/1')
    """
    kind = Probe(compute_dtype)
    for _, module in list(nnx.iter_modules(model)):
        if PROBE in vars(module):  # probed already (a stack probed in its constructor)
            continue
        if _has_call(type(module)) and not isinstance(module, nnx.List | nnx.Dict):
            _attach(module, PROBE, Site(kind))
    return model


def _layers(model: Any) -> list[Any]:
    """The direct children of ``model`` holding parameters, in the order they were assigned
    (``vars`` order; list and dict entries in order): the forward order of a chain."""
    found: list[Any] = []

    def visit(value: Any) -> None:
        if isinstance(value, nnx.List | list | tuple):
            for v in value:
                visit(v)
        elif isinstance(value, nnx.Dict | dict):
            for v in value.values():
                visit(v)
        elif isinstance(value, nnx.Module) and len(nnx.state(value, nnx.Param)):
            found.append(value)

    for name, value in vars(model).items():
        if not name.startswith("_"):
            visit(value)
    return found


def layer_scales_nnx(model: Any, scale: LossScale) -> Any:
    """Give every direct child module of the NNX ``model`` that holds parameters a per-layer
    scale (:func:`jdls.layer_site`, ``scale`` each) on its output, in place; returns ``model``.

    The layers' forward order is the order their attributes were assigned (``nnx.Sequential``:
    its list order); they must form a chain. A child made by ``nnx.vmap`` (a stack) gets one
    site for the whole stack; for a site per layer, call :func:`jdls.nnx.layer_scale` on
    each block inside the vmapped constructor (with the stack's position in the chain).
    Differentiate with
    :func:`jdls.nnx.layer_scaled_value_and_grad`.

    Example:
      >>> import jdls
      >>> from flax import nnx
      >>> model = nnx.Sequential(nnx.Linear(3, 4, rngs=nnx.Rngs(0)), nnx.tanh,
      ...                        nnx.Linear(4, 1, rngs=nnx.Rngs(1)))
      >>> model = jdls.nnx.layer_scales(model, jdls.AdaptiveScale(2.0**10))
      >>> model.layers[0].jdls_layer_scale.get_value().kind
      LayerScale(position=0)
    """
    check_scale(scale, "scale")
    for position, layer in enumerate(_layers(model)):
        _attach(layer, LAYER_SCALE, layer_site(scale, position))
    return model


def layer_scale_nnx(module: Any, scale: LossScale, position: int) -> Any:
    """Give ``module`` (one layer, e.g. a block inside the constructor that ``nnx.vmap``
    stacks) a per-layer scale at ``position`` in the forward order; returns ``module``.

    Example:
      >>> import jdls
      >>> from flax import nnx
      >>> block = jdls.nnx.layer_scale(nnx.Linear(2, 2, rngs=nnx.Rngs(0)), jdls.NoOpScale(), 3)
      >>> block.jdls_layer_scale.get_value().kind.position
      3
    """
    check_scale(scale, "scale")
    _attach(module, LAYER_SCALE, layer_site(scale, position))
    return module


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

    def update(self, model: Any, grads: Any, /, **kwargs: Any) -> Any:
        updates = super().update(model, grads, **kwargs)
        measured = nnx.state(grads, SiteVariable)
        if len(measured):
            sites = nnx.state(model, SiteVariable)
            finite = step_applied(self.opt_state)  # reads the Variables' values
            nnx.update(model, update_sites(sites, measured, finite))
        return updates


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
        grads = nnx.merge_state(grads_params, grads_sites)
        return ((loss, aux) if has_aux else loss), grads

    return value_and_grad_fn
