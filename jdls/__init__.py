"""jdls: dynamic loss scaling for mixed-precision training in JAX and optax."""

from jdls import presets
from jdls._clip import clip
from jdls._finfo import FormatInfo
from jdls._flax import TrainState, nnx_value_and_grad, set_nnx_dynamic_scale
from jdls._formats import FloatFormat, cbfloat16, compress, decompress, finfo
from jdls._optax import wrap
from jdls._policy import Policy, get_policy
from jdls._scale import (
    DynamicScale,
    LossScale,
    MinimumScaleError,
    NoOpScale,
    ScaleRule,
    StaticScale,
    all_finite,
)
from jdls._state import (
    Stats,
    StepStats,
    WrapState,
    get_dynamic_scale,
    nonfinite_paths,
    set_dynamic_scale,
    stats,
)

__version__ = "0.1.0"

__all__ = [
    "DynamicScale",
    "FloatFormat",
    "FormatInfo",
    "LossScale",
    "MinimumScaleError",
    "NoOpScale",
    "Policy",
    "ScaleRule",
    "StaticScale",
    "Stats",
    "StepStats",
    "TrainState",
    "WrapState",
    "all_finite",
    "cbfloat16",
    "clip",
    "compress",
    "decompress",
    "finfo",
    "get_dynamic_scale",
    "get_policy",
    "nnx_value_and_grad",
    "nonfinite_paths",
    "presets",
    "set_dynamic_scale",
    "set_nnx_dynamic_scale",
    "stats",
    "wrap",
]
