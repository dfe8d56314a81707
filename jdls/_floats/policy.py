"""Mixed-precision policies (jmp-compatible) with native and emulated compute formats.

A :class:`Policy` names the formats of parameters, computation and outputs and casts the
floating-point leaves of pytrees between them; casts to emulated formats (a
:class:`jdls.FloatFormat`) round values and, backward, cotangents to the format's grid. The
string syntax and the exact backward rule of a cast: docs/formats.md, "Precision policies".
"""

from __future__ import annotations

import dataclasses
import functools
import re
from collections.abc import Callable
from typing import Any, TypeVar

import jax
import jax.numpy as jnp
import numpy as np

from jdls._floats.formats import FloatFormat, cbfloat16
from jdls._numerics.checks import is_float_array

__all__ = ["Policy", "get_policy"]

T = TypeVar("T")

PolicyDType = np.dtype | FloatFormat
"""A format a policy can name: a numpy dtype (native) or a :class:`FloatFormat` (emulated)."""

# Names accepted in policy strings. jmp's names first (its first name is the one ``str`` uses),
# then the float8 types of ml_dtypes that jax.numpy exposes, then the emulated formats.
_NATIVE_NAMES: dict[str, tuple[str, ...]] = {
    "bfloat16": ("bf16", "bfloat16"),
    "float16": ("f16", "float16"),
    "float32": ("full", "f32", "float32"),
    "float64": ("f64", "float64"),
}
_FLOAT8_NAMES = tuple(
    name
    for name in (
        "float8_e3m4",
        "float8_e4m3",
        "float8_e4m3b11fnuz",
        "float8_e4m3fn",
        "float8_e4m3fnuz",
        "float8_e5m2",
        "float8_e5m2fnuz",
    )
    if hasattr(jnp, name)
)
_EMULATED_NAMES: dict[str, FloatFormat] = {"cbfloat16": cbfloat16, "cbf16": cbfloat16}


def _name_table() -> dict[str, PolicyDType]:
    table: dict[str, PolicyDType] = {}
    for dtype_name, names in _NATIVE_NAMES.items():
        for name in names:
            table[name] = np.dtype(getattr(jnp, dtype_name))
    for name in _FLOAT8_NAMES:
        table[name] = np.dtype(getattr(jnp, name))
    table.update(_EMULATED_NAMES)
    return table


_NAME_TO_DTYPE = _name_table()


def _accepted() -> str:
    return "half, " + ", ".join(_NAME_TO_DTYPE)


def _half_dtype() -> np.dtype:
    """jmp's ``half``: bfloat16 on TPU, float16 elsewhere."""
    on_tpu = jax.local_devices()[0].platform == "tpu"
    return np.dtype(jnp.bfloat16 if on_tpu else jnp.float16)


_FORMAT_NAME = re.compile(r"^float(\d+)_e(\d+)m(\d+)(?:_b(-?\d+))?$")


def _parse_dtype(value: str, policy_name: str | None = None) -> PolicyDType:
    value = value.strip()
    if value == "half":
        return _half_dtype()
    if value in _NAME_TO_DTYPE:
        return _NAME_TO_DTYPE[value]
    native = getattr(jnp, value, None)  # any other floating dtype of jax.numpy (float4_e2m1fn)
    if isinstance(native, type) and value.startswith("float"):
        try:
            dtype = np.dtype(native)
        except TypeError:
            dtype = None
        if dtype is not None and jnp.issubdtype(dtype, jnp.floating):
            return dtype
    match = _FORMAT_NAME.match(value)
    if match:  # an emulated format by its default name, as str(policy) writes it
        bits, e, m, bias = match.groups()
        if int(bits) == 1 + int(e) + int(m):
            return FloatFormat(int(e), int(m), None if bias is None else int(bias))
    where = f" in policy {policy_name!r}" if policy_name is not None else ""
    raise ValueError(f"Unknown dtype {value!r}{where}; accepted names are: {_accepted()}") from None


def _normalize(field: str, dtype: Any) -> PolicyDType:
    if isinstance(dtype, FloatFormat):
        return dtype
    if isinstance(dtype, str):
        return _parse_dtype(dtype)
    try:
        dt = np.dtype(dtype)
    except TypeError:
        raise TypeError(
            f"{field} must be a floating dtype, a dtype name or a jdls.FloatFormat, got {dtype!r}"
        ) from None
    if not jnp.issubdtype(dt, jnp.floating):
        raise ValueError(f"{field} must be a floating dtype, got {dt}")
    return dt


def _dtype_name(dtype: PolicyDType) -> str:
    """The name ``str(policy)`` writes: one that :func:`get_policy` parses back to ``dtype``."""
    if isinstance(dtype, FloatFormat):
        if _EMULATED_NAMES.get(dtype.name) == dtype:
            return dtype.name
        # A custom label cannot be parsed back; the default name says the bits and the bias.
        name = FloatFormat(dtype.exponent_bits, dtype.mantissa_bits, dtype.bias).name
        if name in _NAME_TO_DTYPE or hasattr(jnp, name):  # float8_e4m3 is also a native type
            name += f"_b{dtype.bias}"  # the explicit bias marks the emulated format
        return name
    for dtype_name, names in _NATIVE_NAMES.items():
        if dtype == np.dtype(getattr(jnp, dtype_name)):
            return names[0]
    return str(dtype)


# --------------------------------------------------------------------------------------------
# Casting.
# --------------------------------------------------------------------------------------------


def _to(fmt: PolicyDType, x: jax.Array) -> jax.Array:
    """Forward conversion of one array to a format (emulated: float32 on the grid)."""
    if isinstance(fmt, FloatFormat):
        return fmt.round(x.astype(jnp.float32))
    return x.astype(fmt)


@functools.cache
def _emulated_cast(
    dst: PolicyDType, src: FloatFormat | None, in_dtype: np.dtype
) -> Callable[[jax.Array], jax.Array]:
    """A cast with backward ``round_src(round_dst(g))`` converted back to ``in_dtype``."""

    @jax.custom_vjp
    def cast(x: jax.Array) -> jax.Array:
        return _to(dst, x)

    def fwd(x: jax.Array) -> tuple[jax.Array, None]:
        return _to(dst, x), None

    def bwd(_: None, g: jax.Array) -> tuple[jax.Array]:
        g = _to(dst, g)  # the cotangent of a dst value is a dst value
        if src is not None:
            g = src.round(g.astype(jnp.float32))
        return (g.astype(in_dtype),)

    cast.defvjp(fwd, bwd)
    return cast


def _cast_floating_to(tree: T, dst: PolicyDType, src: PolicyDType) -> T:
    def cast(x: Any) -> Any:
        if not is_float_array(x):
            return x
        emulated_src = src if isinstance(src, FloatFormat) and x.dtype == np.float32 else None
        if not isinstance(dst, FloatFormat) and emulated_src is None:
            return x.astype(dst)  # native: JAX's own transpose converts the cotangent
        x = jnp.asarray(x)
        return _emulated_cast(dst, emulated_src, np.dtype(x.dtype))(x)

    return jax.tree_util.tree_map(cast, tree)


@dataclasses.dataclass(frozen=True)
class Policy:
    """A mixed-precision policy: formats for parameters, computation and outputs.

    Compatible with ``jmp.Policy`` (same fields, methods and string form), and extended with
    emulated formats: a field may be a :class:`jdls.FloatFormat` such as
    :data:`jdls.cbfloat16`. Fields given as dtype names, numpy dtypes or scalar types
    (``jnp.float16``) are normalised to ``np.dtype``; ``FloatFormat`` fields are kept. Casts
    touch only floating-point array leaves (``np.ndarray`` or ``jax.Array``); integers,
    Python scalars and ``None`` pass through. The backward rule of the casts:
    docs/formats.md, "The backward pass of a cast".

    References:
      jmp, "Mixed precision training in JAX" (https://github.com/google-deepmind/jmp):
      ``jmp.Policy`` and ``jmp.get_policy``.

    Attributes:
      param_dtype: format of the parameters (:meth:`cast_to_param`).
      compute_dtype: format of the computation (:meth:`cast_to_compute`).
      output_dtype: format of the outputs (:meth:`cast_to_output`).

    Example:
      >>> import jax.numpy as jnp
      >>> import jdls
      >>> policy = jdls.Policy(jnp.float32, jdls.cbfloat16, jnp.float32)
      >>> x = policy.cast_to_compute(jnp.array([1.0 + 2.0**-12, 1e-13]))
      >>> x.dtype, [float(v) for v in x]
      (dtype('float32'), [1.0, 0.0])
      >>> str(policy)
      'p=full,c=cbfloat16,o=full'
    """

    param_dtype: PolicyDType
    compute_dtype: PolicyDType
    output_dtype: PolicyDType

    def __post_init__(self) -> None:
        for field in ("param_dtype", "compute_dtype", "output_dtype"):
            object.__setattr__(self, field, _normalize(field, getattr(self, field)))

    def cast_to_param(self, x: T) -> T:
        """Converts the floating-point leaves of ``x`` to the param format.

        Args:
          x: a pytree (often gradients computed in the compute format).

        Returns:
          ``x`` with floating-point array leaves converted (emulated: float32 on the grid).

        Example:
          >>> import jax.numpy as jnp
          >>> import jdls
          >>> jdls.get_policy("p=f16,c=f32").cast_to_param(jnp.ones(2)).dtype
          dtype('float16')
        """
        return _cast_floating_to(x, self.param_dtype, self.compute_dtype)

    def cast_to_compute(self, x: T) -> T:
        """Converts the floating-point leaves of ``x`` to the compute format.

        Args:
          x: a pytree (parameters, inputs, intermediate activations).

        Returns:
          ``x`` with floating-point array leaves converted (emulated: float32 on the grid;
          the backward pass rounds cotangents to the grid as well).

        Example:
          >>> import jax
          >>> import jax.numpy as jnp
          >>> import jdls
          >>> policy = jdls.get_policy("params=float32,compute=cbfloat16,output=float32")
          >>> grad = jax.grad(lambda w: 1e-13 * policy.cast_to_compute(w).sum())(jnp.ones(2))
          >>> [float(g) for g in grad]  # 1e-13 is below cbfloat16's smallest subnormal / 2
          [0.0, 0.0]
        """
        return _cast_floating_to(x, self.compute_dtype, self.param_dtype)

    def cast_to_output(self, x: T) -> T:
        """Converts the floating-point leaves of ``x`` to the output format.

        Args:
          x: a pytree of compute-format values (the model's outputs).

        Returns:
          ``x`` with floating-point array leaves converted.

        Example:
          >>> import jax.numpy as jnp
          >>> import jdls
          >>> jdls.get_policy("c=bf16,o=f32").cast_to_output(jnp.ones(2, jnp.bfloat16)).dtype
          dtype('float32')
        """
        return _cast_floating_to(x, self.output_dtype, self.compute_dtype)

    def with_output_dtype(self, output_dtype: Any) -> Policy:
        """Returns a copy of this policy with another output format.

        Args:
          output_dtype: a dtype, dtype name or :class:`jdls.FloatFormat`.

        Returns:
          A new :class:`Policy`.

        Example:
          >>> import jdls
          >>> str(jdls.get_policy("c=cbfloat16").with_output_dtype("float32"))
          'p=full,c=cbfloat16,o=full'
        """
        return dataclasses.replace(self, output_dtype=output_dtype)

    def __str__(self) -> str:
        return (
            f"p={_dtype_name(self.param_dtype)},"
            f"c={_dtype_name(self.compute_dtype)},"
            f"o={_dtype_name(self.output_dtype)}"
        )


def get_policy(policy_name: str) -> Policy:
    """Parses a policy string in jmp's syntax.

    Either comma-separated ``key=dtype`` parts, with keys ``params``/``p``,
    ``compute``/``c`` and ``output``/``o`` (param defaults to float32, compute follows param,
    output follows compute, as in jmp), or a single dtype name for all three. Dtype names:
    jmp's (``float32``/``f32``/``full``, ``float16``/``f16``, ``bfloat16``/``bf16``,
    ``float64``/``f64``, ``half`` = bfloat16 on TPU else float16), the ml_dtypes float8 types
    (``float8_e4m3``, ``float8_e5m2``, ...) and the emulated ``cbfloat16`` (alias ``cbf16``).
    Whitespace around parts is ignored.

    Args:
      policy_name: e.g. ``"params=float32,compute=cbfloat16,output=float32"``, ``"c=f16"``,
        ``"bf16"``.

    Returns:
      The :class:`Policy`.

    Raises:
      ValueError: an unknown key or dtype name, or a malformed part.

    Example:
      >>> import jdls
      >>> str(jdls.get_policy("c=f16"))
      'p=full,c=f16,o=f16'
      >>> jdls.get_policy("params=float32,compute=cbfloat16,output=float32").compute_dtype.name
      'cbfloat16'
    """
    if not isinstance(policy_name, str):
        raise TypeError(f"policy_name must be a str, got {policy_name!r}")
    param: PolicyDType = np.dtype(jnp.float32)
    compute: PolicyDType | None = None
    output: PolicyDType | None = None
    if "=" in policy_name:
        for part in policy_name.split(","):
            key, sep, value = part.partition("=")
            key = key.strip()
            if not sep:
                raise ValueError(
                    f"Malformed part {part!r} in policy {policy_name!r}: expected key=dtype "
                    f"with key params/p, compute/c or output/o"
                )
            dtype = _parse_dtype(value, policy_name)
            if key in ("p", "params"):
                param = dtype
            elif key in ("c", "compute"):
                compute = dtype
            elif key in ("o", "output"):
                output = dtype
            else:
                raise ValueError(
                    f"Unknown key {key!r} in policy {policy_name!r}: should be 'params', "
                    f"'compute' or 'output' (or 'p', 'c', 'o')"
                )
        compute = param if compute is None else compute
        output = compute if output is None else output
    else:
        param = compute = output = _parse_dtype(policy_name, policy_name)
    return Policy(param_dtype=param, compute_dtype=compute, output_dtype=output)
