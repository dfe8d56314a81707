"""The NVFP4 training recipe: what each tensor of each dot gets, and the state it keeps.

NVIDIA's recipe (arXiv 2509.25149, section 4; TransformerEngine's ``NVFP4BlockScaling``):

- activations and output gradients in 1x16 blocks along the axis each dot contracts;
  weights in 16x16 tiles, the same tiles in the forward dot and, transposed, in the
  backward dot of the input gradient (``weight_tiles``);
- the random Hadamard transform of both inputs of the weight-gradient dot, along the tokens
  it contracts, before they are quantized (``hadamard``);
- stochastic rounding of the output gradient, in both backward dots; everything else rounds
  to nearest even (``stochastic_rounding``);
- some layers kept in high precision: a dot's ``keep`` state (data, so one layer of a
  scanned stack can differ from the next) computes it in bfloat16 (or FP8) instead.

Each dot's state (per tensor: ``lhs``, ``rhs``, ``grad``) is a :class:`NVFP4State` of three
float32 scalars: ``keep``, and the stochastic rounding's ``seed`` and ``step``. The random
bits of a step come from ``(seed, step)``, the backward dot they serve and the device's
index along the mesh axes the gradient varies over; ``step`` advances once per applied step,
so a skipped step does not advance it and a retried step draws the same bits. The state is
float32 so that ``jax.grad`` with respect to the sites, and checkpoint filters that keep
inexact arrays, take it as it is.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

import jax
import jax.numpy as jnp
from flax import struct
from jax import lax

from jdls._numerics.axes import bound_axes, tracked_axes, varying_axes
from jdls.fp8._block import blocked, unblocked
from jdls.fp8._block_dot import BlockScaling
from jdls.fp8._formats import Formats, format_max
from jdls.fp8._nvfp4 import (
    BLOCK,
    TE_SIGNS,
    checked_signs,
    hadamard,
    padded_length,
    quantize_parts,
)
from jdls.fp8._recipe import (
    Measurement,
    Quantized,
    Role,
    check_role,
    element_format,
    quantize_with_scale,
    scale_from_amax,
)

__all__ = ["GEMMS", "NVFP4Scaling", "NVFP4State", "nvfp4"]

Gemm = Literal["fprop", "dgrad", "wgrad"]
GEMMS: tuple[Gemm, ...] = ("fprop", "dgrad", "wgrad")
_SEEDS = 2**24  # float32 holds every integer below this exactly
_HIGH = ("bf16", "fp8")


@struct.dataclass
class NVFP4State:
    """The state of one tensor of an NVFP4 dot: three float32 scalars.

    Attributes:
      keep: 1.0 where the dot is kept in high precision (the recipe's ``high_precision``
        format), 0.0 in NVFP4.
      seed: the stochastic rounding's seed, an integer below ``2**24``.
      step: the applied steps so far, modulo ``2**24``: the bits of each step differ.
    """

    keep: jax.Array
    seed: jax.Array
    step: jax.Array


@dataclasses.dataclass(frozen=True)
class NVFP4Scaling:
    """NVIDIA's NVFP4 training recipe, exact on any machine (module docstring).

    Configuration only (frozen, hashable, static under ``jax.jit``): give it to
    ``jdls.fp8.init`` or an FP8 layer of any framework, as any ``jdls.fp8`` recipe. Each
    switch is one ablation of the recipe.

    Args:
      stochastic_rounding: round the output gradient stochastically (both backward dots).
      hadamard: the random Hadamard transform of the weight-gradient dot's two inputs.
      weight_tiles: 16x16 weight tiles (``False``: 1x16 blocks along each dot's contraction,
        so the forward and backward dots see different weights).
      high_precision: the format of a dot whose ``keep`` state is set: ``"bf16"`` (operands
        rounded to bfloat16) or ``"fp8"`` (per-tensor current scaling, e4m3 operands and
        e5m2 output gradient).
      signs: the Hadamard transform's 16 signs, each +1 or -1 (ints, floats or a NumPy
        array, kept as ints; default: TransformerEngine's).
      seed: the stochastic rounding's seed of a site made without a key (``jdls.fp8.init``
        with ``key=`` and the framework layers, given their random keys, draw one per site).
      measure_error: measure each dot's weight-gradient error (``Measurement.error`` of the
        ``grad`` tensor): the relative L2 distance of the NVFP4 weight gradient from the
        same dot of the unquantized operands. One more dot per backward pass; what
        :func:`jdls.fp8.rank_layers` ranks layers by.

    Example:
      >>> import jdls
      >>> jdls.fp8.nvfp4(hadamard=False).block_shape((64, 32), "rhs", (0,))
      (16, 16)
    """

    stochastic_rounding: bool = True
    hadamard: bool = True
    weight_tiles: bool = True
    high_precision: str = "bf16"
    signs: tuple[int, ...] = TE_SIGNS
    seed: int = 0
    measure_error: bool = False

    def __post_init__(self) -> None:
        for name in ("stochastic_rounding", "hadamard", "weight_tiles", "measure_error"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if self.high_precision not in _HIGH:
            raise ValueError(
                f"high_precision must be one of {_HIGH} (the format of the dots kept out of "
                f"NVFP4), got {self.high_precision!r}"
            )
        # the check hadamard makes (1.5, True or "1" refused, not rounded), kept as ints
        object.__setattr__(self, "signs", tuple(int(v) for v in checked_signs(self.signs)))
        if not (isinstance(self.seed, int) and not isinstance(self.seed, bool)) or not (
            0 <= self.seed < _SEEDS
        ):
            raise ValueError(f"seed must be an int in [0, 2**24), got {self.seed!r}")

    # -- The jdls.fp8 recipe protocol (jdls/fp8/_recipe.py). ---------------------------------

    @property
    def compute_dtype(self) -> Any:
        """The dot multiplies the dequantized values and accumulates in float32."""
        return jnp.dtype(jnp.float32)

    @property
    def requantize_backward(self) -> bool:
        """The backward dots quantize again along their own contraction axes."""
        return True

    @property
    def measures_error(self) -> bool:
        return self.measure_error

    def init(self, role: Role) -> NVFP4State:
        check_role(role)
        zero = jnp.zeros((), jnp.float32)
        return NVFP4State(keep=zero, seed=jnp.full((), self.seed, jnp.float32), step=zero)

    def seeded(self, state: NVFP4State, key: jax.Array) -> NVFP4State:
        """``state`` with a seed drawn from ``key`` (a new site's own seed)."""
        seed = jax.random.randint(key, (), 0, _SEEDS).astype(jnp.float32)
        return dataclasses.replace(state, seed=seed)

    def block_shape(
        self, shape: tuple[int, ...], role: Role, axes: tuple[int, ...]
    ) -> tuple[int, ...]:
        """16 values along the last contracted axis; a weight (``"rhs"``) in 16x16 tiles of
        that axis and its last other axis (with ``weight_tiles``)."""
        tile = (BLOCK, BLOCK) if self.weight_tiles else BLOCK
        return BlockScaling(BLOCK, tile, "e2m1", "e2m1").block_shape(shape, role, axes)

    def quantize(
        self, x: jax.Array, state: NVFP4State, role: Role, axes: tuple[int, ...] = ()
    ) -> tuple[Quantized, Measurement]:
        """``x`` for the forward dot (``"lhs"``, ``"rhs"``) or the input-gradient dot."""
        return self.quantize_gemm(x, state, role, axes, "dgrad" if role == "grad" else "fprop")

    def quantize_gemm(
        self, x: jax.Array, state: NVFP4State, role: Role, axes: tuple[int, ...], gemm: Gemm
    ) -> tuple[Quantized, Measurement]:
        """``x`` quantized for one of the three dots (``"fprop"``, ``"dgrad"``, ``"wgrad"``).

        The weight-gradient dot's operands are transformed first (``hadamard``), along the
        last contracted axis, zero-padded to a multiple of 16 there. ``Quantized.values``
        holds the dequantized float32 values and ``scale`` is 1: the dot multiplies the
        values as the hardware's block-scaled dot does before its tensor scale.
        """
        x = jnp.asarray(x)
        axes = tuple(axes)
        along = axes[-1] if axes else x.ndim - 1
        x32 = x.astype(jnp.float32)
        transform = self.hadamard and gemm == "wgrad" and role != "rhs" and x.ndim > 0
        if transform:
            plain = _pad(x32, along)
            x_in = hadamard(x32, along, self.signs)
        else:
            plain = x_in = x32
        shape = self.block_shape(x_in.shape, role, axes)
        bits = None
        if self.stochastic_rounding and role == "grad":
            bits = blocked(_random_bits(state, gemm, x_in), shape)
        parts = quantize_parts(x_in, shape, bits)
        fp4 = unblocked(parts.dequantized, x_in.shape)
        keep = state.keep > 0
        high, high_measurement = self._high(plain, role)
        values = jnp.where(keep, high, fp4)
        n = max(x_in.size, 1)
        measurement = Measurement(
            amax=_amax(x32),
            saturated=jnp.where(
                keep, high_measurement.saturated, jnp.sum(parts.clipped, dtype=jnp.float32) / n
            ),
            flushed=jnp.where(
                keep, high_measurement.flushed, jnp.sum(parts.flushed, dtype=jnp.float32) / n
            ),
        )
        return Quantized(values=values, scale=jnp.ones((), jnp.float32)), measurement

    def _high(self, x: jax.Array, role: Role) -> tuple[jax.Array, Measurement]:
        """``x`` in the high-precision format, as float32 values, and its measurement."""
        if self.high_precision == "bf16":
            zero = jnp.zeros((), jnp.float32)
            return x.astype(jnp.bfloat16).astype(jnp.float32), Measurement(_amax(x), zero, zero)
        fmt = element_format(Formats(), role)
        scale = scale_from_amax(_amax(x), jnp.ones((), jnp.float32), format_max(fmt))
        q, measurement = quantize_with_scale(x, scale, fmt, jnp.float32)
        return q.dequantize(jnp.float32), measurement

    def update(
        self, state: NVFP4State, measurement: Measurement, role: Role, skipped: Any = False
    ) -> NVFP4State:
        """The next step's state: ``step`` advances (the caller keeps the old state on a
        skipped step)."""
        del measurement, role, skipped
        step = jnp.where(state.step + 1 >= _SEEDS, 0.0, state.step + 1).astype(jnp.float32)
        return dataclasses.replace(state, step=step)


def _pad(x: jax.Array, axis: int) -> jax.Array:
    pad = padded_length(x.shape[axis]) - x.shape[axis]
    if not pad:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, pad)
    return jnp.pad(x, widths)


def _amax(x: jax.Array) -> jax.Array:
    """The largest magnitude, inf when ``x`` holds an inf or NaN (the ``Measurement`` rule)."""
    if not x.size:
        return jnp.zeros((), jnp.float32)
    amax = jnp.max(jnp.abs(x)).astype(jnp.float32)
    return jnp.where(jnp.all(jnp.isfinite(x)), amax, jnp.inf)


def _random_bits(state: NVFP4State, gemm: Gemm, like: jax.Array) -> jax.Array:
    """uint32 bits of ``like``'s shape from the seed, the step, the dot and the device."""
    key = jax.random.key(state.seed.astype(jnp.int32))
    key = jax.random.fold_in(key, state.step.astype(jnp.int32))
    key = jax.random.fold_in(key, GEMMS.index(gemm))
    axes = bound_axes()
    tracked = tracked_axes(axes)
    for axis in axes:
        if axis in varying_axes(like) or axis not in tracked:
            key = jax.random.fold_in(key, lax.axis_index(axis))
    return jax.random.bits(key, like.shape, jnp.uint32)


def nvfp4(
    stochastic_rounding: bool = True,
    hadamard: bool = True,
    weight_tiles: bool = True,
    *,
    high_precision: str = "bf16",
    seed: int = 0,
    measure_error: bool = False,
) -> NVFP4Scaling:
    """NVIDIA's NVFP4 training recipe (:class:`NVFP4Scaling`), every switch on by default.

    E2M1 values in blocks of 16 with E4M3 scales under a float32 tensor scale, 16x16 weight
    tiles, the random Hadamard transform of the weight-gradient inputs and stochastic
    rounding of the output gradients, computed exactly as TransformerEngine's kernels (but a
    non-finite value reaches the gradients, so the step is skipped).

    References:
      NVIDIA, "Pretraining Large Language Models with NVFP4", arXiv 2509.25149 (2025);
      TransformerEngine's ``NVFP4BlockScaling``.

    Example:
      >>> import jax, jax.numpy as jnp, jdls
      >>> site = jdls.fp8.init(jdls.fp8.nvfp4(), key=jax.random.key(0))
      >>> x, w = jnp.ones((32, 16)), jnp.full((16, 8), 0.5)
      >>> y = jdls.fp8.dot_general(x, w, (((1,), (0,)), ((), ())), site=site)
      >>> float(y[0, 0])
      8.0
    """
    return NVFP4Scaling(
        stochastic_rounding=stochastic_rounding,
        hadamard=hadamard,
        weight_tiles=weight_tiles,
        high_precision=high_precision,
        seed=seed,
        measure_error=measure_error,
    )
