"""Smoke test of the benchmark suite: ``python -m benchmarks all --quick`` runs and writes
well-formed JSON and Markdown for every suite (tiny sizes, a few rounds, no thresholds)."""

from __future__ import annotations

import importlib
import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
from _helpers import ROOT

# The benchmarks time jdls against jmp (``benchmarks/bench_update.py``, ``bench_step.py``): they
# need the ``peers`` extra, so the smoke test skips without it.
pytest.importorskip("jmp", reason="the benchmarks compare with jmp (pip install -e '.[peers]')")

pytestmark = pytest.mark.full  # minutes: the full suite only (docs/contributing.md)


def _registry() -> object:
    """``benchmarks/_registry.py``, the one list of suites (benchmarks/ is not installed)."""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    return importlib.import_module("benchmarks._registry")


# The suites ``all`` runs (``quality`` trains for minutes: tests/integration/test_quality_bench.py).
SUITES = tuple(n for n, s in _registry().SUITES.items() if s.in_all)  # type: ignore[attr-defined]


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("benchmarks")
    env = dict(os.environ)
    # One CPU device, as a user runs it (not the 8 of conftest). LLVM's optimizations off:
    # the run checks the harness (its reports' form, which steps skip), not times or the
    # last bits, and its tiny programs then compile in two thirds of the time (131 s
    # against 86 s for the whole run on a 2-core CPU).
    env["XLA_FLAGS"] = "--xla_backend_optimization_level=0"
    env["JAX_PLATFORMS"] = "cpu"
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks", "all", "--quick", "--out", str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return out


def _finite_number(x: object) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x)


@pytest.mark.parametrize("suite", SUITES)
def test_json_is_well_formed(results: Path, suite: str) -> None:
    data = json.loads((results / f"{suite}.json").read_text())
    assert data["suite"] == suite
    assert data["quick"] is True
    env = data["environment"]
    for key in ("date", "cpu", "cpu_count", "versions", "command"):
        assert key in env
    assert env["versions"]["jax"]
    assert data["sections"], "no sections"
    for section in data["sections"]:
        assert section["title"] and section["rows"]
        for row in section["rows"]:
            assert row["label"]
            if suite == "compile" and "temp_bytes" not in row:  # the sum-of-squares forms
                assert row["kernels"] >= 1 and row["compile_ms"] > 0 and row["median_ms"] > 0
            elif suite == "compile":
                assert row["temp_bytes"] >= 0
                assert _finite_number(row["compile_ms"]) and row["compile_ms"] > 0
                assert _finite_number(row["total_ratio"])
            else:
                assert _finite_number(row["median_ms"]) and row["median_ms"] > 0
                assert _finite_number(row["ratio"]) and row["ratio"] > 0
                assert row["q1_ms"] <= row["median_ms"] <= row["q3_ms"]
                assert len(row["times_ms"]) == row["rounds"] >= 1
        first = section["rows"][0]
        if "ratio" in first:
            assert first["ratio"] == 1.0  # the baseline against itself


@pytest.mark.parametrize("suite", SUITES)
def test_markdown_has_a_table_per_section(results: Path, suite: str) -> None:
    text = (results / f"{suite}.md").read_text()
    data = json.loads((results / f"{suite}.json").read_text())
    assert text.startswith(f"## {suite}")
    for section in data["sections"]:
        assert f"### {section['title']}" in text
        for row in section["rows"]:
            assert f"| {row['label']} |" in text
    assert text.count("|:--|") == len(data["sections"])


def test_summary_lists_the_targets(results: Path) -> None:
    text = (results / "summary.md").read_text()
    assert "| target | measured | limit | met |" in text
    assert "full step: jdls.wrap(adam) / static scale" in text
    assert "update: jdls.wrap(adam) / adam" in text


def test_skipped_cases_really_skip(results: Path) -> None:
    rows = json.loads((results / "step.json").read_text())["sections"][0]["rows"]
    by_label = {r["label"]: r for r in rows}
    assert by_label["jdls.wrap(adam)"]["last_step_skipped"] is False
    assert by_label["jdls.wrap(adam) [skipped step]"]["last_step_skipped"] is True
    rows = json.loads((results / "update.json").read_text())["sections"][0]["rows"]
    for row in rows:
        if row["label"].startswith(("jdls", "chain(jdls")):
            assert row["last_step_skipped"] is row["label"].endswith("[skipped step]")


def test_capabilities_suite_targets_and_plot(results: Path, tmp_path: Path) -> None:
    rows = json.loads((results / "capabilities.json").read_text())["sections"][0]["rows"]
    assert {r["workload"] for r in rows} == {"mlp", "transformer"}
    assert all(r["skipped_steps"] == 0 for r in rows)
    assert sum(r["target"] is not None for r in rows) == 9
    assert "transformer full step: nll + z-loss" in (results / "summary.md").read_text()
    pytest.importorskip("matplotlib")
    from benchmarks import plot

    assert tmp_path / "perf_capabilities.png" in plot.plot_all(results, tmp_path)


def test_capabilities_gradients_agree() -> None:
    """The per-layer and per-loss steps of the ``capabilities`` suite compute the global
    scale's gradients (quick sizes; the suite checks it itself only before a full run)."""
    _registry()  # the repository root on sys.path
    cap = importlib.import_module("benchmarks.bench_capabilities")
    for model in (cap.mlp_model(True), cap.transformer_model(True)):
        errors = cap.check_gradients(model)  # raises beyond cap.TOLERANCE
        assert set(errors) == ({"per-layer"} if model.losses is None else {"per-layer", "per-loss"})


def test_help_lists_the_registry() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks", "--help"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    registry = _registry()
    for name in (*SUITES, *registry.TOOLS):  # type: ignore[attr-defined]
        assert f"  {name}  " in proc.stdout
    for module in registry.TOOLS:  # type: ignore[attr-defined]
        assert importlib.util.find_spec(module) is not None, module
