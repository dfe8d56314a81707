"""The two backward passes of per-loss scales (``multi_loss.py``), and what they share.

``one_pass`` (``backward="one"``): ``fun`` traced to a jaxpr, every value given the set of
losses that depend on it (``loss_sets.py``), one backward pass keeping each value's cotangent at
its set's scale. ``per_loss`` (``backward="per_loss"``): one forward pass, one backward pass per
loss at its own scale, unscaled, weighted and summed in float32. Both return the losses, the
aux, the combined gradients (a site's measurement in its place, never unscaled, weighted or
summed), and per loss its finite flag and largest unscaled magnitude.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp

from jdls._numerics.axes import manual_axes, vary_over
from jdls._numerics.checks import all_finite, is_float
from jdls._numerics.norm import tree_amax
from jdls._scales.grad import seed_scale, with_loss_scale
from jdls._scales.loss_adjust import keyed_items, rebuilt
from jdls._scales.loss_sets import EMPTY, Levels, all_sets, analyze, evaluate, var_set
from jdls._scales.scale import LossScale
from jdls._sites.backward_scale import (
    ToldSite,
    sites_reading_loss_scale,
    tell_sites,
    untell_sites,
)
from jdls._sites.site import is_site

__all__ = ["one_pass", "per_loss"]

_F32 = jnp.float32


def _split_aux(out: Any, has_aux: bool) -> tuple[Any, Any]:
    """``fun``'s output as ``(losses, aux)``, checked against ``has_aux``."""
    if not has_aux:
        return out, None
    if not (isinstance(out, tuple | list) and len(out) == 2):
        raise TypeError(
            f"with has_aux=True, fun must return (losses, aux), got a {type(out).__name__}: "
            "return the losses and the aux as a pair, or pass has_aux=False"
        )
    return out[0], out[1]


def _loss_order(losses: Any, keys: list[Any]) -> tuple[list[Any], list[int]]:
    """The keys of ``fun``'s losses, and for each the index of its scale; each a scalar."""
    if not isinstance(losses, Mapping | tuple | list):
        raise TypeError(
            "fun's losses must be a dict, tuple or list (one entry per loss), got "
            f"{'an array' if hasattr(losses, 'shape') else type(losses).__name__}: with "
            "has_aux=True, fun returns (losses, aux)"
        )
    loss_keys, values = keyed_items(losses, "fun's losses")
    if len(loss_keys) != len(keys) or set(loss_keys) != set(keys):
        raise ValueError(
            f"fun must return one loss per scale, with the keys of scales {keys}; got "
            f"{loss_keys} (a fun that also returns an aux, (losses, aux), needs has_aux=True)"
        )
    for key, value in zip(loss_keys, values, strict=True):
        if jnp.shape(value) != ():
            raise TypeError(
                f"each loss must be a scalar, as jax.grad's; loss {key!r} has shape "
                f"{jnp.shape(value)}: reduce it (jnp.mean or jnp.sum) before returning it"
            )
    return loss_keys, [keys.index(k) for k in loss_keys]


def _site_leaves(tree: Any) -> list[bool]:
    """Per leaf of ``tree`` (flattened), whether it belongs to a site's value: its cotangent
    is the site's measurement, never a gradient."""
    out: list[bool] = []
    for x in jax.tree_util.tree_leaves(tree, is_leaf=is_site):
        out.extend([True] * len(jax.tree_util.tree_leaves(x)) if is_site(x) else [False])
    return out


def _factor_leaves(tree: Any) -> list[bool]:
    """Per leaf of ``tree`` (flattened), whether it is the factor of a told site
    (``jdls/_sites/backward_scale.py``)."""
    out: list[bool] = []
    for x in jax.tree_util.tree_leaves(tree, is_leaf=is_site):
        if isinstance(x, ToldSite):
            out.extend([False] * len(jax.tree_util.tree_leaves(x.value)))
            out.extend([True] * len(jax.tree_util.tree_leaves(x.factor)))
        elif is_site(x):
            out.extend([False] * len(jax.tree_util.tree_leaves(x)))
        else:
            out.append(False)
    return out


def _unit(levels: Levels, weights: list[Any], s: frozenset[int]) -> jax.Array:
    """What the cotangent of a region of loss set ``s`` is scaled by, against the gradient of
    the weighted sum of the losses: the set's level; in one loss's own region, whose
    cotangent is that loss's gradient without its weight, the level over the weight."""
    if not s:
        return jnp.ones((), _F32)
    level = levels.level(s)
    if len(s) == 1 and weights[next(iter(s))] is not None:
        w = weights[next(iter(s))]
        level = jnp.where(w != 0, level / jnp.where(w != 0, w, 1.0), level)
    return level


def _seeded(scale: LossScale, loss: Any) -> LossScale:
    """``scale`` as the global path applies it to ``loss`` (``jdls/_scales/grad.py``): a
    16-bit loss is multiplied by at most its format's largest power of two."""
    seed = seed_scale(scale.loss_scale, loss)
    return scale if seed is None else with_loss_scale(scale, seed)


def _unscale(g: Any, level: jax.Array) -> Any:
    """``g / level``, narrower floats promoted to float32 (as ``LossScale.unscale``)."""
    if not is_float(g):
        return g
    dtype = jnp.promote_types(g.dtype, _F32)
    return g.astype(dtype) / level.astype(dtype)


def _weighted(grads: Any, weight: Any) -> Any:
    """``grads`` times ``weight`` (in their dtype); an integer argument's ``float0`` gradient
    stays as it is."""
    if weight is None:
        return grads
    return jax.tree_util.tree_map(
        lambda g: g * jnp.asarray(weight, g.dtype) if is_float(g) else g, grads
    )


def _add(a: Any, b: Any) -> Any:
    """``a + b``; an integer argument's ``float0`` gradient and a site's place (None) stay
    as they are."""
    return a + b if a is not None and is_float(a) else a


def _dependence(
    forward: Callable[..., Any], primals: list[Any], keys: list[Any], has_aux: bool
) -> list[frozenset[int]]:
    """Per leaf of ``primals`` (flattened), the losses (indices into ``keys``) depending on it."""
    flat, in_tree = jax.tree_util.tree_flatten(primals)
    order: list[int] = []

    def traced(*leaves: Any) -> list[Any]:
        out = forward(*jax.tree_util.tree_unflatten(in_tree, leaves))
        losses, _ = _split_aux(out, has_aux)
        loss_keys, found = _loss_order(losses, keys)
        order[:] = found
        return [losses[k] for k in loss_keys]

    closed = jax.make_jaxpr(traced)(*flat)
    scope = analyze(closed, [True] * len(flat), [frozenset({i}) for i in order])
    return [var_set(scope, v) for v in closed.jaxpr.invars]


def per_loss(
    forward: Callable[..., Any],
    primals: list[Any],
    keys: list[Any],
    scale_list: list[LossScale],
    weight_list: list[Any],
    has_aux: bool,
    measure: bool,
) -> tuple[Any, Any, list[Any], list[jax.Array], list[Any]]:
    """One forward pass, one backward pass per loss, summed after unscaling."""
    _refuse_told_sites(primals)
    if has_aux:
        checked = lambda *p: _split_aux(forward(*p), True)  # noqa: E731
        losses, vjp_fn, aux = jax.vjp(checked, *primals, has_aux=True)
    else:
        (losses, vjp_fn), aux = jax.vjp(forward, *primals), None
    loss_keys, _ = _loss_order(losses, keys)
    depends = _dependence(forward, primals, keys, has_aux)
    sites = _site_leaves(primals)
    seeded = [_seeded(scale, losses[k]) for scale, k in zip(scale_list, keys, strict=True)]

    def seeds(i: int | None) -> Any:
        """The losses' cotangents: loss ``i``'s scale, zeros for the others; with ``i``
        None, every loss's scale times its weight (the weighted sum of the losses)."""
        out = []
        for k in loss_keys:
            j = keys.index(k)
            if i is None or j == i:
                one = seeded[j].scale(jnp.ones_like(losses[k]))
                out.append(_weighted(one, weight_list[j]) if i is None else one)
            else:
                out.append(jnp.zeros_like(losses[k]))
        return rebuilt(losses, out)

    total: list[Any] = []
    tree: Any = None
    finite: list[jax.Array] = []
    amaxes: list[Any] = []
    for i, scale in enumerate(seeded):
        leaves, tree = jax.tree_util.tree_flatten(vjp_fn(seeds(i)))
        grads: list[Any] = []
        own: list[Any] = []
        for g, on, site in zip(leaves, depends, sites, strict=True):
            if site:  # a measurement: from the pass below, never unscaled, weighted or summed
                grads.append(None)
                continue
            if is_float(g):
                # A leaf loss ``i`` does not depend on gets zeros, as jax.grad's symbolic zero:
                # not the zero cotangent times another loss's values (0 * inf is NaN).
                g = _unscale(g, scale.loss_scale) if i in on else _zeros(g)
            if i in on:
                own.append(g)
            grads.append(_weighted(g, weight_list[i]))
        finite.append(all_finite(own))
        amaxes.append(tree_amax(own) if measure else None)
        total = grads if not total else [_add(a, b) for a, b in zip(total, grads, strict=True)]
    if any(sites):
        # The sites measure one backward pass of the weighted sum of the losses, each at its
        # own scale: where the scales are equal, what one global scale measures.
        measurements = jax.tree_util.tree_leaves(vjp_fn(seeds(None)))
        total = [m if site else g for g, m, site in zip(total, measurements, sites, strict=True)]
    return losses, aux, jax.tree_util.tree_unflatten(tree, total), finite, amaxes


def _refuse_told_sites(primals: list[Any]) -> None:
    """``backward="per_loss"`` cannot measure a site that reads the loss scale (an FP8 dot's
    output gradient): its one forward pass fixes what each dot is told, while each loss's
    backward pass runs at its own scale, so no pass could unscale what the dot records."""
    told = sites_reading_loss_scale(primals)
    if told:
        sites = f"{len(told)} such site{'s' if len(told) > 1 else ''}, a stack counted once"
        raise ValueError(
            f"multi_loss_value_and_grad(backward='per_loss') cannot measure the "
            f"{type(told[0].kind).__name__} site among the differentiated arguments ({sites}): "
            "an FP8 dot records its output gradient unscaled, but one forward pass "
            "serves every loss's backward pass, each at its own scale, so no pass can tell the "
            "dot its scale. Use backward='one' (the default: each dot is told its region's "
            "scale and records the weighted sum's gradient unscaled), or one loss scale on the "
            "weighted sum of the losses (scale.value_and_grad)"
        )


def _zeros(g: jax.Array) -> jax.Array:
    """The unscaled zeros of a float leaf (narrower floats promoted to float32)."""
    return jnp.zeros(jnp.shape(g), jnp.promote_types(g.dtype, _F32))


def one_pass(
    forward: Callable[..., Any],
    primals: list[Any],
    keys: list[Any],
    scale_list: list[LossScale],
    weight_list: list[Any],
    has_aux: bool,
    measure: bool,
) -> tuple[Any, Any, list[Any], list[jax.Array], list[Any]]:
    """One backward pass, each value's cotangent at the scale of the losses depending on it."""
    # The sites that read the loss scale (FP8 dots) are told their region's scale: traced with
    # a factor of 1 each, given their region's once the regions are known (below).
    primals = tell_sites(primals, lambda path, site: jnp.ones((), _F32))
    flat, in_tree = jax.tree_util.tree_flatten(primals)
    found: dict[str, Any] = {}

    def traced(*leaves: Any) -> list[Any]:
        out = forward(*jax.tree_util.tree_unflatten(in_tree, leaves))
        losses, aux = _split_aux(out, has_aux)
        loss_keys, order = _loss_order(losses, keys)
        aux_leaves, aux_tree = jax.tree_util.tree_flatten(aux)
        is_traced = [isinstance(a, jax.core.Tracer) for a in aux_leaves]
        found.update(
            losses=losses, order=order, aux_leaves=aux_leaves, aux_tree=aux_tree, traced=is_traced
        )
        return [losses[k] for k in loss_keys] + [
            a for a, t in zip(aux_leaves, is_traced, strict=True) if t
        ]

    closed = jax.make_jaxpr(traced)(*flat)
    order: list[int] = found["order"]
    n = len(order)
    live = [is_float(x) for x in flat]
    sites = _site_leaves(primals)
    out_sets = [frozenset({i}) for i in order] + [EMPTY] * (len(closed.out_avals) - n)
    scope = analyze(closed, live, out_sets, sites)
    weights = [None if w is None else jnp.asarray(w, _F32) for w in weight_list]
    loss_avals = {i: aval for i, aval in zip(order, closed.out_avals[:n], strict=True)}
    seeded = [_seeded(s, loss_avals[i]) for i, s in enumerate(scale_list)]
    levels = Levels([s.loss_scale for s in seeded], weights)
    sets = all_sets(scope)
    levels.index = {s: k for k, s in enumerate(sets)}

    def interpreted(*args: Any) -> tuple[list[Any], list[Any]]:
        *leaves, bad, entered, size, exits = args
        levels.sinks = (bad, entered, size, exits)
        outs = evaluate(scope, levels, closed.consts, leaves)
        return outs[:n], outs[n:]

    # a told site's cotangent runs at the level of the region of the equation reading it
    # (the set of its factor: the equations it feeds), measured against the weighted sum
    flat = [
        jnp.broadcast_to(_unit(levels, weights, var_set(scope, v)), jnp.shape(x)) if told else x
        for x, v, told in zip(flat, closed.jaxpr.invars, _factor_leaves(primals), strict=True)
    ]
    sinks = [jnp.zeros((len(sets),), _F32)] * 2 + [jnp.zeros((len(keys),), _F32)] * 2
    manual = manual_axes()
    if manual:  # inside shard_map: each device blames its own overflows
        sinks = [vary_over(x, manual) for x in sinks]
    loss_values, vjp_fn, traced_aux = jax.vjp(interpreted, *flat, *sinks, has_aux=True)
    outvars = closed.jaxpr.outvars
    seeds = [
        jnp.ones_like(v) * levels.seed(var_set(scope, ov), i).astype(jnp.result_type(v))
        for v, ov, i in zip(loss_values, outvars[:n], order, strict=True)
    ]
    *cotangents, bad, entered, size, exits = vjp_fn(seeds)

    grads: list[Any] = []
    by_set: dict[frozenset[int], list[Any]] = {}
    for g, v, site in zip(cotangents, closed.jaxpr.invars, sites, strict=True):
        s = var_set(scope, v)
        if site:  # a measurement: never unscaled, weighted or summed like a gradient
            grads.append(g)
            continue
        if not s:
            grads.append(
                jnp.zeros(jnp.shape(g), jnp.promote_types(g.dtype, _F32)) if is_float(g) else g
            )
            continue
        g = _unscale(g, levels.level(s))
        by_set.setdefault(s, []).append(g)
        grads.append((g, s))
    # A region is non-finite where a boundary out of it saw a non-finite cotangent, or where
    # the gradients of its parameters are; each such region blames its culprits. A non-finite
    # cotangent does not enter the next region (it is replaced by zeros there), so that
    # region's overflows are its own; the gradients it would have reached are poisoned below.
    blamed = jnp.zeros((len(keys),), _F32)
    measured = exits  # per loss, the largest unscaled cotangent out of its own region
    for s in sets:
        nonfinite = bad[levels.index[s]] > 0
        if s in by_set:
            nonfinite = nonfinite | ~all_finite(by_set[s])
            if measure:  # measured by those it would blame: of tied scales, the largest's
                culprits = levels.culprits(s, size)
                a = tree_amax(by_set[s])
                top = jnp.where((culprits > 0) & jnp.isfinite(a), a, 0.0)
                measured = jnp.maximum(measured, top)
        blamed = blamed + nonfinite.astype(_F32) * levels.culprits(s, size)
    finite = [blamed[i] == 0 for i in range(len(keys))]
    # a non-finite measurement where the loss is flagged (as jdls.wrap measures an overflow)
    measured = jnp.where(blamed > 0, jnp.inf, measured)
    # the regions a non-finite cotangent entered (sets of several losses), by parameter set
    entries = {
        s: [entered[levels.index[r]] > 0 for r in sets if len(r) > 1 and r <= s] for s in by_set
    }
    out: list[Any] = []
    for g in grads:
        if not isinstance(g, tuple):
            out.append(g)
            continue
        g, s = g
        if entries[s]:
            reached = functools.reduce(jnp.logical_or, entries[s])
            g = jnp.where(reached, g + jnp.asarray(jnp.nan, g.dtype), g)
        out.append(_weighted(g, weight_list[next(iter(s))]) if len(s) == 1 else g)
    grads = out

    aux_iter = iter(traced_aux)
    aux_leaves = [
        next(aux_iter) if t else a
        for a, t in zip(found["aux_leaves"], found["traced"], strict=True)
    ]
    aux = jax.tree_util.tree_unflatten(found["aux_tree"], aux_leaves)
    losses = rebuilt(found["losses"], list(loss_values))
    total = untell_sites(jax.tree_util.tree_unflatten(in_tree, grads))
    return losses, aux if has_aux else None, total, finite, [measured[i] for i in range(len(keys))]
