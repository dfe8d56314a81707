"""Sites kept apart from an optimizer: an optax transformation never sees them. The update
at a site is a :class:`SiteUpdate` (no leaves), which every optax transformation after the
wrap passes on untouched and nothing can add to a site; the sites' new state waits in the
wrap's state until the parameters take it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax

from jdls._sites.site import SiteUpdate, fresh_site, is_site, refuse_halved
from jdls._sites.update import merge_sites, split_sites, update_sites

__all__ = ["site_leaves", "sites_apart"]


def site_leaves(tree: Any) -> list[Any]:
    """The sites of ``tree``, in its flattening order."""
    return [x for x in jax.tree_util.tree_leaves(tree, is_leaf=is_site) if is_site(x)]


def sites_apart(
    init_fn: Callable[..., Any],
    update_fn: Callable[..., Any],
    finite_of: Callable[[Any], jax.Array] | None,
    hold: Callable[[Any, tuple[Any, ...]], Any] | None = None,
) -> tuple[Callable[..., Any], Callable[..., Any]]:
    """An optax transformation's functions with the sites of the parameters and of the
    gradients kept apart: the transformation never sees them (``None`` in their place: never
    clipped, decayed or counted in a norm).

    With ``finite_of`` (``jdls.wrap``: the state's skip decision), each site is updated by its
    kind from its measurement, the update at the site is a :class:`SiteUpdate` (so that a
    transformation after the wrap, ``optax.scale``, leaves it alone, and ``eqx.apply_updates``
    or ``optax.add_decayed_weights`` fail, naming the fix, instead of keeping the old state) and
    ``hold(state, sites)`` puts the new sites (in the parameters' flattening order) in the
    state, where ``jdls.apply_updates`` finds them. Without (``jdls.clip``), the measurement
    passes on."""

    def init(params: Any) -> Any:
        refuse_halved(params, "the params given to tx.init")
        state = init_fn(split_sites(params)[0])
        sites = site_leaves(params)
        if hold is not None and sites:
            # copies: a step that donates both the parameters and the state (jax.jit with
            # donate_argnums=(0, 1)) cannot be given one buffer twice
            state = hold(state, tuple(fresh_site(x) for x in sites))
        return state

    def update(updates: Any, state: Any, params: Any = None, **extra: Any) -> Any:
        rest, measured = split_sites(updates)
        found = len(site_leaves(measured))
        if not found:
            return update_fn(updates, state, params, **extra)
        held, sites = (None, None) if params is None else split_sites(params)
        if finite_of is not None and sites is not None and len(site_leaves(sites)) != found:
            raise ValueError(
                f"the gradients hold {found} sites' measurements and the params "
                f"{len(site_leaves(sites))} sites: jdls.wrap updates each site from its state "
                "among the params. Flax NNX: use jdls.nnx.Optimizer(model, tx, wrt=nnx.Param), "
                "which updates the sites (nnx.Optimizer gives tx only the parameters); "
                "otherwise pass the params the gradients were taken at, sites included"
            )
        out, new_state = update_fn(rest, state, held, **extra)
        if finite_of is None:
            return merge_sites(out, measured), new_state
        if params is None:
            raise ValueError(
                "the gradients hold sites' measurements (probes, per-layer scales, FP8 "
                "state), but tx.update got no params: jdls.wrap updates each site from its "
                "current state, which is among the params. Pass them: "
                "tx.update(grads, opt_state, params)"
            )
        out = _marked(out, measured)
        new_sites = update_sites(sites, measured, finite_of(new_state))
        if hold is not None:
            new_state = hold(new_state, tuple(site_leaves(new_sites)))
        return out, new_state

    return init, update


def _marked(out: Any, measured: Any) -> Any:
    """``out`` with a :class:`SiteUpdate` at every site of ``measured``."""

    def pick(m: Any, o: Any) -> Any:
        return SiteUpdate() if is_site(m) else o

    return jax.tree_util.tree_map(pick, measured, out, is_leaf=lambda x: x is None or is_site(x))
