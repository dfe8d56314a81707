"""An Equinox CNN trained in float16 with jdls, beside float32 and unscaled float16.

The model has the shape of Equinox's MNIST CNN example (a list of layers and functions:
``Conv2d``, ``MaxPool2d``, ``relu``, ``jnp.ravel``, three ``Linear`` with ``sigmoid`` and
``relu``, ``log_softmax``), sized for the scikit-learn digits (8x8 images). It is an
``eqx.Module`` whose leaves include functions, trained the Equinox way (``eqx.filter_jit``,
``eqx.filter(model, eqx.is_array)`` for optax, ``eqx.apply_updates``); the only jdls lines
are the optimizer and ``scale.value_and_grad``::

    tx = jdls.wrap(optax.adam(lr), jdls.DynamicScale(...))
    opt_state = tx.init(eqx.filter(model, eqx.is_array))
    ...
    scale = jdls.get_scale(opt_state)
    loss, grads = scale.value_and_grad(loss_fn)(model, x, y)
    updates, opt_state = tx.update(grads, opt_state, eqx.filter(model, eqx.is_array))
    model = eqx.apply_updates(model, updates)

The weights stay float32; the forward and backward passes run in float16 (the model's arrays
are cast inside the loss). The loss is the mean cross-entropy times a small weight
(``--loss-weight``, ``1e-4``), standing for the small gradients of deep float16 networks: the
float16 backward pass without scaling loses most gradients below float16's smallest
subnormal (``6e-8``), while Adam, invariant to the loss's scale, trains the float32 run as
with a weight of 1. Three runs from the same initialisation and batches: ``float32``,
``float16`` (no scaling: ``jdls.NoOpScale``), ``float16+jdls`` (``jdls.DynamicScale``).

Run (about 30 s on 2 CPU cores)::

    python examples/equinox_cnn.py
    python examples/equinox_cnn.py --steps 300 --runs float32,float16+jdls
"""

from __future__ import annotations

import argparse
import math
import time
from collections.abc import Sequence
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax

import jdls

RUNS: dict[str, tuple[Any, Any]] = {
    "float32": (jnp.float32, jdls.NoOpScale),
    "float16": (jnp.float16, jdls.NoOpScale),
    "float16+jdls": (
        jnp.float16,
        lambda: jdls.DynamicScale(2.0**15, growth_interval=50, max_loss_scale=2.0**32),
    ),
}


class CNN(eqx.Module):
    """Equinox's MNIST CNN, for 8x8 digits: conv 3x3 (3 channels), max-pool 2x2, then
    75-512-64-10."""

    layers: list

    def __init__(self, key: jax.Array) -> None:
        key1, key2, key3, key4 = jax.random.split(key, 4)
        self.layers = [
            eqx.nn.Conv2d(1, 3, kernel_size=3, key=key1),
            eqx.nn.MaxPool2d(kernel_size=2),
            jax.nn.relu,
            jnp.ravel,
            eqx.nn.Linear(75, 512, key=key2),
            jax.nn.sigmoid,
            eqx.nn.Linear(512, 64, key=key3),
            jax.nn.relu,
            eqx.nn.Linear(64, 10, key=key4),
            jax.nn.log_softmax,
        ]

    def __call__(self, x: jax.Array) -> jax.Array:
        for layer in self.layers:
            x = layer(x)
        return x


def cast(model: Any, dtype: Any) -> Any:
    """The model with its floating-point arrays in ``dtype`` (functions left as they are)."""
    return jax.tree_util.tree_map(
        lambda x: x.astype(dtype) if eqx.is_inexact_array(x) else x, model
    )


def load_data() -> tuple[np.ndarray, ...]:
    """The scikit-learn digits as 1x8x8 images in [0, 1], split 70/30 (stratified, seed 0)."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    x = (digits.images / 16.0).astype(np.float32)[:, None]
    y = digits.target.astype(np.int32)
    return tuple(train_test_split(x, y, test_size=0.3, random_state=0, stratify=y))


def train(name: str, args: argparse.Namespace, data: tuple, batches: np.ndarray) -> dict:
    """One run; returns its test accuracy, zero-gradient fraction, skips and final scale."""
    dtype, make_scale = RUNS[name]
    x_train, x_test, y_train, y_test = (jnp.asarray(a) for a in data)
    model = CNN(jax.random.key(args.seed))
    tx = jdls.wrap(optax.adam(args.lr), make_scale())
    opt_state = tx.init(eqx.filter(model, eqx.is_array))

    def loss_fn(model: CNN, x: jax.Array, y: jax.Array) -> jax.Array:
        logits = jax.vmap(cast(model, dtype))(x.astype(dtype)).astype(jnp.float32)
        return args.loss_weight * -jnp.mean(jnp.take_along_axis(logits, y[:, None], axis=1))

    @eqx.filter_jit
    def train_step(model: CNN, opt_state: Any, idx: jax.Array) -> tuple:
        scale = jdls.get_scale(opt_state)
        _, grads = scale.value_and_grad(loss_fn)(model, x_train[idx], y_train[idx])
        leaves = jax.tree_util.tree_leaves(grads)
        zeros = sum(jnp.sum(g == 0) for g in leaves) / sum(g.size for g in leaves)
        updates, opt_state = tx.update(grads, opt_state, eqx.filter(model, eqx.is_array))
        return eqx.apply_updates(model, updates), opt_state, zeros

    zeros = []
    for idx in batches:
        model, opt_state, z = train_step(model, opt_state, idx)
        zeros.append(z)
    logits = jax.vmap(cast(model, dtype))(x_test.astype(dtype))
    stats = jdls.stats(opt_state)
    return {
        "accuracy": float(jnp.mean(jnp.argmax(logits, -1) == y_test)),
        "zero_fraction": float(np.mean(jax.device_get(zeros))),
        "skipped_steps": int(stats.skipped_steps),
        "loss_scale": float(jdls.get_scale(opt_state).loss_scale),
    }


def main(argv: Sequence[str] | None = None) -> dict:
    """Run the comparison; returns the results by run name."""
    parser = argparse.ArgumentParser(
        description="Train an Equinox CNN on the digits in float16 with jdls, beside float32 "
        "and unscaled float16.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--loss-weight", type=float, default=1e-4)
    parser.add_argument("--runs", default=",".join(RUNS), help="comma-separated, among these")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quiet", action="store_true", help="print the table only")
    args = parser.parse_args(argv)
    names = [n.strip() for n in args.runs.split(",") if n.strip()]
    unknown = sorted(set(names) - set(RUNS))
    if unknown:
        parser.error(f"unknown runs {unknown}; choose among {list(RUNS)}")

    start = time.perf_counter()
    data = load_data()
    n = len(data[0])
    rng = np.random.default_rng(args.seed)
    per_epoch = n // args.batch_size
    order = np.concatenate(
        [
            rng.permutation(n)[: per_epoch * args.batch_size]
            for _ in range(args.steps // per_epoch + 1)
        ]
    )
    batches = order.reshape(-1, args.batch_size)[: args.steps].astype(np.int32)

    results = {}
    for name in names:
        if not args.quiet:
            print(f"training {name} ...", flush=True)
        results[name] = train(name, args, data, batches)
    print(f"\nEquinox CNN on the digits, {args.steps} steps, loss weight {args.loss_weight:g}")
    print(f"{'run':<14}{'accuracy':>10}{'zero grads':>12}{'skipped':>9}{'loss scale':>12}")
    for name, r in results.items():
        scale = r["loss_scale"]
        shown = f"2^{math.log2(scale):g}" if math.log2(scale).is_integer() else f"{scale:.3g}"
        print(
            f"{name:<14}{100 * r['accuracy']:>9.2f}%{100 * r['zero_fraction']:>11.1f}%"
            f"{r['skipped_steps']:>9d}{shown:>12}"
        )
    print(f"total time {time.perf_counter() - start:.1f} s")
    return results


if __name__ == "__main__":
    main()
