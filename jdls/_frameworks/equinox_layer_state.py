"""Reading and setting an Equinox model's per-layer scales, and the checkpoint filter that
keeps its sites: :func:`get_layer_scales`, :func:`set_layer_scales`, :func:`checkpointed`
(the sites are put in by ``jdls/_frameworks/equinox_sites.py``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from jdls._frameworks.equinox_sites import site_name
from jdls._numerics.paths import path_key
from jdls._scales.layer_site import LayerScale
from jdls._scales.scale import LossScale, check_scale
from jdls._sites.site import Site, fresh_site, is_site

__all__ = ["checkpointed", "get_layer_scales", "set_layer_scales"]


def _layer_sites(model: Any) -> list[tuple[str, Site, tuple[Any, ...]]]:
    """The per-layer sites of ``model`` in forward order: name, site, path."""
    found = jax.tree_util.tree_flatten_with_path(model, is_leaf=is_site)[0]
    sites = []
    for path, site in found:
        if isinstance(site, Site) and isinstance(site.kind, LayerScale):
            keys = tuple(path_key(k) for k in path)
            sites.append((site_name(keys[:-1]), site, keys))
    return sorted(sites, key=lambda s: s[1].kind.position)  # type: ignore[attr-defined]


def _rows(name: str, site: Site) -> Iterator[tuple[str, tuple[int, ...]]]:
    """The rows of a site: its layers' names (``"layers[3]"``) and indices in the stack."""
    stack = site.kind.stack_shape(site.value)
    for index in np.ndindex(*stack):
        yield (f"{name}[{','.join(map(str, index))}]" if stack else name), index


def get_layer_scales(model: Any) -> dict[str, jax.Array]:
    """Each layer's loss scale, in forward order: ``{"embed": 2.0**15, "layers[0]": ...}``
    (a stack's layers ``"layers[k]"``, as the rows of :class:`jdls.Telemetry`).

    Example:
      >>> import equinox as eqx, jax, jdls, jdls.equinox
      >>> model = jdls.equinox.layer_scales(eqx.nn.MLP(2, 1, 4, 1, key=jax.random.key(0)),
      ...                                   jdls.StaticScale(8.0))
      >>> list(jdls.equinox.get_layer_scales(model))
      ['layers/0', 'layers/1']
    """
    out: dict[str, jax.Array] = {}
    for name, site, _ in _layer_sites(model):
        levels = jnp.asarray(site.value["scale"].loss_scale)
        for row, index in _rows(name, site):
            out[row] = levels[index]
    return out


def set_layer_scales(model: Any, scales: LossScale | Sequence[LossScale | float]) -> Any:
    """``model`` with its per-layer scales replaced: one :class:`jdls.LossScale` for every
    layer, or one entry per layer in forward order (the rows of :func:`get_layer_scales`, a
    stack's layers one by one), each a loss scale (its rule and state with it) or a number
    (the layer's loss scale set to it, its rule's state kept).

    Example:
      >>> import equinox as eqx, jax, jdls, jdls.equinox
      >>> model = jdls.equinox.layer_scales(eqx.nn.MLP(2, 1, 4, 1, key=jax.random.key(0)),
      ...                                   jdls.AdaptiveScale())
      >>> model = jdls.equinox.set_layer_scales(model, [2.0**20, 2.0**4])
      >>> [float(v) for v in jdls.equinox.get_layer_scales(model).values()]
      [1048576.0, 16.0]
    """
    sites = _layer_sites(model)
    if not sites:
        raise ValueError(
            "jdls.equinox.set_layer_scales: the model holds no per-layer scale; add them "
            "with jdls.equinox.layer_scales(model, scale)"
        )
    rows = sum(len(list(_rows(name, site))) for name, site, _ in sites)
    if isinstance(scales, LossScale):
        given: list[Any] = [scales] * rows
    else:
        given = list(scales)
        if len(given) != rows:
            names = [r for name, site, _ in sites for r, _ in _rows(name, site)]
            raise ValueError(
                f"jdls.equinox.set_layer_scales: the model has {rows} layers with a scale "
                f"({', '.join(names)}), got {len(given)} values: give one per layer in this "
                "order, or one jdls loss scale for all"
            )
    new: dict[tuple[Any, ...], Site] = {}
    k = 0
    for name, site, path in sites:
        current = site.value["scale"]
        entries = []
        for row, index in _rows(name, site):
            value = given[k]
            k += 1
            old = jax.tree_util.tree_map(lambda v, i=index: jnp.asarray(v)[i], current)
            if isinstance(value, LossScale):
                entries.append(check_scale(value, "scales"))
            elif isinstance(value, int | float) or (
                hasattr(value, "shape") and jnp.shape(value) == ()
            ):
                number = jnp.asarray(value, jnp.asarray(old.loss_scale).dtype)
                entries.append(dataclasses.replace(old, loss_scale=number))
            else:
                raise TypeError(
                    f"jdls.equinox.set_layer_scales: the value for {row} is a "
                    f"{type(value).__name__}; give a jdls loss scale or a number"
                )
        stack = site.kind.stack_shape(site.value)
        level: Any
        if stack:
            try:
                level = jax.tree_util.tree_map(
                    lambda *v, shape=stack: jnp.stack([jnp.asarray(x) for x in v]).reshape(
                        (*shape, *jnp.shape(v[0]))
                    ),
                    *entries,
                )
            except ValueError:
                raise ValueError(
                    f"jdls.equinox.set_layer_scales: the layers of the stack {name} take "
                    "loss scales of different kinds or rules; one stack's layers share one"
                ) from None
        else:
            level = entries[0]
        new[path] = fresh_site(Site(site.kind, {**site.value, "scale": level}))

    def put(path: Any, x: Any) -> Any:
        return new.get(tuple(path_key(p) for p in path), x)

    return jax.tree_util.tree_map_with_path(put, model, is_leaf=is_site)


def checkpointed(model: Any) -> Any:
    """``eqx.filter(model, eqx.is_inexact_array)`` that keeps the sites whole: their
    integer leaves (a per-layer scale's counters) too, which the inexact filter drops and a
    restore would take from the template (counters silently reset). Save and restore with it
    where a codebase filters to inexact arrays.

    Example:
      >>> import equinox as eqx, jax, jdls, jdls.equinox
      >>> model = jdls.equinox.layer_scales(eqx.nn.MLP(2, 1, 4, 1, key=jax.random.key(0)),
      ...                                   jdls.DynamicScale())
      >>> count = lambda t: len(jax.tree_util.tree_leaves(t))
      >>> count(jdls.equinox.checkpointed(model)) - count(eqx.filter(model, eqx.is_inexact_array))
      6
    """
    return eqx.filter(model, lambda x: is_site(x) or eqx.is_inexact_array(x), is_leaf=is_site)
