"""State-dict interop: a run migrated from PyTorch or Cerebras keeps its scale and counters."""

from __future__ import annotations

import numpy as np
import pytest
import reference_rules as ref
from _helpers import torch_gradscaler

import jdls

FLAGS_BEFORE = [True, True, False, True, True, True, False, True, True]
FLAGS_AFTER = [True, True, True, False, True, True, True, True, False, True]


@pytest.mark.full
def test_pytorch_state_dict_round_trip_with_real_gradscaler():
    torch = pytest.importorskip("torch")
    kwargs = dict(init_scale=1024.0, growth_factor=2.0, backoff_factor=0.5, growth_interval=3)
    scaler, torch_step = torch_gradscaler(**kwargs)  # a real GradScaler, real gradients
    for f in FLAGS_BEFORE:
        torch_step(f)
    state = scaler.state_dict()
    ours = jdls.presets.from_pytorch_state_dict(state)
    assert (
        float(ours.loss_scale) == state["scale"]
        and int(ours.state.counter) == state["_growth_tracker"]
    )
    assert jdls.presets.to_pytorch_state_dict(ours) == state
    # Both continue with the same steps: same scale and tracker after each.
    for f in FLAGS_AFTER:
        torch_step(f)
        ours = ours.adjust(f)
        assert float(ours.loss_scale) == scaler.get_scale()
        assert int(ours.state.counter) == scaler.state_dict()["_growth_tracker"]
    # And back: torch loads jdls's state dict and continues identically.
    fresh = torch.amp.GradScaler("cpu", **kwargs)
    fresh.load_state_dict(jdls.presets.to_pytorch_state_dict(ours))
    assert fresh.state_dict() == scaler.state_dict()


def test_pytorch_disabled_scaler_maps_to_noop():
    assert isinstance(jdls.presets.from_pytorch_state_dict({}), jdls.NoOpScale)
    assert jdls.presets.to_pytorch_state_dict(jdls.NoOpScale()) == {}


def test_pytorch_state_dict_errors():
    with pytest.raises(ValueError, match=r"missing keys \['_growth_tracker'\]"):
        jdls.presets.from_pytorch_state_dict(
            {"scale": 1.0, "growth_factor": 2.0, "backoff_factor": 0.5, "growth_interval": 3}
        )
    with pytest.raises(TypeError, match="state_dict must be a dict"):
        jdls.presets.from_pytorch_state_dict([("scale", 1.0)])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"made by jdls.presets.pytorch"):
        jdls.presets.to_pytorch_state_dict(jdls.presets.flax())


def test_cerebras_state_dict_round_trip_and_continuation():
    kwargs = dict(steps_per_increase=4, overflow_tolerance=0.25, max_loss_scale=2.0**20)
    reference = ref.Cerebras(init_scale=2.0**12, **kwargs)
    for f in FLAGS_BEFORE:
        reference.step(f)
    state = {
        "loss_scale": float(reference.loss_scale),
        "steps_since_rescale": reference.steps_since_rescale,
        "overflows_since_rescale": reference.overflows_since_rescale,
        "num_skipped_steps": reference.num_skipped_steps,
    }
    ours = jdls.presets.from_cerebras_state_dict(state, **kwargs)
    # The skip count is not part of the scale (jdls.wrap counts it): a scale adjusted by hand
    # has its skips counted here.
    skipped = state["num_skipped_steps"]
    assert jdls.presets.to_cerebras_state_dict(ours, skipped) == state
    for f in FLAGS_AFTER:
        value = reference.step(f)
        ours = ours.adjust(f)
        skipped += int(not f)
        assert np.float32(ours.loss_scale) == value
    assert jdls.presets.to_cerebras_state_dict(ours, skipped) == {
        "loss_scale": float(reference.loss_scale),
        "steps_since_rescale": reference.steps_since_rescale,
        "overflows_since_rescale": reference.overflows_since_rescale,
        "num_skipped_steps": reference.num_skipped_steps,
    }


def test_cerebras_state_dict_errors():
    with pytest.raises(ValueError, match="missing keys"):
        jdls.presets.from_cerebras_state_dict({"loss_scale": 2.0})
    with pytest.raises(ValueError, match="loss_scale must be a finite number > 0"):
        jdls.presets.from_cerebras_state_dict(
            {
                "loss_scale": float("inf"),
                "steps_since_rescale": 0,
                "overflows_since_rescale": 0,
                "num_skipped_steps": 0,
            }
        )
    with pytest.raises(ValueError, match="made by jdls.presets.cerebras"):
        jdls.presets.to_cerebras_state_dict(jdls.DynamicScale())
