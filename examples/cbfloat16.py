"""Training in Cerebras' cbfloat16 (emulated) with jdls, compared with float16.

``cbfloat16`` is a 16-bit format with 6 exponent bits and 9 mantissa bits: a range from
``1.8e-12`` (smallest subnormal) to ``4.3e9``, against float16's ``6.0e-8`` to ``65504``, at
the price of one bit of precision. JAX has no such dtype; ``jdls.get_policy`` emulates it: a
cbfloat16 array is a float32 array whose values are rounded to the cbfloat16 grid at every
policy cast, and the backward pass rounds the cotangents at the same casts, so gradients
underflow and overflow as they would on hardware. The policy string is the only change:
``"params=float32,compute=cbfloat16,output=float32"``.

The task is the one of ``examples/demo.py``: the scikit-learn digits, a 64-256-256-10 MLP with
float32 master weights, and a loss ``loss_weight * mean cross-entropy`` whose small weight
(``5e-6``) sends every gradient of the float16 backward pass below float16's range. Three
runs from the same initial parameters and batches:

* ``float16+jdls``: float16 compute, ``jdls.DynamicScale`` starting at ``2**15``, doubling
  every 50 finite steps, without a maximum;
* ``cbfloat16``: cbfloat16 compute, no loss scaling;
* ``cbfloat16+jdls``: cbfloat16 compute with Cerebras' own rule,
  ``jdls.presets.cerebras(half_dtype="cbfloat16")``: the scale starts at its maximum
  ``2**31`` and halves when a gradient overflows.

The table shows what the wider range buys: without any scaling, cbfloat16 keeps most of the
gradients that float16 loses entirely (the model trains), and with the Cerebras scale it needs
no backoff and no skipped step; float16 needs a scale near ``2**40`` and skips the steps that
overflow on the way there. A loss weight small enough to push cbfloat16's gradients out of
its range here (``1e-9``) stalls every run, float32 included: the gradients are then below
Adam's ``eps = 1e-8``, and no loss scale changes what Adam sees.

Run (under a minute on 2 CPU cores)::

    python examples/cbfloat16.py
    python examples/cbfloat16.py --steps 300 --runs cbfloat16,cbfloat16+jdls
"""

from __future__ import annotations

import argparse
import math
import time
from collections.abc import Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from tqdm import tqdm

import jdls


class MLP(nn.Module):
    """A 64-256-256-10 MLP; every layer's output goes through the policy's compute cast."""

    policy: jdls.Policy

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        cast = self.policy.cast_to_compute  # rounds values and, backward, cotangents
        x = cast(x)
        x = cast(nn.relu(cast(nn.Dense(256)(x))))
        x = cast(nn.relu(cast(nn.Dense(256)(x))))
        return self.policy.cast_to_output(cast(nn.Dense(10)(x)))


def load_digits_split() -> tuple[np.ndarray, ...]:
    """The scikit-learn digits in [0, 1], split 70/30 (stratified, seed 0)."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32)
    y = digits.target.astype(np.int32)
    return tuple(train_test_split(x, y, test_size=0.3, random_state=0, stratify=y))


RUNS: dict[str, tuple[str, Any]] = {
    "float16+jdls": (
        "float16",
        lambda: jdls.DynamicScale(2.0**15, growth_interval=50, max_loss_scale=None),
    ),
    "cbfloat16": ("cbfloat16", jdls.NoOpScale),
    "cbfloat16+jdls": ("cbfloat16", lambda: jdls.presets.cerebras(half_dtype="cbfloat16")),
}


def train(name: str, args: argparse.Namespace, data: tuple, batches: np.ndarray) -> dict:
    """One run; returns its accuracy, zero-gradient fraction, skipped steps and final scale."""
    compute, make_scale = RUNS[name]
    policy = jdls.get_policy(f"params=float32,compute={compute},output=float32")
    model = MLP(policy)
    x_train, x_test, y_train, y_test = (jnp.asarray(a) for a in data)
    state = jdls.linen.TrainState.create(
        apply_fn=model.apply,
        params=model.init(jax.random.key(args.seed), x_train[:1])["params"],
        tx=jdls.wrap(optax.adam(optax.cosine_decay_schedule(1e-3, args.steps)), make_scale()),
    )

    def loss_fn(params: Any, x: jax.Array, y: jax.Array) -> jax.Array:
        logits = state.apply_fn({"params": policy.cast_to_compute(params)}, x)
        cross_entropy = optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
        return args.loss_weight * cross_entropy

    @jax.jit
    def train_step(state: jdls.linen.TrainState, idx: jax.Array) -> tuple:
        _, grads = state.value_and_grad(loss_fn)(state.params, x_train[idx], y_train[idx])
        leaves = jax.tree.leaves(grads)
        zeros = sum(jnp.sum(g == 0) for g in leaves) / sum(g.size for g in leaves)
        state = state.apply_gradients(grads=grads)
        return state, jnp.where(state.stats.finite, zeros, jnp.nan)

    zeros = []
    for idx in tqdm(batches, desc=f"{name:>15}", disable=args.quiet):
        state, z = train_step(state, idx)
        zeros.append(z)
    logits = model.apply({"params": policy.cast_to_compute(state.params)}, x_test)
    return {
        "accuracy": float(jnp.mean(jnp.argmax(logits, -1) == y_test)),
        "zero_fraction": float(np.nanmean(jax.device_get(zeros))),
        "skipped_steps": int(state.stats.skipped_steps),
        "loss_scale": float(state.loss_scale),
    }


def main(argv: Sequence[str] | None = None) -> dict:
    """Run the comparison; returns the results by run name."""
    parser = argparse.ArgumentParser(
        description="Train the digits MLP in float16 and in emulated cbfloat16, with jdls.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--loss-weight", type=float, default=5e-6)
    parser.add_argument("--runs", default=",".join(RUNS), help="comma-separated, among these")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quiet", action="store_true", help="no progress bars")
    args = parser.parse_args(argv)
    names = [n.strip() for n in args.runs.split(",") if n.strip()]
    unknown = sorted(set(names) - set(RUNS))
    if unknown:
        parser.error(f"unknown runs {unknown}; choose among {list(RUNS)}")

    start = time.perf_counter()
    data = load_digits_split()
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

    results = {name: train(name, args, data, batches) for name in names}
    print(f"\ndigits MLP, {args.steps} steps, loss weight {args.loss_weight:g}")
    print(f"{'run':<16}{'accuracy':>10}{'zero grads':>12}{'skipped':>9}{'loss scale':>12}")
    for name, r in results.items():
        scale = r["loss_scale"]
        shown = f"2^{math.log2(scale):g}" if math.log2(scale).is_integer() else f"{scale:.3g}"
        print(
            f"{name:<16}{100 * r['accuracy']:>9.2f}%{100 * r['zero_fraction']:>11.1f}%"
            f"{r['skipped_steps']:>9d}{shown:>12}"
        )
    print(f"total time {time.perf_counter() - start:.1f} s")
    return results


if __name__ == "__main__":
    main()
