"""A character-level transformer in Flax NNX, computing in float16 with dynamic loss scaling.

The model (token and position embeddings, pre-norm transformer blocks with causal
self-attention, dropout) stores its parameters in float32 and computes in float16: every
``nnx.Linear``, ``nnx.Embed`` and ``nnx.MultiHeadAttention`` is built with
``dtype=jnp.float16``, the layer norms compute in float32, and the logits are cast to float32
for the loss. It learns to continue the source code of Python's ``textwrap`` module, which
ships with every Python: nothing is downloaded.

The NNX pieces of jdls:

* ``nnx.Optimizer(model, jdls.wrap(optax.adamw(...)), wrt=nnx.Param)``: ``optimizer.update``
  skips a step whose gradients are not finite and adjusts the loss scale;
* ``jdls.get_scale(optimizer)`` finds the scale in the optimizer state;
* ``jdls.nnx.value_and_grad(loss_fn, scale)`` is ``nnx.value_and_grad`` with the loss scaled
  and the gradients unscaled: it differentiates only the ``nnx.Param`` variables, so the
  dropout RNG state of the model is no obstacle;
* ``jdls.get_scale`` and ``jdls.stats`` of ``nnx.as_pure(optimizer.opt_state)`` read the scale
  and the statistics as plain arrays.

Run (about 30 seconds on 2 CPU cores)::

    python examples/nnx_transformer.py
    python examples/nnx_transformer.py --steps 20 --quiet
"""

from __future__ import annotations

import argparse
import inspect
import textwrap
import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from tqdm import trange

import jdls

COMPUTE = jnp.float16


def load_text() -> str:
    """The source of Python's ``textwrap`` module (about 20,000 characters)."""
    return inspect.getsource(textwrap)


class Block(nnx.Module):
    """Pre-norm transformer block: causal self-attention and an MLP, with residuals."""

    def __init__(self, dim: int, heads: int, dropout: float, rngs: nnx.Rngs):
        self.norm1 = nnx.LayerNorm(dim, dtype=jnp.float32, rngs=rngs)
        self.attention = nnx.MultiHeadAttention(
            num_heads=heads,
            in_features=dim,
            dropout_rate=dropout,
            deterministic=False,  # model.eval() turns dropout off
            dtype=COMPUTE,
            decode=False,
            rngs=rngs,
        )
        self.norm2 = nnx.LayerNorm(dim, dtype=jnp.float32, rngs=rngs)
        self.up = nnx.Linear(dim, 4 * dim, dtype=COMPUTE, rngs=rngs)
        self.down = nnx.Linear(4 * dim, dim, dtype=COMPUTE, rngs=rngs)
        self.dropout = nnx.Dropout(dropout, rngs=rngs)

    def __call__(self, x: jax.Array, mask: jax.Array) -> jax.Array:
        h = self.norm1(x).astype(COMPUTE)
        x = x + self.dropout(self.attention(h, mask=mask))
        h = self.norm2(x).astype(COMPUTE)
        return x + self.dropout(self.down(nnx.gelu(self.up(h))))


class CharTransformer(nnx.Module):
    """Embeddings, ``depth`` blocks, a final norm and a linear head (float32 logits)."""

    def __init__(
        self, vocab: int, context: int, dim: int, heads: int, depth: int, dropout: float, *, rngs
    ):
        self.tokens = nnx.Embed(vocab, dim, dtype=COMPUTE, rngs=rngs)
        self.positions = nnx.Embed(context, dim, dtype=COMPUTE, rngs=rngs)
        self.blocks = nnx.List([Block(dim, heads, dropout, rngs) for _ in range(depth)])
        self.norm = nnx.LayerNorm(dim, dtype=jnp.float32, rngs=rngs)
        self.head = nnx.Linear(dim, vocab, dtype=COMPUTE, rngs=rngs)

    def __call__(self, ids: jax.Array) -> jax.Array:
        length = ids.shape[-1]
        x = self.tokens(ids) + self.positions(jnp.arange(length))
        mask = nnx.make_causal_mask(ids)
        for block in self.blocks:
            x = block(x, mask)
        return self.head(self.norm(x).astype(COMPUTE)).astype(jnp.float32)


def loss_fn(model: CharTransformer, batch: jax.Array) -> jax.Array:
    """Mean next-character cross-entropy (float32)."""
    logits = model(batch[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:]).mean()


@nnx.jit
def train_step(model: CharTransformer, optimizer: nnx.Optimizer, batch: jax.Array) -> tuple:
    scale = jdls.get_scale(optimizer)
    loss, grads = jdls.nnx.value_and_grad(loss_fn, scale)(model, batch)
    optimizer.update(model, grads)  # skipped if a gradient is inf/NaN; adjusts the scale
    opt_state = nnx.as_pure(optimizer.opt_state)
    return loss, jdls.get_scale(opt_state).loss_scale, jdls.stats(opt_state).skipped_steps


@nnx.jit
def next_char(model: CharTransformer, window: jax.Array, length: jax.Array, key: jax.Array):
    logits = model(window[None])[0, length - 1]
    return jax.random.categorical(key, logits / 0.7)  # temperature 0.7


def generate(model: CharTransformer, prompt: np.ndarray, length: int, context: int) -> list:
    """A sampled continuation of ``prompt`` (token ids): ``length`` new ids."""
    ids = list(prompt)
    key = jax.random.key(0)
    for _ in range(length):
        window = np.asarray(ids[-context:], np.int32)
        used = len(window)
        window = np.pad(window, (0, context - used))  # causal: the padding is never seen
        key, sub = jax.random.split(key)
        ids.append(int(next_char(model, jnp.asarray(window), used, sub)))
    return ids[len(prompt) :]


def main(argv: Sequence[str] | None = None) -> dict:
    """Train; returns the final loss, loss scale, skipped steps and a sample."""
    parser = argparse.ArgumentParser(
        description="Train a character-level NNX transformer in float16 with jdls.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--context", type=int, default=32, help="characters per sequence")
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--depth", type=int, default=2)
    parser.add_argument("--learning-rate", type=float, default=1e-2)
    parser.add_argument("--growth-interval", type=int, default=100)
    parser.add_argument("--sample", type=int, default=120, help="characters to generate")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)

    text = load_text()
    chars = sorted(set(text))
    index = {c: i for i, c in enumerate(chars)}
    data = np.array([index[c] for c in text], np.int32)
    rng = np.random.default_rng(args.seed)

    model = CharTransformer(
        len(chars), args.context, args.dim, args.heads, args.depth, 0.1, rngs=nnx.Rngs(args.seed)
    )
    schedule = optax.warmup_cosine_decay_schedule(
        0.0, args.learning_rate, min(100, args.steps // 4 + 1), args.steps
    )
    scale = jdls.DynamicScale(2.0**15, growth_interval=args.growth_interval)
    optimizer = nnx.Optimizer(model, jdls.wrap(optax.adamw(schedule), scale), wrt=nnx.Param)

    start = time.perf_counter()
    bar = trange(args.steps, desc="nnx transformer", disable=args.quiet)
    loss = loss_scale = skipped = None
    for step in bar:
        starts = rng.integers(0, len(data) - args.context - 1, args.batch_size)
        batch = np.stack([data[s : s + args.context + 1] for s in starts])
        loss, loss_scale, skipped = train_step(model, optimizer, jnp.asarray(batch))
        if step % 20 == 0 or step == args.steps - 1:
            bar.set_postfix(loss=f"{float(loss):.3f}", scale=f"{float(loss_scale):g}")
    seconds = time.perf_counter() - start

    model.eval()  # no dropout
    prompt = "def wrap("
    sample = "".join(
        chars[i]
        for i in generate(model, np.array([index[c] for c in prompt]), args.sample, args.context)
    )
    result = {
        "loss": float(loss),
        "loss_scale": float(loss_scale),
        "skipped_steps": int(skipped),
        "sample": prompt + sample,
        "seconds": seconds,
    }
    print(
        f"{args.steps} steps in {seconds:.1f} s: loss {result['loss']:.3f}, "
        f"loss scale {result['loss_scale']:g}, skipped steps {result['skipped_steps']}"
    )
    print("sample:", repr(result["sample"]))
    return result


if __name__ == "__main__":
    main()
