"""The sites of a tree in a train step: split from the rest (the measurements from the
gradients), merged back, and updated by their kinds from their measurements.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jdls._numerics.paths import path_name
from jdls._sites.measured import Measured
from jdls._sites.site import Site, is_site, refuse_halved

__all__ = ["merge_sites", "split_sites", "update_sites"]


def split_sites(tree: Any) -> tuple[Any, Any]:
    """``(rest, sites)``: two trees shaped like ``tree``, one with ``None`` in place of every
    :class:`Site`, the other with ``None`` everywhere but the sites.

    On gradients: ``rest`` is what the optimizer gets, ``sites`` the measurements.

    Example:
      >>> import jax.numpy as jnp, jdls
      >>> rest, sites = jdls.split_sites({"w": jnp.ones(2), "probe": jdls.Site(jdls.Probe())})
      >>> rest["probe"], sites["w"], type(sites["probe"]).__name__
      (None, None, 'Site')
    """
    rest = jax.tree_util.tree_map(lambda x: None if is_site(x) else x, tree, is_leaf=is_site)
    sites = jax.tree_util.tree_map(lambda x: x if is_site(x) else None, tree, is_leaf=is_site)
    return rest, sites


def merge_sites(rest: Any, sites: Any) -> Any:
    """The inverse of :func:`split_sites`: ``rest`` with the sites of ``sites`` put back.

    Example:
      >>> import jax.numpy as jnp, jdls
      >>> tree = {"w": jnp.ones(2), "probe": jdls.Site(jdls.Probe())}
      >>> jdls.is_site(jdls.merge_sites(*jdls.split_sites(tree))["probe"])
      True
    """

    def pick(s: Any, r: Any) -> Any:
        return s if is_site(s) else r

    def stop(x: Any) -> bool:
        return x is None or is_site(x)

    return jax.tree_util.tree_map(pick, sites, rest, is_leaf=stop)


def _update_one(
    site: Site, measured: Site | None, finite: jax.Array, axis_name: Any = None
) -> Site:
    if measured is None:
        return site
    if not isinstance(measured, Site) or measured.kind != site.kind:
        raise ValueError(
            f"update_sites: the measurement of a {type(site.kind).__name__} site is "
            f"{type(measured).__name__}; pass the sites' gradients as the measurements"
        )
    update: Callable[..., Any] = functools.partial(_kind_update, site.kind)
    for _ in site.kind.stack_shape(site.value):
        update = jax.vmap(update, in_axes=(0, 0, None))
    value = measured.value
    if axis_name is not None and not isinstance(measured, Measured):  # global already
        value = site.kind.reduce(value, axis_name)
    # the measurement's integer leaves are None (held fixed) or float0: the kind ignores them
    return Site(site.kind, update(site.value, value, finite))


# A kind's update is one program per kind and shapes: inlined inside a user's jit with its
# trace kept (a probe per module updates alike), one compiled program when called eagerly.
@functools.partial(jax.jit, static_argnums=(0,), inline=True)
def _kind_update(kind: Any, value: Any, measured: Any, finite: jax.Array) -> Any:
    return kind.update(value, measured, finite)


def update_sites(sites: Any, measurements: Any, finite: Any = True, axis_name: Any = None) -> Any:
    """Every :class:`Site` in ``sites`` updated by its kind from its measurement.

    ``measurements`` are the gradients at the sites (:func:`split_sites` of the gradients);
    ``finite`` whether the step was taken (``jdls.stats(opt_state).finite``): a kind decides
    what a skipped step changes (a probe records its statistics either way). A stacked site
    is updated site by site. Leaves that are not sites are returned unchanged.

    Args:
      sites: a pytree holding sites (the model's variables, a dict of sites).
      measurements: the same structure, with the measurements at the sites (``None``
        elsewhere, or the same leaves).
      finite: a boolean scalar.
      axis_name: inside ``shard_map`` or ``pmap`` with each device's own measurements (its
        own copy of the sites): the axis over which each kind combines them
        (:meth:`SiteKind.reduce`), so that every device updates alike.

    Returns:
      ``sites`` with every site's value updated.

    Example:
      >>> import jax, jax.numpy as jnp, jdls
      >>> sites = {"h": jdls.Site(jdls.Probe())}
      >>> loss = lambda x, s: jnp.sum(jdls.apply_site(x * 2.0, s["h"]))
      >>> _, measured = jax.grad(loss, (0, 1))(jnp.ones(4), sites)
      >>> sites = jdls.update_sites(sites, measured)
      >>> jdls.Telemetry.of(sites).amax.tolist()
      [1.0]
    """
    refuse_halved(sites, "jdls.update_sites")
    finite = jnp.asarray(finite, bool)
    measured_sites = jax.tree_util.tree_map(
        lambda x: x if is_site(x) else None, measurements, is_leaf=is_site
    )

    def one(site: Any, measured: Any) -> Any:
        return _update_one(site, measured, finite, axis_name) if is_site(site) else site

    _warn_unrecorded(measured_sites)
    return jax.tree_util.tree_map(
        one, sites, measured_sites, is_leaf=lambda x: is_site(x) or x is None
    )


def _warn_unrecorded(measured: Any) -> None:
    """Warn (once per set of sites, at run time) where a site's kind refuses this step's
    measurement because the site served several uses (an FP8 dot's site shared by two
    dots, or closed over by ``jax.vmap`` over examples): without it the site's scales never
    move, silently. One ``lax.cond`` on a scalar; the host is called only when it happens."""
    names, flags = [], []
    for path, m in jax.tree_util.tree_flatten_with_path(measured, is_leaf=is_site)[0]:
        if not is_site(m):
            continue
        flag = m.kind.unrecorded(m.value)
        if flag is not None:
            names.append(path_name(path))
            flags.append(jnp.any(jnp.asarray(flag, bool)))
    if not flags:
        return
    flags_array = jnp.stack(flags)

    def report(values: Any) -> None:
        shared = [n for n, f in zip(names, np.asarray(values), strict=True) if f]
        if shared:
            warnings.warn(
                f"site(s) {', '.join(shared)} served more than one use in this step, and JAX "
                "summed their measurements, so nothing was recorded and their scales did not "
                "move. A site serves one use: one jdls.fp8 site per dot (a layer applied "
                "once); under jax.vmap over examples, call the layer on the whole batch "
                "(jax.vmap inside the layer, or a batched layer) instead of closing over its "
                "site; in a loop, sites stacked along the loop axis.",
                stacklevel=1,
            )

    lax.cond(
        jnp.any(flags_array),
        lambda v: jax.debug.callback(report, v),
        lambda v: None,
        flags_array,
    )
