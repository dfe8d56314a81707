"""Per-layer scales in a Flax NNX model: a :class:`jdls.LayerScale` site on each layer's output.

:func:`layer_scales_nnx` gives the layers of a chain (the direct children holding parameters,
in the order they were assigned) a ``jdls_layer_scale`` :class:`SiteVariable`, numbered in
that order; :func:`layer_scale_nnx` gives one module its site at a position of your choosing
(a block that ``nnx.vmap`` stacks). The modules pass their output through it as through a
probe (``jdls/_frameworks/nnx_sites.py``); ``jdls.nnx.layer_scaled_value_and_grad``
(``nnx_step``) differentiates with them.
"""

from __future__ import annotations

from typing import Any

from flax import nnx

from jdls._frameworks.nnx_model import SiteVariable, modules_in_order
from jdls._frameworks.nnx_sites import LAYER_SCALE, attach_site
from jdls._scales.layer_site import LayerScale, layer_site
from jdls._scales.scale import LossScale, check_scale

__all__ = ["layer_scale_nnx", "layer_scales_nnx"]


def _layers(model: Any) -> list[Any]:
    """The direct children of ``model`` holding parameters, in the order they were assigned
    (``vars`` order; list and dict entries in order): the forward order of a chain. One
    module at two places of the chain is refused (it would hold one site for both)."""
    found: dict[int, tuple[Any, ...]] = {}
    layers: list[Any] = []

    def visit(value: Any, path: tuple[Any, ...]) -> None:
        if isinstance(value, nnx.List | list | tuple):
            for i, v in enumerate(value):
                visit(v, (*path, i))
        elif isinstance(value, nnx.Dict | dict):
            for k, v in value.items():
                visit(v, (*path, k))
        elif isinstance(value, nnx.Module) and len(nnx.state(value, nnx.Param)):
            if id(value) in found:
                raise ValueError(
                    f"jdls.nnx.layer_scales: the layer at {'/'.join(map(str, path))} is the "
                    f"one at {'/'.join(map(str, found[id(value)]))}: one module at two places "
                    "of the chain would hold one per-layer site for both. Give each place its "
                    "own module, or set the scales by hand (jdls.nnx.layer_scale)"
                )
            found[id(value)] = path
            layers.append(value)

    for name, value in vars(model).items():
        if not name.startswith("_"):
            visit(value, (name,))
    return layers


def layer_scales_nnx(model: Any, scale: LossScale) -> Any:
    """Give every direct child module of the NNX ``model`` that holds parameters a per-layer
    scale (:func:`jdls.layer_site`, ``scale`` each) on its output, in place; returns ``model``.

    The layers' forward order is the order their attributes were assigned (``nnx.Sequential``:
    its list order); they must form a chain. Each site's kind holds its layer's position
    (:class:`jdls.LayerScale`), so the order travels with the sites through ``nnx.split`` /
    ``nnx.merge``, ``nnx.jit``, ``nnx.grad`` and a checkpoint's restore, which rebuild the
    modules with their attributes sorted by name: call this where the model is built (in
    the function that ``nnx.eval_shape`` or a sharded ``nnx.jit`` init runs), not on a
    model rebuilt since. Called again on layers that hold per-layer sites, it keeps their
    positions. :func:`jdls.nnx.layer_scaled_value_and_grad` refuses layers that apply
    their sites out of the positions' order. A child made by ``nnx.vmap`` (a stack) gets one
    site for the whole stack; for a site per layer, call :func:`jdls.nnx.layer_scale` on
    each block inside the vmapped constructor (with the stack's position in the chain).
    Differentiate with
    :func:`jdls.nnx.layer_scaled_value_and_grad`.

    Example:
      >>> import jdls
      >>> from flax import nnx
      >>> model = nnx.Sequential(nnx.Linear(3, 4, rngs=nnx.Rngs(0)), nnx.tanh,
      ...                        nnx.Linear(4, 1, rngs=nnx.Rngs(1)))
      >>> model = jdls.nnx.layer_scales(model, jdls.AdaptiveScale(2.0**10))
      >>> model.layers[0].jdls_layer_scale.get_value().kind
      LayerScale(position=0)
    """
    check_scale(scale, "scale")
    modules_in_order(model, "jdls.nnx.layer_scales")  # refuses a shared site
    layers = _layers(model)
    held = [_position(layer) for layer in layers]
    placed = all(p is not None for p in held)  # called again: the positions stay
    for k, (layer, position) in enumerate(zip(layers, held, strict=True)):
        attach_site(
            layer,
            LAYER_SCALE,
            layer_site(scale, position if position is not None and placed else k),
        )
    return model


def _position(layer: Any) -> int | None:
    """The position of the per-layer site ``layer`` holds, or None."""
    variable = vars(layer).get(LAYER_SCALE)
    if isinstance(variable, SiteVariable) and isinstance(variable.get_value().kind, LayerScale):
        return int(variable.get_value().kind.position)
    return None


def layer_scale_nnx(module: Any, scale: LossScale, position: int) -> Any:
    """Give ``module`` (one layer, e.g. a block inside the constructor that ``nnx.vmap``
    stacks) a per-layer scale at ``position`` in the forward order; returns ``module``.

    Example:
      >>> import jdls
      >>> from flax import nnx
      >>> block = jdls.nnx.layer_scale(nnx.Linear(2, 2, rngs=nnx.Rngs(0)), jdls.NoOpScale(), 3)
      >>> block.jdls_layer_scale.get_value().kind.position
      3
    """
    check_scale(scale, "scale")
    attach_site(module, LAYER_SCALE, layer_site(scale, position))
    return module
