"""FP8 training: per-tensor (and block) scales held as plain state, skip-aware.

A *recipe* (plain configuration) says how each tensor of a dot is scaled and cast. Each FP8
dot is a jdls site (:func:`init`): its scales and amax histories are arrays that go into
:func:`dot_general`, and what the dot measured comes out as the gradient with respect to the
site, which ``jdls.update_sites`` (or a framework's train step) turns into the next step's
scales.

Example:
  >>> import jax, jax.numpy as jnp, jdls
  >>> site = jdls.fp8.init(jdls.fp8.DelayedScaling(history_length=16))
  >>> x, w = jnp.ones((4, 8)), jnp.ones((8, 2))
  >>> def loss(w, site):
  ...     y = jdls.fp8.dot_general(x, w, (((1,), (0,)), ((), ())), site=site)
  ...     return jnp.mean(y**2)
  >>> grad_w, measured = jax.grad(loss, argnums=(0, 1))(w, site)
  >>> site = jdls.update_sites(site, measured)
  >>> float(site.value.lhs.history[0]), float(site.value.grad.history[0])
  (1.0, 2.0)
"""

from jdls.fp8 import linen, nnx
from jdls.fp8._adaptive import AdaptiveScaling, AdaptiveState
from jdls.fp8._block import BlockArray, block_stats, dequantize_blocks, quantize_blocks
from jdls.fp8._block_dot import BlockScaling, BlockState, deepseek, mx
from jdls.fp8._current import CurrentScaling, CurrentState
from jdls.fp8._delayed import DelayedScaling, DelayedState
from jdls.fp8._dot import dot_general
from jdls.fp8._einsum import einsum
from jdls.fp8._formats import Formats, format_max
from jdls.fp8._layers import (
    LayerError,
    keep_high_precision,
    rank_layers,
    suggest_high_precision,
)
from jdls.fp8._nvfp4 import TE_SIGNS, NVFP4Array, dequantize_nvfp4, hadamard, quantize_nvfp4
from jdls.fp8._nvfp4_recipe import NVFP4Scaling, NVFP4State, nvfp4
from jdls.fp8._presets import flax_fp8_ops, transformer_engine
from jdls.fp8._recipe import Measurement, Quantized, Recipe, scale_from_amax
from jdls.fp8._state import (
    DotState,
    Fp8,
    Meter,
    init,
    replace_states,
    states,
    step_applied,
    telemetry,
)

__all__ = [
    "TE_SIGNS",
    "AdaptiveScaling",
    "AdaptiveState",
    "BlockArray",
    "BlockScaling",
    "BlockState",
    "CurrentScaling",
    "CurrentState",
    "DelayedScaling",
    "DelayedState",
    "DotState",
    "Formats",
    "Fp8",
    "LayerError",
    "Measurement",
    "Meter",
    "NVFP4Array",
    "NVFP4Scaling",
    "NVFP4State",
    "Quantized",
    "Recipe",
    "block_stats",
    "deepseek",
    "dequantize_blocks",
    "dequantize_nvfp4",
    "dot_general",
    "einsum",
    "flax_fp8_ops",
    "format_max",
    "hadamard",
    "init",
    "keep_high_precision",
    "linen",
    "mx",
    "nnx",
    "nvfp4",
    "quantize_blocks",
    "quantize_nvfp4",
    "rank_layers",
    "replace_states",
    "scale_from_amax",
    "states",
    "step_applied",
    "suggest_high_precision",
    "telemetry",
    "transformer_engine",
]


def __getattr__(name: str) -> object:
    """``equinox``, the optional Equinox FP8 layers, imported on first use (Equinox is not a
    dependency): ``jdls.fp8.equinox`` works after ``import jdls`` where Equinox is installed."""
    if name == "equinox":
        import importlib

        return importlib.import_module(f"{__name__}.equinox")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
