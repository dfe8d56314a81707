"""Scale span: tasks whose gradients span more than float16's range, global rules against
per-layer and per-loss scales against float32, trained side by side from the same starts.

One global loss scale serves the layer (or the loss) with the largest gradients; where the
gradients span more than the compute format holds, the rest are flushed to zero or rounded
to a few subnormal ulps. Three tasks on the digits of ``bench_quality``:

* ``deep`` and ``deep-saturated``: a plain MLP of ``DEPTH`` tanh layers of width ``WIDTH``,
  no normalisation, biases starting at 1.5 or 3 (saturated units: each layer shrinks the
  backward signal, by about ``2**-4`` at 3), so the first layers' gradients sit about
  ``2**20`` or ``2**46`` below the last's. Per-layer scales: ``jdls.AdaptiveScale()`` per
  layer, a ``jdls.layer_site`` at each layer's output, ``jdls.update_sites``
  after each step.
* ``multitask``: an autoencoder whose squared error of the raw pixels (0 to 16) is summed
  over pixels and a batch of 1024 (as VAE code often reduces it: its gradients hold the
  global scale near ``2**1``), and an auxiliary digit classifier on the code, mean
  cross-entropy weighted ``1e-4``: at that scale its gradients sit at the bottom of
  float16's subnormals. Per-loss scales: ``jdls.multi_loss_value_and_grad`` with PyTorch's
  rule per loss.

Rules: PyTorch's default (``presets.pytorch()``) and ``jdls.AdaptiveScale()`` as global scales,
the per-layer or per-loss scales, float16 without scaling, and float32. Each float16 run
computes forward and backward in float16 on float32 master weights, with
``jdls.wrap(optax.adam(...))`` (skipping non-finite steps); each rule runs from ``SEEDS``
seeds (initialisation and batch order), and float32's spread over the seeds is the noise.

Metrics: the task's final metric (mean and range over seeds), skipped steps, the fraction of
gradient signal flushed to zero and the gradient error: every ``PROBE_EVERY`` steps the
float32 gradient at the same parameters and batch is computed; *flushed* is the fraction of
its L1 mass that sits where the run's gradient is exactly zero, *error* the relative L1
distance of the run's (unscaled) gradient to it (flushed, or rounded to a few subnormal
ulps), per layer (deep: the mean over the layers, each counting alike) or of the auxiliary
head (multitask); the mean over those steps.

Run::

    python -m benchmarks span            # a few minutes on 2 cores
    python -m benchmarks span --quick    # a smoke test: 1 seed, 40 steps
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jdls
from benchmarks import _harness as h
from benchmarks.bench_quality import digits

F16, F32 = jnp.float16, jnp.float32
PROBE_EVERY = 20
DEPTH, WIDTH = 12, 64
TRAINABLE_BIAS, SATURATED_BIAS = 1.5, 3.0
AUX_WEIGHT = 1e-4
SEEDS = 3


def _batches(n: int, batch: int, steps: int, seed: int = 0) -> np.ndarray:
    """``steps`` batches of ``batch`` indices into ``n`` examples, epochs shuffled by ``seed``."""
    rng = np.random.default_rng(seed)
    per = n // batch
    order = [rng.permutation(n)[: per * batch] for _ in range(math.ceil(steps / per))]
    return np.concatenate(order).reshape(-1, batch)[:steps].astype(np.int32)


def _dense(key: jax.Array, n_in: int, n_out: int, bias: float = 0.0) -> dict[str, jax.Array]:
    return {
        "w": jax.random.normal(key, (n_in, n_out), F32) / math.sqrt(n_in),
        "b": jnp.full((n_out,), bias, F32),
    }


def _apply(p: dict[str, jax.Array], x: jax.Array, dtype: Any) -> jax.Array:
    return x @ p["w"].astype(dtype) + p["b"].astype(dtype)


# --------------------------------------------------------------------------------------------
# Tasks.
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Task:
    """One training problem over a dict of parameters.

    ``losses(params, batch, dtype)`` returns a dict of weighted losses (their sum is the
    loss); ``evaluate(params)`` the final metric in float32; ``watched`` the parameter keys
    whose flushed signal is reported.
    """

    name: str
    description: str
    steps: int
    batch: int
    init: Callable[[int], dict[str, Any]]
    losses: Callable[[dict[str, Any], dict[str, jax.Array], Any], dict[str, jax.Array]]
    evaluate: Callable[[dict[str, Any]], jax.Array]
    metric: str
    watched: tuple[str, ...]
    per: str  # "layer" or "loss"
    learning_rate: float = 1e-3


#: The key under which a step passes the per-layer sites to a task's loss with its parameters.
SITES = "sites"


def _sites_of(scales: dict[str, Any]) -> dict[str, Any]:
    """One per-layer site per scale, in the dict's order (the layers' forward order)."""
    return {k: jdls.layer_site(s, i) for i, (k, s) in enumerate(scales.items())}


def _data() -> tuple[jax.Array, ...]:
    return tuple(jnp.asarray(a) for a in digits())


def task_deep(steps: int, bias: float, name: str) -> Task:
    xtr, xte, ytr, yte = _data()
    names = [f"dense_{i}" for i in range(DEPTH)] + ["out"]

    def init(seed: int) -> dict[str, Any]:
        keys = jax.random.split(jax.random.key(seed), DEPTH + 1)
        widths = [xtr.shape[1]] + [WIDTH] * DEPTH
        params = {f"dense_{i}": _dense(keys[i], widths[i], WIDTH, bias) for i in range(DEPTH)}
        params["out"] = _dense(keys[DEPTH], WIDTH, 10)
        return params

    def logits(params: dict[str, Any], x: jax.Array, dtype: Any) -> jax.Array:
        sites = params.get(SITES)  # the per-layer sites, when the step passes them in

        def mark(h: jax.Array, name: str) -> jax.Array:
            return h if sites is None else jdls.apply_site(h, sites[name])

        h_ = x.astype(dtype)
        for name in names[:-1]:
            h_ = mark(jnp.tanh(_apply(params[name], h_, dtype)), name)
        return mark(_apply(params["out"], h_, dtype), "out").astype(F32)

    def losses(params: dict[str, Any], batch: dict[str, jax.Array], dtype: Any) -> dict:
        ce = optax.softmax_cross_entropy_with_integer_labels(
            logits(params, xtr[batch["idx"]], dtype), ytr[batch["idx"]]
        )
        return {"ce": ce.mean()}

    return Task(
        name,
        f"digits, plain tanh MLP {DEPTH} x {WIDTH}, biases starting at {bias} (saturated "
        "units: the backward signal shrinks at every layer), no normalisation, batch 256",
        steps,
        256,
        init,
        losses,
        lambda p: jnp.mean(jnp.argmax(logits(p, xte, F32), -1) == yte),
        "test accuracy",
        tuple(names),
        "layer",
    )


def task_multitask(steps: int) -> Task:
    xtr, xte, ytr, yte = _data()

    def init(seed: int) -> dict[str, Any]:
        k = jax.random.split(jax.random.key(seed), 4)
        return {
            "trunk": [_dense(k[0], xtr.shape[1], 128), _dense(k[1], 128, 32)],
            "decoder": _dense(k[2], 32, xtr.shape[1]),
            "aux": _dense(k[3], 32, 10),
        }

    def heads(params: dict[str, Any], x: jax.Array, dtype: Any) -> tuple[jax.Array, jax.Array]:
        h_ = x.astype(dtype)
        for layer in params["trunk"]:
            h_ = jnp.tanh(_apply(layer, h_, dtype))
        decoded = _apply(params["decoder"], h_, dtype).astype(F32)
        return decoded, _apply(params["aux"], h_, dtype).astype(F32)

    def losses(params: dict[str, Any], batch: dict[str, jax.Array], dtype: Any) -> dict:
        x, y = xtr[batch["idx"]], ytr[batch["idx"]]
        decoded, logits = heads(params, x, dtype)
        reconstruction = jnp.sum((decoded - 16 * x) ** 2)  # raw pixel intensities, 0 to 16
        ce = optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
        return {"reconstruction": reconstruction, "aux": AUX_WEIGHT * ce}

    def evaluate(params: dict[str, Any]) -> jax.Array:
        _, logits = heads(params, xte, F32)
        return jnp.mean(jnp.argmax(logits, -1) == yte)

    return Task(
        "multitask",
        "digits autoencoder 64-128-32-64 (tanh), squared error of the raw pixels (0 to 16) "
        "summed over pixels and batch (weight 1), and an auxiliary digit classifier on the "
        f"code (mean cross-entropy, weight {AUX_WEIGHT:g}), batch 1024",
        steps,
        1024,
        init,
        losses,
        evaluate,
        "auxiliary classifier's test accuracy",
        ("aux",),
        "loss",
    )


def tasks(quick: bool) -> list[Task]:
    n = 40 if quick else None
    return [
        task_deep(n or 2000, TRAINABLE_BIAS, "deep"),
        task_deep(n or 2000, SATURATED_BIAS, "deep-saturated"),
        task_multitask(n or 2000),
    ]


# --------------------------------------------------------------------------------------------
# Rules and training.
# --------------------------------------------------------------------------------------------

#: label -> (kind, factory of one scale, compute dtype); kind "global" wraps the one scale,
#: "split" gives each layer (deep) or each loss (multitask) a scale from the factory.
RULES: dict[str, tuple[str, Callable[[], jdls.LossScale], Any]] = {
    "PyTorch (global)": ("global", jdls.presets.pytorch, F16),
    "AdaptiveScale (global)": ("global", jdls.AdaptiveScale, F16),
    "per-layer / per-loss": ("split", jdls.AdaptiveScale, F16),
    "no scaling (f16)": ("global", jdls.NoOpScale, F16),
    "float32": ("global", jdls.NoOpScale, F32),
}


def _split_factory(task: Task) -> Callable[[], jdls.LossScale]:
    # per-loss scales are adjusted from their finite flag only: PyTorch's rule per loss
    return jdls.AdaptiveScale if task.per == "layer" else jdls.presets.pytorch


def _lost(grads: Any, ref: Any, keys: tuple[str, ...]) -> jax.Array:
    """Per watched key, against the float32 gradient ``ref``: the fraction of its L1 mass
    where ``grads`` is exactly zero (flushed), and the relative L1 error of ``grads`` (flushed
    or rounded away: ``|g - ref|_1 / |ref|_1``); each the mean over the keys (every layer
    counts alike, however small). Returns ``[flushed, error]``."""
    fractions = []
    for key in keys:
        g, r = jax.tree.leaves(grads[key]), jax.tree.leaves(ref[key])
        mass = jnp.maximum(sum(jnp.sum(jnp.abs(b)) for b in r), jnp.finfo(F32).tiny)
        lost = sum(jnp.sum(jnp.where(a == 0, jnp.abs(b), 0)) for a, b in zip(g, r, strict=True))
        error = sum(jnp.sum(jnp.abs(a.astype(F32) - b)) for a, b in zip(g, r, strict=True))
        fractions.append(jnp.stack([lost / mass, error / mass]))
    return jnp.mean(jnp.stack(fractions), axis=0)


def train(task: Task, rule: str, seed: int) -> dict[str, Any]:
    """One run; the final metric, skipped steps, flushed fraction, final scale(s)."""
    kind, make, dtype = RULES[rule]
    params = task.init(seed)
    xtr = _data()[0]
    idx = jnp.asarray(_batches(len(xtr), task.batch, task.steps, seed))
    schedule = optax.cosine_decay_schedule(task.learning_rate, task.steps)
    split = kind == "split"
    tx = jdls.wrap(optax.adam(schedule), jdls.NoOpScale() if split else make())
    opt = tx.init(params)
    keys = list(task.losses(params, {"idx": idx[0]}, F32)) if task.per == "loss" else []
    if split:
        factory = _split_factory(task)
        scales = {k: factory() for k in (task.watched if task.per == "layer" else keys)}
        if task.per == "layer":
            scales = _sites_of(scales)
    else:
        scales = {}

    def total(p: Any, batch: Any, dt: Any = dtype) -> jax.Array:
        return sum(task.losses(p, batch, dt).values())

    def body(carry: Any, xs: tuple[jax.Array, jax.Array]) -> tuple[Any, dict[str, Any]]:
        params, opt, scales = carry
        batch, step = {"idx": xs[0]}, xs[1]
        if not split:
            scale = jdls.get_scale(opt)
            _, grads = scale.value_and_grad(total)(params, batch)
            level = scale.loss_scale
        elif task.per == "layer":
            fn = jdls.layer_scaled_value_and_grad(lambda p, s, b: total({**p, SITES: s}, b))
            _, (grads, measured) = fn(params, scales, batch)
            level = jnp.stack([s.value["scale"].loss_scale for s in scales.values()])
        else:
            fn = jdls.multi_loss_value_and_grad(lambda p, b: task.losses(p, b, dtype), scales)
            _, grads, finite_per_loss = fn(params, batch)
            level = jnp.stack([scales[k].loss_scale for k in keys])

        def flushed() -> jax.Array:
            ref = jax.grad(total)(params, batch, F32)
            return _lost(grads, ref, task.watched)

        probe = (step % PROBE_EVERY == 0) & (dtype != F32)
        frac = jax.lax.cond(probe, flushed, lambda: jnp.full((2,), jnp.nan))
        updates, opt = tx.update(grads, opt, params)
        finite = jdls.stats(opt).finite
        if split and task.per == "layer":
            scales = jdls.update_sites(scales, measured, finite)
        elif split:
            scales = {k: s.adjust(finite_per_loss[k]) for k, s in scales.items()}
        params = optax.apply_updates(params, updates)
        out = {"finite": finite, "flushed": frac, "level": jnp.log2(level)}
        return (params, opt, scales), out

    start = time.perf_counter()
    run = jax.jit(lambda c, xs: jax.lax.scan(body, c, xs))
    (params, opt, scales), out = run((params, opt, scales), (idx, jnp.arange(task.steps)))
    metric = float(task.evaluate(params))
    out = jax.device_get(out)
    finite = np.asarray(out["finite"])
    lost = np.asarray(out["flushed"])
    kept = np.isfinite(lost[:, 0]) & finite
    lost = lost[kept] if dtype != F32 else np.zeros((1, 2))
    level = np.asarray(out["level"])
    return {
        "metric": metric,
        "skipped": int((~finite).sum()),
        "flushed": float(lost[:, 0].mean()) if lost.size else float("nan"),
        "error": float(lost[:, 1].mean()) if lost.size else float("nan"),
        "scale_log2": level[-1].tolist(),
        "seconds": time.perf_counter() - start,
    }


def span_bits(task: Task, seed: int = 0) -> float:
    """log2 of the ratio of the largest to the smallest per-parameter-group float32 gradient
    magnitude (median of |g| per watched group) at initialisation, on the first batch."""
    params = task.init(seed)
    idx = jnp.asarray(_batches(len(_data()[0]), task.batch, 1, seed))[0]
    if task.per == "layer":
        grads = jax.grad(lambda p: sum(task.losses(p, {"idx": idx}, F32).values()))(params)
        meds = [
            np.median(np.abs(np.concatenate([np.ravel(a) for a in jax.tree.leaves(grads[k])])))
            for k in task.watched
        ]
    else:
        meds = []
        for key in task.losses(params, {"idx": idx}, F32):
            g = jax.grad(lambda p, k=key: task.losses(p, {"idx": idx}, F32)[k])(params)
            flat = np.concatenate([np.ravel(a) for a in jax.tree.leaves(g)])
            meds.append(np.median(np.abs(flat[flat != 0])))
    meds = np.asarray(meds, np.float64)
    return float(np.log2(meds.max() / meds.min()))


#: global scales tried at each point of ``same_point`` (log2): the best of them is reported
GLOBAL_LOG2 = tuple(range(0, 31, 2))
SAME_POINT_ADJUSTMENTS = 30


def same_point(task: Task, seed: int = 0, at: tuple[int, ...] | None = None) -> list[dict]:
    """Gradient error at the *same* parameters: float32 trains the task; at the steps ``at``
    its parameters and batch are frozen, and the float16 gradient is taken with the best of
    the global scales ``2**GLOBAL_LOG2`` (the one with the least error) and with per-layer
    scales (``jdls.AdaptiveScale()`` per layer, adjusted ``SAME_POINT_ADJUSTMENTS`` times on
    that batch). Unlike the training runs' errors, these share one trajectory, so what
    differs is only how the backward pass is scaled. Layer tasks only."""
    if task.per != "layer":
        raise ValueError(f"same_point compares per-layer scales; {task.name!r} has per-loss")
    at = at if at is not None else (0, task.steps // 2, task.steps - 1)
    params = task.init(seed)
    idx = jnp.asarray(_batches(len(_data()[0]), task.batch, task.steps, seed))
    tx = optax.adam(optax.cosine_decay_schedule(task.learning_rate, task.steps))
    opt = tx.init(params)

    def total(p: Any, batch: Any, dt: Any) -> jax.Array:
        return sum(task.losses(p, batch, dt).values())

    @jax.jit
    def step(p: Any, o: Any, i: jax.Array) -> tuple[Any, Any]:
        u, o = tx.update(jax.grad(total)(p, {"idx": i}, F32), o, p)
        return optax.apply_updates(p, u), o

    base = jdls.DynamicScale(1.0)
    reference = jax.jit(lambda p, i: jax.grad(total)(p, {"idx": i}, F32))

    @jax.jit
    def global_lost(p: Any, i: jax.Array, ref: Any, log2: jax.Array) -> jax.Array:
        scale = base.replace(loss_scale=jnp.exp2(log2.astype(F32)))
        _, g = scale.value_and_grad(lambda q: total(q, {"idx": i}, F16))(p)
        return _lost(g, ref, task.watched)

    @jax.jit
    def layered(p: Any, i: jax.Array, sites: Any) -> tuple[Any, Any]:
        fn = jdls.layer_scaled_value_and_grad(lambda q, s: total({**q, SITES: s}, {"idx": i}, F16))
        _, (g, measured) = fn(p, sites)
        return g, jdls.update_sites(sites, measured, jdls.all_finite(g))

    rows = []
    for t in range(max(at) + 1):
        if t in at:
            ref = reference(params, idx[t])  # once per point, for every scale compared
            errors = {
                e: np.asarray(global_lost(params, idx[t], ref, jnp.int32(e))) for e in GLOBAL_LOG2
            }
            best = min(errors, key=lambda e: (errors[e][1], e))
            scales = _sites_of({k: jdls.AdaptiveScale() for k in task.watched})
            for _ in range(SAME_POINT_ADJUSTMENTS):  # the last gradients are measured
                grads, scales = layered(params, idx[t], scales)
            lost = np.asarray(_lost(grads, ref, task.watched))
            levels = np.log2([float(s.value["scale"].loss_scale) for s in scales.values()])
            rows.append(
                {
                    "label": f"step {t}",
                    "global_log2": best,
                    "global_flushed_pct": 100 * float(errors[best][0]),
                    "global_error_pct": 100 * float(errors[best][1]),
                    "layer_log2": f"{levels.min():.0f} to {levels.max():.0f}",
                    "layer_flushed_pct": 100 * float(lost[0]),
                    "layer_error_pct": 100 * float(lost[1]),
                }
            )
        params, opt = step(params, opt, idx[t])
    return rows


SAME_POINT_COLUMNS = (
    ("label", "float32 parameters at", ""),
    ("global_log2", "best global scale, log2", ""),
    ("global_flushed_pct", "flushed % (best global)", ".3f"),
    ("global_error_pct", "error % (best global)", ".2f"),
    ("layer_log2", "per-layer scales, log2", ""),
    ("layer_flushed_pct", "flushed % (per-layer)", ".3f"),
    ("layer_error_pct", "error % (per-layer)", ".2f"),
)


# --------------------------------------------------------------------------------------------
# The suite.
# --------------------------------------------------------------------------------------------

COLUMNS = (
    ("label", "rule", ""),
    ("metric", "metric (mean)", ".4f"),
    ("metric_range", "metric (min-max over seeds)", ""),
    ("skipped", "skipped steps (mean)", ".1f"),
    ("flushed_pct", "signal flushed % (mean)", ".3f"),
    ("error_pct", "gradient error % (mean)", ".3f"),
    ("scale_log2", "final scale(s), log2 (seed 0)", ""),
    ("seconds", "seconds per run", ".1f"),
)


def _summary(rule: str, runs: list[dict[str, Any]]) -> dict[str, Any]:
    metrics = [r["metric"] for r in runs]
    scales = np.atleast_1d(np.asarray(runs[0]["scale_log2"]))
    return {
        "label": rule,
        "metric": float(np.mean(metrics)),
        "metric_range": f"{min(metrics):.4f}-{max(metrics):.4f}",
        "metrics": metrics,
        "skipped": float(np.mean([r["skipped"] for r in runs])),
        "flushed_pct": 100 * float(np.nanmean([r["flushed"] for r in runs])),
        "error_pct": 100 * float(np.nanmean([r["error"] for r in runs])),
        "scale_log2": (
            f"{scales[0]:.0f}" if scales.size == 1 else f"{scales.min():.0f} to {scales.max():.0f}"
        ),
        "scale_log2_all": scales.tolist(),
        "seconds": float(np.mean([r["seconds"] for r in runs])),
    }


def suite(quick: bool = False, rounds: int | None = None) -> list[h.Section]:
    """One section per task: every rule, mean and range over seeds."""
    del rounds
    seeds = range(1 if quick else SEEDS)
    sections = []
    for task in tasks(quick):
        rows = []
        for rule in RULES:
            h.log(f"span: {task.name} / {rule}")
            rows.append(_summary(rule, [train(task, rule, s) for s in seeds]))
        span = span_bits(task)
        note = (
            f"{task.description}; {task.steps} steps; {len(seeds)} seed(s); metric: "
            f"{task.metric}; flushed: of the gradient of {', '.join(task.watched)}; float32 "
            f"gradient magnitudes (median per {task.per}) span 2**{span:.0f} at the start"
        )
        sections.append(
            h.Section(task.name, note, rows, COLUMNS, {"steps": task.steps, "span_bits": span})
        )
        if task.per == "layer":
            h.log(f"span: {task.name} / same parameters")
            same = (
                f"{task.name}, gradient error at the same parameters (the float32 run's, seed 0, "
                "and its batch): the best of the global scales 2**0, 2**2, ..., 2**30 against "
                f"per-layer scales (AdaptiveScale per layer, {SAME_POINT_ADJUSTMENTS} "
                "adjustments on that batch); error and flushed as above, mean over the layers"
            )
            sections.append(
                h.Section(
                    f"{task.name}, same parameters", same, same_point(task), SAME_POINT_COLUMNS
                )
            )
    return sections


def sweep(biases: tuple[float, ...] = (1.5, 1.75, 2.0, 2.25, 2.5, 3.0)) -> str:
    """Where a deep tanh network stops training in float32, against where one global scale
    starts to lose gradient: for each starting bias, the span at the start, float32's test
    accuracy after the suite's 2,000 steps (seed 0), and ``same_point`` at steps 0 and 1000.
    Returns a Markdown table."""
    lines = [
        "| bias | span at the start | float32 accuracy | step | best global: flushed %, error % "
        "| per-layer: flushed %, error % |",
        "|--:|--:|--:|--:|--:|--:|",
    ]
    for bias in biases:
        task = task_deep(2000, bias, f"deep-{bias:g}")
        head = f"| {bias:g} | 2**{span_bits(task):.0f} | {train(task, 'float32', 0)['metric']:.3f}"
        for r in same_point(task, at=(0, 1000)):
            lines.append(
                f"{head} | {r['label'].split()[1]} | {r['global_flushed_pct']:.3f}, "
                f"{r['global_error_pct']:.2f} | {r['layer_flushed_pct']:.3f}, "
                f"{r['layer_error_pct']:.2f} |"
            )
            head = "| | |"
    return "\n".join(lines)


if __name__ == "__main__":  # python -m benchmarks.bench_span: the bias sweep of docs/per-layer.md
    print(sweep())
