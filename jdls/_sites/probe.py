"""Cotangent probes: where in the backward pass precision is lost, layer by layer.

A probe is a site (``jdls/_sites/site.py``) of kind :class:`Probe`: ``jdls.apply_site(x, site)`` is
the identity in the forward pass, and in the backward pass it measures the cotangent flowing
through it (largest magnitude, how many values, how many nonzero, how many flushed to zero in
the compute format, how many non-finite) and returns the measurement as the cotangent of the
site's value. The counts are sums, so they stay right where JAX adds up the cotangents of a
site used several times (a loop body, an inner ``vmap`` over an unbatched site); the largest
magnitude is right where each use has its own site (stacked along the scan axis, batched along
the ``vmap`` axis), and :class:`Telemetry` reports it as NaN where a site served several uses.

``jdls/_sites/telemetry.py`` reads them: :meth:`Telemetry.of` takes the probes of a tree (the
measurements of a step, or the sites after :func:`jdls.update_sites`, which records the last
measurement).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jdls._floats.formats import FloatFormat
from jdls._floats.lookup import canonical_format, finfo
from jdls._sites.site import SiteKind

__all__ = ["FIELDS", "Probe", "statistics"]

_F32 = jnp.float32
FIELDS = ("amax", "count", "nonzero", "flushed", "nonfinite", "uses")


def _flushed(x: jax.Array, compute_dtype: Any) -> jax.Array:
    """Where a nonzero value of ``x`` becomes zero in the compute format."""
    if isinstance(compute_dtype, FloatFormat):
        rounded = compute_dtype.round(x)
    else:
        rounded = x.astype(compute_dtype)
    return (x != 0) & (rounded == 0)


_COUNT_LIMIT = 2**31 - 1  # int32 counts are exact up to here


def _counted_float16(g: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """:func:`_counted` of a float16 ``g`` in float16 compute, in one integer pass over its
    bits: the magnitude's bits ``m`` order like the magnitudes (a NaN above inf, so a NaN
    is the largest magnitude, never dropped), ``m != 0`` is a nonzero value, ``m >= inf``
    a non-finite one; nothing flushes. Exact: a float16 value is never a float32 subnormal,
    so the float tests it replaces do not depend on the backend's flushing of those."""
    inf = int(np.array(np.inf, np.float16).view(np.uint16))
    m = jax.lax.bitcast_convert_type(g, jnp.uint16).astype(jnp.int32) & 0x7FFF
    big, nonzero, nonfinite = jax.lax.reduce(
        (m, (m != 0).astype(jnp.int32), (m >= inf).astype(jnp.int32)),
        (jnp.zeros((), jnp.int32),) * 3,
        lambda p, q: (jnp.maximum(p[0], q[0]), p[1] + q[1], p[2] + q[2]),
        tuple(range(g.ndim)),
    )
    amax = jax.lax.bitcast_convert_type(big.astype(jnp.uint16), jnp.float16)
    return amax, nonzero, jnp.zeros((), jnp.int32), nonfinite


def _counted(g: jax.Array, compute_dtype: Any) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """Largest magnitude of ``g`` (one max) and its nonzero, flushed and non-finite values
    (one variadic int32 sum); a float16 ``g`` in float16 compute in one integer pass."""
    same = not isinstance(compute_dtype, FloatFormat) and g.dtype == jnp.dtype(compute_dtype)
    if same and g.dtype == jnp.float16 and g.size <= _COUNT_LIMIT:
        return _counted_float16(g)
    big = jnp.max(jnp.abs(g))
    codes = [g != 0, ~jnp.isfinite(g)]
    if not same:  # already in the compute format: nothing flushes
        codes.append(_flushed(g, compute_dtype))
    n = len(codes)
    if g.size > _COUNT_LIMIT:  # too many for int32: float32 sums, one per count
        sums = [jnp.sum(c, dtype=_F32) for c in codes]
    else:
        sums = jax.lax.reduce(
            tuple(c.astype(jnp.int32) for c in codes),
            (jnp.zeros((), jnp.int32),) * n,
            lambda p, q: tuple(p[i] + q[i] for i in range(n)),
            tuple(range(g.ndim)),
        )
    lost = sums[2] if n > 2 else jnp.zeros((), jnp.int32)
    return big, sums[0], lost, sums[1]


def statistics(leaves: Sequence[jax.Array], compute_dtype: Any) -> jax.Array:
    """The probe's measurement of the cotangents ``leaves``: float32 ``FIELDS``.

    Each leaf is read in its own format (no float32 copy): its largest magnitude is one max,
    its three counts (nonzero, flushed, non-finite) one variadic reduction in int32 (exact
    below 2**31 values). The non-finite count is its own sum, not read off the
    maximum: XLA's max may drop a NaN (on CPU it does in large arrays). A float16 leaf in
    float16 compute is read in one integer pass over its bits (the same values; its largest
    magnitude is NaN whenever it holds a NaN).
    """
    amax, count, nonzero, flushed, nonfinite = (jnp.zeros((), _F32) for _ in range(5))
    for g in leaves:
        g = jnp.asarray(g)
        if g.dtype not in (jnp.float16, jnp.bfloat16, jnp.float32):
            g = g.astype(_F32)
        count = count + g.size
        if not g.size:
            continue
        big, nz, lost, bad = _counted(g, compute_dtype)
        amax = jnp.maximum(amax, big.astype(_F32))
        nonzero = nonzero + nz.astype(_F32)
        flushed = flushed + lost.astype(_F32)
        nonfinite = nonfinite + bad.astype(_F32)
    return jnp.stack([amax, count, nonzero, flushed, nonfinite, jnp.ones((), _F32)])


@dataclasses.dataclass(frozen=True)
class Probe(SiteKind):
    """A site kind that measures the cotangent of what passes through it (the identity
    forward).

    Its value is the last measurement, float32 ``(6,)``: largest magnitude, values,
    nonzero values, values flushed to zero in ``compute_dtype``, non-finite values, uses
    (how many times the site was passed through). The statistics are of the **scaled**
    cotangents, the values the compute format holds. :func:`jdls.update_sites` records the
    measurement, on skipped steps too (they are the ones worth reading).

    Args:
      compute_dtype: the format whose flushing to zero the probe counts (``"float16"``,
        ``"bfloat16"``, a :class:`jdls.FloatFormat`, ...).
      position: the probe's place in the model's forward order (the order in which the
        probed modules return), or None. :meth:`Telemetry.of` orders its rows by it, so that
        the rows follow the forward pass whatever order the tree's keys sort in
        (``"layers_10"`` before ``"layers_9"``). ``jdls.linen.probes`` and
        ``jdls.nnx.probes`` set it when the model is initialised or built; it is
        configuration, kept by ``jit``, ``nnx.split`` / ``nnx.merge`` and a checkpoint's
        restore alike.
      name: what :class:`Telemetry` calls a probe whose path in the tree is empty (the
        root module's probe in NNX: its class name).
      stack: the path in the tree of the stack of layers the probe is inside, where that
        stack has no probe of its own (``jdls.equinox.probes`` of modules inside an
        ``eqx.filter_vmap`` stack), or None: :class:`Telemetry` then gives the stack's rows
        layer by layer, each layer's probes in their order, as it does inside a probed
        stack.

    Example:
      >>> import jax, jax.numpy as jnp, jdls
      >>> sites = {"h": jdls.Site(jdls.Probe())}
      >>> def loss(w, sites):
      ...     return jnp.sum(jdls.apply_site(w * 3.0, sites["h"]) * 1e-6)
      >>> fn = jax.jit(jdls.StaticScale(1024.0).value_and_grad(loss, argnums=(0, 1)))
      >>> _, (grads, measured) = fn(jnp.ones(2), sites)
      >>> t = jdls.Telemetry.of(measured)
      >>> t.names, round(float(t.amax[0]), 6)  # the scaled cotangent
      (('h',), 0.001024)
    """

    compute_dtype: Any = "float16"
    position: int | None = None
    name: str | None = None
    stack: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        finfo(self.compute_dtype)  # a clear error for a bad format
        if self.position is not None and (
            not isinstance(self.position, int | np.integer) or isinstance(self.position, bool)
        ):
            raise TypeError(
                f"Probe(position=...) takes an int (the place in the forward order) or None, "
                f"got {self.position!r}"
            )
        # one spelling per format, so that equal probes compare, hash and key jit's cache alike
        object.__setattr__(self, "compute_dtype", canonical_format(self.compute_dtype))

    def init(self) -> jax.Array:
        return jnp.zeros((len(FIELDS),), _F32)

    def backward(self, residuals: Any, g: Any) -> tuple[Any, jax.Array]:
        del residuals
        return g, statistics(g, self.compute_dtype)

    def accumulate(self, a: jax.Array, b: jax.Array) -> jax.Array:
        """Two micro-batches' measurements (``jdls.accumulate``): as two devices' (the largest
        magnitude and the uses by max, the counts summed), so a probe used once per
        micro-batch reads as one use with the step's largest magnitude."""
        by_max = jnp.array([f in ("amax", "uses") for f in FIELDS])
        return jnp.where(by_max, jnp.maximum(a, b), a + b)

    def reduce(self, measurement: jax.Array, axis_name: Any) -> jax.Array:
        # the largest magnitude and the uses (1 on each device) by max, the counts by sum
        largest = jax.lax.pmax(measurement, axis_name)
        summed = jax.lax.psum(measurement, axis_name)
        by_max = jnp.array([f in ("amax", "uses") for f in FIELDS])
        return jnp.where(by_max, largest, summed)

    def update(self, value: jax.Array, measurement: jax.Array, finite: jax.Array) -> jax.Array:
        del value, finite
        return measurement
