"""Every example runs (shortened), shows --help, and the demo's claims hold.

The examples are imported from their files and their ``main(argv)`` is called in-process (one
JAX start for all of them); one is also run as a script in a subprocess, as a reader would.
"""

from __future__ import annotations

import importlib.util
import math
import os
import subprocess
import sys

import numpy as np
import pytest
from _helpers import ROOT

EXAMPLES = ROOT / "examples"
NAMES = [
    "quickstart",
    "demo",
    "nnx_transformer",
    "data_parallel",
    "cbfloat16",
    "zero_skip",
    "multitask",
    "equinox_cnn",
    "scanned_transformer",
]
#: Examples that need an optional library (in the ``test`` and ``examples`` extras).
NEEDS = {"equinox_cnn": "equinox"}


def load(name: str):
    """Import ``examples/<name>.py`` as the module ``jdls_example_<name>``."""
    module_name = f"jdls_example_{name}"
    if name in NEEDS:
        pytest.importorskip(NEEDS[name])
    if module_name in sys.modules:
        return sys.modules[module_name]
    spec = importlib.util.spec_from_file_location(module_name, EXAMPLES / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_every_example_is_listed():
    assert sorted(p.stem for p in EXAMPLES.glob("*.py")) == sorted(NAMES)


@pytest.mark.parametrize("name", NAMES)
def test_help(name, capsys):
    with pytest.raises(SystemExit) as exit_info:
        load(name).main(["--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage:")
    assert "--quiet" in out


def test_quickstart():
    result = load("quickstart").main(["--steps", "60", "--quiet"])
    # The default scale starts at 1 and then follows the largest gradient: no step overflows.
    assert result["skipped_steps"] == 0
    assert result["loss_scale"] == 2.0**11
    assert result["loss"] < 1.0


@pytest.mark.full
def test_scanned_transformer(tmp_path, capsys):
    """A few steps of the scanned, rematerialised transformer (2 small layers): a loss scale
    per layer, a row of telemetry per layer in forward order, the plot, the table."""
    argv = ["--steps", "3", "--layers", "2", "--dim", "32", "--heads", "2", "--context", "16"]
    argv += ["--batch-size", "4", "--quiet", "--out", str(tmp_path)]
    result = load("scanned_transformer").main(argv)
    assert result["skipped_steps"] == 0
    assert len(result["losses"]) == 3 and np.all(np.isfinite(result["losses"]))
    scales = result["scales"]
    assert [s.shape for s in scales.values()] == [(1,), (2,), (1,)]
    assert all(np.all(s > 1.0) for s in scales.values())  # grown from 1 to the headroom
    for telemetry in result["history"]:
        assert telemetry.names == ("embed", "blocks[0]", "blocks[1]", "head")
        assert np.all(np.isfinite(telemetry.amax)) and np.all(telemetry.amax > 0)
    assert result["plot"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    text = capsys.readouterr().out
    assert "skipped steps 0" in text
    for name in ("loss scale", "headroom bits", "embed", "blocks[1]", "head"):
        assert name in text


@pytest.mark.full
def test_demo_claims(tmp_path, capsys):
    """Shortened demo: float16 without scaling fails; float16 + jdls matches float32.

    ``--growth-interval 10`` lets the scale reach float16's overflow within 400 steps, so the
    run also exercises skipped steps and backoffs.
    """
    out = tmp_path / "demo.png"
    argv = ["--steps", "400", "--growth-interval", "10", "--quiet", "--out", str(out)]
    results = load("demo").main(argv)
    f32, f16, jdls_run = results["float32"], results["float16"], results["float16+jdls"]

    # float16 without scaling: every gradient underflows to zero, nothing is learned.
    assert f16.zero_fraction == 1.0
    assert f16.accuracy < 0.2
    assert f16.skipped == 0 and f16.loss_scale == 1.0
    assert np.all(f16.zeros == 1.0)  # at every step: Adam's updates are 0, nothing moves
    assert f16.loss.min() > 2.2  # chance level: ln(10) = 2.30
    # float16 + jdls: within 0.5 percentage points of float32.
    assert f32.accuracy > 0.95
    assert abs(jdls_run.accuracy - f32.accuracy) <= 0.005
    assert jdls_run.zero_fraction < 0.5
    assert f32.zero_fraction < 0.5  # structural zeros only (blank pixels, inactive units)
    # The dynamic scale grew far above 2**15, overflowed, skipped and backed off.
    assert jdls_run.skipped > 0
    assert jdls_run.loss_scale >= 2.0**30
    assert math.log2(jdls_run.loss_scale).is_integer()
    assert jdls_run.skipped_so_far[-1] == jdls_run.skipped
    assert np.all(np.diff(jdls_run.skipped_so_far) >= 0)
    # float32 never skips and keeps a scale of 1.
    assert f32.skipped == 0 and f32.loss_scale == 1.0

    text = capsys.readouterr().out
    for name in ("float32", "float16", "float16+jdls", "accuracy", "zero grads", "skipped"):
        assert name in text
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.full
def test_demo_other_formats_and_errors(tmp_path):
    demo = load("demo")
    results = demo.main(
        ["--steps", "5", "--quiet", "--no-plot", "--formats", "bfloat16,cbfloat16+jdls"]
    )
    assert list(results) == ["bfloat16", "cbfloat16+jdls"]
    assert all(len(r.loss) == 5 for r in results.values())
    with pytest.raises(SystemExit):
        demo.main(["--formats", "float8+jdls", "--no-plot"])
    with pytest.raises(SystemExit):
        demo.main(["--formats", "float16+apex", "--no-plot"])
    assert not list(tmp_path.iterdir())  # --no-plot writes nothing


@pytest.mark.full
def test_nnx_transformer():
    result = load("nnx_transformer").main(["--steps", "6", "--sample", "8", "--quiet"])
    assert np.isfinite(result["loss"])
    assert result["loss_scale"] == 2.0**15  # no growth (interval 100) and no overflow
    assert result["skipped_steps"] == 0
    assert result["sample"].startswith("def wrap(") and len(result["sample"]) == 9 + 8


@pytest.mark.full
def test_data_parallel_modes_agree():
    results = load("data_parallel").main(["--steps", "8", "--batch-size", "64", "--quiet"])
    jit, shard_map = results["jit"], results["shard_map"]
    assert jit["replicated"] and shard_map["replicated"]
    assert jit["loss_scale"] == shard_map["loss_scale"] == 2.0**15
    assert jit["skipped_steps"] == shard_map["skipped_steps"] == 0
    np.testing.assert_allclose(jit["losses"], shard_map["losses"], rtol=1e-2)
    assert jit["losses"][-1] < jit["losses"][0]


@pytest.mark.full
def test_cbfloat16():
    results = load("cbfloat16").main(["--steps", "20", "--quiet"])
    assert list(results) == ["float16+jdls", "cbfloat16", "cbfloat16+jdls"]
    assert results["cbfloat16+jdls"]["loss_scale"] == 2.0**31  # Cerebras' cbfloat16 maximum
    assert results["cbfloat16"]["loss_scale"] == 1.0
    # At this loss weight cbfloat16 keeps gradients that float16 would flush to zero.
    assert results["cbfloat16"]["zero_fraction"] < 0.5
    for r in results.values():
        assert r["skipped_steps"] == 0


@pytest.mark.full
def test_zero_skip(tmp_path):
    """Injected scale-caused overflows: retries drop no batch and the schedule follows the
    data; skipping drops batches and the schedule falls behind by as many."""
    out = tmp_path / "zero_skip.png"
    results = load("zero_skip").main(["--steps", "80", "--quiet", "--out", str(out)])
    retry, skip = results["retry"], results["skip"]
    assert retry["dropped"] == 0 and retry["applied"].all()
    assert retry["retried_steps"] >= 1
    assert list(retry["schedule_step"]) == list(range(1, 81))
    assert skip["dropped"] >= 1
    assert skip["schedule_step"][-1] == 80 - skip["dropped"]
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.full
def test_data_parallel_runs_as_a_script():
    """As a reader runs it: a fresh process, which must set up 8 CPU devices by itself."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env["JAX_PLATFORMS"] = "cpu"
    proc = subprocess.run(
        [sys.executable, str(EXAMPLES / "data_parallel.py"), "--steps", "3", "--mode", "jit"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert "8 devices (cpu)" in proc.stdout
    assert "jit: final loss" in proc.stdout


@pytest.mark.full
def test_multitask_per_loss_scales_recover_the_small_loss():
    """The example's claim, at its defaults (2,000 steps, about 25 s): one global scale loses
    the classifier weighted 1e-4, per-loss scales (PyTorch's rule, AdaptiveScale) learn it as
    float32 does."""
    results = load("multitask").main(["--quiet"])
    f32 = results["float32"]
    one = results["float16, one global scale"]
    per_loss = results["float16, per-loss scales"]
    assert f32.accuracy > 0.6
    assert one.accuracy < f32.accuracy - 0.2
    assert per_loss.accuracy > f32.accuracy - 0.05
    # the reconstruction holds every global scale near 1; the classifier gets its own
    assert one.scales["global"] <= 2.0**2
    assert per_loss.scales["classifier"] >= 2.0**8 * per_loss.scales["reconstruction"]
    # the reconstruction itself is learnt alike
    assert abs(per_loss.reconstruction - f32.reconstruction) < 0.05 * f32.reconstruction
    # AdaptiveScale per loss, given each loss's measurement by jdls.adjust_loss_scales
    adaptive = results["float16, per-loss Adaptive"]
    assert adaptive.accuracy > f32.accuracy - 0.05
    assert adaptive.scales["classifier"] >= 2.0**8 * adaptive.scales["reconstruction"]


@pytest.mark.full
def test_equinox_cnn_matches_float32_where_unscaled_float16_fails():
    results = load("equinox_cnn").main(["--steps", "150", "--quiet"])
    f32, f16, scaled = results["float32"], results["float16"], results["float16+jdls"]
    assert list(results) == ["float32", "float16", "float16+jdls"]
    # Unscaled float16 loses almost every gradient and stays near chance.
    assert f16["zero_fraction"] > 0.9 and f16["accuracy"] < 0.3
    # With jdls the float16 run keeps float32's gradients and accuracy.
    assert abs(scaled["zero_fraction"] - f32["zero_fraction"]) < 0.02
    assert abs(scaled["accuracy"] - f32["accuracy"]) < 0.03
    assert f32["accuracy"] > f16["accuracy"] + 0.2
    assert scaled["skipped_steps"] == 0 and scaled["loss_scale"] > 2.0**15
    assert f32["loss_scale"] == f16["loss_scale"] == 1.0
