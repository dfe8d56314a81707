"""Per-loss scales: several losses, each differentiated at its own scale, combined exactly.

``backward="one"`` (the default): ``fun`` is traced to a jaxpr, every value gets the set of
losses that depend on it (``loss_sets.py``), and one backward pass keeps each value's
cotangent at its set's scale: the region of the backward pass that only loss ``i`` reaches (its
head) runs at ``s_i``, a region shared by several losses at the smallest of their scales. Each
parameter's gradient is unscaled by its region's scale: the gradients equal ``jax.grad`` of the
weighted sum (bit for bit in float32 with power-of-two scales and weights), at about the cost
of one global scale's step. ``backward="per_loss"``: one forward pass (``jax.vjp``), one
backward pass per loss at its own scale, unscaled, weighted and summed in float32 (apex's
``num_losses`` / ``loss_id``): every parameter, shared ones included, gets each loss's share at
that loss's scale, for one backward pass per loss.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from jdls._numerics.axes import manual_axes, vary_over
from jdls._numerics.checks import all_finite, is_float
from jdls._numerics.norm import tree_amax
from jdls._scales.filter import Split, is_jax_type, split_arguments
from jdls._scales.grad import seed_scale, with_loss_scale
from jdls._scales.loss_adjust import keyed_items, rebuilt
from jdls._scales.loss_sets import EMPTY, Levels, all_sets, analyze, evaluate, var_set
from jdls._scales.scale import LossScale, check_scale
from jdls._sites.backward_scale import (
    ToldSite,
    sites_reading_loss_scale,
    tell_sites,
    untell_sites,
)
from jdls._sites.measured import measured as measured_sites
from jdls._sites.site import is_site

__all__ = ["multi_loss_value_and_grad"]

_BACKWARDS = ("one", "per_loss")
_F32 = jnp.float32


def _loss_order(losses: Any, keys: list[Any]) -> tuple[list[Any], list[int]]:
    """The keys of ``fun``'s losses, and for each the index of its scale."""
    loss_keys, _ = keyed_items(losses, "fun's losses")
    if len(loss_keys) != len(keys) or set(loss_keys) != set(keys):
        raise ValueError(
            f"fun must return one loss per scale, with the keys of scales {keys}; got {loss_keys}"
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


def multi_loss_value_and_grad(
    fun: Callable[..., Any],
    scales: Mapping[Any, LossScale] | Sequence[LossScale],
    weights: Mapping[Any, float] | Sequence[float] | None = None,
    argnums: int | Sequence[int] = 0,
    has_aux: bool = False,
    *,
    backward: str = "one",
    with_amax: bool = False,
) -> Callable[..., tuple[Any, ...]]:
    """Gradients of several losses, each scaled by its own scale, combined after unscaling.

    ``fun`` returns its losses as a dict, tuple or list shaped like ``scales`` (one scalar
    per loss). The gradients equal ``jax.grad`` of ``sum(weights[i] * loss[i])`` wherever
    nothing underflows or overflows; how each loss's scale is applied depends on ``backward``:

    * ``"one"`` (default): one forward and one backward pass. ``fun`` is traced to a jaxpr (as
      ``jax.jit`` traces it: no Python control flow on traced values) and each value's backward
      cotangent is kept at the scale of the losses that depend on it: where only loss ``i``
      reaches (its head, its own parameters) at ``scales[i]``, in a region shared by several
      losses (a common trunk) at the smallest of their scales, as with one global scale there.
      A parameter used by one loss only is unscaled by that loss's scale and multiplied by its
      weight in float32, exactly as with ``"per_loss"``; a shared one is unscaled by the
      smallest scale of its losses (the weights entered where the losses' cotangents met).
      Functions inside ``jax.jit`` are looked into; other higher-order primitives (``scan``,
      ``cond``, ``remat``, ``custom_jvp``...) are one region each. Exact: in float32 with
      power-of-two scales and weights, the gradients are ``jax.grad``'s bit for bit (eager;
      under ``jax.jit`` to float32 rounding, XLA fusing the two programs differently); other
      scales or weights round once more where they are applied.
    * ``"per_loss"``: one forward pass, one backward pass per loss: loss ``i``'s cotangent is
      ``scales[i]``, its gradients are unscaled by it, multiplied by ``weights[i]`` in float32
      and added to the others'. Every parameter, shared ones included, gets each loss's share
      at that loss's own scale, for one backward pass per loss (about 1.7x one global scale's
      step for two losses).

    As on the global path (:meth:`jdls.LossScale.value_and_grad`), a 16-bit loss is multiplied
    by at most its format's largest power of two (``2**15`` for float16), and a site among the
    differentiated arguments (a :class:`jdls.Probe`, FP8 state) gets its measurement coded as
    that path returns it, never unscaled, weighted or summed like a gradient: with ``"one"``
    the one backward pass's, with ``"per_loss"`` that of one more backward pass of the
    weighted sum of the losses, each at its own scale. An FP8 dot's site is told the scale of
    its cotangent with ``"one"`` (its region's; over the loss's weight in one loss's head), so
    that it records the amax of the weighted sum's gradient unscaled; ``"per_loss"`` refuses
    an FP8 site (a ``ValueError`` naming ``"one"``): its one forward pass serves backward
    passes at several scales, and no pass could tell the dot its scale.

    Args:
      fun: the loss function; returns the losses (``{"a": la, "b": lb}`` or ``(la, lb)``),
        or ``(losses, aux)`` with ``has_aux``.
      scales: one jdls loss scale per loss, in the same container (dict keys or positions).
      weights: one float per loss (default 1 each). Applied in float32 to the unscaled
        gradients of the parameters used by that loss alone (all of them with ``"per_loss"``),
        so that a tiny weight does not enter the compute format there; with ``"one"`` it
        multiplies the loss's cotangent where it enters a region shared with other losses.
      argnums: positional argument(s) to differentiate, as in ``jax.value_and_grad``.
      has_aux: whether ``fun`` returns ``(losses, aux)``.
      backward: ``"one"`` or ``"per_loss"``, see above.
      with_amax: also return, per loss, the largest magnitude of its unscaled gradients (the
        measurement an observing rule such as :func:`jdls.AdaptiveScale` needs; give both to
        :func:`jdls.adjust_loss_scales`).

    Returns:
      A function of ``fun``'s arguments returning ``(losses, grads, finite)`` (or
      ``((losses, aux), grads, finite)``; with ``with_amax`` a fourth entry, ``grad_amax``):
      the losses as ``fun`` computed them, the combined unscaled gradients, and per loss a
      boolean scalar, whether that loss's gradients were finite (adjust the scales with it:
      ``jdls.adjust_loss_scales(scales, finite, grad_amax)``; under ``shard_map`` combine it
      over the devices first, ``jax.lax.pmin``, and ``grad_amax`` with ``jax.lax.pmax``, see
      ``docs/per-layer.md``). With ``"per_loss"``, loss ``i``'s flag and ``grad_amax`` are
      those of its own unscaled gradients (before its weight). With ``"one"``, loss ``i`` is
      non-finite when a region of the backward pass running at its scale made a non-finite
      value: its own region (measured where its cotangent leaves it), or a shared region whose
      smallest scale is its own (of several losses with that scale, those whose cotangents
      entered it largest). A non-finite cotangent leaving a region flags that region's losses
      and is replaced by zeros where it enters the next region, so that the next region's own
      overflows, and only they, flag its losses (an overflow in the small loss's head flags
      the small loss only, as ``"per_loss"`` does); the gradients that cotangent reaches (the
      parameters of every region it would have entered) come back NaN, so that the step is
      skipped as with ``"per_loss"``. Its ``grad_amax`` is the largest unscaled value computed
      at its scale: the gradients of its own parameters (before its weight), the cotangents
      leaving its own region (with several exits, their sum bounds it), and the combined
      gradients of the shared regions whose smallest scale is its own (of several losses
      with that scale, the one whose cotangent entered largest: tied scales part).

    Example:
      >>> import jax.numpy as jnp, jdls
      >>> def losses(p):
      ...     return {"big": jnp.sum(p["a"] ** 2), "small": 1e-4 * jnp.sum(p["b"] * p["a"])}
      >>> scales = {"big": jdls.StaticScale(8.0), "small": jdls.StaticScale(2.0**20)}
      >>> fn = jdls.multi_loss_value_and_grad(losses, scales)  # one backward pass
      >>> values, grads, finite = fn({"a": jnp.ones(2), "b": jnp.ones(2)})
      >>> [round(g, 4) for g in grads["a"].tolist()], [round(g, 6) for g in grads["b"].tolist()]
      ([2.0001, 2.0001], [0.0001, 0.0001])
      >>> bool(finite["big"]), bool(finite["small"])
      (True, True)
      >>> _, per_loss, _ = jdls.multi_loss_value_and_grad(losses, scales, backward="per_loss")(
      ...     {"a": jnp.ones(2), "b": jnp.ones(2)})
      >>> bool(jnp.all(per_loss["a"] == grads["a"]))
      True
    """
    if not isinstance(with_amax, bool):
        raise TypeError(f"with_amax must be True or False, got {with_amax!r}")
    if backward not in _BACKWARDS:
        raise ValueError(
            f"backward must be 'one' (one backward pass, each loss's own region at its scale) "
            f"or 'per_loss' (one backward pass per loss), got {backward!r}"
        )
    keys, scale_list = keyed_items(scales, "scales")
    if not keys:
        raise ValueError("scales must hold one loss scale per loss, got none")
    for key, scale in zip(keys, scale_list, strict=True):
        check_scale(scale, f"scales[{key!r}]")
    weight_list: list[Any]
    if weights is None:
        weight_list = [None] * len(keys)
    else:
        weight_keys, weight_list = keyed_items(weights, "weights")
        if isinstance(weights, Mapping) and set(weight_keys) == set(keys):
            weight_list = [weights[k] for k in keys]
        elif weight_keys != keys:
            raise ValueError(
                f"weights must have the keys of scales, {keys}, got {weight_keys}: pass one "
                "weight per loss, or None"
            )
    nums = (argnums,) if isinstance(argnums, int) else tuple(argnums)
    run = _one_pass if backward == "one" else _per_loss

    def value_and_grad_fn(*args: Any, **kwargs: Any) -> tuple[Any, ...]:
        def forward(*diff: Any) -> Any:
            full = list(args)
            for n, value in zip(nums, diff, strict=True):
                full[n] = value
            return fun(*full, **kwargs)

        primals = [args[n] for n in nums]
        # non-array leaves (an Equinox model): held fixed, None gradients; the sites kept
        # whole, so that their cotangents are known as measurements and an FP8 dot is told
        # its region's scale
        split = split_arguments(primals, nums, "multi_loss_value_and_grad", is_jax_type, is_site)
        if split is not None:
            forward, primals = _combined(forward, split), list(split.diff)
        losses, aux, total, finite, measured = run(
            forward, primals, keys, scale_list, weight_list, has_aux, with_amax
        )
        total = measured_sites(total)  # as the global path returns a site's measurement
        grads = total[0] if isinstance(argnums, int) else tuple(total)
        value = (losses, aux) if has_aux else losses
        if with_amax:
            return value, grads, rebuilt(scales, finite), rebuilt(scales, measured)
        return value, grads, rebuilt(scales, finite)

    return value_and_grad_fn


def _combined(forward: Callable[..., Any], split: Split) -> Callable[..., Any]:
    return lambda *diffs: forward(*split.combine(diffs))


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
        losses = out[0] if has_aux else out
        loss_keys, found = _loss_order(losses, keys)
        order[:] = found
        return [losses[k] for k in loss_keys]

    closed = jax.make_jaxpr(traced)(*flat)
    scope = analyze(closed, [True] * len(flat), [frozenset({i}) for i in order])
    return [var_set(scope, v) for v in closed.jaxpr.invars]


def _per_loss(
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
        losses, vjp_fn, aux = jax.vjp(forward, *primals, has_aux=True)
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


def _one_pass(
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
        losses, aux = out if has_aux else (out, None)
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
