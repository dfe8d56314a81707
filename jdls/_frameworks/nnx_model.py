"""A Flax NNX model as jdls sees it: :class:`SiteVariable`, the variable that holds a site,
and :func:`modules_in_order`, every module once in the order the forward pass returns from
them (the walk that places probes and per-layer scales and that refuses a shared site)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from flax import nnx

from jdls._sites.probe import Probe

__all__ = ["SiteVariable", "modules_in_order"]


class SiteVariable(nnx.Variable):  # type: ignore[type-arg]
    """An NNX ``Variable`` holding a :class:`jdls.Site`: the model's state, not a parameter
    (``nnx.Optimizer(..., wrt=nnx.Param)`` leaves it alone; :class:`Optimizer` updates it).

    Example:
      >>> import jdls
      >>> v = jdls.nnx.SiteVariable(jdls.Site(jdls.Probe()))
      >>> v.get_value().value.shape
      (6,)
    """


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
