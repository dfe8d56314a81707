"""Scaling quality: rules x tasks, trained side by side from the same start on the same batches.

Rules: the default rules of PyTorch (``presets.pytorch()``), Flax (``presets.flax()``), jmp
(``presets.jmp(2**15)``) and Cerebras (``presets.cerebras()``), ``jdls.AdaptiveScale()``, no
scaling (``jdls.NoOpScale()`` in float16) and float32 (no scaling, float32 compute). Every
float16 run computes its forward and backward passes in float16 on float32 master weights
(Flax layers with ``dtype=float16``), with ``jdls.wrap(optax.adam(...))`` and
``jdls.linen.TrainState``; a whole run is one ``lax.scan``.

Tasks:

* ``mlp``: the digits MLP of ``examples/demo.py`` (64-256-256-10), loss weight ``5e-6``;
* ``transformer``: a small character-level transformer on the source of ``textwrap``, the
  loss multiplied by ``1e4`` every 100th step (injected loss spikes); metric: the float32
  cross-entropy on held-out text;
* ``cnn``: a small CNN with BatchNorm on the digits (``apply_gradients(..., batch_stats=)``);
* ``multitask``: one MLP trunk, two heads: the digit (weight 1) and its parity (weight
  ``1e-4``); metric: the parity head's accuracy.

Metrics per run: the final metric, skipped steps (first 1,000 and overall), the step after
which the scale stays within one binade of its final value (the median of the last tenth of
the run), and the fraction of gradient signal flushed to zero: every ``PROBE_EVERY`` steps
the float32 gradient at the same parameters and batch is computed, and the fraction of its
L1 mass that sits where the run's gradient is exactly zero is recorded (mean over those
steps). A timing section compares a full step with the adaptive rule against PyTorch's.

Run::

    python -m benchmarks quality           # a few minutes on 2 cores
    python -m benchmarks quality --quick   # a smoke test: 3 rules, 40 steps
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import math
import textwrap
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

import jdls
from benchmarks import _harness as h

F16, F32 = jnp.float16, jnp.float32
PROBE_EVERY = 20
SPIKE_EVERY, SPIKE_FACTOR = 100, 1e4


# --------------------------------------------------------------------------------------------
# Rules.
# --------------------------------------------------------------------------------------------


def rules(quick: bool) -> dict[str, tuple[Callable[[], jdls.LossScale], Any]]:
    """Name -> (scale factory, compute dtype)."""
    table: dict[str, tuple[Callable[[], jdls.LossScale], Any]] = {
        "PyTorch": (jdls.presets.pytorch, F16),
        "Flax": (jdls.presets.flax, F16),
        "jmp": (lambda: jdls.presets.jmp(2.0**15), F16),
        "Cerebras": (jdls.presets.cerebras, F16),
        "AdaptiveScale": (jdls.AdaptiveScale, F16),
        "no scaling (f16)": (jdls.NoOpScale, F16),
        "float32": (jdls.NoOpScale, F32),
    }
    if quick:
        return {k: table[k] for k in ("PyTorch", "AdaptiveScale", "float32")}
    return table


# --------------------------------------------------------------------------------------------
# Data and models.
# --------------------------------------------------------------------------------------------


@functools.cache
def digits() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    d = load_digits()
    x = (d.data / 16.0).astype(np.float32)
    y = d.target.astype(np.int32)
    return tuple(train_test_split(x, y, test_size=0.3, random_state=0, stratify=y))  # type: ignore[return-value]


class MLP(nn.Module):
    dtype: Any
    hidden: int = 256
    heads: tuple[int, ...] = (10,)

    @nn.compact
    def __call__(self, x: jax.Array, train: bool = True) -> Any:
        x = x.astype(self.dtype)
        for _ in range(2):
            x = nn.relu(nn.Dense(self.hidden, dtype=self.dtype)(x))
        outs = tuple(nn.Dense(n, dtype=self.dtype)(x).astype(F32) for n in self.heads)
        return outs if len(outs) > 1 else outs[0]


class CNN(nn.Module):
    dtype: Any

    @nn.compact
    def __call__(self, x: jax.Array, train: bool = True) -> jax.Array:
        x = x.reshape(-1, 8, 8, 1).astype(self.dtype)
        for features, stride in ((16, 1), (32, 2)):
            x = nn.Conv(features, (3, 3), strides=stride, dtype=self.dtype)(x)
            x = nn.BatchNorm(use_running_average=not train, dtype=self.dtype)(x)
            x = nn.relu(x)
        return nn.Dense(10, dtype=self.dtype)(x.mean(axis=(1, 2))).astype(F32)


class Block(nn.Module):
    dtype: Any
    dim: int
    heads: int

    @nn.compact
    def __call__(self, x: jax.Array, mask: jax.Array) -> jax.Array:
        y = nn.LayerNorm(dtype=F32)(x).astype(self.dtype)
        x = x + nn.MultiHeadDotProductAttention(self.heads, dtype=self.dtype)(y, y, mask=mask)
        y = nn.LayerNorm(dtype=F32)(x).astype(self.dtype)
        y = nn.Dense(self.dim, dtype=self.dtype)(
            nn.gelu(nn.Dense(4 * self.dim, dtype=self.dtype)(y))
        )
        return x + y


class CharLM(nn.Module):
    dtype: Any
    vocab: int
    dim: int = 64
    heads: int = 4
    depth: int = 2

    @nn.compact
    def __call__(self, tokens: jax.Array, train: bool = True) -> jax.Array:
        seq = tokens.shape[-1]
        x = nn.Embed(self.vocab, self.dim, dtype=self.dtype)(tokens)
        pos = self.param("pos", nn.initializers.normal(0.02), (seq, self.dim))
        x = (x + pos.astype(self.dtype)).astype(self.dtype)
        mask = nn.make_causal_mask(tokens)
        for _ in range(self.depth):
            x = Block(self.dtype, self.dim, self.heads)(x, mask)
        x = nn.LayerNorm(dtype=F32)(x).astype(self.dtype)
        return nn.Dense(self.vocab, dtype=self.dtype)(x).astype(F32)


# --------------------------------------------------------------------------------------------
# Tasks.
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Task:
    """One training problem.

    ``loss(model, variables, batch, step, train)`` returns ``(loss, new_batch_stats)``;
    ``evaluate(model, variables)`` the final metric (higher is better unless ``lower``).
    """

    name: str
    description: str
    steps: int
    make_model: Callable[[Any], nn.Module]
    sample: jax.Array
    batches: dict[str, np.ndarray]  # per step
    loss: Callable[..., tuple[jax.Array, Any]]
    evaluate: Callable[[nn.Module, Any], jax.Array]
    metric: str
    lower: bool = False
    learning_rate: float = 1e-3


def _batches(n: int, batch: int, steps: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    per = n // batch
    order = [rng.permutation(n)[: per * batch] for _ in range(math.ceil(steps / per))]
    return np.concatenate(order).reshape(-1, batch)[:steps].astype(np.int32)


def _accuracy(logits: jax.Array, y: jax.Array) -> jax.Array:
    return jnp.mean(jnp.argmax(logits, -1) == y)


def task_mlp(steps: int) -> Task:
    xtr, xte, ytr, yte = (jnp.asarray(a) for a in digits())
    weight = 5e-6

    def loss(model, variables, idx, step, train):
        logits = model.apply(variables, xtr[idx])
        ce = optax.softmax_cross_entropy_with_integer_labels(logits, ytr[idx]).mean()
        return weight * ce, {}

    return Task(
        "mlp",
        "digits MLP 64-256-256-10, batch 256, loss weight 5e-6 (the demo's)",
        steps,
        lambda dt: MLP(dt),
        xtr[:1],
        {"idx": _batches(len(xtr), 256, steps)},
        loss,
        lambda model, v: _accuracy(model.apply(v, xte), yte),
        "test accuracy",
    )


def task_multitask(steps: int) -> Task:
    xtr, xte, ytr, yte = (jnp.asarray(a) for a in digits())

    def loss(model, variables, idx, step, train):
        digit, parity = model.apply(variables, xtr[idx])
        y = ytr[idx]
        a = optax.softmax_cross_entropy_with_integer_labels(digit, y).mean()
        b = optax.softmax_cross_entropy_with_integer_labels(parity, y % 2).mean()
        return a + 1e-4 * b, {}

    return Task(
        "multitask",
        "digits MLP trunk, heads digit (weight 1) and parity (weight 1e-4), batch 256",
        steps,
        lambda dt: MLP(dt, hidden=128, heads=(10, 2)),
        xtr[:1],
        {"idx": _batches(len(xtr), 256, steps)},
        loss,
        lambda model, v: _accuracy(model.apply(v, xte)[1], yte % 2),
        "parity-head accuracy",
    )


def task_cnn(steps: int) -> Task:
    xtr, xte, ytr, yte = (jnp.asarray(a) for a in digits())

    def loss(model, variables, idx, step, train):
        logits, updated = model.apply(variables, xtr[idx], mutable=["batch_stats"])
        ce = optax.softmax_cross_entropy_with_integer_labels(logits, ytr[idx]).mean()
        return ce, updated["batch_stats"]

    return Task(
        "cnn",
        "digits CNN (2 conv + BatchNorm), batch 128",
        steps,
        lambda dt: CNN(dt),
        xtr[:2],
        {"idx": _batches(len(xtr), 128, steps)},
        loss,
        lambda model, v: _accuracy(model.apply(v, xte, train=False), yte),
        "test accuracy",
    )


def task_transformer(steps: int, quick: bool) -> Task:
    text = inspect.getsource(textwrap)
    chars = sorted(set(text))
    data = np.array([chars.index(c) for c in text], np.int32)
    split = int(0.9 * len(data))
    seq, batch = (16, 8) if quick else (64, 32)
    rng = np.random.default_rng(0)
    starts = rng.integers(0, split - seq - 1, (steps, batch))
    held = np.arange(split, len(data) - seq - 1, seq)[:64]
    heldout = np.stack([data[s : s + seq + 1] for s in held])
    train = jnp.asarray(data[:split])
    vocab = len(chars)

    def windows(s: jax.Array) -> jax.Array:
        return jax.vmap(lambda i: jax.lax.dynamic_slice(train, (i,), (seq + 1,)))(s)

    def loss(model, variables, start, step, train_):
        w = windows(start)
        logits = model.apply(variables, w[:, :-1])
        ce = optax.softmax_cross_entropy_with_integer_labels(logits, w[:, 1:]).mean()
        spike = jnp.where(step % SPIKE_EVERY == SPIKE_EVERY // 2, SPIKE_FACTOR, 1.0)
        return spike * ce, {}

    def evaluate(model, v):
        logits = model.apply(v, heldout[:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits, heldout[:, 1:]).mean()

    return Task(
        "transformer",
        f"char transformer (2 blocks, dim 64, seq {seq}, batch {batch}), loss x1e4 every "
        f"{SPIKE_EVERY}th step",
        steps,
        lambda dt: CharLM(dt, vocab, dim=32 if quick else 64),
        jnp.zeros((1, seq), jnp.int32),
        {"idx": starts.astype(np.int32)},
        loss,
        evaluate,
        "held-out loss",
        lower=True,
        learning_rate=3e-3,
    )


def tasks(quick: bool) -> list[Task]:
    n = 40 if quick else None
    return [
        task_mlp(n or 2000),
        task_transformer(n or 1000, quick),
        task_cnn(n or 1000),
        task_multitask(n or 2000),
    ]


# --------------------------------------------------------------------------------------------
# Training.
# --------------------------------------------------------------------------------------------


class State(jdls.linen.TrainState):
    """``jdls.linen.TrainState`` with Flax ``batch_stats`` (empty for models without BatchNorm)."""

    batch_stats: Any = None


def train(task: Task, make_scale: Callable[[], jdls.LossScale], dtype: Any) -> dict[str, Any]:
    """One run; per-step arrays of the scale used, finite flags, flushed fraction."""
    model, ref_model = task.make_model(dtype), task.make_model(F32)
    variables = model.init(jax.random.key(0), task.sample)
    schedule = optax.cosine_decay_schedule(task.learning_rate, task.steps)
    state = State.create(
        apply_fn=model.apply,
        params=variables["params"],
        tx=jdls.wrap(optax.adam(schedule), make_scale()),
        batch_stats=variables.get("batch_stats", {}),
    )

    def variables_of(params: Any, batch_stats: Any) -> dict[str, Any]:
        return {"params": params, **({"batch_stats": batch_stats} if batch_stats else {})}

    def body(state: State, xs: tuple[Any, jax.Array]) -> tuple[State, dict[str, jax.Array]]:
        idx, step = xs

        def loss_fn(params: Any, m: nn.Module = model) -> tuple[jax.Array, Any]:
            return task.loss(m, variables_of(params, state.batch_stats), idx, step, True)

        scale = state.scale
        (_, bs), grads = scale.value_and_grad(loss_fn, has_aux=True)(state.params)

        def flushed() -> jax.Array:
            ref = jax.grad(lambda p: loss_fn(p, ref_model)[0])(state.params)
            mass = sum(jnp.sum(jnp.abs(r)) for r in jax.tree.leaves(ref))
            lost = sum(
                jnp.sum(jnp.where(g == 0, jnp.abs(r), 0))
                for g, r in zip(jax.tree.leaves(grads), jax.tree.leaves(ref), strict=True)
            )
            return lost / mass

        probe = (step % PROBE_EVERY == 0) & (dtype != F32)
        frac = jax.lax.cond(probe, flushed, lambda: jnp.full((), jnp.nan))
        new = state.apply_gradients(grads=grads, batch_stats=bs)
        finite = new.stats.finite
        return new, {"scale": scale.loss_scale, "finite": finite, "flushed": frac}

    run = jax.jit(lambda s, xs: jax.lax.scan(body, s, xs))
    start = time.perf_counter()
    xs = (jnp.asarray(task.batches["idx"]), jnp.arange(task.steps))
    state, out = run(state, xs)
    metric = float(task.evaluate(ref_model, variables_of(state.params, state.batch_stats)))
    seconds = time.perf_counter() - start
    out = jax.device_get(out)
    finite = np.asarray(out["finite"])
    flushed = np.asarray(out["flushed"])
    flushed = flushed[np.isfinite(flushed) & finite] if dtype != F32 else np.zeros(1)
    return {
        "metric": metric,
        "skipped_1000": int((~finite[:1000]).sum()),
        "skipped": int((~finite).sum()),
        "settle": settle_step(np.asarray(out["scale"])),
        "final_scale": float(out["scale"][-1]),
        "flushed": float(flushed.mean()) if flushed.size else float("nan"),
        "seconds": seconds,
        "scale_trace": np.asarray(out["scale"]).tolist(),
        "skipped_trace": np.cumsum(~finite).tolist(),
    }


def settle_step(scales: np.ndarray) -> int:
    """The first step from which the scale stays within one binade of its final value (the
    median of log2 over the last tenth of the run)."""
    log2 = np.log2(scales)
    final = np.median(log2[-max(1, len(log2) // 10) :])
    outside = np.nonzero(np.abs(log2 - final) > 1)[0]
    return int(outside[-1] + 1) if outside.size else 0


# --------------------------------------------------------------------------------------------
# Step cost: adaptive rule against PyTorch's, one jitted step.
# --------------------------------------------------------------------------------------------


def step_cost(task: Task, rounds: int) -> list[dict[str, Any]]:
    """Time one jitted step: PyTorch's rule, AdaptiveScale, and AdaptiveScale with every
    linen module probed (``jdls.linen.probes``, ``jdls.probed_value_and_grad``)."""
    model = task.make_model(F16)
    variables = model.init(jax.random.key(0), task.sample)
    idx = jnp.asarray(task.batches["idx"][0])

    def loss_fn(params: Any) -> tuple[jax.Array, Any]:
        return task.loss(model, {"params": params}, idx, jnp.int32(1), True)

    def probed_loss(params: Any) -> tuple[jax.Array, Any]:
        with jdls.linen.probes():
            return loss_fn(params)

    variants = (
        (task.name, "PyTorch", jdls.presets.pytorch, False),
        (task.name, "AdaptiveScale", jdls.AdaptiveScale, False),
        (f"{task.name} telemetry", "AdaptiveScale", jdls.AdaptiveScale, False),
        (f"{task.name} telemetry", "AdaptiveScale + telemetry", jdls.AdaptiveScale, True),
    )
    cases = []
    for group, label, make, probed in variants:
        state = State.create(
            apply_fn=model.apply,
            params=jax.tree.map(jnp.array, variables["params"]),  # donated: one copy per case
            tx=jdls.wrap(optax.adam(1e-3), make()),
            batch_stats={},
        )

        @functools.partial(jax.jit, donate_argnums=0)
        def step(state: State, probed: bool = probed) -> tuple[State, Any]:
            if probed:
                fn = jdls.probed_value_and_grad(probed_loss, state.scale, has_aux=True)
                _, grads, telemetry = fn(state.params)
            else:
                _, grads = state.scale.value_and_grad(loss_fn, has_aux=True)(state.params)
                telemetry = None
            return state.apply_gradients(grads=grads), telemetry

        box = [state]

        def run(step: Any = step, box: list[Any] = box) -> None:
            box[0], telemetry = step(box[0])
            jax.block_until_ready((box[0], telemetry))

        cases.append(h.Case(f"{task.name}: {label}", run, group=group))
    return h.time_cases(cases, rounds=rounds)


def settling(task: Task, quick: bool) -> list[dict[str, Any]]:
    """Start 2**20 above and below the scale AdaptiveScale follows on this task; count the
    steps until the scale stays within one binade of that reference run's scale."""
    ref = np.log2(np.asarray(train(task, jdls.AdaptiveScale, F16)["scale_trace"]))
    rows = []
    for label, make in (("AdaptiveScale", jdls.AdaptiveScale), ("PyTorch", jdls.presets.pytorch)):
        for offset in (20, -20):
            start = 2.0 ** float(np.clip(np.round(ref[1]) + offset, -126, 127))

            def scale(make: Any = make, start: float = start) -> jdls.LossScale:
                s = make()
                return s.replace(loss_scale=jnp.float32(start))

            h.log(f"quality: settling {label} from 2**{math.log2(start):.0f}")
            trace = np.log2(np.asarray(train(task, scale, F16)["scale_trace"]))
            off = np.nonzero(np.abs(trace - ref) > 1)[0]
            steps = int(off[-1] + 1) if off.size else 0
            rows.append(
                {
                    "label": f"{label} from 2**{offset:+d}",
                    "start_log2": math.log2(start),
                    "settle": steps if steps < len(trace) else None,
                    "steps": len(trace),
                }
            )
    return rows


# --------------------------------------------------------------------------------------------
# The suite.
# --------------------------------------------------------------------------------------------

COLUMNS = (
    ("label", "task / rule", ""),
    ("metric", "final metric", ".4f"),
    ("skipped_1000", "skipped (first 1000)", "d"),
    ("skipped", "skipped (all)", "d"),
    ("settle", "settle step", "d"),
    ("final_scale_log2", "final scale (log2)", ".1f"),
    ("flushed_pct", "signal flushed %", ".2f"),
    ("seconds", "seconds", ".1f"),
)


def suite(quick: bool = False, rounds: int | None = None) -> list[h.Section]:
    """The quality table (one section per task) and the step-cost table."""
    sections = []
    for task in tasks(quick):
        rows = []
        for name, (make, dtype) in rules(quick).items():
            h.log(f"quality: {task.name} / {name}")
            r = train(task, make, dtype)
            r["label"] = name
            r["final_scale_log2"] = math.log2(r["final_scale"])
            r["flushed_pct"] = 100 * r["flushed"]
            rows.append(r)
        note = f"{task.description}; {task.steps} steps; metric: {task.metric}" + (
            " (lower is better)" if task.lower else ""
        )
        sections.append(
            h.Section(task.name, note, rows, COLUMNS, {"steps": task.steps, "metric": task.metric})
        )
    mlp = tasks(quick)[0]
    sections.append(
        h.Section(
            "settling",
            f"{mlp.name}: steps until the scale stays within one binade of the scale that "
            "AdaptiveScale follows from its default start (empty: never, within the budget)",
            settling(mlp, quick),
            (
                ("label", "rule / start", ""),
                ("start_log2", "start (log2)", ".0f"),
                ("settle", "settle steps", "d"),
                ("steps", "budget", "d"),
            ),
        )
    )
    cost_rows: list[dict[str, Any]] = []
    for task in tasks(quick)[:2]:
        cost_rows += step_cost(task, rounds or (5 if quick else 200))
    sections.append(
        h.Section(
            "step cost",
            "one jitted train step (float16 compute, adam); ratio: to the first case of its "
            "group (AdaptiveScale / PyTorch's rule; telemetry on / off)",
            cost_rows,
        )
    )
    return sections


# --------------------------------------------------------------------------------------------
# Plots: python -m benchmarks.bench_quality [RESULTS_JSON] [PNG]
# --------------------------------------------------------------------------------------------


def plot(results: str, out: str) -> None:
    """The loss scale used at every step, and the cumulative skipped steps, per task and rule."""
    import json

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = json.loads(Path(results).read_text())
    sections = [s for s in data["sections"] if s["rows"] and "scale_trace" in s["rows"][0]]
    fig, axes = plt.subplots(2, len(sections), figsize=(4.2 * len(sections), 6.5), squeeze=False)
    styles = ["-", "--", ":", "-.", "-", "--", ":"]
    for j, section in enumerate(sections):
        for i, row in enumerate(section["rows"]):
            if row["label"] in ("float32", "no scaling (f16)"):
                continue
            width = 2.2 if row["label"] == "AdaptiveScale" else 1.2
            axes[0, j].plot(row["scale_trace"], styles[i], label=row["label"], linewidth=width)
            axes[1, j].plot(row["skipped_trace"], styles[i], label=row["label"], linewidth=width)
        axes[0, j].set_yscale("log", base=2)
        axes[0, j].set_title(f"{section['title']}: loss scale")
        axes[1, j].set_title(f"{section['title']}: skipped steps (cumulative)")
        axes[1, j].set_xlabel("step")
        for ax in axes[:, j]:
            ax.grid(True, alpha=0.3)
    axes[0, 0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    import sys

    args = sys.argv[1:]
    plot(
        args[0] if args else str(h.RESULTS_DIR / "quality.json"),
        args[1] if len(args) > 1 else "docs/img/quality.png",
    )
