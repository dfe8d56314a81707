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

import dataclasses
import functools
from collections.abc import Callable, Iterator
from typing import Any, cast

import jax
from flax import nnx

from jdls._scales.layer_scales import (
    LayerScale,
    applied_in_order,
    layer_site,
    note_applied,
    scale_layers,
)
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
                site = variable.get_value()
                note_applied(site)  # checked by jdls.nnx.layer_scaled_value_and_grad
                out = apply_site(out, site)
        return out

    namespace = {"__call__": __call__, "__module__": cls.__module__, _ORIGINAL: cls}
    return type(cls.__name__, (cls,), namespace)


def _attach(module: Any, name: str, site: Site) -> None:
    cls: Any = type(module)
    if _ORIGINAL not in vars(cls):
        object.__setattr__(module, "__class__", _with_sites(cls))
    setattr(module, name, SiteVariable(site))


def _children(value: Any, path: tuple[Any, ...]) -> Iterator[tuple[tuple[Any, ...], Any]]:
    """The nodes under an attribute ``value`` at ``path``: a module, or the entries of a
    list or dict (in order)."""
    if isinstance(value, nnx.Module):
        yield path, value
    elif isinstance(value, list | tuple):
        for i, v in enumerate(value):
            yield from _children(v, (*path, i))
    elif isinstance(value, dict):
        for k, v in value.items():
            yield from _children(v, (*path, k))


def _attributes(node: Any) -> Iterator[tuple[Any, Any]]:
    """A module's attributes in the order they were assigned (an ``nnx.List``'s entries in
    list order, an ``nnx.Dict``'s in insertion order)."""
    if isinstance(node, nnx.List):
        yield from enumerate(node)
    elif isinstance(node, nnx.Dict):
        yield from node.items()
    else:
        for name, value in vars(node).items():
            if not name.startswith("_pytree__"):
                yield name, value


def modules_in_order(model: Any, who: str) -> list[tuple[tuple[Any, ...], Any]]:
    """Every module of ``model`` once, as ``(path, module)``: each module after its
    submodules (the order in which they return), siblings in the order their attributes
    were assigned. Refuses a site other than a probe reachable under two paths (one
    ``jdls.fp8.nnx.DotGeneral`` passed to several layers): JAX sums its uses' measurements,
    so it would never measure one use."""
    found: list[tuple[tuple[Any, ...], Any]] = []
    placed: set[int] = set()
    sites: dict[int, tuple[Any, ...]] = {}

    def visit(node: Any, path: tuple[Any, ...], stack: tuple[int, ...]) -> None:
        for name, value in _attributes(node):
            if isinstance(value, SiteVariable):
                _once(value, (*path, name), sites, who)
                continue
            for child_path, child in _children(value, (*path, name)):
                if id(child) not in stack:  # a cycle back to an enclosing module
                    visit(child, child_path, (*stack, id(child)))
        if id(node) not in placed:
            placed.add(id(node))
            found.append((path, node))

    visit(model, (), (id(model),))
    return found


def _once(variable: SiteVariable, path: tuple[Any, ...], sites: dict[int, Any], who: str) -> None:
    first = sites.setdefault(id(variable), path)
    if first == path or isinstance(variable.get_value().kind, Probe):
        return  # a shared module's probe counts its uses (Telemetry: uses, NaN amax)
    at = "/".join(map(str, first)), "/".join(map(str, path))
    raise ValueError(
        f"{who}: one site is at {at[0]} and at {at[1]}: a module holding a site (a "
        "jdls.fp8.nnx.DotGeneral, a per-layer scale) is shared by several layers, so JAX "
        "sums their measurements and the site never records one (its FP8 scales never "
        "move). Make one per layer: nnx.Linear(..., dot_general=jdls.fp8.nnx.DotGeneral("
        "recipe)) in each layer, not one DotGeneral passed to all."
    )


def probes_nnx(model: Any, compute_dtype: Any = "float16") -> Any:
    """Give every module of the NNX ``model`` (the model included) that has a ``__call__`` a
    :class:`jdls.Probe` on its output, in place; returns ``model``.

    The probes are :class:`SiteVariable` attributes ``jdls_probe`` (a module probed already
    keeps its probe); their gradients
    (``jdls.nnx.value_and_grad``) are what they measured (:meth:`jdls.Telemetry.of`). For a
    stack made by ``nnx.vmap``, call it inside the vmapped constructor: the probes are then
    stacked with the layers, one per layer.

    Each probe's ``position`` (the forward order of :meth:`jdls.Telemetry.of`'s rows) is
    set here, from the order the modules' attributes were assigned: each module after its
    submodules, siblings in assignment order (``nnx.Sequential``: its list order). Call it
    where the model is built, before ``nnx.split`` / ``nnx.merge``, ``nnx.jit`` or a
    checkpoint's restore rebuild the modules with their attributes sorted by name; the
    positions then travel with the sites. The model's own probe is named after its class.

    Raises:
      ValueError: a site other than a probe is reachable under two paths (one
        ``jdls.fp8.nnx.DotGeneral`` passed to several layers).

    Example:
      >>> import jax.numpy as jnp, jdls
      >>> from flax import nnx
      >>> model = jdls.nnx.probes(nnx.Sequential(nnx.Linear(3, 4, rngs=nnx.Rngs(0)),
      ...                                        nnx.Linear(4, 1, rngs=nnx.Rngs(1))))
      >>> loss = lambda m, x: jnp.sum(m(x))
      >>> _, grads = jdls.nnx.value_and_grad(loss, jdls.StaticScale(8.0))(model, jnp.ones((2, 3)))
      >>> jdls.Telemetry.of(grads).names  # forward order: the layers, then the model
      ('layers/0', 'layers/1', 'Sequential')
    """
    modules = modules_in_order(model, "jdls.nnx.probes")
    position = 0
    for path, module in modules:
        name = None if path else type(module).__name__
        held = vars(module).get(PROBE)
        if isinstance(held, SiteVariable):  # probed already (a stack probed in its constructor)
            site = held.get_value()
            kind = dataclasses.replace(site.kind, position=position, name=name)
            held.set_value(Site(kind, site.value))
        elif _has_call(type(module)) and not isinstance(module, nnx.List | nnx.Dict):
            _attach(module, PROBE, Site(Probe(compute_dtype, position, name)))
        else:
            continue
        position += 1
    return model


def _layers(model: Any) -> list[Any]:
    """The direct children of ``model`` holding parameters, in the order they were assigned
    (``vars`` order; list and dict entries in order): the forward order of a chain. One
    module at two places of the chain is refused (it would hold one site for both)."""
    found: dict[int, tuple[Any, ...]] = {}
    layers: list[Any] = []

    def visit(value: Any, path: tuple[Any, ...]) -> None:
        if isinstance(value, nnx.List | list | tuple):
            for i, v in enumerate(value):
                visit(v, (*path, i))
        elif isinstance(value, nnx.Dict | dict):
            for k, v in value.items():
                visit(v, (*path, k))
        elif isinstance(value, nnx.Module) and len(nnx.state(value, nnx.Param)):
            if id(value) in found:
                raise ValueError(
                    f"jdls.nnx.layer_scales: the layer at {'/'.join(map(str, path))} is the "
                    f"one at {'/'.join(map(str, found[id(value)]))}: one module at two places "
                    "of the chain would hold one per-layer site for both. Give each place its "
                    "own module, or set the scales by hand (jdls.nnx.layer_scale)"
                )
            found[id(value)] = path
            layers.append(value)

    for name, value in vars(model).items():
        if not name.startswith("_"):
            visit(value, (name,))
    return layers


def layer_scales_nnx(model: Any, scale: LossScale) -> Any:
    """Give every direct child module of the NNX ``model`` that holds parameters a per-layer
    scale (:func:`jdls.layer_site`, ``scale`` each) on its output, in place; returns ``model``.

    The layers' forward order is the order their attributes were assigned (``nnx.Sequential``:
    its list order); they must form a chain. Each site's kind holds its layer's position
    (:class:`jdls.LayerScale`), so the order travels with the sites through ``nnx.split`` /
    ``nnx.merge``, ``nnx.jit``, ``nnx.grad`` and a checkpoint's restore, which rebuild the
    modules with their attributes sorted by name: call this where the model is built (in
    the function that ``nnx.eval_shape`` or a sharded ``nnx.jit`` init runs), not on a
    model rebuilt since. Called again on layers that hold per-layer sites, it keeps their
    positions. :func:`jdls.nnx.layer_scaled_value_and_grad` refuses layers that apply
    their sites out of the positions' order. A child made by ``nnx.vmap`` (a stack) gets one
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
    modules_in_order(model, "jdls.nnx.layer_scales")  # refuses a shared site
    layers = _layers(model)
    held = [_position(layer) for layer in layers]
    placed = all(p is not None for p in held)  # called again: the positions stay
    for k, (layer, position) in enumerate(zip(layers, held, strict=True)):
        _attach(
            layer,
            LAYER_SCALE,
            layer_site(scale, position if position is not None and placed else k),
        )
    return model


def _position(layer: Any) -> int | None:
    """The position of the per-layer site ``layer`` holds, or None."""
    variable = vars(layer).get(LAYER_SCALE)
    if isinstance(variable, SiteVariable) and isinstance(variable.get_value().kind, LayerScale):
        return int(variable.get_value().kind.position)
    return None


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
        updates = super().update(model, grads, **kwargs)
        measured = nnx.state(grads, SiteVariable)
        if len(measured):
            sites = nnx.state(model, SiteVariable)
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
        grads = nnx.merge_state(grads_params, grads_sites)
        return ((loss, aux) if has_aux else loss), grads

    return value_and_grad_fn
