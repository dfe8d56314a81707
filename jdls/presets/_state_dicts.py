"""Conversion of PyTorch and Cerebras ``GradScaler`` state dicts to and from jdls scales."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from jdls._numerics.checks import check_int, check_positive_finite
from jdls._scales.scale import DynamicScale, NoOpScale
from jdls.presets._cerebras import cerebras
from jdls.presets._libraries import pytorch
from jdls.rules import GrowBackoff, OverflowTolerance

__all__ = [
    "from_cerebras_state_dict",
    "from_pytorch_state_dict",
    "to_cerebras_state_dict",
    "to_pytorch_state_dict",
]

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


def _describe(scale: Any) -> str:
    rule = getattr(scale, "rule", None)
    return type(scale).__name__ + (f" with rule {type(rule).__name__}" if rule is not None else "")


def _pytorch_rule(scale: Any) -> GrowBackoff:
    """The rule of ``scale`` if :func:`pytorch` could have made it, else a ValueError."""
    rule = getattr(scale, "rule", None)
    if isinstance(rule, GrowBackoff) and rule.backoff_factor is not None:
        twin = pytorch(1.0, rule.growth_factor, rule.backoff_factor, rule.growth_interval)
        if twin.rule == rule:  # type: ignore[union-attr]
            return rule
    raise ValueError(
        f"expected a scale made by jdls.presets.pytorch(...), got {_describe(scale)}; a GradScaler "
        "state dict holds only PyTorch's rule: convert with jdls.presets.pytorch first"
    )


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
      >>> float(s.loss_scale), int(s.state.counter)
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
    counter = int(_item(state_dict["_growth_tracker"]))
    return scale.replace(state=scale.rule.initial_state(counter=counter))


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
    rule = _pytorch_rule(scale)
    return {
        "scale": float(_item(scale.loss_scale)),
        "growth_factor": float(rule.growth_factor),
        "backoff_factor": float(rule.backoff_factor),  # type: ignore[arg-type]
        "growth_interval": int(rule.growth_interval),
        "_growth_tracker": int(_item(scale.state.counter)),
    }


def from_cerebras_state_dict(state_dict: Mapping[str, Any], **kwargs: Any) -> DynamicScale:
    """The dynamic :func:`cerebras` scale holding a Cerebras ``GradScaler.state_dict()``.

    ``num_skipped_steps`` is a statistic in jdls (``jdls.stats(state).skipped_steps``), not
    part of the scale: it is checked and left out.

    Args:
      state_dict: a dict with ``loss_scale``, ``steps_since_rescale``,
        ``overflows_since_rescale`` and ``num_skipped_steps``.
      **kwargs: the :func:`cerebras` arguments of the run (``steps_per_increase``,
        ``min_loss_scale``, ``max_loss_scale``, ``overflow_tolerance``, ``half_dtype``), which
        Cerebras does not store in its state dict.

    Returns:
      A scale that continues exactly where the Cerebras run stopped.

    Example:
      >>> import jdls
      >>> sd = {"loss_scale": 4096.0, "steps_since_rescale": 10,
      ...       "overflows_since_rescale": 0, "num_skipped_steps": 3}
      >>> s = jdls.presets.from_cerebras_state_dict(sd)
      >>> float(s.loss_scale), int(s.state.counter)
      (4096.0, 10)
    """
    _require_keys(state_dict, _CEREBRAS_KEYS, "Cerebras GradScaler")
    if kwargs.get("loss_scale", "dynamic") != "dynamic":
        raise ValueError("from_cerebras_state_dict restores a dynamic scale: drop loss_scale")
    kwargs.pop("init_scale", None)
    check_int("num_skipped_steps", int(_item(state_dict["num_skipped_steps"])), 0)
    template = cerebras(**kwargs)
    assert isinstance(template, DynamicScale)
    value = check_positive_finite("loss_scale", _item(state_dict["loss_scale"]))
    state = template.rule.initial_state(
        counter=int(_item(state_dict["steps_since_rescale"])),
        overflows=int(_item(state_dict["overflows_since_rescale"])),
    )
    return DynamicScale(value, template.rule, state=state)


def to_cerebras_state_dict(scale: DynamicScale, num_skipped_steps: Any = 0) -> dict[str, Any]:
    """The Cerebras ``GradScaler.state_dict()`` of a dynamic :func:`cerebras` scale.

    Args:
      scale: a scale made by :func:`cerebras` with ``loss_scale="dynamic"``.
      num_skipped_steps: the run's skipped steps, ``jdls.stats(opt_state).skipped_steps``.

    Returns:
      A dict with ``loss_scale``, ``steps_since_rescale``, ``overflows_since_rescale`` and
      ``num_skipped_steps``.

    Example:
      >>> import jdls
      >>> jdls.presets.to_cerebras_state_dict(jdls.presets.cerebras())["loss_scale"]
      32768.0
    """
    if not (isinstance(scale, DynamicScale) and isinstance(scale.rule, OverflowTolerance)):
        raise ValueError(
            f"expected a dynamic scale made by jdls.presets.cerebras(...), got {_describe(scale)}; "
            "convert with jdls.presets.cerebras first"
        )
    return {
        "loss_scale": float(_item(scale.loss_scale)),
        "steps_since_rescale": int(_item(scale.state.counter)),
        "overflows_since_rescale": int(_item(scale.state.overflows)),
        "num_skipped_steps": int(_item(num_skipped_steps)),
    }
