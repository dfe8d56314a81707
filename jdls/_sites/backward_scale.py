"""The loss scale of the backward pass being traced, for the sites that measure cotangents.

A site that quantizes or measures the cotangent of a loss-scaled backward pass (an FP8 dot's
output gradient) sees the gradient times the loss scale. Its history should not move when the
loss scale does (a growth of the loss scale would clip the next step, a back-off leave the
history too high for a window), so it divides what it measures by the loss scale and
multiplies its scale by it.

jdls's scaled ``value_and_grad`` opens a :func:`backward_scale` context with its loss scale
around the whole differentiation. A site reads it in its forward pass
(:func:`current_loss_scale`) and passes it on as an argument of its ``custom_vjp`` (so that it
reaches the backward rule as data, through ``lax.scan``, remat and ``jit``). A 16-bit loss is
seeded with at most the format's largest power of two (its cotangent must be finite), which
is known only once the forward pass returned the loss: the context then records that cap
(:func:`set_seed_cap`, a Python number, which also keys what is traced after it), and the
backward rule, traced after the forward pass and inside the same ``value_and_grad`` call,
applies it (:func:`seeded`).

Where the cotangent's scale differs from place to place, one context cannot say it: per-layer
scales (``jdls/_scales/layer_scales.py``: inside layer ``k`` the cotangent carries layer
``k``'s scale) and per-loss scales with one backward pass (``jdls/_scales/multi_loss_passes.py``:
each region of the backward pass runs at its own level). There the differentiation *tells*
each site that reads the loss scale (a kind with ``reads_loss_scale``, the FP8 dot's) the
factor between its cotangent and the loss's scale: :func:`tell_sites` replaces such a site of
the differentiated arguments by a :class:`ToldSite`, whose ``factor`` is data (an array,
stacked like the site's value, so that ``lax.scan`` slices it with the site), and
:func:`untell_sites` turns the gradients back into plain sites. The site passes the factor on
beside the context's loss scale (:func:`site_factor`), and its backward rule measures at
:func:`backward_level`: the seeded loss scale times the factor (the factor alone without a
context). The three paths share this one rule. The global path tells no site (its factor is
None: the context's scale alone, as before). The per-layer path opens the context with the
loss's scale (the last layer's; a 16-bit loss's cap recorded as on the global path) and tells
each site its layer's scale over it (a site belongs to the layer whose path holds it; a
differentiated one in no layer is refused); a site it cannot see (closed over) quantizes at
the loss's scale. Per-loss with ``backward="one"`` opens no context: each site is told the
level of the region of the backward pass that reads it (already seeded), over the loss's
weight in one loss's own region, so that every site measures the gradient of the weighted
sum of the losses.

Outside any such call (``jax.grad`` by hand) there is no context and no factor, and the site
measures the cotangent as it is (a scale of 1). ``backward="per_loss"`` refuses a site that
reads the loss scale: its one forward pass serves each loss's backward pass at that loss's
own scale, and a site is told its factor in the forward pass, once for all of them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import jax
import jax.numpy as jnp

from jdls._numerics.paths import path_key
from jdls._sites.site import Site, is_site

__all__ = [
    "ToldSite",
    "backward_level",
    "backward_scale",
    "current_loss_scale",
    "reads_loss_scale",
    "seeded",
    "set_seed_cap",
    "site_factor",
    "sites_reading_loss_scale",
    "tell_sites",
    "untell_sites",
]

_local = threading.local()


@dataclasses.dataclass
class _Context:
    """One differentiation's context: its loss scale, the seed cap its loss set, and, where
    its arguments hold sites that read the loss scale, its cache key and the keys entered."""

    loss_scale: Any
    cap: float | None = None
    key: Any = None
    keys: contextlib.ExitStack = dataclasses.field(default_factory=contextlib.ExitStack)


def _stack() -> list[_Context]:
    stack = getattr(_local, "stack", None)
    if stack is None:
        stack = _local.stack = []
    return stack


# The context is read while tracing, so where a differentiation holds sites that read it, it
# is part of every jitted function's cache key (``jax.make_user_context``): a ``jax.jit``
# called inside the differentiation (a jitted forward pass, ``nn.jit``), a ``lax.scan`` body
# or a ``jax.checkpoint`` that was traced outside it, inside another trace's, or at another
# concrete scale is traced again instead of reusing a trace that read another loss scale, or
# none (or a tracer of a trace that has ended: JAX's UnexpectedTracerError). Without such
# sites nothing is keyed: no trace is repeated. The seed cap, known once the forward pass
# returned the loss, keys what is traced after it (the backward rules, which read it, are
# traced in a kept trace's transposition).
_CACHE_KEY = jax.make_user_context(default_value=None)


def _cache_key(loss_scale: Any) -> Any:
    """What a trace that read ``loss_scale`` depends on: a traced scale belongs to the trace
    around it (a new token: one per trace of the step, so an inner ``jax.jit`` is traced once
    per trace of the step); a concrete one (a scale built in the step, an eager step) is a
    constant of the trace, so its value is the key. An eager step then compiles its
    operations once per loss scale it meets: the rules' scales are powers of two, a handful
    over a run, and JAX keeps each compiled operation. (Telling the sites the scale as data
    instead would change their pytree type, which no longer matches an untold copy of the
    same tree: the static half of ``eqx.partition`` closed over by the loss. The per-layer
    and per-loss paths, which must tell, refuse that form with JAX's pytree error, whose
    text names the fix: see :class:`ToldSite`. A field of every site holding the factor
    would match, but would change every site's pytree structure, which orbax checkpoints
    written before record.)"""
    if isinstance(loss_scale, jax.core.Tracer):
        return object()
    return ("concrete", float(jnp.asarray(loss_scale, jnp.float32)))


@contextlib.contextmanager
def backward_scale(loss_scale: Any, arguments: Any = None) -> Iterator[None]:
    """The context of one differentiation of a loss scaled by ``loss_scale``, with respect to
    ``arguments`` (where the sites that read it are)."""
    stack = _stack()
    context = _Context(loss_scale)
    if sites_reading_loss_scale(arguments):
        context.key = _cache_key(loss_scale)
    stack.append(context)
    try:
        with context.keys:
            if context.key is not None:
                context.keys.enter_context(_CACHE_KEY(context.key))
            yield
    finally:
        stack.pop()


def current_loss_scale() -> Any:
    """The innermost context's loss scale (float32), or None outside any."""
    stack = _stack()
    return jnp.asarray(stack[-1].loss_scale, jnp.float32) if stack else None


def set_seed_cap(cap: float | None) -> None:
    """The largest scale the innermost context's loss could be seeded with (a 16-bit
    loss's largest power of two; None for a wider loss), which keys what is traced after."""
    stack = _stack()
    if stack:
        context = stack[-1]
        context.cap = cap
        if context.key is not None:
            context.keys.enter_context(_CACHE_KEY((context.key, cap)))


def seeded(loss_scale: Any) -> Any:
    """The scale the backward pass is seeded with: ``loss_scale``, capped by the innermost
    context's :func:`set_seed_cap`."""
    stack = _stack()
    cap = stack[-1].cap if stack else None
    return loss_scale if cap is None else jnp.minimum(loss_scale, jnp.float32(cap))


def backward_level(loss_scale: Any, factor: Any) -> Any:
    """What a site's cotangent is scaled by, in its backward rule: the seeded loss scale
    (:func:`seeded`) times the site's ``factor`` (:func:`site_factor`); the factor alone
    without a loss scale, the seeded loss scale alone without a factor (the global path, as
    it always was), None without either (the cotangent as it is)."""
    if factor is None:
        return None if loss_scale is None else seeded(loss_scale)
    factor = jnp.asarray(factor, jnp.float32)
    return factor if loss_scale is None else seeded(loss_scale) * factor


def reads_loss_scale(x: Any) -> bool:
    """Whether ``x`` is a site whose kind measures its cotangent unscaled (``reads_loss_scale``
    on the kind: the FP8 dot's), and so is told its factor on the per-layer and per-loss
    paths."""
    return is_site(x) and bool(getattr(x.kind, "reads_loss_scale", False))


def sites_reading_loss_scale(tree: Any) -> list[Site]:
    """The sites of ``tree`` that read the loss scale (:func:`reads_loss_scale`), in its
    flattening order; a stack of sites is one."""
    return [x for x in jax.tree_util.tree_leaves(tree, is_leaf=is_site) if reads_loss_scale(x)]


class _ToldSiteType(type(Site)):  # type: ignore[misc]
    """The type of told sites, whose ``repr`` names the fix where JAX's "pytree structure
    error" meets one beside a copy that was not told (the static half of ``eqx.partition``
    closed over by the loss, combined with the differentiated half inside it)."""

    def __repr__(cls) -> str:
        return (
            f"<class '{cls.__module__}.{cls.__qualname__}'> (an FP8 site that jdls's per-layer "
            "or per-loss differentiation told its cotangent's scale, met beside an untold copy: "
            "the loss combines the differentiated half of a model with a static half it closes "
            "over, eqx.combine(params, static) inside the loss. Differentiate the model itself "
            "instead: combine before the call, jdls.equinox.layer_scaled_value_and_grad(loss)"
            "(eqx.combine(params, static), ...), with loss(model, ...))"
        )


@dataclasses.dataclass(frozen=True, eq=False)
class ToldSite(Site, metaclass=_ToldSiteType):
    """A site told, for one differentiation, the factor between its cotangent and the loss
    scale of the context (:func:`tell_sites`): a float32 array of the site's stack shape.
    Only the differentiation that made it sees it; the gradients it returns are plain sites
    again (:func:`untell_sites`)."""

    factor: Any = None


def _told_flatten(site: ToldSite) -> tuple[tuple[tuple[Any, Any], ...], Any]:
    keys = (jax.tree_util.GetAttrKey("value"), jax.tree_util.GetAttrKey("factor"))
    return tuple(zip(keys, (site.value, site.factor), strict=True)), site.kind


def _told_unflatten(kind: Any, children: Iterable[Any]) -> ToldSite:
    value, factor = children
    site = object.__new__(ToldSite)
    object.__setattr__(site, "kind", kind)
    object.__setattr__(site, "value", value)
    object.__setattr__(site, "factor", factor)
    return site


jax.tree_util.register_pytree_with_keys(
    ToldSite, _told_flatten, _told_unflatten, lambda s: ((s.value, s.factor), s.kind)
)


def site_factor(site: Any) -> Any:
    """The factor ``site`` was told (a float32 array), or None (the global path, or no
    differentiation that tells)."""
    return site.factor if isinstance(site, ToldSite) else None


def tell_sites(tree: Any, factor_of: Callable[[tuple[Any, ...], Site], Any]) -> Any:
    """``tree`` with each site that reads the loss scale told ``factor_of(path, site)`` (its
    path: the keys as text, as ``jdls/_numerics/paths.py`` gives them), broadcast to the
    site's stack shape in float32; a site for which it returns None is left as it is."""

    def one(path: Any, x: Any) -> Any:
        if not reads_loss_scale(x) or isinstance(x, ToldSite):
            return x
        factor = factor_of(tuple(path_key(k) for k in path), x)
        if factor is None:
            return x
        stack = x.kind.stack_shape(x.value)
        factor = jnp.asarray(factor, jnp.float32)
        factor = factor.reshape(factor.shape + (1,) * (len(stack) - factor.ndim))
        return ToldSite(x.kind, x.value, jnp.broadcast_to(factor, stack))

    return jax.tree_util.tree_map_with_path(one, tree, is_leaf=is_site)


def untell_sites(tree: Any) -> Any:
    """``tree`` (the gradients of told sites, say) with every :class:`ToldSite` a plain site
    again, its factor dropped."""

    def one(x: Any) -> Any:
        return Site(x.kind, x.value) if isinstance(x, ToldSite) else x

    return jax.tree_util.tree_map(one, tree, is_leaf=is_site)
