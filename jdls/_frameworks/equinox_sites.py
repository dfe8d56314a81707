"""Sites in an Equinox model without model edits: chosen submodules wrapped in
:class:`Sited`, which passes their output through a probe and/or a per-layer scale.

An Equinox model is an immutable pytree, so the sites are fields of the model: the functions
here return a new model in which each chosen submodule is replaced by a :class:`Sited`
holding it (``jdls_wrapped``) and its sites (``probe``, ``layer_scale``). The wrapper forwards
``__call__`` (and attribute access), so the model's own code runs unchanged; its sites are
arrays of the model, split by ``eqx.partition``, sliced by ``lax.scan`` over a stack (a stacked
module's sites carry the stack's leading axis), checkpointed by ``eqx.filter_checkpoint`` and
differentiated with the rest.

The forward order (the rows of :class:`jdls.Telemetry`, the chain of per-layer scales) is the
tree order of the chosen modules, each after its submodules (as ``jdls.nnx`` orders them),
or the order in which a ``where`` function returns them.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp

from jdls._numerics.paths import path_key
from jdls._scales.layer_site import layer_site, note_applied
from jdls._scales.scale import LossScale, check_scale
from jdls._sites.apply import apply_site
from jdls._sites.probe import Probe
from jdls._sites.site import Site, fresh_site, is_site
from jdls._sites.telemetry import WRAPPED

__all__ = [
    "FIX_ORDER",
    "Sited",
    "layer_scales_equinox",
    "probes_equinox",
    "site_name",
    "unwrap",
]

Where = Callable[[Any], Any] | type | tuple[type, ...] | None

#: How to number the layers in forward order, in the error of :func:`applied_in_order`.
FIX_ORDER = (
    "jdls.equinox.layer_scales numbers the layers in the order of the model's fields (or of "
    "where=): give the layers in the order the model calls them, where=lambda m: (m.embed, "
    "m.layers, m.norm, m.head)"
)


class Sited(eqx.Module):
    """A module with sites on its output: ``Sited(module, probe=..., layer_scale=...)(x)`` is
    ``module(x)`` passed through the probe, then through the per-layer scale (the probe sees
    the layer's own scale). Attributes other than its fields are the wrapped module's
    (``wrapper.weight`` is ``wrapper.jdls_wrapped.weight``), so the model's code and
    ``eqx.tree_at`` reach through it.

    :func:`jdls.equinox.probes` and :func:`jdls.equinox.layer_scales` make these;
    :func:`jdls.equinox.unwrap` removes them.

    Example:
      >>> import equinox as eqx, jax, jax.numpy as jnp, jdls, jdls.equinox
      >>> linear = eqx.nn.Linear(2, 3, key=jax.random.key(0))
      >>> sited = jdls.equinox.Sited(linear, probe=jdls.Site(jdls.Probe()))
      >>> sited(jnp.ones(2)).shape, sited.weight.shape
      ((3,), (3, 2))
    """

    jdls_wrapped: Any
    probe: Site | None = None
    layer_scale: Site | None = None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        out = self.jdls_wrapped(*args, **kwargs)
        for site in (self.probe, self.layer_scale):
            if site is None:
                continue
            _check_one(site, self.jdls_wrapped)
            note_applied(site)  # checked by jdls.equinox.layer_scaled_value_and_grad
            out = apply_site(out, site)
        return out

    def __getattr__(self, name: str) -> Any:
        # only reached where ordinary lookup failed: the wrapped module's attribute
        if name.startswith("__") or name == WRAPPED:
            raise AttributeError(name)
        return getattr(object.__getattribute__(self, WRAPPED), name)


def _check_one(site: Site, module: Any) -> None:
    """Refuse a site that does not fit the call: a site sliced by ``lax.scan`` (the module is
    a stack that ``stacked=`` did not name), or a stack of sites in a whole call."""
    what = type(module).__name__
    try:
        stack = site.kind.stack_shape(site.value)
    except (ValueError, IndexError, KeyError):
        raise ValueError(
            f"jdls.equinox: the {type(site.kind).__name__} site of a {what} is sliced: the "
            f"{what} is a stack of layers (made by eqx.filter_vmap) run one layer at a time, "
            "but its site was made for one module. Name the stack when adding the sites, e.g. "
            "jdls.equinox.probes(model, stacked=lambda m: m.layers)"
        ) from None
    if stack:
        raise ValueError(
            f"jdls.equinox: a {what} holding a stack of {math.prod(stack)} sites is called "
            "whole, not one layer at a time: stacked= named a module that is not a stack run "
            "by lax.scan. Leave it out of stacked="
        )


def _arrays(module: Any) -> list[Any]:
    return [
        x for x in jax.tree_util.tree_leaves(module, is_leaf=is_site) if eqx.is_inexact_array(x)
    ]


def _stack_size(module: Any, who: str) -> int:
    """The number of layers of a stack (the shared leading axis of its arrays)."""
    leading = {jnp.shape(x)[0] if jnp.ndim(x) else None for x in _arrays(module)}
    if len(leading) != 1 or None in leading:
        raise ValueError(
            f"{who}: stacked= named a {type(module).__name__} whose arrays do not share a "
            f"leading axis (leading sizes {sorted(map(str, leading))}): a stack made by "
            "eqx.filter_vmap has one, the number of layers. Name only such stacks"
        )
    size = leading.pop()
    assert size is not None
    return int(size)


def _picked(model: Any, chooser: Callable[[Any], Any], what: str, who: str) -> list[Any]:
    """The modules a ``where``/``stacked`` function returns, in its order."""
    got = chooser(model)
    nodes = list(got) if isinstance(got, list | tuple) else [got]
    for node in nodes:
        if not isinstance(node, eqx.Module):
            raise TypeError(
                f"{who}: {what} returned a {type(node).__name__}, not an eqx.Module: return "
                "the submodules, e.g. lambda m: (m.embed, m.layers, m.norm, m.head)"
            )
    return nodes


def _one_level(node: Any) -> tuple[list[tuple[Any, Any]], Any]:
    """The direct children of ``node`` with their keys, and its tree structure."""
    found, treedef = jax.tree_util.tree_flatten_with_path(node, is_leaf=lambda x: x is not node)
    return [(path[0], child) for path, child in found], treedef


def _is_node(x: Any) -> bool:
    """A node whose children are walked: a module or a container, not a site or an array."""
    return isinstance(x, eqx.Module | list | tuple | dict) and not is_site(x)


def _top_level(model: Any) -> list[Any]:
    """The model's direct submodules holding floating-point arrays: its fields, and the
    entries of its list, tuple and dict fields."""
    found: list[Any] = []

    def visit(x: Any) -> None:
        if isinstance(x, eqx.Module) and not is_site(x):
            if _arrays(x):
                found.append(x)
        elif isinstance(x, list | tuple | dict):
            for _, child in _one_level(x)[0]:
                visit(child)

    for _, child in _one_level(model)[0]:
        visit(child)
    return found


@dataclasses.dataclass
class _Plan:
    """Which modules get a site, and which are stacks."""

    chosen: Callable[[Any], bool]
    ranks: dict[int, int] | None  # id -> place where a where function gave the order
    stacks: set[int]


def _plan(model: Any, where: Where, stacked: Any, who: str) -> _Plan:
    stacks = (
        {id(m) for m in _picked(model, stacked, "stacked", who)} if stacked is not None else set()
    )
    if where is None:
        ids = {id(m): k for k, m in enumerate(_top_level(model))}
        if not ids:
            raise ValueError(
                f"{who}: the model has no submodule holding floating-point arrays to put a "
                "site after; choose the modules with where=..."
            )
        return _Plan(lambda m: id(m) in ids, None, stacks)
    if isinstance(where, type) or (
        isinstance(where, tuple) and all(isinstance(t, type) for t in where)
    ):
        types = where
        return _Plan(lambda m: isinstance(m, types), None, stacks)
    if not callable(where):
        raise TypeError(
            f"{who}: where= takes a function of the model returning the submodules to wrap "
            f"(lambda m: (m.embed, m.layers, m.head)), or a module class, got {where!r}"
        )
    nodes = _picked(model, where, "where", who)
    ranks: dict[int, int] = {}
    for k, node in enumerate(nodes):
        if id(node) in ranks:
            raise ValueError(f"{who}: where returned one module twice (at {ranks[id(node)]}, {k})")
        ranks[id(node)] = k
    return _Plan(lambda m: id(m) in ranks, ranks, stacks)


@dataclasses.dataclass(frozen=True)
class Stack:
    """Where a site goes in a stack of layers: the stack's size (its leading axis), its path
    in the model, and whether the site is the stack's own (``False``: a module inside it)."""

    size: int
    path: tuple[str, ...]
    own: bool


def _with_sites(
    model: Any,
    make: Callable[[int, Stack | None], Site],
    field: str,
    where: Where,
    stacked: Any,
    who: str,
) -> Any:
    """``model`` with a site ``make(position, stack)`` in the field ``field`` of a
    :class:`Sited` around each chosen module (a module wrapped already takes it in its own
    wrapper); the positions in forward order."""
    plan = _plan(model, where, stacked, who)
    chosen: list[tuple[int, Stack | None]] = []  # (order key, stack) per site
    seen: dict[int, Any] = {}
    count = 0

    def walk(node: Any, path: tuple[Any, ...], stack: Stack | None) -> Any:
        nonlocal count
        if not _is_node(node):
            return node
        inner = node.jdls_wrapped if isinstance(node, Sited) else node
        picked = plan.chosen(node) or (node is not inner and plan.chosen(inner))
        if id(inner) in plan.stacks or id(node) in plan.stacks:
            if stack is not None:
                raise ValueError(
                    f"{who}: stacked= named a stack inside a stack, at {site_name(path)}"
                )
            stack = Stack(_stack_size(inner, who), _keys(path), picked)
        inside = (
            stack
            if stack is None or stack.path == _keys(path)
            else Stack(stack.size, stack.path, False)
        )
        if isinstance(node, Sited):
            rebuilt = dataclasses.replace(node, jdls_wrapped=_rebuild(inner, path, stack, walk))
        else:
            rebuilt = _rebuild(node, path, stack, walk)
        if not picked:
            return rebuilt
        if id(inner) in seen:
            raise ValueError(
                f"{who}: one module is at {site_name(seen[id(inner)])} and at {site_name(path)}: one "
                "site would serve both uses. Give each place its own module"
            )
        seen[id(inner)] = path
        if not callable(inner):
            raise TypeError(
                f"{who}: the {type(inner).__name__} at {site_name(path)} has no __call__"
            )
        if isinstance(rebuilt, Sited) and getattr(rebuilt, field) is not None:
            again = "set_layer_scales" if field == "layer_scale" else "unwrap"
            raise ValueError(
                f"{who}: the {type(inner).__name__} at {site_name(path)} holds a {field} already; "
                f"change it with jdls.equinox.{again}"
            )
        if plan.ranks is not None:
            rank = plan.ranks[id(node) if id(node) in plan.ranks else id(inner)]
        else:
            rank = count
        count += 1
        chosen.append((rank, inside))
        placeholder: Any = _Pending(len(chosen) - 1)
        if isinstance(rebuilt, Sited):
            return dataclasses.replace(rebuilt, **{field: placeholder})
        return Sited(rebuilt, **{field: placeholder})

    walked = walk(model, (), None)
    order = sorted(range(len(chosen)), key=lambda i: chosen[i][0])
    position = {i: k for k, i in enumerate(order)}

    def fill(x: Any) -> Any:
        if isinstance(x, _Pending):
            return make(position[x.index], chosen[x.index][1])
        return x

    return jax.tree_util.tree_map(fill, walked, is_leaf=lambda x: isinstance(x, _Pending))


@dataclasses.dataclass(frozen=True)
class _Pending:
    """A site's place while the forward positions are counted."""

    index: int


def _rebuild(
    node: Any,
    path: tuple[Any, ...],
    stack: Stack | None,
    walk: Callable[[Any, tuple[Any, ...], Stack | None], Any],
) -> Any:
    children, treedef = _one_level(node)
    return jax.tree_util.tree_unflatten(
        treedef, [walk(child, (*path, path_key(key)), stack) for key, child in children]
    )


def _keys(path: Sequence[Any]) -> tuple[str, ...]:
    """A path as :class:`jdls.Telemetry` names it: its keys as text, the wrappers' left out."""
    return tuple(str(k) for k in path if k != WRAPPED)


def site_name(path: Sequence[Any]) -> str:
    """A path as a telemetry row names it (the wrappers' keys left out), ``"the model"`` for
    the root."""
    return "/".join(_keys(path)) or "the model"


def probes_equinox(
    model: Any,
    compute_dtype: Any = "float16",
    *,
    where: Where = None,
    stacked: Callable[[Any], Any] | None = None,
) -> Any:
    """``model`` with a :class:`jdls.Probe` on the output of chosen submodules.

    Each chosen submodule is wrapped in a :class:`Sited` holding its probe; for a stack of
    layers made by ``eqx.filter_vmap`` (named by ``stacked``), the probe is stacked with it,
    one row of telemetry per layer. ``jdls.equinox.value_and_grad`` (or
    ``scale.value_and_grad``) returns what they measured as their gradients,
    :meth:`jdls.Telemetry.of` reads them (from the gradients, or from the model after
    ``jdls.equinox.apply_updates``), rows named by the module's field (``"layers[3]"``).

    Args:
      model: an Equinox model (not changed).
      compute_dtype: the format whose flushing to zero the probes count.
      where: which submodules: a function of the model returning them (in forward order),
        or a module class (every module of that class, in tree order); default the model's
        direct submodules holding floating-point arrays, in the order of its fields.
      stacked: a function of the model returning the stacks of layers (made by
        ``eqx.filter_vmap``, run by ``lax.scan``), e.g. ``lambda m: m.layers``.

    Returns:
      The model with :class:`Sited` wrappers.

    Example:
      >>> import equinox as eqx, jax, jax.numpy as jnp, jdls, jdls.equinox
      >>> model = jdls.equinox.probes(eqx.nn.Sequential([
      ...     eqx.nn.Linear(3, 4, key=jax.random.key(0)), eqx.nn.Lambda(jnp.tanh),
      ...     eqx.nn.Linear(4, 1, key=jax.random.key(1))]))
      >>> loss = lambda m, x: jnp.sum(m(x))
      >>> _, grads = jdls.equinox.value_and_grad(loss, jdls.StaticScale(8.0))(model, jnp.ones(3))
      >>> jdls.Telemetry.of(grads).names
      ('layers/0', 'layers/2')
    """
    kind = Probe(compute_dtype)

    def make(position: int, stack: Stack | None) -> Site:
        if stack is None:
            return Site(dataclasses.replace(kind, position=position))
        # a module inside a stack without a probe of its own: its rows go layer by layer
        within = None if stack.own else stack.path
        return Site(dataclasses.replace(kind, position=position, stack=within)).stacked(stack.size)

    return _with_sites(model, make, "probe", where, stacked, "jdls.equinox.probes")


def layer_scales_equinox(
    model: Any,
    scale: LossScale,
    *,
    where: Where = None,
    stacked: Callable[[Any], Any] | None = None,
) -> Any:
    """``model`` with a per-layer scale (:func:`jdls.layer_site`, ``scale`` each) on the output
    of chosen submodules; a stack of layers (named by ``stacked``) gets one per layer.

    The chosen modules must form a chain in their forward order (each one's output the next
    one's input), and every floating-point array of the model must be in one of them;
    differentiate with :func:`jdls.equinox.layer_scaled_value_and_grad`, which refuses
    layers that apply their scales out of that order. ``jdls.wrap`` (with
    ``jdls.NoOpScale()``) updates each layer's scale from its own gradients and
    :func:`jdls.equinox.apply_updates` puts them in place.

    Args:
      model: an Equinox model (not changed).
      scale: every layer's initial scale (``jdls.AdaptiveScale()``, say).
      where: which submodules, in forward order (see :func:`probes_equinox`); default the
        model's direct submodules holding floating-point arrays, in the order of its fields.
      stacked: a function of the model returning the stacks of layers, e.g.
        ``lambda m: m.layers``.

    Returns:
      The model with :class:`Sited` wrappers.

    Example:
      >>> import equinox as eqx, jax, jdls, jdls.equinox
      >>> model = eqx.nn.MLP(2, 1, 4, 1, key=jax.random.key(0))
      >>> model = jdls.equinox.layer_scales(model, jdls.StaticScale(2.0**10))
      >>> {k: float(v) for k, v in jdls.equinox.get_layer_scales(model).items()}
      {'layers/0': 1024.0, 'layers/1': 1024.0}
    """
    check_scale(scale, "scale")

    def make(position: int, stack: Stack | None) -> Site:
        site = layer_site(scale, position)
        if stack is None:
            return fresh_site(site)
        if not stack.own:
            raise ValueError(
                f"jdls.equinox.layer_scales: where= chose a module inside the stack "
                f"{'/'.join(stack.path)}: a per-layer scale goes after a whole layer of the "
                "chain, and each layer of a stack is one. Choose the stack itself"
            )
        return fresh_site(site.stacked(stack.size))

    return _with_sites(model, make, "layer_scale", where, stacked, "jdls.equinox.layer_scales")


def unwrap(model: Any) -> Any:
    """``model`` without its :class:`Sited` wrappers (and so without the sites they held):
    the bare model, for evaluation, export or a reference gradient.

    Example:
      >>> import equinox as eqx, jax, jdls, jdls.equinox
      >>> linear = eqx.nn.Linear(2, 1, key=jax.random.key(0))
      >>> model = jdls.equinox.probes(eqx.nn.Sequential([linear]))
      >>> type(model.layers[0]).__name__, type(jdls.equinox.unwrap(model).layers[0]).__name__
      ('Sited', 'Linear')
    """

    def bare(x: Any) -> Any:
        return unwrap(x.jdls_wrapped) if isinstance(x, Sited) else x

    return jax.tree_util.tree_map(bare, model, is_leaf=lambda x: isinstance(x, Sited))
