"""Smoke test of ``python -m benchmarks quality`` (benchmarks/bench_quality.py): a few steps of
some tasks with a few rules, two seeds at once, and the settling measure; the full suite takes
minutes, so it is not in the registry-driven smoke test of
tests/integration/test_benchmarks_smoke.py."""

from __future__ import annotations

import dataclasses
import math
import sys

import numpy as np
import pytest
from _helpers import ROOT

pytest.importorskip("sklearn", reason="the tasks train on scikit-learn's digits")
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import jdls
from benchmarks import bench_quality as q


def short(name: str, steps: int = 6) -> q.Task:
    return dataclasses.replace(next(t for t in q.TASKS if t.name == name), steps=steps)


def test_the_tasks_are_named_and_explained():
    names = [t.name for t in q.TASKS]
    assert len(names) == len(set(names)) == 18
    assert all(
        t.why and t.metric in ("test accuracy", "parity accuracy", "train loss") for t in q.TASKS
    )
    assert sum(t.kind == "no regression" for t in q.TASKS) == 3
    assert list(q.rules()) == [
        "PyTorch", "Flax", "jmp", "Keras", "DeepSpeed", "Cerebras", "jdls classic",
        "AdaptiveScale", "no scaling", "float32",
    ]  # fmt: skip


@pytest.mark.parametrize("name", ["tiny weight", "cnn"])
@pytest.mark.full
def test_a_run_reports_every_metric(name):
    task = short(name)
    r = q.train(task, q.rules()["AdaptiveScale"], seeds=2)
    assert 0 <= r["metric"] <= 1 and len(r["metric_per_seed"]) == 2
    assert 0 <= r["skipped"] <= task.steps
    assert 0 <= r["flushed_pct"] <= 100
    assert len(r["scale_trace"]) == task.steps
    assert r["scale_trace"][0] == 0.0 and r["scale_trace"][1] > 10  # measured, then jumped
    f32 = q.train(task, q.rules()["float32"], "float32", seeds=2)
    assert f32["flushed_pct"] == 0 and f32["scale_trace"] == [0.0] * task.steps


@pytest.mark.full
def test_a_restart_starts_every_rule_at_the_checkpointed_scale():
    task = short("restart low", 2)
    r = q.train(task, q.rules()["PyTorch"], seeds=1)
    assert r["scale_trace"][0] == -12.0


@pytest.mark.full
def test_a_spike_is_skipped_and_a_burst_skips_every_bad_step():
    spikes = dataclasses.replace(short("spikes", 30))
    r = q.train(spikes, q.rules()["AdaptiveScale"], seeds=1)
    assert r["skipped_trace"][q.SPIKE_EVERY // 2] == 1  # the spike at step 25, skipped
    assert r["skipped"] == 1


def test_settle_step():
    assert q.settle_step(2.0 ** np.array([0, 30, 31, 30, 31, 31])) == 1
    assert q.settle_step(2.0 ** np.array([16, 15, 14, 15, 20, 14, 14])) == 5
    assert q.settle_step(np.ones(3)) == 0


def test_registered():
    from benchmarks._registry import SUITES

    assert SUITES["quality"].load() is q.suite
    assert math.isfinite(q.SPIKE_FACTOR)
    assert isinstance(q.rules()["jdls classic"]("float16"), jdls.DynamicScale)


@pytest.mark.full
def test_the_default_scale_reaches_float32_on_the_tiny_weight_task():
    """``jdls.wrap(optax.adam(...))`` with no scale: within 0.02 of float32's test accuracy on
    the digits MLP whose loss is weighted 2**-32 (400 steps), where PyTorch's rule is not."""
    task = next(t for t in q.TASKS if t.name == "tiny weight")
    default = q.train(task, lambda fmt: None, seeds=1)  # jdls.wrap(tx, None): the default
    f32 = q.train(task, q.rules()["float32"], "float32", seeds=1)
    assert abs(default["metric"] - f32["metric"]) <= 0.02
    # one skipped step: the first, whose gradients all flush at the start's scale (1), is
    # skipped (jdls.SkipCause.UNDERFLOW) rather than taken with zeros
    assert default["skipped"] == 1 and f32["metric"] > 0.9
