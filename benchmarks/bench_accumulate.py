"""Cost of ``jdls.accumulate``: a train step that accumulates micro-batches, against the same
step written as a plain ``lax.scan`` that sums the gradients without checking them.

The full train steps of ``bench_retry``'s MLP 512-1024-1024-1024-10 (batch 256 in 4
micro-batches of 64) and of ``bench_step``'s transformer (8 sequences in 4 micro-batches of
2), float16 compute, ``jdls.wrap(adam, DynamicScale(2**15))``, parameters and optimizer state
donated. Cases:

* ``plain lax.scan``: the baseline, ``scale.value_and_grad`` per micro-batch, the gradients
  and losses summed, divided by their number, ``tx.update``;
* ``jdls.accumulate``: the defaults (``retries=0, max_dropped=0``: a micro-batch that
  overflows skips the step);
* ``jdls.accumulate(max_dropped=1)``: a micro-batch that overflows is left out of the sum;
* ``jdls.accumulate(retries=2)``: a micro-batch that overflows is recomputed at a lower scale.

Every micro-batch is finite, so every case takes the step. Memory: the compiled temporary
bytes, and the difference to the baseline in float32 gradient buffers. Run::

    python -m benchmarks accumulate [--quick] [--rounds N]
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax import lax

import jdls
from benchmarks import _harness as h
from benchmarks import bench_retry, bench_step

MICRO = 4

COLUMNS = (
    *h.TIME_COLUMNS,
    ("temp_mib", "temp MiB", ".2f"),
    ("extra_grad_buffers", "Δtemp / gradient buffer", "+.2f"),
)


def _split(batch: Any) -> Any:
    """The batch as ``MICRO`` micro-batches (a scalar, such as the transformer's loss weight,
    repeated for each)."""

    def split(x: jax.Array) -> jax.Array:
        if not x.ndim:
            return jnp.broadcast_to(x, (MICRO,))
        return x.reshape(MICRO, x.shape[0] // MICRO, *x.shape[1:])

    return jax.tree_util.tree_map(split, batch)


def plain_step(loss: Callable[..., jax.Array], tx: Any) -> Callable[..., Any]:
    """A ``lax.scan`` that sums each micro-batch's loss and gradients, unchecked."""

    def step(params: Any, state: Any, micro_batches: Any) -> tuple[Any, Any, jax.Array]:
        scale = jdls.get_scale(state)

        def body(total: Any, batch: Any) -> tuple[Any, None]:
            value, grads = scale.value_and_grad(loss)(params, batch)
            return jax.tree_util.tree_map(jnp.add, total, (value, grads)), None

        zeros = jax.tree_util.tree_map(lambda p: jnp.zeros(p.shape, jnp.float32), params)
        (value, grads), _ = lax.scan(body, (jnp.float32(0), zeros), micro_batches)
        grads = jax.tree_util.tree_map(lambda g: g / MICRO, grads)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state, value / MICRO

    return step


def accumulate_step(loss: Callable[..., jax.Array], tx: Any, **options: Any) -> Callable[..., Any]:
    """``jdls.accumulate`` with ``options``, its scale put back, then ``tx.update``."""

    def step(params: Any, state: Any, micro_batches: Any) -> tuple[Any, Any, jax.Array]:
        scale = jdls.get_scale(state)
        value, grads, info = jdls.accumulate(loss, scale, params, micro_batches, **options)
        state = jdls.set_scale(state, info.scale)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state, value

    return step


def run(work: bench_step.Workload, *, rounds: int, warmup: int) -> h.Section:
    batch = _split(work.batch)
    specs = [
        ("plain lax.scan", None),
        ("jdls.accumulate", {}),
        ("jdls.accumulate(max_dropped=1)", {"max_dropped": 1}),
        ("jdls.accumulate(retries=2)", {"retries": 2}),
    ]
    h.log(f"{work.title}: compiling {len(specs)} cases")
    runners, temps = [], []
    for _, options in specs:
        tx = jdls.wrap(bench_step.adam(), jdls.DynamicScale(bench_step.SCALE))
        step = (
            plain_step(work.loss, tx)
            if options is None
            else accumulate_step(work.loss, tx, **options)
        )
        runner = bench_step.Runner(bench_step.Method(tx.init, step), work.params, batch)
        compiled = runner.fn.lower(runner.params, runner.state, runner.batch).compile()
        runners.append(runner)
        temps.append(compiled.memory_analysis().temp_size_in_bytes)
    grad_bytes = 4 * work.n_params
    cases = [
        h.Case(label, r, info=h.temp_info(temp, temps[0], grad_bytes))
        for (label, _), r, temp in zip(specs, runners, temps, strict=True)
    ]
    rows = h.time_cases(cases, rounds=rounds, warmup=warmup)
    for row, r in zip(rows, runners, strict=True):
        if bool(jdls.stats(r.state).skipped):
            raise RuntimeError(f"{row['label']}: the step was skipped")
    note = (
        f"{work.description}, in {MICRO} micro-batches; parameters and optimizer state "
        f"donated; {rounds} interleaved rounds of wall time; ratio = median of the per-round "
        "ratios to the plain `lax.scan`; Δtemp in units of one float32 gradient buffer "
        f"({grad_bytes / 2**20:.2f} MiB)."
    )
    config = {"workload": work.description, "micro_batches": MICRO, "rounds": rounds}
    title = f"Accumulation, {work.title[len('Full train step, ') :]}"
    return h.Section(title, note, rows, COLUMNS, config)


def suite(quick: bool = False, rounds: int | None = None) -> list[h.Section]:
    """The ``accumulate`` suite: the MLP 512-1024-1024-1024-10 and ``bench_step``'s
    transformer. ``quick``: the MLP at a tiny size, a smoke run of the code."""
    works = [(bench_retry.mlp_512_workload, 25), (bench_step.transformer_workload, 12)]
    return [
        run(make(quick), rounds=rounds or (3 if quick else full), warmup=1 if quick else 2)
        for make, full in (works[:1] if quick else works)
    ]
