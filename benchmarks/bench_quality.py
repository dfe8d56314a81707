"""Scaling quality: every rule on tasks chosen to tell the rules apart, several seeds each.

Rules (one column each): the default rules of PyTorch, Flax, jmp (``2**15``), Keras,
DeepSpeed and Cerebras (:mod:`jdls.presets`), jdls's classic rule (``jdls.DynamicScale()``),
``jdls.AdaptiveScale()``, no scaling (``jdls.NoOpScale()``) and float32 (no scaling, float32
compute). Every 16-bit run computes its forward and backward passes in the 16-bit format on
float32 master weights, with ``jdls.wrap(optax.adam(cosine schedule, eps=1e-20), scale)``
(an epsilon far below every gradient, so that float32 does not depend on the loss weight).

Tasks (chosen, with their reasons, before any rule ran on them; ``TASKS`` below and
docs/quality.md say why each one): small models on scikit-learn's digits (64 inputs, 10
classes, and a parity head where a task weights it), 400 steps of batch 128, so that a whole
run is one ``lax.scan``; the tasks that share a model and a format differ only in data (loss
weights per step, reduction, restart scale, learning rate), so they and the seeds are
``vmap`` axes: one compilation per rule per family of tasks. Each task is ranked by a metric that
measures scaling, not overfitting: held-out accuracy of a model that does not overfit
digits in the budget, or the float32 training loss on the whole training set at the end.

Columns: the metric (mean over seeds and its standard deviation), skipped steps, the step
after which the scale stays within one binade of its final value ("settle"), and the fraction
of the float32 gradient's L1 mass that the run's gradient flushed to zero (every
``PROBE_EVERY`` steps, taken steps only).

Run::

    python -m benchmarks quality           # about 10 minutes on 2 cores
    python -m benchmarks quality --quick   # a smoke test: 3 tasks, 3 rules, 30 steps
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

import jdls
from benchmarks import _harness as h

F16, F32 = jnp.float16, jnp.float32
STEPS, SEEDS, BATCH, HIDDEN = 400, 3, 128, 64
PROBE_EVERY = 20
SPIKE_EVERY, SPIKE_FACTOR = 50, 1e4
CLIP_NORM, CLIP_VALUE = 2.0**-10, 2.0**-16
# Adam's epsilon, far below every gradient here: float32 training then does not depend on the
# loss weight, and what differs between the rules is only the 16-bit arithmetic.
ADAM_EPS = 1e-20


# --------------------------------------------------------------------------------------------
# Rules.
# --------------------------------------------------------------------------------------------

Rules = dict[str, Callable[[str], jdls.LossScale]]


def rules(quick: bool = False) -> Rules:
    """Name -> scale factory (the compute format's name: ``"float16"`` or ``"cbfloat16"``)."""
    table: Rules = {
        "PyTorch": lambda fmt: jdls.presets.pytorch(),
        "Flax": lambda fmt: jdls.presets.flax(),
        "jmp": lambda fmt: jdls.presets.jmp(2.0**15),
        "Keras": lambda fmt: jdls.presets.keras(),
        "DeepSpeed": lambda fmt: jdls.presets.deepspeed(),
        "Cerebras": lambda fmt: jdls.presets.cerebras(half_dtype=fmt),
        "jdls classic": lambda fmt: jdls.DynamicScale(),
        "AdaptiveScale": lambda fmt: jdls.AdaptiveScale(),
        "no scaling": lambda fmt: jdls.NoOpScale(),
        "float32": lambda fmt: jdls.NoOpScale(),
    }
    if quick:
        return {k: table[k] for k in ("PyTorch", "AdaptiveScale", "float32")}
    return table


# --------------------------------------------------------------------------------------------
# Data, formats, models.
# --------------------------------------------------------------------------------------------


@functools.cache
def digits() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    d = load_digits()
    x = (d.data / 16.0).astype(np.float32)
    y = d.target.astype(np.int32)
    return tuple(train_test_split(x, y, test_size=0.3, random_state=0, stratify=y))  # type: ignore[return-value]


@jax.custom_vjp
def _cb16(x: jax.Array) -> jax.Array:
    return jdls.cbfloat16.round(x)


_cb16.defvjp(lambda x: (jdls.cbfloat16.round(x), None), lambda _, g: (jdls.cbfloat16.round(g),))


def caster(fmt: str) -> Callable[[jax.Array], jax.Array]:
    """Into the compute format: float16 (a cast), cbfloat16 (rounded both ways), float32."""
    if fmt == "float16":
        return lambda x: x.astype(F16)
    if fmt == "cbfloat16":
        return lambda x: _cb16(x.astype(F32))
    return lambda x: x.astype(F32)


def init_mlp(
    key: jax.Array, outputs: int, hidden: int = HIDDEN
) -> list[tuple[jax.Array, jax.Array]]:
    sizes = (64, hidden, hidden, outputs)
    keys = jax.random.split(key, len(sizes) - 1)
    return [
        (jax.random.normal(k, (a, b)) * math.sqrt(2.0 / a), jnp.zeros(b))
        for k, a, b in zip(keys, sizes[:-1], sizes[1:], strict=True)
    ]


def mlp(params: Any, x: jax.Array, cast: Callable[[jax.Array], jax.Array]) -> jax.Array:
    h_ = cast(x)
    for i, (w, b) in enumerate(params):
        h_ = cast(h_ @ cast(w) + cast(b))
        if i < len(params) - 1:
            h_ = jax.nn.relu(h_)
    return h_.astype(F32)


def init_cnn(key: jax.Array, outputs: int) -> dict[str, jax.Array]:
    k1, k2, k3 = jax.random.split(key, 3)
    return {
        "c1": jax.random.normal(k1, (3, 3, 1, 16)) * math.sqrt(2.0 / 9),
        "c2": jax.random.normal(k2, (3, 3, 16, 32)) * math.sqrt(2.0 / 144),
        "w": jax.random.normal(k3, (32, outputs)) * math.sqrt(1.0 / 32),
        "b": jnp.zeros(outputs),
    }


def _conv3x3(x: jax.Array, w: jax.Array, stride: int) -> jax.Array:
    """A 3x3 "SAME" convolution as one matmul over shifted copies (a float16 convolution on
    CPU is far slower than a float16 matmul)."""
    _, hgt, wid, c = x.shape
    p = jnp.pad(x, ((0, 0), (1, 1), (1, 1), (0, 0)))
    patches = jnp.concatenate(
        [p[:, i : i + hgt : stride, j : j + wid : stride, :] for i in range(3) for j in range(3)],
        axis=-1,
    )
    return patches @ w.reshape(9 * c, -1)


def cnn(params: Any, x: jax.Array, cast: Callable[[jax.Array], jax.Array]) -> jax.Array:
    h_ = cast(x.reshape(-1, 8, 8, 1))
    for name, stride in (("c1", 1), ("c2", 2)):
        h_ = jax.nn.relu(cast(_conv3x3(h_, cast(params[name]), stride)))
    h_ = cast(h_.mean(axis=(1, 2)))
    return cast(h_ @ cast(params["w"]) + cast(params["b"])).astype(F32)


# --------------------------------------------------------------------------------------------
# Tasks.
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Task:
    """One training problem, and why it is in the suite.

    ``weight(step)`` multiplies the loss (a float32 scalar; may be inf for a bad batch);
    ``reduction``: ``"mean"`` or ``"sum"`` over the batch of the digit cross-entropy;
    ``parity``: the weight of a mean-reduced parity head (a second output), 0 for none.
    """

    name: str
    why: str
    metric: str  # "test accuracy", "parity accuracy" or "train loss"
    weight: Callable[[jax.Array], jax.Array] = lambda step: jnp.float32(1.0)
    reduction: str = "mean"
    parity: float = 0.0
    model: str = "mlp"
    fmt: str = "float16"
    start: float | None = None  # every rule starts here (a restart), else its own default
    learning_rate: float = 1e-3
    b2: float = 0.999  # Adam's second-moment decay
    steps: int = STEPS
    kind: str = "discriminative"  # or "no regression"
    #: a clipping transformation in front of the wrap: "" (none), "jdls.clip" or "optax.clip"
    #: (global norm ``CLIP_NORM``), "jdls.clip value" (``CLIP_VALUE`` per element)
    front: str = ""
    loss_dtype: str = "float32"  # "float16": the loss value itself is float16

    @property
    def lower(self) -> bool:
        return self.metric == "train loss"


def _spikes(step: jax.Array) -> jax.Array:
    return jnp.where(step % SPIKE_EVERY == SPIKE_EVERY // 2, F32(SPIKE_FACTOR), F32(1.0))


def _zero_then_one(step: jax.Array) -> jax.Array:
    return jnp.where(step < 100, F32(0.0), F32(1.0))


def _frozen(step: jax.Array) -> jax.Array:
    return jnp.where((step >= 100) & (step < 200), F32(0.0), F32(2.0**-8))


def _burst(step: jax.Array) -> jax.Array:
    bad = (step >= 100) & (step < 116)
    return jnp.where(bad, F32(jnp.inf), F32(2.0**-16))


TASKS: tuple[Task, ...] = (
    Task(
        "tiny weight",
        "loss weighted 2**-32: the useful scale is about 2**40, above every classic rule's "
        "start; a rule that grows once per 2,000 steps never gets there in 400",
        "test accuracy",
        weight=lambda step: F32(2.0**-32),
    ),
    Task(
        "decaying weight",
        "loss weight lowered in stages, 1, then 2**-16 from step 100 and 2**-32 from step 200 "
        "(a curriculum or an annealed auxiliary weight): the right scale rises by 32 binades "
        "while training. Adam's b2 is 0.9 here so that float32 itself keeps learning after "
        "each drop (the suite's first runs decayed the weight smoothly: with any b2 Adam's "
        "second moment then remembers the larger past gradients and float32 stops learning)",
        "train loss",
        weight=lambda step: jnp.exp2(-16.0 * jnp.minimum(step // 100, 2).astype(F32)),
        b2=0.9,
    ),
    Task(
        "sum + mean",
        "a digit loss summed over the batch (gradients 128x a mean's) next to a parity loss "
        "averaged and weighted 2**-12: one scale must fit the large and the small term",
        "parity accuracy",
        reduction="sum",
        parity=2.0**-12,
    ),
    Task(
        "late training",
        "loss weight 2**-28, learning rate 3e-3 decayed to 0: the gradients shrink by many "
        "binades as the training loss falls, so late steps need a rising scale (the "
        "suite's first runs used 2**-20 and 2**-24, which every rule's start still covers)",
        "train loss",
        weight=lambda step: F32(2.0**-28),
        learning_rate=3e-3,
    ),
    Task(
        "restart low",
        "a restart whose checkpointed scale (2**-12) is 20 binades too low for a loss "
        "weighted 2**-8: almost every gradient flushes until the scale recovers",
        "test accuracy",
        weight=lambda step: F32(2.0**-8),
        start=2.0**-12,
    ),
    Task(
        "restart high",
        "a restart at scale 2**40 with loss weight 1: every step overflows until the "
        "rule has backed off about 30 binades",
        "test accuracy",
        start=2.0**40,
    ),
    Task(
        "cbfloat16",
        "cbfloat16 compute (6 exponent bits, subnormals to 2**-39), loss weighted 2**-48: "
        "Cerebras' cbfloat16 start (2**31) fits; scales made for float16 do not",
        "test accuracy",
        weight=lambda step: F32(2.0**-48),
        fmt="cbfloat16",
    ),
    Task(
        "spikes",
        f"loss x{SPIKE_FACTOR:.0e} every {SPIKE_EVERY} steps (8 spikes): a spike's gradient "
        "that reaches Adam inflates its second moment for hundreds of steps; a rule should "
        "skip those steps and not lose its scale for long",
        "train loss",
        weight=_spikes,
    ),
    Task(
        "burst",
        "loss weight 2**-16, then 16 batches in a row with an inf loss (steps 100-115): "
        "rules that halve per overflow end 16 binades low and then grow once per 2,000 steps",
        "test accuracy",
        weight=_burst,
    ),
    Task(
        "zero start",
        "loss weight 0 for the first 100 steps (an auxiliary loss warmed up from 0, a frozen "
        "phase at the start), then 1: the gradients are all zero, which a measuring rule "
        "cannot tell from gradients that all flushed",
        "test accuracy",
        weight=_zero_then_one,
    ),
    Task(
        "zero phase",
        "loss weight 2**-8, 0 for steps 100-199, then 2**-8 again: all-zero gradients in the "
        "middle of training, after the rule has measured",
        "test accuracy",
        weight=_frozen,
    ),
    Task(
        "clip in front",
        "optax.chain(jdls.clip(2**-10), jdls.wrap(...)): the wrap receives gradients clipped "
        "by about 2**11, which would put a measuring rule 11 binades too high for the next "
        "backward pass, computed before clipping",
        "test accuracy",
        front="jdls.clip",
    ),
    Task(
        "value clip in front",
        "optax.chain(jdls.clip(max_value=2**-16), jdls.wrap(...)): each element clipped to "
        "2**-16, so the largest gradient the wrap receives understates the backward pass's",
        "test accuracy",
        front="jdls.clip value",
    ),
    Task(
        "optax clip in front",
        "optax.chain(optax.clip_by_global_norm(2**-10), jdls.wrap(...)): as clip in front, "
        "through a transformation that hands nothing to the wrap",
        "test accuracy",
        front="optax.clip",
    ),
    Task(
        "float16 loss",
        "the loss value itself in float16, weighted 2**-8: the gradients call for a scale "
        "above 65504, where the float16 seed of the backward pass would be inf",
        "test accuracy",
        weight=lambda step: F32(2.0**-8),
        loss_dtype="float16",
    ),
    Task(
        "mlp",
        "the demo's digits MLP, loss weight 5e-6: every rule already fits",
        "test accuracy",
        weight=lambda step: F32(5e-6),
        kind="no regression",
    ),
    Task(
        "cnn",
        "a small digits CNN (2 conv layers), loss weight 1",
        "test accuracy",
        model="cnn",
        learning_rate=3e-3,
        kind="no regression",
    ),
    Task(
        "multitask",
        "digits MLP with a parity head weighted 1e-4 (mean-reduced)",
        "parity accuracy",
        parity=1e-4,
        kind="no regression",
    ),
)


def tasks(quick: bool = False) -> list[Task]:
    """The tasks; quick: three of them, 30 steps."""
    if not quick:
        return list(TASKS)
    return [
        dataclasses.replace(t, steps=30)
        for t in TASKS
        if t.name in ("tiny weight", "spikes", "cnn")
    ]


# --------------------------------------------------------------------------------------------
# Training: one jit per rule per family of tasks (same model and format), tasks and seeds
# vmapped: what differs between the tasks of a family (loss weights per step, reduction,
# parity weight, restart scale, learning rate) is data, not code.
# --------------------------------------------------------------------------------------------


def _family(task: Task) -> tuple[str, str, str, str]:
    return task.model, task.fmt, task.front, task.loss_dtype


def _front(front: str) -> optax.GradientTransformation | None:
    """The clipping transformation a task puts in front of the wrap (None: none)."""
    return {
        "": lambda: None,
        "jdls.clip": lambda: jdls.clip(CLIP_NORM),
        "jdls.clip value": lambda: jdls.clip(max_value=CLIP_VALUE),
        "optax.clip": lambda: optax.clip_by_global_norm(CLIP_NORM),
    }[front]()


def _task_data(task: Task, steps: int) -> dict[str, jax.Array]:
    weights = jnp.broadcast_to(task.weight(jnp.arange(steps)), (steps,)).astype(F32)
    return {
        "weights": weights,
        "reduction": F32(BATCH if task.reduction == "sum" else 1.0),
        "parity": F32(task.parity),
        "start": F32(math.nan if task.start is None else task.start),
        "lr": F32(task.learning_rate),
        "b2": F32(task.b2),
    }


def _loss(
    apply: Callable[..., Any], fmt: str, loss_dtype: str = "float32"
) -> Callable[..., jax.Array]:
    cast = caster(fmt)
    dtype = jnp.dtype(loss_dtype)

    def loss(params: Any, x: jax.Array, y: jax.Array, data: Any, step: jax.Array) -> jax.Array:
        out = apply(params, x, cast).astype(dtype)
        ce = optax.softmax_cross_entropy_with_integer_labels(out[:, :10], y).mean()
        parity = optax.softmax_cross_entropy_with_integer_labels(out[:, 10:], y % 2).mean()
        total = data["reduction"].astype(dtype) * ce + data["parity"].astype(dtype) * parity
        return data["weights"][step].astype(dtype) * total

    return loss


def make_run(
    family: list[Task], make_scale: Callable[[str], jdls.LossScale], fmt: str, seeds: int
) -> Callable[[], dict[str, Any]]:
    """The jitted run of one rule on a family of tasks, tasks x seeds vmapped."""
    xtr, xte, ytr, yte = (jnp.asarray(a) for a in digits())
    model, task_fmt, front, loss_dtype = _family(family[0])
    steps = family[0].steps
    init, apply = (init_cnn, cnn) if model == "cnn" else (init_mlp, mlp)
    loss = _loss(apply, fmt, "float32" if fmt == "float32" else loss_dtype)
    ref_loss = _loss(apply, "float32")

    def one(seed: jax.Array, data: dict[str, jax.Array]) -> dict[str, Any]:
        adam = optax.adam(optax.cosine_decay_schedule(1.0, steps), b2=data["b2"], eps=ADAM_EPS)
        tx = jdls.wrap(adam, make_scale(task_fmt))
        clip = _front(front)
        if clip is not None:
            tx = optax.chain(clip, tx)
        key = jax.random.key(seed)
        params = init(jax.random.fold_in(key, 0), 12)
        opt_state = tx.init(params)
        scale = jdls.get_scale(opt_state)
        if isinstance(scale, jdls.DynamicScale):  # a restart: the checkpointed scale
            start = jnp.where(jnp.isnan(data["start"]), scale.loss_scale, data["start"])
            opt_state = jdls.set_scale(opt_state, scale.replace(loss_scale=start))

        def body(carry: Any, step: jax.Array) -> tuple[Any, dict[str, jax.Array]]:
            params, opt_state = carry
            idx = jax.random.randint(jax.random.fold_in(key, step + 1), (BATCH,), 0, len(xtr))
            x, y = xtr[idx], ytr[idx]
            scale = jdls.get_scale(opt_state)
            _, grads = scale.value_and_grad(loss)(params, x, y, data, step)

            def flushed() -> jax.Array:
                ref = jax.grad(ref_loss)(params, x, y, data, step)
                mass = sum(jnp.sum(jnp.abs(r)) for r in jax.tree.leaves(ref))
                lost = sum(
                    jnp.sum(jnp.where(g == 0, jnp.abs(r), 0))
                    for g, r in zip(jax.tree.leaves(grads), jax.tree.leaves(ref), strict=True)
                )
                return jnp.where(mass > 0, jnp.clip(lost / mass, 0.0, 1.0), 0.0)

            probe = (step % PROBE_EVERY == 0) & (fmt != "float32")
            frac = lax.cond(probe, flushed, lambda: jnp.full((), jnp.nan))
            updates, opt_state = tx.update(grads, opt_state, params)
            updates = jax.tree.map(lambda u: data["lr"] * u, updates)
            params = optax.apply_updates(params, updates)
            finite = jdls.stats(opt_state).finite
            return (params, opt_state), {
                "scale": scale.loss_scale,
                "finite": finite,
                "flushed": frac,
            }

        (params, _), trace = lax.scan(body, (params, opt_state), jnp.arange(steps))
        out = apply(params, xte, caster("float32"))
        train_out = apply(params, xtr, caster("float32"))
        trace["test accuracy"] = jnp.mean(jnp.argmax(out[:, :10], -1) == yte)
        trace["parity accuracy"] = jnp.mean(jnp.argmax(out[:, 10:], -1) == yte % 2)
        trace["train loss"] = optax.softmax_cross_entropy_with_integer_labels(
            train_out[:, :10], ytr
        ).mean()
        return trace

    data = jax.tree.map(lambda *a: jnp.stack(a), *(_task_data(t, steps) for t in family))
    n = len(family)
    data = jax.tree.map(lambda a: jnp.repeat(a, seeds, axis=0), data)
    seed_ids = jnp.tile(jnp.arange(seeds), n)
    run = jax.jit(jax.vmap(one))
    return lambda: jax.device_get(run(seed_ids, data))


def train_family(
    family: list[Task],
    make_scale: Callable[[str], jdls.LossScale],
    fmt: str | None = None,
    seeds: int = SEEDS,
) -> list[dict[str, Any]]:
    """One rule on tasks of one family, ``seeds`` seeds each, all at once: per task, the
    metric (mean, std over seeds) and seed 0's traces."""
    fmt = family[0].fmt if fmt is None else fmt
    start = time.perf_counter()
    out = make_run(family, make_scale, fmt, seeds)()
    seconds = time.perf_counter() - start
    results = []
    for i, task in enumerate(family):
        part = {k: np.asarray(v)[i * seeds : (i + 1) * seeds] for k, v in out.items()}
        values = part[task.metric].astype(np.float64)
        finite = part["finite"]  # (seeds, steps)
        scales = part["scale"].astype(np.float64)
        flushed = part["flushed"].astype(np.float64)
        taken = flushed[np.isfinite(flushed) & finite]
        results.append(
            {
                "metric": float(values.mean()),
                "metric_std": float(values.std()),
                "metric_per_seed": values.tolist(),
                "skipped": float((~finite).sum(axis=1).mean()),
                "settle": float(np.mean([settle_step(s) for s in scales])),
                "final_scale_log2": float(np.median(np.log2(scales[:, -1]))),
                "flushed_pct": 100 * float(taken.mean()) if taken.size else 0.0,
                "seconds": seconds / len(family),
                "scale_trace": np.log2(scales[0]).tolist(),
                "skipped_trace": np.cumsum(~finite[0]).tolist(),
            }
        )
    return results


def train(
    task: Task,
    make_scale: Callable[[str], jdls.LossScale],
    fmt: str | None = None,
    seeds: int = SEEDS,
) -> dict[str, Any]:
    """One rule on one task (:func:`train_family` of one task)."""
    return train_family([task], make_scale, fmt, seeds)[0]


def settle_step(scales: np.ndarray) -> int:
    """The first step from which the scale stays within one binade of its final value (the
    median of log2 over the last tenth of the run)."""
    log2 = np.log2(scales)
    final = np.median(log2[-max(1, len(log2) // 10) :])
    outside = np.nonzero(np.abs(log2 - final) > 1)[0]
    return int(outside[-1] + 1) if outside.size else 0


# --------------------------------------------------------------------------------------------
# Step cost: AdaptiveScale against the classic rule, one jitted step, interleaved.
# --------------------------------------------------------------------------------------------


#: Each timed sample runs this long (several steps of a short one), so that one sample is not
#: dominated by the timer and the dispatch of one call.
SAMPLE_SECONDS = 0.01


def _cost_workloads(quick: bool) -> list[tuple[str, Callable[..., Any], Any, Any]]:
    """(name, loss(params, batch), params, batch) of the step-cost workloads."""
    from benchmarks import bench_step

    xtr, _, ytr, _ = (jnp.asarray(a) for a in digits())
    loss = _loss(mlp, "float16")
    data = _task_data(TASKS[0], 2)

    def suite_mlp(hidden: int, batch: int) -> tuple[str, Callable[..., Any], Any, Any]:
        x, y = xtr[:batch], ytr[:batch]
        return (
            f"MLP width {hidden}, batch {batch}",
            lambda p, b, x=x, y=y: loss(p, x, y, data, 1),
            init_mlp(jax.random.key(0), 12, hidden),
            None,
        )

    out = [suite_mlp(HIDDEN, BATCH)]
    if not quick:
        out.append(suite_mlp(512, 256))
        for work in (bench_step.mlp_workload(False), bench_step.transformer_workload(False)):
            name = f"{work.title.rsplit(', ', 1)[-1]} {work.n_params / 1e6:.1f}M"
            out.append((name, work.loss, work.params, work.batch))
    return out


def step_cost(rounds: int, quick: bool = False) -> list[dict[str, Any]]:
    """Time of one jitted float16 train step (adam) per rule, rounds interleaved, on the
    suite's MLP and on larger models; each sample runs ``k`` steps (the same ``k`` for every
    rule of a workload, about :data:`SAMPLE_SECONDS`); ratio: to the classic rule. The rules
    are interleaved within a workload, one workload after the other: a large model's step
    between two small ones would leave the small ones cold caches."""
    rows = []
    for group, loss, params0, batch in _cost_workloads(quick):
        cases = []
        k = 0
        for label, make in (
            ("jdls classic", jdls.DynamicScale),
            ("PyTorch", jdls.presets.pytorch),
            ("AdaptiveScale", jdls.AdaptiveScale),
        ):
            tx = jdls.wrap(optax.adam(1e-4), make())

            @functools.partial(jax.jit, donate_argnums=0)
            def step(carry: Any, tx: Any = tx, loss: Any = loss, batch: Any = batch) -> Any:
                params, opt_state = carry
                scale = jdls.get_scale(opt_state)
                _, grads = scale.value_and_grad(loss)(params, batch)
                updates, opt_state = tx.update(grads, opt_state, params)
                return optax.apply_updates(params, updates), opt_state

            params = jax.tree_util.tree_map(jnp.copy, params0)
            box = [(params, tx.init(params))]
            for _ in range(3):  # compile, settle the scale
                box[0] = step(box[0])
            jax.block_until_ready(box[0])
            if not k:  # from the first rule's step time
                start = time.perf_counter()
                for _ in range(5):
                    box[0] = step(box[0])
                jax.block_until_ready(box[0])
                k = max(1, round(SAMPLE_SECONDS * 5 / (time.perf_counter() - start)))

            def run(step: Any = step, box: list[Any] = box, k: int = k) -> None:
                for _ in range(k):
                    box[0] = step(box[0])
                jax.block_until_ready(box[0])

            cases.append(h.Case(f"{group}: {label}", run, group=group, info={"steps": k}))
        rows += h.time_cases(cases, rounds=rounds)
    for row in rows:  # per step
        for key in ("median_ms", "q1_ms", "q3_ms", "iqr_ms", "min_ms"):
            row[key] /= row["steps"]
        row["times_ms"] = [t / row["steps"] for t in row["times_ms"]]
    return rows


def suite_step_cost(quick: bool = False, rounds: int | None = None) -> list[h.Section]:
    """The step cost of the default scale against the classic rule, alone."""
    return [_cost_section(quick, rounds)]


def _cost_section(quick: bool, rounds: int | None) -> h.Section:
    return h.Section(
        "step cost",
        "one jitted float16 train step (adam) per sample of several steps, rounds "
        "interleaved; ratio: median of the per-round ratios to the classic rule. MLP width "
        "64/512: the quality suite's digits MLP; MLP 8.4M and transformer 3.7M: the models "
        "of `python -m benchmarks step` and `transformer`",
        step_cost(rounds or (3 if quick else 60), quick),
    )


# --------------------------------------------------------------------------------------------
# The suite.
# --------------------------------------------------------------------------------------------

COLUMNS = (
    ("label", "rule", ""),
    ("metric", "metric", ".4f"),
    ("metric_std", "± (seeds)", ".4f"),
    ("skipped", "skipped", ".1f"),
    ("settle", "settle step", ".0f"),
    ("final_scale_log2", "final scale (log2)", ".0f"),
    ("flushed_pct", "signal flushed %", ".2f"),
    ("seconds", "seconds", ".1f"),
)


def suite(quick: bool = False, rounds: int | None = None) -> list[h.Section]:
    """One section per task (every rule) and the step-cost table."""
    sections = []
    seeds = 2 if quick else SEEDS
    todo = tasks(quick)
    families: dict[tuple[str, str], list[Task]] = {}
    for task in todo:
        families.setdefault(_family(task), []).append(task)
    rows_of: dict[str, list[dict[str, Any]]] = {t.name: [] for t in todo}
    for family in families.values():
        for name, make in rules(quick).items():
            h.log(f"quality: {', '.join(t.name for t in family)} / {name}")
            fmt = "float32" if name == "float32" else family[0].fmt
            for task, r in zip(family, train_family(family, make, fmt, seeds), strict=True):
                rows_of[task.name].append({"label": name, **r})
    for task in todo:
        rows = rows_of[task.name]
        note = (
            f"{task.why}. {task.steps} steps, {seeds} seeds, {task.fmt}; metric: {task.metric}"
            + (" (lower is better)" if task.lower else "")
        )
        sections.append(
            h.Section(
                task.name,
                note,
                rows,
                COLUMNS,
                {"steps": task.steps, "metric": task.metric, "kind": task.kind, "why": task.why},
            )
        )
    sections.append(_cost_section(quick, rounds))
    return sections


# --------------------------------------------------------------------------------------------
# Plots: python -m benchmarks.bench_quality [RESULTS_JSON] [PNG]
# --------------------------------------------------------------------------------------------


def plot(results: str, out: str) -> None:
    """The loss scale (log2) every rule used at every step, one panel per task (seed 0)."""
    import json

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = json.loads(Path(results).read_text())
    sections = [s for s in data["sections"] if s["rows"] and "scale_trace" in s["rows"][0]]
    cols = 4
    rows_ = math.ceil(len(sections) / cols)
    fig, axes = plt.subplots(rows_, cols, figsize=(4.2 * cols, 3.2 * rows_), squeeze=False)
    styles = ["-", "--", ":", "-.", "-", "--", ":", "-"]
    for ax, section in zip(axes.flat, sections, strict=False):
        i = 0
        for row in section["rows"]:
            if row["label"] in ("float32", "no scaling"):
                continue
            style = {"lw": 2.2, "color": "k"} if row["label"] == "AdaptiveScale" else {"lw": 1.1}
            ax.plot(row["scale_trace"], styles[i % len(styles)], label=row["label"], **style)
            i += 1
        ax.set_title(section["title"], fontsize=10)
        ax.set_ylabel("log2 loss scale", fontsize=8)
        ax.set_xlabel("step", fontsize=8)
        ax.grid(True, alpha=0.3)
    for ax in list(axes.flat)[len(sections) :]:
        ax.axis("off")
    axes[0, 0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=90)
    plt.close(fig)


if __name__ == "__main__":
    import sys

    args = sys.argv[1:]
    plot(
        args[0] if args else str(h.RESULTS_DIR / "quality.json"),
        args[1] if len(args) > 1 else "docs/img/quality.png",
    )
