"""Cotangent probes: where in the backward pass precision is lost, layer by layer.

A probe is a site (``jdls/_sites/site.py``) of kind :class:`Probe`: ``jdls.apply_site(x, site)`` is
the identity in the forward pass, and in the backward pass it measures the cotangent flowing
through it (largest magnitude, how many values, how many nonzero, how many flushed to zero in
the compute format, how many non-finite) and returns the measurement as the cotangent of the
site's value. The counts are sums, so they stay right where JAX adds up the cotangents of a
site used several times (a loop body, an inner ``vmap`` over an unbatched site); the largest
magnitude is right where each use has its own site (stacked along the scan axis, batched along
the ``vmap`` axis), and :class:`Telemetry` reports it as NaN where a site served several uses.

:meth:`Telemetry.of` reads the probes of a tree (the measurements of a step, or the sites after
:func:`jdls.update_sites`, which records the last measurement).
"""

from __future__ import annotations

import dataclasses
import re
import warnings
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jdls._floats.formats import FloatFormat
from jdls._floats.lookup import canonical_format, finfo
from jdls._numerics.paths import path_key
from jdls._sites.site import Site, SiteKind, is_site

__all__ = ["WRAPPED", "Probe", "Telemetry", "plot_headroom"]

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


class _Entry(NamedTuple):
    keys: tuple[str, ...]  # the module's path
    kind: Probe
    value: jax.Array
    stack: tuple[int, ...]  # the leading axes of a stack of sites
    call: str  # which call of the module: "" (its __call__), ".decode", "#2", ".decode#2"


#: The field in which a framework's wrapper holds the module it puts sites after
#: (``jdls.equinox.Sited``): left out of a row's name, which is the wrapped module's.
WRAPPED = "jdls_wrapped"

#: A framework's probe variable after a module call (``jdls.linen.probes``): ``"probe"``, or
#: ``"probe.decode"`` after its method ``decode``, ``"probe#2"`` after its second call.
_CALL_PROBE = re.compile(r"(?:jdls_)?probe((?:\.[A-Za-z_]\w*)?(?:#\d+)?)")


def _base(entries: Sequence[_Entry], n: int) -> tuple[int, int, int]:
    """The order of the ``n``-th probe (tree order) alone: its position, then the probes
    without one in tree order."""
    position = entries[n].kind.position
    return (0, int(position), n) if position is not None else (1, 0, n)


def _group(entries: Sequence[_Entry], n: int) -> _Entry:
    """The stack the ``n``-th probe is part of: the probe of the outermost module around it
    (or itself) stacked along the same leading axes (a scanned block, whose submodules'
    probes are stacked with it), or the stack its kind names (:class:`Probe`'s ``stack``);
    the probe itself where there is none."""
    mine = entries[n]
    if not mine.stack:
        return mine
    if mine.kind.stack is not None:  # inside a stack without a probe of its own
        return _Entry(tuple(mine.kind.stack), mine.kind, mine.value, mine.stack, "")
    for other in sorted(entries, key=lambda e: len(e.keys)):
        if (
            other.stack
            and other.keys == mine.keys[: len(other.keys)]
            and mine.stack[: len(other.stack)] == other.stack
        ):
            return other
    return mine


class Telemetry(NamedTuple):
    """What the probes measured on one backward pass (on-device arrays, one row per probe).

    The statistics are of the **scaled** cotangents, the values the compute format holds.
    Build it with :meth:`of`.

    Attributes:
      names: the probes' paths in the tree (static), ``"blocks[3]"`` for the fourth site
        of a stack; a probe at the root of the tree takes its kind's ``name`` (``jdls.nnx``:
        the model's class name), else ``"(root)"``. The rows are in forward order: by each
        probe's ``position`` (:class:`Probe`), a stack's sites in index order; probes
        without a position follow, in tree order.
      amax: largest magnitude; NaN where the site was not passed through exactly once (not
        reached, or one site shared by several uses, where JAX adds up the measurements).
      flushed: fraction of the nonzero values that become zero in the compute format (0.0
        where none is nonzero).
      zeros: fraction of values exactly zero.
      nonfinite: 1.0 where the cotangent held an inf or NaN, else 0.0.
      uses: how many times each site was passed through (None when built by hand).
    """

    names: tuple[str, ...]
    amax: jax.Array
    flushed: jax.Array
    zeros: jax.Array
    nonfinite: jax.Array
    uses: Any = None

    @classmethod
    def of(cls, tree: Any) -> Telemetry:
        """The telemetry of every :class:`Probe` site in ``tree``, in forward order.

        ``tree`` holds the measurements of a step (the sites' gradients) or the sites after
        :func:`jdls.update_sites`. A stack of sites (a scanned stack of layers) gives a row
        per site. The rows follow the probes' ``position`` (set by ``jdls.linen.probes`` and
        ``jdls.nnx.probes``), then, for probes without one, the tree's order; read one
        model's probes at a time (their positions count from 0 in each model).

        Example:
          >>> import jdls
          >>> jdls.Telemetry.of({"blocks": jdls.Site(jdls.Probe()).stacked(2)}).names
          ('blocks[0]', 'blocks[1]')
          >>> late, early = jdls.Site(jdls.Probe(position=1)), jdls.Site(jdls.Probe(position=0))
          >>> jdls.Telemetry.of({"layers_10": late, "layers_9": early}).names
          ('layers_9', 'layers_10')
        """
        found = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_site)[0]
        entries = []
        for path, site in found:
            if isinstance(site, Site) and isinstance(site.kind, Probe):
                keys = [str(path_key(k)) for k in path if path_key(k) != WRAPPED]
                if keys[-1:] == ["value"]:  # an NNX Variable's value
                    keys = keys[:-1]
                call = ""
                framework = _CALL_PROBE.fullmatch(keys[-1]) if keys else None
                if framework:  # a framework's probe: its module, and which call of it
                    keys, call = keys[:-1], framework.group(1)
                value = jnp.asarray(site.value, _F32)
                entries.append(_Entry(tuple(keys), site.kind, value, value.shape[:-1], call))
        names: list[str] = []
        keys_of_rows: list[tuple[Any, ...]] = []
        groups = [_group(entries, n) for n in range(len(entries))]
        # a stack's place: that of its first probe (a probe outside stacks: its own)
        first: dict[tuple[Any, ...], tuple[int, int, int]] = {}
        where = [(g.keys, g.call if not g.stack else "") for g in groups]
        for n, group in enumerate(where):
            first[group] = min(first.get(group, _base(entries, n)), _base(entries, n))
        for n, (module, kind, _, stack, call) in enumerate(entries):
            name = ("/".join(module) or kind.name or "(root)") + call
            outer = len(groups[n].stack)
            for index in np.ndindex(*stack):
                names.append(f"{name}[{','.join(map(str, index))}]" if stack else name)
                # a stack's layers one after the other, each layer's probes in their order
                place = (first[where[n]], index[:outer], _base(entries, n), index[outer:])
                keys_of_rows.append(place)
        order = sorted(range(len(names)), key=keys_of_rows.__getitem__)
        rows = [e.value.reshape(-1, len(FIELDS)) for e in entries]
        table = jnp.concatenate(rows) if rows else jnp.zeros((0, len(FIELDS)), _F32)
        if order != list(range(len(order))):
            table = table[np.asarray(order, np.int32)]
        ordered = tuple(names[i] for i in order)
        amax, count, nonzero, flushed, nonfinite, uses = (table[:, i] for i in range(6))
        return cls(
            ordered,
            jnp.where(uses == 1, amax, jnp.nan),
            flushed / jnp.maximum(nonzero, 1),
            jnp.where(count > 0, 1 - nonzero / jnp.maximum(count, 1), 0.0),
            (nonfinite > 0).astype(_F32),
            uses,
        )

    def headroom_bits(self, compute_dtype: Any = "float16") -> jax.Array:
        """Bits between each probe's largest magnitude and the format's maximum
        (``log2(fmax / amax)``; negative: overflowed; inf: all zero).

        Example:
          >>> import jax.numpy as jnp, jdls
          >>> t = jdls.Telemetry(("a",), jnp.array([2.0**10]), *[jnp.zeros(1)] * 3)
          >>> t.headroom_bits().round(2).tolist()
          [6.0]
        """
        return jnp.log2(_F32(finfo(compute_dtype).max)) - jnp.log2(self.amax)

    def first_nonfinite(self) -> str | None:
        """The last row (in forward order, :meth:`of`) whose cotangent went non-finite (host
        side), or None: the first probe the backward pass reached with an inf or a NaN. The
        cotangent at a row is what the backward pass of the code after it (in forward
        order: the next row's module, or the loss after the last row) produced, so that is
        where the overflow started: a row named ``"layers[1]"`` points at ``layers[2]``'s
        backward pass, the last row at the loss and its scale.

        Example:
          >>> import jax.numpy as jnp, jdls
          >>> z = jnp.zeros(2)
          >>> jdls.Telemetry(("a", "b"), z, z, z, jnp.array([1.0, 1.0])).first_nonfinite()
          'b'
        """
        flags = np.asarray(jax.device_get(self.nonfinite)).reshape(-1, len(self.names))
        hit = np.nonzero(flags.any(axis=0))[0]
        return self.names[int(hit[-1])] if hit.size else None

    def as_dict(self) -> dict[str, dict[str, float]]:
        """``{name: {"amax", "flushed", "zeros", "nonfinite", "uses"}}`` as Python floats
        (host side; ``"uses"`` where known).

        A row whose site was not passed through exactly once has a NaN ``amax``; where a
        site served several uses, a warning names the rows and the fix (:meth:`table` says
        it in the row).

        Example:
          >>> import jax.numpy as jnp, jdls
          >>> jdls.Telemetry(("a",), *[jnp.ones(1)] * 4).as_dict()["a"]["amax"]
          1.0
        """
        fields = ("amax", "flushed", "zeros", "nonfinite", "uses")
        values = jax.device_get((self.amax, self.flushed, self.zeros, self.nonfinite, self.uses))
        rows = {
            name: {
                key: float(np.asarray(v)[..., i].max())
                for key, v in zip(fields, values, strict=True)
                if v is not None
            }
            for i, name in enumerate(self.names)
        }
        shared = [
            f"{n} ({row['uses']:.0f} uses)" for n, row in rows.items() if row.get("uses", 1) > 1
        ]
        if shared:
            warnings.warn(
                f"probes used more than once in one step: {', '.join(shared)}. JAX adds up "
                f"the measurements of a shared site, so their amax is NaN. {_ONE_PER_USE}",
                stacklevel=2,
            )
        return rows

    def table(self, compute_dtype: Any = "float16") -> str:
        """The rows as text to print, one line per probe in forward order (host side).

        Columns: the largest magnitude, the headroom in bits below ``compute_dtype``'s
        maximum (:meth:`headroom_bits`), the fractions flushed and zero, non-finite, and the
        uses. A row whose ``amax`` is NaN says why and what to do: its site served several
        uses (a module called twice, a loop body; JAX adds up their measurements), or none
        (a branch not taken).

        Example:
          >>> import jax.numpy as jnp, jdls
          >>> z = jnp.zeros(2)
          >>> amax, uses = jnp.array([2.0**10, jnp.nan]), jnp.array([1.0, 2.0])
          >>> print(jdls.Telemetry(("embed", "drop"), amax, z, z, z, uses).table())
          probe        amax  headroom  flushed   zeros  nonfinite  uses
          embed     1.02e+03       6.0     0.0%    0.0%         no     1
          drop           nan       nan     0.0%    0.0%         no     2  used 2 times in one step: ...
        """
        host = jax.device_get(
            (self.amax, self.headroom_bits(compute_dtype), self.flushed, self.zeros)
        )
        amax, headroom, flushed, zeros = (np.asarray(v) for v in host)
        nonfinite = np.asarray(jax.device_get(self.nonfinite))
        uses = None if self.uses is None else np.asarray(jax.device_get(self.uses))

        def at(v: np.ndarray, i: int) -> float:  # a history's rows (leading axes): the largest
            return float(v.reshape(-1, len(self.names))[:, i].max())

        width = max([len("probe"), *map(len, self.names)])
        head = f"{'probe':<{width}}  {'amax':>8}  {'headroom':>8}  {'flushed':>7}  {'zeros':>6}"
        lines = [head + "  nonfinite" + ("  uses" if uses is not None else "")]
        for i, name in enumerate(self.names):
            line = (
                f"{name:<{width}}  {at(amax, i):>8.3g}  {at(headroom, i):>8.1f}  "
                f"{at(flushed, i):>7.1%}  {at(zeros, i):>6.1%}  "
                f"{'yes' if at(nonfinite, i) > 0 else 'no':>9}"
            )
            if uses is not None:
                n = round(at(uses, i))
                line += f"  {n:>4}"
                if n > 1:
                    line += (
                        f"  used {n} times in one step: amax unknown (JAX adds up a shared "
                        f"site's measurements); {_ONE_PER_USE_SHORT}"
                    )
                elif n == 0:
                    line += "  not used this step (a branch not taken): nothing measured"
            lines.append(line)
        return "\n".join(lines)


#: The fix for a site shared by several uses, in :meth:`Telemetry.as_dict`'s warning.
_ONE_PER_USE = (
    "Give each use its own site: one jdls.Probe per call, and in a loop sites stacked along "
    "the loop axis (jdls.linen.probes makes one per module call: a module called twice has "
    "rows 'name' and 'name#2')."
)
_ONE_PER_USE_SHORT = (
    "give each use its own site (one jdls.Probe per call; in a loop, sites stacked along "
    "the loop axis)"
)


def _flatten_telemetry(t: Telemetry) -> tuple[tuple[Any, ...], tuple[str, ...]]:
    return (t.amax, t.flushed, t.zeros, t.nonfinite, t.uses), t.names


jax.tree_util.register_pytree_node(
    Telemetry,
    _flatten_telemetry,
    lambda names, children: Telemetry(names, *children),
)


def plot_headroom(
    history: Sequence[Telemetry],
    compute_dtype: Any = "float16",
    path: str | None = None,
    steps: Sequence[int] | None = None,
) -> Any:
    """Plot each probe's headroom (bits to the format's maximum) over training.

    Needs matplotlib (``pip install matplotlib``).

    Args:
      history: one :class:`Telemetry` per recorded step (host or device arrays).
      compute_dtype: the format whose maximum the headroom is measured against.
      path: where to save the figure (None: not saved).
      steps: the step of each entry (default ``0, 1, ...``).

    Returns:
      The matplotlib ``Figure``.

    Example:
      >>> import jax.numpy as jnp, jdls
      >>> z = jnp.zeros(1)
      >>> h = [jdls.Telemetry(("a",), jnp.array([2.0**k]), z, z, z) for k in range(3)]
      >>> fig = jdls.plot_headroom(h)
      >>> fig.axes[0].get_ylabel()
      'headroom (bits below the float16 maximum)'
    """
    try:
        import matplotlib

        matplotlib.use("Agg") if path is not None else None
        import matplotlib.pyplot as plt
    except ImportError:
        raise ImportError("plot_headroom needs matplotlib: pip install matplotlib") from None
    if not history:
        raise ValueError("history must hold at least one Telemetry, got none")
    names = history[0].names
    bits = np.stack([np.asarray(t.headroom_bits(compute_dtype)) for t in history])
    x = np.arange(len(history)) if steps is None else np.asarray(steps)
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for i, name in enumerate(names):
        ax.plot(x, bits[:, i], label=name or "(root)", linewidth=1.2)
    ax.axhline(0, color="k", linewidth=0.8)
    ax.set_xlabel("step")
    ax.set_ylabel(f"headroom (bits below the {finfo(compute_dtype).dtype} maximum)")
    ax.legend(fontsize=7, ncol=2)
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    if path is not None:
        fig.savefig(path, dpi=110)
    return fig
