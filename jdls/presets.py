"""Exact loss-scale rules of PyTorch, Flax, jmp, Keras, DeepSpeed, Megatron-LM and Cerebras.

Each preset takes the keyword arguments of the library it mirrors, under the same names and
with the same defaults, and returns a :class:`jdls.DynamicScale` (or a static / no-op scale
where that library would not scale dynamically) whose ``adjust`` reproduces that library's
loss-scale trajectory step by step. A preset is only data: a :class:`jdls.ScaleRule` fed to
the one general state machine of :class:`jdls.DynamicScale`.

Example:
  >>> import jdls
  >>> scale = jdls.presets.pytorch(init_scale=2.0**16, growth_interval=2000)
  >>> float(scale.adjust(False).loss_scale)
  32768.0
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from jdls._scale import (
    DynamicScale,
    NoOpScale,
    ScaleRule,
    StaticScale,
    _check_int,
    _check_positive_finite,
)

__all__ = [
    "cerebras",
    "deepspeed",
    "flax",
    "from_cerebras_state_dict",
    "from_pytorch_state_dict",
    "jmp",
    "keras",
    "megatron",
    "pytorch",
    "to_cerebras_state_dict",
    "to_pytorch_state_dict",
]

_F32_TINY = float(np.finfo(np.float32).tiny)
_F32_MAX = float(np.finfo(np.float32).max)
CEREBRAS_MIN_LOSS_SCALE = 2.0**-14
_CEREBRAS_MAX_LOSS_SCALE = {"float16": 2.0**15, "bfloat16": 2.0**15, "cbfloat16": 2.0**31}


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
    rule = ScaleRule(
        growth_factor=growth_factor,
        backoff_factor=backoff_factor,
        growth_interval=growth_interval,
        min_loss_scale=None,
        max_loss_scale=None,
        keep_scale_if_growth_overflows=True,
        name="pytorch",
    )
    return DynamicScale.from_rule(rule, _check_positive_finite("init_scale", init_scale))


def flax(
    growth_factor: float = 2.0,
    backoff_factor: float = 0.5,
    growth_interval: int = 2000,
    fin_steps: int = 0,
    scale: float = 65536.0,
    minimum_scale: float | None = _F32_TINY,
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
    interval = _check_int("growth_interval", growth_interval, 1)
    if _check_int("fin_steps", fin_steps, 0) > interval:
        raise ValueError(
            f"fin_steps must be in [0, growth_interval] = [0, {interval}], got {fin_steps}"
        )
    rule = ScaleRule(
        growth_factor=growth_factor,
        backoff_factor=backoff_factor,
        growth_interval=interval + 1,
        min_loss_scale=minimum_scale,
        max_loss_scale=_F32_MAX,
        name="flax",
    )
    return DynamicScale.from_rule(rule, scale, counter=_check_int("fin_steps", fin_steps, 0))


def jmp(
    loss_scale: float,
    counter: int = 0,
    period: int = 2000,
    factor: float = 2,
    min_loss_scale: float = 1.0,
) -> DynamicScale:
    """``jmp.DynamicLossScale``.

    Grows by ``factor`` on the ``period``-th finite step in a row (a growth to inf is dropped),
    divides by ``factor`` on a non-finite step, never below ``min_loss_scale``. Unlike jmp, the
    minimum survives a pytree round trip.

    Args:
      loss_scale: initial scale (required, as in jmp; its documentation uses ``2**15``).
      counter: initial count of finite steps, in ``[0, period)``.
      period: finite steps in a row before a growth, >= 1.
      factor: growth factor and backoff divisor, > 1.
      min_loss_scale: lower bound on backoff.

    Returns:
      The scale.

    Example:
      >>> import jdls
      >>> s = jdls.presets.jmp(loss_scale=2.0**15, period=1)
      >>> float(s.adjust(True).loss_scale)
      65536.0
    """
    if _check_int("counter", counter, 0) >= _check_int("period", period, 1):
        raise ValueError(f"counter must be in [0, period) = [0, {period}), got {counter}")
    rule = ScaleRule(
        growth_factor=factor,
        backoff_factor=None,
        growth_interval=period,
        min_loss_scale=min_loss_scale,
        max_loss_scale=None,
        keep_scale_if_growth_overflows=True,
        name="jmp",
    )
    return DynamicScale.from_rule(rule, loss_scale, counter=counter)


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
    rule = ScaleRule(
        growth_factor=2.0,
        backoff_factor=None,
        growth_interval=_check_int("dynamic_growth_steps", dynamic_growth_steps, 1),
        min_loss_scale=None,
        max_loss_scale=None,
        name="keras",
    )
    return DynamicScale.from_rule(rule, _check_positive_finite("initial_scale", initial_scale))


def deepspeed(
    init_scale: float = 2.0**32,
    scale_factor: float = 2.0,
    scale_window: int = 1000,
    min_scale: float = 1.0,
    delayed_shift: int = 2,
    consecutive_hysteresis: bool = False,
    raise_error_at_min_scale: bool = True,
) -> DynamicScale:
    """DeepSpeed's ``DynamicLossScaler`` as its fp16 engine configures it.

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
    window = _check_int("scale_window", scale_window, 1)
    rule = ScaleRule(
        growth_factor=scale_factor,
        backoff_factor=None,
        growth_interval=window + 1,
        counter_after_growth=1,
        min_loss_scale=min_scale,
        max_loss_scale=None,
        hysteresis=_check_int("delayed_shift", delayed_shift, 1),
        refill_hysteresis_on_finite=bool(consecutive_hysteresis),
        error_at_min_scale=bool(raise_error_at_min_scale),
        name="deepspeed",
    )
    return DynamicScale.from_rule(rule, init_scale)


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
    rule = ScaleRule(
        growth_factor=growth_factor,
        backoff_factor=backoff_factor,
        growth_interval=growth_interval,
        min_loss_scale=min_scale,
        max_loss_scale=None,
        hysteresis=hysteresis,
        name="megatron",
    )
    return DynamicScale.from_rule(rule, initial_scale)


def cerebras(
    loss_scale: str | float | None = "dynamic",
    init_scale: float | None = None,
    steps_per_increase: int | None = 2000,
    min_loss_scale: float | None = CEREBRAS_MIN_LOSS_SCALE,
    max_loss_scale: float | None = None,
    overflow_tolerance: float = 0.0,
    max_gradient_norm: float | None = None,
    half_dtype: str = "float16",
) -> DynamicScale | StaticScale | NoOpScale:
    """Cerebras' ``cerebras.pytorch.amp.GradScaler``.

    With ``loss_scale="dynamic"``: every step counts towards ``steps_since_rescale``; the
    scale halves when the fraction of non-finite steps since the last change exceeds
    ``overflow_tolerance`` (compared in float32), doubles after ``steps_per_increase + 1``
    steps without a change, and is clamped to ``[min_loss_scale, max_loss_scale]`` after
    every step (the initial scale is clamped to the maximum). As in Cerebras, ``jdls.wrap``
    calls a step non-finite when the float32 global norm of the gradients is not finite,
    even if every element is (their sum of squares overflows). A number gives a
    :class:`jdls.StaticScale`; None gives a :class:`jdls.NoOpScale`.

    ``half_dtype`` stands for ``cstorch.amp.set_half_dtype``: the default maximum (and initial)
    scale is ``2**15`` for float16 and bfloat16 and ``2**31`` for cbfloat16.

    Args:
      loss_scale: ``"dynamic"``, a static scale (a number > 0), or None for no scaling.
      init_scale: initial scale (default: the maximum).
      steps_per_increase: steps without a change before a growth, >= 1 (None: 2000).
      min_loss_scale: lower clamp, >= ``2**-14`` (None: ``2**-14``).
      max_loss_scale: upper clamp (None: set by ``half_dtype``).
      overflow_tolerance: tolerated fraction of non-finite steps, >= 0.
      max_gradient_norm: global-norm clipping limit (DLS + GCC); ``jdls.wrap`` uses it when it
        is given no ``max_norm`` of its own.
      half_dtype: ``"float16"``, ``"bfloat16"`` or ``"cbfloat16"``.

    Returns:
      The scale.

    Example:
      >>> import jdls
      >>> float(jdls.presets.cerebras(half_dtype="cbfloat16").loss_scale) == 2.0**31
      True
      >>> type(jdls.presets.cerebras(loss_scale=128.0)).__name__
      'StaticScale'
    """
    if half_dtype not in _CEREBRAS_MAX_LOSS_SCALE:
        raise ValueError(
            f"half_dtype must be one of {sorted(_CEREBRAS_MAX_LOSS_SCALE)}, got {half_dtype!r}"
        )
    if loss_scale is None:
        return NoOpScale()
    if not (isinstance(loss_scale, str) and loss_scale == "dynamic"):
        if isinstance(loss_scale, str):
            raise ValueError(
                f'loss_scale must be "dynamic", a number > 0 or None, got {loss_scale!r}'
            )
        if max_gradient_norm is not None:
            raise ValueError(
                "max_gradient_norm is applied by jdls.wrap: with a static loss_scale pass "
                f"jdls.wrap(inner, scale, max_norm={max_gradient_norm!r}) instead"
            )
        return StaticScale(loss_scale)
    if min_loss_scale is None:
        min_loss_scale = CEREBRAS_MIN_LOSS_SCALE
    min_value = _check_positive_finite("min_loss_scale", min_loss_scale)
    if min_value < CEREBRAS_MIN_LOSS_SCALE:
        raise ValueError(
            f"min_loss_scale must be >= 2**-14 ({CEREBRAS_MIN_LOSS_SCALE}) as in Cerebras, "
            f"got {min_loss_scale!r}"
        )
    if max_loss_scale is None:
        max_loss_scale = _CEREBRAS_MAX_LOSS_SCALE[half_dtype]
    if steps_per_increase is None:
        steps_per_increase = 2000
    spi = _check_int("steps_per_increase", steps_per_increase, 1)
    rule = ScaleRule(
        growth_factor=2.0,
        backoff_factor=0.5,
        growth_interval=spi + 1,
        min_loss_scale=min_value,
        max_loss_scale=max_loss_scale,
        clamp_every_step=True,
        overflow_tolerance=overflow_tolerance,
        max_gradient_norm=max_gradient_norm,
        finite_from_norm=True,
        name="cerebras",
    )
    start = max_loss_scale if init_scale is None else init_scale
    return DynamicScale.from_rule(rule, start)


# --------------------------------------------------------------------------------------------
# State-dict interop.
# --------------------------------------------------------------------------------------------

_TORCH_KEYS = ("scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker")
_CEREBRAS_KEYS = (
    "loss_scale",
    "steps_since_rescale",
    "overflows_since_rescale",
    "num_skipped_steps",
)


def _require_keys(state_dict: Mapping[str, Any], keys: tuple[str, ...], what: str) -> None:
    if not isinstance(state_dict, Mapping):
        raise TypeError(f"state_dict must be a dict, got {type(state_dict).__name__}")
    missing = [k for k in keys if k not in state_dict]
    if missing:
        raise ValueError(
            f"{what} state_dict is missing keys {missing}; expected keys {list(keys)}, "
            f"got {sorted(state_dict)}"
        )


def _item(x: Any) -> Any:
    return np.asarray(x).item()


def _require_rule(scale: Any, name: str) -> DynamicScale:
    if not isinstance(scale, DynamicScale) or scale.rule.name != name:
        got = scale.rule.name if isinstance(scale, DynamicScale) else type(scale).__name__
        raise ValueError(
            f"expected a DynamicScale made by jdls.presets.{name}(...), got {got!r}; "
            f"convert with jdls.presets.{name} first"
        )
    return scale


def from_pytorch_state_dict(state_dict: Mapping[str, Any]) -> DynamicScale | NoOpScale:
    """The :func:`pytorch` scale holding a ``torch.amp.GradScaler.state_dict()``.

    Args:
      state_dict: the dict ``GradScaler.state_dict()`` returns: ``scale``, ``growth_factor``,
        ``backoff_factor``, ``growth_interval`` and ``_growth_tracker``. An empty dict (what
        a disabled scaler returns) gives a :class:`jdls.NoOpScale`.

    Returns:
      A scale that continues exactly where the PyTorch run stopped.

    Example:
      >>> import jdls
      >>> sd = {"scale": 1024.0, "growth_factor": 2.0, "backoff_factor": 0.5,
      ...       "growth_interval": 2000, "_growth_tracker": 17}
      >>> s = jdls.presets.from_pytorch_state_dict(sd)
      >>> float(s.loss_scale), int(s.counter)
      (1024.0, 17)
    """
    if isinstance(state_dict, Mapping) and len(state_dict) == 0:
        return NoOpScale()
    _require_keys(state_dict, _TORCH_KEYS, "torch.amp.GradScaler")
    scale = pytorch(
        init_scale=_item(state_dict["scale"]),
        growth_factor=_item(state_dict["growth_factor"]),
        backoff_factor=_item(state_dict["backoff_factor"]),
        growth_interval=int(_item(state_dict["growth_interval"])),
    )
    assert isinstance(scale, DynamicScale)
    return DynamicScale.from_rule(
        scale.rule, _item(state_dict["scale"]), counter=int(_item(state_dict["_growth_tracker"]))
    )


def to_pytorch_state_dict(scale: DynamicScale | NoOpScale) -> dict[str, Any]:
    """The ``torch.amp.GradScaler.state_dict()`` of a :func:`pytorch` scale.

    Args:
      scale: a scale made by :func:`pytorch` (a :class:`jdls.NoOpScale` gives ``{}``, as a
        disabled ``GradScaler`` does).

    Returns:
      A dict that ``GradScaler.load_state_dict`` accepts.

    Example:
      >>> import jdls
      >>> jdls.presets.to_pytorch_state_dict(jdls.presets.pytorch(init_scale=8.0))["scale"]
      8.0
    """
    if isinstance(scale, NoOpScale):
        return {}
    scale = _require_rule(scale, "pytorch")
    rule = scale.rule
    return {
        "scale": float(_item(scale.loss_scale)),
        "growth_factor": float(rule.growth_factor),
        "backoff_factor": float(rule.backoff_factor or 0.5),
        "growth_interval": int(rule.growth_interval),
        "_growth_tracker": int(_item(scale.counter)),
    }


def from_cerebras_state_dict(state_dict: Mapping[str, Any], **kwargs: Any) -> DynamicScale:
    """The dynamic :func:`cerebras` scale holding a Cerebras ``GradScaler.state_dict()``.

    Args:
      state_dict: a dict with ``loss_scale``, ``steps_since_rescale``,
        ``overflows_since_rescale`` and ``num_skipped_steps``.
      **kwargs: the :func:`cerebras` arguments of the run (``steps_per_increase``,
        ``min_loss_scale``, ``max_loss_scale``, ``overflow_tolerance``, ``half_dtype``...),
        which Cerebras does not store in its state dict.

    Returns:
      A scale that continues exactly where the Cerebras run stopped.

    Example:
      >>> import jdls
      >>> sd = {"loss_scale": 4096.0, "steps_since_rescale": 10,
      ...       "overflows_since_rescale": 0, "num_skipped_steps": 3}
      >>> s = jdls.presets.from_cerebras_state_dict(sd)
      >>> float(s.loss_scale), int(s.counter), int(s.skipped)
      (4096.0, 10, 3)
    """
    _require_keys(state_dict, _CEREBRAS_KEYS, "Cerebras GradScaler")
    if kwargs.get("loss_scale", "dynamic") != "dynamic":
        raise ValueError("from_cerebras_state_dict restores a dynamic scale: drop loss_scale")
    kwargs.pop("init_scale", None)
    template = cerebras(**kwargs)
    assert isinstance(template, DynamicScale)
    rule = template.rule
    value = _check_positive_finite("loss_scale", _item(state_dict["loss_scale"]))
    return DynamicScale.from_rule(
        rule,
        value,
        counter=int(_item(state_dict["steps_since_rescale"])),
        overflows=int(_item(state_dict["overflows_since_rescale"])),
        skipped=int(_item(state_dict["num_skipped_steps"])),
    )


def to_cerebras_state_dict(scale: DynamicScale) -> dict[str, Any]:
    """The Cerebras ``GradScaler.state_dict()`` of a dynamic :func:`cerebras` scale.

    Args:
      scale: a scale made by :func:`cerebras` with ``loss_scale="dynamic"``.

    Returns:
      A dict with ``loss_scale``, ``steps_since_rescale``, ``overflows_since_rescale`` and
      ``num_skipped_steps``.

    Example:
      >>> import jdls
      >>> jdls.presets.to_cerebras_state_dict(jdls.presets.cerebras())["loss_scale"]
      32768.0
    """
    scale = _require_rule(scale, "cerebras")
    return {
        "loss_scale": float(_item(scale.loss_scale)),
        "steps_since_rescale": int(_item(scale.counter)),
        "overflows_since_rescale": int(_item(scale.overflows)),
        "num_skipped_steps": int(_item(scale.skipped)),
    }
