"""The timing harness shared by every suite: interleaved rounds, medians, IQRs, ratios, output.

A *case* is a zero-argument callable that runs one unit of work (one train step, one update)
and blocks until its results are ready; it keeps its own state (donated buffers are replaced
by the outputs of the previous call). :func:`run_interleaved` calls every case once per
round, in an order shuffled anew each round, so that a change of machine load (other jobs on
a shared machine) hits every case alike, and no case always runs right after the same
neighbour. :func:`summarize` reports, per case, the median time and its interquartile range,
and the ratio to the baseline case (the first one) as the **median of the per-round ratios**:
two cases timed in the same round saw the same load, so their ratio is steadier than either
time.

Results are written as JSON (every number, the environment, the configuration) and as a
Markdown table by :func:`write_results`.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import platform
import random
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax

#: Where results go unless ``--out`` says otherwise; ignored by git (the benchmark command
#: regenerates it), the summary that the docs cite is ``benchmarks/summary-*.md``.
RESULTS_DIR = Path(__file__).resolve().parent / "results"


@dataclasses.dataclass
class Case:
    """One timed thing.

    Attributes:
      label: the name shown in tables.
      run: runs one unit of work and blocks until it is done.
      group: cases with the same group share a baseline (the first case of the group);
        ``None`` uses the first case overall.
      info: extra columns for the JSON/Markdown (e.g. bytes moved).
    """

    label: str
    run: Callable[[], Any]
    group: str | None = None
    info: dict[str, Any] = dataclasses.field(default_factory=dict)


def settle(run: Callable[[], Any], jitted: Any, max_calls: int = 5) -> None:
    """Call ``run`` until ``jitted`` stops compiling (a state whose dtypes or weak types change
    after the first step, as Flax's and jmp's scales do, compiles twice); then check later.
    """
    size = getattr(jitted, "_cache_size", None)
    if size is None:
        run()
        return
    for _ in range(max_calls):
        before = size()
        run()
        if size() == before:
            return
    raise RuntimeError(f"{jitted} still compiles after {max_calls} calls")


def temp_bytes(jitted: Any, *args: Any) -> int:
    """Temporary bytes of ``jitted`` compiled for ``args`` (``memory_analysis()``; donated
    arguments are not counted)."""
    return jitted.lower(*args).compile().memory_analysis().temp_size_in_bytes


def temp_info(temp: int, base: int, grad_bytes: int) -> dict[str, Any]:
    """The memory columns of a case: its temporary bytes, and their difference to its
    baseline's (``base``) in units of one gradient buffer (``grad_bytes``)."""
    return {
        "temp_bytes": temp,
        "temp_mib": temp / 2**20,
        "extra_grad_buffers": (temp - base) / grad_bytes,
        "grad_buffer_bytes": grad_bytes,
    }


#: glibc settings that keep freed memory in the process (``--malloc keep``): see
#: :func:`malloc_mode`. Both are needed; each alone makes little or no difference here.
KEEP_FREED_MEMORY = {
    "MALLOC_MMAP_THRESHOLD_": str(16 * 2**30),
    "MALLOC_TRIM_THRESHOLD_": str(16 * 2**30),
}


def malloc_mode() -> str:
    """``"keep"`` when glibc was told to keep freed memory (:data:`KEEP_FREED_MEMORY`).

    XLA:CPU allocates the outputs and temporary buffers of every call anew. With glibc's
    defaults, large blocks come from ``mmap`` and go back to the system when freed, and the
    top of the heap is trimmed, so every call page-faults its buffers in again: a cost that
    grows with the bytes a call allocates, not with the work it does. With both variables set
    (before the process starts: glibc reads them once) freed blocks stay in the heap for the
    next call. ``python -m benchmarks ... --malloc keep`` re-executes itself with them.
    """
    import os

    if all(os.environ.get(k) == v for k, v in KEEP_FREED_MEMORY.items()):
        return "keep"
    return "default"


def log(message: str) -> None:
    """Progress on stderr (stdout carries the tables)."""
    print(message, file=sys.stderr, flush=True)


def run_interleaved(
    cases: Sequence[Case],
    *,
    rounds: int,
    warmup: int = 2,
    seed: int = 0,
    clock: Callable[[], float] = time.perf_counter,
) -> list[list[float]]:
    """Time every case ``rounds`` times, one call per case per round, in shuffled order.

    Args:
      cases: what to time (each ``run`` blocks until its work is done).
      rounds: timed rounds.
      warmup: untimed calls of every case first (compilation, allocation, caches).
      seed: seed of the per-round order.
      clock: wall time by default; ``time.process_time`` counts the CPU time of this process
        only, steadier than wall time on a machine other jobs load (with XLA:CPU on one
        thread, ``XLA_FLAGS="--xla_cpu_multi_thread_eigen=false
        intra_op_parallelism_threads=1"``, it is the work of the step).

    Returns:
      Per case, its ``rounds`` times in seconds, in round order.
    """
    for _ in range(warmup):
        for case in cases:
            case.run()
    order = list(range(len(cases)))
    rng = random.Random(seed)
    times: list[list[float]] = [[] for _ in cases]
    step = max(1, rounds // 5)
    for k in range(rounds):
        rng.shuffle(order)
        for j in order:
            start = clock()
            cases[j].run()
            times[j].append(clock() - start)
        if (k + 1) % step == 0:
            log(f"  round {k + 1}/{rounds}")
    return times


def quartiles(values: Sequence[float]) -> tuple[float, float, float]:
    """(first quartile, median, third quartile); all three equal for a single value."""
    if len(values) < 2:
        v = float(values[0])
        return v, v, v
    q1, q2, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return q1, q2, q3


def summarize(cases: Sequence[Case], times: Sequence[Sequence[float]]) -> list[dict[str, Any]]:
    """One row per case: median and IQR of its times and of its per-round ratio to its baseline.

    The baseline of a case is the first case of its ``group`` (the first case overall when
    the group is None).
    """
    first: dict[str | None, int] = {}
    for i, case in enumerate(cases):
        first.setdefault(case.group, i)
    rows = []
    for case, t in zip(cases, times, strict=True):
        base_index = first[case.group]
        base = times[base_index]
        ratios = [a / b for a, b in zip(t, base, strict=True)]
        q1, med, q3 = quartiles(t)
        r1, rmed, r3 = quartiles(ratios)
        rows.append(
            {
                "label": case.label,
                "group": case.group,
                "baseline": cases[base_index].label,
                "rounds": len(t),
                "median_ms": 1e3 * med,
                "q1_ms": 1e3 * q1,
                "q3_ms": 1e3 * q3,
                "iqr_ms": 1e3 * (q3 - q1),
                "min_ms": 1e3 * min(t),
                "ratio": rmed,
                "ratio_q1": r1,
                "ratio_q3": r3,
                "ratio_of_medians": med / statistics.median(base),
                "times_ms": [1e3 * x for x in t],
                **case.info,
            }
        )
    return rows


def time_cases(
    cases: Sequence[Case],
    *,
    rounds: int,
    warmup: int = 2,
    seed: int = 0,
    clock: Callable[[], float] = time.perf_counter,
) -> list[dict[str, Any]]:
    """:func:`run_interleaved` then :func:`summarize`."""
    times = run_interleaved(cases, rounds=rounds, warmup=warmup, seed=seed, clock=clock)
    return summarize(cases, times)


# --------------------------------------------------------------------------------------------
# The environment.
# --------------------------------------------------------------------------------------------


def cpu_model() -> str:
    """The ``model name`` of /proc/cpuinfo (or what ``platform`` knows)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def load_average() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def _version(module: str) -> str | None:
    try:
        mod = __import__(module)
    except ImportError:
        return None
    return getattr(mod, "__version__", None)


def git_revision() -> str | None:
    """``git describe --always --dirty`` of the repository (None outside a checkout)."""
    import subprocess

    try:
        out = subprocess.run(
            ["git", "describe", "--always", "--dirty"],
            cwd=Path(__file__).resolve().parent,
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def environment() -> dict[str, Any]:
    """What the numbers depend on: machine, load, library versions, flags, revision."""
    import jaxlib

    device = jax.devices()[0]
    return {
        "date": datetime.date.today().isoformat(),
        "cpu": cpu_model(),
        "cpu_count": os.cpu_count(),
        "load_average": load_average(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "device": f"{device.platform}:{device.device_kind}",
        "device_count": jax.device_count(),
        "versions": {
            "jax": jax.__version__,
            "jaxlib": jaxlib.__version__,
            "optax": _version("optax"),
            "flax": _version("flax"),
            "jmp": _version("jmp"),
            "numpy": _version("numpy"),
            "jdls": _version("jdls"),
        },
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "malloc": malloc_mode(),
        "git": git_revision(),
        "command": " ".join(["python -m benchmarks", *sys.argv[1:]]),
    }


# --------------------------------------------------------------------------------------------
# Output.
# --------------------------------------------------------------------------------------------


def _cell(value: Any, spec: str) -> str:
    if value is None:
        return "–"
    if isinstance(value, float):
        return format(value, spec)
    return str(value)


def markdown_table(rows: Sequence[dict[str, Any]], columns: Sequence[tuple[str, str, str]]) -> str:
    """A Markdown table; ``columns`` are ``(key, header, format spec)``."""
    head = "| " + " | ".join(h for _, h, _ in columns) + " |"
    align = "|" + "|".join(":--" if i == 0 else "--:" for i in range(len(columns))) + "|"
    body = [
        "| " + " | ".join(_cell(row.get(k), spec) for k, _, spec in columns) + " |" for row in rows
    ]
    return "\n".join([head, align, *body])


#: The usual columns of a timing table.
TIME_COLUMNS = (
    ("label", "variant", ""),
    ("median_ms", "median ms", ".2f"),
    ("iqr_ms", "IQR ms", ".2f"),
    ("ratio", "ratio", ".3f"),
    ("ratio_iqr", "ratio IQR", ""),
)


def with_ratio_iqr(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Rows with a printable ``ratio_iqr`` column (``q1–q3``)."""
    out = []
    for row in rows:
        row = dict(row)
        if "ratio_q1" in row:
            row["ratio_iqr"] = f"{row['ratio_q1']:.3f}–{row['ratio_q3']:.3f}"
        out.append(row)
    return out


@dataclasses.dataclass
class Section:
    """One table of a suite's report."""

    title: str
    note: str
    rows: list[dict[str, Any]]
    columns: Sequence[tuple[str, str, str]] = TIME_COLUMNS
    config: dict[str, Any] = dataclasses.field(default_factory=dict)

    def markdown(self) -> str:
        parts = [f"### {self.title}", ""]
        if self.note:
            parts += [self.note, ""]
        parts.append(markdown_table(with_ratio_iqr(self.rows), self.columns))
        return "\n".join(parts)


def environment_markdown(env: dict[str, Any]) -> str:
    v = env["versions"]
    load = env.get("load_average")
    return (
        f"{env['date']}, {env['cpu']} ({env['cpu_count']} cores), {env['device']}; "
        f"jax {v['jax']}, jaxlib {v['jaxlib']}, optax {v['optax']}, flax {v['flax']}, "
        f"jmp {v['jmp']}; glibc malloc: {env.get('malloc', 'default')}; load average at start "
        f"{load}; command `{env['command']}`"
    )


def write_results(
    name: str,
    sections: Sequence[Section],
    *,
    out_dir: Path | str = RESULTS_DIR,
    env: dict[str, Any] | None = None,
    extra: dict[str, Any] | None = None,
) -> tuple[Path, Path]:
    """Write ``<out_dir>/<name>.json`` and ``<out_dir>/<name>.md``; returns both paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    env = dict(env or environment())
    env["load_average_end"] = load_average()
    payload = {
        "suite": name,
        "environment": env,
        "sections": [dataclasses.asdict(s) for s in sections],
        **(extra or {}),
    }
    json_path = out / f"{name}.json"
    json_path.write_text(json.dumps(payload, indent=1, default=_jsonable) + "\n")
    md = [f"## {name}", "", environment_markdown(env), ""]
    for s in sections:
        md += [s.markdown(), ""]
    md_path = out / f"{name}.md"
    md_path.write_text("\n".join(md))
    return json_path, md_path


def _jsonable(x: Any) -> Any:
    if hasattr(x, "tolist"):
        return x.tolist()
    if isinstance(x, tuple | set | frozenset):
        return list(x)
    return str(x)
