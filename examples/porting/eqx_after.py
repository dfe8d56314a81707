"""A small Llama-3-style language model in Equinox, as an open-source codebase writes one:
the projections are the codebase's own ``Linear`` (a weight field and ``x @ weight.T``), the
layers are made by ``eqx.filter_vmap`` and run by a ``jax.lax.scan`` of
``eqx.filter_checkpoint``-ed bodies over the stack's arrays, with RMSNorm, causal attention
and a SwiGLU MLP; the optimizer is a global-norm clip in front of AdamW, the jitted step
takes the model's arrays and its static half (a static argument), and the loop stops on a
non-finite gradient norm.

The program comes twice: ``eqx_before.py`` is the codebase as written (float32) and
``eqx_after.py`` the same codebase with jdls (float16 with loss scaling, a row of
backward-pass telemetry per layer, FP8 projections). docs/porting.md walks through the diff,
line by line.

Run::

    python examples/porting/eqx_before.py --steps 150
    python examples/porting/eqx_after.py --steps 150
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import importlib
import inspect

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax

import jdls
import jdls.equinox


@dataclasses.dataclass(frozen=True)
class Config:
    vocab: int = 256
    dim: int = 64
    heads: int = 4
    head_dim: int = 16
    hidden: int = 128
    layers: int = 4
    dtype: object = jnp.float16


class Linear(eqx.Module):
    weight: jax.Array
    site: jdls.Site

    def __init__(self, n_in: int, n_out: int, key: jax.Array) -> None:
        self.weight = jax.random.normal(key, (n_out, n_in)) * 0.02
        self.site = jdls.fp8.init(jdls.fp8.DelayedScaling())

    def __call__(self, x: jax.Array) -> jax.Array:
        return jdls.fp8.einsum("...i,oi->...o", x, self.weight.astype(x.dtype), site=self.site)


class Embedding(eqx.Module):
    weight: jax.Array

    def __init__(self, vocab: int, dim: int, key: jax.Array) -> None:
        self.weight = jax.random.normal(key, (vocab, dim))

    def __call__(self, tokens: jax.Array) -> jax.Array:
        return self.weight[tokens]


class RMSNorm(eqx.Module):
    weight: jax.Array

    def __init__(self, dim: int) -> None:
        self.weight = jnp.ones(dim)

    def __call__(self, x: jax.Array) -> jax.Array:
        var = jnp.mean(jnp.square(x.astype(jnp.float32)), axis=-1, keepdims=True)
        return (x.astype(jnp.float32) * jax.lax.rsqrt(var + 1e-6) * self.weight).astype(x.dtype)


class Attention(eqx.Module):
    wq: Linear
    wk: Linear
    wv: Linear
    wo: Linear
    heads: int = eqx.field(static=True)

    def __init__(self, c: Config, key: jax.Array) -> None:
        kq, kk, kv, ko = jax.random.split(key, 4)
        self.wq = Linear(c.dim, c.heads * c.head_dim, kq)
        self.wk = Linear(c.dim, c.heads * c.head_dim, kk)
        self.wv = Linear(c.dim, c.heads * c.head_dim, kv)
        self.wo = Linear(c.heads * c.head_dim, c.dim, ko)
        self.heads = c.heads

    def __call__(self, x: jax.Array) -> jax.Array:
        batch, seq, _ = x.shape
        split = lambda h: h.reshape(batch, seq, self.heads, -1)  # noqa: E731
        q, k, v = split(self.wq(x)), split(self.wk(x)), split(self.wv(x))
        logits = jnp.einsum("BTKH,BSKH->BKTS", q, k).astype(jnp.float32)
        logits = logits / np.sqrt(q.shape[-1])
        causal = jnp.tril(jnp.ones((seq, seq), bool))
        probs = jax.nn.softmax(jnp.where(causal, logits, -1e30), axis=-1).astype(x.dtype)
        return self.wo(jnp.einsum("BKTS,BSKH->BTKH", probs, v).reshape(batch, seq, -1))


class MLP(eqx.Module):
    gate: Linear
    up: Linear
    down: Linear

    def __init__(self, c: Config, key: jax.Array) -> None:
        kg, ku, kd = jax.random.split(key, 3)
        self.gate = Linear(c.dim, c.hidden, kg)
        self.up = Linear(c.dim, c.hidden, ku)
        self.down = Linear(c.hidden, c.dim, kd)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.down(jax.nn.silu(self.gate(x)) * self.up(x))


class Layer(eqx.Module):
    attention_norm: RMSNorm
    attention: Attention
    ffn_norm: RMSNorm
    feed_forward: MLP

    def __init__(self, c: Config, key: jax.Array) -> None:
        ka, kf = jax.random.split(key)
        self.attention_norm, self.ffn_norm = RMSNorm(c.dim), RMSNorm(c.dim)
        self.attention, self.feed_forward = Attention(c, ka), MLP(c, kf)

    def __call__(self, x: jax.Array) -> jax.Array:
        x = x + self.attention(self.attention_norm(x))
        return x + self.feed_forward(self.ffn_norm(x))


class Transformer(eqx.Module):
    embed: Embedding
    layers: Layer  # a stack made by eqx.filter_vmap: every array has a leading axis
    norm: RMSNorm
    output: Linear
    dtype: object = eqx.field(static=True)

    def __init__(self, c: Config, key: jax.Array) -> None:
        ke, kl, ko = jax.random.split(key, 3)
        self.embed = Embedding(c.vocab, c.dim, ke)
        make_layer = lambda k: Layer(c, k)  # noqa: E731
        self.layers = eqx.filter_vmap(make_layer)(jax.random.split(kl, c.layers))
        self.norm, self.output = RMSNorm(c.dim), Linear(c.dim, c.vocab, ko)
        self.dtype = c.dtype

    def __call__(self, tokens: jax.Array) -> jax.Array:
        x = self.embed(tokens).astype(self.dtype)
        dynamic, static = eqx.partition(self.layers, eqx.is_array)

        @eqx.filter_checkpoint
        def body(x, layer):
            return eqx.combine(layer, static)(x), None

        x, _ = jax.lax.scan(body, x, dynamic)
        return self.output(self.norm(x)).astype(jnp.float32)


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
    key = jax.random.key(seed)
    model = jdls.equinox.probes(Transformer(config, key), stacked=lambda m: m.layers)
    tx = jdls.wrap(optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(3e-3)))
    data = load_text()
    cut = len(data) * 9 // 10
    train_data, test_data = batches(data[:cut], 64, 16, seed), batches(data[cut:], 64, 64, 1)
    params, static = eqx.partition(model, eqx.is_array)
    opt_state = tx.init(params)

    @functools.partial(jax.jit, static_argnums=1)
    def train_step(params, static, opt_state, tokens, targets):
        def loss_fn(params):
            return cross_entropy(eqx.combine(params, static)(tokens), targets)

        loss, grads = jdls.get_scale(opt_state).value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params, value=loss)
        params = jdls.equinox.apply_updates(params, updates, opt_state)
        return params, opt_state, loss, optax.tree.norm(grads)

    @functools.partial(jax.jit, static_argnums=1)
    def evaluate(params, static, tokens, targets):
        return cross_entropy(eqx.combine(params, static)(tokens), targets)

    for step in range(steps):
        params, opt_state, loss, grad_norm = train_step(
            params, static, opt_state, *next(train_data)
        )
        if step % 50 == 0:
            print(f"step {step}: loss {float(loss):.4f}")
        if not np.isfinite(grad_norm) and not jdls.skip_cause(opt_state).handled:
            raise FloatingPointError(f"step {step}: the gradient norm is {grad_norm}")
    print(jdls.Telemetry.of(params).table())
    return float(evaluate(params, static, *next(test_data)))


def main(argv: list[str] | None = None) -> float:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=150)
    args = parser.parse_args(argv)
    loss = train(Config(), args.steps)
    print(f"test loss {loss:.4f}")
    return loss


if __name__ == "__main__":
    main()
