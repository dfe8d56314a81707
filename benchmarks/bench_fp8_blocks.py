"""Block-scaled FP8: the shared exponent's three rounding rules side by side, and the
character-level transformer of ``bench_fp8`` trained with block and per-tensor recipes.

    PYTHONPATH=. python benchmarks/bench_fp8_blocks.py rounding [--blocks 32768]
    PYTHONPATH=. python benchmarks/bench_fp8_blocks.py train [--steps 300] [--variants ...]
    PYTHONPATH=. python benchmarks/bench_fp8_blocks.py fp4 [--steps 300] [--variants ...]

``rounding``: blocks of 32 values ``N(0,1) * exp(3 N(0,1))`` (log-normal magnitudes, as in
the reference measurement of ../shared/reference/fp8-scaling.md, S3), quantized with each rule
and MX element format; per rule: the fraction of blocks whose largest value was clipped, the
fraction of blocks whose largest value exceeded ``fmax`` by more than half an ulp (the clip
changed its rounded value), the fraction of values flushed to zero, the relative L2 error ``|x - q| / |x|`` and the largest
relative error of a block's maximum.

``train``: ``bench_fp8.CharLM`` (scanned, rematerialised, bfloat16 compute) whose four
projections per block are ``jdls.fp8.linen.DotGeneral`` with the given recipe; AdamW, a step
with non-finite gradients skipped by ``jdls.wrap``; the test loss at the end.

``fp4``: the same model, data, steps and optimizer as ``train``, with FP4 recipes against
bfloat16 and jdls's default FP8 recipe (``DelayedScaling(16)``): MXFP4 (``mx("e2m1")``) and
NVIDIA's NVFP4 recipe (``nvfp4()``: stochastic rounding of the output gradients, the random
Hadamard transform of the weight-gradient inputs, 16x16 weight tiles, some dots kept in
bfloat16) and its ablations (``FP4_VARIANTS``). The dots kept in bfloat16 are chosen by
measurement: ``--measure-steps`` steps of ``nvfp4(measure_error=True)`` from the same
initialisation and data, then ``suggest_high_precision(variables, 0.15)``; the chosen dots are
kept (``keep_high_precision``) in the fresh sites of every NVFP4 variant but ``nvfp4-paper``
(the last dots of the last block, as many as the measurement chose: the paper's rule) and
``nvfp4-all`` (none). Per variant: the test loss, the skipped steps, the output gradients'
flushed fraction (telemetry, the mean over the dots and the last ``--tail`` steps), and the
step time as a ratio to bfloat16, measured after training in ``--time-rounds`` interleaved
rounds of one step of every variant of the process (median of the per-round ratios).
"""

from __future__ import annotations

import argparse
import functools
import json
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jdls
from benchmarks.bench_fp8 import CharLM, batches, load_text, test_set
from jdls import fp8

RULES = ("up", "down", "outlier_aware")


def rounding_table(blocks: int, seed: int) -> list[dict[str, Any]]:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((blocks, 32)) * np.exp(3 * rng.standard_normal((blocks, 32)))
    x = jnp.asarray(x.astype(np.float32))
    rows = []
    for fmt in ("e4m3", "e5m2", "e2m3", "e3m2", "e2m1"):
        for rule in RULES:

            @jax.jit
            def measure(x: jax.Array, fmt: str = fmt, rule: str = rule) -> dict[str, jax.Array]:
                q, stats = fp8._block.quantize_and_measure(x, (1, 32), fmt, rule)
                d = fp8.dequantize_blocks(q)
                top = jnp.argmax(jnp.abs(x), axis=1)
                xm = jnp.take_along_axis(x, top[:, None], 1)
                dm = jnp.take_along_axis(d, top[:, None], 1)
                # a maximum beyond fmax + half an ulp would have rounded to a larger value:
                # the clip changed it (the reference measurement's "clipped")
                f = fp8._block.element_format(fmt)
                ulp = 2.0 ** (np.floor(np.log2(f.max)) - f.mantissa_bits)
                e = q.codes.astype(jnp.int32)[:, 0] - 127
                scaled = jnp.abs(xm[:, 0]) * jnp.exp2(-e.astype(jnp.float32))
                return {
                    "clipped": stats["clipped"],
                    "clipped_beyond_rounding": jnp.mean(scaled > f.max + ulp / 2),
                    "flushed": stats["flushed"],
                    "rel_l2": jnp.linalg.norm(x - d) / jnp.linalg.norm(x),
                    "worst_max_err": jnp.max(jnp.abs(dm - xm) / jnp.abs(xm)),
                }

            out = {k: float(v) for k, v in measure(x).items()}
            rows.append({"format": fmt, "rounding": rule, **out})
            print(json.dumps(rows[-1]), flush=True)
    return rows


def recipe_for(variant: str) -> Any:
    if variant == "bf16":
        return None
    if variant == "delayed":
        return fp8.DelayedScaling(16)
    if variant == "current":
        return fp8.CurrentScaling()
    if variant == "deepseek":
        return fp8.deepseek()
    name, _, rule = variant.partition("-")  # e.g. mxfp8-up, mxfp4-down
    fmt = {"mxfp8": "e4m3", "mxfp6": "e2m3", "mxfp4": "e2m1"}[name]
    return fp8.mx(fmt, rule or "up")


class _Run:
    """The model of ``train`` with one recipe: data, optimizer, initial state, jitted step."""

    def __init__(self, recipe: Any, args: argparse.Namespace) -> None:
        data = load_text()
        split = int(0.9 * len(data))
        self.train_data, self.test_data = data[:split], data[split:]
        dot = None if recipe is None else functools.partial(fp8.linen.DotGeneral, recipe=recipe)
        model = CharLM(args.dim, 4, args.layers, dot)
        schedule = optax.warmup_cosine_decay_schedule(
            0, 3e-3, min(50, args.steps // 2), args.steps, 3e-4
        )
        tx = jdls.wrap(optax.adamw(schedule, weight_decay=0.01), jdls.NoOpScale())
        x0, _ = test_set(self.test_data, args.seq, 2)
        self.variables = dict(model.init(jax.random.key(args.seed), x0, jnp.float32(1.0)))
        self.opt_state = tx.init(self.variables["params"])

        def loss_fn(variables: Any, x: jax.Array, y: jax.Array) -> jax.Array:
            logits = model.apply(variables, x, jnp.float32(1.0))
            return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

        @jax.jit
        def step(variables: Any, opt_state: Any, x: jax.Array, y: jax.Array):
            loss, grads = jax.value_and_grad(loss_fn)(variables, x, y)
            updates, opt_state = tx.update(grads["params"], opt_state, variables["params"])
            new = {"params": optax.apply_updates(variables["params"], updates)}
            if "jdls" in variables:
                finite = jdls.stats(opt_state).finite
                new["jdls"] = jdls.update_sites(variables["jdls"], grads["jdls"], finite)
            return new, opt_state, loss

        self.step = step
        self.test_loss = jax.jit(loss_fn)
        self.batches = batches(self.train_data, args.seq, args.batch, args.seed)

    def test(self, args: argparse.Namespace) -> float:
        xt, yt = test_set(self.test_data, args.seq)
        return float(self.test_loss(self.variables, xt, yt))


def train(variant: str, args: argparse.Namespace) -> dict[str, Any]:
    run = _Run(recipe_for(variant), args)
    losses = []
    start = time.perf_counter()
    for _ in range(args.steps):
        x, y = next(run.batches)
        run.variables, run.opt_state, loss = run.step(run.variables, run.opt_state, x, y)
        losses.append(float(loss))
    seconds = time.perf_counter() - start
    variables, opt_state = run.variables, run.opt_state
    result = {
        "variant": variant,
        "test_loss": run.test(args),
        "train_loss_last50": float(np.mean(losses[-50:])),
        "skipped": int(jdls.stats(opt_state).skipped_steps),
        "seconds": seconds,
    }
    if "jdls" in variables:  # the last step's telemetry, the largest over the FP8 dots
        sites = jax.tree.leaves(variables["jdls"], is_leaf=jdls.is_site)
        meters = [s.value.meter for s in sites]
        for role in ("lhs", "rhs", "grad"):
            result[f"{role}_saturated"] = max(
                float(jnp.max(getattr(m, role).saturated)) for m in meters
            )
            result[f"{role}_flushed"] = max(
                float(jnp.max(getattr(m, role).flushed)) for m in meters
            )
    return result


# -- fp4 ---------------------------------------------------------------------------------------

#: The variants of ``fp4``, in order: bfloat16, jdls's default FP8 recipe, MXFP4, NVFP4 with
#: the dots kept in bfloat16 chosen by measurement, by the paper's rule (the last dots), none,
#: and the measured choice without stochastic rounding / the Hadamard transform / 16x16 tiles.
FP4_VARIANTS = (
    "bf16",
    "fp8",
    "mxfp4",
    "nvfp4",
    "nvfp4-paper",
    "nvfp4-all",
    "nvfp4-no-sr",
    "nvfp4-no-rht",
    "nvfp4-no-2d",
)
_ABLATIONS = {
    "nvfp4-no-sr": {"stochastic_rounding": False},
    "nvfp4-no-rht": {"hadamard": False},
    "nvfp4-no-2d": {"weight_tiles": False},
}
#: The projections of a block, in the order the forward pass runs them.
_PROJECTIONS = ("qkv", "out", "up", "down")

Name = tuple[str, Any]  # (site path, layer of the stack), as jdls.fp8.rank_layers names a dot


def fp4_recipe(variant: str, measure_error: bool = False) -> Any:
    if variant == "bf16":
        return None
    if variant == "fp8":
        return fp8.DelayedScaling(16)  # bench_fp8's jdls-fp8, train's "delayed"
    if variant == "mxfp4":
        return fp8.mx("e2m1")
    if variant not in FP4_VARIANTS:
        raise ValueError(f"unknown fp4 variant {variant!r}; known: {FP4_VARIANTS}")
    return fp8.nvfp4(**_ABLATIONS.get(variant, {}), measure_error=measure_error)


def measure_layers(args: argparse.Namespace) -> dict[str, Any]:
    """``--measure-steps`` steps of ``nvfp4(measure_error=True)`` (the same initialisation and
    first batches as the runs), then ``suggest_high_precision(variables, --fraction)``."""
    run = _Run(fp4_recipe("nvfp4", measure_error=True), args)
    per_step = []
    start = time.perf_counter()
    for _ in range(args.measure_steps):
        x, y = next(run.batches)
        run.variables, run.opt_state, _ = run.step(run.variables, run.opt_state, x, y)
        ranked = fp8.rank_layers(run.variables)
        per_step.append([[r.path, r.layer, r.error] for r in ranked])
    chosen = fp8.suggest_high_precision(run.variables, args.fraction)
    # the choice each measured step would have made, to see whether one step would have done
    count = len(chosen)
    per_step_choice = [[tuple(r[:2]) for r in ranked[:count]] for ranked in per_step]
    return {
        "chosen": [list(n) for n in chosen],
        "ranking_last_step": per_step[-1],
        "ranking_per_step": per_step,
        "same_choice_at_every_step": all(set(c) == set(chosen) for c in per_step_choice),
        "seconds": time.perf_counter() - start,
    }


def paper_layers(variables: Any, count: int) -> list[Name]:
    """The last ``count`` NVFP4 dots in the order the forward pass runs them: the paper's
    rule (keep about 15% of the linear layers, the last blocks') at the measured count."""
    paths = {r.path for r in fp8.rank_layers(variables)}
    layers = max(r.layer for r in fp8.rank_layers(variables)) + 1

    def path_of(projection: str) -> str:
        (path,) = [p for p in paths if f"/{projection}/" in f"/{p}/"]
        return path

    order = [(path_of(p), layer) for layer in range(layers) for p in _PROJECTIONS]
    return order[len(order) - count :]


def _grad_flushed(variables: Any, kept: set[Name]) -> tuple[list[float], list[float]]:
    """This step's flushed fraction of the output gradient, per dot: of every dot, and of
    the dots computed in FP4/FP8 (not kept in high precision); from ``jdls.fp8.telemetry``."""
    every, quantized = [], []
    for path, row in fp8.telemetry(variables).items():
        values = row["grad"]["flushed"]
        values = values if isinstance(values, list) else [values]
        for layer, v in enumerate(values):
            every.append(v)
            if (path, layer) not in kept:
                quantized.append(v)
    return every, quantized


def train_fp4(variant: str, args: argparse.Namespace, kept: list[Name]) -> tuple[dict, _Run]:
    run = _Run(fp4_recipe(variant), args)
    if kept:
        run.variables = fp8.keep_high_precision(run.variables, kept)
    kept_set = {tuple(n) for n in kept}
    losses, times, every, quantized = [], [], [], []
    start = time.perf_counter()
    for i in range(args.steps):
        x, y = next(run.batches)
        t = time.perf_counter()
        run.variables, run.opt_state, loss = run.step(run.variables, run.opt_state, x, y)
        losses.append(float(loss))  # waits for the step
        times.append(time.perf_counter() - t)
        if "jdls" in run.variables and i >= args.steps - args.tail:
            e, q = _grad_flushed(run.variables, kept_set)
            every.append(np.mean(e))
            quantized.append(np.mean(q) if q else np.nan)
    seconds = time.perf_counter() - start
    result = {
        "variant": variant,
        "recipe": repr(fp4_recipe(variant)),
        "kept": [list(n) for n in kept],
        "test_loss": run.test(args),
        "train_loss_last50": float(np.mean(losses[-50:])),
        "skipped": int(jdls.stats(run.opt_state).skipped_steps),
        "seconds": seconds,
        "first_step_s": times[0],  # with the compilation
        "train_step_median_s": float(np.median(times[1:])) if len(times) > 1 else None,
        "grad_flushed_quantized_dots": float(np.mean(quantized)) if quantized else None,
        "grad_flushed_all_dots": float(np.mean(every)) if every else None,
    }
    if "jdls" in run.variables:
        result["telemetry_last_step"] = fp8.telemetry(run.variables)
    return result, run


def time_steps(runs: dict[str, _Run], args: argparse.Namespace) -> dict[str, dict[str, float]]:
    """Interleaved rounds of one step of every variant (each from its trained state, the same
    batch, the result discarded); per variant the median step time and the median of the
    per-round ratios to bfloat16."""
    x, y = next(runs["bf16"].batches)
    times: dict[str, list[float]] = {v: [] for v in runs}
    for _ in range(args.time_rounds):
        for v, run in runs.items():
            t = time.perf_counter()
            jax.block_until_ready(run.step(run.variables, run.opt_state, x, y))
            times[v].append(time.perf_counter() - t)
    base = np.asarray(times["bf16"])
    return {
        v: {
            "median_s": float(np.median(t)),
            "ratio_to_bf16": float(np.median(np.asarray(t) / base)),
            "ratio_iqr": [float(q) for q in np.percentile(np.asarray(t) / base, [25, 75])],
        }
        for v, t in times.items()
    }


def fp4(args: argparse.Namespace) -> dict[str, Any]:
    variants = args.variants.split(",") if args.variants else list(FP4_VARIANTS)
    if "bf16" not in variants:
        variants.insert(0, "bf16")  # the step times are ratios to it
    out: dict[str, Any] = {"machine": _machine(), "variants": variants}
    kept: dict[str, list[Name]] = {}
    if any(v.startswith("nvfp4") and v != "nvfp4-all" for v in variants):
        out["measurement"] = measure_layers(args)
        print(
            json.dumps(
                {
                    k: out["measurement"][k]
                    for k in ("chosen", "ranking_last_step", "same_choice_at_every_step")
                }
            ),
            flush=True,
        )
        measured = [tuple(n) for n in out["measurement"]["chosen"]]
        probe = _Run(fp4_recipe("nvfp4"), args).variables
        paper = paper_layers(probe, len(measured))
        out["paper_rule"] = [list(n) for n in paper]
        kept = {v: measured for v in variants if v.startswith("nvfp4")}
        kept["nvfp4-paper"], kept["nvfp4-all"] = paper, []
    results, runs = [], {}
    for variant in variants:
        result, runs[variant] = train_fp4(variant, args, kept.get(variant, []))
        results.append(result)
        print(
            json.dumps({k: v for k, v in result.items() if k != "telemetry_last_step"}), flush=True
        )
    if args.time_rounds:
        timing = time_steps(runs, args)
        for result in results:
            result["step_time"] = timing[result["variant"]]
        print(json.dumps(timing), flush=True)
    out["results"] = results
    return out


def _machine() -> dict[str, Any]:
    import os
    import platform

    return {
        "cpu_count": os.cpu_count(),
        "processor": platform.processor() or platform.machine(),
        "jax": jax.__version__,
        "load_average_at_start": list(os.getloadavg()),
        "date": time.strftime("%Y-%m-%d"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("experiment", choices=["rounding", "train", "fp4"])
    parser.add_argument("--blocks", type=int, default=32768)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--variants",
        default="",
        help="train: default bf16,delayed,current,mxfp8-up,mxfp8-down,mxfp8-outlier_aware,"
        f"deepseek; fp4: default {','.join(FP4_VARIANTS)}",
    )
    parser.add_argument("--measure-steps", type=int, default=10, help="fp4: steps measured")
    parser.add_argument("--fraction", type=float, default=0.15, help="fp4: of the dots kept")
    parser.add_argument("--tail", type=int, default=50, help="fp4: steps of flushed fractions")
    parser.add_argument("--time-rounds", type=int, default=10, help="fp4: timed step rounds")
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    if args.experiment == "rounding":
        results = rounding_table(args.blocks, args.seed)
    elif args.experiment == "fp4":
        out = fp4(args)
        if args.out:
            with open(args.out, "w") as f:
                json.dump({"args": vars(args), **out}, f, indent=1)
        return
    else:
        if not args.variants:
            args.variants = "bf16,delayed,current,mxfp8-up,mxfp8-down,mxfp8-outlier_aware,deepseek"
        results = []
        for variant in args.variants.split(","):
            results.append(train(variant, args))
            print(json.dumps(results[-1]), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
