"""jdls: dynamic loss scaling for mixed-precision training in JAX and optax."""

from jdls import presets
from jdls._scale import (
    DynamicScale,
    LossScale,
    MinimumScaleError,
    NoOpScale,
    ScaleRule,
    StaticScale,
    all_finite,
)

# -- float formats (issue 4) --
# -- optax integration (issue 3) --
# -- flax integration (issue 5) --

__version__ = "0.1.0"

__all__ = [
    "DynamicScale",
    "LossScale",
    "MinimumScaleError",
    "NoOpScale",
    "ScaleRule",
    "StaticScale",
    "all_finite",
    "presets",
]
