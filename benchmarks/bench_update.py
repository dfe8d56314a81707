"""Cost of one optimizer update: ``jdls.wrap`` and friends against ``optax.adam`` alone.

Only the update is timed: the gradients are given, every variant is jitted with its optimizer
state donated, and each call ends with ``block_until_ready``. The variants run interleaved, one
call each per round, so that a change of machine load hits all of them alike; the report gives
per variant the median time and the median of its per-round ratio to ``adam``.

Run::

    python -m benchmarks.bench_update            # 8M float32 parameters in 64 leaves
    python -m benchmarks.bench_update --quick    # 1M parameters, fewer rounds (a smoke test)

Reuse (issue 6 builds on this): ``Config``, ``make_variants``, ``time_variants`` and
``format_table`` are public; ``main(argv)`` returns the result rows.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jdls


@dataclasses.dataclass(frozen=True)
class Config:
    """What to measure.

    Attributes:
      n_params: total number of float32 parameters.
      n_leaves: number of leaves they are split into (equal sizes).
      rounds: interleaved rounds (one timed call of every variant per round).
      warmup: untimed calls of every variant before timing.
      max_norm: the clipping limit (chosen so that clipping happens: the gradients are
        standard normal, their norm is about ``sqrt(n_params)``).
      seed: seed of the gradients.
    """

    n_params: int = 8 * 2**20
    n_leaves: int = 64
    rounds: int = 30
    warmup: int = 3
    max_norm: float = 1.0
    seed: int = 0


def make_tree(config: Config, *, poison: bool = False) -> dict[str, jax.Array]:
    """A dict of ``n_leaves`` float32 leaves holding ``n_params`` standard normal values.

    With ``poison``, one element of the middle leaf is inf (a step that will be skipped).
    """
    rng = np.random.default_rng(config.seed)
    size = config.n_params // config.n_leaves
    tree = {}
    for i in range(config.n_leaves):
        leaf = rng.standard_normal(size, dtype=np.float32)
        if poison and i == config.n_leaves // 2:
            leaf[size // 2] = np.inf
        tree[f"leaf_{i:03d}"] = jnp.asarray(leaf)
    return tree


def make_variants(config: Config) -> dict[str, Callable[[], optax.GradientTransformation]]:
    """The transformations compared, by name (``adam`` is the baseline)."""

    def adam() -> optax.GradientTransformation:
        return optax.adam(1e-3)

    c = config.max_norm
    return {
        "adam": adam,
        "jdls.wrap(adam)": lambda: jdls.wrap(adam()),
        "jdls.wrap(adam, select)": lambda: jdls.wrap(adam(), skip_with="select"),
        "jdls.wrap(adam, track_nonfinite)": lambda: jdls.wrap(adam(), track_nonfinite=True),
        "jdls.wrap(adam, max_norm)": lambda: jdls.wrap(adam(), max_norm=c),
        "jdls.wrap(adam, max_norm, select)": lambda: jdls.wrap(
            adam(), max_norm=c, skip_with="select"
        ),
        "chain(jdls.clip, jdls.wrap(adam))": lambda: optax.chain(jdls.clip(c), jdls.wrap(adam())),
        "optax clip + adam": lambda: optax.chain(optax.clip_by_global_norm(c), adam()),
        "optax.apply_if_finite(adam)": lambda: optax.apply_if_finite(adam(), 10**6),
        "optax clip + apply_if_finite": lambda: optax.chain(
            optax.clip_by_global_norm(c), optax.apply_if_finite(adam(), 10**6)
        ),
    }


#: Variants also timed on a skipped step (gradients holding an inf).
SKIPPED_VARIANTS = (
    "jdls.wrap(adam)",
    "jdls.wrap(adam, select)",
    "jdls.wrap(adam, max_norm)",
    "jdls.wrap(adam, track_nonfinite)",
)


def _compile(tx: optax.GradientTransformation, params: Any) -> tuple[Callable[..., Any], Any]:
    def step(grads: Any, state: Any, params: Any) -> tuple[Any, Any]:
        updates, state = tx.update(grads, state, params)
        # State first: jit pairs donated inputs with outputs of the same shape in order, so
        # this lets each moment be updated in place (updates first would steal its buffer).
        return state, updates

    return jax.jit(step, donate_argnums=(1,)), tx.init(params)


def time_variants(
    config: Config,
    variants: dict[str, Callable[[], optax.GradientTransformation]],
    cases: Sequence[tuple[str, str, bool]],
    *,
    log: Callable[[str], None] = lambda _: None,
) -> list[dict[str, Any]]:
    """Time ``cases`` interleaved.

    Args:
      config: sizes and repeats.
      variants: transformation factories by name.
      cases: ``(label, variant name, poisoned)``; the first is the baseline of the ratios.
      log: progress messages.

    Returns:
      One row per case: ``label``, ``median_ms``, ``ratio`` (median of per-round ratios to
      the baseline) and ``ratio_of_medians``.
    """
    grads = make_tree(config)
    poisoned = make_tree(config, poison=True)
    params = jax.tree_util.tree_map(jnp.zeros_like, grads)
    runners = []
    for label, name, poison in cases:
        fn, state = _compile(variants[name](), params)
        g = poisoned if poison else grads
        runners.append([label, fn, state, g])
    log(f"compiling and warming up {len(runners)} cases")
    for r in runners:
        for _ in range(config.warmup):
            r[2], out = r[1](r[3], r[2], params)
            jax.block_until_ready((out, r[2]))
    times: list[list[float]] = [[] for _ in runners]
    for k in range(config.rounds):
        for j, r in enumerate(runners):
            start = time.perf_counter()
            r[2], out = r[1](r[3], r[2], params)
            jax.block_until_ready((out, r[2]))
            times[j].append(time.perf_counter() - start)
        if (k + 1) % 10 == 0:
            log(f"round {k + 1}/{config.rounds}")
    base = times[0]
    rows = []
    for (label, _, _), t in zip(cases, times, strict=True):
        rows.append(
            {
                "label": label,
                "median_ms": 1e3 * statistics.median(t),
                "ratio": statistics.median(a / b for a, b in zip(t, base, strict=True)),
                "ratio_of_medians": statistics.median(t) / statistics.median(base),
            }
        )
    return rows


def default_cases(variants: dict[str, Any]) -> list[tuple[str, str, bool]]:
    """Every variant on a finite step, then the skipped-step variants on a poisoned one."""
    cases = [(name, name, False) for name in variants]
    cases += [(f"{name} [skipped step]", name, True) for name in SKIPPED_VARIANTS]
    return cases


def format_table(rows: Sequence[dict[str, Any]], config: Config) -> str:
    """A plain-text table of ``rows``."""
    width = max(len(r["label"]) for r in rows)
    lines = [
        f"update only, {config.n_params:,} float32 parameters in {config.n_leaves} leaves, "
        f"{config.rounds} interleaved rounds; ratio = median of per-round ratios to adam",
        f"{'variant':<{width}}  {'median ms':>9}  {'ratio':>6}",
    ]
    for r in rows:
        lines.append(f"{r['label']:<{width}}  {r['median_ms']:9.2f}  {r['ratio']:6.2f}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> list[dict[str, Any]]:
    """Run the benchmark from the command line; returns the result rows."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="1M parameters, 8 rounds")
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--params", type=int, default=None, help="number of parameters")
    parser.add_argument("--leaves", type=int, default=None, help="number of leaves")
    parser.add_argument("--only", nargs="*", default=None, help="variant names to run")
    parser.add_argument("--json", default=None, help="also write the rows to this file")
    args = parser.parse_args(argv)
    config = Config(n_params=2**20, rounds=8, warmup=2) if args.quick else Config()
    if args.rounds is not None:
        config = dataclasses.replace(config, rounds=args.rounds)
    if args.params is not None:
        config = dataclasses.replace(config, n_params=args.params)
    if args.leaves is not None:
        config = dataclasses.replace(config, n_leaves=args.leaves)
    variants = make_variants(config)
    cases = default_cases(variants)
    if args.only:
        keep = set(args.only) | {"adam"}
        cases = [c for c in cases if c[1] in keep]
    print(f"jax {jax.__version__}, optax {optax.__version__}, {jax.devices()[0].device_kind}")
    rows = time_variants(config, variants, cases, log=lambda m: print(m, file=sys.stderr))
    print(format_table(rows, config))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"config": dataclasses.asdict(config), "rows": rows}, f, indent=2)
    return rows


if __name__ == "__main__":
    main()
