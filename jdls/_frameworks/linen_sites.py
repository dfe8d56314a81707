"""Sites in a Flax linen model without model edits: a probe after every module, a per-layer
scale after every top-level layer.

:func:`probes_linen` and :func:`layer_scales_linen` return the model wrapped in a module that
shares its scope (the parameters keep their paths) and, inside its own ``__call__``, passes
module outputs through sites (``flax.linen.intercept_methods``). The sites' values are
variables of the collection ``"jdls"`` (:data:`SITES`) at each module's path, made by
``model.init`` like the parameters: under ``nn.scan`` with ``variable_axes={"params": 0,
"jdls": 0}`` one site per layer, stacked like the layer's parameters. The interception is part
of the wrapper's traced code, so every trace of the wrapped model (a jitted ``apply`` traced
before, ``nn.remat``, ``nn.scan``, ``nn.jit``) has the sites; nothing is read from Python
state outside it.

A site that is neither in the variables nor makeable (the collection not mutable where the
module runs) raises :class:`MissingSitesError` (:func:`require_site`), which names the
omission: ``"jdls"`` missing from an ``nn.scan``'s ``variable_axes``, from the ``mutable`` of
an ``apply`` used as ``init``, or from the variables an evaluation applies the model with.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Mapping
from typing import Any

import flax.linen as nn
from flax.core import Scope, freeze

from jdls._frameworks.linen_scope import LAYER_SCALE, PROBE, SITES, Outer, require_site
from jdls._numerics.checks import holds_floats
from jdls._scales.layer_site import LayerScale, layer_site
from jdls._scales.scale import LossScale, check_scale
from jdls._sites.apply import apply_site
from jdls._sites.probe import Probe
from jdls._sites.site import Site, fresh_site

__all__ = ["forward_order", "layer_scales_linen", "probes_linen"]


class _Sites(nn.Module):
    """``model`` with its module outputs passed through sites (see the module docstring)."""

    jdls_wrapped: nn.Module
    make: Callable[[tuple[str, ...]], list[tuple[str, Site]]]  # module path -> its sites
    # the per-layer scale at forward position k (the found site gives the stack shape)
    place: Callable[[int, Site], Site] | None = None

    def setup(self) -> None:
        nn.share_scope(self, self.jdls_wrapped)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        # init (the sites not made yet): the modules' paths in the order they return, which
        # gives the sites their forward positions when the call returns (_place_probes)
        given = bool(self.variables.get(SITES))
        making = self.is_mutable_collection(SITES) and not given
        if not given and not making and not self.is_mutable_collection("params"):
            # applied with {"params": ...} only (an evaluation, a sampler): probes and
            # per-layer scales only measure and scale the backward pass, so the model is the
            # bare one. (FP8 dots compute with their sites, and still ask for them.)
            return self.jdls_wrapped(*args, **kwargs)
        outer = Outer(
            self.is_mutable_collection(SITES), given, self.is_mutable_collection("params")
        )
        returned: dict[tuple[str, ...], int] = {}  # a probe's module path and name -> rank

        calling: list[tuple[str, ...]] = []  # the modules inside one of their own methods
        # Calls so far of each module method, per trace (a lifted transformation traces its
        # body with a scope root of its own, and may trace it more than once): the k-th call
        # of a method in a trace takes the k-th probe, the same one on every trace.
        calls: dict[tuple[int, tuple[str, ...], str], int] = {}
        roots: list[Any] = []  # the roots counted by, kept alive so that ids stay theirs

        def interceptor(next_fun: Callable[..., Any], a: Any, kw: Any, context: Any) -> Any:
            module, method = context.module, context.method_name
            if not _probed_method(method) or module is self or module is self.jdls_wrapped:
                return next_fun(*a, **kw)
            # the path in the model: the wrapper shares its scope (the variables' paths), but
            # submodules made in the model's setup see the wrapper's field name first
            path = tuple(str(p) for p in module.scope.path)
            path = path[1:] if path[:1] == ("jdls_wrapped",) else path
            # super().__call__ of a subclass, a method calling another of the module's own:
            # one call, one site (the outermost method's)
            if path in calling:
                return next_fun(*a, **kw)
            calling.append(path)
            try:
                out = next_fun(*a, **kw)
            finally:
                calling.pop()
            root = module.scope.root
            roots.append(root)
            key = (id(root), path, method)
            use = calls[key] = calls.get(key, 0) + 1
            first = method == "__call__" and use == 1
            for name, site in self.make(path):
                if name == PROBE:  # a probe per call: each use of a module its own row
                    if not first and not holds_floats(out):
                        continue  # nothing to measure (the first __call__ keeps its probe)
                    name = probe_name(method, use)
                    if not first and _not_made(module.scope, name):
                        continue  # a call that init did not make (a method only called now)
                    if making:
                        returned.setdefault((*path, name), len(returned))
                elif method != "__call__":
                    continue  # a per-layer scale: after the layer's __call__ only
                elif use > 1:
                    raise ValueError(
                        f"jdls.linen.layer_scales: the layer {'/'.join(path)!r} was called "
                        f"{use} times in one step (a shared module, or weights tied to another "
                        "layer): per-layer scales need each layer called once, in a chain, or "
                        "its gradients are unscaled by the wrong scale. Move the shared module "
                        "inside one layer, or train with one global scale"
                    )
                # the module's scope, not module.variable: a module without @compact (nn.Embed,
                # setup-style modules) may not make variables in its __call__
                require_site(module.scope, name, outer)
                value = module.scope.variable(SITES, name, fresh_site, site).value
                out = apply_site(out, value)
            return out

        # A lifted nn.jit inside the model reuses a trace by the module's fingerprint, which
        # holds its scope's flags, not the interceptor: a flag naming these sites keeps a trace
        # made without them (the bare model's, or another wrapper's) from standing in for one
        # with them. Child scopes (lifted ones too) take the flags of this one.
        scope = self.scope
        assert scope is not None
        flags = scope.flags
        scope.flags = freeze({**flags, "jdls_sites": self.make})
        try:
            with nn.intercept_methods(interceptor):
                out = self.jdls_wrapped(*args, **kwargs)
        finally:
            scope.flags = flags
        if making and self.place is not None:
            self._place_layer_sites()
        if making:
            self._place_probes(returned)
        return out

    def _place_layer_sites(self) -> None:
        """Give the per-layer sites just made their forward positions, here, outside every
        lifted transformation of the model: the order in which the top-level layers' sites
        came back to this scope is the order in which the layers returned. (Inside a layer,
        the site may come from a trace of another layer that ``nn.jit`` reused.)"""
        assert self.place is not None
        position = 0
        for name, made in list(self.variables.get(SITES, {}).items()):
            site = made.get(LAYER_SCALE) if isinstance(made, Mapping) else None
            if isinstance(site, Site) and isinstance(site.kind, LayerScale):
                made = {**made, LAYER_SCALE: self.place(position, site)}
                self.put_variable(SITES, name, made)
                position += 1

    def _place_probes(self, returned: dict[tuple[str, ...], int]) -> None:
        """Give the probes just made their forward positions (:class:`jdls.Probe`), here,
        outside every lifted transformation: the order in which the module calls returned
        (``returned``), where a trace that ``nn.jit`` reused hid a module's return the order
        of its twin's (see :func:`forward_order`)."""
        made = self.variables.get(SITES, {})
        order = forward_order(made, returned)
        if not order:
            return
        positions = {key: k for k, key in enumerate(order)}

        def placed(node: Mapping[str, Any], path: tuple[str, ...]) -> dict[str, Any]:
            out: dict[str, Any] = {}
            for key, value in node.items():
                if isinstance(value, Mapping):
                    out[key] = placed(value, (*path, key))
                elif _is_probe(value) and (*path, key) in positions:
                    kind = dataclasses.replace(value.kind, position=positions[(*path, key)])
                    out[key] = Site(kind, value.value)
                else:
                    out[key] = value
            return out

        for name, subtree in list(made.items()):
            if isinstance(subtree, Mapping):
                self.put_variable(SITES, name, placed(subtree, (name,)))


def _is_probe(value: Any) -> bool:
    return isinstance(value, Site) and isinstance(value.kind, Probe)


def probe_name(method: str, use: int) -> str:
    """The variable name of the probe after the ``use``-th call (from 1) of a module's
    ``method`` in one trace: ``"probe"`` for the first ``__call__``, ``"probe.decode"`` for
    the first ``decode``, ``"probe#2"`` and ``"probe.decode#2"`` for the second calls.
    :meth:`jdls.Telemetry.of` names its row after the module and this suffix
    (``"embedder.decode"``, ``"blocks/Dropout_0#2"``).

    Example:
      >>> from jdls._frameworks.linen_sites import probe_name
      >>> probe_name("__call__", 1), probe_name("decode", 1), probe_name("__call__", 2)
      ('probe', 'probe.decode', 'probe#2')
    """
    name = PROBE if method == "__call__" else f"{PROBE}.{method}"
    return name if use == 1 else f"{name}#{use}"


def _probed_method(method: str) -> bool:
    """Whether the output of a module's ``method`` gets a probe: ``__call__`` and the public
    methods (``encode``, ``decode``, ``nn.Embed.attend``), not ``setup`` or a private helper."""
    return method == "__call__" or (not method.startswith("_") and method != "setup")


def _not_made(scope: Scope, name: str) -> bool:
    """Whether the probe ``name`` is missing from sites that were given: the call was not
    made when ``init`` ran (a method called only at apply), so it goes unprobed, as every call
    but the first ``__call__`` did before. Where no sites were given at all the probe is
    required (:func:`require_site` names the omission)."""
    return not (
        scope.has_variable(SITES, name)
        or scope.is_mutable_collection(SITES)
        or scope.is_collection_empty(SITES)
    )


def _natural(name: str) -> tuple[tuple[int, int, str], ...]:
    """``"layers_10"`` after ``"layers_9"``: the digits compared as numbers."""
    return tuple(
        (0, int(part), "") if part.isdigit() else (1, 0, part)
        for part in re.split(r"(\d+)", name)
        if part
    )


def forward_order(
    tree: Mapping[str, Any], returned: Mapping[tuple[str, ...], int]
) -> list[tuple[str, ...]]:
    """The probes in ``tree`` (the ``"jdls"`` variables), each as its module's path and its
    variable name (``("blocks", "Dense_0", "probe")``), in forward order: the order in which
    the module calls returned (``returned``: path and name -> rank).

    A module's probes come after its submodules' (a module returns after them). Where
    ``nn.jit`` reused another module's trace the interceptor saw none of the returns inside
    it: such a subtree takes the order of a twin (a module whose returns were seen, with the
    same probes at the same relative paths: the trace it reused), and its place among its
    siblings is where its variables came back to the parent's scope. Without a twin, a
    subtree's modules follow their names' natural order (``"layers_9"`` before
    ``"layers_10"``), each module's own probes last.
    """
    relative: dict[tuple[str, ...], frozenset[tuple[str, ...]]] = {}

    def collect(node: Mapping[str, Any], path: tuple[str, ...]) -> frozenset[tuple[str, ...]]:
        found: set[tuple[str, ...]] = {(k,) for k, v in node.items() if _is_probe(v)}
        for key, value in node.items():
            if isinstance(value, Mapping):
                found |= {(key, *rel) for rel in collect(value, (*path, key))}
        relative[path] = frozenset(found)
        return relative[path]

    collect(tree, ())

    def twin(path: tuple[str, ...]) -> list[tuple[str, ...]] | None:
        rels = relative[path]
        for other, others in relative.items():
            if other != path and others == rels and all((*other, *r) in returned for r in rels):
                return [(*path, *r) for r in sorted(rels, key=lambda r: returned[(*other, *r)])]
        return None

    def order(node: Mapping[str, Any], path: tuple[str, ...]) -> list[tuple[str, ...]]:
        rels = relative[path]
        if path and rels and not any((*path, *r) in returned for r in rels):
            copied = twin(path)
            if copied is not None:
                return copied
        entries: list[tuple[list[tuple[str, ...]], int | None, tuple[Any, ...]]] = []
        for key, value in node.items():
            if isinstance(value, Mapping) and relative[(*path, key)]:
                seq = order(value, (*path, key))
                ranks = [returned[p] for p in seq if p in returned]
                entries.append((seq, min(ranks) if ranks else None, _natural(key)))
        if not any(rank is not None for _, rank, _ in entries):  # nothing seen: by name
            entries.sort(key=lambda e: e[2])
        # Each probe by its rank, so that the calls of modules used several times interleave
        # as they returned; one not seen keeps its place after the one before it (its
        # variables came back to this scope after that one's).
        keyed: list[tuple[tuple[float, int, int], tuple[str, ...]]] = []
        carry = -1.0
        for i, (seq, _, _) in enumerate(entries):
            for j, p in enumerate(seq):
                carry = max(carry, float(returned[p])) if p in returned else carry
                keyed.append(((float(returned[p]) if p in returned else carry, i, j), p))
        for k, name in enumerate(sorted((r[0] for r in rels if len(r) == 1), key=_natural)):
            own = returned.get((*path, name))
            rank = float(own) if own is not None else float("inf")
            keyed.append(((rank, len(entries) + k, 0), (*path, name)))
        return [p for _, p in sorted(keyed, key=lambda e: e[0])]

    return order(tree, ())


def _with_sites(
    model: nn.Module,
    make: Callable[[tuple[str, ...]], list[tuple[str, Site]]],
    place: Callable[[int, Site], Site] | None = None,
) -> nn.Module:
    """``model`` with the sites ``make`` gives; on a model that already has sites (probes of a
    model with per-layer scales), one wrapper with both (each site after the earlier ones)."""
    if isinstance(model, _Sites):
        earlier = model.make

        def both(path: tuple[str, ...]) -> list[tuple[str, Site]]:
            return [*earlier(path), *make(path)]

        return _Sites(model.jdls_wrapped, both, model.place or place)
    return _Sites(model, make, place)


def probes_linen(model: nn.Module, compute_dtype: Any = "float16") -> nn.Module:
    """``model`` with a :class:`jdls.Probe` after every call of every submodule.

    The probes are variables of the collection ``"jdls"`` at each module's path: ``"probe"``
    after its ``__call__``, ``"probe.decode"`` after a public method ``decode`` (an
    embedder's ``encode`` and ``decode``, ``nn.Embed.attend``), ``"probe#2"`` after a
    second call in one pass (a dropout applied twice): each call its own row of telemetry,
    ``"embedder.decode"``, ``"Dropout_0#2"`` (:func:`probe_name`). ``init`` makes them,
    ``apply`` takes them (``{"params": ..., "jdls": ...}``); their gradients are what they
    measured (:meth:`jdls.Telemetry.of`). Inside ``nn.scan``, add ``"jdls": 0`` to
    ``variable_axes``: a row of telemetry per layer.

    Args:
      model: a linen module (not changed).
      compute_dtype: the format whose flushing to zero the probes count.

    Returns:
      A linen module with ``model``'s parameters at the same paths.

    Example:
      >>> import jax, jax.numpy as jnp, flax.linen as nn, jdls
      >>> model = jdls.linen.probes(nn.Sequential([nn.Dense(4), nn.relu, nn.Dense(1)]))
      >>> variables = model.init(jax.random.key(0), jnp.ones((1, 3)))
      >>> sorted(variables), sorted(variables["params"])
      (['jdls', 'params'], ['layers_0', 'layers_2'])
      >>> loss = lambda v: jnp.sum(model.apply(v, jnp.ones((2, 3))))
      >>> _, grads = jdls.StaticScale(8.0).value_and_grad(loss)(variables)
      >>> jdls.Telemetry.of(grads["jdls"]).names
      ('layers_0', 'layers_2')
    """
    kind = Probe(compute_dtype)

    def make(path: tuple[str, ...]) -> list[tuple[str, Site]]:
        del path
        return [(PROBE, Site(kind))]

    return _with_sites(model, make)


def layer_scales_linen(model: nn.Module, scale: LossScale) -> nn.Module:
    """``model`` with a per-layer scale (:func:`jdls.layer_site`) after every top-level
    submodule (``"Dense_0"``, ``"layers_1"``; the module under ``nn.scan``: one per layer).

    The sites are variables ``"layer_scale"`` of the collection ``"jdls"``, made by ``init``
    with ``scale`` each, in the order the layers are called (the chain's forward order). The
    top-level submodules must form a chain (each one's output the next one's input); each
    layer's parameters are those under its path. Differentiate with
    ``jdls.linen.TrainState.value_and_grad`` (or :func:`jdls.layer_scaled_value_and_grad` on
    ``(params, sites)``).

    The forward order is the order in which the layers return during ``init``, set by the
    wrapper outside the layers: layers of one class each wrapped in ``nn.jit`` (which reuses
    the first layer's trace for the others) get their own positions, and each site's initial
    value is made from ``scale`` there, whatever trace JAX reused inside the layer.

    Args:
      model: a linen module (not changed).
      scale: every layer's initial scale (``jdls.AdaptiveScale()``, say).

    Returns:
      A linen module with ``model``'s parameters at the same paths.

    Example:
      >>> import jax, jax.numpy as jnp, flax.linen as nn, jdls
      >>> net = nn.Sequential([nn.Dense(4), nn.tanh, nn.Dense(1)])
      >>> model = jdls.linen.layer_scales(net, jdls.StaticScale(2.0**10))
      >>> variables = model.init(jax.random.key(0), jnp.ones((1, 3)))
      >>> sorted(variables["jdls"])
      ['layers_0', 'layers_2']
    """
    check_scale(scale, "scale")

    def make(path: tuple[str, ...]) -> list[tuple[str, Site]]:
        # the position is set where the order is known (_Sites._place_layer_sites)
        return [(LAYER_SCALE, layer_site(scale, 0))] if len(path) == 1 else []

    def place(position: int, made: Site) -> Site:
        stack = made.kind.stack_shape(made.value)
        return fresh_site(layer_site(scale, position).stacked(*stack))

    return _with_sites(model, make, place)
