"""A site differentiated through without its own state: its measurement would be dropped
without a word (``nnx.grad`` with the default ``wrt=nnx.Param``, ``jax.grad`` of the params
alone with the sites closed over). :func:`watched` is an identity on the site's input whose
forward rule sees, while tracing, which of its arguments JAX differentiates, and warns once
where the input is differentiated and the site's state is not (not inside ``shard_map`` or
``pmap``: see :func:`watched`).
"""

from __future__ import annotations

import functools
import warnings
from typing import Any

import jax
import jax.numpy as jnp

from jdls._numerics.axes import manual_axes

__all__ = ["SiteNotDifferentiated", "watched"]


class SiteNotDifferentiated(UserWarning):
    """Warned while tracing a differentiation that goes through a jdls site (a probe, a
    per-layer scale, an FP8 dot) but not with respect to the site's own state: the site's
    measurement is dropped and the site never updates. The message names the fix for each
    framework; where leaving the site out is meant (a gradient with respect to the inputs
    alone), silence it with ``warnings.filterwarnings("ignore",
    category=jdls.SiteNotDifferentiated)``.

    Example:
      >>> import warnings, jax, jax.numpy as jnp, jdls
      >>> site = jdls.Site(jdls.Probe())
      >>> loss = lambda w: jnp.sum(jdls.apply_site(w * 2.0, site))  # the site closed over
      >>> with warnings.catch_warnings(record=True) as caught:
      ...     warnings.simplefilter("always")
      ...     _ = jax.grad(loss)(jnp.ones(2))
      >>> caught[0].category.__name__
      'SiteNotDifferentiated'
    """


_FIX = (
    "differentiate with respect to the sites as well: jdls.nnx.value_and_grad (its default "
    "wrt takes the sites) with jdls.nnx.Optimizer in NNX; state.value_and_grad or "
    "jdls.linen.TrainState with the 'jdls' collection in linen; scale.value_and_grad of the "
    "whole model, sites included, in Equinox or JAX"
)


def _floats(tree: Any) -> list[Any]:
    return [
        x
        for x in jax.tree_util.tree_leaves(tree)
        if jnp.issubdtype(jnp.result_type(x), jnp.inexact)
    ]


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _watch(what: str, xs: list[Any], value: list[Any]) -> list[Any]:
    del what, value
    return xs


def _watch_fwd(what: str, xs: list[Any], value: list[Any]) -> tuple[list[Any], None]:
    if any(x.perturbed for x in xs) and value and not any(v.perturbed for v in value):
        warnings.warn(
            f"jdls: {what} is differentiated through, but not with respect to its own state: "
            "its measurement is dropped and it never updates (an FP8 scale stays as it was "
            f"made, a probe reads nothing); {_FIX}",
            SiteNotDifferentiated,
            stacklevel=2,
        )
    return [x.value for x in xs], None


def _watch_bwd(what: str, _: None, g: list[Any]) -> tuple[list[Any], None]:
    del what
    return g, None


_watch.defvjp(_watch_fwd, _watch_bwd, symbolic_zeros=True)


def watched(what: str, xs: list[Any], value: Any) -> list[Any]:
    """``xs`` (the float inputs of a site), unchanged; while tracing a differentiation of
    ``xs`` that leaves ``value`` (the site's state) constant, a :class:`SiteNotDifferentiated`
    warning naming ``what`` (``"a Probe site"``) and the fix.

    Inside ``shard_map`` (and ``pmap``, which JAX builds on it) the inputs pass unwatched: JAX
    cannot run such an identity there when nothing differentiates it ("custom_vjp
    symbolic_zeros support with shard_map is not implemented"), so a forward pass alone (an
    evaluation step) would fail. There the warning is not given."""
    if manual_axes():
        return list(xs)
    return list(_watch(what, list(xs), _floats(value)))
