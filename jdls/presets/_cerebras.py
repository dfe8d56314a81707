"""Cerebras' ``GradScaler`` as a preset, and ``jdls.wrap`` configured as its ``optimizer_step``."""

from __future__ import annotations

import inspect
from typing import Any

import optax

from jdls._floats.lookup import canonical_format
from jdls._numerics.checks import check_limit, check_positive_finite
from jdls._scales.scale import DynamicScale, NoOpScale, StaticScale
from jdls._transforms.wrap import wrap
from jdls.presets._arguments import check_interval_plus_one, spelled
from jdls.rules import OverflowTolerance

__all__ = ["CEREBRAS_MIN_LOSS_SCALE", "cerebras", "cerebras_wrap"]

CEREBRAS_MIN_LOSS_SCALE = 2.0**-14
_CEREBRAS_MAX_LOSS_SCALE = {"float16": 2.0**15, "bfloat16": 2.0**15, "cbfloat16": 2.0**31}


def cerebras(
    loss_scale: str | float | None = "dynamic",
    init_scale: float | None = None,
    steps_per_increase: int | None = 2000,
    min_loss_scale: float | None = CEREBRAS_MIN_LOSS_SCALE,
    max_loss_scale: float | None = None,
    overflow_tolerance: float = 0.0,
    half_dtype: Any = "float16",
    *,
    max_gradient_norm: float | None = None,
) -> DynamicScale | StaticScale | NoOpScale:
    """Cerebras' ``cerebras.pytorch.amp.GradScaler``: the :class:`jdls.rules.OverflowTolerance` rule.

    With ``loss_scale="dynamic"``: the scale halves when the fraction of non-finite steps
    since the last change exceeds ``overflow_tolerance``, doubles after
    ``steps_per_increase + 1`` steps without a change, and is clamped to
    ``[min_loss_scale, max_loss_scale]`` after every step (the initial scale to the maximum).
    A number gives a :class:`jdls.StaticScale`; None a :class:`jdls.NoOpScale`. Cerebras'
    clipping and its finiteness test on the float32 norm are arguments of the wrap: see
    :func:`cerebras_wrap`.

    Args:
      loss_scale: ``"dynamic"``, a static scale (a number > 0), or None for no scaling.
      init_scale: initial scale (default: the maximum).
      steps_per_increase: steps without a change before a growth, >= 1 (None: 2000).
      min_loss_scale: lower clamp, >= ``2**-14`` (None: ``2**-14``).
      max_loss_scale: upper clamp (None: ``2**15`` for float16 and bfloat16, ``2**31`` for
        cbfloat16, as ``cstorch.amp.set_half_dtype`` sets it).
      overflow_tolerance: tolerated fraction of non-finite steps, >= 0.
      half_dtype: float16, bfloat16 or cbfloat16, in any spelling of a format: a name
        (``"float16"``, ``"bfloat16"``, ``"cbfloat16"``), a dtype (``jnp.bfloat16``,
        ``np.dtype("float16")``) or a :class:`jdls.FloatFormat` (``jdls.cbfloat16``).
      max_gradient_norm: not accepted here (a TypeError says where it goes: clipping is the
        wrap's, :func:`cerebras_wrap`).

    Returns:
      The scale.

    Example:
      >>> import jdls
      >>> float(jdls.presets.cerebras(half_dtype="cbfloat16").loss_scale) == 2.0**31
      True
      >>> type(jdls.presets.cerebras(loss_scale=128.0)).__name__
      'StaticScale'
    """
    if max_gradient_norm is not None:
        raise TypeError(
            "presets.cerebras builds the scale; clipping belongs to the wrap: "
            f"jdls.presets.cerebras_wrap(optimizer, max_gradient_norm={max_gradient_norm!r}, ...)"
        )
    half_dtype = _half_dtype_name(half_dtype)
    if loss_scale is None:
        return NoOpScale()
    if not (isinstance(loss_scale, str) and loss_scale == "dynamic"):
        if isinstance(loss_scale, str):
            raise ValueError(
                f'loss_scale must be "dynamic", a number > 0 or None, got {loss_scale!r}'
            )
        return StaticScale(loss_scale)
    if min_loss_scale is None:
        min_loss_scale = CEREBRAS_MIN_LOSS_SCALE
    if max_loss_scale is None:
        max_loss_scale = _CEREBRAS_MAX_LOSS_SCALE[half_dtype]
    if steps_per_increase is None:
        steps_per_increase = 2000
    names = {
        "loss_scale": "init_scale",
        "tolerance": "overflow_tolerance",
        "growth_interval": "steps_per_increase",
    }
    with spelled("cerebras", **names):
        min_value = check_positive_finite("min_loss_scale", min_loss_scale)
        if min_value < CEREBRAS_MIN_LOSS_SCALE:
            raise ValueError(
                f"min_loss_scale must be >= 2**-14 ({CEREBRAS_MIN_LOSS_SCALE}) as in Cerebras, "
                f"got {min_loss_scale!r}"
            )
        rule = OverflowTolerance(
            growth_interval=check_interval_plus_one("steps_per_increase", steps_per_increase) + 1,
            min_loss_scale=min_value,
            max_loss_scale=max_loss_scale,
            tolerance=overflow_tolerance,
        )
        return DynamicScale(max_loss_scale if init_scale is None else init_scale, rule)


def _half_dtype_name(half_dtype: Any) -> str:
    """The name (``"float16"``, ``"bfloat16"``, ``"cbfloat16"``) of ``half_dtype``, however
    it is spelled (:func:`jdls._floats.lookup.canonical_format`)."""
    names = {canonical_format(name): name for name in _CEREBRAS_MAX_LOSS_SCALE}
    try:
        name = names.get(canonical_format(half_dtype))
    except TypeError:  # not a format at all
        name = None
    if name is None:
        raise ValueError(
            f"half_dtype must be one of {sorted(_CEREBRAS_MAX_LOSS_SCALE)}, got {half_dtype!r}: "
            'pass one of these names, a dtype (jnp.float16, np.dtype("bfloat16")) or '
            "jdls.cbfloat16"
        )
    return name


def cerebras_wrap(
    inner: optax.GradientTransformation,
    *,
    max_gradient_norm: float | None = None,
    **options: Any,
) -> optax.GradientTransformationExtraArgs:
    """``jdls.wrap`` configured as Cerebras' ``optimizer_step`` with its ``GradScaler``.

    The scale is :func:`cerebras` built from the options that are its arguments; the other
    options (``axis_name``, ``sharded``, ``skip_with``, ``track_nonfinite``...) go to
    :func:`jdls.wrap`. With a dynamic scale, a step whose float32 global gradient norm is not
    finite is skipped even when every element is finite (``skip_norm_overflow=True``), as
    Cerebras decides; ``max_gradient_norm`` clips (fused into the update).

    Args:
      inner: the optax optimizer.
      max_gradient_norm: global-norm clipping limit (None: no clipping).
      **options: arguments of :func:`cerebras` and of :func:`jdls.wrap`.

    Returns:
      The transformation.

    Example:
      >>> import jax.numpy as jnp, optax, jdls
      >>> tx = jdls.presets.cerebras_wrap(optax.sgd(0.1), max_gradient_norm=1.0, skip_with="select")
      >>> float(jdls.get_scale(tx.init({"w": jnp.zeros(2)})).loss_scale)
      32768.0
    """
    scaler_names = set(inspect.signature(cerebras).parameters) - {"max_gradient_norm"}
    scale = cerebras(**{k: v for k, v in options.items() if k in scaler_names})
    wrap_options = {k: v for k, v in options.items() if k not in scaler_names}
    if max_gradient_norm is not None:
        max_gradient_norm = check_limit("max_gradient_norm", max_gradient_norm)
    return wrap(
        inner,
        scale,
        max_norm=max_gradient_norm,
        skip_norm_overflow=isinstance(scale, DynamicScale),
        **wrap_options,
    )
