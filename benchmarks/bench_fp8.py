"""FP8 training of a scanned, rematerialised character-level transformer: jdls.fp8 against
bfloat16 and Flax's ``fp8_ops``, and recovery after an injected inf and gradient spikes.

    PYTHONPATH=. python benchmarks/bench_fp8.py [--steps 600] [--quick]

The model: byte embeddings, ``nn.scan(nn.remat(Block))`` over the layers (pre-norm causal
self-attention and a GELU MLP, bfloat16 compute, float32 parameters and layer norms), a float32
head. In the FP8 runs the four projections of every block (qkv, attention output, MLP up and
down) are FP8 dots: ``jdls.fp8.linen.DotGeneral`` (delayed scaling, history 16, e4m3 forward,
e5m2 backward) or Flax's ``nn.Fp8DirectDotGeneralOp`` (history 16), whose state is carried as
Flax's ``TrainState`` carries it (overwritten with its gradient). Text: the source of a dozen
Python standard-library modules (read offline with ``inspect``), 90% train, 10% test. The
optimizer is AdamW; a step whose gradients are not finite is skipped (``jdls.wrap`` for jdls
and bfloat16, ``optax.apply_if_finite`` for Flax).

Events: an ``inf`` multiplies the output gradient of the last block at one step (an overflow
in the backward pass), or ten steps multiply it by 1e4 (gradient spikes). For the output
gradients of every FP8 dot the run records the amax and the scale the step used, and counts
the steps after the event while the scale stays frozen and while it is more than 100x away
from the tracking scale.
"""

from __future__ import annotations

import argparse
import functools
import inspect
import json
import time
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax.linen import fp8_ops

import jdls
from jdls import fp8

OWG = fp8_ops.OVERWRITE_WITH_GRADIENT
COMPUTE = jnp.bfloat16
E5M2_MAX = 57344.0
MODULES = (
    "argparse", "textwrap", "difflib", "pprint", "string", "heapq", "bisect", "functools",
    "dataclasses", "enum", "json.decoder", "json.encoder", "fractions", "shlex",
)  # fmt: skip


def load_text() -> np.ndarray:
    """The bytes of the modules' sources (ASCII), as uint8."""
    import importlib

    text = "\n".join(inspect.getsource(importlib.import_module(m)) for m in MODULES)
    return np.frombuffer(text.encode("ascii", "replace"), np.uint8)


@jax.custom_vjp
def event_gate(x: jax.Array, factor: jax.Array) -> jax.Array:
    """The identity; its backward pass multiplies the cotangent by ``factor``."""
    return x


def _gate_fwd(x: jax.Array, factor: jax.Array) -> tuple[jax.Array, jax.Array]:
    return x, factor


def _gate_bwd(factor: jax.Array, g: jax.Array) -> tuple[jax.Array, jax.Array]:
    return (g * factor.astype(g.dtype)), jnp.zeros_like(factor)


event_gate.defvjp(_gate_fwd, _gate_bwd)


class Block(nn.Module):
    dim: int
    heads: int
    dot: Any
    dtype: Any = COMPUTE

    @nn.compact
    def __call__(self, x: jax.Array, _: Any) -> tuple[jax.Array, None]:
        dense = functools.partial(nn.Dense, dtype=self.dtype, dot_general_cls=self.dot)
        b, t, d = x.shape
        h = nn.LayerNorm(dtype=jnp.float32)(x).astype(self.dtype)
        q, k, v = jnp.split(dense(3 * d, name="qkv")(h), 3, axis=-1)
        q, k, v = (a.reshape(b, t, self.heads, d // self.heads) for a in (q, k, v))
        logits = jnp.einsum("bqhd,bkhd->bhqk", q, k).astype(jnp.float32) / np.sqrt(d // self.heads)
        mask = jnp.tril(jnp.ones((t, t), bool))
        weights = jax.nn.softmax(jnp.where(mask, logits, -1e9), axis=-1).astype(self.dtype)
        att = jnp.einsum("bhqk,bkhd->bqhd", weights, v).reshape(b, t, d)
        x = x + dense(d, name="out")(att).astype(jnp.float32)
        h = nn.LayerNorm(dtype=jnp.float32)(x).astype(self.dtype)
        up = nn.gelu(dense(4 * d, name="up")(h))
        return x + dense(d, name="down")(up).astype(jnp.float32), None


class CharLM(nn.Module):
    dim: int = 128
    heads: int = 4
    layers: int = 4
    dot: Any = None
    dtype: Any = COMPUTE  # of the blocks' computation

    @nn.compact
    def __call__(self, tokens: jax.Array, factor: jax.Array) -> jax.Array:
        x = nn.Embed(256, self.dim)(tokens)
        x = x + self.param("pos", nn.initializers.normal(0.02), (tokens.shape[1], self.dim))
        blocks = nn.scan(
            nn.remat(Block),
            variable_axes={"params": 0, "jdls": 0, OWG: 0},
            split_rngs={"params": True},
            length=self.layers,
        )
        x = blocks(self.dim, self.heads, self.dot, self.dtype, name="blocks")(x, None)[0]
        x = event_gate(x, factor)
        return nn.Dense(256)(nn.LayerNorm()(x))


def dot_for(variant: str, history: int) -> Any:
    if variant == "bf16":
        return None
    if variant == "flax-fp8":
        return functools.partial(fp8_ops.Fp8DirectDotGeneralOp, amax_history_length=history)
    algorithm = "most_recent" if variant == "jdls-fp8-recent" else "max"
    recipe = fp8.DelayedScaling(history, algorithm)
    return functools.partial(fp8.linen.DotGeneral, recipe=recipe)


def make_step(model: CharLM, variant: str, tx: Any) -> Any:
    def loss_fn(variables: Any, x: jax.Array, y: jax.Array, factor: jax.Array) -> jax.Array:
        logits = model.apply(variables, x, factor)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    @jax.jit
    def step(variables: Any, opt_state: Any, x: jax.Array, y: jax.Array, factor: jax.Array):
        loss, grads = jax.value_and_grad(loss_fn)(variables, x, y, factor)
        updates, opt_state = tx.update(grads["params"], opt_state, variables["params"])
        new = {"params": optax.apply_updates(variables["params"], updates)}
        if "jdls" in variables:
            finite = jdls.stats(opt_state).finite
            new["jdls"] = jdls.update_sites(variables["jdls"], grads["jdls"], finite)
        if OWG in variables:  # as flax.training.train_state.TrainState.apply_gradients
            new[OWG] = grads[OWG]
        return new, opt_state, loss, _grad_record(variables, new)

    @jax.jit
    def test_loss(variables: Any, x: jax.Array, y: jax.Array) -> jax.Array:
        return loss_fn(variables, x, y, jnp.float32(1.0))

    return step, test_loss


def _grad_record(old: Any, new: Any) -> dict[str, jax.Array]:
    """The output-gradient amax of this step and the scale it used, per FP8 dot (stacked)."""
    if "jdls" in new:
        sites = jax.tree.leaves(new["jdls"], is_leaf=jdls.is_site)
        olds = jax.tree.leaves(old["jdls"], is_leaf=jdls.is_site)
        amax = jnp.stack([s.value.meter.grad.amax for s in sites])
        scale = jnp.stack([s.value.grad.scale for s in olds])
        flushed = jnp.stack([s.value.meter.grad.flushed for s in sites])
        return {"amax": amax, "scale": scale, "flushed": flushed}
    if OWG in new:
        metas = [m for m in jax.tree.leaves(new[OWG], is_leaf=lambda d: "output_grad_scale" in d)]
        amax = jnp.stack([m["output_grad_amax_history"][..., 0] for m in metas])
        scale = jnp.stack([m["output_grad_scale"][..., 0] for m in metas])
        return {"amax": amax, "scale": scale, "flushed": jnp.zeros_like(amax)}
    return {}


def batches(data: np.ndarray, seq: int, batch: int, seed: int):
    rng = np.random.default_rng(seed)
    while True:
        starts = rng.integers(0, len(data) - seq - 1, batch)
        chunk = np.stack([data[s : s + seq + 1] for s in starts]).astype(np.int32)
        yield chunk[:, :-1], chunk[:, 1:]


def test_set(data: np.ndarray, seq: int, count: int = 64) -> tuple[np.ndarray, np.ndarray]:
    starts = np.linspace(0, len(data) - seq - 2, count).astype(int)
    chunk = np.stack([data[s : s + seq + 1] for s in starts]).astype(np.int32)
    return chunk[:, :-1], chunk[:, 1:]


def run(variant: str, args: argparse.Namespace, events: dict[int, float]) -> dict[str, Any]:
    data = load_text()
    split = int(0.9 * len(data))
    train, test = data[:split], data[split:]
    model = CharLM(args.dim, 4, args.layers, dot_for(variant, args.history))
    tx = optax.adamw(
        optax.warmup_cosine_decay_schedule(0, 3e-3, min(50, args.steps // 2), args.steps, 3e-4),
        weight_decay=0.01,
    )
    tx = (
        optax.apply_if_finite(tx, 10**6)
        if variant == "flax-fp8"
        else jdls.wrap(tx, jdls.NoOpScale())
    )
    x0, _ = test_set(test, args.seq, 2)
    variables = model.init(jax.random.key(args.seed), x0, jnp.float32(1.0))
    variables = dict(variables)
    opt_state = tx.init(variables["params"])
    step, test_loss = make_step(model, variant, tx)
    xt, yt = test_set(test, args.seq)
    it = batches(train, args.seq, args.batch, args.seed)
    losses, records = [], []
    start = time.perf_counter()
    for i in range(args.steps):
        x, y = next(it)
        factor = jnp.float32(events.get(i, 1.0))
        variables, opt_state, loss, record = step(variables, opt_state, x, y, factor)
        losses.append(float(loss))
        if record:
            records.append(jax.tree.map(np.asarray, record))
    seconds = time.perf_counter() - start
    result = {
        "variant": variant,
        "test_loss": float(test_loss(variables, xt, yt)),
        "train_loss_last50": float(np.mean(losses[-50:])),
        "seconds": seconds,
    }
    if records and events:
        result.update(_event_stats(records, events, args.history))
    return result


def _event_stats(
    records: list[dict[str, np.ndarray]], events: dict[int, float], history: int
) -> dict[str, Any]:
    """Per step and FP8 dot: the scale used against the scale that tracks the amax (the
    largest of the last ``history`` finite output-gradient amaxes, over e5m2's max)."""
    amax = np.stack([r["amax"].reshape(-1) for r in records])  # steps x dots
    scale = np.stack([r["scale"].reshape(-1) for r in records])
    flushed = np.stack([r["flushed"].reshape(-1) for r in records])
    first, last = min(events), max(events)
    untracked = []
    for t in range(first + 1, len(records)):
        tracking = np.empty(amax.shape[1])
        for d in range(amax.shape[1]):
            seen = amax[:t, d][np.isfinite(amax[:t, d])]
            tracking[d] = seen[-history:].max() / E5M2_MAX
        ratio = scale[t] / tracking  # 1 when the scale is the finite history's
        untracked.append(bool(np.any(np.abs(np.log2(ratio)) > 1e-3)))
    # against the step's own amax: r < 1 clips the largest values, r > 100 loses 6+ binades
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = scale * E5M2_MAX / np.where(np.isfinite(amax) & (amax > 0), amax, np.nan)
    after = ratio[first + 1 :]
    clipping = np.any(after < 1 - 1e-6, axis=1)
    coarse = np.any(after > 100, axis=1)
    settled = [t for t in range(last + 1, len(records)) if not np.any(ratio[t] > 100)]
    return {
        "steps_not_tracking_after_event": int(np.sum(untracked)),
        "steps_clipping_after_event": int(np.sum(clipping)),
        "steps_scale_over_100x_amax": int(np.sum(coarse)),
        "steps_to_settle_after_last_event": (settled[0] - last) if settled else None,
        "mean_flushed_during_events": float(np.mean(flushed[first : last + history + 1])),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--history", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--experiment", choices=["quality", "inf", "spikes"], default="quality")
    parser.add_argument("--variants", default="")
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    if args.experiment == "quality":
        variants, events = ["bf16", "jdls-fp8", "flax-fp8"], {}
    elif args.experiment == "inf":
        variants, events = ["jdls-fp8", "flax-fp8"], {args.steps // 3: float("inf")}
    else:
        start = args.steps // 3
        variants = ["jdls-fp8", "jdls-fp8-recent", "flax-fp8"]
        events = {start + 10 * i: 1e4 for i in range(10)}
    if args.variants:
        variants = args.variants.split(",")
    results = []
    for variant in variants:
        result = run(variant, args, events)
        print(json.dumps(result), flush=True)
        results.append(result)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
