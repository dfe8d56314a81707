"""Where the time of one variant goes: per-kernel times from the JAX profiler, and HLO counts.

Runs a few steps of one variant under ``jax.profiler.trace`` and sums the duration of every
XLA:CPU kernel (fusion, copy, dot, conditional) over them; also counts, in the compiled HLO,
the kernels and the copies. Use it to see what a variant does more than its baseline::

    python -m benchmarks.profile_ops step "static scale" "jdls.wrap(adam)"
    python -m benchmarks.profile_ops update adam "jdls.wrap(adam)" --top 15
    python -m benchmarks.profile_ops update "jdls.wrap(adam)" --skipped

Kernel times overlap when XLA runs two kernels at once, and a ``cond`` counts the kernels
of its taken branch again, so the per-kernel sums do not add up to the wall time.
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import re
import tempfile
from collections.abc import Sequence
from typing import Any

import jax

from benchmarks import bench_step, bench_update

_SKIP = re.compile(r"^(\$|ThunkExecutor|SlinkyThreadPool|PjitFunction|CommonPjRt|ParseArguments)")


def _runner(workload: str, name: str, skipped: bool) -> Any:
    if workload == "update":
        config = bench_update.Config()
        cases, _ = bench_update.make_cases(
            config, [] if skipped else [name], [name] if skipped else []
        )
        return cases[0].run
    work = (
        bench_step.mlp_workload(False)
        if workload == "step"
        else (bench_step.transformer_workload(False))
    )
    method = bench_step.make_methods(work.loss)[name]()
    return bench_step.Runner(method, work.params, work.poisoned if skipped else work.batch)


def hlo_counts(text: str) -> dict[str, int]:
    """Kernels (fusions, dots, copies, custom calls), copies and conditionals of compiled HLO."""
    return {
        "fusions": len(re.findall(r"= \S+ fusion\(", text)),
        "copies": len(re.findall(r"= \S+ copy\(", text)),
        "dots": len(re.findall(r"= \S+ dot\(", text)),
        "conditionals": text.count(" conditional("),
    }


def kernels_per_computation(text: str) -> dict[str, int]:
    """Kernels (fusions, copies, dots) of the entry computation and of every branch of a
    ``conditional``: where the kernels, hence the compile time, come from."""
    counts = {}
    for block in re.split(r"\n(?=\S)", text):
        head = block.split("\n", 1)[0]
        name = "ENTRY" if head.startswith("ENTRY") else head.split(" ")[0].lstrip("%")
        if name.startswith(("fused", "wrapped")):
            continue
        k = len(re.findall(r"\s(?:fusion|copy|dot)\(", block))
        if k:
            counts[name] = k
    return counts


def profile(runner: Any, steps: int) -> dict[str, float]:
    """Milliseconds per step of every kernel, from a profiler trace of ``steps`` calls."""
    with tempfile.TemporaryDirectory() as tmp:
        with jax.profiler.trace(tmp, create_perfetto_trace=True):
            for _ in range(steps):
                runner()
        (path,) = glob.glob(f"{tmp}/**/*.trace.json.gz", recursive=True)
        with gzip.open(path) as f:
            trace = json.load(f)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    total: dict[str, float] = collections.defaultdict(float)
    for e in events:
        if e.get("ph") == "X" and not _SKIP.match(e["name"]):
            total[e["name"]] += e["dur"] / 1e3 / steps
    return dict(total)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("workload", choices=["update", "step", "transformer"])
    parser.add_argument("variants", nargs="+", help="variant names, as in the tables")
    parser.add_argument("--skipped", action="store_true", help="profile skipped steps")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args(argv)
    for name in args.variants:
        runner = _runner(args.workload, name, args.skipped)
        for _ in range(2):
            runner()
        times = profile(runner, args.steps)
        print(f"## {args.workload}: {name}{' [skipped step]' if args.skipped else ''}")
        try:
            text = runner.fn.lower(*_args(runner)).compile().as_text()
            print(", ".join(f"{k} {v}" for k, v in hlo_counts(text).items()))
            per = kernels_per_computation(text)
            print("kernels per computation: " + ", ".join(f"{k} {v}" for k, v in per.items()))
        except Exception as e:  # jmp's scale cannot be lowered from its own instances
            print(f"(no HLO counts: {type(e).__name__})")
        print(f"{'ms/step':>9}  kernel")
        for k, v in sorted(times.items(), key=lambda kv: -kv[1])[: args.top]:
            print(f"{v:9.2f}  {k}")
        print()


def _args(runner: Any) -> tuple[Any, ...]:
    if isinstance(runner, bench_step.Runner):
        return runner.params, runner.state, runner.batch
    return runner.grads, runner.state, runner.params


if __name__ == "__main__":
    main()
