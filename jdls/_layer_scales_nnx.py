"""Per-layer scales for Flax NNX models, without model edits: a boundary at the output of
each direct child module, and ``value_and_grad`` of an NNX loss with one scale per child.

A *layer* is a direct child module of the model holding an ``nnx.Param``: for
``nnx.Sequential`` its ``layers/0``, ``layers/1``, ...; for a custom module its attribute
submodules, also inside ``nnx.List`` / ``nnx.Dict`` or a list. Its name is its path joined by
``/``, as the paths of ``nnx.state(model)`` print. The boundaries come from the class swap of
``_nnx_hooks`` (shared with ``jdls.nnx.probes``); the differentiation is
``jdls.layer_scaled_value_and_grad`` over the parameters split by layer and merged back.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Mapping
from typing import Any, cast

from jdls._layer_scales import layer_boundary, layer_scaled_value_and_grad
from jdls._nnx_hooks import hook_outputs, module_name
from jdls._scale import LossScale

__all__ = ["layer_boundaries_nnx", "nnx_layer_scaled_value_and_grad"]

Path = tuple[Any, ...]


def _layers(model: Any) -> dict[str, tuple[Path, Any]]:
    """``{name: (path, module)}`` of the direct children of ``model`` that hold an
    ``nnx.Param``: modules reached from ``model`` through no other module than an
    ``nnx.List`` / ``nnx.Dict``."""
    from flax import nnx

    param_paths = [path for path, _ in nnx.to_flat_state(nnx.state(model, nnx.Param))]
    candidates = [
        (tuple(path), module)
        for path, module in nnx.iter_modules(model)
        if path and not isinstance(module, nnx.List | nnx.Dict)
    ]
    inner = {path for path, _ in candidates}
    layers = {}
    for path, module in candidates:
        if any(path[:i] in inner for i in range(1, len(path))):
            continue  # inside another child
        if any(tuple(p[: len(path)]) == path for p in param_paths):
            layers[module_name(path)] = (path, module)
    return layers


@contextlib.contextmanager
def layer_boundaries_nnx(model: Any) -> Iterator[None]:
    """Within this context, the output of every direct child module of the NNX ``model``
    that holds parameters is a :func:`jdls.layer_boundary` named by its path (``"layers/0"``
    for ``nnx.Sequential``, ``"encoder"`` or ``"blocks/1"`` for a custom module's attributes):
    the model needs no change, and ``nnx.state(model, nnx.Param)`` has the same paths.

    The children must form a chain (each one's output is the next one's input); a residual
    block is one child. The classes of the children are swapped while the context is open
    and restored on exit, as :func:`jdls.nnx.probes` does (the two nest).
    :func:`jdls.nnx.layer_scaled_value_and_grad` opens it for you.

    Example:
      >>> import jax.numpy as jnp, jdls
      >>> from flax import nnx
      >>> model = nnx.Sequential(nnx.Linear(3, 4, rngs=nnx.Rngs(0)), nnx.tanh,
      ...                        nnx.Linear(4, 1, rngs=nnx.Rngs(1)))
      >>> with jdls.nnx.layer_boundaries(model):  # outside a per-layer differentiation
      ...     y = model(jnp.ones((2, 3)))             # the boundaries are the identity
      >>> y.shape, type(model.layers[0]) is nnx.Linear  # the class is restored
      ((2, 1), True)
    """
    hooks = [
        (module, functools.partial(layer_boundary, name=name))
        for name, (_, module) in _layers(model).items()
    ]
    with hook_outputs(hooks):
        yield


def nnx_layer_scaled_value_and_grad(
    loss_fn: Callable[..., Any],
    scales: Mapping[str, LossScale],
    has_aux: bool = False,
) -> Callable[..., tuple[Any, Any, dict[str, Any]]]:
    """:func:`jdls.layer_scaled_value_and_grad` for an NNX model, with no model edits: each
    direct child module with parameters (``"layers/0"``, ``"layers/1"`` of an
    ``nnx.Sequential``) is a layer with its own scale.

    ``loss_fn(model, *args)`` is an ordinary NNX loss. The model's ``nnx.Param`` state is
    split by layer, merged back into a copy of the model inside the differentiation, and
    ``loss_fn`` runs on the copy inside :func:`jdls.nnx.layer_boundaries`; updates of the
    other variables (batch statistics, RNG counts) are written back to ``model``. The
    gradients are an ``nnx.State`` of the parameters, as ``nnx.grad`` returns: pass them to
    ``optimizer.update(model, grads)`` and to :func:`jdls.adjust_layer_scales`. Exact where
    nothing under- or overflows and the layers form a chain (a residual block is one child).

    Args:
      loss_fn: the loss, ``loss_fn(model, *args)``; returns a scalar, or ``(loss, aux)``.
      scales: one jdls loss scale per layer, keyed by the layer's path (``"layers/0"``).
      has_aux: whether ``loss_fn`` returns ``(loss, aux)``.

    Returns:
      A function ``(model, *args) -> (value, grads, finite)``: the loss (or
      ``(loss, aux)``), the unscaled gradients of the model's ``nnx.Param`` state, and per
      layer a boolean scalar, whether its gradients were finite.

    Raises:
      ValueError: (when called) a parameter lies outside every direct child module, or
        ``scales`` does not have exactly one entry per layer.

    Example:
      >>> import jax.numpy as jnp, jdls
      >>> from flax import nnx
      >>> model = nnx.Sequential(nnx.Linear(3, 4, rngs=nnx.Rngs(0)), nnx.tanh,
      ...                        nnx.Linear(4, 1, rngs=nnx.Rngs(1)))
      >>> scales = {"layers/0": jdls.StaticScale(2.0**12), "layers/2": jdls.StaticScale(2.0)}
      >>> loss_fn = lambda m, x: jnp.mean(m(x) ** 2)
      >>> fn = jdls.nnx.layer_scaled_value_and_grad(loss_fn, scales)
      >>> value, grads, finite = fn(model, jnp.ones((2, 3)))
      >>> grads["layers"][0]["kernel"].shape, bool(finite["layers/0"])
      ((3, 4), True)
    """
    layer_scaled_value_and_grad(loss_fn, scales)  # the same checks of ``scales``, now

    def value_and_grad_fn(model: Any, *args: Any, **kwargs: Any) -> Any:
        from flax import nnx

        layers = _layers(model)
        graphdef, params, rest = cast(Any, nnx.split(model, nnx.Param, ...))
        groups: dict[str, list[tuple[Path, Any]]] = {name: [] for name in layers}
        outside = []
        for path, value in nnx.to_flat_state(params):
            name = next((n for n, (p, _) in layers.items() if tuple(path[: len(p)]) == p), None)
            if name is None:
                outside.append(module_name(path))
            else:
                groups[name].append((path, value))
        if outside:
            raise ValueError(
                "jdls.nnx.layer_scaled_value_and_grad gives a scale to each direct child module of "
                f"the model that holds parameters ({sorted(layers)}); these parameters lie "
                f"outside every child: {outside}. Move them into a child module, or mark the "
                "layers yourself with jdls.layer_boundary and use "
                "jdls.layer_scaled_value_and_grad"
            )
        missing, unknown = sorted(set(layers) - set(scales)), sorted(set(scales) - set(layers))
        if missing or unknown:
            raise ValueError(
                f"scales must have one entry per layer of the model, {sorted(layers)}: layers "
                f"without a scale {missing}, scales of no layer {unknown}"
            )
        by_layer = {name: nnx.from_flat_state(items) for name, items in groups.items()}

        def fun(p: dict[str, Any], *a: Any, **kw: Any) -> Any:
            copy = nnx.merge(graphdef, *p.values(), rest, copy=True)
            with layer_boundaries_nnx(copy):
                out = loss_fn(copy, *a, **kw)
            loss, aux = out if has_aux else (out, None)
            return loss, (aux, nnx.state(copy, nnx.Not(nnx.Param)))

        fn = layer_scaled_value_and_grad(fun, scales, has_aux=True)
        (loss, (aux, new_rest)), grads, finite = fn(by_layer, *args, **kwargs)
        if len(new_rest):
            nnx.update(model, new_rest)
        full = nnx.merge_state(*grads.values())
        return ((loss, aux) if has_aux else loss), full, finite

    return value_and_grad_fn
