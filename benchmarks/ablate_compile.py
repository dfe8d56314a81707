"""Where the compile time of ``jdls.wrap(adam)`` goes: the update compiled with parts removed.

Each row compiles the update of the 8M-parameter, 64-leaf benchmark (traced afresh, rounds
interleaved, medians):

* ``adam`` and the minimal reference (sum of squares + ``lax.cond``), as in the compile suite;
* ``jdls.wrap(adam, StaticScale)``: without the dynamic scale rule;
* ``jdls.wrap(adam), exact-overflow branch removed``: ``jdls.wrap(adam)`` with the branch that
  handles a non-finite or overflowing sum of squares replaced by the ordinary one. This
  patches a private function of ``jdls/_clip.py`` for the measurement only; the row is left
  out when that function is not there.

Run::

    python -m benchmarks.ablate_compile [--rounds 7]
"""

from __future__ import annotations

import argparse
import contextlib
import random
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import optax

import jdls
from benchmarks import bench_update


@contextlib.contextmanager
def _without_exact_branch() -> Iterator[None]:
    import jdls._clip as clip_module

    original = clip_module._norm_branches

    def patched(*args: Any) -> Any:
        reduce, usual, _ = original(*args)
        return reduce, usual, usual

    clip_module._norm_branches = patched
    try:
        yield
    finally:
        clip_module._norm_branches = original


def _measure(make: Callable[[], Any], grads: Any, patch: bool) -> tuple[float, float]:
    updater = make()
    state = jax.eval_shape(updater.init, grads)

    def step(g: Any, s: Any, p: Any) -> tuple[Any, Any]:
        updates, s = updater.update(g, s, p)
        return s, updates

    jitted = jax.jit(lambda *a: step(*a), donate_argnums=(1,))
    with _without_exact_branch() if patch else contextlib.nullcontext():
        t0 = time.perf_counter()
        lowered = jitted.lower(grads, state, grads)
        t1 = time.perf_counter()
    lowered.compile()
    t2 = time.perf_counter()
    return t1 - t0, t2 - t1


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args(argv)
    import jdls._clip as clip_module

    config = bench_update.Config()
    grads = jax.tree_util.tree_map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), bench_update.make_tree(config)
    )
    adam = lambda: optax.adam(1e-3)  # noqa: E731
    rows: dict[str, tuple[Callable[[], Any], bool]] = {
        "adam": (lambda: bench_update.from_optax(adam()), False),
        bench_update.REFERENCE: (
            lambda: bench_update.from_optax(bench_update.minimal_skip(adam())),
            False,
        ),
        "jdls.wrap(adam)": (lambda: bench_update.from_optax(jdls.wrap(adam())), False),
        "jdls.wrap(adam, StaticScale)": (
            lambda: bench_update.from_optax(jdls.wrap(adam(), jdls.StaticScale(2.0**15))),
            False,
        ),
    }
    if hasattr(clip_module, "_norm_branches"):
        rows["jdls.wrap(adam), exact-overflow branch removed"] = (
            lambda: bench_update.from_optax(jdls.wrap(adam())),
            True,
        )
    times: dict[str, list[tuple[float, float]]] = {k: [] for k in rows}
    order = list(rows)
    rng = random.Random(0)
    for _ in range(args.rounds):
        rng.shuffle(order)
        for name in order:
            make, patch = rows[name]
            times[name].append(_measure(make, grads, patch))
    base = [a + b for a, b in times["adam"]]
    print(
        f"compile of the update, {config.n_params:,} parameters in {config.n_leaves} leaves, "
        f"{args.rounds} interleaved rounds (medians)"
    )
    print("| variant | trace+lower ms | compile ms | total / adam |")
    print("|:--|--:|--:|--:|")
    for name in rows:
        lo = statistics.median(a for a, _ in times[name])
        co = statistics.median(b for _, b in times[name])
        ratio = statistics.median((a + b) / c for (a, b), c in zip(times[name], base, strict=True))
        print(f"| {name} | {1e3 * lo:.0f} | {1e3 * co:.0f} | {ratio:.2f} |")


if __name__ == "__main__":
    main()
