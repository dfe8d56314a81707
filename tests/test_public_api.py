"""The public API: the core at the top level, every framework's entry points in one module."""

from __future__ import annotations

import importlib
import re

import pytest

import jdls


def test_framework_modules_hold_their_entry_points() -> None:
    """Each framework module exports its entry points without a framework suffix."""
    assert sorted(jdls.linen.__all__) == [
        "SITES",
        "TrainState",
        "apply_gradients",
        "from_train_state",
        "layer_scales",
        "probes",
        "split_gradients",
        "value_and_grad",
    ]
    assert sorted(jdls.nnx.__all__) == [
        "Optimizer",
        "SiteMeasurement",
        "SiteVariable",
        "layer_scale",
        "layer_scaled_value_and_grad",
        "layer_scales",
        "probes",
        "set_scale",
        "value_and_grad",
    ]
    assert jdls.linen.SITES == "jdls"
    for module in (jdls.linen, jdls.nnx):
        for name in module.__all__:
            if name != "SITES":
                assert callable(getattr(module, name)), (module.__name__, name)


def test_equinox_module_holds_its_entry_points() -> None:
    """``jdls.equinox`` names its entry points as ``jdls.linen`` and ``jdls.nnx`` do
    (``probes``, ``layer_scales``, ``layer_scaled_value_and_grad``), without a suffix."""
    pytest.importorskip("equinox")
    module = importlib.import_module("jdls.equinox")
    assert sorted(module.__all__) == [
        "Sited",
        "apply_updates",
        "checkpointed",
        "get_layer_scales",
        "layer_scaled_value_and_grad",
        "layer_scales",
        "probes",
        "set_layer_scales",
        "unwrap",
        "value_and_grad",
    ]
    for name in module.__all__:
        assert callable(getattr(module, name)), name


def test_top_level_names_carry_no_framework_suffix() -> None:
    """No top-level name is a linen/NNX variant: those live in jdls.linen and jdls.nnx."""
    names = [n for n in jdls.__all__ if n not in ("linen", "nnx")]
    suffixed = [n for n in names if re.search(r"(^|_)(linen|nnx|flax)(_|$)", n)]
    assert suffixed == []
    assert not hasattr(jdls, "TrainState")


def test_no_two_public_names_are_the_same_object() -> None:
    """One name for one thing, across the top level and the framework modules."""
    seen: dict[int, str] = {}
    for module in (jdls, jdls.linen, jdls.nnx):
        for name in module.__all__:
            obj = getattr(module, name)
            if isinstance(obj, type(jdls)):
                continue  # the submodules themselves
            key = id(obj)
            assert key not in seen, f"{module.__name__}.{name} is also {seen[key]}"
            seen[key] = f"{module.__name__}.{name}"


def test_no_module_imports_private_jax() -> None:
    """jdls reads no private JAX API (``jax._src``): the sites carry their state as data."""
    from pathlib import Path

    root = Path(jdls.__file__).parent
    found = [
        str(f.relative_to(root))
        for f in root.rglob("*.py")
        if re.search(r"^\s*(from|import)\s+jax\._src", f.read_text(encoding="utf-8"), re.M)
    ]
    assert found == []


@pytest.mark.full  # about 4 s, a new process; tests/test_equinox.py keeps one quick
def test_the_equinox_faces_load_on_first_use():
    """``import jdls`` and no more: ``jdls.equinox`` and ``jdls.fp8.equinox`` are imported on
    first use (Equinox is optional), as the docs use them."""
    pytest.importorskip("equinox")
    import subprocess
    import sys

    code = "import jdls; print(jdls.equinox.probes.__name__, jdls.fp8.equinox.Linear.__name__)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["probes_equinox", "Linear"]
