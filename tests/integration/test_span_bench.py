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
