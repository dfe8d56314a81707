"""What an FP8 recipe is: the protocol, the quantized tensor and the measurement it returns.

A recipe is plain, hashable configuration (a frozen dataclass) that knows four things:

* ``init(role)``: the state of one tensor of a dot (a pytree of arrays, possibly empty);
* ``quantize(x, state, role, axes)``: ``x`` cast to its element format with its scale, as a
  :class:`Quantized`, and what was seen on the way, a :class:`Measurement`;
* ``update(state, measurement, role, skipped)``: the state of the next step;
* ``compute_dtype``: the dtype the dot accumulates in (``None``: the operands' dtype);
* ``requantize_backward``: whether the backward dots quantize the operands again along their
  own contraction axes (block scaling) or reuse the forward's quantized operands (per tensor).

``role`` is ``"lhs"``, ``"rhs"`` or ``"grad"`` (the output gradient); ``axes`` are the axes of
``x`` that the dot contracts, for recipes whose scales are per block along them.

A :class:`Quantized` holds ``values`` (float8, or float32 holding a jdls.FloatFormat's
values) and ``scale``, the dequantization scale: ``values * scale`` approximates ``x``. The
scale is either a scalar (one per tensor) or an array of the same rank as ``values`` whose
every dimension divides the values' one: each scale covers a block of
``values.shape[i] // scale.shape[i]`` elements along axis ``i``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal, Protocol

import jax
import jax.numpy as jnp
import numpy as np
from flax import serialization, struct

from jdls._floats.formats import FloatFormat
from jdls._floats.lookup import canonical_format
from jdls.fp8._formats import cast, format_max, saturation_limit

__all__ = [
    "Measurement",
    "Quantized",
    "Recipe",
    "Role",
    "measure",
    "quantize_with_scale",
    "register_fields",
    "rescaled_history_state",
    "scale_from_amax",
]

Role = Literal["lhs", "rhs", "grad"]
ROLES: tuple[Role, ...] = ("lhs", "rhs", "grad")


@struct.dataclass
class Measurement:
    """What a quantize point saw in one step; float32 scalars, combined by ``max``.

    Attributes:
      amax: the largest magnitude of the tensor before scaling; ``inf`` when the tensor held
        an inf or a NaN.
      saturated: fraction of values clipped to the format's largest finite value.
      flushed: the non-zero values that became zero, as a fraction of all the tensor's
        values (zeros included).
      error: the relative L2 error of the dot's weight gradient, for the output gradient of
        a recipe that measures it (``jdls.fp8.nvfp4(measure_error=True)``); 0 otherwise.
    """

    amax: jax.Array
    saturated: jax.Array
    flushed: jax.Array
    error: jax.Array = dataclasses.field(default_factory=lambda: jnp.zeros((), jnp.float32))

    @classmethod
    def zeros(cls) -> Measurement:
        """The zero measurement: the value of a site's meter before the backward pass."""
        z = jnp.zeros((), jnp.float32)
        return cls(amax=z, saturated=z, flushed=z, error=z)

    def combine(self, other: Measurement) -> Measurement:
        """The measurement of two uses (micro-batches, data shards): the maximum of each."""
        return jax.tree.map(jnp.maximum, self, other)


def register_fields(cls: type, name: str, optional: frozenset[str]) -> None:
    """Registers ``cls`` (a dataclass) with Flax serialization field by field: a state saved
    before one of the ``optional`` fields existed restores it from the target; an unknown or
    other missing field is an error that names the fields."""
    fields = [f.name for f in dataclasses.fields(cls)]

    def to_state_dict(value: Any) -> dict[str, Any]:
        return {f: serialization.to_state_dict(getattr(value, f)) for f in fields}

    def from_state_dict(target: Any, state: dict[str, Any]) -> Any:
        missing = sorted(set(fields) - set(state) - optional)
        unknown = sorted(set(state) - set(fields))
        if missing or unknown:
            raise ValueError(
                f"cannot restore a {name} from the saved fields {sorted(state)}: unknown "
                f"{unknown}, missing {missing}; restore into a target built with the same "
                "FP8 recipe as the one that was saved"
            )
        values = {
            f: serialization.from_state_dict(getattr(target, f), state[f], f)
            for f in fields
            if f in state
        }
        return dataclasses.replace(target, **values)

    serialization.register_serialization_state(cls, to_state_dict, from_state_dict, override=True)


# ``error`` came after the other fields: a state saved before it restores the target's.
register_fields(Measurement, "jdls.fp8.Measurement", frozenset({"error"}))


@struct.dataclass
class Quantized:
    """A tensor in an FP8 (or emulated) format with its dequantization scale.

    Attributes:
      values: the element values (float8, or float32 for a jdls.FloatFormat).
      scale: float32, a scalar or a per-block array of the values' rank (see the module
        docstring); ``values * scale`` approximates the original tensor.
    """

    values: jax.Array
    scale: jax.Array

    def dequantize(self, dtype: Any = jnp.float32) -> jax.Array:
        """``values * scale`` in ``dtype``, each scale repeated over its block."""
        scale = self.scale.astype(dtype)
        if scale.ndim:
            for axis, (n, k) in enumerate(zip(self.values.shape, scale.shape, strict=True)):
                if n != k:
                    scale = jnp.repeat(scale, n // k, axis=axis)
        return self.values.astype(dtype) * scale


class Recipe(Protocol):
    """The interface every FP8 recipe implements (see the module docstring)."""

    @property
    def requantize_backward(self) -> bool: ...

    @property
    def compute_dtype(self) -> Any: ...

    def init(self, role: Role) -> Any: ...

    def quantize(
        self, x: jax.Array, state: Any, role: Role, axes: tuple[int, ...]
    ) -> tuple[Quantized, Measurement]: ...

    def update(
        self, state: Any, measurement: Measurement, role: Role, skipped: jax.Array
    ) -> Any: ...


def scale_from_amax(
    amax: jax.Array,
    previous: jax.Array,
    fmax: float,
    margin: float = 0,
    power_of_two: bool = False,
) -> jax.Array:
    """The dequantization scale that maps ``amax`` to the format's largest value ``fmax``.

    The scaling factor is ``(fmax / amax) / 2**margin`` (TransformerEngine's formula), rounded
    down to a power of two when ``power_of_two``; the returned scale is its reciprocal. When
    ``amax`` is 0, inf or NaN, or the factor would overflow, the ``previous`` scale is kept.

    Args:
      amax: float32, the amax the scale is for.
      previous: float32, the scale kept when ``amax`` cannot give one.
      fmax: the largest finite value of the element format.
      margin: the factor is divided by ``2**margin``.
      power_of_two: round the factor down to a power of two (the scale up).

    Returns:
      float32, the dequantization scale.

    Example:
      >>> import jax.numpy as jnp
      >>> from jdls.fp8 import scale_from_amax
      >>> float(scale_from_amax(jnp.float32(3.5), jnp.float32(1.0), 448.0))
      0.0078125
      >>> float(scale_from_amax(jnp.float32(jnp.inf), jnp.float32(0.5), 448.0))
      0.5
    """
    factor = (fmax / amax) / (2.0**margin)
    if power_of_two:
        _, exponent = jnp.frexp(factor)
        factor = jnp.ldexp(jnp.ones_like(factor), exponent - 1)
    ok = (amax > 0.0) & jnp.isfinite(amax) & jnp.isfinite(factor)
    factor = jnp.where(ok, factor, 1.0 / previous)
    return 1.0 / factor


def rescaled_history_state(state: Any, factor: jax.Array) -> Any:
    """A per-tensor state (``scale`` and an amax ``history``, 0 where empty) for the tensor
    multiplied by ``factor`` (a loss scale): its scale times ``factor``; the history keeps
    the amaxes of the unscaled tensor. Before the first amax is recorded the scale (1)
    applies to the tensor as it comes, loss scale and all, as without a loss scale: a fresh
    site keeps the range the loss scale gives small gradients."""
    recorded = jnp.any(state.history > 0, axis=-1)
    return dataclasses.replace(state, scale=state.scale * jnp.where(recorded, factor, 1.0))


def measure(
    x: jax.Array, scaled: jax.Array, values: jax.Array, fmax: jax.Array, fmt: Any = None
) -> Measurement:
    """The :class:`Measurement` of quantizing ``x``: ``scaled = x / scale`` became ``values``.

    ``saturated`` counts the values the clip to ``fmax`` changed: with ``fmt``, a value just
    above ``fmax`` that rounds to ``fmax`` anyway (``x / scale`` one float32 ulp above it) is
    not counted (:func:`jdls.fp8._formats.saturation_limit`).
    """
    finite = jnp.isfinite(scaled)
    amax = jnp.max(jnp.abs(x)).astype(jnp.float32) if x.size else jnp.float32(0)
    # A NaN can be dropped by a max reduction on some backends: test finiteness on its own.
    amax = jnp.where(jnp.all(jnp.isfinite(x)), amax, jnp.inf)
    if fmt is None:
        beyond = jnp.abs(scaled) > fmax
    else:
        limit, inclusive = saturation_limit(fmt)
        bound = jnp.asarray(limit, jnp.float32)
        magnitude = jnp.abs(scaled).astype(jnp.float32)
        beyond = magnitude >= bound if inclusive else magnitude > bound
    saturated = jnp.mean(beyond & finite, dtype=jnp.float32)
    flushed = jnp.mean((x != 0) & (values == 0), dtype=jnp.float32)
    return Measurement(amax=amax, saturated=saturated, flushed=flushed)


def quantize_with_scale(
    x: jax.Array, scale: jax.Array, fmt: Any, compute_dtype: Any | None
) -> tuple[Quantized, Measurement]:
    """Quantizes ``x`` with one dequantization ``scale`` for the whole tensor.

    ``x / scale`` is computed in ``compute_dtype`` (``None``: ``x``'s dtype), clipped to the
    format's finite range and rounded to ``fmt``. An inf or NaN is not clipped: it stays
    non-finite (a NaN in formats without inf), so that it reaches the gradients and the step is
    skipped.
    """
    dtype = x.dtype if compute_dtype is None else compute_dtype
    x = x.astype(dtype)
    fmax = jnp.asarray(format_max(fmt), dtype)
    scaled = x / jnp.broadcast_to(scale.astype(dtype), x.shape)
    clipped = jnp.where(jnp.isfinite(scaled), jnp.clip(scaled, -fmax, fmax), scaled)
    values = cast(clipped, fmt)
    return Quantized(values=values, scale=scale.astype(jnp.float32)), measure(
        x, scaled, values, fmax, fmt
    )


def element_format(formats: Any, role: Role) -> Any:
    """The element format of ``role``: ``formats.backward`` for the gradient, else forward."""
    return formats.backward if role == "grad" else formats.forward


def canonical_compute_dtype(compute_dtype: Any) -> np.dtype | None:
    """A recipe's ``compute_dtype`` in its one spelling (:func:`jdls._floats.lookup.canonical_format`):
    ``jnp.bfloat16``, ``"bfloat16"`` and ``np.dtype("bfloat16")`` become one numpy dtype, so
    that equal recipes compare and hash equal and ``jax.jit`` compiles once. ``None`` (the
    operands' dtype) stays ``None``.

    Raises:
      TypeError: ``compute_dtype`` is not a floating-point dtype XLA computes in (an emulated
        :class:`jdls.FloatFormat` is not: the dot accumulates in a real dtype).
    """
    if compute_dtype is None:
        return None
    hint = 'pass a dtype such as jnp.float32, "bfloat16" or np.dtype("float16"), or None'
    try:
        fmt = canonical_format(compute_dtype)
    except TypeError:
        raise TypeError(
            f"compute_dtype must be a floating-point dtype: {hint}; got {compute_dtype!r}"
        ) from None
    if isinstance(fmt, FloatFormat):
        raise TypeError(
            f"compute_dtype must be a dtype XLA computes in, not the emulated format {fmt!r}: "
            f"{hint} (an emulated element format goes in formats=, e.g. "
            "jdls.fp8.Formats(jdls.FloatFormat(4, 3), 'e5m2'))"
        )
    return fmt


def check_role(role: str) -> None:
    if role not in ROLES:
        raise ValueError(f"role must be one of {ROLES}, got {role!r}")
