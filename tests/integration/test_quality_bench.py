"""Smoke test of ``python -m benchmarks quality`` (benchmarks/bench_quality.py): a few steps of
each task with two rules, and the settling measure; the full suite takes minutes, so it is not
in the registry-driven smoke test of tests/integration/test_benchmarks_smoke.py."""

from __future__ import annotations

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


@pytest.fixture(scope="module")
def small_tasks():
    tasks = q.tasks(quick=True)
    for task in tasks:
        task.steps = 6
        task.batches = {"idx": task.batches["idx"][:6]}
    return {t.name: t for t in tasks}


@pytest.mark.parametrize("name", ["mlp", "cnn"])
def test_a_run_reports_every_metric(small_tasks, name):
    task = small_tasks[name]
    r = q.train(task, jdls.AdaptiveScale, q.F16)
    assert 0 <= r["metric"] <= 1
    assert r["skipped"] >= r["skipped_1000"] >= 0
    assert 0 <= r["flushed"] <= 1
    assert len(r["scale_trace"]) == task.steps
    assert r["scale_trace"][0] == 1.0 and r["scale_trace"][1] > 2.0**10  # measured, jumped
    f32 = q.train(task, jdls.NoOpScale, q.F32)
    assert f32["flushed"] == 0 and f32["final_scale"] == 1.0


def test_settle_step():
    assert q.settle_step(2.0 ** np.array([0, 30, 31, 30, 31, 31])) == 1
    assert q.settle_step(2.0 ** np.array([16, 15, 14, 15, 20, 14, 14])) == 5
    assert q.settle_step(np.ones(3)) == 0


def test_registered():
    from benchmarks._registry import SUITES

    assert SUITES["quality"].load() is q.suite
    assert math.isfinite(q.SPIKE_FACTOR)
