"""jdls: dynamic loss scaling for mixed-precision training in JAX and optax."""

from jdls import presets
from jdls._formats import FloatFormat, FormatInfo, cbfloat16, compress, decompress, finfo
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

# -- optax integration (issue 3) --
# -- flax integration (issue 5) --

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
    "all_finite",
    "cbfloat16",
    "compress",
    "decompress",
    "finfo",
    "get_policy",
    "presets",
]
