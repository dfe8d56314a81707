"""Passing a value through a site: ``apply_site``, the ``custom_vjp`` whose backward pass
returns the kind's measurement of the cotangent as the cotangent of the site's value.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jdls._numerics.checks import is_float
from jdls._sites.dropped import watched
from jdls._sites.site import Site, SiteKind

__all__ = ["apply_site"]


def _cotangent(measurement: Any, value: Any) -> Any:
    """The measurement as a cotangent of ``value``: each float leaf in its leaf's dtype and
    shape (a shape mismatch is the kind's error), ``float0`` zeros for integer leaves."""
    from jdls._numerics.axes import sum_like, vary_like

    def leaf(m: Any, v: Any) -> Any:
        if m is None:  # no measurement for this part of the value: zeros
            return jax.tree_util.tree_map(lambda u: leaf(jnp.zeros_like(u), u), v)
        if not is_float(v):
            return np.zeros(jnp.shape(v), jax.dtypes.float0)
        m = jnp.asarray(m).astype(jnp.result_type(v))
        if m.shape != jnp.shape(v):
            raise ValueError(
                f"a site's backward() returned a measurement of shape {m.shape} for a value "
                f"leaf of shape {jnp.shape(v)}: it must have the value's structure and shapes"
            )
        # inside shard_map: a value that varies per device gets its device's measurement; a
        # replicated one the sum over the devices, as JAX gives any replicated input
        return sum_like(vary_like(m, v), v)

    return jax.tree_util.tree_map(leaf, measurement, value, is_leaf=lambda x: x is None)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _site_op(kind: SiteKind, x: Any, value: Any) -> Any:
    return kind.forward(x, value)[0]


def _site_fwd(kind: SiteKind, x: Any, value: Any) -> tuple[Any, Any]:
    y, residuals = kind.forward(x, value)
    return y, (residuals, value)


def _site_bwd(kind: SiteKind, saved: Any, g: Any) -> tuple[Any, Any]:
    residuals, value = saved
    g_x, measurement = kind.backward(residuals, g)
    return g_x, _cotangent(_global(kind, measurement, value), value)


def _global(kind: SiteKind, measurement: Any, value: Any) -> Any:
    """Inside ``shard_map`` with ``check_vma``: a measurement that varies over axes the
    site's value does not (a replicated site, a sharded batch) combined over them by the
    kind's own rule (``SiteKind.reduce``: an amax the largest, a count the sum), before JAX's
    transpose would sum it as the cotangent of a replicated input."""
    from jdls._numerics.axes import varying_axes

    def axes(tree: Any) -> frozenset[Any]:
        leaves = [x for x in jax.tree_util.tree_leaves(tree) if is_float(x)]
        return frozenset().union(*map(varying_axes, leaves)) if leaves else frozenset()

    extra = tuple(sorted(axes(measurement) - axes(value), key=str))
    return kind.reduce(measurement, extra) if extra else measurement


_site_op.defvjp(_site_fwd, _site_bwd)


def apply_site(x: Any, site: Site) -> Any:
    """Pass ``x`` through ``site``: the kind's forward pass, and in the backward pass its
    measurement of the cotangent of ``x`` as the cotangent of ``site.value``.

    ``x`` is an array or a pytree; its floating-point leaves go through the site together
    (the others pass unchanged). The site must be one site's value: inside ``lax.scan`` over
    a stack, the slice of the stacked site for this iteration.

    Args:
      x: a value of the forward pass (a layer's output, say).
      site: a :class:`Site` (one, not a stack).

    Returns:
      The kind's forward output (``x`` for probes and boundaries).

    Example:
      >>> import jax, jax.numpy as jnp, jdls
      >>> site = jdls.Site(jdls.Probe())
      >>> def loss(x, site):
      ...     return jnp.sum(jdls.apply_site(jnp.tanh(x), site))
      >>> _, measured = jax.grad(loss, (0, 1))(jnp.ones(3), site)
      >>> jdls.Telemetry.of({"h": measured}).uses.tolist()
      [1.0]
    """
    if not isinstance(site, Site):
        raise TypeError(
            f"apply_site(x, site) takes a jdls.Site as its second argument, got "
            f"{type(site).__name__}: build one with jdls.Site(kind), keep it with the model's "
            "state and pass it in"
        )
    stack = site.kind.stack_shape(site.value)
    if stack:
        raise ValueError(
            f"apply_site got a stack of {math.prod(stack)} {type(site.kind).__name__} sites "
            f"(leading axes {stack}): pass one site, e.g. the slice lax.scan gives each "
            "iteration (scan over the stacked sites with the stacked parameters)"
        )
    leaves, treedef = jax.tree_util.tree_flatten(x)
    floats = [i for i, leaf in enumerate(leaves) if is_float(leaf)]
    if not floats:
        return x
    ins = watched(f"a {type(site.kind).__name__} site", [leaves[i] for i in floats], site.value)
    out = _site_op(site.kind, ins, site.value)
    leaves = list(leaves)
    for i, y in zip(floats, out, strict=True):
        leaves[i] = y
    return jax.tree_util.tree_unflatten(treedef, leaves)
