"""Cost of one optimizer update, gradients given: ``jdls.wrap`` and its peers against ``adam``.

Only the update is timed: the gradients are given, every variant is jitted with its optimizer
state donated (``donate_argnums``, the same for every variant, so each moment can be updated
in place), and each call ends with ``block_until_ready``. The variants run interleaved (see
``benchmarks/_harness.py``); the report gives per variant the median time, its IQR, and the
median of its per-round ratio to ``adam``.

Run::

    python -m benchmarks update            # 8M float32 parameters in 64 leaves
    python -m benchmarks update-large      # 100M float32 parameters in 500 leaves
    python -m benchmarks update --quick    # tiny sizes, a few rounds (a smoke test)
    python -m benchmarks.bench_update      # the same as ``update``, standalone

Every variant sees the same gradients; a *skipped* case sees them with one inf in the middle
leaf, so that a dynamic-scaling variant skips every call.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import jmp
import numpy as np
import optax
from jax import lax

import jdls
from benchmarks import _harness as h


@dataclasses.dataclass(frozen=True)
class Config:
    """What to measure.

    Attributes:
      n_params: total number of float32 parameters.
      n_leaves: number of leaves they are split into (equal sizes).
      rounds: interleaved rounds (one timed call of every case per round).
      warmup: untimed calls of every case before timing.
      max_norm: the clipping limit (chosen so that clipping happens: the gradients are
        standard normal, their norm is about ``sqrt(n_params)``).
      seed: seed of the gradients.
    """

    n_params: int = 8 * 2**20
    n_leaves: int = 64
    rounds: int = 40
    warmup: int = 3
    max_norm: float = 1.0
    seed: int = 0


QUICK = Config(n_params=2**16, n_leaves=8, rounds=3, warmup=1)
LARGE = Config(n_params=100_000_000, n_leaves=500, rounds=15, warmup=2)


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


# --------------------------------------------------------------------------------------------
# Variants: an update function ``(grads, state, params) -> (updates, state)`` and its init.
# --------------------------------------------------------------------------------------------


class Updater(NamedTuple):
    """What a variant does after the gradients are known (``optax``-like)."""

    init: Callable[[Any], Any]
    update: Callable[[Any, Any, Any], tuple[Any, Any]]


def from_optax(tx: optax.GradientTransformation) -> Updater:
    return Updater(tx.init, tx.update)


def flax_pattern(inner: optax.GradientTransformation) -> Updater:
    """Flax's ``DynamicScale`` check and adjust, then ``jnp.where`` over the new and old state.

    ``flax.training.dynamic_scale.DynamicScale.value_and_grad`` tests ``jnp.all(isfinite(g))``
    leaf by leaf and adjusts its scale; the Flax documentation then selects the new or old
    optimizer state (and parameters) with ``jnp.where(is_fin, new, old)``. The gradients are
    given here, so the check and the adjustment are Flax's lines (flax 0.12,
    ``flax/training/dynamic_scale.py``) applied to them; the full-step benchmark calls
    ``DynamicScale.value_and_grad`` itself.
    """
    from flax.training.dynamic_scale import DynamicScale

    def init(params: Any) -> Any:
        return DynamicScale(), inner.init(params)

    def update(grads: Any, state: Any, params: Any) -> tuple[Any, Any]:
        scale, inner_state = state
        finite = jnp.array(True)
        for g in jax.tree_util.tree_leaves(grads):
            finite &= jnp.all(lax.is_finite(g))
        grow = scale.fin_steps == scale.growth_interval
        fin_scale = jnp.where(
            grow & finite,
            jnp.minimum(scale.scale * scale.growth_factor, jnp.finfo(jnp.float32).max),
            scale.scale,
        )
        inf_scale = jnp.maximum(scale.scale * scale.backoff_factor, scale.minimum_scale)
        scale = scale.replace(
            fin_steps=jnp.where(grow | (~finite), 0, scale.fin_steps + 1),
            scale=jnp.where(finite, fin_scale, inf_scale),
        )
        updates, new_inner = inner.update(grads, inner_state, params)
        select = functools.partial(jnp.where, finite)
        new_inner = jax.tree_util.tree_map(select, new_inner, inner_state)
        updates = jax.tree_util.tree_map(lambda u: jnp.where(finite, u, 0), updates)
        return updates, (scale, new_inner)

    return Updater(init, update)


def jmp_pattern(inner: optax.GradientTransformation) -> Updater:
    """jmp's documented pattern: ``all_finite``, ``adjust``, ``select_tree`` of the new state."""

    def init(params: Any) -> Any:
        return jmp.DynamicLossScale(jnp.asarray(2.0**15, jnp.float32)), inner.init(params)

    def update(grads: Any, state: Any, params: Any) -> tuple[Any, Any]:
        scale, inner_state = state
        finite = jmp.all_finite(grads)
        updates, new_inner = inner.update(grads, inner_state, params)
        new_inner = jmp.select_tree(finite, new_inner, inner_state)
        zeros = jax.tree_util.tree_map(jnp.zeros_like, updates)
        updates = jmp.select_tree(finite, updates, zeros)
        return updates, (scale.adjust(finite), new_inner)

    return Updater(init, update)


def minimal_skip(inner: optax.GradientTransformation) -> optax.GradientTransformation:
    """The least a skipping update can do: one sum of squares and a ``lax.cond``. A reference.

    No loss scale to adjust, no statistics, no exact overflow handling (a finite sum of
    squares that overflows float32 is skipped too), updates assumed shaped like the
    gradients. Its cost against ``adam`` is the floor for any design built on the same
    check; ``jdls.wrap`` adds the rest of a dynamic loss scale to it.
    """

    def update(grads: Any, state: Any, params: Any = None) -> tuple[Any, Any]:
        total = sum(jnp.sum(jnp.square(x)) for x in jax.tree_util.tree_leaves(grads))

        def take(ops: Any) -> Any:
            return inner.update(ops[0], ops[1], params)

        def skip(ops: Any) -> Any:
            return jax.tree_util.tree_map(lambda x: jnp.full_like(x, -0.0), ops[0]), ops[1]

        return lax.cond(jnp.isfinite(total), take, skip, (grads, state))

    return optax.GradientTransformation(inner.init, update)


REFERENCE = "reference: adam + sum of squares + lax.cond"


def make_variants(config: Config) -> dict[str, Callable[[], Updater]]:
    """The variants compared, by name (``adam`` is the baseline)."""

    def adam() -> optax.GradientTransformation:
        return optax.adam(1e-3)

    c = config.max_norm
    return {
        "adam": lambda: from_optax(adam()),
        "jdls.wrap(adam)": lambda: from_optax(jdls.wrap(adam())),
        "jdls.wrap(adam, select)": lambda: from_optax(jdls.wrap(adam(), skip_with="select")),
        "jdls.wrap(adam, track_nonfinite)": lambda: from_optax(
            jdls.wrap(adam(), track_nonfinite=True)
        ),
        "jdls.wrap(adam, max_norm)": lambda: from_optax(jdls.wrap(adam(), max_norm=c)),
        "jdls.wrap(adam, max_norm, select)": lambda: from_optax(
            jdls.wrap(adam(), max_norm=c, skip_with="select")
        ),
        "chain(jdls.clip, jdls.wrap(adam))": lambda: from_optax(
            optax.chain(jdls.clip(c), jdls.wrap(adam()))
        ),
        "jdls.wrap(chain(jdls.clip, adam))": lambda: from_optax(
            jdls.wrap(optax.chain(jdls.clip(c), adam()))
        ),
        "optax clip + adam": lambda: from_optax(optax.chain(optax.clip_by_global_norm(c), adam())),
        "optax.apply_if_finite(adam)": lambda: from_optax(optax.apply_if_finite(adam(), 10**6)),
        "optax clip + apply_if_finite": lambda: from_optax(
            optax.chain(optax.clip_by_global_norm(c), optax.apply_if_finite(adam(), 10**6))
        ),
        "Flax DynamicScale + jnp.where": lambda: flax_pattern(adam()),
        "jmp DynamicLossScale + select_tree": lambda: jmp_pattern(adam()),
        REFERENCE: lambda: from_optax(minimal_skip(adam())),
    }


#: Variants also timed on a skipped step (gradients holding an inf).
SKIPPED_VARIANTS = (
    "jdls.wrap(adam)",
    "jdls.wrap(adam, select)",
    "jdls.wrap(adam, track_nonfinite)",
    "jdls.wrap(adam, max_norm)",
    "chain(jdls.clip, jdls.wrap(adam))",
    "optax.apply_if_finite(adam)",
)

#: The variants of the large tree (each holds its own optimizer state: memory).
LARGE_VARIANTS = (
    "adam",
    REFERENCE,
    "jdls.wrap(adam)",
    "jdls.wrap(adam, max_norm)",
    "chain(jdls.clip, jdls.wrap(adam))",
    "optax clip + adam",
    "optax.apply_if_finite(adam)",
    "optax clip + apply_if_finite",
)
LARGE_SKIPPED = ("jdls.wrap(adam)",)


def compile_update(updater: Updater, grads: Any, params: Any) -> tuple[Callable[..., Any], Any]:
    """The jitted update (compiled on its first call), its state donated, and a fresh state."""

    def step(grads: Any, state: Any, params: Any) -> tuple[Any, Any]:
        updates, state = updater.update(grads, state, params)
        # State first: jit pairs donated inputs with outputs of the same shape in order, so
        # this lets each moment be updated in place (updates first would take its buffer).
        return state, updates

    return jax.jit(step, donate_argnums=(1,)), updater.init(params)


class _Runner:
    """One case: calls the compiled update on its own state, blocks until done."""

    def __init__(self, fn: Callable[..., Any], state: Any, grads: Any, params: Any) -> None:
        self.fn, self.state, self.grads, self.params = fn, state, grads, params
        h.settle(self, fn)

    def __call__(self) -> None:
        self.state, updates = self.fn(self.grads, self.state, self.params)
        jax.block_until_ready((self.state, updates))


def make_cases(
    config: Config, names: Sequence[str], skipped: Sequence[str]
) -> tuple[list[h.Case], dict[str, Any]]:
    """Cases for ``names`` on finite gradients and ``skipped`` on poisoned ones."""
    variants = make_variants(config)
    grads = make_tree(config)
    poisoned = make_tree(config, poison=True) if skipped else None
    params = jax.tree_util.tree_map(jnp.zeros_like, grads)
    cases = []
    compiled: dict[str, Callable[..., Any]] = {}  # taken and skipped cases share a compilation
    for label, name, g in [(n, n, grads) for n in names] + [
        (f"{n} [skipped step]", n, poisoned) for n in skipped
    ]:
        updater = variants[name]()
        fn, state = compile_update(updater, grads, params)
        fn = compiled.setdefault(name, fn)
        cases.append(h.Case(label, _Runner(fn, state, g, params)))
    return cases, {"grads": grads, "params": params}


def last_skipped(state: Any) -> bool | None:
    """Whether the last step of a jdls variant was skipped (None for other variants)."""
    try:
        return bool(jdls.stats(state).skipped)
    except ValueError:
        return None


def default_names(variants: dict[str, Any]) -> list[str]:
    return list(variants)


def run(config: Config, names: Sequence[str], skipped: Sequence[str], title: str) -> h.Section:
    """Time the update of ``names`` (and ``skipped`` on a skipped step); one section."""
    h.log(f"{title}: compiling {len(names) + len(skipped)} cases")
    cases, _ = make_cases(config, names, skipped)
    rows = h.time_cases(cases, rounds=config.rounds, warmup=config.warmup)
    for row, case in zip(rows, cases, strict=True):
        row["last_step_skipped"] = was = last_skipped(case.run.state)
        expected = row["label"].endswith("[skipped step]")
        if was is not None and was != expected:
            raise RuntimeError(f"{row['label']}: expected skipped={expected}, got {was}")
    mib = 4 * config.n_params / 2**20
    note = (
        f"Update only, {config.n_params:,} float32 parameters ({mib:,.0f} MiB) in "
        f"{config.n_leaves} leaves; optimizer state donated; {config.rounds} interleaved "
        "rounds; ratio = median of the per-round ratios to `adam` (IQR of those ratios "
        "beside it)."
    )
    return h.Section(title, note, rows, config=dataclasses.asdict(config))


def suite(quick: bool = False, rounds: int | None = None) -> list[h.Section]:
    """The ``update`` suite: 8M parameters in 64 leaves, every variant, skipped steps."""
    config = QUICK if quick else Config()
    if rounds is not None:
        config = dataclasses.replace(config, rounds=rounds)
    names = default_names(make_variants(config))
    return [run(config, names, SKIPPED_VARIANTS, "Update only, 8M parameters")]


def suite_large(quick: bool = False, rounds: int | None = None) -> list[h.Section]:
    """The ``update-large`` suite: 100M parameters in 500 leaves, the main variants."""
    config = dataclasses.replace(QUICK, n_leaves=50) if quick else LARGE
    if rounds is not None:
        config = dataclasses.replace(config, rounds=rounds)
    names = LARGE_VARIANTS[:2] if quick else LARGE_VARIANTS
    return [run(config, names, LARGE_SKIPPED, "Update only, 100M parameters")]


def main(argv: Sequence[str] | None = None) -> list[dict[str, Any]]:
    """Run the update benchmark alone; returns the result rows."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes, 3 rounds")
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--params", type=int, default=None, help="number of parameters")
    parser.add_argument("--leaves", type=int, default=None, help="number of leaves")
    parser.add_argument("--only", nargs="*", default=None, help="variant names to run")
    args = parser.parse_args(argv)
    config = QUICK if args.quick else Config()
    if args.rounds is not None:
        config = dataclasses.replace(config, rounds=args.rounds)
    if args.params is not None:
        config = dataclasses.replace(config, n_params=args.params)
    if args.leaves is not None:
        config = dataclasses.replace(config, n_leaves=args.leaves)
    names = default_names(make_variants(config))
    skipped: Sequence[str] = SKIPPED_VARIANTS
    if args.only:
        keep = set(args.only) | {"adam"}
        names = [n for n in names if n in keep]
        skipped = [n for n in skipped if n in keep]
    section = run(config, names, skipped, "Update only")
    print(section.markdown())
    return section.rows


if __name__ == "__main__":
    main()
