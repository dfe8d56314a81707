"""Sites kept apart from an optimizer: an optax transformation never sees them, and its
update at each site is a ``SiteUpdate`` of the site updated by its kind.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from jdls._sites.site import SiteUpdate, is_site, is_site_update
from jdls._sites.update import merge_sites, split_sites, update_sites

__all__ = ["apply_site_updates", "sites_apart"]


def sites_apart(
    init_fn: Callable[..., Any],
    update_fn: Callable[..., Any],
    finite_of: Callable[[Any], jax.Array] | None,
) -> tuple[Callable[..., Any], Callable[..., Any]]:
    """An optax transformation's functions with the sites of the parameters and of the
    gradients kept apart: the transformation never sees them (``None`` in their place: never
    clipped, decayed or counted in a norm). With ``finite_of`` (``jdls.wrap``: the state's
    skip decision), the update at each site is a :class:`SiteUpdate` of the site updated by
    its kind from its measurement; without (``jdls.clip``), the measurement passes on."""

    def init(params: Any) -> Any:
        return init_fn(split_sites(params)[0])

    def update(updates: Any, state: Any, params: Any = None, **extra: Any) -> Any:
        rest, measured = split_sites(updates)
        if not any(map(is_site, jax.tree_util.tree_leaves(measured, is_leaf=is_site))):
            return update_fn(updates, state, params, **extra)
        held = None if params is None else split_sites(params)[0]
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
        sites = split_sites(params)[1]
        new_sites = update_sites(sites, measured, finite_of(new_state))
        wrapped = jax.tree_util.tree_map(
            lambda s: SiteUpdate(s) if is_site(s) else s, new_sites, is_leaf=is_site
        )
        return merge_sites(out, wrapped), new_state

    return init, update


def apply_site_updates(params: Any, updates: Any) -> Any:
    """``optax.apply_updates(params, updates)`` where ``params`` may hold sites: a site takes
    the new state of its :class:`SiteUpdate` (``jdls.wrap``'s update at a site); a ``None``
    update keeps its leaf; every other leaf becomes ``(p + u)`` in ``p``'s dtype."""

    def apply(u: Any, p: Any) -> Any:
        if u is None:
            return p
        if is_site_update(u):
            return u.site
        return jnp.asarray(p + u).astype(jnp.asarray(p).dtype)

    stop = lambda x: x is None or is_site_update(x)  # noqa: E731
    return jax.tree_util.tree_map(apply, updates, params, is_leaf=stop)
