"""The port guide (docs/porting.md) tells the truth: examples/porting/lm_after.py is
lm_before.py (Flax linen), eqx_after.py eqx_before.py (Equinox) and nnx_after.py
nnx_before.py (Flax NNX), each with fewer than 20 changed lines; the guide shows exactly those
lines, and each ported program (float16, loss scaling, probes, FP8 projections) trains as its
float32 original."""

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


# Each port: its program's name (``{name}_before.py``, ``{name}_after.py``) and the heading of
# its section of docs/porting.md; the linen port takes every section no other port names.
PORTS = {"lm": None, "eqx": "Equinox", "nnx": "Flax NNX"}


def _changed(name: str) -> tuple[list[str], list[str]]:
    """The lines removed from {name}_before.py and added in {name}_after.py (blank lines left
    out)."""
    before, after = _lines(f"{name}_before"), _lines(f"{name}_after")
    # autojunk off: difflib would otherwise treat the lines a file of 200 lines repeats (a
    # `def __call__` signature) as junk and show one next to a change as removed and added.
    matcher = difflib.SequenceMatcher(None, before, after, autojunk=False)
    removed, added = [], []
    for tag, i1, i2, j1, j2 in matcher.get_opcodes():
        if tag != "equal":
            removed += [line for line in before[i1:i2] if line.strip()]
            added += [line for line in after[j1:j2] if line.strip()]
    return removed, added


def _guide_blocks(name: str) -> list[str]:
    """The diff blocks of docs/porting.md in the port's sections (``## <heading>``)."""
    guide = (ROOT / "docs" / "porting.md").read_text()
    headings = {h for h in PORTS.values() if h is not None}
    blocks = []
    for section in re.split(r"^## ", guide, flags=re.M):
        heading = section.split("\n", 1)[0].strip()
        if PORTS[name] == heading or (PORTS[name] is None and heading not in headings):
            blocks += re.findall(r"```diff\n(.*?)```", section, re.S)
    return blocks


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


@pytest.mark.parametrize("name", PORTS)
def test_the_port_changes_fewer_than_20_lines(name: str) -> None:
    removed, added = _changed(name)
    assert 0 < len(added) < 20, added
    assert len(removed) <= len(added)


@pytest.mark.parametrize("name", PORTS)
def test_the_guide_shows_every_changed_line(name: str) -> None:
    """The diff blocks of the port's sections of docs/porting.md hold exactly the lines the
    port changes."""
    blocks = _guide_blocks(name)
    assert blocks
    shown_removed, shown_added = [], []
    for block in blocks:
        for line in block.splitlines():
            if line.startswith("+") and line[1:].strip():
                shown_added.append(line[1:])
            elif line.startswith("-") and line[1:].strip():
                shown_removed.append(line[1:])
    removed, added = _changed(name)
    assert sorted(shown_added) == sorted(added)
    assert sorted(shown_removed) == sorted(removed)


@pytest.mark.full  # about 15 s: two short trainings
def test_the_ported_program_trains_as_the_original(capsys: pytest.CaptureFixture[str]) -> None:
    """30 steps of each: the float16 + FP8 program with jdls reaches the float32 program's
    held-out loss, its probes print a row per layer, and its loop's guard never fires."""
    before = _load("lm_before").main(["--steps", "30"])
    after = _load("lm_after").main(["--steps", "30"])
    out = capsys.readouterr().out
    assert np.isfinite(before) and np.isfinite(after)
    assert abs(after - before) < 0.05, (before, after)
    for row in ("embedder.encode", "layers/attn/qkv_fp8[3]", "layers[3]", "embedder.decode"):
        assert row in out


@pytest.mark.full  # about 20 s: two short trainings
def test_the_ported_equinox_program_trains_as_the_original(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """30 steps of each: the Equinox program in float16 with FP8 projections, loss scaling and
    probes reaches the float32 program's held-out loss, prints a row per layer of the
    ``eqx.filter_vmap`` stack, and its loop's guard never fires."""
    before = _load("eqx_before").main(["--steps", "30"])
    after = _load("eqx_after").main(["--steps", "30"])
    out = capsys.readouterr().out
    assert np.isfinite(before) and np.isfinite(after)
    assert abs(after - before) < 0.05, (before, after)
    for row in ("embed", "layers[0]", "layers[3]", "norm", "output"):
        assert row in out


@pytest.mark.full  # about 20 s: two short trainings
def test_the_ported_nnx_program_trains_as_the_original(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """30 steps of each: the Flax NNX program in float16 with FP8 projections, loss scaling
    and probes reaches the float32 program's held-out loss, prints a row per layer of its
    list and per FP8 einsum, and its loop's guard never fires."""
    before = _load("nnx_before").main(["--steps", "30"])
    after = _load("nnx_after").main(["--steps", "30"])
    out = capsys.readouterr().out
    assert np.isfinite(before) and np.isfinite(after)
    assert abs(after - before) < 0.05, (before, after)
    for row in ("layers/0/attn/qkv_einsum/fp8", "layers/3 ", "final_norm", "Transformer"):
        assert row in out
