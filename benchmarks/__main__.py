"""``python -m benchmarks <suite> [--quick]``: run a benchmark suite, write JSON and Markdown.

The suites, and ``all`` and ``plot``, are listed by ``python -m benchmarks --help`` from
``benchmarks/_registry.py``, the one place that names them.

Each suite writes ``<out>/<suite>.json`` (every time of every round, the environment) and
``<out>/<suite>.md``; ``<out>`` is ``benchmarks/results/`` unless ``--out`` says otherwise
(not in git). ``--quick`` uses tiny sizes and a few rounds: a smoke test of the harness (CI
runs it), not a measurement. ``--malloc keep`` runs with glibc keeping freed memory (see
``benchmarks/_harness.py``), writing ``<suite>-malloc-keep.*``.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from benchmarks import _harness as h
from benchmarks._registry import SUITES, describe


def run_suite(name: str, *, quick: bool, rounds: int | None, out: Path) -> list[h.Section]:
    env = h.environment()
    start = time.perf_counter()
    sections = SUITES[name].load()(quick=quick, rounds=rounds)
    seconds = time.perf_counter() - start
    stem = name + ("" if h.malloc_mode() == "default" else "-malloc-keep")
    json_path, md_path = h.write_results(
        stem, sections, out_dir=out, env=env, extra={"quick": quick, "seconds": seconds}
    )
    print(md_path.read_text())
    h.log(f"{name}: {seconds:.0f} s; wrote {json_path} and {md_path}")
    return sections


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks",
        description=__doc__.splitlines()[0],
        epilog=describe(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "suite",
        choices=[*SUITES, "all", "plot"],
        metavar="SUITE",
        help="a suite below, all, or plot",
    )
    parser.add_argument("--quick", action="store_true", help="tiny sizes, few rounds (CI)")
    parser.add_argument("--rounds", type=int, default=None, help="override the rounds")
    parser.add_argument(
        "--out", type=Path, default=h.RESULTS_DIR, help="where to write JSON and Markdown"
    )
    parser.add_argument(
        "--img",
        type=Path,
        default=None,
        help="where to draw the plots (default: docs/img for full runs, none for --quick)",
    )
    parser.add_argument(
        "--malloc",
        choices=["default", "keep"],
        default="default",
        help="keep: re-run with glibc keeping freed memory (no page faults of fresh buffers "
        "on every call); results go to <suite>-malloc-keep.json",
    )
    args = parser.parse_args(argv)
    if args.malloc == "keep" and h.malloc_mode() != "keep":
        env = {**os.environ, **h.KEEP_FREED_MEMORY}
        argv = sys.argv[1:] if argv is None else list(argv)
        os.execve(sys.executable, [sys.executable, "-m", "benchmarks", *argv], env)
    if args.malloc == "default" and h.malloc_mode() != "default":
        parser.error("--malloc default with MALLOC_MMAP_THRESHOLD_/MALLOC_TRIM_THRESHOLD_ set")
    suffix = "" if args.malloc == "default" else "-malloc-keep"
    if args.suite == "plot":
        from benchmarks import plot

        for path in plot.plot_all(args.out, args.img or plot.DEFAULT_IMG, suffix):
            h.log(f"wrote {path}")
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / f"summary{suffix}.md").write_text(plot.summary_markdown(args.out, suffix))
        return 0
    if args.suite != "all":
        run_suite(args.suite, quick=args.quick, rounds=args.rounds, out=args.out)
        return 0
    # One process per suite: each starts with a fresh heap and fresh caches, and the 100M
    # tree's memory goes back to the system before the next suite. --quick measures nothing
    # (a smoke run of the code): every suite in this process, one import of JAX for all.
    for name in (n for n, s in SUITES.items() if s.in_all):
        if args.quick:
            run_suite(name, quick=True, rounds=args.rounds, out=args.out)
            continue
        cmd = [sys.executable, "-m", "benchmarks", name, "--out", str(args.out)]
        cmd += ["--quick"] if args.quick else []
        cmd += [] if args.rounds is None else ["--rounds", str(args.rounds)]
        cmd += ["--malloc", args.malloc]
        code = subprocess.run(cmd, check=False).returncode
        if code:
            h.log(f"{name} failed with exit code {code}")
            return code
    from benchmarks import plot

    summary = plot.summary_markdown(args.out, suffix)
    (args.out / f"summary{suffix}.md").write_text(summary)
    print(summary)
    img = args.img if args.img is not None else (None if args.quick else plot.DEFAULT_IMG)
    if img is not None:
        for path in plot.plot_all(args.out, img, suffix):
            h.log(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
