"""The rules of PyTorch, Flax, jmp, Keras, DeepSpeed and Megatron-LM: each preset picks a rule and its parameters."""

from __future__ import annotations

from typing import Any

from jdls._numerics.checks import (
    F32_MAX,
    F32_TINY,
    check_int,
    check_number,
    check_positive_finite,
)
from jdls._scales.scale import DynamicScale, NoOpScale
from jdls.presets._arguments import check_interval_plus_one, exact_scale, integral, spelled
from jdls.rules import GrowBackoff

__all__ = [
    "deepspeed",
    "deepspeed_fp16",
    "flax",
    "from_jmp",
    "jmp",
    "keras",
    "megatron",
    "pytorch",
]


def pytorch(
    init_scale: float = 2.0**16,
    growth_factor: float = 2.0,
    backoff_factor: float = 0.5,
    growth_interval: int = 2000,
    enabled: bool = True,
) -> DynamicScale | NoOpScale:
    """``torch.amp.GradScaler``: the rule of its kernel ``_amp_update_scale_``.

    Backs off by ``backoff_factor`` on every non-finite step (no minimum), grows by
    ``growth_factor`` on the ``growth_interval``-th finite step in a row, and drops a growth
    whose float32 result would be inf.

    Args:
      init_scale: initial scale.
      growth_factor: multiplier on growth, > 1.
      backoff_factor: multiplier on backoff, in (0, 1).
      growth_interval: finite steps in a row before a growth, >= 1.
      enabled: False gives a :class:`jdls.NoOpScale`, as a disabled ``GradScaler`` does not
        scale.

    Returns:
      The scale.

    Example:
      >>> import jdls
      >>> s = jdls.presets.pytorch(init_scale=8.0, growth_interval=1)
      >>> float(s.adjust(True).loss_scale)
      16.0
    """
    if not enabled:
        return NoOpScale()
    with spelled("pytorch", loss_scale="init_scale"):
        rule = GrowBackoff(
            growth_factor=growth_factor,
            backoff_factor=backoff_factor,
            growth_interval=growth_interval,
            min_loss_scale=None,
            max_loss_scale=None,
            keep_scale_if_growth_overflows=True,
        )
        return DynamicScale(check_positive_finite("init_scale", init_scale), rule)


def flax(
    growth_factor: float = 2.0,
    backoff_factor: float = 0.5,
    growth_interval: int = 2000,
    fin_steps: int = 0,
    scale: float = 65536.0,
    minimum_scale: float | None = F32_TINY,
) -> DynamicScale:
    """``flax.training.dynamic_scale.DynamicScale``.

    Growth is tested before the step is counted, so the scale grows on the
    ``(growth_interval + 1)``-th finite step in a row, clamped to the float32 maximum; a
    backoff is clamped below by ``minimum_scale``. (Flax itself never skips a step: the caller
    selects the old parameters. ``jdls.wrap`` skips.)

    Args:
      growth_factor: multiplier on growth, > 1.
      backoff_factor: multiplier on backoff, in (0, 1).
      growth_interval: finite steps in a row counted before the growing step, >= 1.
      fin_steps: initial count of finite steps, in ``[0, growth_interval]``.
      scale: initial scale.
      minimum_scale: lower bound on backoff (default float32 ``tiny``); None for no bound.

    Returns:
      The scale.

    Example:
      >>> import jdls
      >>> s = jdls.presets.flax(growth_interval=1, scale=4.0)
      >>> float(s.adjust(True).loss_scale), float(s.adjust(True).adjust(True).loss_scale)
      (4.0, 8.0)
    """
    with spelled("flax", loss_scale="scale", min_loss_scale="minimum_scale"):
        interval = check_interval_plus_one("growth_interval", growth_interval)
        if check_int("fin_steps", fin_steps, 0) > interval:
            raise ValueError(
                f"fin_steps must be in [0, growth_interval] = [0, {interval}], got {fin_steps}"
            )
        rule = GrowBackoff(
            growth_factor=growth_factor,
            backoff_factor=backoff_factor,
            growth_interval=interval + 1,
            min_loss_scale=minimum_scale,
            max_loss_scale=F32_MAX,
            keep_scale_if_growth_overflows=False,
        )
        return DynamicScale(scale, rule, state=rule.initial_state(counter=fin_steps))


def jmp(
    loss_scale: float | Any,
    counter: int | Any = 0,
    period: int | float = 2000,
    factor: float = 2,
    min_loss_scale: float | Any = 1.0,
) -> DynamicScale:
    """``jmp.DynamicLossScale``.

    Grows by ``factor`` on the ``period``-th finite step in a row (a growth to inf is dropped),
    divides by ``factor`` on a non-finite step, never below ``min_loss_scale``. Unlike jmp, the
    minimum survives a pytree round trip. Takes what jmp takes: arrays for ``loss_scale``,
    ``counter`` and ``min_loss_scale`` (jmp's defaults are arrays), a whole float ``period``,
    and ``min_loss_scale=0`` for no floor. :func:`from_jmp` converts an existing jmp scale.

    Args:
      loss_scale: initial scale (required, as in jmp; its documentation uses ``2**15``).
      counter: initial count of finite steps, in ``[0, period)``.
      period: finite steps in a row before a growth, >= 1.
      factor: growth factor and backoff divisor, > 1.
      min_loss_scale: lower bound on backoff; 0 (or None) for none.

    Returns:
      The scale.

    Example:
      >>> import jax.numpy as jnp, jdls
      >>> s = jdls.presets.jmp(loss_scale=2.0**15, counter=jnp.zeros([], jnp.int32), period=1)
      >>> float(s.adjust(True).loss_scale)
      65536.0
      >>> print(jdls.presets.jmp(loss_scale=1.0, min_loss_scale=0.0).rule.min_loss_scale)
      None
    """
    with spelled("jmp", growth_factor="factor", growth_interval="period"):
        period = integral("period", period, 1)
        counter = integral("counter", counter, 0)
        if counter >= period:
            raise ValueError(f"counter must be in [0, period) = [0, {period}), got {counter}")
        minimum: float | None = None
        if min_loss_scale is not None:
            value = exact_scale("min_loss_scale", min_loss_scale)
            if value < 0:
                raise ValueError(f"min_loss_scale must be >= 0 (0: no floor), got {value!r}")
            minimum = None if value == 0 else value  # jmp's max(0, s / factor): no floor
        rule = GrowBackoff(
            growth_factor=check_number("factor", factor),
            backoff_factor=None,
            growth_interval=period,
            min_loss_scale=minimum,
            max_loss_scale=None,
            keep_scale_if_growth_overflows=True,
        )
        return DynamicScale(
            exact_scale("loss_scale", loss_scale), rule, state=rule.initial_state(counter=counter)
        )


def from_jmp(jmp_scale: Any) -> DynamicScale:
    """The jdls scale of an existing ``jmp.DynamicLossScale``, same values and counters.

    Reads its ``loss_scale``, ``counter``, ``period``, ``factor`` and ``min_loss_scale``; from
    there the two follow the same trajectory bit for bit. (A jmp scale that went through a
    pytree round trip, e.g. out of ``jit``, has already lost its ``min_loss_scale``: jmp resets
    it to 1.)

    Args:
      jmp_scale: a ``jmp.DynamicLossScale`` (or any object with those five attributes).

    Returns:
      The scale, as :func:`jmp` builds it.

    Example:
      >>> import jax.numpy as jnp, jmp, jdls
      >>> theirs = jmp.DynamicLossScale(jnp.float32(2.0**15), period=4)
      >>> ours = jdls.presets.from_jmp(theirs)
      >>> float(ours.loss_scale), ours.rule.growth_interval
      (32768.0, 4)
    """
    fields = ("loss_scale", "counter", "period", "factor", "min_loss_scale")
    missing = [f for f in fields if not hasattr(jmp_scale, f)]
    if missing:
        raise TypeError(
            f"from_jmp expects a jmp.DynamicLossScale, got {type(jmp_scale).__name__} without "
            f"{missing}; for a jmp.StaticLossScale use jdls.StaticScale(s.loss_scale), for a "
            "jmp.NoOpLossScale jdls.NoOpScale()"
        )
    return jmp(**{f: getattr(jmp_scale, f) for f in fields})


def keras(initial_scale: float = 2.0**15, dynamic_growth_steps: int = 2000) -> DynamicScale:
    """Keras 3 ``keras.optimizers.LossScaleOptimizer``.

    Doubles on the ``dynamic_growth_steps``-th finite step in a row and halves on a non-finite
    step, with no clamp at all: like Keras, the scale can reach inf after very long finite
    runs, or 0 after very long overflow runs.

    Args:
      initial_scale: initial scale.
      dynamic_growth_steps: finite steps in a row before a growth, >= 1.

    Returns:
      The scale.

    Example:
      >>> import jdls
      >>> float(jdls.presets.keras(initial_scale=4.0).adjust(False).loss_scale)
      2.0
    """
    with spelled("keras", loss_scale="initial_scale", growth_interval="dynamic_growth_steps"):
        rule = GrowBackoff(
            growth_factor=2.0,
            backoff_factor=None,
            growth_interval=check_int("dynamic_growth_steps", dynamic_growth_steps, 1),
            min_loss_scale=None,
            max_loss_scale=None,
            keep_scale_if_growth_overflows=False,
        )
        return DynamicScale(check_positive_finite("initial_scale", initial_scale), rule)


def deepspeed(
    init_scale: float = 2.0**32,
    scale_factor: float = 2.0,
    scale_window: int = 1000,
    min_scale: float = 1.0,
    delayed_shift: int = 2,
    consecutive_hysteresis: bool = False,
    raise_error_at_min_scale: bool = True,
) -> DynamicScale:
    """DeepSpeed's ``DynamicLossScaler``, the scaler of its ZeRO optimizers (stages 1-3).

    DeepSpeed's fp16 optimizers without ZeRO (``FP16_Optimizer``, fused and unfused) update
    the scale with their own, simpler rule: :func:`deepspeed_fp16`.

    On a non-finite step, hysteresis (``delayed_shift``, the config's ``hysteresis``) forgives
    up to ``delayed_shift - 1`` overflows before dividing by ``scale_factor`` (not below
    ``min_scale``); the step is skipped either way. The scale grows after ``scale_window + 1``
    finite steps since the last overflow, then every ``scale_window`` steps, refilling the
    hysteresis (on every finite step with ``consecutive_hysteresis``). No maximum.

    DeepSpeed raises when an overflow needs a backoff while the scale is already at
    ``min_scale``. jdls counts this in ``min_scale_overflows``; call
    :meth:`jdls.DynamicScale.check` on the host to raise :class:`jdls.MinimumScaleError`.

    Args:
      init_scale: initial scale (``2**initial_scale_power`` in the config).
      scale_factor: growth factor and backoff divisor, > 1.
      scale_window: the config's ``loss_scale_window``, >= 1.
      min_scale: the config's ``min_loss_scale``.
      delayed_shift: the config's ``hysteresis``, >= 1.
      consecutive_hysteresis: the config's ``consecutive_hysteresis``.
      raise_error_at_min_scale: whether :meth:`~jdls.DynamicScale.check` raises.

    Returns:
      The scale.

    Example:
      >>> import jdls
      >>> s = jdls.presets.deepspeed(init_scale=1024.0, delayed_shift=2)
      >>> float(s.adjust(False).loss_scale), float(s.adjust(False).adjust(False).loss_scale)
      (1024.0, 512.0)
    """
    return _deepspeed(
        "deepspeed",
        init_scale,
        scale_factor,
        scale_window,
        min_scale,
        delayed_shift,
        consecutive_hysteresis,
        raise_error_at_min_scale,
    )


def _deepspeed(
    preset: str,
    init_scale: float,
    scale_factor: float,
    scale_window: int,
    min_scale: float,
    delayed_shift: int,
    consecutive_hysteresis: bool,
    raise_error_at_min_scale: bool,
) -> DynamicScale:
    names = {
        "loss_scale": "init_scale",
        "growth_factor": "scale_factor",
        "min_loss_scale": "min_scale",
        "hysteresis": "delayed_shift",
        "error_at_min_scale": "raise_error_at_min_scale",
    }
    with spelled(preset, **names):
        window = check_interval_plus_one("scale_window", scale_window)
        rule = GrowBackoff(
            growth_factor=scale_factor,
            backoff_factor=None,
            growth_interval=window + 1,
            counter_after_growth=1,
            min_loss_scale=min_scale,
            max_loss_scale=None,
            keep_scale_if_growth_overflows=False,
            hysteresis=check_int("delayed_shift", delayed_shift, 1),
            refill_hysteresis_on_finite=bool(consecutive_hysteresis),
            error_at_min_scale=bool(raise_error_at_min_scale),
        )
        return DynamicScale(init_scale, rule)


def deepspeed_fp16(
    init_scale: float = 2.0**32,
    scale_window: int = 1000,
    min_scale: float = 1.0,
) -> DynamicScale:
    """DeepSpeed's fp16 optimizers without ZeRO (``FP16_Optimizer``, fused and unfused).

    Their ``_update_scale`` divides the scale by 2 on every non-finite step (not below
    ``min_scale``), and doubles it after ``scale_window + 1`` finite steps since the last
    overflow, then every ``scale_window``. They read only these three settings: the config's
    ``hysteresis`` and ``consecutive_hysteresis`` are ignored, and they never raise at the
    minimum. The ZeRO path (hysteresis, the error at the minimum) is :func:`deepspeed`.

    Args:
      init_scale: initial scale (``2**initial_scale_power`` in the config).
      scale_window: the config's ``loss_scale_window``, >= 1.
      min_scale: the config's ``min_loss_scale``.

    Returns:
      The scale: :func:`deepspeed` with ``delayed_shift=1`` and no error at the minimum.

    Example:
      >>> import jdls
      >>> s = jdls.presets.deepspeed_fp16(init_scale=1024.0)
      >>> float(s.adjust(False).loss_scale)   # no hysteresis: the first overflow halves it
      512.0
    """
    return _deepspeed("deepspeed_fp16", init_scale, 2.0, scale_window, min_scale, 1, False, False)


def megatron(
    initial_scale: float = 2.0**32,
    min_scale: float = 1.0,
    growth_factor: float = 2.0,
    backoff_factor: float = 0.5,
    growth_interval: int = 1000,
    hysteresis: int = 2,
) -> DynamicScale:
    """Megatron-LM's ``DynamicGradScaler``.

    A non-finite step uses one unit of hysteresis; once it is used up, every non-finite step
    multiplies the scale by ``backoff_factor`` (not below ``min_scale``). Growth, on the
    ``growth_interval``-th finite step in a row, refills the hysteresis; a backoff does not.
    No maximum.

    Args:
      initial_scale: initial scale.
      min_scale: lower bound on backoff.
      growth_factor: multiplier on growth, > 1.
      backoff_factor: multiplier on backoff, in (0, 1).
      growth_interval: finite steps in a row before a growth, >= 1.
      hysteresis: non-finite steps needed before the first backoff, >= 1.

    Returns:
      The scale.

    Example:
      >>> import jdls
      >>> s = jdls.presets.megatron(initial_scale=64.0, hysteresis=1)
      >>> float(s.adjust(False).loss_scale)
      32.0
    """
    with spelled("megatron", loss_scale="initial_scale", min_loss_scale="min_scale"):
        rule = GrowBackoff(
            growth_factor=growth_factor,
            backoff_factor=backoff_factor,
            growth_interval=growth_interval,
            min_loss_scale=min_scale,
            max_loss_scale=None,
            keep_scale_if_growth_overflows=False,
            hysteresis=hysteresis,
        )
        return DynamicScale(initial_scale, rule)
