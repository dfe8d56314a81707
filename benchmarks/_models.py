"""The models of the full-step benchmarks: an MLP and a small decoder-only transformer.

Plain JAX, float32 master parameters, float16 compute: the loss casts the parameters and the
inputs to float16, runs the model, and computes the loss in float32. Every variant of the
step benchmark differentiates the same loss of the same model.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

F16 = jnp.float16


def _cast(tree: Any, dtype: Any) -> Any:
    return jax.tree_util.tree_map(lambda x: x.astype(dtype), tree)


# --------------------------------------------------------------------------------------------
# MLP.
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class MLPConfig:
    """An MLP regression problem: ``widths[0]`` inputs, ``widths[-1]`` outputs, ReLU between."""

    widths: tuple[int, ...] = (1024, 2048, 2048, 1024)
    batch: int = 256

    @property
    def n_params(self) -> int:
        return sum(a * b + b for a, b in zip(self.widths[:-1], self.widths[1:], strict=True))


def mlp_init(config: MLPConfig, seed: int = 0) -> dict[str, Any]:
    rng = np.random.default_rng(seed)
    params = {}
    for i, (a, b) in enumerate(zip(config.widths[:-1], config.widths[1:], strict=True)):
        params[f"dense_{i}"] = {
            "kernel": jnp.asarray(rng.standard_normal((a, b), np.float32) / np.sqrt(a)),
            "bias": jnp.zeros((b,), jnp.float32),
        }
    return params


def mlp_batch(config: MLPConfig, seed: int = 1, poison: bool = False) -> dict[str, jax.Array]:
    """A fixed batch; with ``poison`` one input is inf (every gradient becomes non-finite)."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((config.batch, config.widths[0]), np.float32)
    if poison:
        x[0, 0] = np.inf
    y = rng.standard_normal((config.batch, config.widths[-1]), np.float32)
    return {"x": jnp.asarray(x, F16), "y": jnp.asarray(y)}


def mlp_loss(params: Any, batch: dict[str, jax.Array]) -> jax.Array:
    p = _cast(params, F16)
    h = batch["x"]
    n = len(p)
    for i in range(n):
        layer = p[f"dense_{i}"]
        h = h @ layer["kernel"] + layer["bias"]
        if i < n - 1:
            h = jax.nn.relu(h)
    return jnp.mean(jnp.square(h.astype(jnp.float32) - batch["y"]))


# --------------------------------------------------------------------------------------------
# Transformer.
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class TransformerConfig:
    """A decoder-only language model with pre-layer-norm blocks and tied embeddings."""

    vocab: int = 2048
    d_model: int = 256
    heads: int = 4
    layers: int = 4
    d_mlp: int = 1024
    seq: int = 128
    batch: int = 8

    @property
    def n_params(self) -> int:
        d, f = self.d_model, self.d_mlp
        block = 4 * d * d + 2 * d * f + f + d + 4 * d  # attention, mlp (+ biases), 2 norms
        return self.vocab * d + self.seq * d + self.layers * block + 2 * d


def transformer_init(config: TransformerConfig, seed: int = 0) -> dict[str, Any]:
    rng = np.random.default_rng(seed)
    d, f = config.d_model, config.d_mlp

    def normal(*shape: int, fan_in: int) -> jax.Array:
        return jnp.asarray(rng.standard_normal(shape, np.float32) / np.sqrt(fan_in))

    params: dict[str, Any] = {
        "embed": normal(config.vocab, d, fan_in=d),
        "pos": normal(config.seq, d, fan_in=d),
        "final_norm": {"scale": jnp.ones((d,)), "bias": jnp.zeros((d,))},
    }
    for i in range(config.layers):
        params[f"block_{i}"] = {
            "norm1": {"scale": jnp.ones((d,)), "bias": jnp.zeros((d,))},
            "qkv": normal(d, 3 * d, fan_in=d),
            "out": normal(d, d, fan_in=d),
            "norm2": {"scale": jnp.ones((d,)), "bias": jnp.zeros((d,))},
            "mlp_in": normal(d, f, fan_in=d),
            "mlp_in_bias": jnp.zeros((f,)),
            "mlp_out": normal(f, d, fan_in=f),
            "mlp_out_bias": jnp.zeros((d,)),
        }
    return params


def transformer_batch(
    config: TransformerConfig, seed: int = 1, poison: bool = False
) -> dict[str, jax.Array]:
    """Random tokens; with ``poison`` the loss is multiplied by inf (non-finite gradients)."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, config.vocab, (config.batch, config.seq + 1), dtype=np.int32)
    weight = np.float32(np.inf if poison else 1.0)
    return {"tokens": jnp.asarray(tokens), "weight": jnp.asarray(weight)}


def _layer_norm(x: jax.Array, p: dict[str, jax.Array]) -> jax.Array:
    x32 = x.astype(jnp.float32)
    mean = jnp.mean(x32, -1, keepdims=True)
    var = jnp.mean(jnp.square(x32 - mean), -1, keepdims=True)
    y = (x32 - mean) * jax.lax.rsqrt(var + 1e-5)
    return (y * p["scale"].astype(jnp.float32) + p["bias"].astype(jnp.float32)).astype(x.dtype)


def transformer_loss_fn(config: TransformerConfig) -> Any:
    heads = config.heads

    def loss(params: Any, batch: dict[str, jax.Array]) -> jax.Array:
        p = _cast(params, F16)
        tokens = batch["tokens"]
        inputs, targets = tokens[:, :-1], tokens[:, 1:]
        b, t = inputs.shape
        x = p["embed"][inputs] + p["pos"][None, :t]
        mask = jnp.tril(jnp.ones((t, t), jnp.bool_))
        for i in range(config.layers):
            blk = p[f"block_{i}"]
            y = _layer_norm(x, blk["norm1"])
            q, k, v = jnp.split(y @ blk["qkv"], 3, axis=-1)
            q, k, v = (z.reshape(b, t, heads, -1) for z in (q, k, v))
            logits = jnp.einsum("bqhd,bkhd->bhqk", q, k).astype(jnp.float32)
            logits = logits / np.sqrt(q.shape[-1])
            att = jax.nn.softmax(jnp.where(mask, logits, -1e9), axis=-1).astype(F16)
            y = jnp.einsum("bhqk,bkhd->bqhd", att, v).reshape(b, t, -1)
            x = x + y @ blk["out"]
            y = _layer_norm(x, blk["norm2"])
            y = jax.nn.gelu(y @ blk["mlp_in"] + blk["mlp_in_bias"])
            x = x + y @ blk["mlp_out"] + blk["mlp_out_bias"]
        x = _layer_norm(x, p["final_norm"])
        logits = (x @ p["embed"].T).astype(jnp.float32)
        logp = jax.nn.log_softmax(logits, axis=-1)
        nll = -jnp.take_along_axis(logp, targets[..., None], axis=-1)
        return jnp.mean(nll) * batch["weight"]

    return loss
