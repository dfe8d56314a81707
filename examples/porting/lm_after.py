"""A small Gemma-style language model in Flax linen, as an open-source codebase writes one:
the projections are hand-written parameters and einsums (no ``nn.Dense``), the embedder has
``encode``/``decode`` methods and ties the head to its table, the blocks run under
``nn.scan(nn.remat(Block))`` with dropout, the optimizer is built with a global-norm clip in
front, the train state is a dict and the loop stops on a non-finite gradient norm.

The program comes twice: ``lm_before.py`` is the codebase as written (float32) and
``lm_after.py`` the same codebase with jdls (float16 with loss scaling, a row of backward-pass
telemetry per layer, FP8 projections). docs/porting.md walks through the diff, line by line.

Run::

    python examples/porting/lm_before.py --steps 150
    python examples/porting/lm_after.py --steps 150
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import inspect

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

import jdls
from jdls.fp8.linen import Einsum as Fp8Einsum


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


def init(std: float = 0.02) -> nn.initializers.Initializer:
    return nn.initializers.normal(std)


class Embedder(nn.Module):
    config: Config

    def setup(self) -> None:
        self.table = self.param("table", init(1.0), (self.config.vocab, self.config.dim))

    def encode(self, tokens: jax.Array) -> jax.Array:
        x = self.table[tokens] * jnp.sqrt(float(self.config.dim))
        return x.astype(self.config.dtype)

    def decode(self, x: jax.Array) -> jax.Array:
        return jnp.dot(x, self.table.T.astype(x.dtype))


class RMSNorm(nn.Module):
    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        scale = self.param("scale", nn.initializers.zeros_init(), (x.shape[-1],))
        var = jnp.mean(jnp.square(x.astype(jnp.float32)), axis=-1, keepdims=True)
        normed = x.astype(jnp.float32) * jax.lax.rsqrt(var + 1e-6) * (1.0 + scale)
        return normed.astype(x.dtype)


class Attention(nn.Module):
    config: Config

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        c = self.config
        qkv = self.param("qkv_einsum", init(), (3, c.heads, c.dim, c.head_dim))
        q, k, v = Fp8Einsum(name="qkv_fp8")("BSD,3KDH->3BSKH", x, qkv.astype(c.dtype))
        logits = jnp.einsum("BTKH,BSKH->BKTS", q, k).astype(jnp.float32) / np.sqrt(c.head_dim)
        causal = jnp.tril(jnp.ones((x.shape[1], x.shape[1]), bool))
        probs = jax.nn.softmax(jnp.where(causal, logits, -1e30), axis=-1).astype(c.dtype)
        encoded = jnp.einsum("BKTS,BSKH->BTKH", probs, v)
        out = self.param("attn_vec_einsum", init(), (c.heads, c.head_dim, c.dim))
        return Fp8Einsum(name="out_fp8")("BTKH,KHD->BTD", encoded, out.astype(c.dtype))


class FeedForward(nn.Module):
    config: Config

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        c = self.config
        gating = self.param("gating_einsum", init(), (2, c.dim, c.hidden))
        gate = Fp8Einsum(name="gating_fp8")("BTD,2DF->2BTF", x, gating.astype(c.dtype))
        hidden = nn.gelu(gate[0]) * gate[1]
        linear = self.param("linear", init(), (c.hidden, c.dim))
        return Fp8Einsum(name="linear_fp8")("BTF,FD->BTD", hidden, linear.astype(c.dtype))


class Block(nn.Module):
    config: Config
    deterministic: bool

    @nn.compact
    def __call__(self, x: jax.Array, _: None) -> tuple[jax.Array, None]:
        drop = nn.Dropout(self.config.dropout, deterministic=self.deterministic)
        x = x + drop(Attention(self.config, name="attn")(RMSNorm(name="pre_attention_norm")(x)))
        x = x + drop(FeedForward(self.config, name="mlp")(RMSNorm(name="pre_ffw_norm")(x)))
        return x, None


class Transformer(nn.Module):
    config: Config
    deterministic: bool = True

    @nn.compact
    def __call__(self, tokens: jax.Array) -> jax.Array:
        embedder = Embedder(self.config, name="embedder")
        x = embedder.encode(tokens)
        blocks = nn.scan(
            nn.remat(Block),
            variable_axes={"params": 0, "jdls": 0},
            split_rngs={"params": True, "dropout": True},
            length=self.config.layers,
        )
        x, _ = blocks(self.config, self.deterministic, name="layers")(x, None)
        x = RMSNorm(name="final_norm")(x)
        return embedder.decode(x).astype(jnp.float32)


def make_optimizer(learning_rate: float) -> optax.GradientTransformation:
    """The codebase's own builder: a global-norm clip of the matrices in front of AdamW."""
    matrices = lambda params: jax.tree.map(lambda p: p.ndim > 1, params)  # noqa: E731
    return optax.chain(
        optax.masked(optax.clip_by_global_norm(1.0), matrices),
        optax.adamw(learning_rate, weight_decay=0.01),
    )


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
    model = jdls.linen.probes(Transformer(config, deterministic=False))
    evaluator = Transformer(config)
    tx = jdls.wrap(make_optimizer(3e-3))
    data = load_text()
    cut = len(data) * 9 // 10
    train_data, test_data = batches(data[:cut], 64, 16, seed), batches(data[cut:], 64, 64, 1)
    tokens, _ = next(train_data)
    params = model.init(jax.random.key(seed), tokens)
    state = {"params": params, "opt_state": tx.init(params), "step": 0}

    @jax.jit
    def train_step(state, tokens, targets, key):
        def loss_fn(params):
            logits = model.apply(params, tokens, rngs={"dropout": key})
            return cross_entropy(logits, targets)

        params, opt_state = state["params"], state["opt_state"]
        loss, grads = jdls.linen.value_and_grad(loss_fn, jdls.get_scale(opt_state))(params)
        params, opt_state = jdls.linen.apply_gradients(tx, params, grads, opt_state, value=loss)
        new = {"params": params, "opt_state": opt_state, "step": state["step"] + 1}
        return new, loss, optax.tree.norm(grads)

    @jax.jit
    def evaluate(params, tokens, targets):
        return cross_entropy(evaluator.apply(params, tokens), targets)

    key = jax.random.key(seed + 1)
    for step in range(steps):
        key, dropout_key = jax.random.split(key)
        state, loss, grad_norm = train_step(state, *next(train_data), dropout_key)
        if step % 50 == 0:
            print(f"step {step}: loss {float(loss):.4f}")
        if not np.isfinite(grad_norm) and not jdls.skip_cause(state["opt_state"]).handled:
            raise FloatingPointError(f"step {step}: the gradient norm is {grad_norm}")
    print(jdls.Telemetry.of(state["params"]["jdls"]).table())
    return float(evaluate(state["params"], *next(test_data)))


def main(argv: list[str] | None = None) -> float:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=150)
    args = parser.parse_args(argv)
    loss = train(Config(), args.steps)
    print(f"test loss {loss:.4f}")
    return loss


if __name__ == "__main__":
    main()
