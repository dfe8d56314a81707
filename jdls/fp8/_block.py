"""Block quantization: values in a narrow element format, one power-of-two scale per block.

``quantize_blocks(x, block_shape, fmt, rounding)`` splits ``x`` into blocks of
``block_shape`` (zero-padded at the ends), takes each block's largest magnitude, picks its
shared exponent with one of the rules of ``jdls.fp8._e8m0`` and returns a :class:`BlockArray`:
``values = round(clip(x / 2**e, -fmax, fmax))`` in the element format and ``scales``, the
E8M0 codes. A block holding inf or NaN gets the NaN scale, so every value of it dequantizes
to NaN: a non-finite value is never clipped into finite numbers. :func:`block_stats` reports
the fractions of blocks whose maximum was clipped, of values flushed to zero and of
non-finite blocks.

Element formats (:data:`ELEMENT_FORMATS`): the MX element formats e4m3, e5m2 (FP8), e2m3,
e3m2 (FP6) and e2m1 (FP4). FP8 and FP4 values are stored in their ml_dtypes dtype; XLA on CPU
cannot convert to the FP6 dtypes, so FP6 values are rounded exactly by a
:class:`jdls.FloatFormat` with one more exponent bit (equal to the FP6 format up to its
largest value, which the clip never exceeds) and held in float32.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jdls._floats.formats import FloatFormat
from jdls.fp8._e8m0 import NAN_CODE, ROUNDINGS, amax_bits, ldexp, shared_exponent

__all__ = [
    "ELEMENT_FORMATS",
    "BlockArray",
    "ElementFormat",
    "block_stats",
    "blocked",
    "check_blocks",
    "dequantize_blocks",
    "element_format",
    "expand_blocks",
    "quantize_and_measure",
    "quantize_blocks",
    "split_axis",
    "unblocked",
]


@dataclasses.dataclass(frozen=True)
class ElementFormat:
    """An MX element format: its name, largest value, mantissa bits and how values are stored.

    Attributes:
      name: ``"e4m3"``, ``"e5m2"``, ``"e2m3"``, ``"e3m2"`` or ``"e2m1"``.
      max: the largest finite value (448, 57344, 7.5, 28, 6).
      mantissa_bits: explicit mantissa bits.
      dtype: the ml_dtypes dtype of the values (the FP6 formats: float32, see the module doc).
      emulated: the :class:`jdls.FloatFormat` that rounds FP6 values exactly, else None.
    """

    name: str
    max: float
    mantissa_bits: int
    dtype: Any
    emulated: FloatFormat | None = None

    def round(self, q: jax.Array) -> jax.Array:
        """Rounds float32 values already inside ``[-max, max]`` (ties to even)."""
        if self.emulated is not None:
            return self.emulated.round(q)
        return q.astype(self.dtype)

    def __repr__(self) -> str:
        return f"ElementFormat({self.name!r})"


ELEMENT_FORMATS = {
    "e4m3": ElementFormat("e4m3", 448.0, 3, jnp.dtype(jnp.float8_e4m3fn)),
    "e5m2": ElementFormat("e5m2", 57344.0, 2, jnp.dtype(jnp.float8_e5m2)),
    "e2m3": ElementFormat("e2m3", 7.5, 3, jnp.dtype(jnp.float32), FloatFormat(3, 3, 1, "e2m3")),
    "e3m2": ElementFormat("e3m2", 28.0, 2, jnp.dtype(jnp.float32), FloatFormat(4, 2, 3, "e3m2")),
    "e2m1": ElementFormat("e2m1", 6.0, 1, jnp.dtype(jnp.float4_e2m1fn)),
}
_ALIASES = {
    "fp8_e4m3": "e4m3",
    "float8_e4m3fn": "e4m3",
    "e4m3fn": "e4m3",
    "fp8_e5m2": "e5m2",
    "float8_e5m2": "e5m2",
    "fp6_e2m3": "e2m3",
    "float6_e2m3fn": "e2m3",
    "fp6_e3m2": "e3m2",
    "float6_e3m2fn": "e3m2",
    "fp4_e2m1": "e2m1",
    "float4_e2m1fn": "e2m1",
    "fp4": "e2m1",
}


def element_format(fmt: Any) -> ElementFormat:
    """The :class:`ElementFormat` named by ``fmt`` (a name, alias or ml_dtypes dtype).

    Example:
      >>> from jdls.fp8._block import element_format
      >>> element_format("fp4_e2m1").max, element_format("e2m3").max
      (6.0, 7.5)
    """
    if isinstance(fmt, ElementFormat):
        return fmt
    name = fmt if isinstance(fmt, str) else None
    if name is None:
        try:
            name = np.dtype(fmt).name
        except TypeError:
            name = None
    if name is not None:
        name = _ALIASES.get(name, name)
        if name in ELEMENT_FORMATS:
            return ELEMENT_FORMATS[name]
    raise ValueError(
        f"a block element format must be one of {sorted(ELEMENT_FORMATS)} (or an alias such as "
        f"'fp8_e4m3', 'fp4_e2m1', or the ml_dtypes dtype), got {fmt!r}"
    )


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class BlockArray:
    """Block-quantized values and their scales.

    ``values`` has the shape of the quantized array; ``codes`` (uint8) has one E8M0 code per
    block, ``ceil(n / b)`` along each axis. ``scales`` is ``codes`` as ``float8_e8m0fnu``
    (the dtype of ``jax.lax.scaled_dot``), ``scales_float32`` as powers of two in float32.
    """

    values: jax.Array
    codes: jax.Array
    block_shape: tuple[int, ...] = dataclasses.field(metadata=dict(static=True))
    fmt: str = dataclasses.field(metadata=dict(static=True))

    @property
    def scales(self) -> jax.Array:
        return lax.bitcast_convert_type(self.codes, jnp.float8_e8m0fnu)

    @property
    def scales_float32(self) -> jax.Array:
        e = self.codes.astype(jnp.int32) - 127
        s = ldexp(jnp.ones(e.shape, jnp.float32), e)
        return jnp.where(self.codes == NAN_CODE, jnp.nan, s)


def check_blocks(shape: tuple[int, ...], block_shape: tuple[int, ...]) -> tuple[int, ...]:
    block_shape = tuple(int(b) for b in block_shape)
    if len(block_shape) != len(shape) or any(b < 1 for b in block_shape):
        raise ValueError(
            f"block_shape must give one positive block length per axis of the array "
            f"(shape {shape}), got {block_shape}"
        )
    return block_shape


def _axis_size(mesh: Any, axis: Any) -> int:
    names = axis if isinstance(axis, tuple) else (axis,)
    return math.prod(mesh.shape[n] for n in names)


def split_axis(x: jax.Array, axis: int, size: int) -> jax.Array:
    """``x`` with ``axis`` split in two, ``(n / size, size)``.

    Under an explicit mesh (where JAX cannot infer such a reshape's sharding) the outer
    half keeps the axis's sharding when the blocks divide over its devices, so blocks stay
    where they are; otherwise the axis is gathered first (blocks that straddle devices)."""
    n = x.shape[axis]
    shape = (*x.shape[:axis], n // size, size, *x.shape[axis + 1 :])
    mesh, spec = _explicit(x)
    if spec is None:
        return x.reshape(shape)
    a = spec[axis]
    if a is not None and (n // size) % _axis_size(mesh, a) != 0:
        spec[axis] = a = None
        x = jax.sharding.reshard(
            x, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(*spec))
        )
    out = jax.sharding.PartitionSpec(*spec[:axis], a, None, *spec[axis + 1 :])
    return jnp.reshape(x, shape, out_sharding=jax.sharding.NamedSharding(mesh, out))


def blocked(x: jax.Array, block_shape: tuple[int, ...]) -> jax.Array:
    """``x`` zero-padded to whole blocks and reshaped to ``(n0/b0, b0, n1/b1, b1, ...)``."""
    pad = [(0, -n % b) for n, b in zip(x.shape, block_shape, strict=True)]
    if any(p for _, p in pad):
        x = jnp.pad(x, pad)
    for axis in reversed(range(x.ndim)):  # the last first: earlier axes keep their index
        x = split_axis(x, axis, block_shape[axis])
    return x


def _explicit(x: jax.Array) -> tuple[Any, list[Any] | None]:
    """The explicit mesh of ``x`` and its spec (one entry per axis), or ``(None, None)``."""
    sharding = getattr(jax.typeof(x), "sharding", None)
    mesh, spec = getattr(sharding, "mesh", None), getattr(sharding, "spec", None)
    if mesh is None or spec is None or mesh.empty or all(a is None for a in spec):
        return None, None
    return mesh, list(spec) + [None] * (x.ndim - len(spec))


def unblocked(xb: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    """The inverse of :func:`blocked`: ``(n0/b0, b0, ...)`` merged and the padding cut."""
    padded = tuple(xb.shape[2 * i] * xb.shape[2 * i + 1] for i in range(len(shape)))
    mesh, spec = _explicit(xb)
    if spec is None or any(a is not None for a in spec[1::2]):
        x = xb.reshape(padded)
    else:
        target = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(*spec[::2]))
        x = jnp.reshape(xb, padded, out_sharding=target)
    if padded != shape:
        x = x[tuple(slice(0, n) for n in shape)]
    return x


def expand_blocks(codes: jax.Array) -> jax.Array:
    """Block codes shaped ``(n0/b0, 1, n1/b1, 1, ...)`` to broadcast against a blocked array."""
    return codes.reshape([v for n in codes.shape for v in (n, 1)])


def _quantize(x: jax.Array, block_shape: tuple[int, ...], fmt: ElementFormat, rounding: str):
    xb = blocked(x.astype(jnp.float32), block_shape)
    inner = tuple(range(1, xb.ndim, 2))
    a = amax_bits(xb, inner)
    codes = shared_exponent(a, rounding, fmt.max, fmt.mantissa_bits)
    e = expand_blocks(codes)
    q = jnp.clip(ldexp(xb, 127 - e), -fmt.max, fmt.max)
    q = jnp.where(e == NAN_CODE, 0.0, q)  # the NaN scale carries the block's non-finite value
    return xb, a, codes, fmt.round(q)


def quantize_blocks(
    x: jax.Array, block_shape: tuple[int, ...], fmt: Any = "e4m3", rounding: str = "up"
) -> BlockArray:
    """Quantizes ``x`` in blocks of ``block_shape``, one E8M0 scale per block.

    Args:
      x: a float array (float32, bfloat16 or float16; read exactly as float32).
      block_shape: the block length along each axis, e.g. ``(1, 32)`` for MX blocks of 32
        along the last axis of a matrix, ``(128, 128)`` for DeepSeek-V3 weight blocks. Axes
        that are not a multiple are zero-padded at the end (padding never changes a scale).
      fmt: the element format (:func:`element_format`).
      rounding: the shared exponent's rule, ``"up"`` (default), ``"down"`` or
        ``"outlier_aware"`` (``jdls.fp8._e8m0``).

    Returns:
      A :class:`BlockArray`.

    Example:
      >>> import jax.numpy as jnp
      >>> from jdls.fp8._block import quantize_blocks, dequantize_blocks
      >>> x = jnp.array([[1.0, -3.0, 500.0, 0.5]])
      >>> q = quantize_blocks(x, (1, 2), "e4m3", "up")
      >>> q.scales_float32.tolist(), dequantize_blocks(q).tolist()
      ([[0.0078125, 2.0]], [[1.0, -3.0, 512.0, 0.5]])
    """
    return quantize_and_measure(x, block_shape, fmt, rounding)[0]


def dequantize_blocks(q: BlockArray) -> jax.Array:
    """The float32 values ``values * 2**e`` of a :class:`BlockArray` (NaN in NaN-scaled blocks).

    Products below ``2**-126`` become zero, as XLA CPU's float32 arithmetic makes them.
    """
    vb = blocked(q.values.astype(jnp.float32), q.block_shape)
    e = expand_blocks(q.codes.astype(jnp.int32))
    out = jnp.where(e == NAN_CODE, jnp.nan, ldexp(vb, e - 127))
    return unblocked(out, q.values.shape)


def block_stats(
    x: jax.Array, block_shape: tuple[int, ...], fmt: Any = "e4m3", rounding: str = "up"
) -> dict[str, jax.Array]:
    """What block quantization did to ``x``: three float32 fractions.

    - ``"clipped"``: finite blocks whose largest magnitude exceeded ``fmax`` after scaling
      (so it was clipped), over all blocks;
    - ``"flushed"``: non-zero finite values that became zero, over all values;
    - ``"nonfinite"``: blocks holding inf or NaN (their scale is NaN), over all blocks;

    and ``"amax"``, the largest magnitude (inf when ``x`` holds an inf or NaN).

    Example:
      >>> import jax.numpy as jnp
      >>> from jdls.fp8._block import block_stats
      >>> x = jnp.array([[449.0, 1e-6, 1.0, jnp.inf]])
      >>> {k: float(v) for k, v in block_stats(x, (1, 2), "e4m3", "down").items()}
      {'clipped': 0.5, 'flushed': 0.25, 'nonfinite': 0.5, 'amax': inf}
    """
    return quantize_and_measure(x, block_shape, fmt, rounding)[1]


def quantize_and_measure(
    x: jax.Array, block_shape: tuple[int, ...], fmt: Any = "e4m3", rounding: str = "up"
) -> tuple[BlockArray, dict[str, jax.Array]]:
    """:func:`quantize_blocks` and :func:`block_stats` in one pass, plus ``"amax"``: the
    largest magnitude of ``x`` in float32 (inf when ``x`` holds an inf or NaN)."""
    x = jnp.asarray(x)
    fmt = element_format(fmt)
    if rounding not in ROUNDINGS:
        raise ValueError(
            f"rounding must be one of {ROUNDINGS} (how the shared exponent is rounded), "
            f"got {rounding!r}"
        )
    array, stats = _quantize_and_measure(x, check_blocks(x.shape, block_shape), fmt, rounding)
    return array, dict(zip(("clipped", "flushed", "nonfinite", "amax"), stats, strict=True))


# Compiled as one program, also when called eagerly: op by op it lowered 95 small programs
# (3.3 s the first time on a 2-core CPU, 0.43 s as one). The statistics come back as a tuple,
# in quantize_and_measure's order (a jitted dict would come back with its keys sorted).
# Inside a user's jit it is inlined (``inline=True``): the program is the operations'.
@functools.partial(jax.jit, static_argnums=(1, 2, 3), inline=True)
def _quantize_and_measure(
    x: jax.Array, block_shape: tuple[int, ...], fmt: ElementFormat, rounding: str
) -> tuple[BlockArray, tuple[jax.Array, ...]]:
    xb, a, codes, q = _quantize(x, block_shape, fmt, rounding)
    finite = codes != NAN_CODE
    top = ldexp(lax.bitcast_convert_type(a, jnp.float32), 127 - codes)
    clipped = finite & (top > fmt.max)
    nonzero = (lax.bitcast_convert_type(xb, jnp.uint32) & jnp.uint32(0x7FFFFFFF)) != 0
    flushed = nonzero & (q.astype(jnp.float32) == 0) & expand_blocks(finite)
    blocks = math.prod(codes.shape)
    amax = lax.bitcast_convert_type(jnp.max(a), jnp.float32) if a.size else jnp.float32(0)
    stats = (
        jnp.sum(clipped, dtype=jnp.float32) / blocks,
        jnp.sum(flushed, dtype=jnp.float32) / max(x.size, 1),
        jnp.sum(~finite, dtype=jnp.float32) / blocks,
        jnp.where(jnp.isfinite(amax), amax, jnp.inf),
    )
    array = BlockArray(unblocked(q, x.shape), codes.astype(jnp.uint8), block_shape, fmt.name)
    return array, stats
