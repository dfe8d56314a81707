"""Per-layer scales: each layer's backward pass computes at its own scale.

A layer's scale is a site of kind :class:`LayerScale` at its output
(``jdls/_scales/layer_site.py``). :func:`layer_scaled_value_and_grad`
sets the ratios from the scales (in the layers' forward order, the kinds' ``position`` and the
index along a stack), scales the loss by the last layer's scale and unscales each layer's
parameter gradients by its own scale: the cotangent inside layer ``k`` is ``s[k]`` times the
true one, exactly (powers of two). The measurement it returns for each site is the largest
magnitude and the finiteness of that layer's gradients, and :func:`jdls.update_sites` adjusts
each scale from it (``jdls.rules.Adaptive`` per layer), none growing on a skipped step.

Everything is data: the scales go in as the sites' values (stacked along the scan axis for a
scanned stack) and the measurements come out as their gradients, so ``lax.scan``,
``jax.checkpoint``, inner ``jax.jit``, ``lax.cond`` and ``vmap`` compose.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, cast

import jax
import jax.numpy as jnp

from jdls._numerics.handoff import remember_largest
from jdls._numerics.paths import path_key
from jdls._numerics.scalars import pick
from jdls._scales.filter import filtered_value_and_grad
from jdls._scales.grad import seed_cap, seed_scale
from jdls._scales.layer_site import LayerScale, layer_sites
from jdls._sites.backward_scale import (
    backward_scale,
    set_seed_cap,
    tell_sites,
    untell_sites,
)
from jdls._sites.measured import measured as measured_sites
from jdls._sites.site import Site, is_site, refuse_halved

__all__ = ["layer_scaled_value_and_grad", "scale_layers"]

_F32 = jnp.float32
Path = tuple[Any, ...]


def _link(sites: list[tuple[Path, Site]]) -> tuple[list[Site], jax.Array]:
    """The sites with their ratios set from their scales (forward order: position, then
    index along the stack) and the last layer's scale, by which the loss is scaled."""
    kinds = [cast(LayerScale, site.kind) for _, site in sites]
    order = sorted(range(len(sites)), key=lambda i: kinds[i].position)
    positions = [kinds[i].position for i in order]
    if len(set(positions)) != len(positions):
        raise ValueError(
            f"two per-layer sites have the same position {positions}: give each layer (or "
            "stack of layers) its own place in the forward order, jdls.layer_site(scale, k)"
        )
    levels = [jnp.reshape(sites[i][1].value["scale"].loss_scale, (-1,)).astype(_F32) for i in order]
    flat = jnp.concatenate(levels)
    nxt = jnp.concatenate([flat[1:], flat[-1:]])
    ratios = flat / nxt
    out: list[Site] = [s for _, s in sites]
    start = 0
    for i, level in zip(order, levels, strict=True):
        site = sites[i][1]
        shape = jnp.shape(site.value["ratio"])
        ratio = ratios[start : start + level.size].reshape(shape)
        start += level.size
        out[i] = Site(site.kind, {**site.value, "ratio": ratio})
    return out, flat[-1]


def _of_layer(path: Path, layers: Sequence[Path]) -> int | None:
    best, size = None, -1
    for i, layer in enumerate(layers):
        if len(layer) > size and tuple(path[: len(layer)]) == tuple(layer):
            best, size = i, len(layer)
    return best


def _unscale(g: jax.Array, level: jax.Array) -> jax.Array:
    dtype = jnp.promote_types(g.dtype, _F32)
    level = level.reshape(level.shape + (1,) * (g.ndim - level.ndim))
    return g.astype(dtype) / level.astype(dtype)


def _layer_measure(grads: list[jax.Array], stack: tuple[int, ...]) -> tuple[jax.Array, jax.Array]:
    """The largest magnitude and the finiteness of a layer's gradients, per stacked layer.

    Per leaf, over its axes past the stack's, ``max(abs(g))`` and the sum of squares: the two
    reductions XLA fuses with their reads (no copy of a gradient, whatever its layout or
    sharding). The layer is finite exactly where its largest magnitude is below inf and its
    sum of squares is not NaN: an inf reaches the maximum, a NaN the sum (XLA's CPU maximum
    may drop a NaN; a sum keeps it; finite values make no NaN in either). A non-finite
    layer's largest magnitude reads inf."""
    grads = [g for g in grads if g.size]
    if not grads:
        return jnp.zeros(stack, _F32), jnp.ones(stack, _F32)
    amaxes, sums = [], []
    for g in grads:
        g = g.astype(_F32)
        axes = tuple(range(len(stack), g.ndim))
        amaxes.append(jnp.max(jnp.abs(g), axis=axes))
        sums.append(jnp.sum(g * g, axis=axes))
    amax = amaxes[0] if len(amaxes) == 1 else jnp.max(jnp.stack(amaxes), axis=0)
    total = sums[0] if len(sums) == 1 else jnp.sum(jnp.stack(sums), axis=0)
    finite = (amax < jnp.inf) & ~jnp.isnan(total)
    return pick(finite, amax, jnp.inf), finite.astype(_F32)


def scale_layers(
    fun: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    argnums: tuple[int, ...],
    layer_of: Callable[[Path], Path],
    param_path: Callable[[Path], Path],
    has_aux: bool,
    who: str,
) -> tuple[Any, tuple[Any, ...]]:
    """The per-layer differentiation shared by the hand-written and the framework faces:
    ``(value, grads)`` of ``fun`` for the arguments ``argnums``, each layer's gradients
    unscaled by its scale and its sites' gradients the layer's measurement. ``layer_of``
    maps a site's path (argument index first) to its layer's path, ``param_path`` a
    parameter's path to the same space."""
    diff = tuple(args[n] for n in argnums)
    refuse_halved(diff, who)
    sites = layer_sites(diff)
    if not sites:
        raise ValueError(
            f"{who} found no per-layer site (jdls.layer_site) in the differentiated "
            "arguments: pass the sites in (the second argument by hand, the model's sites in "
            "a framework) and each layer's output through jdls.apply_site"
        )
    linked, last = _link(sites)
    by_path = {path: site for (path, _), site in zip(sites, linked, strict=True)}
    layers = [layer_of(path) for path, _ in sites]

    def put(tree: Any, prefix: Path) -> Any:
        def one(path: Any, x: Any) -> Any:
            key = prefix + tuple(path_key(k) for k in path)
            return by_path.get(key, x)

        return jax.tree_util.tree_map_with_path(one, tree, is_leaf=is_site)

    last_scale = jax.lax.stop_gradient(last)
    own_levels = [jnp.asarray(site.value["scale"].loss_scale, _F32) for site in linked]
    unplaced: list[str] = []

    def factor_of(path: Path, site: Site) -> Any:
        """A site that reads the loss scale (an FP8 dot) is told its layer's scale over the
        loss's: its cotangent carries its layer's scale (jdls/_sites/backward_scale.py)."""
        del site
        layer = _of_layer(param_path(path), layers)
        if layer is None:
            layer = _of_layer(layer_of(path), layers)
        if layer is None:
            unplaced.append("/".join(map(str, path[1:])))
            return None
        return own_levels[layer] / last_scale

    def factor_in(i: int) -> Callable[[Path, Site], Any]:
        return lambda path, site: factor_of((i, *path), site)

    prepared = list(args)
    for i, n in enumerate(argnums):
        prepared[n] = tell_sites(put(args[n], (i,)), factor_in(i))
    if unplaced:
        raise ValueError(
            f"{who}: these FP8 sites are in no layer with a per-layer site: {unplaced}. The "
            "scale of an FP8 dot's output gradient is its layer's: keep each dot's site under "
            "its layer (by hand: in the layer's parameters, params[layer]), or give the "
            "module holding it a per-layer site"
        )

    def scaled(*a: Any, **kw: Any) -> Any:
        out = fun(*a, **kw)
        loss, aux = out if has_aux else (out, None)
        # what the global path multiplies a loss by (a 16-bit loss: at most its format's
        # largest power of two, so that the backward pass starts finite)
        seed = seed_scale(last_scale, loss)
        level = last_scale if seed is None else seed
        set_seed_cap(seed_cap(loss))  # the told sites' backward pass starts at ``seed``
        wide = jnp.asarray(loss).astype(jnp.promote_types(jnp.result_type(loss), _F32))
        return (wide * level).astype(jnp.result_type(loss)), (loss, aux, seed)

    # the loss's scale for the sites that read it (told their layer's factor above)
    with backward_scale(last_scale, (prepared, kwargs)):
        (_, (loss, aux, seed)), grads = filtered_value_and_grad(scaled, argnums, True, who)(
            *prepared, **kwargs
        )
    grads = untell_sites(grads)
    levels = own_levels
    if seed is not None:  # every layer computed at its scale times seed / last (ratios kept)
        levels = [level * (seed / last_scale) for level in levels]
    members: list[list[jax.Array]] = [[] for _ in linked]
    in_order: list[jax.Array] = []  # every unscaled gradient, in the tree's order
    outside: list[str] = []

    def unscale(path: Any, g: Any) -> Any:
        if g is None or is_site(g):
            return g
        key = tuple(path_key(k) for k in path)
        layer = _of_layer(param_path(key), layers)
        if layer is None:
            outside.append("/".join(map(str, key[1:])))
            return g
        u = _unscale(g, levels[layer])
        members[layer].append(u)
        in_order.append(u)
        return u

    grads = jax.tree_util.tree_map_with_path(unscale, tuple(grads), is_leaf=is_site)
    if outside:
        raise ValueError(
            f"{who}: these parameters are in no layer with a per-layer site: {outside}. Every "
            "parameter belongs to the layer whose site is next to it (by hand: the site's "
            "key in the sites is the layer's key in the parameters); give their layer a site"
        )
    measured, largest = {}, []
    for layer, (path, site) in enumerate(sites):
        stack = site.kind.stack_shape(site.value)
        amax, finite = _layer_measure(members[layer], stack)
        largest.append(jnp.ravel(amax))
        measured[path] = Site(
            site.kind,
            {"scale": None, "ratio": jnp.zeros(stack, _F32), "amax": amax, "finite": finite},
        )
    every = jnp.concatenate(largest)
    if every.size:
        # the largest gradient of all (inf where a layer is not finite), for the wrap that
        # receives these very gradients: it then needs no reduction of its own for it
        remember_largest(in_order, jnp.max(every))

    def measure(path: Any, g: Any) -> Any:
        if not is_site(g):
            return g
        return measured.get(tuple(path_key(k) for k in path), g)

    grads = jax.tree_util.tree_map_with_path(measure, grads, is_leaf=is_site)
    return ((loss, aux) if has_aux else loss), measured_sites(grads)


def layer_scaled_value_and_grad(
    fun: Callable[..., Any], has_aux: bool = False
) -> Callable[..., tuple[Any, tuple[Any, Any]]]:
    """``jax.value_and_grad`` of ``fun(params, sites, *args)`` with one scale per layer.

    ``sites`` holds a :func:`layer_site` per layer, keyed like ``params`` (``sites["dense_0"]``
    for ``params["dense_0"]``; a stacked site for a stack of layers whose parameters have the
    same leading axes). ``fun`` passes each layer's output through its site with
    :func:`jdls.apply_site`, in a chain (layer ``k``'s output is the next layer's input). The
    loss is scaled by the last layer's scale; each site multiplies the backward cotangent by
    ``s[k] / s[k+1]``; the gradients of ``params[k]`` are unscaled by ``s[k]``. Exact (equal
    to float32 gradients) where no value underflows or overflows, provided each layer's
    parameters are used only between its input and its site. Other sites in ``sites`` (probes)
    measure as usual. A 16-bit loss is multiplied by at most its format's largest power of two
    (``2**15`` for float16), as :meth:`jdls.LossScale.value_and_grad` does: every layer then
    computes at its scale times that over the last layer's scale. An FP8 site in a layer's
    parameters (``params["dense_0"]["fp8"]``) is told that layer's scale, so that it
    measures its output gradient unscaled; a differentiated FP8 site in no layer is refused.

    Args:
      fun: the loss ``fun(params, sites, *args)``; returns a scalar, or ``(loss, aux)``.
      has_aux: whether ``fun`` returns ``(loss, aux)``.

    Returns:
      A function of ``fun``'s arguments returning ``(value, (grads, measurements))``: the
      loss (or ``(loss, aux)``), the unscaled gradients of ``params``, and the measurements
      of ``sites`` (for :func:`jdls.update_sites`).

    Example:
      >>> import jax.numpy as jnp, jdls
      >>> def loss(p, sites, x):
      ...     h = jdls.apply_site(jnp.tanh(x * p["a"]), sites["a"])
      ...     return jnp.sum(jdls.apply_site(h * p["b"], sites["b"]))
      >>> sites = {"a": jdls.layer_site(jdls.StaticScale(2.0**20), 0),
      ...          "b": jdls.layer_site(jdls.StaticScale(4.0), 1)}
      >>> params = {"a": jnp.float32(0.5), "b": jnp.float32(3.0)}
      >>> value, (grads, measured) = jdls.layer_scaled_value_and_grad(loss)(params, sites, 1.0)
      >>> round(float(grads["a"]), 4), round(float(grads["b"]), 4)
      (2.3593, 0.4621)
      >>> bool(measured["a"].value["finite"])
      True
    """

    def value_and_grad_fn(params: Any, sites: Any, *args: Any, **kwargs: Any) -> Any:
        value, grads = scale_layers(
            fun,
            (params, sites, *args),
            kwargs,
            (0, 1),
            layer_of=lambda path: path[1:],
            param_path=lambda path: path[1:] if path[0] == 0 else (None,),
            has_aux=has_aux,
            who="jdls.layer_scaled_value_and_grad",
        )
        return value, (grads[0], grads[1])

    return value_and_grad_fn
