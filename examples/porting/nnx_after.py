"""A small Gemma-style language model in Flax NNX, as an open-source codebase writes one: the
projections are the codebase's own ``Einsum`` module (an ``nnx.Param`` and ``jnp.einsum``),
the embedder has ``encode``/``decode`` methods and ties the head to its table, the blocks are a
list run by a Python loop with dropout and RMSNorm, the optimizer is ``nnx.Optimizer`` over a
global-norm clip in front of AdamW, the step is ``nnx.jit`` and the loop stops on a
non-finite gradient norm.

The program comes twice: ``nnx_before.py`` is the codebase as written (float32) and
``nnx_after.py`` the same codebase with jdls (float16 with loss scaling, a row of
backward-pass telemetry per layer, FP8 projections). docs/porting.md walks through the diff,
line by line.

Run::

    python examples/porting/nnx_before.py --steps 150
    python examples/porting/nnx_after.py --steps 150
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import inspect

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import jdls


@dataclasses.dataclass(frozen=True)
class Config:
    vocab: int = 256
    dim: int = 64
    heads: int = 4
    head_dim: int = 16
    hidden: int = 128
    layers: int = 4
    dropout: float = 0.1
    dtype: object = jnp.float16


class Einsum(nnx.Module):
    def __init__(self, equation: str, shape: tuple[int, ...], *, rngs: nnx.Rngs) -> None:
        self.equation = equation
        self.w = nnx.Param(nnx.initializers.normal(0.02)(rngs.params(), shape))
        self.fp8 = jdls.fp8.nnx.Einsum(jdls.fp8.DelayedScaling())

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.fp8(self.equation, x, self.w[...].astype(x.dtype))


class Embedder(nnx.Module):
    def __init__(self, c: Config, *, rngs: nnx.Rngs) -> None:
        self.table = nnx.Param(jax.random.normal(rngs.params(), (c.vocab, c.dim)))
        self.dtype = c.dtype

    def encode(self, tokens: jax.Array) -> jax.Array:
        x = self.table[...][tokens] * jnp.sqrt(float(self.table.shape[-1]))
        return x.astype(self.dtype)

    def decode(self, x: jax.Array) -> jax.Array:
        return jnp.dot(x, self.table[...].T.astype(x.dtype))


class RMSNorm(nnx.Module):
    def __init__(self, dim: int) -> None:
        self.scale = nnx.Param(jnp.zeros(dim))

    def __call__(self, x: jax.Array) -> jax.Array:
        var = jnp.mean(jnp.square(x.astype(jnp.float32)), axis=-1, keepdims=True)
        normed = x.astype(jnp.float32) * jax.lax.rsqrt(var + 1e-6) * (1.0 + self.scale[...])
        return normed.astype(x.dtype)


class Attention(nnx.Module):
    def __init__(self, c: Config, *, rngs: nnx.Rngs) -> None:
        qkv_shape = (3, c.heads, c.dim, c.head_dim)
        self.qkv_einsum = Einsum("BSD,3KDH->3BSKH", qkv_shape, rngs=rngs)
        self.attn_vec_einsum = Einsum("BTKH,KHD->BTD", (c.heads, c.head_dim, c.dim), rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        q, k, v = self.qkv_einsum(x)
        logits = jnp.einsum("BTKH,BSKH->BKTS", q, k).astype(jnp.float32)
        logits = logits / np.sqrt(q.shape[-1])
        causal = jnp.tril(jnp.ones((x.shape[1], x.shape[1]), bool))
        probs = jax.nn.softmax(jnp.where(causal, logits, -1e30), axis=-1).astype(x.dtype)
        return self.attn_vec_einsum(jnp.einsum("BKTS,BSKH->BTKH", probs, v))


class FeedForward(nnx.Module):
    def __init__(self, c: Config, *, rngs: nnx.Rngs) -> None:
        self.gating_einsum = Einsum("BTD,2DF->2BTF", (2, c.dim, c.hidden), rngs=rngs)
        self.linear = Einsum("BTF,FD->BTD", (c.hidden, c.dim), rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        gate = self.gating_einsum(x)
        return self.linear(nnx.gelu(gate[0]) * gate[1])


class Block(nnx.Module):
    def __init__(self, c: Config, *, rngs: nnx.Rngs) -> None:
        self.pre_attention_norm = RMSNorm(c.dim)
        self.attn = Attention(c, rngs=rngs)
        self.pre_ffw_norm = RMSNorm(c.dim)
        self.mlp = FeedForward(c, rngs=rngs)
        self.dropout = nnx.Dropout(c.dropout, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        x = x + self.dropout(self.attn(self.pre_attention_norm(x)))
        return x + self.dropout(self.mlp(self.pre_ffw_norm(x)))


class Transformer(nnx.Module):
    def __init__(self, c: Config, *, rngs: nnx.Rngs) -> None:
        self.embedder = Embedder(c, rngs=rngs)
        self.layers = nnx.List([Block(c, rngs=rngs) for _ in range(c.layers)])
        self.final_norm = RMSNorm(c.dim)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        x = self.embedder.encode(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.embedder.decode(self.final_norm(x)).astype(jnp.float32)


def load_text() -> np.ndarray:
    """A few standard-library modules' sources as bytes: nothing to download."""
    text = "\n".join(inspect.getsource(importlib.import_module(m)) for m in ("textwrap", "string"))
    return np.frombuffer(text.encode("ascii", "replace"), np.uint8).astype(np.int32)


def batches(data: np.ndarray, seq: int, batch: int, seed: int):
    rng = np.random.default_rng(seed)
    while True:
        starts = rng.integers(0, len(data) - seq - 1, batch)
        chunk = np.stack([data[s : s + seq + 1] for s in starts])
        yield jnp.asarray(chunk[:, :-1]), jnp.asarray(chunk[:, 1:])


def cross_entropy(logits: jax.Array, targets: jax.Array) -> jax.Array:
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()


def train(config: Config, steps: int, seed: int = 0) -> float:
    """Trains for ``steps`` steps and returns the loss on held-out text."""
    model = jdls.nnx.probes(Transformer(config, rngs=nnx.Rngs(seed)), jnp.zeros((1, 8), int))
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(3e-3, weight_decay=0.01))
    optimizer = jdls.nnx.Optimizer(model, jdls.wrap(tx), wrt=nnx.Param)
    data = load_text()
    cut = len(data) * 9 // 10
    train_data, test_data = batches(data[:cut], 64, 16, seed), batches(data[cut:], 64, 64, 1)

    @nnx.jit
    def train_step(model, optimizer, tokens, targets):
        def loss_fn(model):
            return cross_entropy(model(tokens), targets)

        loss, grads = jdls.nnx.value_and_grad(loss_fn, jdls.get_scale(optimizer))(model)
        optimizer.update(model, grads, value=loss)
        return loss, optax.tree.norm(grads)

    @nnx.jit
    def evaluate(model, tokens, targets):
        return cross_entropy(model(tokens), targets)

    for step in range(steps):
        loss, grad_norm = train_step(model, optimizer, *next(train_data))
        if step % 50 == 0:
            print(f"step {step}: loss {float(loss):.4f}")
        if not np.isfinite(grad_norm) and not jdls.skip_cause(optimizer).handled:
            raise FloatingPointError(f"step {step}: the gradient norm is {grad_norm}")
    print(jdls.Telemetry.of(model).table())
    model.eval()
    return float(evaluate(model, *next(test_data)))


def main(argv: list[str] | None = None) -> float:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=150)
    args = parser.parse_args(argv)
    loss = train(Config(), args.steps)
    print(f"test loss {loss:.4f}")
    return loss


if __name__ == "__main__":
    main()
