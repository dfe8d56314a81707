"""A measurement is never a gradient: what jdls's differentiation returns at a site.

JAX returns a site's measurement as the cotangent of its value, so it arrives inside the
gradient tree, where every tool that is not jdls's treats it as a gradient: a ``lax.pmean``
averages it, an optax clip counts it in its norm and scales it, ``optax.MultiSteps`` averages
it over micro-batches. jdls's entry points (every ``value_and_grad`` of jdls, the framework
steps) therefore return each site's measurement as a :class:`Measured`:

* **global**: reduced over every device by the kind's rule (:meth:`SiteKind.reduce`: the
  largest amax, the conjunction of finite flags, counts summed) before the user's code sees
  it, over the manual axes of ``shard_map`` and ``pmap`` (with ``check_vma``, only those the
  measurement varies over); under ``jit`` with sharded arrays the compiler already computes
  the global value;
* **untouched by what treats it as a gradient**: each float leaf is held as the bytes of its
  bits, each times ``2**-90``, with a check byte (not linear in the bytes, modulo 251),
  beside a ``count`` of ``2**-90``. The squares underflow, so a global norm
  (``optax.clip_by_global_norm`` in front of ``jdls.wrap``) counts nothing of it; any common
  factor applied to the whole tree (the step's own ``lax.pmean`` or ``lax.psum``, a clip's
  factor, ``optax.scale``) cancels exactly in ``byte / count``, a whole number below 256; and
  a cast of the whole tree to bfloat16 (an all-reduce in 16 bits) keeps every byte exact. A
  byte that is not a whole number in ``[0, 256)``, or a check byte that does not match (the
  measurement was added to, averaged with different values, or rounded), decodes to NaN, as
  does a ``count`` flushed to zero (a cast to float16).

``Measured`` is a :class:`Site` (``jdls.is_site`` is true, ``.kind`` and ``.value`` read as
a site's do: ``.value`` decodes the measurement), so ``jdls.update_sites``,
``jdls.split_sites``, ``jdls.Telemetry.of`` and the framework steps take it as they take the
raw measurement of ``jax.grad``. A raw measurement (``jax.grad`` with respect to sites, by
hand) is per device; ``jdls.update_sites(..., axis_name=...)`` reduces it, and leaves a
``Measured`` alone (it is global already).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jdls._numerics.axes import bound_axes, tracked_axes, vary_over, varying_axes
from jdls._sites.site import Site, SiteKind, is_site

__all__ = ["Measured", "measured", "raw"]

_F32 = jnp.float32
# Each byte of a measurement's bits is held as ``byte * _UNIT``: exact in float32 and in
# bfloat16, so small that its square underflows (it counts for nothing in a global norm), and
# ``count`` is ``_UNIT``: any common factor a transformation applies (a pmean, a psum, a
# clip's) cancels in ``byte / count``. A check byte catches what is not a common factor.
_UNIT = 2.0**-90
_CHECK = 251  # a prime below 256: the check byte is exact in bfloat16 too
_PACKED = (jnp.dtype(jnp.float32), jnp.dtype(jnp.float16), jnp.dtype(jnp.bfloat16))


class Measured(Site):
    """A site's measurement as jdls's differentiation returns it: global over the devices,
    and coded so that a ``lax.pmean`` or ``lax.psum`` of the gradients, or a clip of their
    global norm, leaves it exact and is not changed by it.

    Read it as a :class:`jdls.Site`: ``.kind``, and ``.value`` (the decoded measurement).

    Example:
      >>> import jax, jax.numpy as jnp, jdls
      >>> sites = {"h": jdls.Site(jdls.Probe())}
      >>> loss = lambda x, s: jnp.sum(jdls.apply_site(x * 2.0, s["h"]))
      >>> _, (_, measured) = jdls.StaticScale(1.0).value_and_grad(loss, (0, 1))(jnp.ones(4), sites)
      >>> type(measured["h"]).__name__, jdls.is_site(measured["h"])
      ('Measured', True)
      >>> jdls.Telemetry.of(measured).amax.tolist()  # the cotangent of x * 2.0: ones
      [1.0]
    """

    kind: SiteKind
    parts: Any  # per float leaf of the value: its bits as bytes with a check (_Bytes); else None
    count: jax.Array  # float32, _UNIT: what the parts are divided by when decoded

    def __init__(self, kind: SiteKind, parts: Any, count: Any) -> None:
        object.__setattr__(self, "kind", kind)
        object.__setattr__(self, "parts", parts)
        object.__setattr__(self, "count", count)

    @property  # type: ignore[override]
    def value(self) -> Any:
        """The measurement, decoded (float leaves in their dtypes; ``None`` elsewhere).
        Decoded once per object: its arrays never change."""
        decoded = self.__dict__.get("_decoded")
        if decoded is None:
            count = jnp.asarray(self.count, _F32)
            decoded = jax.tree_util.tree_map(
                lambda part: _decode(part, count) if isinstance(part, _Bytes) else part,
                self.parts,
                is_leaf=lambda x: isinstance(x, _Bytes),
            )
            object.__setattr__(self, "_decoded", decoded)
        return decoded

    def __repr__(self) -> str:
        return f"Measured({self.kind!r})"

    def __eq__(self, other: object) -> bool:
        return self is other

    __hash__ = object.__hash__


class _Bytes:
    """A float leaf's bits as bytes (the most significant first) and a check byte, stacked on
    a leading axis, each held as a float32 times ``_UNIT``; the leaf's dtype is static."""

    def __init__(self, coded: Any, dtype: Any) -> None:
        self.coded, self.dtype = coded, jnp.dtype(dtype)


def _bytes_of(dtype: Any, children: Any) -> _Bytes:
    (coded,) = children
    return _Bytes(coded, dtype)


jax.tree_util.register_pytree_with_keys(
    _Bytes,
    lambda b: (((jax.tree_util.GetAttrKey("coded"), b.coded),), b.dtype),
    _bytes_of,
    lambda b: ((b.coded,), b.dtype),
)


def _along(v: Any, ndim: int) -> Any:
    """The vector ``v`` on the leading axis of an array of ``ndim`` dimensions."""
    return jnp.reshape(jnp.asarray(v), (-1,) + (1,) * (ndim - 1))


def _check_of(data: Any) -> Any:
    """The check byte of the bytes ``data`` (uint32, bytes on the leading axis): a weighted
    sum of ``b + b*b`` modulo a prime. Not linear, so an average of two measurements (their
    sum over two counts) does not carry a matching check; a byte changed alone, or two
    swapped, changes it."""
    weights = _along(np.arange(1, 2 * data.shape[0], 2, dtype=np.uint32), data.ndim)
    return jnp.sum(weights * (data + data * data), axis=0) % _CHECK


def _shifts(dtype: Any, ndim: int) -> Any:
    return _along(np.arange(8 * (dtype.itemsize - 1), -1, -8, dtype=np.uint32), ndim)


# Coding and decoding are one program per dtype and shape: inlined inside a user's jit with
# their traces kept, one compiled program each when called eagerly (see _scales/scale.py).
@functools.partial(jax.jit, inline=True)
def _decode(part: _Bytes, count: jax.Array) -> jax.Array:
    coded = jnp.asarray(part.coded, _F32)
    c = jnp.reshape(count, jnp.shape(count) + (1,) * (coded.ndim - jnp.ndim(count)))
    parts = coded / c
    # a common factor (a pmean, a psum, a clip's) cancels; anything else is refused as NaN:
    # a site's state never takes a measurement mixed with others, or rounded
    rounded = jnp.round(parts)
    whole = (parts >= 0) & (parts <= 0xFF) & (jnp.abs(parts - rounded) < 0.25)
    data = rounded[:-1].astype(jnp.uint32)
    ok = (c[0] != 0) & jnp.all(whole, axis=0)
    ok = ok & (_check_of(data) == rounded[-1].astype(jnp.uint32))
    bits = jnp.sum(data << _shifts(part.dtype, data.ndim), axis=0, dtype=jnp.uint32)
    if part.dtype.itemsize == 2:
        value = lax.bitcast_convert_type(bits.astype(jnp.uint16), part.dtype)
    else:
        value = lax.bitcast_convert_type(bits, part.dtype)
    return jnp.where(ok, value, jnp.array(jnp.nan, part.dtype))


def _flatten_with_keys(m: Measured) -> tuple[tuple[tuple[Any, Any], ...], SiteKind]:
    return (
        (jax.tree_util.GetAttrKey("parts"), m.parts),
        (jax.tree_util.GetAttrKey("count"), m.count),
    ), m.kind


def _unflatten(kind: SiteKind, children: Any) -> Measured:
    parts, count = children
    return Measured(kind, parts, count)


jax.tree_util.register_pytree_with_keys(
    Measured, _flatten_with_keys, _unflatten, lambda m: ((m.parts, m.count), m.kind)
)


def _encode(leaf: Any) -> Any:
    if leaf is None or not hasattr(leaf, "dtype"):
        return None
    dtype = jnp.dtype(leaf.dtype)
    if dtype not in _PACKED:
        return None if not jnp.issubdtype(dtype, jnp.inexact) else leaf
    return _Bytes(_coded(leaf), dtype)


@functools.partial(jax.jit, inline=True)
def _coded(leaf: jax.Array) -> jax.Array:
    dtype = jnp.dtype(leaf.dtype)
    if dtype.itemsize == 2:
        bits = lax.bitcast_convert_type(leaf, jnp.uint16).astype(jnp.uint32)
    else:
        bits = lax.bitcast_convert_type(leaf, jnp.uint32)
    data = (bits[None] >> _shifts(dtype, bits.ndim + 1)) & 0xFF
    coded = jnp.concatenate([data, _check_of(data)[None]], axis=0)
    return coded.astype(_F32) * _UNIT


def _global(site: Site, axes: tuple[Any, ...], tracked: frozenset[Any]) -> Site:
    """The measurement reduced over the devices of the manual ``axes`` in scope: those it
    varies over where JAX tracks it (``tracked``: ``shard_map`` with ``check_vma``), every
    bound axis where JAX does not (``pmap``, ``check_vma=False``)."""
    leaves = [x for x in jax.tree_util.tree_leaves(site.value) if hasattr(x, "dtype")]
    varying = frozenset().union(*(varying_axes(x) for x in leaves))
    over = tuple(a for a in axes if a in varying or a not in tracked)
    if not over:
        return site

    def typed(x: Any) -> Any:  # every leaf varying over the tracked axes reduced
        if not hasattr(x, "dtype"):
            return x
        return vary_over(x, tuple(a for a in over if a in tracked and a not in varying_axes(x)))

    value = jax.tree_util.tree_map(typed, site.value)
    return Site(site.kind, site.kind.reduce(value, over))


def measured(grads: Any, *, reduce: bool = True) -> Any:
    """Every site's measurement in ``grads`` (what ``jax.grad`` gave at the sites) made
    global (unless ``reduce`` is False: global already) and coded as a :class:`Measured`;
    other leaves unchanged."""
    leaves = jax.tree_util.tree_leaves(grads, is_leaf=is_site)
    if not any(is_site(x) and not isinstance(x, Measured) for x in leaves):
        return grads  # no site: nothing to ask of the axes in scope
    axes = bound_axes() if reduce else ()
    # which axes JAX tracks, asked once per call (not once per site)
    tracked = tracked_axes(axes)

    def one(x: Any) -> Any:
        if not is_site(x) or isinstance(x, Measured):
            return x
        site = _global(x, axes, tracked) if axes else x
        parts = jax.tree_util.tree_map(_encode, site.value)
        return Measured(site.kind, parts, jnp.full((), _UNIT, _F32))

    return jax.tree_util.tree_map(one, grads, is_leaf=is_site)


def raw(grads: Any) -> Any:
    """``grads`` with every :class:`Measured` decoded into a plain :class:`Site` (for code
    that adds or carries measurements as floats: accumulation, retries)."""
    return jax.tree_util.tree_map(
        lambda x: Site(x.kind, x.value) if isinstance(x, Measured) else x, grads, is_leaf=is_site
    )
