"""Block-scaled FP8: the shared exponent's three rounding rules side by side, and the
character-level transformer of ``bench_fp8`` trained with block and per-tensor recipes.

    PYTHONPATH=. python benchmarks/bench_fp8_blocks.py rounding [--blocks 32768]
    PYTHONPATH=. python benchmarks/bench_fp8_blocks.py train [--steps 300] [--variants ...]

``rounding``: blocks of 32 values ``N(0,1) * exp(3 N(0,1))`` (log-normal magnitudes, as in
the reference measurement of ../shared/reference/fp8-scaling.md, S3), quantized with each rule
and MX element format; per rule: the fraction of blocks whose largest value was clipped, the
fraction of blocks whose largest value exceeded ``fmax`` by more than half an ulp (the clip
changed its rounded value), the fraction of values flushed to zero, the relative L2 error ``|x - q| / |x|`` and the largest
relative error of a block's maximum.

``train``: ``bench_fp8.CharLM`` (scanned, rematerialised, bfloat16 compute) whose four
projections per block are ``jdls.fp8.linen.DotGeneral`` with the given recipe; AdamW, a step
with non-finite gradients skipped by ``jdls.wrap``; the test loss at the end.
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


def train(variant: str, args: argparse.Namespace) -> dict[str, Any]:
    data = load_text()
    split = int(0.9 * len(data))
    train_data, test_data = data[:split], data[split:]
    recipe = recipe_for(variant)
    dot = None if recipe is None else functools.partial(fp8.linen.DotGeneral, recipe=recipe)
    model = CharLM(args.dim, 4, args.layers, dot)
    schedule = optax.warmup_cosine_decay_schedule(
        0, 3e-3, min(50, args.steps // 2), args.steps, 3e-4
    )
    tx = jdls.wrap(optax.adamw(schedule, weight_decay=0.01), jdls.NoOpScale())
    x0, _ = test_set(test_data, args.seq, 2)
    variables = dict(model.init(jax.random.key(args.seed), x0, jnp.float32(1.0)))
    opt_state = tx.init(variables["params"])

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

    xt, yt = test_set(test_data, args.seq)
    it = batches(train_data, args.seq, args.batch, args.seed)
    losses = []
    start = time.perf_counter()
    for _ in range(args.steps):
        x, y = next(it)
        variables, opt_state, loss = step(variables, opt_state, x, y)
        losses.append(float(loss))
    seconds = time.perf_counter() - start
    result = {
        "variant": variant,
        "test_loss": float(jax.jit(loss_fn)(variables, xt, yt)),
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("experiment", choices=["rounding", "train"])
    parser.add_argument("--blocks", type=int, default=32768)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--variants",
        default="bf16,delayed,current,mxfp8-up,mxfp8-down,mxfp8-outlier_aware,deepseek",
    )
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    if args.experiment == "rounding":
        results = rounding_table(args.blocks, args.seed)
    else:
        results = []
        for variant in args.variants.split(","):
            results.append(train(variant, args))
            print(json.dumps(results[-1]), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
