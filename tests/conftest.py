"""Test configuration: 8 virtual CPU devices for the multi-device tests, set before JAX loads;
``tests/`` on ``sys.path`` so that every test module, also under ``tests/integration/``,
imports the shared modules by name (``from _helpers import ...``; see ``tests/_helpers.py``)."""

import os
import sys
from pathlib import Path

_flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in _flags:
    os.environ["XLA_FLAGS"] = (_flags + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

_TESTS = str(Path(__file__).resolve().parent)
if _TESTS not in sys.path:
    sys.path.insert(0, _TESTS)


def pytest_addoption(parser):
    """``--soak-steps N`` runs the long fault-injection soak (tests/integration/test_soak.py)
    for N steps."""
    parser.addoption(
        "--soak-steps",
        type=int,
        default=None,
        help="run the long soak of tests/integration/test_soak.py with this many steps per "
        "configuration",
    )
