"""The per-layer scale site: a layer's own loss scale at its output.

``rescale_boundary(x, ratio)`` is the identity forward; backward it multiplies the cotangent
by ``ratio`` (a ``custom_vjp``). A per-layer scale is a site (``jdls/_sites/site.py``) of kind
:class:`LayerScale` at the layer's output, whose value holds the layer's loss scale and the
ratio ``s[k] / s[k+1]`` of the neighbouring layers' scales, and whose update adjusts the
layer's scale from the measurement of its gradients (``jdls.rules.Adaptive`` per layer, none
growing on a skipped step). The frameworks' layers record the order they apply these sites
in (:func:`note_applied`, :func:`applied_in_order`). The differentiation that sets the
ratios and measures each layer is ``jdls/_scales/layer_scales.py``.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jdls._numerics.paths import path_key
from jdls._numerics.scalars import one_kernel, pick
from jdls._scales.scale import DynamicScale, LossScale, adjust_observed, check_scale
from jdls._sites.site import Site, SiteKind, is_site

__all__ = [
    "LayerScale",
    "applied_in_order",
    "layer_site",
    "layer_sites",
    "note_applied",
    "rescale_boundary",
]

_F32 = jnp.float32
Path = tuple[Any, ...]


@jax.custom_vjp
def _rescale(x: jax.Array, ratio: jax.Array) -> jax.Array:
    del ratio
    return x


def _rescale_fwd(x: jax.Array, ratio: jax.Array) -> tuple[jax.Array, jax.Array]:
    return x, ratio


def _rescale_bwd(ratio: jax.Array, g: jax.Array) -> tuple[jax.Array, jax.Array]:
    dtype = jnp.promote_types(g.dtype, _F32)
    return (g.astype(dtype) * ratio.astype(dtype)).astype(g.dtype), jnp.zeros_like(ratio)


_rescale.defvjp(_rescale_fwd, _rescale_bwd)


def rescale_boundary(x: Any, ratio: float | jax.Array) -> Any:
    """The identity forward; backward, the cotangent of every float leaf of ``x`` is
    multiplied by ``ratio`` (in float32, rounded once to the cotangent's dtype).

    Args:
      x: an array or pytree of the forward pass.
      ratio: a float32 scalar, e.g. the ratio of two layers' scales.

    Returns:
      ``x``.

    Example:
      >>> import jax, jax.numpy as jnp, jdls
      >>> jax.grad(lambda x: jnp.sum(jdls.rescale_boundary(x, 8.0) * 3.0))(jnp.ones(2)).tolist()
      [24.0, 24.0]
    """
    r = jnp.asarray(ratio, _F32)
    if r.shape != ():
        raise ValueError(f"ratio must be a scalar, got shape {r.shape}")

    def leaf(a: Any) -> Any:
        if not jnp.issubdtype(jnp.result_type(a), jnp.floating):
            return a
        return _rescale(a, r)

    return jax.tree_util.tree_map(leaf, x)


@dataclasses.dataclass(frozen=True)
class LayerScale(SiteKind):
    """A site kind for a layer's own loss scale, at the layer's output (build one with
    :func:`layer_site`).

    Its value: ``{"scale": a jdls loss scale, "ratio": the backward multiplier set by
    layer_scaled_value_and_grad, "amax": the largest unscaled gradient of the layer on the
    last step, "finite": 1.0 where they were all finite}``. Forward: the identity. Backward:
    the cotangent times ``ratio`` (in float32, rounded once to its dtype).

    Args:
      position: the layer's place in the forward order among the model's per-layer sites (a
        stack of sites takes one position: its layers follow in index order).
    """

    position: int = 0

    def init(self) -> Any:
        return _value(DynamicScale(), 1.0)

    def stack_shape(self, value: Any) -> tuple[int, ...]:
        return tuple(jnp.shape(value["ratio"]))

    def forward(self, x: Any, value: Any) -> tuple[Any, Any]:
        return x, value["ratio"]

    def backward(self, ratio: Any, g: Any) -> tuple[Any, Any]:
        def leaf(c: jax.Array) -> jax.Array:
            dtype = jnp.promote_types(c.dtype, _F32)
            return (c.astype(dtype) * ratio.astype(dtype)).astype(c.dtype)

        zeros = jnp.zeros((), _F32)
        return [leaf(c) for c in g], {"scale": None, "ratio": zeros, "amax": zeros, "finite": zeros}

    def reduce(self, measurement: Any, axis_name: Any) -> Any:
        return {
            **measurement,
            "amax": jax.lax.pmax(measurement["amax"], axis_name),
            "finite": jax.lax.pmin(measurement["finite"], axis_name),
        }

    def accumulate(self, a: Any, b: Any) -> Any:
        """Two micro-batches' measurements (``jdls.accumulate``): the largest amax (each
        micro-batch's backward pass ran at the layer's scale) and the least finite flag."""
        return {
            **a,
            "amax": jnp.maximum(a["amax"], b["amax"]),
            "finite": jnp.minimum(a["finite"], b["finite"]),
        }

    def update(self, value: Any, measurement: Any, finite: jax.Array) -> Any:
        scale = value["scale"]
        amax, own = measurement["amax"], measurement["finite"] > 0
        # one adjustment, the global path's (jdls.wrap): grown (measured) on a taken step,
        # backed off where the layer itself overflowed (a rule backs off alike with or
        # without a measurement): on a skipped step, or on a taken one whose overflowing
        # micro-batch jdls.accumulate dropped; unchanged where only other layers did. A
        # layer whose gradients are all zero is left to the rule, as one global scale is.
        adjusted = adjust_observed(scale, finite & own, lambda: amax)
        moved = finite | ~own
        new = jax.tree_util.tree_map(lambda a, s: pick(moved, a, s), adjusted, scale)
        # the scale, its counters and the statistics in one kernel, not one each
        return one_kernel({**value, "scale": new, "amax": amax, "finite": own.astype(_F32)})


def _value(scale: LossScale, ratio: Any) -> dict[str, Any]:
    return {
        "scale": scale,
        "ratio": jnp.asarray(ratio, _F32),
        "amax": jnp.zeros((), _F32),
        "finite": jnp.ones((), _F32),
    }


def layer_site(scale: LossScale, position: int) -> Site:
    """A per-layer scale site for the layer at ``position`` in the forward order.

    Pass the layer's output through it with :func:`jdls.apply_site`; differentiate with
    :func:`layer_scaled_value_and_grad`; adjust with :func:`jdls.update_sites`. For a stack of
    ``n`` layers (``lax.scan`` over stacked parameters), ``layer_site(scale, k).stacked(n)``.

    Args:
      scale: the layer's loss scale (``jdls.AdaptiveScale()``, say).
      position: the layer's place in the forward order (0 for the first layer).

    Returns:
      A :class:`jdls.Site` of kind :class:`LayerScale`.

    Example:
      >>> import jdls
      >>> site = jdls.layer_site(jdls.AdaptiveScale(2.0**10), 0)
      >>> float(site.value["scale"].loss_scale), float(site.value["ratio"])
      (1024.0, 1.0)
    """
    check_scale(scale, "scale")
    if not isinstance(position, int | np.integer) or isinstance(position, bool):
        raise TypeError(f"position must be an int (the layer's forward order), got {position!r}")
    return Site(LayerScale(int(position)), _value(scale, 1.0))


# while a framework's layer_scaled_value_and_grad traces the loss: the positions of the
# per-layer sites in the order the model's layers apply them (checked, never used otherwise)
_APPLIED: contextvars.ContextVar[list[int] | None] = contextvars.ContextVar(
    "jdls_layer_sites_applied", default=None
)


def note_applied(site: Site) -> None:
    """Record, inside :func:`applied_in_order`, that a layer applies the per-layer ``site``
    (a framework's layer calls it where it passes its output through its site)."""
    applied = _APPLIED.get()
    if applied is not None and isinstance(site.kind, LayerScale):
        applied.append(site.kind.position)


@contextlib.contextmanager
def applied_in_order(who: str, fix: str) -> Iterator[None]:
    """While tracing a loss: record the positions of the per-layer sites the layers apply
    (:func:`note_applied`), and refuse an order other than the positions' (each layer would
    be unscaled by another's scale); ``fix`` says how to number the layers right."""
    token = _APPLIED.set([])
    try:
        yield
        applied = _APPLIED.get()
    finally:
        _APPLIED.reset(token)
    applied = applied or []
    twice = sorted({p for p in applied if applied.count(p) > 1})
    if twice:
        raise ValueError(
            f"{who}: the per-layer site at position(s) {twice} was applied more than once in "
            "one step (a layer called twice, e.g. a shared module or weights tied to another "
            "layer): per-layer scales need each layer applied once, in a chain, or its "
            "gradients are unscaled by the wrong scale. Leave that module out of the layers "
            "(select the others with where=...), or train with one global scale"
        )
    if applied and applied != sorted(applied):
        raise ValueError(
            f"{who}: the layers applied their per-layer sites in the order of positions "
            f"{applied}, but the positions must follow the forward order. {fix}"
        )


def layer_sites(tree: Any) -> list[tuple[Path, Site]]:
    """The per-layer sites of ``tree`` with their paths (keys as text), in tree order."""
    found = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_site)[0]
    return [
        (tuple(path_key(k) for k in path), site)
        for path, site in found
        if isinstance(site, Site) and isinstance(site.kind, LayerScale)
    ]
