"""Achieved memory bandwidth of the update against streaming kernels on the same bytes.

An optimizer update is memory bound: ``adam`` reads the gradients and both moments and writes
the updates and both moments, 24 bytes per float32 parameter at the least. ``jdls.wrap``
must also read the gradients once to decide whether they are finite (the sum of squares that
also gives the global norm): 28 bytes. The physical limit of the wrap is therefore
``28 / 24 = 1.167`` times ``adam``'s minimum traffic, whatever the implementation.

This suite times, interleaved in the same rounds and on the same leaves:

* two streaming kernels that XLA runs at the machine's practical bandwidth:
  ``x <- a * x + b`` in place (donated; 8 bytes per element) and ``sum(x)`` (4 bytes);
* ``adam`` and the jdls and optax variants, as in the update benchmark.

and reports, per variant, the minimum bytes it must move, the achieved GB/s (minimum bytes /
median time), that bandwidth as a fraction of the streaming copy's, and the time the variant
would take at the streaming bandwidth (its roofline). Run::

    python -m benchmarks roofline [--quick]
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from benchmarks import _harness as h
from benchmarks import bench_update

#: Minimum bytes per float32 parameter: reads and writes that no implementation can avoid.
MIN_BYTES = {
    "adam": (24, "read g, mu, nu; write updates, mu, nu"),
    "jdls.wrap(adam)": (28, "adam + one read of g (sum of squares: finiteness and norm)"),
    "jdls.wrap(adam, max_norm)": (28, "the same norm decides and clips: adam + one read of g"),
    "optax clip + adam": (28, "adam + one read of g (global norm); clipping fused"),
    "optax.apply_if_finite(adam)": (28, "adam + one read of g (isfinite)"),
    "chain(jdls.clip, jdls.wrap(adam))": (32, "adam + two reads of g (clip's norm, wrap's)"),
    "jdls.wrap(chain(jdls.clip, adam))": (32, "adam + wrap's read of g + clip's, in the branch"),
    bench_update.REFERENCE: (28, "adam + one read of g"),
}

VARIANTS = tuple(MIN_BYTES)


class _Stream:
    """``x <- a * x + b`` on every leaf, in place (donated): 8 bytes per element."""

    def __init__(self, tree: Any) -> None:
        self.tree = jax.tree_util.tree_map(jnp.copy, tree)
        self.fn = jax.jit(
            lambda t: jax.tree_util.tree_map(lambda x: x * 0.999 + 0.001, t), donate_argnums=0
        )
        h.settle(self, self.fn)

    def __call__(self) -> None:
        self.tree = self.fn(self.tree)
        jax.block_until_ready(self.tree)


class _Read:
    """``sum(x)`` of every leaf: 4 bytes per element read, nothing written."""

    def __init__(self, tree: Any) -> None:
        self.tree = tree
        self.fn = jax.jit(lambda t: [jnp.sum(x) for x in jax.tree_util.tree_leaves(t)])
        h.settle(self, self.fn)

    def __call__(self) -> None:
        jax.block_until_ready(self.fn(self.tree))


def run(config: bench_update.Config, title: str, variants: tuple[str, ...] = VARIANTS) -> h.Section:
    h.log(f"{title}: compiling")
    cases, data = bench_update.make_cases(config, variants, ())
    grads = data["grads"]
    n = config.n_params
    stream = h.Case("streaming x <- a*x + b (in place)", _Stream(grads))
    read = h.Case("streaming sum(x) (read only)", _Read(grads))
    rows = h.time_cases([stream, read, *cases], rounds=config.rounds, warmup=config.warmup)
    stream_s = rows[0]["median_ms"] / 1e3
    stream_gbs = 8 * n / stream_s / 1e9
    for row in rows:
        t = row["median_ms"] / 1e3
        if row["label"].startswith("streaming x"):
            row["min_bytes_per_param"], row["bytes_note"] = 8, "read x, write x"
        elif row["label"].startswith("streaming sum"):
            row["min_bytes_per_param"], row["bytes_note"] = 4, "read x"
        else:
            row["min_bytes_per_param"], row["bytes_note"] = MIN_BYTES[row["label"]]
        moved = row["min_bytes_per_param"] * n
        row["min_bytes"] = moved
        row["gb_per_s"] = moved / t / 1e9
        row["fraction_of_stream"] = row["gb_per_s"] / stream_gbs
        row["roofline_ms"] = 1e3 * moved / (stream_gbs * 1e9)
        row["time_over_roofline"] = t / (moved / (stream_gbs * 1e9))
    adam = next(r for r in rows if r["label"] == "adam")
    for row in rows:
        # Median of the per-round ratios, as everywhere else (the timed cases share rounds).
        per_round = [a / b for a, b in zip(row["times_ms"], adam["times_ms"], strict=True)]
        row["ratio_to_adam"] = h.quartiles(per_round)[1]
        row["bound_ratio_to_adam"] = row["min_bytes_per_param"] / 24
    note = (
        f"{n:,} float32 parameters in {config.n_leaves} leaves, {config.rounds} interleaved "
        "rounds. Minimum bytes: what the variant must read and write (4 bytes per access of "
        "a float32 parameter). GB/s = minimum bytes / median time; roofline = minimum bytes "
        "at the bandwidth of the in-place streaming kernel measured in the same rounds."
    )
    columns = (
        ("label", "kernel", ""),
        ("min_bytes_per_param", "min bytes/param", ""),
        ("median_ms", "median ms", ".2f"),
        ("gb_per_s", "GB/s", ".1f"),
        ("fraction_of_stream", "of stream", ".2f"),
        ("roofline_ms", "roofline ms", ".2f"),
        ("time_over_roofline", "time / roofline", ".2f"),
        ("ratio_to_adam", "time / adam (per-round median)", ".3f"),
        ("bound_ratio_to_adam", "bound / adam", ".3f"),
    )
    return h.Section(title, note, rows, columns=columns, config=dataclasses.asdict(config))


def suite(quick: bool = False, rounds: int | None = None) -> list[h.Section]:
    """The ``roofline`` suite: 8M parameters in 64 leaves, and 100M in 500 when not quick."""
    configs = (
        [(bench_update.QUICK, "Roofline, update only (quick)")]
        if quick
        else [
            (bench_update.Config(rounds=30), "Roofline, update only, 8M parameters"),
            (bench_update.LARGE, "Roofline, update only, 100M parameters"),
        ]
    )
    sections = []
    for config, title in configs:
        if rounds is not None:
            config = dataclasses.replace(config, rounds=rounds)
        sections.append(run(config, title, VARIANTS[:2] if quick else VARIANTS))
    return sections
