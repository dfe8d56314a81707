"""Smoke test of ``python -m benchmarks span`` (benchmarks/bench_span.py): a few steps of each
task with every rule; the full suite trains for minutes, so it is not in ``all``."""

from __future__ import annotations

import math
import sys

import numpy as np
import pytest
from _helpers import ROOT

pytest.importorskip("sklearn", reason="the tasks train on scikit-learn's digits")
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import bench_span as sp

pytestmark = pytest.mark.full  # trains every rule: the full suite only


@pytest.fixture(scope="module")
def small_tasks():
    tasks = sp.tasks(quick=True)
    for task in tasks:
        task.steps = 6
    return {t.name: t for t in tasks}


@pytest.mark.parametrize("name", ["deep", "deep-saturated", "multitask"])
def test_every_rule_runs_and_reports(small_tasks, name):
    task = small_tasks[name]
    for rule in sp.RULES:
        r = sp.train(task, rule, seed=0)
        assert 0 <= r["metric"] <= 1, rule
        assert 0 <= r["skipped"] <= task.steps, rule
        if rule == "float32":
            assert r["flushed"] == 0
        else:  # NaN when the one probed step (step 0) was skipped
            assert math.isnan(r["flushed"]) or 0 <= r["flushed"] <= 1, rule
            assert math.isnan(r["error"]) or r["error"] >= r["flushed"] - 1e-6, rule
        levels = np.atleast_1d(r["scale_log2"])
        expected = len(task.watched) if task.per == "layer" else 2
        assert levels.size == (expected if rule == "per-layer / per-loss" else 1), rule


def test_the_saturated_task_spans_more_than_float16_holds(small_tasks):
    # float16 holds 2**40 (normal and subnormal): the deep task's layers span more at the start
    assert sp.span_bits(small_tasks["deep-saturated"]) > 30


def test_at_the_same_parameters_per_layer_scales_lose_less_than_any_global_scale(small_tasks):
    # the documented comparison: one trajectory (float32's), so only the scaling differs
    (saturated,) = sp.same_point(small_tasks["deep-saturated"], at=(0,))
    assert saturated["layer_flushed_pct"] * 10 <= saturated["global_flushed_pct"]
    assert saturated["layer_error_pct"] * 10 <= saturated["global_error_pct"]
    # where the span fits float16, the best global scale and per-layer scales err alike:
    # what is left is float16's forward rounding, the same at every scale
    (trainable,) = sp.same_point(small_tasks["deep"], at=(0,))
    assert trainable["layer_flushed_pct"] < 1e-3
    assert trainable["layer_error_pct"] == pytest.approx(trainable["global_error_pct"], rel=0.05)


def test_same_point_refuses_a_per_loss_task(small_tasks):
    with pytest.raises(ValueError, match="per-loss"):
        sp.same_point(small_tasks["multitask"])
