"""Test configuration: 8 virtual CPU devices for the multi-device tests, set before JAX loads."""

import os

_flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in _flags:
    os.environ["XLA_FLAGS"] = (_flags + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")


def pytest_addoption(parser):
    """``--soak-steps N`` runs the long fault-injection soak (tests/test_soak.py) for N steps."""
    parser.addoption(
        "--soak-steps",
        type=int,
        default=None,
        help="run the long soak of tests/test_soak.py with this many steps per configuration",
    )
