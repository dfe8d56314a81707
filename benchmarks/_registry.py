"""The one list of benchmark suites and tools: ``python -m benchmarks``, its help text, ``all``,
the smoke test (``tests/test_benchmarks_smoke.py``) and the package docstring read it.

A *suite* is a function ``suite(quick=False, rounds=None) -> list[Section]`` that
``python -m benchmarks <name>`` runs and writes to ``<out>/<name>.json`` and ``.md``; a *tool*
is a module with its own command line (``python -m <module> --help``). Adding a suite is one
line here. Nothing is imported until a suite runs, so reading the table is cheap.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable
from typing import Any


@dataclasses.dataclass(frozen=True)
class Suite:
    """One suite of ``python -m benchmarks``.

    Attributes:
      name: the command-line name, and the stem of its result files.
      module: the module that defines it.
      function: the name of ``suite(quick=False, rounds=None) -> list[Section]`` in it.
      description: one line for the help text.
      in_all: run by ``all`` (and so by the smoke test); False for suites that train models
        for minutes even with ``--quick`` (``quality``, smoke-tested on its own).
    """

    name: str
    module: str
    function: str
    description: str
    in_all: bool = True

    def load(self) -> Callable[..., list[Any]]:
        """The suite function (imports its module, and so JAX)."""
        return getattr(importlib.import_module(self.module), self.function)


SUITES: dict[str, Suite] = {
    s.name: s
    for s in (
        Suite(
            "update",
            "benchmarks.bench_update",
            "suite",
            "update only, 8M float32 parameters in 64 leaves, every variant, skipped steps",
        ),
        Suite(
            "update-large",
            "benchmarks.bench_update",
            "suite_large",
            "update only, 100M parameters in 500 leaves (about 6 GiB of RAM)",
        ),
        Suite(
            "step",
            "benchmarks.bench_step",
            "suite",
            "full train step of an 8M-parameter MLP, float16 compute, batch 256",
        ),
        Suite(
            "transformer",
            "benchmarks.bench_step",
            "suite_transformer",
            "full train step of a small decoder-only transformer",
        ),
        Suite(
            "retries",
            "benchmarks.bench_retry",
            "suite",
            "jdls.retrying(retries=2): a finite step, a step that retries once, memory, HLO copies",
        ),
        Suite(
            "accumulate",
            "benchmarks.bench_accumulate",
            "suite",
            "jdls.accumulate over 4 micro-batches against a plain lax.scan: time and memory",
        ),
        Suite(
            "capabilities",
            "benchmarks.bench_capabilities",
            "suite",
            "cost of AdaptiveScale, telemetry, per-layer and per-loss scales, retries vs targets",
        ),
        Suite(
            "compile",
            "benchmarks.bench_compile",
            "suite",
            "compiled temporary memory and compile time, full step and update",
        ),
        Suite(
            "quality",
            "benchmarks.bench_quality",
            "suite",
            "scaling quality: 10 rules x 18 tasks, 3 seeds (metric, skips, settling, underflow);"
            " not in all",
            in_all=False,
        ),
        Suite(
            "fp8-quality",
            "benchmarks.bench_fp8_quality",
            "suite",
            "FP8 scaling quality: 7 recipes x 8 tasks on an MLP (3 seeds) and 3 tasks on the"
            " character LM (2 seeds): scale headroom, clipping, flushing, loss; not in all",
            in_all=False,
        ),
        Suite(
            "default-cost",
            "benchmarks.bench_quality",
            "suite_step_cost",
            "step time of the default scale (AdaptiveScale) against the classic rule, four models",
        ),
        Suite(
            "span",
            "benchmarks.bench_span",
            "suite",
            "scale span: global rules vs per-layer / per-loss scales vs float32 on a deep net"
            " and a multi-task loss; not in all",
            in_all=False,
        ),
        Suite(
            "compile-leaves",
            "benchmarks.bench_compile",
            "suite_leaves",
            "compile time of the update at 64, 500 and 5,000 leaves (1M parameters);"
            " not in all (an hour at 5,000 leaves)",
            in_all=False,
        ),
        Suite(
            "sites",
            "benchmarks.bench_sites",
            "suite",
            "probes and per-layer scales on a scanned, rematerialised float16 transformer:"
            " step and compile time against the plain step",
        ),
        Suite(
            "roofline",
            "benchmarks.bench_roofline",
            "suite",
            "achieved GB/s of the update against streaming kernels on the same bytes",
        ),
    )
}

#: Modules with their own command line (not part of ``all``), by module name.
TOOLS: dict[str, str] = {
    "benchmarks.bench_update": "the update suite standalone, e.g. --only VARIANT... --rounds N",
    "benchmarks.profile_ops": "per-kernel times (JAX profiler) and HLO kernel counts of variants",
    "benchmarks.ablate_compile": "compile time of the update with parts of jdls.wrap taken out",
    "benchmarks.bench_round": "cost of cbfloat16 rounding against a native float16 round trip",
    "benchmarks.bench_quality": "plot the quality suite's loss scales, one panel per task (RESULTS PNG)",
}


def describe() -> str:
    """The suites and tools as text (the epilog of ``python -m benchmarks --help``)."""
    width = max(len(n) for n in [*SUITES, "all", "plot"])
    lines = ["suites:"]
    lines += [f"  {s.name:{width}}  {s.description}" for s in SUITES.values()]
    lines += [
        f"  {'all':{width}}  every suite above but those not in all, then summary.md and (unless --quick) the plots",
        f"  {'plot':{width}}  only redraw the plots and summary.md from the JSON in --out",
        "",
        "tools (python -m MODULE --help):",
    ]
    width = max(len(m) for m in TOOLS)
    lines += [f"  {m:{width}}  {d}" for m, d in TOOLS.items()]
    return "\n".join(lines)
