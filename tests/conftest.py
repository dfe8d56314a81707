"""Test configuration: 8 virtual CPU devices for the multi-device tests, set before JAX loads;
``tests/`` on ``sys.path`` so that every test module, also under ``tests/integration/``,
imports the shared modules by name (``from _helpers import ...``; see ``tests/_helpers.py``).

The quick run and the full suite (docs/contributing.md, "Run the tests"): ``python -m pytest``
is the quick run; ``python -m pytest --full`` (or ``JDLS_FULL=1``) is the full suite. The quick
run leaves out

* every test marked ``@pytest.mark.full`` (a slow test, or a ``pytest.param(...,
  marks=pytest.mark.full)`` case of a parametrized one); ``@pytest.mark.full(keep=1)`` on a
  parametrized test keeps its first case in the quick run (of those not marked full
  themselves: a jitted case beside an eager one marked full), and
* the combinations of a test parametrized over several axes beyond a covering sample: every
  value of every axis runs at least once (``covering_items``); a test with one axis runs every
  case.
"""

import os
import sys
import zlib
from collections import defaultdict
from pathlib import Path

import pytest

_flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in _flags:
    os.environ["XLA_FLAGS"] = (_flags + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

_TESTS = str(Path(__file__).resolve().parent)

# JAX's persistent compilation cache, shared by the run's workers and kept between runs: a
# program that several tests (or both workers) build is compiled once and loaded after, the
# same executable. Most of the suite's time is XLA compiling small programs. Set
# JAX_COMPILATION_CACHE_DIR to move the cache; JDLS_TEST_COMPILATION_CACHE=0 turns it off.
if os.environ.get("JDLS_TEST_COMPILATION_CACHE", "1") != "0":
    os.environ.setdefault(
        "JAX_COMPILATION_CACHE_DIR", str(Path(_TESTS).parent / ".pytest_cache" / "jax")
    )
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "-1")
if _TESTS not in sys.path:
    sys.path.insert(0, _TESTS)


def pytest_addoption(parser):
    """``--soak-steps N`` runs the long fault-injection soak (tests/integration/test_soak.py)
    for N steps; ``--full`` runs the full suite, ``--full-only`` what the quick run leaves out."""
    parser.addoption(
        "--soak-steps",
        type=int,
        default=None,
        help="run the long soak of tests/integration/test_soak.py with this many steps per "
        "configuration",
    )
    parser.addoption(
        "--full",
        action="store_true",
        default=False,
        help="the full suite: every test marked full and every combination of the parametrized "
        "tests (the same as JDLS_FULL=1; JDLS_FULL_MATRIX=1 adds every cell of the matrices)",
    )
    parser.addoption(
        "--full-only",
        action="store_true",
        default=False,
        help="the full suite less the quick run (CI runs the quick run, then this)",
    )


def full_suite(config: pytest.Config) -> bool:
    """Whether this run is the full suite (``--full`` or ``JDLS_FULL=1``)."""
    return (
        bool(config.getoption("--full"))
        or bool(config.getoption("--full-only"))
        or os.environ.get("JDLS_FULL") == "1"
    )


def pytest_report_header(config: pytest.Config) -> str:
    if config.getoption("--full-only"):
        return "jdls: the full suite less the quick run"
    if full_suite(config):
        return "jdls: the full suite"
    return "jdls: the quick run (--full or JDLS_FULL=1 runs the full suite)"


def covering_items(items: list[pytest.Item]) -> list[pytest.Item]:
    """Of the cases of one parametrized test, a fixed subset in which every value of every
    parametrized axis appears at least once (all of them when there is one axis)."""
    axes = {name for item in items for name in _indices(item)}
    if len({_decorator(item, name) for item in items for name in axes}) <= 1:
        return items
    chosen, seen = [], set()
    for item in sorted(items, key=lambda i: zlib.crc32(i.nodeid.encode())):
        values = set(_indices(item).items())
        if not values <= seen:
            chosen.append(item)
            seen |= values
    return [item for item in items if item in chosen]


def _quick_cases(items: list[pytest.Item]) -> list[pytest.Item]:
    """The cases of one test that the quick run keeps."""
    # every "full" mark of a case: a case's own (``pytest.param(..., marks=pytest.mark.full)``)
    # beside its test's ``full(keep=N)``, which the closest mark alone would hide
    marks = [list(item.iter_markers("full")) for item in items]
    items = [item for item, own in zip(items, marks, strict=True) if not _full_only(own)]
    keep = [mark.kwargs["keep"] for own in marks for mark in own if "keep" in mark.kwargs]
    return covering_items(items)[: keep[0]] if keep else covering_items(items)


def _full_only(marks: list[pytest.Mark]) -> bool:
    """Whether a case so marked runs only in the full suite (``full(keep=N)`` decides later)."""
    return any("keep" not in mark.kwargs for mark in marks)


def _indices(item: pytest.Item) -> dict[str, int]:
    """Each parametrized argument of ``item`` and its value (by identity: the cases of one
    decorator share their value objects)."""
    callspec = getattr(item, "callspec", None)
    return {k: id(v) for k, v in callspec.params.items()} if callspec is not None else {}


def _decorator(item: pytest.Item, name: str) -> tuple[str, ...]:
    """The argument names parametrized together with ``name`` (one axis)."""
    for mark in item.iter_markers("parametrize"):
        names = mark.args[0]
        names = [n.strip() for n in names.split(",")] if isinstance(names, str) else list(names)
        if name in names:
            return tuple(names)
    return (name,)  # a parametrized fixture


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    full_only = bool(config.getoption("--full-only"))
    if full_suite(config) and not full_only:
        return
    tests: dict[str, list[pytest.Item]] = defaultdict(list)
    for item in items:
        tests[item.nodeid.split("[")[0]].append(item)
    quick = {id(i) for group in tests.values() for i in _quick_cases(group)}
    # --full-only: the complement
    keep = {id(i) for i in items if id(i) not in quick} if full_only else quick
    deselected = [item for item in items if id(item) not in keep]
    if deselected:
        config.hook.pytest_deselected(items=deselected)
        items[:] = [item for item in items if id(item) in keep]
