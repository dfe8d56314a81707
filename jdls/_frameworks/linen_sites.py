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
from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import errors
from flax.core import Scope, freeze

from jdls._scales.layer_scales import LayerScale, layer_site
from jdls._scales.scale import LossScale, check_scale
from jdls._sites.apply import apply_site
from jdls._sites.probe import Probe
from jdls._sites.site import Site

__all__ = [
    "LAYER_SCALE",
    "PROBE",
    "SITES",
    "MissingSitesError",
    "Outer",
    "forward_order",
    "layer_scales_linen",
    "probes_linen",
    "require_site",
]

#: The variable collection that holds the sites of a linen model.
SITES = "jdls"
#: The variable names of a module's probe and per-layer scale in :data:`SITES`.
PROBE = "probe"
LAYER_SCALE = "layer_scale"


class MissingSitesError(errors.ScopeCollectionNotFound, ValueError):
    """A module reads a site of the ``"jdls"`` collection that is not in the variables and
    cannot be made there; the message says which omission it is and the line that fixes it.

    A Flax ``ScopeCollectionNotFound`` (code catching that one catches this one too) and a
    ``ValueError``.
    """

    def __init__(self, message: str) -> None:
        Exception.__init__(self, message)  # not FlaxError's: no link to Flax's page of its own

    def __reduce__(self) -> tuple[type[MissingSitesError], tuple[str]]:
        return (type(self), (str(self),))


class Outer(NamedTuple):
    """What the model's own scope (outside every lifted transformation) holds of the sites:
    whether ``"jdls"`` is mutable there, whether variables of it were given, and whether
    ``"params"`` is mutable (an ``apply`` that initialises)."""

    mutable: bool
    given: bool
    params_mutable: bool


#: What the site of each variable name is, in the errors.
_WHAT = {PROBE: "probe", LAYER_SCALE: "per-layer scale", "fp8": "FP8 dot"}

_FIX_LIFT = (
    'the {lift} on the way does not carry the collection "jdls": add "jdls": 0 to its '
    'variable_axes, as the parameters, e.g. nn.scan(Block, variable_axes={{"params": 0, '
    '"jdls": 0}}, split_rngs={{"params": True}}, length=n)'
)
_FIX_INIT = (
    'an apply that makes the variables (mutable=["params"] used as init) does not make '
    'the sites: add "jdls" to mutable, model.apply(variables, *args, rngs=rngs, '
    'mutable=["params", "jdls"]) (model.init makes every collection)'
)
_FIX_EVAL = (
    'the model is applied with {"params": ...} only (an evaluation, a sampler): pass its '
    'sites too, model.apply({"params": params, "jdls": variables["jdls"]}, *args) '
    "(state.variables of a jdls.linen.TrainState holds both)"
)
_FIX_OTHER = (
    'the "jdls" variables given hold no such site here: they were made by another model '
    "(before jdls.linen.probes or layer_scales wrapped it, or with other FP8 layers); make "
    "them with this model's init"
)


def _lift(scope: Scope) -> str | None:
    """The lifted transformations ``scope`` runs inside (``"nn.scan at /scan(Block_0)"``),
    or None outside every one (the root of a lifted scope has a name; the model's has none)."""
    if scope.root.name is None:
        return None
    path = [str(p) for p in scope.debug_path]
    lifted = [k for k, p in enumerate(path) if re.match(r"\w+\(", p)]
    if not lifted:
        return "lifted transformation"
    names = sorted({path[k].split("(")[0] for k in lifted})
    where = "/" + "/".join(path[: lifted[-1] + 1])
    return f"{' or '.join('nn.' + n for n in names)} (at {where})"


def require_site(scope: Scope, name: str, outer: Outer | None = None) -> None:
    """Raise :class:`MissingSitesError` if the site ``name`` of the ``"jdls"`` collection can
    be neither read nor made at ``scope``: the message names the fix where the scope (and,
    from the model's wrapper, ``outer``) tells which of the usual omissions it is, and lists
    them all where it cannot. Call it where a module reads its site, before the variable."""
    if scope.has_variable(SITES, name) or scope.is_mutable_collection(SITES):
        return
    lift = _lift(scope)
    fixes: list[str]
    if not scope.is_collection_empty(SITES):
        fixes = [_FIX_OTHER]
    elif lift is None:  # the model's own scope: the apply itself lacks the sites
        fixes = [_FIX_INIT if scope.is_mutable_collection("params") else _FIX_EVAL]
    elif (outer is not None and (outer.mutable or outer.given)) or (
        outer is None and scope.flags.get("initializing", False)
    ):
        fixes = [_FIX_LIFT.format(lift=lift)]  # made or given outside, dropped by the lift
    else:  # the apply lacks them, and the lift may as well (it cannot be seen from inside)
        init_like = outer.params_mutable if outer is not None else None
        if init_like is None:
            init_like = scope.is_mutable_collection("params")
        fixes = [_FIX_INIT if init_like else _FIX_EVAL, _FIX_LIFT.format(lift=lift)]
    what = _WHAT.get(name, "site")
    head = (
        f'jdls: the {what} site "{name}" of the collection "jdls" at {scope.path_text} is not '
        'in the variables, and "jdls" is not mutable there to make it. '
    )
    if len(fixes) == 1:
        raise MissingSitesError(head + "The cause: " + fixes[0] + ".")
    listed = " ".join(f"({k + 1}) {fix}." for k, fix in enumerate(fixes))
    raise MissingSitesError(head + "Check each of these (all may apply): " + listed)


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
        outer = Outer(
            self.is_mutable_collection(SITES), given, self.is_mutable_collection("params")
        )
        returned: dict[tuple[str, ...], int] = {}

        calling: list[tuple[str, ...]] = []  # the modules inside their own __call__

        def interceptor(next_fun: Callable[..., Any], a: Any, kw: Any, context: Any) -> Any:
            module = context.module
            if context.method_name != "__call__" or module is self or module is self.jdls_wrapped:
                return next_fun(*a, **kw)
            # the path in the model: the wrapper shares its scope (the variables' paths), but
            # submodules made in the model's setup see the wrapper's field name first
            path = tuple(str(p) for p in module.scope.path)
            path = path[1:] if path[:1] == ("jdls_wrapped",) else path
            if path in calling:  # super().__call__ of a subclass: one call, one site
                return next_fun(*a, **kw)
            calling.append(path)
            try:
                out = next_fun(*a, **kw)
            finally:
                calling.pop()
            if making:
                returned.setdefault(path, len(returned))
            for name, site in self.make(path):
                # the module's scope, not module.variable: a module without @compact (nn.Embed,
                # setup-style modules) may not make variables in its __call__
                require_site(module.scope, name, outer)
                value = module.scope.variable(SITES, name, _fresh, site).value
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
        outside every lifted transformation: the order in which the modules returned
        (``returned``), where a trace that ``nn.jit`` reused hid a module's return the order
        of its twin's (see :func:`forward_order`)."""
        made = self.variables.get(SITES, {})
        order = forward_order(made, returned)
        if not order:
            return
        positions = {path: k for k, path in enumerate(order)}

        def placed(node: Mapping[str, Any], path: tuple[str, ...]) -> dict[str, Any]:
            out: dict[str, Any] = {}
            for key, value in node.items():
                if isinstance(value, Mapping):
                    out[key] = placed(value, (*path, key))
                elif key == PROBE and _is_probe(value):
                    kind = dataclasses.replace(value.kind, position=positions[path])
                    out[key] = Site(kind, value.value)
                else:
                    out[key] = value
            return out

        for name, subtree in list(made.items()):
            if isinstance(subtree, Mapping):
                self.put_variable(SITES, name, placed(subtree, (name,)))


def _is_probe(value: Any) -> bool:
    return isinstance(value, Site) and isinstance(value.kind, Probe)


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
    """The paths of the modules holding a probe in ``tree`` (the ``"jdls"`` variables),
    in forward order: the order in which the modules returned (``returned``: path -> rank).

    A module's probe comes after its submodules' (a module returns after them). Where
    ``nn.jit`` reused another module's trace the interceptor saw none of the returns inside
    it: such a subtree takes the order of a twin (a module whose returns were seen, with the
    same probes at the same relative paths: the trace it reused), and its place among its
    siblings is where its variables came back to the parent's scope. Without a twin, a
    subtree's modules follow their names' natural order (``"layers_9"`` before
    ``"layers_10"``), each module's own probe last.
    """
    relative: dict[tuple[str, ...], frozenset[tuple[str, ...]]] = {}

    def collect(node: Mapping[str, Any], path: tuple[str, ...]) -> frozenset[tuple[str, ...]]:
        found: set[tuple[str, ...]] = {()} if _is_probe(node.get(PROBE)) else set()
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
        # an entry not seen keeps its place after the one before it (its variables came
        # back to this scope after that one's)
        keyed, carry = [], -1.0
        for i, (seq, rank, _) in enumerate(entries):
            carry = float(rank) if rank is not None else carry
            keyed.append(((carry, i), seq))
        if () in rels:
            own = returned.get(path)
            keyed.append(((float(own) if own is not None else float("inf"), len(keyed)), [path]))
        return [p for _, seq in sorted(keyed, key=lambda e: e[0]) for p in seq]

    return order(tree, ())


def _fresh(site: Site) -> Site:
    """``site`` with its arrays copied: every site's initial value its own buffer (sites made
    from one scale would otherwise share arrays, which a donating ``jax.jit`` refuses)."""
    return jax.tree.map(lambda x: jnp.array(x, copy=True), site)


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
    """``model`` with a :class:`jdls.Probe` after every submodule's ``__call__``.

    The probes are variables ``"probe"`` of the collection ``"jdls"`` at each module's path:
    ``init`` makes them, ``apply`` takes them (``{"params": ..., "jdls": ...}``); their
    gradients are what they measured (:meth:`jdls.Telemetry.of`). Inside ``nn.scan``, add
    ``"jdls": 0`` to ``variable_axes``: a row of telemetry per layer.

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
        return _fresh(layer_site(scale, position).stacked(*stack))

    return _with_sites(model, make, place)
