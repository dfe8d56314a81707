"""Compiled memory and compile time, with and without jdls, for the full step and the update.

For every variant of the full-step (MLP) and update-only (8M parameters) benchmarks:

* **memory**: ``jax.jit(...).lower(...).compile().memory_analysis()``: the temporary bytes
  XLA needs besides the arguments and outputs (``temp``), and the whole footprint
  ``arguments + outputs - aliased + temp`` (donated buffers are aliased);
* **compile time**: tracing and lowering (``.lower``, Python) and XLA compilation
  (``.compile``), each variant traced afresh in every round (a new function object, so no
  cache is hit), rounds interleaved as for the timings; medians and per-round ratios to the
  baseline.

Every function is jitted over the flattened leaves of its arguments (the same for every
variant), with the same buffers donated as in the timing benchmarks. Run::

    python -m benchmarks compile [--quick]
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import jax

from benchmarks import _harness as h
from benchmarks import bench_step, bench_update

MiB = 2**20


def _flat(
    fn: Callable[..., Any], args: tuple[Any, ...], donate: Sequence[int]
) -> tuple[Callable[..., Any], list[Any], tuple[int, ...]]:
    """``fn`` as a function of the flat leaves of ``args``; donated leaf indices."""
    leaves, treedef = jax.tree_util.tree_flatten(args)
    donated: list[int] = []
    start = 0
    for i, a in enumerate(args):
        n = len(jax.tree_util.tree_leaves(a))
        if i in donate:
            donated.extend(range(start, start + n))
        start += n

    def flat(*xs: Any) -> list[Any]:
        return jax.tree_util.tree_leaves(fn(*jax.tree_util.tree_unflatten(treedef, xs)))

    return flat, leaves, tuple(donated)


class _Target:
    """One variant to compile: a factory of fresh ``(fn, args, donate)``."""

    def __init__(self, label: str, make: Callable[[], tuple[Callable[..., Any], tuple, tuple]]):
        self.label = label
        self.make = make
        self.lower_s: list[float] = []
        self.compile_s: list[float] = []
        self.cpu_s: list[float] = []  # process CPU time of trace+lower+compile
        self.memory: Any = None
        self.counts: dict[str, int] = {}

    def once(self) -> None:
        fn, args, donate = self.make()
        flat, leaves, donated = _flat(fn, args, donate)
        # A new function object every time: no cache of this program can answer. Functions
        # that keep their traces (jax.numpy's, jdls's rule and norm) reuse them after the
        # first round, as in a user's process that compiles a second step.
        jitted = jax.jit(lambda *xs: flat(*xs), donate_argnums=donated)
        c0 = time.process_time()
        t0 = time.perf_counter()
        lowered = jitted.lower(*leaves)
        t1 = time.perf_counter()
        compiled = lowered.compile()
        t2 = time.perf_counter()
        self.cpu_s.append(time.process_time() - c0)
        self.lower_s.append(t1 - t0)
        self.compile_s.append(t2 - t1)
        self.memory = compiled.memory_analysis()
        if not self.counts:
            from benchmarks.profile_ops import hlo_counts

            self.counts = hlo_counts(compiled.as_text())


def _step_targets(quick: bool, names: Sequence[str]) -> list[_Target]:
    work = bench_step.mlp_workload(quick)
    methods = bench_step.make_methods(work.loss)
    targets = []
    for name in names:

        def make(name: str = name) -> tuple[Callable[..., Any], tuple, tuple]:
            method = methods[name]()
            return method.step, (work.params, method.init(work.params), work.batch), (0, 1)

        targets.append(_Target(name, make))
    return targets


def _update_targets(quick: bool, names: Sequence[str]) -> list[_Target]:
    config = bench_update.QUICK if quick else bench_update.Config()
    variants = bench_update.make_variants(config)
    grads = jax.tree_util.tree_map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), bench_update.make_tree(config)
    )
    targets = []
    for name in names:

        def make(name: str = name) -> tuple[Callable[..., Any], tuple, tuple]:
            updater = variants[name]()

            def step(g: Any, state: Any, params: Any) -> tuple[Any, Any]:
                updates, state = updater.update(g, state, params)
                return state, updates

            state = jax.eval_shape(updater.init, grads)
            return step, (grads, state, grads), (1,)

        targets.append(_Target(name, make))
    return targets


STEP_VARIANTS = (
    "static scale",
    "jdls.wrap(adam)",
    "jdls.wrap(adam, select)",
    "jdls.wrap(adam, max_norm)",
    "chain(jdls.clip, jdls.wrap(adam))",
    "static scale + optax clip",
    "Flax DynamicScale + jnp.where",
    "jmp DynamicLossScale + select_tree",
    "static scale + optax.apply_if_finite",
    bench_step.REFERENCE,
)
UPDATE_VARIANTS = (
    "adam",
    "jdls.wrap(adam)",
    "jdls.wrap(adam, select)",
    "jdls.wrap(adam, max_norm)",
    "chain(jdls.clip, jdls.wrap(adam))",
    "optax clip + adam",
    "Flax DynamicScale + jnp.where",
    "jmp DynamicLossScale + select_tree",
    "optax.apply_if_finite(adam)",
    "optax clip + apply_if_finite",
    bench_update.REFERENCE,
)

COLUMNS = (
    ("label", "variant", ""),
    ("temp_mib", "temp MiB", ".2f"),
    ("temp_delta_pct_of_footprint", "Δtemp % of baseline footprint", "+.2f"),
    ("footprint_mib", "footprint MiB", ".1f"),
    ("kernels", "kernels", ""),
    ("lower_ms", "trace+lower ms", ".0f"),
    ("compile_ms", "compile ms", ".0f"),
    ("compile_ratio", "compile ratio", ".3f"),
    ("total_ratio", "lower+compile ratio", ".3f"),
    ("cpu_ms", "CPU ms", ".0f"),
    ("cpu_ratio", "CPU ratio", ".3f"),
)


def _measure(title: str, note: str, targets: list[_Target], rounds: int) -> h.Section:
    h.log(f"{title}: {len(targets)} variants, {rounds} rounds")
    order = list(range(len(targets)))
    import random

    rng = random.Random(0)
    for _ in range(rounds):
        rng.shuffle(order)
        for j in order:
            targets[j].once()
    base = targets[0]
    base_mem = base.memory
    base_footprint = (
        base_mem.argument_size_in_bytes
        + base_mem.output_size_in_bytes
        - base_mem.alias_size_in_bytes
        + base_mem.temp_size_in_bytes
    )
    rows = []
    for t in targets:
        mem = t.memory
        footprint = (
            mem.argument_size_in_bytes
            + mem.output_size_in_bytes
            - mem.alias_size_in_bytes
            + mem.temp_size_in_bytes
        )
        c_ratios = [a / b for a, b in zip(t.compile_s, base.compile_s, strict=True)]
        tot = [a + b for a, b in zip(t.lower_s, t.compile_s, strict=True)]
        base_tot = [a + b for a, b in zip(base.lower_s, base.compile_s, strict=True)]
        rows.append(
            {
                "label": t.label,
                "temp_bytes": mem.temp_size_in_bytes,
                "temp_mib": mem.temp_size_in_bytes / MiB,
                "temp_ratio": mem.temp_size_in_bytes / max(base_mem.temp_size_in_bytes, 1),
                "temp_delta_pct_of_footprint": 100
                * (mem.temp_size_in_bytes - base_mem.temp_size_in_bytes)
                / base_footprint,
                "argument_bytes": mem.argument_size_in_bytes,
                "output_bytes": mem.output_size_in_bytes,
                "alias_bytes": mem.alias_size_in_bytes,
                "footprint_bytes": footprint,
                "footprint_mib": footprint / MiB,
                "lower_ms": 1e3 * h.quartiles(t.lower_s)[1],
                "compile_ms": 1e3 * h.quartiles(t.compile_s)[1],
                "compile_ratio": h.quartiles(c_ratios)[1],
                "total_ratio": h.quartiles([a / b for a, b in zip(tot, base_tot, strict=True)])[1],
                "cpu_ms": 1e3 * h.quartiles(t.cpu_s)[1],
                "cpu_ratio": h.quartiles([a / b for a, b in zip(t.cpu_s, base.cpu_s, strict=True)])[
                    1
                ],
                "cpu_s": t.cpu_s,
                "kernels": t.counts.get("fusions", 0)
                + t.counts.get("copies", 0)
                + t.counts.get("dots", 0),
                **{f"hlo_{k}": v for k, v in t.counts.items()},
                "lower_s": t.lower_s,
                "compile_s": t.compile_s,
            }
        )
    return h.Section(title, note, rows, columns=COLUMNS, config={"rounds": rounds})


def _norm_forms(quick: bool, rounds: int) -> h.Section:
    """The sum of squares per leaf (what jdls and optax compile) against one kernel over all
    leaves (fewer kernels to compile, but XLA's own reduction loop instead of the vectorized
    one): compile time and run time, on the update benchmark's gradients."""
    import jax.numpy as jnp

    config = bench_update.QUICK if quick else bench_update.Config()
    leaves = jax.tree_util.tree_leaves(bench_update.make_tree(config))
    forms = {
        "per leaf: sum(sum(g**2) for g in leaves)": lambda ls: sum(
            jnp.sum(jnp.square(x)) for x in ls
        ),
        "one kernel: sum(concatenate(leaves)**2)": lambda ls: jnp.sum(
            jnp.square(jnp.concatenate([x.ravel() for x in ls]))
        ),
    }
    compile_s: dict[str, list[float]] = {k: [] for k in forms}
    compiled: dict[str, Any] = {}
    for _ in range(rounds):
        for name, f in forms.items():
            jitted = jax.jit(lambda ls, f=f: f(ls))
            t0 = time.perf_counter()
            compiled[name] = jitted.lower(leaves).compile()
            compile_s[name].append(time.perf_counter() - t0)
    cases = [
        h.Case(name, lambda c=c: jax.block_until_ready(c(leaves))) for name, c in compiled.items()
    ]
    rows = h.time_cases(cases, rounds=max(rounds * 3, 3), warmup=1)
    from benchmarks.profile_ops import hlo_counts

    for row in rows:
        row["compile_ms"] = 1e3 * h.quartiles(compile_s[row["label"]])[1]
        counts = hlo_counts(compiled[row["label"]].as_text())
        row["kernels"] = counts["fusions"] + counts["copies"] + counts["dots"]
    note = (
        f"The global sum of squares of {config.n_params:,} float32 values in {config.n_leaves} "
        "leaves: lower+compile time (median of the rounds) and run time (median of interleaved "
        "rounds, ratio to the per-leaf form)."
    )
    columns = (
        ("label", "form", ""),
        ("kernels", "kernels", ""),
        ("compile_ms", "lower+compile ms", ".0f"),
        ("median_ms", "run ms", ".2f"),
        ("ratio", "run ratio", ".2f"),
    )
    return h.Section("Sum of squares: per leaf or one kernel", note, rows, columns=columns)


def suite(quick: bool = False, rounds: int | None = None) -> list[h.Section]:
    """The ``compile`` suite: memory and compile time of the full step and of the update."""
    rounds = rounds or (1 if quick else 7)
    note = (
        "`temp`: XLA's temporary buffers (`memory_analysis().temp_size_in_bytes`); footprint = "
        f"arguments + outputs − aliased (donated) + temp. Compile times: medians of {rounds} "
        "interleaved rounds, each variant traced afresh; ratios are medians of per-round "
        "ratios to the first row. CPU ms: the process CPU time of trace+lower+compile "
        "(steadier than wall time on a shared machine)."
    )
    step_names = STEP_VARIANTS[:2] if quick else STEP_VARIANTS
    update_names = UPDATE_VARIANTS[:2] if quick else UPDATE_VARIANTS
    step = _measure(
        "Compiled memory and compile time, full step (MLP)",
        note,
        _step_targets(quick, step_names),
        rounds,
    )
    update = _measure(
        "Compiled memory and compile time, update only (8M parameters)",
        note,
        _update_targets(quick, update_names),
        rounds,
    )
    return [step, update, _norm_forms(quick, rounds)]


LEAF_COUNTS = (64, 500, 5000)
LEAF_VARIANTS = ("adam", bench_update.REFERENCE, "jdls.wrap(adam)", "jdls.wrap(adam, max_norm)")


def _leaf_row(n_leaves: int, n_params: int, names: Sequence[str], rounds: int) -> list[dict]:
    """Compile times of the update of ``n_params`` float32 parameters in ``n_leaves`` leaves."""
    config = bench_update.Config(n_params=n_params, n_leaves=n_leaves)
    variants = bench_update.make_variants(config)
    size = n_params // n_leaves
    grads = {f"leaf_{i:05d}": jax.ShapeDtypeStruct((size,), "float32") for i in range(n_leaves)}
    wall: dict[str, list[float]] = {n: [] for n in names}
    cpu: dict[str, list[float]] = {n: [] for n in names}
    kernels: dict[str, int] = {}
    import random

    from benchmarks.profile_ops import hlo_counts

    order = list(names)
    rng = random.Random(0)
    for _ in range(rounds):
        rng.shuffle(order)
        for name in order:
            updater = variants[name]()
            state = jax.eval_shape(updater.init, grads)

            def step(g: Any, s: Any, p: Any, u: Any = updater) -> tuple[Any, Any]:
                updates, s = u.update(g, s, p)
                return s, updates

            jitted = jax.jit(lambda *a, f=step: f(*a), donate_argnums=(1,))
            t0, c0 = time.perf_counter(), time.process_time()
            compiled = jitted.lower(grads, state, grads).compile()
            wall[name].append(time.perf_counter() - t0)
            cpu[name].append(time.process_time() - c0)
            if name not in kernels:
                c = hlo_counts(compiled.as_text())
                kernels[name] = c["fusions"] + c["copies"] + c["dots"]
    base_wall = h.quartiles(wall[names[0]])[1]
    base_cpu = h.quartiles(cpu[names[0]])[1]
    ref_cpu = h.quartiles(cpu[bench_update.REFERENCE])[1] - base_cpu
    rows = []
    for name in names:
        w, c = h.quartiles(wall[name])[1], h.quartiles(cpu[name])[1]
        rows.append(
            {
                "label": f"{name}, {n_leaves} leaves",
                "n_leaves": n_leaves,
                "variant": name,
                "kernels": kernels[name],
                "wall_ms": 1e3 * w,
                "cpu_ms": 1e3 * c,
                "added_cpu_ms": 1e3 * (c - base_cpu),
                "added_wall_ms": 1e3 * (w - base_wall),
                "added_over_reference": (c - base_cpu) / ref_cpu if ref_cpu > 0 else float("nan"),
                "wall_s": wall[name],
                "cpu_s": cpu[name],
            }
        )
    return rows


def suite_leaves(quick: bool = False, rounds: int | None = None) -> list[h.Section]:
    """The ``compile-leaves`` suite: compile time of the update against the number of leaves
    (64, 500, 5,000) at a fixed total size, and what each design adds to ``adam``'s."""
    rounds = rounds or (1 if quick else 3)
    n_params = 2**14 if quick else 2**20
    counts = (8, 64) if quick else LEAF_COUNTS
    rows: list[dict] = []
    for n in counts:
        r = 1 if n >= 5000 else rounds  # XLA:CPU takes minutes per variant at 5,000 leaves
        h.log(f"compile-leaves: {n} leaves, {r} rounds")
        rows += _leaf_row(n, n_params, LEAF_VARIANTS, r)
    note = (
        f"Update only, {n_params:,} float32 parameters split into equal leaves; trace+lower+"
        f"compile, medians of {rounds} interleaved rounds (one at 5,000 leaves), in process CPU time (steadier than "
        "wall time on a shared machine) and wall time. *added* = the variant's time minus "
        "`adam`'s at the same leaf count; *added / reference* divides that by what the minimal "
        "reference adds."
    )
    columns = (
        ("label", "variant", ""),
        ("kernels", "kernels", ""),
        ("cpu_ms", "CPU ms", ".0f"),
        ("wall_ms", "wall ms", ".0f"),
        ("added_cpu_ms", "added CPU ms", ".0f"),
        ("added_over_reference", "added / reference", ".2f"),
    )
    return [h.Section("Compile time against the number of leaves", note, rows, columns=columns)]
