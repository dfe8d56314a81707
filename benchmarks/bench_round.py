"""Cost of FloatFormat.round versus a native float16 round trip, measured in the same run.

Usage::

    python -m benchmarks.bench_round [--n 16777216] [--repeats 21] [--hlo]

Every function is jitted and compiled before timing; the timed calls are interleaved
(round, native, round, native, ...) so that machine load affects both alike, and the median
over the repeats is reported. The figure of merit is ``ratio`` = median(cbfloat16.round) /
median(x.astype(float16).astype(float32)).
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp

import jdls


def _time(fn: Callable[[jax.Array], jax.Array], x: jax.Array) -> float:
    start = time.perf_counter()
    fn(x).block_until_ready()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=1 << 24, help="number of float32 elements")
    parser.add_argument("--repeats", type=int, default=21)
    parser.add_argument("--hlo", action="store_true", help="print the optimised HLO of round")
    args = parser.parse_args()

    x = jax.random.normal(jax.random.key(0), (args.n,), jnp.float32) * 1e3
    cases: dict[str, Callable[[jax.Array], jax.Array]] = {
        "cbfloat16.round": jax.jit(jdls.cbfloat16.round),
        "FloatFormat(5, 10).round": jax.jit(jdls.FloatFormat(5, 10).round),
        "cbfloat16.to_bits": jax.jit(jdls.cbfloat16.to_bits),
        "native f32->f16->f32": jax.jit(lambda v: v.astype(jnp.float16).astype(jnp.float32)),
        "native f32->bf16->f32": jax.jit(lambda v: v.astype(jnp.bfloat16).astype(jnp.float32)),
    }
    if args.hlo:
        print(jax.jit(jdls.cbfloat16.round).lower(x).compile().as_text())
    for fn in cases.values():  # compile and warm up
        fn(x).block_until_ready()
        fn(x).block_until_ready()

    times: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(args.repeats):
        for name, fn in cases.items():
            times[name].append(_time(fn, x))

    medians = {name: statistics.median(t) for name, t in times.items()}
    base = medians["native f32->f16->f32"]
    print(
        f"jax {jax.__version__}, {jax.devices()[0].platform}, {platform.processor() or '?'}, "
        f"n={args.n}, repeats={args.repeats} (median)"
    )
    print(f"{'case':28s} {'median ms':>10s} {'vs f16 round trip':>18s}")
    for name, t in medians.items():
        print(f"{name:28s} {t * 1e3:10.2f} {t / base:17.2f}x")
    print(
        f"ratio cbfloat16.round / native f16 round trip = {medians['cbfloat16.round'] / base:.2f}"
    )


if __name__ == "__main__":
    main()
