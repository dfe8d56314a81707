"""Current scaling: each tensor's scale comes from its own amax in this step.

No state is kept; the measurement still reports the amax and the saturated and flushed
fractions for telemetry.

References:
  TransformerEngine ``Float8CurrentScaling`` recipe.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

from jdls.fp8._formats import Formats, format_max
from jdls.fp8._recipe import (
    Measurement,
    Quantized,
    Role,
    canonical_compute_dtype,
    check_role,
    element_format,
    quantize_with_scale,
    scale_from_amax,
)

__all__ = ["CurrentScaling", "CurrentState"]


@struct.dataclass
class CurrentState:
    """The (empty) state of one tensor under current scaling."""


@dataclasses.dataclass(frozen=True)
class CurrentScaling:
    """Per-tensor current scaling: the scale maps this step's amax to the format's maximum.

    Args:
      margin: the scaling factor ``fmax / amax`` is divided by ``2**margin``.
      power_of_two: round the scaling factor down to a power of two.
      formats: the element formats (a :class:`jdls.fp8.Formats` or its name).
      compute_dtype: dtype of the quantization arithmetic and of the dot's accumulation;
        ``None`` uses the operands' dtype.

    Example:
      >>> import jax.numpy as jnp, jdls
      >>> recipe = jdls.fp8.CurrentScaling()
      >>> q, m = recipe.quantize(jnp.array([1.0, -3.5]), recipe.init("lhs"), "lhs")
      >>> q.values.astype(float).tolist(), float(q.scale), float(m.amax)
      ([128.0, -448.0], 0.0078125, 3.5)
    """

    margin: float = 0
    power_of_two: bool = False
    formats: Formats | str = "hybrid"
    compute_dtype: Any = jnp.float32

    def __post_init__(self) -> None:
        object.__setattr__(self, "formats", Formats.parse(self.formats))
        object.__setattr__(self, "compute_dtype", canonical_compute_dtype(self.compute_dtype))

    @property
    def requantize_backward(self) -> bool:
        return False

    def init(self, role: Role) -> CurrentState:
        check_role(role)
        return CurrentState()

    def quantize(
        self, x: jax.Array, state: CurrentState, role: Role, axes: tuple[int, ...] = ()
    ) -> tuple[Quantized, Measurement]:
        """Quantizes ``x`` with the scale of its own amax (scale 1 when the amax is 0 or not
        finite: an inf or NaN then reaches the output)."""
        del state, axes
        fmt = element_format(self.formats, role)
        dtype = x.dtype if self.compute_dtype is None else self.compute_dtype
        amax = jnp.max(jnp.abs(x.astype(dtype))).astype(jnp.float32)
        scale = scale_from_amax(
            amax, jnp.ones((), jnp.float32), format_max(fmt), self.margin, self.power_of_two
        )
        return quantize_with_scale(x, scale, fmt, self.compute_dtype)

    def update(
        self, state: CurrentState, measurement: Measurement, role: Role, skipped: Any = False
    ) -> CurrentState:
        del measurement, role, skipped
        return state
