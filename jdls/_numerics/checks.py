"""Argument validators and dtype predicates shared by every jdls module.

The names here are public inside this private module: other jdls modules import them, users
do not. Every validator returns the checked value (converted) or raises an error that names
the argument, what it got, and what to pass instead.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

__all__ = [
    "F32_MAX",
    "F32_TINY",
    "I32_MAX",
    "all_finite",
    "check_int",
    "check_limit",
    "check_number",
    "check_positive_finite",
    "finite_flag",
    "holds_floats",
    "is_float",
    "is_float_array",
]

F32_MAX = float(np.finfo(np.float32).max)
F32_TINY = float(np.finfo(np.float32).tiny)  # smallest normal float32: XLA flushes below it
I32_MAX = int(np.iinfo(np.int32).max)


# --------------------------------------------------------------------------------------------
# Dtype predicates.
# --------------------------------------------------------------------------------------------


def is_float(x: Any) -> bool:
    """Whether ``x`` (an array, a scalar or a ``ShapeDtypeStruct``) has a float or complex dtype."""
    return bool(jnp.issubdtype(jnp.result_type(x), jnp.inexact))


def holds_floats(tree: Any, refuse: type | tuple[type, ...] = ()) -> bool:
    """Whether ``tree`` holds an array (anything with a dtype) of a float or complex dtype and
    no leaf of a type in ``refuse`` (what a probe after a method measures: not a method that
    returns part of the model)."""
    leaves = jax.tree_util.tree_leaves(tree, is_leaf=lambda x: isinstance(x, refuse))
    if any(isinstance(x, refuse) for x in leaves):
        return False
    return any(hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.inexact) for x in leaves)


def is_float_array(x: Any) -> bool:
    """Whether ``x`` is a numpy or JAX array with a real floating-point dtype."""
    return isinstance(x, np.ndarray | jax.Array) and bool(jnp.issubdtype(x.dtype, jnp.floating))


def all_finite(tree: Any) -> jax.Array:
    """Whether every element of every floating-point leaf of ``tree`` is finite.

    Integer and boolean leaves are ignored; an empty tree is finite.

    Args:
      tree: a pytree of arrays.

    Returns:
      A boolean scalar array: False when any float leaf holds an inf, -inf or NaN.

    Example:
      >>> import jax.numpy as jnp, jdls
      >>> bool(jdls.all_finite({"w": jnp.ones(3), "step": jnp.array(7)}))
      True
      >>> bool(jdls.all_finite([jnp.array([1.0, jnp.inf])]))
      False
    """
    flags = [jnp.all(jnp.isfinite(x)) for x in jax.tree_util.tree_leaves(tree) if is_float(x)]
    if not flags:
        return jnp.array(True)
    return flags[0] if len(flags) == 1 else jnp.all(jnp.stack(flags))


# --------------------------------------------------------------------------------------------
# Numbers.
# --------------------------------------------------------------------------------------------


def check_number(name: str, value: Any) -> float:
    """``value`` as a Python float: a real number or a 0-d array, never a string, bool or NaN."""
    if isinstance(value, str | bytes):  # float("1024") would succeed: say it is the wrong type
        raise TypeError(f"{name} must be a real number, got {value!r}")
    if isinstance(value, bool) or not isinstance(value, int | float | np.number):
        try:
            value = float(np.asarray(value))  # also accepts 0-d arrays
        except (TypeError, ValueError):
            raise TypeError(f"{name} must be a real number, got {value!r}") from None
    value = float(value)
    if math.isnan(value):
        raise ValueError(f"{name} must be a number, got nan")
    return value


def check_positive_finite(name: str, value: Any) -> float:
    """A number > 0 that float32 holds as a normal number (XLA flushes smaller ones to 0)."""
    value = check_number(name, value)
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
    if value > F32_MAX:
        raise ValueError(f"{name} must fit in float32 (<= {F32_MAX:.6g}), got {value!r}")
    if value < F32_TINY:
        raise ValueError(
            f"{name} must be a normal float32 number (>= {F32_TINY:.6g}), got {value!r}: XLA "
            "flushes smaller values to 0"
        )
    return value


def check_int(name: str, value: Any, minimum: int) -> int:
    """An int (not a bool) in ``[minimum, int32 max]``."""
    if isinstance(value, bool) or not isinstance(value, int | np.integer):
        raise TypeError(f"{name} must be an int, got {value!r}")
    value = int(value)
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    if value > I32_MAX:
        raise ValueError(f"{name} must fit in int32 (<= {I32_MAX}), got {value}")
    return value


def check_limit(name: str, value: Any) -> Any:
    """A clipping limit: a finite number > 0 that fits float32 (traced values pass unchecked)."""
    if isinstance(value, jax.Array):
        if value.shape != ():
            raise ValueError(f"{name} must be a scalar, got an array of shape {value.shape}")
        try:
            value = value.item()
        except jax.errors.ConcretizationTypeError:
            return value  # a traced hyperparameter (inject_hyperparams): cannot be checked here
    if isinstance(value, bool) or not isinstance(value, int | float | np.number):
        raise TypeError(f"{name} must be a number, got {type(value).__name__} {value!r}")
    value = float(value)
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
    if value > F32_MAX:
        raise ValueError(
            f"{name} must fit in float32 (<= {F32_MAX:.6g}), got {value!r}: it would be inf "
            "in the float32 norm computation"
        )
    return value


def finite_flag(grads_finite: Any) -> jax.Array:
    """``grads_finite`` as a boolean scalar array, or an error that says what to pass."""
    hint = "pass jdls.all_finite(grads), whether the unscaled gradients were all finite"
    try:
        flag = jnp.asarray(grads_finite)
    except (TypeError, ValueError):  # a dict of gradients gives a ValueError
        raise TypeError(
            f"adjust expects a boolean scalar, got {type(grads_finite).__name__}: {hint}"
        ) from None
    if flag.shape != ():
        raise ValueError(
            f"adjust expects a boolean scalar, got an array of shape {flag.shape}: {hint}"
        )
    if not (flag.dtype == jnp.bool_ or jnp.issubdtype(flag.dtype, jnp.integer)):
        raise TypeError(
            f"adjust expects a boolean scalar, got a {flag.dtype} value (the loss?): {hint}"
        )
    return flag.astype(jnp.bool_)
