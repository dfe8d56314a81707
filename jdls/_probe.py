"""Cotangent probes: where in the backward pass precision is lost, layer by layer.

``probe(x, name)`` is the identity in the forward pass; in the backward pass it measures the
cotangent flowing through it (largest magnitude, fraction flushed to zero in the compute
format, fraction exactly zero, non-finite or not). The measurement leaves ``jax.grad`` as the
*cotangent of a dummy input*, the technique of Flax's fp8 ops (``flax/linen/fp8_ops.py``):
:func:`probed_value_and_grad` adds one zero input per probe and reads the statistics from
their gradients, with no side channel, under ``jit``, ``vmap``, ``shard_map`` and ``pmap`` of the
whole call alike. A probe acts only in the trace of its own differentiation: one inside a nested
transformation of the loss (an inner ``jit``, ``checkpoint``, ``scan``, inner ``vmap``) is
refused at trace time (``docs/contributing.md``, "Python state at trace time").

:func:`jdls.linen.probes` probes every Flax linen module's output without editing the model
(``flax.linen.intercept_methods``); :func:`jdls.nnx.probes` does the same for an NNX model.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jdls._context import ContextStack, current_trace, refuse_changed, refuse_nested
from jdls._filter import filtered_eval_shape, filtered_value_and_grad
from jdls._formats import FloatFormat, finfo
from jdls._nnx_hooks import hook_outputs, module_name
from jdls._norm import vary_like
from jdls._scale import LossScale

__all__ = [
    "Telemetry",
    "plot_headroom",
    "probe",
    "probe_linen",
    "probe_nnx",
    "probed_value_and_grad",
]

_F32 = jnp.float32
_FIELDS = 4  # amax, flushed fraction, zero fraction, non-finite


class _Collector:
    """The probes of one differentiation: their names in forward order, their dummies (None
    while the names are being discovered), and the trace the differentiated function runs in
    (a probe reached in any other trace is refused)."""

    def __init__(self, compute_dtype: Any, dummies: dict[str, jax.Array] | None) -> None:
        self.compute_dtype = compute_dtype
        self.dummies = dummies
        self.names: list[str] = []
        self.trace = current_trace()

    def key(self, name: str) -> str:
        key, k = name, 1
        while key in self.names:
            k += 1
            key = f"{name}#{k}"
        self.names.append(key)
        return key


_COLLECTORS: ContextStack[_Collector] = ContextStack()


def _flush_to_zero(x: jax.Array, compute_dtype: Any) -> jax.Array:
    """Where a nonzero value of ``x`` becomes zero in the compute format."""
    if isinstance(compute_dtype, FloatFormat):
        rounded = compute_dtype.round(x)
    else:
        rounded = x.astype(compute_dtype)
    return (x != 0) & (rounded == 0)


def _statistics(g: jax.Array, compute_dtype: Any) -> jax.Array:
    c = jnp.asarray(g).astype(_F32)
    n = max(c.size, 1)
    nonzero = jnp.sum(c != 0)
    amax = jnp.max(jnp.abs(c)) if c.size else jnp.zeros((), _F32)
    # its own reduction: XLA's max may drop a NaN (on CPU it does in large arrays)
    nonfinite = ~jnp.all(jnp.isfinite(c))
    if not isinstance(compute_dtype, FloatFormat) and jnp.dtype(g.dtype) == jnp.dtype(
        compute_dtype
    ):
        flushed = jnp.zeros((), _F32)  # already in the compute format: nothing flushes
    else:
        flushed = jnp.sum(_flush_to_zero(c, compute_dtype)) / jnp.maximum(nonzero, 1)
    return jnp.stack([amax, flushed, 1 - nonzero / n, nonfinite.astype(_F32)]).astype(_F32)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _probe_op(x: jax.Array, dummy: jax.Array, compute_dtype: Any) -> jax.Array:
    del dummy
    return x


def _probe_fwd(x: jax.Array, dummy: jax.Array, compute_dtype: Any) -> tuple[jax.Array, jax.Array]:
    return x, dummy


def _probe_bwd(compute_dtype: Any, dummy: jax.Array, g: jax.Array) -> tuple[jax.Array, jax.Array]:
    # Inside shard_map the dummy varies over every manual axis (each device measures its own
    # cotangents); a cotangent that does not vary is marked as varying, never summed.
    return g, vary_like(_statistics(g, compute_dtype), dummy)


_probe_op.defvjp(_probe_fwd, _probe_bwd)


def probe(x: Any, name: str) -> Any:
    """The identity; inside :func:`probed_value_and_grad`, measures the cotangent of ``x``.

    Outside a probed differentiation it returns ``x`` untouched (no cost). ``x`` may be a
    pytree: every float leaf is probed, named ``name``, ``name[1]``, ... A name used twice
    gets ``#2``, ``#3``, ... appended.

    A probe inside a nested transformation of the probed function (an inner ``jax.jit`` or
    jitted ``model.apply``, ``jax.checkpoint``, ``lax.scan``, an inner ``vmap``, their Flax
    versions) raises a ValueError at trace time: probe the transformed call's output instead,
    or transform the whole :func:`probed_value_and_grad` call.

    Args:
      x: an array (or pytree) of the forward pass, e.g. a layer's output.
      name: the label of the measurement.

    Returns:
      ``x``.

    Example:
      >>> import jax.numpy as jnp, jdls
      >>> def loss(w):
      ...     h = jdls.probe(w * 3.0, "h")
      ...     return jnp.sum(h * 1e-6)
      >>> fn = jdls.probed_value_and_grad(loss, jdls.StaticScale(1024.0))
      >>> value, grads, telemetry = fn(jnp.ones(2, jnp.float32))
      >>> telemetry.names, round(float(telemetry.amax[0]), 6)  # the scaled cotangent
      (('h',), 0.001024)
    """
    collector = _COLLECTORS.current()
    if collector is None:
        return x
    if current_trace() is not collector.trace:
        refuse_nested(
            f"jdls.probe({name!r})",
            "jdls.probed_value_and_grad",
            "Probe the value outside it (the transformed call's output), with "
            "jdls.probe by hand where jdls.linen.probes / jdls.nnx.probes reach inside.",
        )
    leaves, treedef = jax.tree_util.tree_flatten(x)
    out = []
    for i, leaf in enumerate(leaves):
        if not jnp.issubdtype(jnp.result_type(leaf), jnp.floating):
            out.append(leaf)
            continue
        key = collector.key(name if len(leaves) == 1 else f"{name}[{i}]")
        if collector.dummies is None:
            out.append(leaf)
        else:
            out.append(_probe_op(leaf, collector.dummies[key], collector.compute_dtype))
    return jax.tree_util.tree_unflatten(treedef, out)


class Telemetry(NamedTuple):
    """What the probes measured on one backward pass (on-device arrays, one entry per probe).

    The statistics are of the **scaled** cotangents, the values the compute format holds.

    Attributes:
      names: the probes' names in forward order (static); backward order is the reverse.
      amax: largest magnitude.
      flushed: fraction of the nonzero values that become zero in the compute format.
      zeros: fraction of values exactly zero.
      nonfinite: 1.0 where the cotangent held an inf or NaN, else 0.0.
    """

    names: tuple[str, ...]
    amax: jax.Array
    flushed: jax.Array
    zeros: jax.Array
    nonfinite: jax.Array

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
        """The first probe in backward order whose cotangent went non-finite (host side),
        or None.

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
        """``{name: {"amax", "flushed", "zeros", "nonfinite"}}`` as Python floats (host side).

        Example:
          >>> import jax.numpy as jnp, jdls
          >>> jdls.Telemetry(("a",), *[jnp.ones(1)] * 4).as_dict()["a"]["amax"]
          1.0
        """
        values = jax.device_get((self.amax, self.flushed, self.zeros, self.nonfinite))
        return {
            name: {
                key: float(np.asarray(v)[..., i].max())
                for key, v in zip(("amax", "flushed", "zeros", "nonfinite"), values, strict=True)
            }
            for i, name in enumerate(self.names)
        }


def _flatten_telemetry(t: Telemetry) -> tuple[tuple[jax.Array, ...], tuple[str, ...]]:
    return (t.amax, t.flushed, t.zeros, t.nonfinite), t.names


jax.tree_util.register_pytree_node(
    Telemetry,
    _flatten_telemetry,
    lambda names, children: Telemetry(names, *children),
)


def probed_value_and_grad(
    fun: Callable[..., Any],
    scale: LossScale,
    argnums: int | Sequence[int] = 0,
    has_aux: bool = False,
    compute_dtype: Any = "float16",
) -> Callable[..., tuple[Any, Any, Telemetry]]:
    """``scale.value_and_grad(fun)`` that also returns what the probes in ``fun`` measured.

    Every :func:`probe` reached while ``fun`` runs (also through :func:`jdls.linen.probes` or
    :func:`jdls.nnx.probes`) gets a zero dummy input; their gradients are the statistics.

    Args:
      fun: the loss function (returns a scalar, or ``(scalar, aux)`` with ``has_aux``).
      scale: the loss scale, e.g. ``jdls.get_scale(opt_state)``.
      argnums: positional argument(s) to differentiate.
      has_aux: whether ``fun`` returns ``(loss, aux)``.
      compute_dtype: the format whose flushing to zero the probes count (``"float16"``,
        ``"bfloat16"``, a :class:`jdls.FloatFormat`, ...).

    Returns:
      A function of ``fun``'s arguments returning ``(value, grads, telemetry)``, where
      ``value`` and ``grads`` are what ``scale.value_and_grad`` returns and ``telemetry`` a
      :class:`Telemetry`.

    Example:
      >>> import jax, jax.numpy as jnp, jdls
      >>> def loss(w):
      ...     return jnp.sum(jdls.probe(w.astype(jnp.float16), "cast").astype(jnp.float32)) * 1e-9
      >>> fn = jax.jit(jdls.probed_value_and_grad(loss, jdls.StaticScale(1.0)))
      >>> _, grads, t = fn(jnp.ones(3))
      >>> t.names, float(t.zeros[0])  # 1e-9 flushes to zero in float16
      (('cast',), 1.0)
    """
    finfo(compute_dtype)  # a clear error for a bad format
    nums = (argnums,) if isinstance(argnums, int) else tuple(argnums)

    def with_dummies(
        names: list[str], dummies: dict[str, jax.Array], *args: Any, **kwargs: Any
    ) -> Any:
        with _COLLECTORS.push(_Collector(compute_dtype, dummies)) as reached:
            out = fun(*args, **kwargs)
        if reached.names != names:
            refuse_changed("probes", "jdls.probed_value_and_grad", names, reached.names)
        loss, aux = out if has_aux else (out, None)
        return scale.scale(loss), (loss, aux)

    grad_fn = filtered_value_and_grad(
        with_dummies, (1, *(n + 2 for n in nums)), True, "probed_value_and_grad"
    )

    def value_and_grad_fn(*args: Any, **kwargs: Any) -> tuple[Any, Any, Telemetry]:
        found: list[str] = []

        def discover(*diff: Any) -> None:
            # The names only. The arguments not differentiated pass through as themselves
            # (Python values stay Python values, as with jax.value_and_grad).
            full = list(args)
            for n, d in zip(nums, diff, strict=True):
                full[n] = d
            with _COLLECTORS.push(_Collector(compute_dtype, None)) as discovery:
                fun(*full, **kwargs)
            found.extend(discovery.names)

        if any(n >= len(args) or n < -len(args) for n in nums):
            raise ValueError(
                f"argnums {argnums} asks for an argument that the call does not have: it was "
                f"given {len(args)} positional arguments"
            )
        filtered_eval_shape(discover, *(args[n] for n in nums))
        names = tuple(found)
        dummies = {n: jnp.zeros((_FIELDS,), _F32) for n in names}
        manual = tuple(getattr(jax.sharding.get_abstract_mesh(), "manual_axes", ()))
        if manual:  # inside shard_map: each device measures its own cotangents
            dummies = {n: jax.lax.pcast(d, manual, to="varying") for n, d in dummies.items()}
        (_, (loss, aux)), (stats, *grads) = grad_fn(found, dummies, *args, **kwargs)
        grads = scale.unscale(grads[0] if isinstance(argnums, int) else tuple(grads))
        table = jnp.stack([stats[n] for n in names]) if names else jnp.zeros((0, _FIELDS), _F32)
        telemetry = Telemetry(names, *(table[:, i] for i in range(_FIELDS)))
        value = (loss, aux) if has_aux else loss
        return value, grads, telemetry

    return value_and_grad_fn


@contextlib.contextmanager
def probe_linen() -> Iterator[None]:
    """Within this context, the output of every Flax linen module's ``__call__`` is probed,
    named by the module's path (``"Dense_0"``, ``"Block_1/Dense_0"``).

    Use it inside the loss function given to :func:`probed_value_and_grad`; the model needs
    no change.

    Example:
      >>> import jax, jax.numpy as jnp, flax.linen as nn, jdls
      >>> model = nn.Sequential([nn.Dense(4), nn.relu, nn.Dense(1)])
      >>> params = model.init(jax.random.key(0), jnp.ones((1, 3)))
      >>> def loss(p):
      ...     with jdls.linen.probes():
      ...         return jnp.sum(model.apply(p, jnp.ones((2, 3))))
      >>> _, _, t = jdls.probed_value_and_grad(loss, jdls.StaticScale(8.0))(params)
      >>> t.names
      ('layers_0', 'layers_2', '')
    """
    import flax.linen as nn

    def interceptor(next_fun: Callable[..., Any], args: Any, kwargs: Any, context: Any) -> Any:
        out = next_fun(*args, **kwargs)
        if context.method_name != "__call__" or _COLLECTORS.current() is None:
            return out
        return probe(out, "/".join(str(p) for p in context.module.path))

    with nn.intercept_methods(interceptor):
        yield


@contextlib.contextmanager
def probe_nnx(model: Any) -> Iterator[None]:
    """Within this context, the output of every submodule of the NNX ``model`` (and of the
    model itself) is probed, named by its path (``"blocks/0/up"``).

    The modules' classes are swapped for probing subclasses while the context is open, and
    restored on exit (as :func:`jdls.nnx.layer_boundaries` does; the two nest); use it inside
    the loss function given to :func:`probed_value_and_grad` (or ``jdls.nnx.value_and_grad``'s
    function), around the model call.

    Example:
      >>> import jax.numpy as jnp, jdls
      >>> from flax import nnx
      >>> model = nnx.Sequential(nnx.Linear(3, 4, rngs=nnx.Rngs(0)), nnx.Linear(4, 1, rngs=nnx.Rngs(1)))
      >>> def loss(x):
      ...     with jdls.nnx.probes(model):
      ...         return jnp.sum(model(x))
      >>> _, _, t = jdls.probed_value_and_grad(loss, jdls.StaticScale(8.0))(jnp.ones((2, 3)))
      >>> t.names
      ('layers/0', 'layers/1', '')
    """
    from flax import nnx

    hooks = [
        (module, functools.partial(probe, name=module_name(path)))
        for path, module in nnx.iter_modules(model)
    ]
    with hook_outputs(hooks):
        yield


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
        ax.plot(x, bits[:, i], label=name or "(model)", linewidth=1.2)
    ax.axhline(0, color="k", linewidth=0.8)
    ax.set_xlabel("step")
    ax.set_ylabel(f"headroom (bits below the {finfo(compute_dtype).dtype} maximum)")
    ax.legend(fontsize=7, ncol=2)
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    if path is not None:
        fig.savefig(path, dpi=110)
    return fig
