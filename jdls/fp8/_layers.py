"""Which dots to keep in high precision: a ranking from telemetry, and the setter.

NVFP4 training keeps about 15% of the linear layers in bfloat16, mostly the last blocks
(arXiv 2509.25149, section 4.1), and suggests that the layers' quantization error could
choose them. Each NVFP4 dot measures the relative error of its weight gradient when the
recipe has ``measure_error=True``; :func:`rank_layers` orders the dots (one entry per layer of
a stacked, scanned site) by it, :func:`suggest_high_precision` takes the worst fraction and
:func:`keep_high_precision` sets their ``keep`` state. ``keep`` is data, so one layer of a
scanned stack can be kept while the next is not, with no change to the model.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jdls._sites.site import Site
from jdls.fp8._nvfp4_recipe import NVFP4Scaling, NVFP4State
from jdls.fp8._state import telemetry

__all__ = ["LayerError", "keep_high_precision", "rank_layers", "suggest_high_precision"]


@dataclasses.dataclass(frozen=True)
class LayerError:
    """One NVFP4 dot (one layer of a stacked site) and what its last step measured.

    Attributes:
      path: the site's path, as in :func:`jdls.fp8.telemetry` (``"params/Dense_0/fp8"``).
      layer: the index along the stack axis of a stacked site, ``None`` for one site.
      error: the weight gradient's relative L2 error (NaN when it was not measured).
      flushed: the largest fraction of values flushed to zero among the dot's tensors.
      saturated: the largest fraction of values clipped to 6.
      kept: whether the dot is already kept in high precision.
    """

    path: str
    layer: int | None
    error: float
    flushed: float
    saturated: float
    kept: bool

    @property
    def name(self) -> tuple[str, int | None]:
        """``(path, layer)``: what :func:`keep_high_precision` takes."""
        return (self.path, self.layer)


def _is_nvfp4_site(x: Any) -> bool:
    return isinstance(x, Site) and isinstance(getattr(x.kind, "recipe", None), NVFP4Scaling)


def _nvfp4_sites(tree: Any) -> dict[str, Any]:
    rows = telemetry(tree)
    sites = {}
    for path, site in jax.tree_util.tree_flatten_with_path(tree, is_leaf=_is_nvfp4_site)[0]:
        if _is_nvfp4_site(site):
            name = next(n for n in rows if _same_path(n, path))
            sites[name] = site
    return {name: (sites[name], rows[name]) for name in sites}


def _same_path(name: str, path: Any) -> bool:
    keys = [str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path]
    if keys and keys[-1] == "value":
        keys.pop()
    return name == "/".join(keys)


def rank_layers(tree: Any) -> list[LayerError]:
    """The NVFP4 dots of ``tree`` (model variables, an NNX state, an Equinox model), worst
    weight-gradient error first, from the last step's telemetry.

    Measure with ``jdls.fp8.nvfp4(measure_error=True)`` for one or a few steps (the error
    needs one more dot per backward pass), or the ranking falls back to the flushed fraction.

    Example:
      >>> import jax, jax.numpy as jnp, jdls
      >>> site = jdls.fp8.init(jdls.fp8.nvfp4(measure_error=True)).stacked(2)
      >>> [(r.layer, r.kept) for r in jdls.fp8.rank_layers({"mlp": site})]
      [(0, False), (1, False)]
    """
    ranked = []
    for path, (site, row) in _nvfp4_sites(tree).items():
        keep = np.asarray(jax.device_get(site.value.grad.keep))
        stacked = keep.ndim > 0
        n = keep.shape[0] if stacked else 1
        for i in range(n):

            def read(role: str, field: str, row: Any = row, i: int = i) -> float:
                v = row[role].get(field, float("nan"))
                return float(v[i] if isinstance(v, list) else v)

            ranked.append(
                LayerError(
                    path=path,
                    layer=i if stacked else None,
                    error=read("grad", "error"),
                    flushed=max(read(r, "flushed") for r in ("lhs", "rhs", "grad")),
                    saturated=max(read(r, "saturated") for r in ("lhs", "rhs", "grad")),
                    kept=bool(keep[i] if stacked else keep) > 0,
                )
            )

    def key(r: LayerError) -> tuple[float, float]:
        error = -1.0 if math.isnan(r.error) else r.error
        flushed = -1.0 if math.isnan(r.flushed) else r.flushed
        return (-error, -flushed)

    return sorted(ranked, key=key)


def suggest_high_precision(tree: Any, fraction: float = 0.15) -> list[tuple[str, int | None]]:
    """The ``fraction`` of NVFP4 dots with the largest weight-gradient error (at least one
    when ``tree`` holds any; none otherwise), as ``(path, layer)`` names for
    :func:`keep_high_precision`.

    Example:
      >>> import jdls
      >>> site = jdls.fp8.init(jdls.fp8.nvfp4(measure_error=True)).stacked(4)
      >>> len(jdls.fp8.suggest_high_precision({"mlp": site}, 0.5))
      2
    """
    if not (isinstance(fraction, (int, float)) and 0 < fraction <= 1):
        raise ValueError(f"fraction must be in (0, 1] (of the NVFP4 dots), got {fraction!r}")
    ranked = rank_layers(tree)
    return [r.name for r in ranked[: max(1, math.ceil(fraction * len(ranked)))]] if ranked else []


def _keep_state(state: NVFP4State, layers: list[int | None], keep: bool) -> NVFP4State:
    value = jnp.float32(1.0 if keep else 0.0)
    if layers == [None]:
        flags = jnp.broadcast_to(value, jnp.shape(state.keep))
    else:
        flags = state.keep.at[np.asarray(layers, np.int32)].set(value)
    return dataclasses.replace(state, keep=flags)


def _check_layers(path: str, site: Site, layers: list[int | None]) -> None:
    """Each ``layer`` an int inside the stack of ``site`` (``None``: every layer)."""
    stack = jnp.shape(site.value.grad.keep)
    for layer in layers:
        if layer is None:
            continue
        if not stack:
            raise ValueError(
                f"{path!r} is one NVFP4 site, not a stack of layers: name it without a layer "
                f"(the path alone, or ({path!r}, None)), got layer {layer!r}"
            )
        if isinstance(layer, bool) or not isinstance(layer, (int, np.integer)):
            raise ValueError(f"a layer must be an int index into {path!r}, got {layer!r}")
        if not -stack[0] <= layer < stack[0]:
            raise ValueError(
                f"layer {layer} is outside the stack of {stack[0]} layers at {path!r} "
                f"(indices 0 to {stack[0] - 1}, or -1 for the last)"
            )


def keep_high_precision(
    tree: Any, layers: Iterable[tuple[str, int | None] | str], keep: bool = True
) -> Any:
    """``tree`` with the named NVFP4 dots kept in high precision (the recipe's
    ``high_precision`` format), or returned to NVFP4 with ``keep=False``.

    Args:
      tree: anything holding NVFP4 sites (linen variables or their ``"jdls"`` collection, an
        NNX state, an Equinox model).
      layers: ``(path, layer)`` pairs (from :func:`suggest_high_precision` or
        :func:`rank_layers`), or a path alone for every layer of a site; ``layer`` indexes a
        stacked site (``-1``: the last layer).
      keep: ``True`` to keep in high precision, ``False`` for NVFP4.

    Raises:
      ValueError: a name matches no NVFP4 site of ``tree``.

    Example:
      >>> import jdls
      >>> sites = {"blocks": jdls.fp8.init(jdls.fp8.nvfp4()).stacked(4)}
      >>> sites = jdls.fp8.keep_high_precision(sites, [("blocks", -1)])
      >>> sites["blocks"].value.lhs.keep.tolist()
      [0.0, 0.0, 0.0, 1.0]
    """
    items: list[Any] = list(layers)
    if isinstance(layers, str) or (
        isinstance(layers, tuple) and len(layers) == 2 and isinstance(layers[0], str)
    ):
        items = [layers]  # one name, not a list of them
    wanted: dict[str, list[int | None]] = {}
    for item in items:
        path, layer = (item, None) if isinstance(item, str) else item
        wanted.setdefault(path, []).append(layer)
    found = _nvfp4_sites(tree)
    unknown = sorted(set(wanted) - set(found))
    if unknown:
        raise ValueError(
            f"no NVFP4 site at {unknown}; the NVFP4 sites of this tree are {sorted(found)} "
            "(names as jdls.fp8.telemetry and jdls.fp8.rank_layers give them)"
        )
    for path, chosen in wanted.items():
        _check_layers(path, found[path][0], chosen)
    by_id = {id(site): wanted[path] for path, (site, _) in found.items() if path in wanted}

    def set_keep(site: Any) -> Any:
        if not _is_nvfp4_site(site) or id(site) not in by_id:
            return site
        chosen = by_id[id(site)]
        if None in chosen:
            chosen = [None]
        value = site.value
        roles = {r: _keep_state(getattr(value, r), chosen, keep) for r in ("lhs", "rhs", "grad")}
        return type(site)(site.kind, dataclasses.replace(value, **roles))

    return jax.tree_util.tree_map(set_keep, tree, is_leaf=_is_nvfp4_site)
