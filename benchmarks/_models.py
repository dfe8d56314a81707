"""The models of the full-step benchmarks: an MLP and a small decoder-only transformer.

Plain JAX, float32 master parameters, float16 compute: the loss casts the parameters and the
inputs to float16, runs the model, and computes the loss in float32. Every variant of the
step benchmark differentiates the same loss of the same model.

The losses take an optional ``mark(x, name)``, applied to every layer's output (default: the
identity, the plain model): a ``jdls.Probe`` site measures there, a ``jdls.layer_site``
changes scale there (``benchmarks/bench_capabilities.py``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

F16 = jnp.float16

#: ``mark(x, name) -> x``: what the losses apply to every layer's output.
Mark = Callable[[Any, str], Any]


def unmarked(x: Any, name: str) -> Any:
    """The default :data:`Mark`: the identity."""
    del name
    return x


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


def mlp_loss(params: Any, batch: dict[str, jax.Array], mark: Mark = unmarked) -> jax.Array:
    """Mean squared error; ``mark`` is applied to each dense layer's output (after its ReLU),
    named like its parameters (``dense_0``, ...)."""
    p = _cast(params, F16)
    h = batch["x"]
    n = len(p)
    for i in range(n):
        layer = p[f"dense_{i}"]
        h = h @ layer["kernel"] + layer["bias"]
        if i < n - 1:
            h = jax.nn.relu(h)
        h = mark(h, f"dense_{i}")
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


def transformer_layers(params: Any) -> dict[str, Any]:
    """The parameters keyed by layer, for per-layer scales: ``embed`` (token and position
    embeddings), ``block_0``, ``block_1``, ... and ``head`` (final norm and the tied embedding:
    the embedding array is in ``embed`` and in ``head``)."""
    layers: dict[str, Any] = {"embed": {"embed": params["embed"], "pos": params["pos"]}}
    layers.update((k, v) for k, v in params.items() if k.startswith("block_"))
    layers["head"] = {"final_norm": params["final_norm"], "embed": params["embed"]}
    return layers


def transformer_unlayer(layers: Any) -> dict[str, Any]:
    """Gradients keyed by layer back to the parameters' structure: the tied embedding's
    gradient is the sum of its two uses' (:func:`transformer_layers`)."""
    params = {k: v for k, v in layers.items() if k.startswith("block_")}
    params["embed"] = layers["embed"]["embed"] + layers["head"]["embed"]
    params["pos"] = layers["embed"]["pos"]
    params["final_norm"] = layers["head"]["final_norm"]
    return params


def transformer_logits_fn(
    config: TransformerConfig, mark: Mark = unmarked, layered: bool = False
) -> Callable[[Any, jax.Array], jax.Array]:
    """``logits(params, inputs)``, float32. ``mark`` is applied to the output of each layer:
    ``embed`` (token + position embedding), ``block_i`` (after the block's second residual
    add: a residual block is one layer) and ``head`` (final norm and logits). With
    ``layered``, ``params`` are keyed by layer (:func:`transformer_layers`)."""
    heads = config.heads

    def logits_fn(params: Any, inputs: jax.Array) -> jax.Array:
        p = _cast(params, F16)
        if not layered:
            p = transformer_layers(p)
        b, t = inputs.shape
        x = mark(p["embed"]["embed"][inputs] + p["embed"]["pos"][None, :t], "embed")
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
            x = mark(x + y @ blk["mlp_out"] + blk["mlp_out_bias"], f"block_{i}")
        head = p["head"]
        x = _layer_norm(x, head["final_norm"])
        return mark((x @ head["embed"].T).astype(jnp.float32), "head")

    return logits_fn


def _nll(logits: jax.Array, targets: jax.Array) -> jax.Array:
    logp = jax.nn.log_softmax(logits, axis=-1)
    return jnp.mean(-jnp.take_along_axis(logp, targets[..., None], axis=-1))


def transformer_loss_fn(
    config: TransformerConfig, mark: Mark = unmarked, layered: bool = False
) -> Callable[[Any, dict[str, jax.Array]], jax.Array]:
    """``loss(params, batch)``: next-token cross-entropy (``mark`` and ``layered`` as in
    :func:`transformer_logits_fn`)."""
    logits_fn = transformer_logits_fn(config, mark, layered)

    def loss(params: Any, batch: dict[str, jax.Array]) -> jax.Array:
        tokens = batch["tokens"]
        return _nll(logits_fn(params, tokens[:, :-1]), tokens[:, 1:]) * batch["weight"]

    return loss


#: The weight of the auxiliary z-loss (PaLM's).
Z_LOSS_WEIGHT = 1e-4


def transformer_losses_fn(
    config: TransformerConfig, mark: Mark = unmarked, layered: bool = False
) -> Callable[[Any, dict[str, jax.Array]], dict[str, jax.Array]]:
    """``losses(params, batch) -> {"nll": cross-entropy, "z": mean(logsumexp(logits)**2)}``:
    two losses, to be combined as ``nll + Z_LOSS_WEIGHT * z`` (PaLM's auxiliary z-loss)."""
    logits_fn = transformer_logits_fn(config, mark, layered)

    def losses(params: Any, batch: dict[str, jax.Array]) -> dict[str, jax.Array]:
        tokens = batch["tokens"]
        logits = logits_fn(params, tokens[:, :-1])
        z = jnp.mean(jnp.square(jax.nn.logsumexp(logits, axis=-1)))
        return {"nll": _nll(logits, tokens[:, 1:]) * batch["weight"], "z": z * batch["weight"]}

    return losses
