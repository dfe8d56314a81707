"""Data-parallel float16 training with jdls on several devices: ``jit`` or ``shard_map``.

On a CPU-only machine the script asks XLA for 8 virtual CPU devices (it sets
``XLA_FLAGS=--xla_force_host_platform_device_count=8`` before importing JAX, unless
``XLA_FLAGS`` already sets a device count). A Flax MLP (float32 parameters, float16 compute)
is trained on a synthetic classification task, the batch split across the devices and the
parameters replicated, in two ways:

* ``jit``: ``jax.jit`` with ``NamedSharding``s (the batch sharded along the mesh axis
  ``"data"``, the train state replicated). The step is written for the global batch; XLA
  inserts the gradient all-reduce. ``jdls.wrap`` needs nothing more: its finiteness check
  sees the global gradients.
* ``shard_map``: the step is written per device; it averages the gradients with
  ``lax.pmean`` and builds the optimizer with ``jdls.wrap(..., axis_name="data")`` so that
  all devices take the same skip decision and the same loss scale (a ``pmax`` of the
  non-finite flag), even if a gradient was not all-reduced.

Both start from the same state and see the same batches, so they print the same losses and
loss scales, up to the order of floating-point sums.

Run::

    python examples/data_parallel.py
    python examples/data_parallel.py --mode shard_map --steps 50
"""

from __future__ import annotations

import os

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()

import argparse  # (after setting XLA_FLAGS: JAX reads it when it starts)
from collections.abc import Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from tqdm import trange

import jdls

POLICY = jdls.get_policy("params=float32,compute=float16,output=float32")


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        x = nn.relu(nn.Dense(128)(x))
        x = nn.relu(nn.Dense(128)(x))
        return nn.Dense(4)(x)


MODEL = MLP()


def loss_fn(params: Any, x: jax.Array, y: jax.Array) -> jax.Array:
    """Cross-entropy of the MLP run in float16 (float32 master parameters, float32 loss)."""
    logits = MODEL.apply({"params": POLICY.cast_to_compute(params)}, POLICY.cast_to_compute(x))
    logits = POLICY.cast_to_output(logits)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def make_data(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """``n`` points in 16 dimensions, labelled by which of 4 random directions fits best."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 16)).astype(np.float32)
    directions = rng.normal(size=(16, 4)).astype(np.float32)
    return x, np.argmax(x @ directions, axis=1).astype(np.int32)


def make_state(mode: str, seed: int, learning_rate: float) -> jdls.linen.TrainState:
    params = MODEL.init(jax.random.key(seed), jnp.zeros((1, 16)))["params"]
    axis_name = "data" if mode == "shard_map" else None
    tx = jdls.wrap(optax.adam(learning_rate), jdls.DynamicScale(), axis_name=axis_name)
    return jdls.linen.TrainState.create(apply_fn=MODEL.apply, params=params, tx=tx)


def jit_step(mesh: jax.sharding.Mesh) -> Any:
    """The train step for ``jax.jit`` with shardings (global view)."""
    replicated = NamedSharding(mesh, P())

    def step(state: jdls.linen.TrainState, x: jax.Array, y: jax.Array) -> tuple:
        loss, grads = state.value_and_grad(loss_fn)(state.params, x, y)
        state = state.apply_gradients(grads=grads)  # skips if not finite, adjusts the scale
        return state, loss

    return jax.jit(step, out_shardings=(replicated, replicated), donate_argnums=0)


def shard_map_step(mesh: jax.sharding.Mesh) -> Any:
    """The train step for ``shard_map`` (per-device view, explicit all-reduce)."""

    def step(state: jdls.linen.TrainState, x: jax.Array, y: jax.Array) -> tuple:
        loss, grads = state.value_and_grad(loss_fn)(state.params, x, y)  # this device's part
        grads = jax.lax.pmean(grads, "data")
        state = state.apply_gradients(grads=grads)  # wrap(axis_name="data"): one decision
        return state, jax.lax.pmean(loss, "data")

    sharded = jax.shard_map(
        step, mesh=mesh, in_specs=(P(), P("data"), P("data")), out_specs=(P(), P())
    )
    return jax.jit(sharded, donate_argnums=0)


def train(mode: str, args: argparse.Namespace) -> dict:
    """Train in one mode; returns the per-step losses and the final scale and skips."""
    mesh = jax.make_mesh((jax.device_count(),), ("data",))
    x, y = make_data(args.batch_size * args.steps, args.seed)
    state = jax.device_put(
        make_state(mode, args.seed, args.learning_rate), NamedSharding(mesh, P())
    )
    step = jit_step(mesh) if mode == "jit" else shard_map_step(mesh)
    batch_sharding = NamedSharding(mesh, P("data"))

    losses = []
    bar = trange(args.steps, desc=f"{mode:>9}", disable=args.quiet)
    for i in bar:
        chunk = slice(i * args.batch_size, (i + 1) * args.batch_size)
        xb = jax.device_put(x[chunk], batch_sharding)
        yb = jax.device_put(y[chunk], batch_sharding)
        state, loss = step(state, xb, yb)
        losses.append(loss)
        if i % 25 == 0 or i == args.steps - 1:
            bar.set_postfix(loss=f"{float(loss):.3f}", scale=f"{float(state.loss_scale):g}")
    return {
        "losses": np.asarray(jax.device_get(losses)),
        "loss_scale": float(state.loss_scale),
        "skipped_steps": int(state.stats.skipped_steps),
        "replicated": all(p.sharding.is_fully_replicated for p in jax.tree.leaves(state.params)),
    }


def main(argv: Sequence[str] | None = None) -> dict:
    """Train in the chosen mode(s); returns the results by mode."""
    parser = argparse.ArgumentParser(
        description="Data-parallel float16 training with jdls (jit with shardings, shard_map).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--mode", choices=["jit", "shard_map", "both"], default="both")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch-size", type=int, default=512, help="global batch")
    parser.add_argument("--learning-rate", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)
    devices = jax.device_count()
    if args.batch_size % devices:
        parser.error(f"--batch-size must be a multiple of the {devices} devices")

    print(f"{devices} devices ({jax.devices()[0].platform}), global batch {args.batch_size}")
    modes = ["jit", "shard_map"] if args.mode == "both" else [args.mode]
    results = {mode: train(mode, args) for mode in modes}
    for mode, r in results.items():
        print(
            f"{mode:>9}: final loss {r['losses'][-1]:.4f}, loss scale {r['loss_scale']:g}, "
            f"skipped steps {r['skipped_steps']}, parameters replicated: {r['replicated']}"
        )
    if len(results) == 2:
        gap = np.max(np.abs(results["jit"]["losses"] - results["shard_map"]["losses"]))
        print(f"largest difference between the two runs' losses: {gap:.2e}")
    return results


if __name__ == "__main__":
    main()
