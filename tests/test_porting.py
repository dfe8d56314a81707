"""The port guide (docs/porting.md) tells the truth: examples/porting/lm_after.py is
lm_before.py with at most 20 changed lines, the guide shows exactly those lines, and the
ported program (float16, loss scaling, probes, FP8 projections) trains as the float32 one."""

from __future__ import annotations

import difflib
import importlib.util
import re
import sys

import numpy as np
import pytest
from _helpers import ROOT

PORTING = ROOT / "examples" / "porting"


def _lines(name: str) -> list[str]:
    return (PORTING / f"{name}.py").read_text().splitlines()


def _changed() -> tuple[list[str], list[str]]:
    """The lines removed from lm_before.py and added in lm_after.py (blank lines left out)."""
    diff = difflib.unified_diff(_lines("lm_before"), _lines("lm_after"), n=0, lineterm="")
    removed, added = [], []
    for line in diff:
        if line.startswith(("---", "+++", "@@")):
            continue
        if line[1:].strip():
            (added if line[0] == "+" else removed).append(line[1:])
    return removed, added


def _load(name: str):
    module_name = f"jdls_porting_{name}"
    if module_name in sys.modules:
        return sys.modules[module_name]
    spec = importlib.util.spec_from_file_location(module_name, PORTING / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_the_port_changes_at_most_20_lines() -> None:
    removed, added = _changed()
    assert 0 < len(added) <= 20, added
    assert len(removed) <= len(added)


def test_the_guide_shows_every_changed_line() -> None:
    """The diff blocks of docs/porting.md hold exactly the lines the port changes."""
    guide = (ROOT / "docs" / "porting.md").read_text()
    blocks = re.findall(r"```diff\n(.*?)```", guide, re.S)
    assert blocks
    shown_removed, shown_added = [], []
    for block in blocks:
        for line in block.splitlines():
            if line.startswith("+") and line[1:].strip():
                shown_added.append(line[1:])
            elif line.startswith("-") and line[1:].strip():
                shown_removed.append(line[1:])
    removed, added = _changed()
    assert sorted(shown_added) == sorted(added)
    assert sorted(shown_removed) == sorted(removed)


@pytest.mark.full  # about 30 s: two short trainings
def test_the_ported_program_trains_as_the_original(capsys: pytest.CaptureFixture[str]) -> None:
    """60 steps of each: the float16 + FP8 program with jdls reaches the float32 program's
    held-out loss, its probes print a row per layer, and its loop's guard never fires."""
    before = _load("lm_before").main(["--steps", "60"])
    after = _load("lm_after").main(["--steps", "60"])
    out = capsys.readouterr().out
    assert np.isfinite(before) and np.isfinite(after)
    assert abs(after - before) < 0.05, (before, after)
    for row in ("embedder.encode", "layers/attn/qkv_fp8[3]", "layers[3]", "embedder.decode"):
        assert row in out
