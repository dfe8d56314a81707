"""FP8 quality: every per-tensor FP8 scaling recipe on tasks chosen to tell them apart, several
seeds each.

Recipes (columns, :data:`RECIPES`): jdls's ``DelayedScaling`` (max over 1,024 steps, max over
16, the most recent of 16), ``CurrentScaling``, the presets that mirror Flax's ``fp8_ops`` and
TransformerEngine's ``DelayedScaling``, and ``AdaptiveScaling`` where ``jdls.fp8`` has it. A
recipe equal to one before it in the table (``transformer_engine()`` is
``DelayedScaling()``) computes the same numbers and is not run again. The loss table adds a
reference column without FP8 (the same model with plain dots: bfloat16 compute, float16 in the
loss-scaling task).

Tasks (rows, :data:`TASKS`, each with the reason it is here): gradient spikes, slow drift up
and down, a permanent jump, warm-up from a small initialisation, outlier input channels,
float16 loss scaling that grows and backs off, and a long run. The events act on one FP8 dot
(``EVENT_LAYER`` of the MLP; in the LM, every dot below the blocks' output) and are
*compensated*: the dot sees its input multiplied by ``a`` and its output gradient by ``c``
while the model computes the same function and the same gradients (``bench_fp8.event_gate``
divides them back out), so the final loss differs between recipes only by what FP8 lost. (An
uncompensated spike reaches Adam, whose second moment then shrinks the updates for thousands
of steps unless the FP8 dot clipped it: the loss would reward clipping.) The overflows injected
in the loss-scaling task are not compensated: they are infs, and the step is skipped.

Models: a 4-layer MLP (64-128-128-128-10) of ``jdls.fp8.dot_general`` dots with sites from
``jdls.fp8.init`` on scikit-learn's digits, bfloat16 compute, Adam, every task, 3 seeds; and
the scanned, rematerialised character LM of ``benchmarks/bench_fp8.py`` (its four projections
per block FP8, ``jdls.fp8.linen.DotGeneral``) on spikes, drift down and loss scaling, 2
seeds. Every run is one ``lax.scan`` under ``jit``; the event factors, the initial gain and the
outliers are inputs, so each recipe compiles once per model and family (same length and
compute dtype) and the tasks and seeds of a family are ``vmap`` axes. The sites are updated
by ``jdls.linen.TrainState`` (``apply_gradients``), skip-aware.

Tables per model, recipes as columns and tasks as rows, means over seeds:

* steps with a scale over 8x (100x) the amax: the fraction of steps in which some dot's scale
  was more than 8x (100x) above that step's amax, for any of lhs, rhs and grad:
  ``scale * fmax > 8 * amax`` with ``scale`` the site's scale before the step's update (the
  one the step quantized with) and ``amax`` the step's measurement
  (``site.value.meter.<role>.amax`` after the update). A recipe whose state holds no scale
  (current scaling) scales by the step's own amax. Amaxes that are 0 or not finite are left
  out;
* clipped steps: the fraction of steps in which some dot and role saturated a value
  (telemetry ``saturated > 0``). This also counts a largest value that ``x / scale`` put one
  float32 ulp above ``fmax``, which the clip does not change, so:
* steps whose amax the clip changed: the fraction of steps in which some dot's amax lay more
  than half an ulp of the format above ``scale * fmax`` (:func:`clip_limit`);
* output-gradient values flushed to zero: the ``grad`` role's ``flushed``, averaged over dots
  and steps, in percent;
* final loss: the MLP's float32 cross-entropy on the whole training set at the end (computed
  without FP8), the LM's test loss at the end (bfloat16 dots, no FP8), mean and standard
  deviation over seeds;
* skipped steps, in the tasks where some run skipped one.

The JSON has the same per role (``... (lhs)``), as step counts, and every seed's loss.

Run::

    python -m benchmarks fp8-quality          # about 10 minutes on 2 cores
    python -m benchmarks fp8-quality --quick  # a smoke test: the MLP only, 2 tasks, 2 recipes
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

import jdls
from benchmarks import _harness as h
from benchmarks.bench_fp8 import CharLM, event_gate, load_text, test_set
from benchmarks.bench_quality import digits
from jdls import fp8

F32, BF16, F16 = jnp.float32, jnp.bfloat16, jnp.float16
ROLES = ("lhs", "rhs", "grad")


# --------------------------------------------------------------------------------------------
# Recipes: one row per column of the tables. ``make`` returns the recipe, or None where this
# jdls does not have it (the column is then left out).
# --------------------------------------------------------------------------------------------


def _adaptive() -> Any:
    cls = getattr(fp8, "AdaptiveScaling", None)
    return None if cls is None else cls()


RECIPES: tuple[tuple[str, Callable[[], Any]], ...] = (
    ("DelayedScaling()", lambda: fp8.DelayedScaling()),
    ("DelayedScaling(16)", lambda: fp8.DelayedScaling(16)),
    ('DelayedScaling(16, "most_recent")', lambda: fp8.DelayedScaling(16, "most_recent")),
    ("CurrentScaling()", lambda: fp8.CurrentScaling()),
    ("flax_fp8_ops()", lambda: fp8.flax_fp8_ops()),
    ("transformer_engine()", lambda: fp8.transformer_engine()),
    ("AdaptiveScaling()", _adaptive),
)
#: The reference column of the loss tables: the same model with plain (non-FP8) dots.
REFERENCE = "no FP8"
QUICK_RECIPES = ("DelayedScaling(16)", "CurrentScaling()")


def recipes(quick: bool = False) -> dict[str, Any]:
    """Label -> recipe, those this jdls has (quick: :data:`QUICK_RECIPES`)."""
    out = {label: make() for label, make in RECIPES if not quick or label in QUICK_RECIPES}
    return {label: r for label, r in out.items() if r is not None}


# --------------------------------------------------------------------------------------------
# Tasks: the event factors are functions of the run's length, so that the MLP and the LM (fewer
# steps) see the same events.
# --------------------------------------------------------------------------------------------

SPIKE, SPIKES = 1e4, 10
DRIFT = 2.0**9  # the whole drift over a run (about x1.021 per step over 300 steps)
JUMP = 100.0
SMALL_INIT = 0.3  # the warm-up task's initial weights, times He's
OUTLIER, OUTLIER_P, OUTLIER_CHANNELS = 100.0, 0.005, (19, 27, 36, 44)
GROWTH_INTERVAL = 10  # the loss-scaling task's jdls.DynamicScale(growth_interval=...)
OVERFLOW_EVERY = 50  # ... and an overflow (an inf output gradient) injected this often


def _ones(n: int) -> np.ndarray:
    return np.ones(n, np.float32)


def _spikes(n: int) -> np.ndarray:
    f = _ones(n)
    steps = n // 3 + max(1, n // 30) * np.arange(SPIKES)
    f[steps[steps < n]] = SPIKE
    return f


def _drift(total: float) -> Callable[[int], np.ndarray]:
    return lambda n: (total ** (np.arange(n) / n)).astype(np.float32)


def _jump(n: int) -> np.ndarray:
    return np.where(np.arange(n) < n // 3, 1.0, JUMP).astype(np.float32)


def _overflows(n: int) -> np.ndarray:
    f = _ones(n)
    f[OVERFLOW_EVERY - 1 :: OVERFLOW_EVERY] = np.inf
    return f


@dataclasses.dataclass(frozen=True)
class Task:
    """One row of the tables, and why it is in the suite.

    Attributes:
      lhs, grad: per-step factors (a function of the run's length) on the event dot's input
        and output gradient, compensated (the model's function and gradients do not change).
      gain: the MLP's initial weights are He's times ``gain``.
      outliers: the outlier channels' factor (1: none).
      loss_scaling: float16 compute with ``jdls.DynamicScale(growth_interval=GROWTH_INTERVAL)``
        and an overflow every ``OVERFLOW_EVERY`` steps (an inf output gradient, uncompensated:
        the step is skipped and the scale backs off), instead of bfloat16 without loss scaling.
      length: the run's length in units of the suite's steps.
      lm: also run on the character LM.
    """

    name: str
    why: str
    lhs: Callable[[int], np.ndarray] = _ones
    grad: Callable[[int], np.ndarray] = _ones
    gain: float = 1.0
    outliers: float = 1.0
    loss_scaling: bool = False
    length: int = 1
    lm: bool = False


TASKS: tuple[Task, ...] = (
    Task(
        "spikes",
        f"ten steps whose output gradient is x{SPIKE:.0e} (from a third of the run, evenly "
        "spaced over a thirtieth of it each): `max` over a long history keeps the spike's "
        "scale for the whole window; `most_recent` clips each spike, and the step after it "
        "uses the spike's scale",
        grad=_spikes,
        lm=True,
    ),
    Task(
        "drift up",
        f"input and output gradient of one dot grow x{DRIFT:.0f} over the run (x1.02 per step "
        "at 300 steps): every delayed recipe is one step behind and clips a little on many "
        "steps; current scaling is never behind",
        lhs=_drift(DRIFT),
        grad=_drift(DRIFT),
    ),
    Task(
        "drift down",
        f"input and output gradient of one dot shrink x{DRIFT:.0f} over the run: `max` over "
        "1,024 steps stays at the first steps' amax (the scale ends hundreds of times too "
        "coarse), a 16-step window follows",
        lhs=_drift(1 / DRIFT),
        grad=_drift(1 / DRIFT),
        lm=True,
    ),
    Task(
        "jump",
        f"input and output gradient of one dot x{JUMP:.0f} from a third of the run on: every "
        "delayed recipe clips the step of the jump (its amax 100x above its scale's), then "
        "follows; current scaling does not clip",
        lhs=_jump,
        grad=_jump,
    ),
    Task(
        "warm-up",
        f"weights initialised at {SMALL_INIT} x He's (the MLP's logits start about 100x "
        "smaller): activations and gradients grow by orders of magnitude in the first steps "
        "as Adam grows the weights, so every delayed recipe is behind a rising amax; the "
        "first step of each uses its initial scale 1",
        gain=SMALL_INIT,
    ),
    Task(
        "outlier channels",
        f"{len(OUTLIER_CHANNELS)} input features x{OUTLIER:.0f} in {OUTLIER_P:.1%} of the "
        "examples: about half the batches hold an outlier, so the first dot's input amax "
        "jumps between 1 and 100 from step to step; `max` keeps the scale at 100 (100x "
        "headroom on half the steps), `most_recent` clips every batch with outliers after "
        "one without",
        outliers=OUTLIER,
    ),
    Task(
        "loss scaling",
        "float16 compute, jdls.DynamicScale(growth_interval="
        f"{GROWTH_INTERVAL}) from 2**15 and an overflow every {OVERFLOW_EVERY} steps: the loss "
        "scale changes about 40 times in 300 steps, and the output gradient a dot sees moves "
        "with it. Inside jdls's value_and_grad each dot is told the loss scale (docs/fp8.md, "
        "FP8 with loss scaling), so no recipe should clip at a growth or coarsen after a "
        "back-off; where a dot is not told, each growth is a x2 jump and each back-off a /2 "
        "that `max` over a long history keeps for its whole window",
        grad=_overflows,
        loss_scaling=True,
        lm=True,
    ),
    Task(
        "long run",
        "4x the steps, no event: the gradients shrink as the training loss falls; `max` over "
        "1,024 steps holds the early, larger amaxes, and its window rolls over",
        length=4,
    ),
)

QUICK_TASKS = ("spikes", "loss scaling")  # on the MLP only


def tasks(quick: bool = False) -> list[Task]:
    return [t for t in TASKS if not quick or t.name in QUICK_TASKS]


# --------------------------------------------------------------------------------------------
# Configurations.
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class MlpConfig:
    steps: int = 300
    seeds: int = 3
    batch: int = 128
    widths: tuple[int, ...] = (64, 128, 128, 128, 10)
    lr: float = 1e-3
    warmup: int = 10


@dataclasses.dataclass(frozen=True)
class LmConfig:
    steps: int = 120
    seeds: int = 2
    batch: int = 16
    seq: int = 32
    dim: int = 64
    heads: int = 4
    layers: int = 2
    lr: float = 3e-3
    warmup: int = 10


#: The MLP dot whose input and output gradient the events scale (the second of four).
EVENT_LAYER = 1


def configs(quick: bool) -> tuple[MlpConfig, LmConfig]:
    """The models' configurations (quick: a smaller MLP, fewer steps; the LM is not run)."""
    if quick:
        return MlpConfig(steps=30, seeds=2, widths=(64, 32, 32, 10)), LmConfig()
    return MlpConfig(), LmConfig()


def _task_data(task: Task, steps: int) -> dict[str, np.ndarray]:
    n = steps * task.length
    return {
        "lhs": task.lhs(n).astype(np.float32),
        "grad": task.grad(n).astype(np.float32),
        "gain": np.float32(task.gain),
        "outliers": np.float32(task.outliers),
    }


def _optimizer(lr: float, warmup: int, scale: jdls.LossScale) -> optax.GradientTransformation:
    # A constant rate after a short warm-up: the same schedule whatever the run's length.
    schedule = optax.linear_schedule(lr / warmup, lr, warmup)
    return jdls.wrap(optax.adam(schedule), scale)


def _loss_scale(task: Task) -> jdls.LossScale:
    if task.loss_scaling:
        return jdls.DynamicScale(growth_interval=GROWTH_INTERVAL)
    return jdls.NoOpScale()


# --------------------------------------------------------------------------------------------
# What a step measured: per role and dot, the scale used against the amax.
# --------------------------------------------------------------------------------------------


def _fmax(recipe: Any, role: str) -> float:
    return fp8.format_max(recipe.formats.backward if role == "grad" else recipe.formats.forward)


def clip_limit(fmt: Any) -> float:
    """``(fmax + ulp / 2) / fmax`` of an element format: an amax above ``scale * fmax`` times
    this was clipped to a different value than it would have rounded to (below it, the clip
    only undoes a rounding, as when the scale maps the amax itself to ``fmax`` up to float32
    rounding)."""
    fmax = fp8.format_max(fmt)
    mantissa = getattr(fmt, "mantissa_bits", None)
    if mantissa is None:
        mantissa = jnp.finfo(fmt).nmant
    ulp = 2.0 ** (math.floor(math.log2(fmax)) - mantissa)
    return 1 + ulp / 2 / fmax


def _scale_used(recipe: Any, state: Any, amax: jax.Array, fmax: float) -> jax.Array:
    """The scale a step quantized with: the state's (delayed recipes), or, for a recipe that
    keeps none (current scaling), the one of the step's own amax."""
    scale = getattr(state, "scale", None)
    if scale is not None:
        return scale
    margin, power_of_two = getattr(recipe, "margin", 0), getattr(recipe, "power_of_two", False)
    return fp8.scale_from_amax(amax, jnp.ones_like(amax), fmax, margin, power_of_two)


def site_record(recipe: Any, old: Any, new: Any) -> dict[str, jax.Array]:
    """Per role (lhs, rhs, grad) and dot: ``scale * fmax / amax`` of the step (1 where the
    amax is 0 or not finite, or the site did not serve one use), and the saturated and flushed
    fractions. ``old``: the sites before the step's update, ``new``: after it."""
    olds = [s for s in jax.tree.leaves(old, is_leaf=jdls.is_site) if jdls.is_site(s)]
    news = [s for s in jax.tree.leaves(new, is_leaf=jdls.is_site) if jdls.is_site(s)]
    ratio, saturated, flushed, overshoot = [], [], [], []
    for role in ROLES:
        fmax = _fmax(recipe, role)
        limit = clip_limit(recipe.formats.backward if role == "grad" else recipe.formats.forward)
        r, s, f = [], [], []
        for o, n in zip(olds, news, strict=True):
            m = getattr(n.value.meter, role)
            scale = _scale_used(recipe, getattr(o.value, role), m.amax, fmax)
            ok = jnp.isfinite(m.amax) & (m.amax > 0) & (n.value.uses == 1)
            safe = jnp.where(ok, m.amax, 1.0)
            r.append(jnp.where(ok, scale * fmax / safe, 1.0).reshape(-1))
            s.append(jnp.where(n.value.uses == 1, m.saturated, 0.0).reshape(-1))
            f.append(jnp.where(n.value.uses == 1, m.flushed, 0.0).reshape(-1))
        ratio.append(jnp.concatenate(r))
        saturated.append(jnp.concatenate(s))
        flushed.append(jnp.concatenate(f))
        overshoot.append(ratio[-1] * limit < 1)
    return {
        "ratio": jnp.stack(ratio),  # (3, dots)
        "saturated": jnp.stack(saturated),
        "flushed": jnp.stack(flushed),
        "overshoot": jnp.stack(overshoot),
    }


# --------------------------------------------------------------------------------------------
# The MLP: jdls.fp8.dot_general with sites from jdls.fp8.init, one per layer.
# --------------------------------------------------------------------------------------------


def _dot(x: jax.Array, w: jax.Array, site: Any) -> jax.Array:
    dims = (((x.ndim - 1,), (0,)), ((), ()))
    if site is None:
        return lax.dot_general(x, w, dims)
    return fp8.dot_general(x, w, dims, site=site)


def event_dot(x: jax.Array, w: jax.Array, site: Any, a: jax.Array, c: jax.Array) -> jax.Array:
    """``x @ w`` whose dot sees the input times ``a`` and the output gradient times ``c``;
    the result and the gradients of ``x`` and ``w`` are those of ``x @ w``."""
    k = 1.0 / (a * c)
    xs = event_gate(x, k) * a.astype(x.dtype)
    z = _dot(xs, event_gate(w, k), site)
    return event_gate(z / a.astype(z.dtype), c * a)


def mlp_init(key: jax.Array, widths: tuple[int, ...], gain: jax.Array) -> list[dict[str, Any]]:
    keys = jax.random.split(key, len(widths) - 1)
    return [
        {
            "w": jax.random.normal(k, (m, n)) * math.sqrt(2.0 / m) * gain,
            "b": jnp.zeros(n),
        }
        for k, m, n in zip(keys, widths[:-1], widths[1:], strict=True)
    ]


def mlp_apply(
    params: Any, sites: Any, x: jax.Array, a: jax.Array, c: jax.Array, dtype: Any
) -> jax.Array:
    h_ = x.astype(dtype)
    for i, p in enumerate(params):
        site = None if sites is None else sites[i]
        w = p["w"].astype(dtype)
        h_ = event_dot(h_, w, site, a, c) if i == EVENT_LAYER else _dot(h_, w, site)
        h_ = h_ + p["b"].astype(dtype)
        if i < len(params) - 1:
            h_ = jax.nn.relu(h_)
    return h_.astype(F32)


def _record(recipe: Any, state: Any, new: Any, loss: jax.Array) -> dict[str, jax.Array]:
    rec = {
        "loss": loss,
        "finite": jdls.stats(new.opt_state).finite,
        "loss_scale": state.loss_scale,
    }
    if recipe is not None:
        rec.update(site_record(recipe, state.sites, new.sites))
    return rec


def make_mlp_run(
    recipe: Any, family: list[Task], cfg: MlpConfig
) -> Callable[[], dict[str, np.ndarray]]:
    """The jitted runs of one recipe (None: no FP8) on a family of tasks (same length and
    compute), tasks x seeds vmapped."""
    xtr, _, ytr, _ = (jnp.asarray(a) for a in digits())
    task0 = family[0]
    steps = cfg.steps * task0.length
    dtype = F16 if task0.loss_scaling else BF16
    channels = jnp.zeros(cfg.widths[0], bool).at[jnp.asarray(OUTLIER_CHANNELS)].set(True)

    def one(seed: jax.Array, d: dict[str, jax.Array]) -> dict[str, jax.Array]:
        key = jax.random.key(seed)
        params = mlp_init(jax.random.fold_in(key, 0), cfg.widths, d["gain"])
        sites = None if recipe is None else [fp8.init(recipe) for _ in params]
        tx = _optimizer(cfg.lr, cfg.warmup, _loss_scale(task0))
        state = jdls.linen.TrainState.create(apply_fn=None, params=params, tx=tx, sites=sites)

        def body(state: Any, t: jax.Array) -> tuple[Any, dict[str, jax.Array]]:
            k = jax.random.fold_in(key, t + 1)
            idx = jax.random.randint(k, (cfg.batch,), 0, len(xtr))
            x, y = xtr[idx], ytr[idx]
            hit = jax.random.bernoulli(jax.random.fold_in(k, 1), OUTLIER_P, (cfg.batch, 1))
            x = jnp.where(hit & channels, x * d["outliers"], x)
            a, c = d["lhs"][t], d["grad"][t]

            def loss_fn(v: dict[str, Any]) -> jax.Array:
                logits = mlp_apply(v["params"], v.get("jdls"), x, a, c, dtype)
                return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

            loss, grads = state.value_and_grad(loss_fn)(state.variables)
            new = state.apply_gradients(grads=grads)
            return new, _record(recipe, state, new, loss)

        state, trace = lax.scan(body, state, jnp.arange(steps))
        logits = mlp_apply(state.params, None, xtr, F32(1), F32(1), F32)
        trace["final_loss"] = optax.softmax_cross_entropy_with_integer_labels(logits, ytr).mean()
        return trace

    return _vmapped(one, family, cfg.steps, cfg.seeds)


def _vmapped(
    one: Callable[..., Any], family: list[Task], steps: int, seeds: int
) -> Callable[[], dict[str, np.ndarray]]:
    data = [_task_data(t, steps) for t in family]
    data = jax.tree.map(lambda *a: np.repeat(np.stack(a), seeds, axis=0), *data)
    seed_ids = np.tile(np.arange(seeds), len(family))
    run = jax.jit(jax.vmap(one))
    return lambda: jax.device_get(run(seed_ids, data))


# --------------------------------------------------------------------------------------------
# The character LM of bench_fp8: the events act on the output gradient of the blocks (every
# FP8 dot sees them), compensated by dividing the gradients below the gate.
# --------------------------------------------------------------------------------------------

BELOW_GATE = ("Embed_0", "pos", "blocks")


@functools.cache
def _text() -> tuple[np.ndarray, np.ndarray]:
    data = load_text()
    split = int(0.9 * len(data))
    return data[:split], data[split:]


def make_lm_run(
    recipe: Any, family: list[Task], cfg: LmConfig
) -> Callable[[], dict[str, np.ndarray]]:
    """As :func:`make_mlp_run`, for ``bench_fp8.CharLM``."""
    train, test = _text()
    train = jnp.asarray(train.astype(np.int32))
    xt, yt = (jnp.asarray(a) for a in test_set(test, cfg.seq))
    task0 = family[0]
    steps = cfg.steps * task0.length
    dtype = F16 if task0.loss_scaling else BF16
    dot = None if recipe is None else functools.partial(fp8.linen.DotGeneral, recipe=recipe)
    model = CharLM(cfg.dim, cfg.heads, cfg.layers, dot, dtype=dtype)
    plain = CharLM(cfg.dim, cfg.heads, cfg.layers, None)

    def window(start: jax.Array) -> jax.Array:
        return lax.dynamic_slice(train, (start,), (cfg.seq + 1,))

    def one(seed: jax.Array, d: dict[str, jax.Array]) -> dict[str, jax.Array]:
        key = jax.random.key(seed)
        variables = model.init(key, xt[:2], jnp.float32(1.0))
        tx = _optimizer(cfg.lr, cfg.warmup, _loss_scale(task0))
        state = jdls.linen.TrainState.create(
            apply_fn=model.apply, params=variables["params"], tx=tx, sites=variables.get("jdls")
        )

        def body(state: Any, t: jax.Array) -> tuple[Any, dict[str, jax.Array]]:
            k = jax.random.fold_in(key, t + 1)
            starts = jax.random.randint(k, (cfg.batch,), 0, len(train) - cfg.seq - 1)
            chunk = jax.vmap(window)(starts)
            x, y = chunk[:, :-1], chunk[:, 1:]
            c = d["grad"][t]

            def loss_fn(v: dict[str, Any]) -> jax.Array:
                logits = state.apply_fn(v, x, c)
                return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

            loss, grads = state.value_and_grad(loss_fn)(state.variables)
            # the gate multiplied every gradient below it by c: undo it (an inf stays: the
            # injected overflow is meant to be skipped)
            undo = jnp.where(jnp.isfinite(c), c, 1.0)
            params = {
                name: jax.tree.map(lambda g: g / undo, g) if name in BELOW_GATE else g
                for name, g in grads["params"].items()
            }
            grads = {**grads, "params": params}
            new = state.apply_gradients(grads=grads)
            return new, _record(recipe, state, new, loss)

        state, trace = lax.scan(body, state, jnp.arange(steps))
        logits = plain.apply({"params": state.params}, xt, jnp.float32(1.0))
        trace["final_loss"] = optax.softmax_cross_entropy_with_integer_labels(logits, yt).mean()
        return trace

    return _vmapped(one, family, cfg.steps, cfg.seeds)


# --------------------------------------------------------------------------------------------
# Summaries.
# --------------------------------------------------------------------------------------------


def summarize(trace: dict[str, np.ndarray]) -> dict[str, Any]:
    """The numbers of one recipe on one task from its traces (leading axis: seeds)."""
    loss = np.asarray(trace["final_loss"], np.float64)
    out: dict[str, Any] = {
        "loss": float(loss.mean()),
        "loss_std": float(loss.std()),
        "loss_per_seed": loss.tolist(),
        "skipped": float((~np.asarray(trace["finite"])).sum(axis=1).mean()),
    }
    scales = np.asarray(trace["loss_scale"])
    out["loss_scale_changes"] = float((np.diff(scales, axis=1) != 0).sum(axis=1).mean())
    if "ratio" not in trace:
        return out
    ratio = np.asarray(trace["ratio"])  # seeds, steps, roles, dots
    saturated = np.asarray(trace["saturated"])
    flushed = np.asarray(trace["flushed"])
    for name, flags in (
        ("over8", (ratio > 8).any(axis=-1)),
        ("over100", (ratio > 100).any(axis=-1)),
        ("clipped", (saturated > 0).any(axis=-1)),
        ("overshoot", np.asarray(trace["overshoot"]).any(axis=-1)),
    ):
        out[name] = float(flags.any(axis=-1).mean())  # any role, fraction of steps
        out[f"{name}_steps"] = float(flags.any(axis=-1).sum(axis=1).mean())
        for i, role in enumerate(ROLES):
            out[f"{name}_{role}"] = float(flags[..., i].mean())
    out["grad_flushed_pct"] = 100 * float(flushed[:, :, 2, :].mean())
    out["median_log2_headroom"] = float(np.median(np.log2(ratio)))
    return out


#: The metric tables: key in the summary, title, format, note.
METRICS = (
    (
        "over8",
        "steps with a scale over 8x the amax",
        ".2f",
        "fraction of steps in which some dot's scale (the site's, before the step's update) "
        "mapped more than 8x the step's measured amax to the format's maximum, any of lhs, "
        "rhs and grad; mean over seeds",
    ),
    (
        "over100",
        "steps with a scale over 100x the amax",
        ".2f",
        "as above, more than 100x: 6.6 binades of the format unused at the top",
    ),
    (
        "clipped",
        "clipped steps",
        ".2f",
        "fraction of steps in which some dot saturated a value of lhs, rhs or grad "
        "(telemetry `saturated > 0`); mean over seeds",
    ),
    (
        "overshoot",
        "steps whose amax the clip changed",
        ".2f",
        "fraction of steps in which some dot's amax lay more than half an ulp of the format "
        "above `scale * fmax` (its clipped value differs from its rounded one; `saturated > "
        "0` also counts a largest value that the float32 arithmetic of `x / scale` put 1 ulp "
        "above `fmax`, as current scaling does on most steps); mean over seeds",
    ),
    (
        "grad_flushed_pct",
        "output-gradient values flushed to zero (%)",
        ".3f",
        "mean over steps and dots of the grad role's `flushed` (non-zero values that became "
        "zero, over all values), percent; mean over seeds",
    ),
)


def _cell(summary: dict[str, Any] | None, key: str) -> Any:
    if summary is None:
        return None
    if key == "loss":
        return f"{summary['loss']:.4f} ± {summary['loss_std']:.4f}"
    return summary.get(key)


def sections_for(
    model: str,
    todo: list[Task],
    results: dict[str, dict[str, dict[str, Any]]],
    labels: list[str],
    config: dict[str, Any],
    same_as: dict[str, str],
) -> list[h.Section]:
    """One section per metric, tasks as rows and recipes as columns; ``results[task][label]``."""
    sections = []
    loss = (
        "float32 cross-entropy on the whole training set at the end, computed without FP8"
        if model == "MLP"
        else "test loss at the end (64 windows of the held-out text), computed with bfloat16 "
        "dots, no FP8"
    )
    tables = [(key, title, spec, note, labels) for key, title, spec, note in METRICS]
    tables.append(
        (
            "loss",
            "final loss",
            "",
            f"{loss}; mean ± standard deviation over seeds. `{REFERENCE}`: the same model "
            "with plain dots (bfloat16 compute; float16 with the same loss scaling in the "
            "loss-scaling task)",
            [REFERENCE, *labels],
        )
    )
    tables.append(
        (
            "skipped",
            "skipped steps",
            ".1f",
            "steps skipped by `jdls.wrap` (gradients not finite), mean over seeds, in the tasks "
            "where some run skipped one; with `loss_scaling` the loss scale's changes "
            "(`... (loss-scale changes)` in the JSON)",
            [REFERENCE, *labels],
        )
    )
    for key, title, spec, note, cols in tables:
        rows = []
        for task in todo:
            if key == "skipped" and not any(
                results[task.name][label]["skipped"]
                for label in cols
                if label in results[task.name]
            ):
                continue
            row: dict[str, Any] = {"label": task.name}
            for label in cols:
                summary = results[task.name].get(label)
                row[label] = _cell(summary, key)
                if key == "skipped" and summary is not None:
                    row[f"{label} (loss-scale changes)"] = summary["loss_scale_changes"]
                if key == "loss" and summary is not None:
                    row[f"{label} (mean)"] = summary["loss"]
                    row[f"{label} (std)"] = summary["loss_std"]
                    row[f"{label} (per seed)"] = summary["loss_per_seed"]
                if key in ("over8", "over100", "clipped", "overshoot") and summary is not None:
                    row[f"{label} (steps)"] = summary[f"{key}_steps"]
                    for role in ROLES:
                        row[f"{label} ({role})"] = summary[f"{key}_{role}"]
            rows.append(row)
        if not rows:
            continue
        dup = "".join(f"; `{a}` is the same recipe as `{b}`" for a, b in same_as.items())
        columns = [("label", "task", ""), *((c, c, spec) for c in cols)]
        sections.append(h.Section(f"{model}: {title}", note + dup, rows, columns, dict(config)))
    return sections


def _task_section(todo: list[Task], mlp: MlpConfig, lm: LmConfig | None) -> h.Section:
    rows = [
        {
            "label": t.name,
            "why": t.why,
            "mlp_steps": mlp.steps * t.length,
            "lm_steps": lm.steps * t.length if lm is not None and t.lm else None,
        }
        for t in todo
    ]
    note = (
        f"MLP {'-'.join(map(str, mlp.widths))} on digits, batch {mlp.batch}, {mlp.seeds} "
        f"seeds, Adam {mlp.lr:g}, the events on dot {EVENT_LAYER}"
    )
    if lm is not None:
        note += (
            f"; LM: bench_fp8.CharLM dim {lm.dim}, {lm.layers} layers, batch {lm.batch} x "
            f"{lm.seq}, {lm.seeds} seeds, Adam {lm.lr:g}, the events on the blocks' output "
            "gradient"
        )
    columns = (
        ("label", "task", ""),
        ("mlp_steps", "MLP steps", ""),
        ("lm_steps", "LM steps", ""),
        ("why", "why", ""),
    )
    return h.Section("tasks", note, rows, columns)


def _families(todo: list[Task]) -> list[list[Task]]:
    groups: dict[tuple[bool, int], list[Task]] = {}
    for t in todo:
        groups.setdefault((t.loss_scaling, t.length), []).append(t)
    return list(groups.values())


def run_model(
    model: str,
    todo: list[Task],
    table: dict[str, Any],
    cfg: Any,
) -> tuple[dict[str, dict[str, dict[str, Any]]], dict[str, float]]:
    """Every recipe (and the reference) on every task of ``todo``: ``results[task][label]``
    and the seconds per label."""
    make = make_mlp_run if model == "MLP" else make_lm_run
    results: dict[str, dict[str, dict[str, Any]]] = {t.name: {} for t in todo}
    seconds: dict[str, float] = {}
    done: dict[Any, str] = {}
    for label, recipe in [(REFERENCE, None), *table.items()]:
        if recipe is not None and recipe in done:
            for task in todo:
                results[task.name][label] = results[task.name][done[recipe]]
            continue
        start = time.perf_counter()
        for family in _families(todo):
            begin = time.perf_counter()
            out = make(recipe, family, cfg)()
            h.log(
                f"fp8-quality: {model} / {label} / {', '.join(t.name for t in family)}: "
                f"{time.perf_counter() - begin:.1f} s"
            )
            seeds = cfg.seeds
            for i, task in enumerate(family):
                part = {k: np.asarray(v)[i * seeds : (i + 1) * seeds] for k, v in out.items()}
                results[task.name][label] = summarize(part)
        seconds[label] = time.perf_counter() - start
        if recipe is not None:
            done[recipe] = label
    return results, seconds


def suite(quick: bool = False, rounds: int | None = None) -> list[h.Section]:
    """The task list, then per model one table per metric."""
    del rounds  # not a timing suite
    mlp_cfg, lm_cfg = configs(quick)
    table = recipes(quick)
    labels = list(table)
    same_as: dict[str, str] = {}
    for i, label in enumerate(labels):
        for earlier in labels[:i]:
            if table[label] == table[earlier] and label not in same_as:
                same_as[label] = earlier
    todo = tasks(quick)
    sections = [_task_section(todo, mlp_cfg, None if quick else lm_cfg)]
    models: list[tuple[str, Any, list[Task]]] = [("MLP", mlp_cfg, todo)]
    if not quick:  # the LM compiles for a quarter of a minute per recipe and task family
        models.append(("LM", lm_cfg, [t for t in todo if t.lm]))
    for model, cfg, model_tasks in models:
        results, seconds = run_model(model, model_tasks, table, cfg)
        config = {**dataclasses.asdict(cfg), "seconds": seconds}
        sections += sections_for(model, model_tasks, results, labels, config, same_as)
    return sections
