"""A scanned, rematerialised float16 transformer in Flax linen, with a loss scale per layer
and a row of backward-pass telemetry per layer.

The model is written as large JAX codebases write one: the blocks (pre-norm causal
self-attention and an MLP) run under ``nn.scan`` over the layers, each block under
``nn.remat``, every ``Dense`` and the attention compute in float16 while the parameters stay
float32 (the layer norms compute in float32, the logits are cast to float32 for the loss). It
learns to continue the sources of a few Python standard-library modules, which ship with every
Python: nothing is downloaded.

The jdls pieces, and nothing else changes in the model:

* ``jdls.linen.layer_scales(model, jdls.AdaptiveScale())``: a loss scale at the output of each
  top-level layer (``embed``, ``head``) and, the blocks being scanned, one per block, stacked
  along the scan axis like the blocks' parameters (``variable_axes={"params": 0, "jdls": 0}``);
* ``jdls.linen.probes(...)``: a probe after every submodule, measuring the cotangent that
  flows back through it (largest magnitude, values flushed to zero in float16, inf/NaN);
* ``jdls.linen.TrainState`` carries these sites (the ``"jdls"`` collection):
  ``state.value_and_grad`` unscales each layer's gradients by its own scale and returns the
  probes' measurements, ``state.apply_gradients`` skips a non-finite step
  (``jdls.wrap(adamw, jdls.NoOpScale())``: the scales are the layers') and adjusts every
  layer's scale;
* ``jdls.Telemetry.of(grads["jdls"])`` reads the probes, ``jdls.plot_headroom`` draws each
  layer's headroom below float16's maximum over training.

Run (300 steps: about two minutes on 2 busy CPU cores; 200 steps took 79 s at a load
average of 9)::

    python examples/scanned_transformer.py
    python examples/scanned_transformer.py --steps 5 --layers 2 --out /tmp/jdls
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import re
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

import jdls

COMPUTE = jnp.float16
MODULES = ("textwrap", "argparse", "difflib", "string", "heapq", "bisect", "shlex", "fractions")


def load_text() -> np.ndarray:
    """The sources of a few standard-library modules as bytes (a vocabulary of 256)."""
    text = "\n".join(inspect.getsource(importlib.import_module(m)) for m in MODULES)
    return np.frombuffer(text.encode("ascii", "replace"), np.uint8).astype(np.int32)


class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention and an MLP, with residuals."""

    heads: int

    @nn.compact
    def __call__(self, x: jax.Array, _: Any = None) -> tuple[jax.Array, None]:
        mask = nn.make_causal_mask(jnp.ones(x.shape[:2]))
        h = nn.LayerNorm(dtype=jnp.float32)(x).astype(COMPUTE)
        x = x + nn.MultiHeadDotProductAttention(self.heads, dtype=COMPUTE)(h, h, mask=mask)
        h = nn.LayerNorm(dtype=jnp.float32)(x).astype(COMPUTE)
        up = nn.gelu(nn.Dense(4 * x.shape[-1], dtype=COMPUTE)(h))
        return x + nn.Dense(x.shape[-1], dtype=COMPUTE)(up), None


class Embed(nn.Module):
    """Byte and position embeddings."""

    dim: int

    @nn.compact
    def __call__(self, tokens: jax.Array) -> jax.Array:
        init = nn.initializers.normal(0.02)
        table = self.param("tokens", init, (256, self.dim))
        positions = self.param("positions", init, (tokens.shape[1], self.dim))
        return (table[tokens] + positions).astype(COMPUTE)


class Head(nn.Module):
    """Final norm and the logits (float32 for the loss)."""

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        h = nn.LayerNorm(dtype=jnp.float32)(x).astype(COMPUTE)
        return nn.Dense(256, dtype=COMPUTE)(h).astype(jnp.float32)


class CharLM(nn.Module):
    """``embed``, then ``blocks``: ``nn.scan(nn.remat(Block))`` over ``layers``, then ``head``.

    The top-level submodules form a chain, so each is a layer of its own for per-layer scales.
    """

    dim: int = 128
    heads: int = 4
    layers: int = 8

    @nn.compact
    def __call__(self, tokens: jax.Array) -> jax.Array:
        x = Embed(self.dim, name="embed")(tokens)
        blocks = nn.scan(
            nn.remat(Block),
            variable_axes={"params": 0, "jdls": 0},  # a site per layer, like its parameters
            split_rngs={"params": True},
            length=self.layers,
        )
        x, _ = blocks(self.heads, name="blocks")(x, None)
        return Head(name="head")(x)


def per_layer(t: jdls.Telemetry) -> jdls.Telemetry:
    """The rows of the layers' outputs of ``t``, in forward order: ``embed``, ``blocks[i]``,
    ``head`` (the probes inside the blocks, ``blocks/Dense_0[i]`` and so on, left out)."""
    order = {"embed": 0, "blocks": 1, "head": 2}
    keep = [i for i, n in enumerate(t.names) if re.fullmatch(r"embed|blocks\[\d+\]|head", n)]
    keep.sort(key=lambda i: order[t.names[i].split("[")[0]])  # stable: blocks stay in order
    rows = jnp.asarray(keep, jnp.int32)
    return jdls.Telemetry(
        tuple(t.names[i] for i in keep),
        *(a[rows] for a in (t.amax, t.flushed, t.zeros, t.nonfinite, t.uses)),
    )


def layer_scales(sites: Any) -> dict[str, np.ndarray]:
    """Each layer's loss scale: ``{"embed": (1,), "blocks": (layers,), "head": (1,)}``."""
    return {
        name: np.atleast_1d(np.asarray(sites[name]["layer_scale"].value["scale"].loss_scale))
        for name in ("embed", "blocks", "head")
    }


@jax.jit
def train_step(state: jdls.linen.TrainState, batch: jax.Array) -> tuple[Any, ...]:
    def loss_fn(variables: Any) -> jax.Array:
        logits = state.apply_fn(variables, batch[:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:]).mean()

    loss, grads = state.value_and_grad(loss_fn)(state.variables)
    state = state.apply_gradients(grads=grads)  # skips a non-finite step, adjusts the scales
    return state, loss, per_layer(jdls.Telemetry.of(grads["jdls"]))


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Train; returns the losses, skipped steps, per-layer scales and telemetry history."""
    parser = argparse.ArgumentParser(
        description="Train a scanned, rematerialised float16 linen transformer with per-layer "
        "loss scales and per-layer telemetry.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--context", type=int, default=64, help="characters per sequence")
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--learning-rate", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="tmp/scanned_transformer", help="folder for the plot")
    parser.add_argument("--no-plot", action="store_true", help="write nothing")
    parser.add_argument("--quiet", action="store_true", help="print only the final table")
    args = parser.parse_args(argv)

    data = load_text()
    rng = np.random.default_rng(args.seed)

    def batch() -> jax.Array:
        starts = rng.integers(0, len(data) - args.context - 1, args.batch_size)
        return jnp.asarray(np.stack([data[s : s + args.context + 1] for s in starts]))

    net = CharLM(args.dim, args.heads, args.layers)
    model = jdls.linen.probes(jdls.linen.layer_scales(net, jdls.AdaptiveScale()))
    variables = model.init(jax.random.key(args.seed), batch()[:, :-1])
    schedule = optax.warmup_cosine_decay_schedule(
        0.0, args.learning_rate, min(50, args.steps // 4 + 1), max(args.steps, 1)
    )
    state = jdls.linen.TrainState.create(
        apply_fn=model.apply,
        params=variables["params"],
        sites=variables["jdls"],
        tx=jdls.wrap(optax.adamw(schedule), jdls.NoOpScale()),
    )

    start = time.perf_counter()
    losses, history = [], []
    for step in range(args.steps):
        state, loss, telemetry = train_step(state, batch())
        losses.append(float(loss))
        history.append(jax.device_get(telemetry))
        if not args.quiet and (step % 50 == 0 or step == args.steps - 1):
            print(
                f"step {step:4d}  loss {losses[-1]:.3f}  skipped {int(state.stats.skipped_steps)}"
            )
    seconds = time.perf_counter() - start

    scales = layer_scales(state.sites)
    result = {
        "losses": np.asarray(losses),
        "skipped_steps": int(state.stats.skipped_steps),
        "scales": scales,
        "history": history,
        "seconds": seconds,
        "plot": None,
    }
    if not args.no_plot:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        result["plot"] = out / "headroom.png"
        jdls.plot_headroom(history, "float16", path=str(result["plot"]))

    last = history[-1]
    print(
        f"{args.steps} steps in {seconds:.1f} s: loss {losses[0]:.3f} -> {losses[-1]:.3f}, "
        f"skipped steps {result['skipped_steps']}"
    )
    rows = [("embed", scales["embed"][0])]
    rows += [(f"blocks[{i}]", s) for i, s in enumerate(scales["blocks"])]
    rows += [("head", scales["head"][0])]
    headroom = dict(zip(last.names, np.asarray(last.headroom_bits("float16")), strict=True))
    flushed = dict(zip(last.names, np.asarray(last.flushed), strict=True))
    print(f"{'layer':<11} {'loss scale':>10} {'headroom bits':>14} {'flushed':>8}")
    for name, s in rows:
        print(
            f"{name:<11} {f'2**{np.log2(s):g}':>10} {headroom[name]:>14.1f} {flushed[name]:>8.2%}"
        )
    if result["plot"] is not None:
        print(f"headroom per layer: {result['plot']}")
    return result


if __name__ == "__main__":
    main()
