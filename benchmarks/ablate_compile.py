"""Where the compile time of ``jdls.wrap(adam)`` goes: the update compiled with parts removed.

Each row compiles the update of the 8M-parameter, 64-leaf benchmark (traced afresh, rounds
interleaved, medians). Every row is built from jdls's public API or written here:

* ``adam`` and the minimal reference (sum of squares + ``lax.cond``), as in the compile suite;
* ``jdls.wrap(adam, StaticScale)``: ``jdls.wrap`` without the dynamic scale rule;
* ``DynamicScale + sum of squares + lax.cond``: written here, :func:`without_exact_pass`:
  the reference plus a ``jdls.DynamicScale`` adjusted by the check, that is ``jdls.wrap(adam)``
  without the pass that tells an inf from an overflowing sum of squares (and without the
  statistics): a finite sum decides, as in the reference;
* ``jdls.wrap(adam)``;
* ``jdls.wrap(adam, DynamicScale())`` (the classic rule) and ``optax.apply_if_finite(adam)``;
* ``jdls.wrap(adam)`` with the default's measurement ablated (:func:`no_measurement`): no
  ``max(abs)`` per leaf, a constant instead: what the measurement adds to the default's rule;
* ``jdls.wrap(adam, DynamicScale())`` and ``jdls.wrap(adam, StaticScale)`` with the
  exact-overflow pass taken out (the default has none: its largest magnitude decides
  finiteness with the sum): jdls's own code, with the
  ``lax.cond`` branch that handles a non-finite sum exactly
  (``jdls._numerics.norm._branches``' ``careful``) replaced by the ordinary branch while they compile
  (:func:`no_exact_pass`; an inf then still skips, an overflowing finite sum is taken with a
  wrong norm: for this measurement only).

Times are process CPU time (steadier than wall time on a shared machine).

Run::

    python -m benchmarks.ablate_compile [--rounds 7] [--leaves 200]

(``--leaves N``: the same 8M parameters in N leaves.)
"""

from __future__ import annotations

import argparse
import contextlib
import random
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax import lax

import jdls
from benchmarks import bench_update

WITHOUT_EXACT_PASS = "DynamicScale + sum of squares + lax.cond"
CLASSIC = "jdls.wrap(adam, DynamicScale())"
APPLY_IF_FINITE = "optax.apply_if_finite(adam)"
NO_AMAX = "jdls.wrap(adam), no measurement (a constant)"


@contextlib.contextmanager
def no_measurement() -> Any:
    """While active, the default's measurement (``jdls._numerics.norm._largest``, one ``max(abs)`` per
    leaf) compiles as a constant: a measurement aid, never for training."""
    from jdls._numerics import norm as _norm

    original = _norm._largest

    def constant(xs: Any) -> Any:
        return jnp.float32(1.0)

    _norm._largest = constant  # type: ignore[assignment]
    try:
        yield
    finally:
        _norm._largest = original


NO_EXACT_CLASSIC = "jdls.wrap(adam, DynamicScale()) without the exact pass"
NO_EXACT_STATIC = "jdls.wrap(adam, StaticScale) without the exact pass"


@contextlib.contextmanager
def no_exact_pass() -> Any:
    """While active, ``jdls.wrap`` compiles without its exact-overflow branch (a measurement
    aid: never for training)."""
    from jdls._numerics import norm as _norm

    original = _norm._branches

    def branches(axis_name: Any, is_sharded: Any, largest: bool) -> Any:
        reduce, usual, _ = original.__wrapped__(axis_name, is_sharded, largest)
        return reduce, usual, usual

    _norm._branches = branches  # type: ignore[assignment]
    try:
        yield
    finally:
        _norm._branches = original


def without_exact_pass(inner: optax.GradientTransformation) -> bench_update.Updater:
    """``jdls.wrap(inner)`` less its exact-overflow pass and statistics, from public pieces.

    One sum of squares decides (a finite gradient whose squares overflow float32 counts as
    an overflow, where ``jdls.wrap`` would take the step); the inner update runs in a
    ``lax.cond``; the scale is adjusted with ``jdls.DynamicScale.adjust``.
    """

    def init(params: Any) -> Any:
        return jdls.DynamicScale(), inner.init(params)

    def update(grads: Any, state: Any, params: Any = None) -> tuple[Any, Any]:
        scale, inner_state = state
        total = sum(jnp.sum(jnp.square(x)) for x in jax.tree_util.tree_leaves(grads))
        finite = jnp.isfinite(total)

        def take(ops: Any) -> Any:
            return inner.update(ops[0], ops[1], params)

        def skip(ops: Any) -> Any:
            return jax.tree_util.tree_map(lambda x: jnp.full_like(x, -0.0), ops[0]), ops[1]

        updates, inner_state = lax.cond(finite, take, skip, (grads, inner_state))
        return updates, (scale.adjust(finite), inner_state)

    return bench_update.Updater(init, update)


def _measure(make: Callable[[], Any], grads: Any) -> tuple[float, float]:
    updater = make()
    state = jax.eval_shape(updater.init, grads)

    def step(g: Any, s: Any, p: Any) -> tuple[Any, Any]:
        updates, s = updater.update(g, s, p)
        return s, updates

    jitted = jax.jit(lambda *a: step(*a), donate_argnums=(1,))
    t0 = time.process_time()
    lowered = jitted.lower(grads, state, grads)
    t1 = time.process_time()
    lowered.compile()
    t2 = time.process_time()
    return t1 - t0, t2 - t1


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--leaves", type=int, default=None, help="number of leaves")
    args = parser.parse_args(argv)

    config = bench_update.Config()
    if args.leaves:
        config = bench_update.Config(n_params=config.n_params, n_leaves=args.leaves)
    grads = jax.tree_util.tree_map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), bench_update.make_tree(config)
    )
    adam = lambda: optax.adam(1e-3)  # noqa: E731
    rows: dict[str, Callable[[], Any]] = {
        "adam": lambda: bench_update.from_optax(adam()),
        bench_update.REFERENCE: lambda: bench_update.from_optax(bench_update.minimal_skip(adam())),
        "jdls.wrap(adam, StaticScale)": lambda: bench_update.from_optax(
            jdls.wrap(adam(), jdls.StaticScale(2.0**15))
        ),
        WITHOUT_EXACT_PASS: lambda: without_exact_pass(adam()),
        "jdls.wrap(adam)": lambda: bench_update.from_optax(jdls.wrap(adam())),
        CLASSIC: lambda: bench_update.from_optax(jdls.wrap(adam(), jdls.DynamicScale())),
        APPLY_IF_FINITE: lambda: bench_update.from_optax(optax.apply_if_finite(adam(), 10**6)),
        NO_AMAX: lambda: bench_update.from_optax(jdls.wrap(adam())),
        NO_EXACT_CLASSIC: lambda: bench_update.from_optax(jdls.wrap(adam(), jdls.DynamicScale())),
        NO_EXACT_STATIC: lambda: bench_update.from_optax(
            jdls.wrap(adam(), jdls.StaticScale(2.0**15))
        ),
    }
    times: dict[str, list[tuple[float, float]]] = {k: [] for k in rows}
    order = list(rows)
    rng = random.Random(0)
    for _ in range(args.rounds):
        rng.shuffle(order)
        for name in order:
            patch: Any = None
            if name in (NO_EXACT_CLASSIC, NO_EXACT_STATIC):
                patch = no_exact_pass()
            elif name == NO_AMAX:
                patch = no_measurement()
            with patch or contextlib.nullcontext():
                times[name].append(_measure(rows[name], grads))
    base = [a + b for a, b in times["adam"]]
    print(
        f"compile of the update, {config.n_params:,} parameters in {config.n_leaves} leaves, "
        f"{args.rounds} interleaved rounds (medians of process CPU time)"
    )
    print(
        "| variant | trace+lower ms | compile ms | total / adam | total / reference "
        "| total / apply_if_finite |"
    )
    print("|:--|--:|--:|--:|--:|--:|")
    ref = [a + b for a, b in times[bench_update.REFERENCE]]
    peer = [a + b for a, b in times[APPLY_IF_FINITE]]
    for name in rows:
        lo = statistics.median(a for a, _ in times[name])
        co = statistics.median(b for _, b in times[name])
        ratio = statistics.median((a + b) / c for (a, b), c in zip(times[name], base, strict=True))
        to_ref = statistics.median((a + b) / c for (a, b), c in zip(times[name], ref, strict=True))
        to_peer = statistics.median(
            (a + b) / c for (a, b), c in zip(times[name], peer, strict=True)
        )
        print(
            f"| {name} | {1e3 * lo:.0f} | {1e3 * co:.0f} | {ratio:.2f} | {to_ref:.2f} "
            f"| {to_peer:.2f} |"
        )


if __name__ == "__main__":
    main()
