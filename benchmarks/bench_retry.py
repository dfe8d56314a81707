"""Cost of retries: a finite step with ``retries=2`` and ``value_fn`` against the same step
without, a step that retries once against a normal step, and their compiled memory.

The full train step of ``bench_step`` (MLP and transformer, float16 compute, ``jdls.wrap(adam)``
at a scale of ``2**15``), with one scalar parameter added, ``probe``, that only an injected
outlier touches: the loss is ``model_loss + probe * c`` in float16, so with ``c = 3`` the
scaled gradient of ``probe`` (``3 * 2**15``) overflows float16 and at ``2**14`` it does not.
Every case starts each call from the scale ``2**15`` (set at the start of the step, the same
for every case), so a ``c = 3`` batch retries once on every call. Cases:

* ``jdls.wrap(adam)``: the baseline, ``c = 0``;
* ``retries=2 + value_fn, finite``: the same step with ``jdls.wrap(adam, retries=2)`` and
  ``tx.update(..., value_fn=f)``, ``c = 0`` (target: <= 1.01x);
* ``retries=2 + value_fn, retries once``: ``c = 3``: one extra forward and backward inside the
  step (target: <= 2.1x).

Memory: ``memory_analysis()`` of each compiled step (parameters and state donated): the
temporary bytes, and the difference to the baseline in units of one float32 gradient buffer
(target: at most one). Run::

    python -m benchmarks retries [--quick] [--rounds N]
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

import jdls
from benchmarks import _harness as h
from benchmarks import bench_step

SCALE = 2.0**15
OUTLIER = 3.0  # 3 * 2**15 overflows float16 (65504), 3 * 2**14 does not

COLUMNS = (
    *h.TIME_COLUMNS,
    ("temp_mib", "temp MiB", ".2f"),
    ("extra_grad_buffers", "Δtemp / gradient buffer", "+.2f"),
    ("retries", "retries", ""),
)


def with_probe(loss: Callable[..., jax.Array]) -> Callable[..., jax.Array]:
    """``loss(params, batch) + probe * c`` (float16), over ``{"model", "probe"}`` params and
    ``{"data", "c"}`` batches."""

    def probed(params: Any, batch: Any) -> jax.Array:
        probe = params["probe"].astype(jnp.float16) * batch["c"].astype(jnp.float16)
        return loss(params["model"], batch["data"]) + probe.astype(jnp.float32)

    return probed


def make_step(loss: Callable[..., jax.Array], tx: Any, retrying: bool) -> Callable[..., Any]:
    """``bench_step``'s jdls step, from the scale ``2**15`` on every call."""
    inner = bench_step.jdls_method(loss, tx, retrying).step

    def step(params: Any, state: Any, batch: Any) -> tuple[Any, Any, jax.Array]:
        return inner(params, jdls.set_scale(state, jdls.DynamicScale(SCALE)), batch)

    return step


def run(work: bench_step.Workload, *, rounds: int, warmup: int) -> h.Section:
    loss = with_probe(work.loss)
    params = {"model": work.params, "probe": jnp.zeros((), jnp.float32)}
    finite = {"data": work.batch, "c": jnp.float32(0.0)}
    outlier = {"data": work.batch, "c": jnp.float32(OUTLIER)}
    plain = jdls.wrap(bench_step.adam())
    retrying = jdls.wrap(bench_step.adam(), retries=2)
    specs = [
        ("jdls.wrap(adam)", plain, False, finite, 0),
        ("retries=2 + value_fn, finite", retrying, True, finite, 0),
        ("retries=2 + value_fn, retries once", retrying, True, outlier, 1),
    ]
    h.log(f"{work.title}: compiling {len(specs)} cases")
    runners = [
        bench_step.Runner(bench_step.Method(tx.init, make_step(loss, tx, r)), params, b)
        for _, tx, r, b, _ in specs
    ]
    grad_bytes = 4 * (work.n_params + 1)  # one float32 gradient buffer
    temps = [r.temp_bytes() for r in runners]
    cases = [
        h.Case(label, r, info=h.temp_info(temp, temps[0], grad_bytes))
        for (label, *_), r, temp in zip(specs, runners, temps, strict=True)
    ]
    rows = h.time_cases(cases, rounds=rounds, warmup=warmup)
    for row, r, spec in zip(rows, runners, specs, strict=True):
        stats = jdls.stats(r.state)
        row["retries"] = int(stats.retries)
        row["last_step_skipped"] = bool(stats.skipped)
        if row["retries"] != spec[4] or row["last_step_skipped"]:
            raise RuntimeError(f"{row['label']}: expected {spec[4]} retries and a taken step")
    note = (
        f"{work.description}, plus one scalar parameter (the outlier's probe); parameters and "
        f"optimizer state donated; {rounds} interleaved rounds; ratio = median of the "
        "per-round ratios to `jdls.wrap(adam)`; Δtemp in units of one float32 gradient "
        f"buffer ({grad_bytes / 2**20:.2f} MiB)."
    )
    config = {"workload": work.description, "n_params": work.n_params, "rounds": rounds}
    return h.Section(
        f"Retries, {work.title[len('Full train step, ') :]}", note, rows, COLUMNS, config
    )


def suite(quick: bool = False, rounds: int | None = None) -> list[h.Section]:
    """The ``retries`` suite: the MLP and the transformer of ``bench_step``."""
    return [
        run(
            bench_step.mlp_workload(quick),
            rounds=rounds or (3 if quick else 30),
            warmup=1 if quick else 2,
        ),
        run(
            bench_step.transformer_workload(quick),
            rounds=rounds or (3 if quick else 20),
            warmup=1 if quick else 2,
        ),
    ]
