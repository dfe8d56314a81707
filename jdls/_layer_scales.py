"""Per-layer scales: each layer's backward pass computes at its own scale.

``rescale_boundary(x, ratio)`` is the identity forward; backward it multiplies the cotangent
by ``ratio`` (a ``custom_vjp``). :func:`layer_scaled_value_and_grad` places one at every
:func:`layer_boundary` (a layer's output), with the ratio of the neighbouring layers' scales,
``s[k] / s[k+1]``, and scales the loss by the last layer's scale: the cotangent inside layer
``k`` is then ``s[k]`` times the true one, and layer ``k``'s parameter gradients are unscaled
by ``s[k]``, exactly (powers of two). :func:`adjust_layer_scales` is the rule: every scale is
adjusted from its own layer's gradients (``jdls.rules.Adaptive`` per layer), and none grows
on a step where any gradient is non-finite.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import jax
import jax.numpy as jnp

from jdls._checks import all_finite
from jdls._context import ContextStack, current_trace, refuse_changed, refuse_nested
from jdls._filter import filtered_eval_shape, filtered_value_and_grad
from jdls._norm import tree_amax
from jdls._scale import DynamicScale, LossScale, check_scale

__all__ = [
    "adjust_layer_scales",
    "layer_boundaries_linen",
    "layer_boundary",
    "layer_scaled_value_and_grad",
    "rescale_boundary",
]

_F32 = jnp.float32


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


class _Layers:
    """The boundaries of one differentiation: names in forward order, the ratios (None
    while the names are being discovered), and the trace the differentiated function runs in
    (a boundary reached in any other trace is refused)."""

    def __init__(self, ratios: dict[str, jax.Array] | None) -> None:
        self.ratios = ratios
        self.names: list[str] = []
        self.trace = current_trace()


_LAYERS: ContextStack[_Layers] = ContextStack()


def layer_boundary(x: Any, name: str) -> Any:
    """Mark ``x`` as the output of layer ``name``: the identity, except inside
    :func:`layer_scaled_value_and_grad`, where the backward pass changes scale here from the
    next layer's to this layer's.

    A boundary inside a nested transformation of the differentiated function (an inner
    ``jax.jit`` or jitted ``model.apply``, ``jax.checkpoint``, ``lax.scan``, an inner
    ``vmap``, their Flax versions) raises a ValueError at trace time: mark the transformed
    call's output instead, or transform the whole :func:`layer_scaled_value_and_grad` call.

    Args:
      x: the layer's output (array or pytree).
      name: the layer's name, a key of the parameters and of the scales.

    Returns:
      ``x``.

    Example:
      >>> import jax.numpy as jnp, jdls
      >>> jdls.layer_boundary(jnp.ones(2), "dense_0").tolist()  # outside: the identity
      [1.0, 1.0]
    """
    layers = _LAYERS.current()
    if layers is None:
        return x
    if current_trace() is not layers.trace:
        refuse_nested(
            f"jdls.layer_boundary({name!r})",
            "jdls.layer_scaled_value_and_grad",
            "Mark the layer outputs outside it (around the transformed call); a layer whose "
            "parameters are used inside the transformation then ends at the call's output.",
        )
    if name in layers.names:
        raise ValueError(
            f"layer_boundary({name!r}) was reached twice: mark each layer's output once, "
            "with a name per layer"
        )
    layers.names.append(name)
    if layers.ratios is None:
        return x
    return rescale_boundary(x, layers.ratios[name])


@contextlib.contextmanager
def layer_boundaries_linen() -> Iterator[None]:
    """Within this context, the output of every top-level submodule of a Flax linen model
    (``"Dense_0"``, ``"layers_1"``) is a :func:`layer_boundary` named by the module: the
    model needs no change, and its ``variables["params"]`` are keyed by the same names.

    The submodules must form a chain (each one's output is the next one's input), as in
    ``nn.Sequential``.

    Example:
      >>> import jax, jax.numpy as jnp, flax.linen as nn, jdls
      >>> model = nn.Sequential([nn.Dense(4), nn.tanh, nn.Dense(1)])
      >>> params = model.init(jax.random.key(0), jnp.ones((1, 3)))["params"]
      >>> def loss(p, x):
      ...     with jdls.linen.layer_boundaries():
      ...         return jnp.sum(model.apply({"params": p}, x))
      >>> scales = {"layers_0": jdls.StaticScale(2.0**12), "layers_2": jdls.StaticScale(2.0)}
      >>> _, grads, _ = jdls.layer_scaled_value_and_grad(loss, scales)(params, jnp.ones((2, 3)))
      >>> sorted(grads)
      ['layers_0', 'layers_2']
    """
    import flax.linen as nn

    def interceptor(next_fun: Callable[..., Any], args: Any, kwargs: Any, context: Any) -> Any:
        out = next_fun(*args, **kwargs)
        path = context.module.path
        if context.method_name != "__call__" or len(path) != 1:
            return out
        return layer_boundary(out, str(path[0]))

    with nn.intercept_methods(interceptor):
        yield


def layer_scaled_value_and_grad(
    fun: Callable[..., Any],
    scales: Mapping[str, LossScale],
    has_aux: bool = False,
) -> Callable[..., tuple[Any, Any, dict[str, jax.Array]]]:
    """``jax.value_and_grad`` of ``fun`` (first argument) with one scale per layer.

    ``fun(params, *args)`` takes a dict of parameters keyed by layer name, and marks each
    layer's output with :func:`layer_boundary` in a chain (layer ``k``'s output is the next
    layer's input). The loss is scaled by the last layer's scale; each boundary multiplies
    the backward cotangent by ``scales[k] / scales[k+1]``; ``grads[k]`` is unscaled by
    ``scales[k]``. Exact (equal to float32 gradients) where no value underflows or
    overflows, provided each layer's parameters are used only between its input and its
    boundary. The arguments after ``params`` reach ``fun`` as they are given (a Python
    ``bool``, ``str`` or callable stays one), as with ``jax.value_and_grad``.

    Args:
      fun: the loss function ``fun(params, *args)``; returns a scalar, or ``(loss, aux)``.
      scales: one jdls loss scale per layer, keyed like ``params``.
      has_aux: whether ``fun`` returns ``(loss, aux)``.

    Returns:
      A function of ``fun``'s arguments returning ``(value, grads, finite)``: the loss (or
      ``(loss, aux)``), the unscaled gradients of ``params``, and per layer a boolean scalar,
      whether its gradients were finite.

    Example:
      >>> import jax.numpy as jnp, jdls
      >>> def loss(p, x):
      ...     h = jdls.layer_boundary(jnp.tanh(x * p["a"]), "a")
      ...     return jnp.sum(jdls.layer_boundary(h * p["b"], "b"))
      >>> scales = {"a": jdls.StaticScale(2.0**20), "b": jdls.StaticScale(4.0)}
      >>> value, grads, finite = jdls.layer_scaled_value_and_grad(loss, scales)(
      ...     {"a": jnp.float32(0.5), "b": jnp.float32(3.0)}, jnp.float32(1.0))
      >>> round(float(grads["a"]), 4), round(float(grads["b"]), 4), bool(finite["a"])
      (2.3593, 0.4621, True)
    """
    if not isinstance(scales, Mapping) or not scales:
        raise TypeError(
            "scales must be a non-empty dict of jdls loss scales keyed by layer name, e.g. "
            "{'dense_0': jdls.AdaptiveScale(), 'dense_1': jdls.AdaptiveScale()}"
        )
    for key, scale in scales.items():
        check_scale(scale, f"scales[{key!r}]")

    def value_and_grad_fn(params: Any, *args: Any, **kwargs: Any) -> Any:
        if not isinstance(params, Mapping) or set(params) - set(scales):
            raise ValueError(
                "the first argument of fun must be a dict of parameters keyed by layer name, "
                f"each with a scale; scales has {sorted(scales)}, got "
                + (f"{sorted(params)}" if isinstance(params, Mapping) else type(params).__name__)
            )
        names: list[str] = []

        def discover(p: Any) -> None:
            # The other arguments pass through as themselves (Python values stay Python
            # values, as with jax.value_and_grad); only the parameters are abstract.
            with _LAYERS.push(_Layers(None)) as discovery:
                fun(p, *args, **kwargs)
            names.extend(discovery.names)

        filtered_eval_shape(discover, params)
        missing = sorted(set(params) - set(names))
        unknown = sorted(set(names) - set(scales))
        if missing or unknown or not names:
            raise ValueError(
                "every layer with parameters must mark its output with "
                "jdls.layer_boundary(x, name), and every name needs a scale: "
                f"layers without a boundary {missing}, boundaries without a scale {unknown}. "
                "A boundary inside a jitted or checkpointed function that JAX traced and cached "
                "before (without the boundaries) is not reached: JAX reuses the cached trace; "
                "mark the layer outputs outside such a function"
            )
        level = {n: scales[n].loss_scale for n in names}
        ratios = {a: level[a] / level[b] for a, b in itertools.pairwise(names)}
        ratios[names[-1]] = jnp.ones((), _F32)
        last = scales[names[-1]]

        def scaled(p: Any) -> Any:
            with _LAYERS.push(_Layers(ratios)) as reached:
                out = fun(p, *args, **kwargs)
            if reached.names != names:
                refuse_changed(
                    "boundaries", "jdls.layer_scaled_value_and_grad", names, reached.names
                )
            loss, aux = out if has_aux else (out, None)
            return last.scale(loss), (loss, aux)

        (_, (loss, aux)), grads = filtered_value_and_grad(
            scaled, 0, True, "layer_scaled_value_and_grad"
        )(params)
        grads = {k: scales[k].unscale(g) for k, g in grads.items()}
        finite = {k: all_finite(g) for k, g in grads.items()}
        return ((loss, aux) if has_aux else loss), grads, finite

    return value_and_grad_fn


def _key_name(key: Any) -> str:
    for attr in ("key", "idx", "name"):  # DictKey, SequenceKey / FlattenedIndexKey, GetAttrKey
        if hasattr(key, attr):
            return str(getattr(key, attr))
    return str(key)


def group_by_layer(grads: Any, names: Iterable[str]) -> dict[str, list[jax.Array]]:
    """The leaves of ``grads`` by layer: a leaf belongs to the layer whose name is its path in
    ``grads`` (``{"dense_0": g}``) or a prefix of it, by ``/``-separated parts (the leaf
    ``layers/0/kernel`` of an ``nnx.State`` belongs to ``"layers/0"``). Layers without leaves
    are left out; a leaf of no layer is an error.

    Example:
      >>> import jax.numpy as jnp
      >>> from jdls._layer_scales import group_by_layer
      >>> grads = {"layers": {0: {"w": jnp.ones(2)}}, "b": jnp.ones(1)}
      >>> sorted(group_by_layer(grads, ["layers/0", "b"]))
      ['b', 'layers/0']
    """
    names = sorted(names, key=len, reverse=True)  # the longest matching name wins
    out: dict[str, list[jax.Array]] = {}
    outside = []
    for path, leaf in jax.tree_util.tree_flatten_with_path(grads)[0]:
        where = "/".join(_key_name(k) for k in path)
        layer = next((n for n in names if where == n or where.startswith(n + "/")), None)
        if layer is None:
            outside.append(where)
        else:
            out.setdefault(layer, []).append(leaf)
    if outside:
        raise ValueError(
            f"grads has values outside every layer with a scale: {outside}; pass the gradients "
            "that the per-layer value_and_grad returned, with the scales given to it"
        )
    return out


def adjust_layer_scales(scales: Mapping[str, LossScale], grads: Any) -> dict[str, LossScale]:
    """The next per-layer scales after a step: the rule, layer by layer, with a global skip.

    When every gradient is finite, each scale is adjusted with its own layer's largest
    unscaled gradient (``scale.adjust(True, grad_amax)``: a :class:`jdls.rules.Adaptive`
    scale moves to that layer's headroom). When any is non-finite (the step is skipped),
    the scales of the layers whose gradients were non-finite back off and the others stay.
    Every scale stays within its rule's bounds. Under ``shard_map``, ``jax.lax.pmean`` the
    gradients first: every device then computes the same scales.

    Args:
      scales: the per-layer scales (``jdls.AdaptiveScale()`` per layer, say).
      grads: the unscaled gradients of :func:`layer_scaled_value_and_grad` (a dict by layer)
        or of :func:`jdls.nnx.layer_scaled_value_and_grad` (an ``nnx.State``, whose paths
        under ``layers/0`` belong to the layer ``"layers/0"``).

    Returns:
      The new scales, a dict with the keys of ``scales``.

    Example:
      >>> import jax.numpy as jnp, jdls
      >>> scales = {"a": jdls.AdaptiveScale(), "b": jdls.AdaptiveScale()}
      >>> new = jdls.adjust_layer_scales(scales, {"a": jnp.float32(2.0**-20), "b": jnp.float32(1.0)})
      >>> float(new["a"].loss_scale) == 2.0**(15 - 6 + 20), float(new["b"].loss_scale) == 2.0**9
      (True, True)
    """
    by_layer = group_by_layer(grads, scales)
    # Finiteness from its own reduction: XLA's max reduction may drop a NaN (on CPU it does
    # for large arrays), so the largest magnitude cannot tell a NaN gradient.
    finite = {k: all_finite(g) for k, g in by_layer.items()}
    amax = {k: tree_amax(g) for k, g in by_layer.items()}
    everything = jnp.all(jnp.stack(list(finite.values()))) if finite else jnp.array(True)
    out: dict[str, LossScale] = {}
    for key, scale in scales.items():
        if key not in by_layer:
            out[key] = scale
            continue
        grown: LossScale
        if isinstance(scale, DynamicScale) and scale.rule.observes:
            grown = scale.adjust(True, amax[key])
        else:
            grown = scale.adjust(True)
        backed_off = scale.adjust(False)
        out[key] = jax.tree_util.tree_map(
            lambda g, b, s, k=key: jnp.where(everything, g, jnp.where(finite[k], s, b)),
            grown,
            backed_off,
            scale,
        )
    return out
