"""Cost of retries: a finite step of ``jdls.retrying(loss, jdls.wrap(adam), retries=2)``
against the same step without retries, a step that retries once, compiled memory and copies.

The full train steps of ``bench_step`` (float16 compute, ``jdls.wrap(adam)`` at a scale of
``2**15``): the MLP 512-1024-1024-1024-10 at batch 256, the suite's MLP and its transformer,
each with one scalar parameter added, ``probe``, that only an injected outlier touches: the
loss is ``model_loss + probe * c`` in float16, so with ``c = 3`` the scaled gradient of
``probe`` (``3 * 2**15``) overflows float16 and at ``2**14`` it does not. Every case starts
each call from the scale ``2**15`` (set at the start of the step, the same for every case, as
a runtime value: a constant scale is folded into the step), so a ``c = 3`` batch retries once
on every call. Cases:

* ``jdls.wrap(adam)``: the baseline, the hand-written step (``get_scale``,
  ``scale.value_and_grad``, ``tx.update``, ``apply_updates``), ``c = 0``;
* ``retrying, finite``: ``jdls.retrying(loss, tx, retries=2)``, ``c = 0`` (target:
  <= 1.02x, goal 1.01x);
* an ablation, ``jdls.wrap(adam) + a separate check``: the step without retries that also
  decides ``jdls.all_finite(grads)``, what a retry loop deciding apart from the wrap would
  add (the loop decides from the wrap's own statistics instead);
* ``retrying, retries once``: ``c = 3``: one extra forward and backward inside the step.

Memory: ``memory_analysis()`` of each compiled step (parameters and state donated): the
temporary bytes, and the difference to the baseline in units of one float32 gradient buffer
(target: at most one); beside it the ``copy`` instructions of the compiled HLO module. Run::

    python -m benchmarks retries [--quick] [--rounds N]
    python -m benchmarks.bench_retry --compile [--rounds N]   # compile time, CPU time
    XLA_FLAGS="--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1" \
      python -m benchmarks.bench_retry --only mlp-512 --cpu-time   # steadier when loaded
"""

from __future__ import annotations

import argparse
import re
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax import lax

import jdls
from benchmarks import _harness as h
from benchmarks import _models as m
from benchmarks import bench_step

SCALE = 2.0**15
OUTLIER = 3.0  # 3 * 2**15 overflows float16 (65504), 3 * 2**14 does not

COLUMNS = (
    *h.TIME_COLUMNS,
    ("temp_mib", "temp MiB", ".2f"),
    ("extra_grad_buffers", "Δtemp / gradient buffer", "+.2f"),
    ("hlo_copies", "HLO copies", "d"),
    ("retries", "retries", ""),
)


def with_probe(loss: Callable[..., jax.Array]) -> Callable[..., jax.Array]:
    """``loss(params, batch) + probe * c`` (float16), over ``{"model", "probe"}`` params and
    ``{"data", "c"}`` batches."""

    def probed(params: Any, batch: Any) -> jax.Array:
        probe = params["probe"].astype(jnp.float16) * batch["c"].astype(jnp.float16)
        return loss(params["model"], batch["data"]) + probe.astype(jnp.float32)

    return probed


def make_step(
    loss: Callable[..., jax.Array], tx: Any, retries: int, check: bool = False
) -> Callable[..., Any]:
    """``bench_step``'s jdls step (``jdls.retrying`` with ``retries``), from the scale ``2**15``
    on every call; with ``check`` (and no retries), the step also decides
    ``jdls.all_finite(grads)`` apart from the wrap, and returns a NaN loss when false.

    The scale ``2**15`` enters the step as a runtime value (through
    ``lax.optimization_barrier``), as a scale read from the optimizer state does: a constant
    one is folded into the compiled step, which made the step without retries about 30%
    slower than with the scale of the state (and so hid the cost of retries)."""
    inner = bench_step.jdls_method(loss, tx, retries).step
    if check:
        if retries:
            raise ValueError("check only measures the step without retries")

        def inner(params: Any, state: Any, batch: Any) -> tuple[Any, Any, jax.Array]:
            scale = jdls.get_scale(state)
            value, grads = scale.value_and_grad(loss)(params, batch)
            value = jnp.where(jdls.all_finite(grads), value, jnp.nan)
            updates, state = tx.update(grads, state, params)
            return optax.apply_updates(params, updates), state, value

    def step(params: Any, state: Any, batch: Any) -> tuple[Any, Any, jax.Array]:
        scale = jax.tree_util.tree_map(lax.optimization_barrier, jdls.DynamicScale(SCALE))
        return inner(params, jdls.set_scale(state, scale), batch)

    return step


def compiled_facts(runner: bench_step.Runner) -> tuple[int, int]:
    """``(copy instructions, temporary bytes)`` of the compiled HLO module of ``runner``'s
    step, from one compilation."""
    compiled = runner.fn.lower(runner.params, runner.state, runner.batch).compile()
    copies = len(re.findall(r"\bcopy\(", compiled.as_text()))
    return copies, compiled.memory_analysis().temp_size_in_bytes


def mlp_512_workload(quick: bool) -> bench_step.Workload:
    """The MLP 512-1024-1024-1024-10 at batch 256 (float16 compute, Adam)."""
    config = (
        m.MLPConfig(widths=(32, 64, 64, 10), batch=16)
        if quick
        else m.MLPConfig(widths=(512, 1024, 1024, 1024, 10), batch=256)
    )
    return bench_step.mlp_workload_of(
        config, "mlp-512", "Full train step, MLP " + "-".join(map(str, config.widths))
    )


def run(
    work: bench_step.Workload,
    *,
    rounds: int,
    warmup: int,
    clock: Callable[[], float] = time.perf_counter,
    ablations: bool = True,
) -> h.Section:
    loss = with_probe(work.loss)
    params = {"model": work.params, "probe": jnp.zeros((), jnp.float32)}
    finite = {"data": work.batch, "c": jnp.float32(0.0)}
    outlier = {"data": work.batch, "c": jnp.float32(OUTLIER)}
    # (label, retries, variant, batch, expected retries); the variants: "" as shipped,
    # "check": the step without retries plus a separate finiteness check.
    specs = [
        ("jdls.wrap(adam)", 0, "", finite, 0),
        ("jdls.retrying(retries=2), finite", 2, "", finite, 0),
        ("ablation: jdls.wrap(adam) + a separate check", 0, "check", finite, 0),
        ("jdls.retrying(retries=2), retries once", 2, "", outlier, 1),
    ]
    if not ablations:  # --quick: the cases as shipped
        specs = [spec for spec in specs if spec[2] == ""]
    h.log(f"{work.title}: compiling {len(specs)} cases")
    runners, facts = [], []
    for _, retries, variant, batch, _ in specs:
        tx = jdls.wrap(bench_step.adam())
        step = make_step(loss, tx, retries, check=variant == "check")
        method = bench_step.Method(tx.init, step)
        runners.append(bench_step.Runner(method, params, batch))
        facts.append(compiled_facts(runners[-1]))
    grad_bytes = 4 * (work.n_params + 1)  # one float32 gradient buffer
    base = facts[0][1]
    cases = [
        h.Case(label, r, info={**h.temp_info(temp, base, grad_bytes), "hlo_copies": copies})
        for (label, *_), r, (copies, temp) in zip(specs, runners, facts, strict=True)
    ]
    rows = h.time_cases(cases, rounds=rounds, warmup=warmup, clock=clock)
    for row, r, spec in zip(rows, runners, specs, strict=True):
        stats = jdls.stats(r.state)
        row["retries"] = int(stats.retries)
        row["last_step_skipped"] = bool(stats.skipped)
        if row["retries"] != spec[4] or row["last_step_skipped"]:
            raise RuntimeError(f"{row['label']}: expected {spec[4]} retries and a taken step")
    note = (
        f"{work.description}, plus one scalar parameter (the outlier's probe); parameters and "
        f"optimizer state donated; {rounds} interleaved rounds of "
        f"{'CPU time (time.process_time)' if clock is time.process_time else 'wall time'}; "
        "ratio = median of the "
        "per-round ratios to `jdls.wrap(adam)`; Δtemp in units of one float32 gradient "
        f"buffer ({grad_bytes / 2**20:.2f} MiB); HLO copies: `copy` instructions in the "
        "compiled module."
    )
    config = {
        "workload": work.description,
        "n_params": work.n_params,
        "rounds": rounds,
        "clock": getattr(clock, "__name__", str(clock)),
    }
    return h.Section(
        f"Retries, {work.title[len('Full train step, ') :]}", note, rows, COLUMNS, config
    )


def compile_run(work: bench_step.Workload, *, rounds: int, warmup: int = 1) -> h.Section:
    """Compile time of ``jdls.retrying(retries=2)`` against the step without retries:
    process CPU time of trace, lowering and compilation of a fresh ``jax.jit`` each round
    (parameters and state donated), the persistent compilation cache off, interleaved
    rounds, medians of per-round ratios."""
    loss = with_probe(work.loss)
    params = {"model": work.params, "probe": jnp.zeros((), jnp.float32)}
    batch = {"data": work.batch, "c": jnp.float32(0.0)}
    tx = jdls.wrap(bench_step.adam())
    state = tx.init(params)

    def compiles(retries: int) -> Callable[[], Any]:
        def run() -> Any:
            step: Any = jax.jit(jdls.retrying(loss, tx, retries=retries), donate_argnums=(0, 1))
            return step.lower(params, state, batch).compile()

        return run

    cases = [
        h.Case("without retries", compiles(0)),
        h.Case("jdls.retrying(retries=2)", compiles(2)),
    ]
    cache = jax.config.jax_enable_compilation_cache  # type: ignore[attr-defined]
    jax.config.update("jax_enable_compilation_cache", False)
    try:
        rows = h.time_cases(cases, rounds=rounds, warmup=warmup, clock=time.process_time)
    finally:
        jax.config.update("jax_enable_compilation_cache", cache)
    note = (
        f"{work.description}, plus the outlier's probe; process CPU time of trace + lower + "
        f"compile of a fresh jit, {rounds} interleaved rounds; ratio = median of the "
        "per-round ratios to the step without retries."
    )
    title = f"Retries, compile time, {work.title[len('Full train step, ') :]}"
    return h.Section(title, note, rows, h.TIME_COLUMNS, {"rounds": rounds})


def suite(quick: bool = False, rounds: int | None = None) -> list[h.Section]:
    """The ``retries`` suite: the MLP 512-1024-1024-1024-10, and the MLP and the transformer
    of ``bench_step``. ``quick``: the first workload at a tiny size, the cases as shipped
    (no ablations): a smoke run of the code, not a measurement."""
    works = [
        (mlp_512_workload, 25),
        (bench_step.mlp_workload, 20),
        (bench_step.transformer_workload, 12),
    ]
    return [
        run(
            make(quick),
            rounds=rounds or (3 if quick else full_rounds),
            warmup=1 if quick else 2,
            ablations=not quick,
        )
        for make, full_rounds in (works[:1] if quick else works)
    ]


def main(argv: Sequence[str] | None = None) -> None:
    """``python -m benchmarks.bench_retry [--only mlp-512|mlp|transformer] [--rounds N]
    [--cpu-time]``: one or all workloads of the suite, printed as Markdown."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=["mlp-512", "mlp", "transformer"])
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument(
        "--cpu-time",
        action="store_true",
        help="time.process_time instead of wall time (steadier on a loaded machine; run "
        "XLA:CPU on one thread for it to be the work of the step)",
    )
    parser.add_argument(
        "--compile",
        action="store_true",
        help="compile time (process CPU time) instead of step time, 5 rounds by default",
    )
    args = parser.parse_args(argv)
    print(h.environment_markdown(h.environment()), flush=True)
    works = {
        "mlp-512": (mlp_512_workload, 25),
        "mlp": (bench_step.mlp_workload, 20),
        "transformer": (bench_step.transformer_workload, 12),
    }
    clock = time.process_time if args.cpu_time else time.perf_counter
    for name, (make, rounds) in works.items():
        if args.only not in (None, name):
            continue
        if args.compile:
            print(compile_run(make(args.quick), rounds=args.rounds or 5).markdown(), flush=True)
            continue
        section = run(
            make(args.quick),
            rounds=args.rounds or (3 if args.quick else rounds),
            warmup=1 if args.quick else 2,
            clock=clock,
            ablations=not args.quick,
        )
        print(section.markdown(), flush=True)


if __name__ == "__main__":
    main()
