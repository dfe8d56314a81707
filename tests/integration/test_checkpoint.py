"""Checkpoint and resume: a run restored in a fresh process continues bit for bit.

A Flax ``TrainState`` whose optimizer is ``jdls.wrap(adamw + schedule, scale)`` trains under
injected faults (``_mlp``); mid-run, with skipped steps behind it and counters part-way, it is
saved with orbax-checkpoint and with ``flax.serialization.to_bytes``. A **fresh Python process**
(``_checkpoint_worker.py``) builds the template state from scratch, restores into it, checks
that the scale kept its rule (static configuration, which comes from the target), and
continues. Its restored and final states must equal, byte for byte, the state at the save and
the state of the uninterrupted run.

Runs migrated from other libraries resume too: a real ``torch.amp.GradScaler`` state dict and
a Cerebras state dict, put into the optimizer state with ``jdls.set_scale``, continue
with the same scale and counters as the library itself, step by step.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import _checkpoint_worker as worker
import _mlp
import jax
import numpy as np
import pytest
import reference_rules as ref
from _helpers import ROOT, host_bytes, torch_gradscaler
from flax import serialization

import jdls

ocp = pytest.importorskip("orbax.checkpoint")

N_STEPS, START, SEED = 60, 33, 7
FORMATS = ("orbax", "flax")
WORKER_TIMEOUT_S = 240


def save(fmt: str, state, path: Path) -> None:
    if fmt == "orbax":
        with ocp.StandardCheckpointer() as checkpointer:
            checkpointer.save(path, state)
            checkpointer.wait_until_finished()
    else:
        path.write_bytes(serialization.to_bytes(state))


@pytest.fixture(scope="module")
def resumed(tmp_path_factory):
    """Save every (format, scale) here, restore and continue them all in one fresh process."""
    root = tmp_path_factory.mktemp("checkpoints")
    specs = worker.specs_for(N_STEPS, SEED)
    cases, expected = [], {}
    for name in worker.WRAPS:
        state0 = worker.make_state(name, N_STEPS, SEED)
        mid = worker.run(state0, specs, 0, START)
        full = worker.run(state0, specs, 0, N_STEPS)
        expected[name] = (mid, full)
        for fmt in FORMATS:
            path = root / f"{name}.{fmt}"
            save(fmt, mid, path)
            cases.append(
                dict(
                    format=fmt,
                    path=str(path),
                    scale=name,
                    n_steps=N_STEPS,
                    seed=SEED,
                    start=START,
                    out=str(root / f"{name}-{fmt}.npz"),
                )
            )
    cases_file = root / "cases.json"
    cases_file.write_text(json.dumps(cases))
    proc = subprocess.run(
        [sys.executable, worker.__file__, str(cases_file)],
        capture_output=True,
        text=True,
        timeout=WORKER_TIMEOUT_S,
        cwd=ROOT,
        env=dict(os.environ),
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    results = {(c["format"], c["scale"]): dict(np.load(c["out"])) for c in cases}
    return results, expected


def _leaves_bytes(npz, prefix):
    keys = sorted((k for k in npz if k.startswith(prefix)), key=lambda k: int(k.split("leaf")[1]))
    return [npz[k].tobytes() for k in keys]


@pytest.mark.parametrize("name", list(worker.WRAPS))
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.full
def test_resume_in_fresh_process_is_bit_identical(resumed, fmt, name):
    results, expected = resumed
    mid, full = expected[name]
    out = results[(fmt, name)]
    # The checkpoint was taken mid-run, with skipped steps and counters part-way.
    stats, scale = jdls.stats(mid), jdls.get_scale(mid)
    assert int(stats.skipped_steps) > 0
    assert int(scale.state.counter) > 0 or int(stats.consecutive_skips) > 0
    # What the fresh process restored is what was saved, rule included ...
    assert str(out["rule"]) == repr(scale.rule)
    assert _leaves_bytes(out, "restored_") == host_bytes(mid)
    # ... and where it ended is where the uninterrupted run ended.
    assert _leaves_bytes(out, "final_") == host_bytes(full)


@pytest.mark.full
def test_checkpoint_caught_interesting_states(resumed):
    """The save point is not trivial for the scales with extra counters."""
    _, expected = resumed
    deepspeed = jdls.get_scale(expected["deepspeed"][0])
    cerebras = jdls.get_scale(expected["cerebras"][0])
    assert int(deepspeed.state.hysteresis) == 1  # one overflow forgiven, not yet refilled
    assert int(cerebras.state.overflows) > 0  # overflows since the last change, below the tolerance


# --------------------------------------------------------------------------------------------
# What a restore needs: a target. The rule is configuration and is not in the checkpoint.
# --------------------------------------------------------------------------------------------


def test_orbax_restore_without_target_gives_plain_arrays(tmp_path):
    state = worker.make_state("deepspeed", N_STEPS, SEED)
    save("orbax", state, tmp_path / "ckpt")
    with ocp.StandardCheckpointer() as checkpointer:
        raw = checkpointer.restore(tmp_path / "ckpt")
    assert isinstance(raw, dict)
    # The scale's data: its value and its rule's counters (the skip count is a statistic of
    # the wrap, saved with its stats).
    assert sorted(raw["opt_state"]["scale"]) == ["loss_scale", "state"]
    assert sorted(raw["opt_state"]["scale"]["state"]) == [
        "counter",
        "hysteresis",
        "min_scale_overflows",
    ]
    assert "skipped_steps" in raw["opt_state"]["stats"]
    assert not any(
        isinstance(x, jdls.LossScale)
        for x in jax.tree.leaves(raw, is_leaf=lambda x: isinstance(x, jdls.LossScale))
    )


def test_restore_takes_the_rule_of_the_target(tmp_path):
    """Documented limitation: restoring into a target built with another rule keeps the values
    and takes the target's rule; build the target with the same scale as the run."""
    saved = worker.make_state("deepspeed", N_STEPS, SEED)
    save("orbax", saved, tmp_path / "ckpt")
    other = worker.make_state("default", N_STEPS, SEED)
    abstract = jax.eval_shape(lambda: other)
    with ocp.StandardCheckpointer() as checkpointer:
        restored = checkpointer.restore(tmp_path / "ckpt", abstract)
    scale = jdls.get_scale(restored)
    assert scale.rule == jdls.get_scale(other).rule
    assert float(scale.loss_scale) == 2.0**16  # the saved deepspeed value
    assert int(scale.state.hysteresis) == 2


def test_flax_from_bytes_rejects_another_kind_of_scale():
    params = _mlp.init_params(0)
    dynamic = jdls.wrap(_mlp.adamw_cosine(10), jdls.DynamicScale()).init(params)
    static = jdls.wrap(_mlp.adamw_cosine(10), jdls.StaticScale(8.0)).init(params)
    noop = jdls.wrap(_mlp.adamw_cosine(10), jdls.NoOpScale()).init(params)
    data = serialization.to_bytes(dynamic)
    with pytest.raises(ValueError, match=r"cannot restore a StaticScale from the saved fields"):
        serialization.from_bytes(static, data)
    with pytest.raises(ValueError, match=r"cannot restore a NoOpScale"):
        serialization.from_bytes(noop, data)
    with pytest.raises(ValueError, match=r"cannot restore a DynamicScale.*same kind of scale"):
        serialization.from_bytes(dynamic, serialization.to_bytes(static))
    # Each kind round-trips into its own kind.
    for state in (dynamic, static, noop):
        back = serialization.from_bytes(state, serialization.to_bytes(state))
        assert type(back.scale) is type(state.scale)
        assert host_bytes(back) == host_bytes(state)


# --------------------------------------------------------------------------------------------
# Runs migrated from PyTorch and Cerebras.
# --------------------------------------------------------------------------------------------


def _finite_flags(n: int, seed: int) -> np.ndarray:
    return worker.specs_for(n, seed)[:, 1] == 0


def _continue_one_step_at_a_time(state, specs):
    for t in range(len(specs)):
        state = worker.run(state, specs, t, t + 1)
        yield state


@pytest.mark.full
def test_pytorch_gradscaler_state_dict_resumes():
    kwargs = dict(init_scale=2.0**10, growth_factor=2.0, backoff_factor=0.5, growth_interval=4)
    scaler, torch_step = torch_gradscaler(**kwargs)
    for f in [*_finite_flags(30, seed=1), False, True, True]:  # the PyTorch part of the run
        torch_step(bool(f))
    sd = scaler.state_dict()
    assert sd["_growth_tracker"] == 2 and sd["scale"] != kwargs["init_scale"]

    state = worker.make_state("default", 40, SEED)
    state = state.replace(
        opt_state=jdls.set_scale(state.opt_state, jdls.presets.from_pytorch_state_dict(sd))
    )
    scale = jdls.get_scale(state)
    assert (
        float(scale.loss_scale) == sd["scale"] and int(scale.state.counter) == sd["_growth_tracker"]
    )
    specs = worker.specs_for(40, SEED)
    for t, resumed_state in enumerate(_continue_one_step_at_a_time(state, specs)):
        torch_step(bool(specs[t, 1] == 0))
        scale = jdls.get_scale(resumed_state)
        assert float(scale.loss_scale) == scaler.get_scale(), t
        assert int(scale.state.counter) == scaler.state_dict()["_growth_tracker"], t
    assert jdls.presets.to_pytorch_state_dict(scale) == scaler.state_dict()


def test_cerebras_state_dict_resumes():
    sd = {
        "loss_scale": 2.0**12,
        "steps_since_rescale": 6,
        "overflows_since_rescale": 1,
        "num_skipped_steps": 9,
    }
    kwargs = dict(steps_per_increase=10, overflow_tolerance=0.25)
    reference = ref.Cerebras(init_scale=sd["loss_scale"], **kwargs)
    reference.steps_since_rescale = sd["steps_since_rescale"]
    reference.overflows_since_rescale = sd["overflows_since_rescale"]
    reference.num_skipped_steps = sd["num_skipped_steps"]

    state = worker.make_state("cerebras", 40, SEED)
    scale = jdls.presets.from_cerebras_state_dict(sd, **kwargs)
    state = state.replace(opt_state=jdls.set_scale(state.opt_state, scale))

    # The skip count is a statistic of the wrap (counted from this run's start), not part of
    # the scale: the state dict's num_skipped_steps is the migrated count plus this run's.
    def state_dict(opt_state):
        skipped = sd["num_skipped_steps"] + int(jdls.stats(opt_state).skipped_steps)
        return jdls.presets.to_cerebras_state_dict(jdls.get_scale(opt_state), skipped)

    assert state_dict(state.opt_state) == sd
    specs = worker.specs_for(40, SEED)
    for t, resumed_state in enumerate(_continue_one_step_at_a_time(state, specs)):
        expected = reference.step(bool(specs[t, 1] == 0))
        assert state_dict(resumed_state.opt_state) == {
            "loss_scale": float(expected),
            "steps_since_rescale": reference.steps_since_rescale,
            "overflows_since_rescale": reference.overflows_since_rescale,
            "num_skipped_steps": reference.num_skipped_steps,
        }, t
