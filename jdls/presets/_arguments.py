"""The arguments of the presets: checked as their libraries take them, and errors that name
them as the user spelled them.

A preset passes its library's arguments (``scale_factor``, ``min_scale``, ``init_scale``...) to
a rule and a :class:`jdls.DynamicScale` under jdls's names (``growth_factor``,
``min_loss_scale``, ``loss_scale``...), whose checks raise errors in jdls's names. Building
inside :func:`spelled` re-raises them with the preset's names.
"""

from __future__ import annotations

import contextlib
import math
import re
from collections.abc import Iterator
from typing import Any

import numpy as np

from jdls._numerics.checks import I32_MAX, check_int, check_number

__all__ = ["check_interval_plus_one", "exact_scale", "integral", "spelled"]


@contextlib.contextmanager
def spelled(preset: str, **names: str) -> Iterator[None]:
    """Re-raise a ``TypeError`` or ``ValueError`` raised inside with jdls's argument names
    replaced by the preset's: ``spelled("deepspeed", growth_factor="scale_factor")``.

    Example:
      >>> from jdls.presets._arguments import spelled
      >>> try:
      ...     with spelled("keras", loss_scale="initial_scale"):
      ...         raise ValueError("loss_scale must be > 0, got -1.0")
      ... except ValueError as e:
      ...     print(e)
      initial_scale must be > 0, got -1.0 (in jdls.presets.keras)
    """
    pattern = re.compile(r"\b(" + "|".join(map(re.escape, names)) + r")\b")
    try:
        yield
    except (TypeError, ValueError) as e:
        message = str(e)
        renamed = pattern.sub(lambda m: names[m.group(1)], message) if names else message
        raise type(e)(f"{renamed} (in jdls.presets.{preset})") from None


def check_interval_plus_one(name: str, value: object) -> int:
    """An interval the rule counts as ``value + 1`` steps: an int in ``[1, int32 max - 1]``."""
    interval = check_int(name, value, 1)
    if interval >= I32_MAX:
        raise ValueError(
            f"{name} must be < {I32_MAX} (the rule counts {name} + 1 steps in int32), got "
            f"{interval}"
        )
    return interval


def integral(name: str, value: Any, minimum: int) -> int:
    """An int given as a Python or numpy int, an integral float, or a 0-d array of either.

    jmp's own defaults are arrays (``counter=jnp.zeros([], jnp.int32)``) and its ``period`` may
    be a float (``2000.0``); what jmp accepts, the preset accepts.
    """
    if isinstance(value, bool):
        raise TypeError(f"{name} must be an int, got {value!r}")
    if not isinstance(value, int | np.integer):
        try:
            array = np.asarray(value)
        except Exception:
            raise TypeError(f"{name} must be an int, got {value!r}") from None
        if array.shape != () or not (
            np.issubdtype(array.dtype, np.integer) or np.issubdtype(array.dtype, np.floating)
        ):
            raise TypeError(f"{name} must be an int (or a 0-d integer array), got {value!r}")
        number = array.item()
        if isinstance(number, float) and not (math.isfinite(number) and number.is_integer()):
            raise ValueError(f"{name} must be a whole number, got {number!r}")
        value = int(number)
    return check_int(name, value, minimum)


def exact_scale(name: str, value: Any) -> float:
    """A number for a float32 scale; an integer (jmp warns on integer arrays, its scales must
    be floating) is taken when float32 holds it exactly, refused otherwise."""
    number = check_number(name, value)
    integral = isinstance(value, int | np.integer) or (
        hasattr(value, "dtype") and np.issubdtype(np.dtype(value.dtype), np.integer)
    )
    if integral and float(np.float32(number)) != number:
        raise ValueError(
            f"{name} must be a number float32 holds exactly (jdls's scales are float32), got "
            f"the integer {int(number)}, which float32 rounds to {float(np.float32(number))!r}: "
            "pass a scale float32 holds (a power of two, say)"
        )
    return number
