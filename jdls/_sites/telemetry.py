"""Reading the probes: :class:`Telemetry`, one row per probe in forward order, and
:func:`plot_headroom`.

:meth:`Telemetry.of` takes the probes of a tree (the measurements of a step, or the sites
after :func:`jdls.update_sites`, which records the last measurement) and names each row after
its module, a stacked layer's rows numbered (``"blocks[3]"``).
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jdls._floats.lookup import finfo
from jdls._numerics.paths import path_key
from jdls._sites.probe import FIELDS, Probe
from jdls._sites.site import Site, is_site

_F32 = jnp.float32

__all__ = ["WRAPPED", "Telemetry", "plot_headroom"]


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
            # a probe without a value measured nothing (not differentiated: the gradient of
            # a frozen half, jdls warned SiteNotDifferentiated): no row
            if isinstance(site, Site) and isinstance(site.kind, Probe) and site.value is not None:
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
                f"{_flag(at(nonfinite, i)):>9}"
            )
            if uses is not None and np.isnan(at(uses, i)):
                line += f"  {'?':>4}  {_LOST}"
            elif uses is not None:
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


def _flag(x: float) -> str:
    """A row's non-finite flag: ``yes``, ``no``, or ``?`` where the measurement was lost."""
    return "?" if np.isnan(x) else ("yes" if x > 0 else "no")


#: A measurement that decodes to NaN (its ``uses`` too): something multiplied it by 0 or NaN.
_LOST = (
    "measurement lost: something multiplied the gradients by 0 or NaN before jdls saw them "
    "(optax.clip_by_global_norm in front of jdls.wrap on a non-finite step); jdls.clip keeps it"
)


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
