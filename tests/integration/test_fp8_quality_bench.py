"""Smoke test of ``python -m benchmarks fp8-quality`` (benchmarks/bench_fp8_quality.py): the
``--quick`` suite (the MLP, two tasks, two recipes, 30 steps) and a few steps of the LM; the
full suite trains for minutes, so it is not in ``all``."""

from __future__ import annotations

import dataclasses
import json
import math
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _helpers import ROOT

pytest.importorskip("sklearn", reason="the MLP trains on scikit-learn's digits")
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import jdls
from benchmarks import _harness as h
from benchmarks import bench_fp8_quality as fq


def test_registered_and_explained():
    from benchmarks._registry import SUITES

    assert SUITES["fp8-quality"].load() is fq.suite
    assert not SUITES["fp8-quality"].in_all
    names = [t.name for t in fq.TASKS]
    assert len(names) == len(set(names)) == 8 and all(t.why for t in fq.TASKS)
    assert set(fq.QUICK_TASKS) <= set(names)
    table = fq.recipes()
    assert set(fq.QUICK_RECIPES) <= set(table)
    assert ("AdaptiveScaling()" in table) == hasattr(jdls.fp8, "AdaptiveScaling")
    for n in (30, 300, 1200):  # the events fit every length
        assert (fq._spikes(n) == fq.SPIKE).sum() == min(fq.SPIKES, n - n // 3)


def test_clip_limit_is_half_an_ulp_above_fmax():
    formats = jdls.fp8.DelayedScaling().formats
    assert fq.clip_limit(formats.forward) == pytest.approx(464 / 448)  # e4m3: next 480
    assert fq.clip_limit(formats.backward) == pytest.approx(61440 / 57344)  # e5m2: next 65536


@pytest.mark.full  # about 4 s
def test_event_dot_scales_what_the_dot_sees_and_nothing_else():
    x = jax.random.normal(jax.random.key(0), (8, 16))
    w = jax.random.normal(jax.random.key(1), (16, 4))
    a, c = jnp.float32(4.0), jnp.float32(1e4)

    def loss(x, w, site, a, c):
        return jnp.sum(jnp.sin(fq.event_dot(x, w, site, a, c)))

    plain = jax.grad(loss, argnums=(0, 1))(x, w, None, a, c)
    exact = jax.grad(lambda x, w: jnp.sum(jnp.sin(x @ w)), argnums=(0, 1))(x, w)
    for g, e in zip(plain, exact, strict=True):
        np.testing.assert_allclose(g, e, rtol=1e-5, atol=1e-6)
    site = jdls.fp8.init(jdls.fp8.CurrentScaling())
    ones = jnp.float32(1.0)
    base = jax.grad(loss, argnums=2)(x, w, site, ones, ones).value.meter
    scaled = jax.grad(loss, argnums=2)(x, w, site, a, c).value.meter
    assert float(scaled.lhs.amax) == pytest.approx(4 * float(base.lhs.amax), rel=1e-6)
    assert float(scaled.rhs.amax) == pytest.approx(float(base.rhs.amax), rel=1e-6)
    assert float(scaled.grad.amax) == pytest.approx(1e4 * float(base.grad.amax), rel=1e-3)


def test_site_record_compares_the_scale_used_with_the_amax():
    recipe = jdls.fp8.DelayedScaling(4)
    x, w = jnp.full((2, 3), 2.0), jnp.full((3, 1), 0.5)
    old = jdls.fp8.init(recipe)  # scale 1: lhs 448 / 2, rhs 448 / 0.5, grad 57344 / 1

    def loss(s):
        return jnp.sum(jdls.fp8.dot_general(x, w, (((1,), (0,)), ((), ())), site=s))

    new = jdls.update_sites(old, jax.grad(loss)(old))
    r = fq.site_record(recipe, [old], [new])
    np.testing.assert_allclose(r["ratio"][:, 0], [224.0, 896.0, 57344.0])
    assert not r["overshoot"].any() and not r["saturated"].any()
    r = fq.site_record(recipe, [new], [new])  # the scale of the amax itself
    np.testing.assert_allclose(r["ratio"][:, 0], 1.0, rtol=1e-6)
    current = jdls.fp8.CurrentScaling()  # no scale in the state: the step's own amax
    site = jdls.fp8.init(current)
    site_new = jdls.update_sites(site, jax.grad(loss)(site))
    r = fq.site_record(current, [site], [site_new])
    np.testing.assert_allclose(r["ratio"][:, 0], 1.0, rtol=1e-6)


@pytest.mark.full  # about a minute: every quick recipe compiles twice
def test_quick_suite_reports_every_table(tmp_path):
    sections = fq.suite(quick=True)
    json_path, md_path = h.write_results("fp8-quality", sections, out_dir=tmp_path)
    data = json.loads(json_path.read_text())
    titles = [s["title"] for s in data["sections"]]
    assert titles[0] == "tasks"
    metrics = [*(title for _, title, _, _ in fq.METRICS), "final loss"]
    assert [t.split(": ", 1)[1] for t in titles[1 : len(metrics) + 1]] == metrics
    assert titles[len(metrics) + 1 :] in ([], ["MLP: skipped steps"])  # where some run skipped
    labels = list(fq.recipes(quick=True))
    for section in data["sections"][1 : len(metrics) + 1]:
        assert [r["label"] for r in section["rows"]] == list(fq.QUICK_TASKS)
        for row in section["rows"]:
            for label in labels:
                if section["title"].endswith("final loss"):
                    assert math.isfinite(row[f"{label} (mean)"])
                    assert len(row[f"{label} (per seed)"]) == 2
                elif "flushed" in section["title"]:
                    assert 0 <= row[label] <= 100
                else:
                    assert 0 <= row[label] <= 1
    by_title = {s["title"]: s for s in data["sections"]}
    over8 = {r["label"]: r for r in by_title["MLP: steps with a scale over 8x the amax"]["rows"]}
    # current scaling maps each step's own amax; delayed scaling's first step uses scale 1
    assert over8["spikes"]["CurrentScaling()"] == 0
    assert over8["spikes"]["DelayedScaling(16)"] > 0
    text = md_path.read_text()
    assert text.count("|:--|") == len(sections)
    assert "| task | no FP8 | DelayedScaling(16) | CurrentScaling() |" in text


@pytest.mark.full
def test_a_few_lm_steps_report_every_metric():
    cfg = fq.LmConfig(steps=4, seeds=1, batch=2, seq=8, dim=16, heads=2, layers=1)
    family = [t for t in fq.TASKS if t.name == "spikes"]
    out = fq.make_lm_run(jdls.fp8.DelayedScaling(16), family, cfg)()
    s = fq.summarize(out)
    assert math.isfinite(s["loss"]) and s["skipped"] == 0
    assert out["ratio"].shape == (1, 4, 3, 4)  # seeds, steps, roles, four dots of one layer
    assert s["over8"] > 0  # the first step's scale is 1
    task = dataclasses.replace(next(t for t in fq.TASKS if t.loss_scaling))
    out = fq.make_lm_run(None, [task], cfg)()
    assert "ratio" not in out and math.isfinite(fq.summarize(out)["loss"])
