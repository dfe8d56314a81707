"""``jdls.apply_updates``: ``optax.apply_updates`` for parameters that hold sites, whose new
state waits in the wrap's state (the update at a site is a ``SiteUpdate``, no leaves)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp

from jdls._sites.apart import site_leaves
from jdls._sites.site import fresh_site, is_site
from jdls._transforms.stats import snapshot, wrap_states

__all__ = ["apply_updates"]


def _pending(opt_state: Any, count: int) -> list[Any]:
    if opt_state is None:
        raise ValueError(
            f"the parameters hold {count} sites (probes, per-layer scales, FP8 state), whose "
            "new state jdls.wrap keeps in the optimizer state (their update is a SiteUpdate): pass "
            "it, apply_updates(params, updates, opt_state)"
        )
    held = [w.sites for _, w in wrap_states(snapshot(opt_state)) if w.sites is not None]
    if len(held) > 1:
        raise ValueError(
            f"jdls.apply_updates: {len(held)} jdls.wrap states hold sites; keep the "
            "parameters that hold sites under one jdls.wrap"
        )
    sites = list(held[0]) if held else []
    if not sites:
        raise ValueError(
            f"jdls.apply_updates: the parameters hold {count} sites, but no jdls.wrap in the "
            "optimizer state saw them: keep the parameters that hold sites under the wrap "
            "(not masked out by optax.masked, nor labelled to another transformation by "
            "optax.multi_transform: mask inside it, jdls.wrap(optax.masked(...))), and pass "
            "the state that tx.update returned"
        )
    if len(sites) != count:
        raise ValueError(
            f"jdls.apply_updates: the parameters hold {count} sites and the optimizer state "
            f"{len(sites)}; pass the whole parameters that tx.update got (with "
            "jdls.wrap_groups: every group, and the updates of the groups stepped) and the "
            "state it returned"
        )
    return sites


def apply_updates(params: Any, updates: Any, opt_state: Any = None) -> Any:
    """``optax.apply_updates(params, updates)`` for parameters that may hold sites.

    ``jdls.wrap`` keeps the sites of the parameters (probes, per-layer scales, FP8 state)
    from the optimizer: the update at a site is a ``SiteUpdate`` without leaves, so that no
    transformation after the wrap scales, decays or clips it (``eqx.apply_updates`` and
    ``optax.apply_updates`` refuse it, naming this function), and the site's new state waits
    in ``opt_state``. This puts it in place. Every other leaf becomes ``(p + u)`` in ``p``'s dtype, as in
    ``optax.apply_updates`` (16-bit parameters stay 16-bit under float32 updates); a ``None``
    update keeps its leaf.

    Args:
      params: the parameters (any pytree; non-array leaves are kept).
      updates: what ``tx.update`` returned (``None`` where a leaf has no update). For a
        dict of parameter groups, the updates may hold some of them (``jdls.wrap_groups``
        stepping some groups): the others keep their parameters.
      opt_state: the optimizer state ``tx.update`` returned with them; needed only when
        ``params`` holds sites.

    Returns:
      The updated parameters.

    Raises:
      ValueError: ``params`` holds sites and ``opt_state`` is missing or holds other sites.

    Example:
      >>> import jax, jax.numpy as jnp, optax, jdls
      >>> params = {"w": jnp.ones(2), "probe": jdls.Site(jdls.Probe())}
      >>> tx = jdls.wrap(optax.sgd(0.25), jdls.StaticScale(1.0))
      >>> opt_state = tx.init(params)
      >>> loss = lambda p: jnp.sum(jdls.apply_site(p["w"], p["probe"]) ** 2)
      >>> updates, opt_state = tx.update(jax.grad(loss)(params), opt_state, params)
      >>> updates["probe"]
      SiteUpdate()
      >>> params = jdls.apply_updates(params, updates, opt_state)
      >>> params["w"].tolist(), jdls.Telemetry.of(params).amax.tolist()
      ([0.5, 0.5], [2.0])
    """
    if (
        isinstance(params, Mapping)
        and isinstance(updates, Mapping)
        and updates.keys() < params.keys()
    ):
        # jdls.wrap_groups stepping some groups: the others keep their parameters
        def nothing(tree: Any) -> Any:
            return jax.tree_util.tree_map(lambda _: None, tree, is_leaf=is_site)

        updates = {k: updates[k] if k in updates else nothing(params[k]) for k in params}
    sites = site_leaves(params)
    pending = iter(_pending(opt_state, len(sites)) if sites else [])

    def apply(p: Any, u: Any) -> Any:
        if is_site(p):
            new = next(pending)
            if not is_site(new) or new.kind != p.kind:
                raise ValueError(
                    f"jdls.apply_updates: a {type(p.kind).__name__} site of the parameters "
                    f"meets a {type(getattr(new, 'kind', new)).__name__} in the optimizer "
                    "state; pass the state tx.update returned for these parameters"
                )
            # a copy (free under jit): the parameters and the state, both donated to the
            # next step, cannot share a buffer
            return fresh_site(new)
        if u is None or p is None:
            return p
        return jnp.asarray(p + u).astype(jnp.asarray(p).dtype)

    def stop(x: Any) -> bool:
        return x is None or is_site(x)

    try:
        return jax.tree_util.tree_map(apply, params, updates, is_leaf=stop)
    except (ValueError, TypeError) as e:
        if "jdls.apply_updates" in str(e):
            raise
        raise ValueError(
            "jdls.apply_updates: the updates are not shaped like the parameters (each "
            f"parameter needs its update, None where it has none); {e}"
        ) from None
