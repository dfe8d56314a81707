"""Per-loss scales: a small auxiliary loss that one global scale cannot serve.

A Flax linen autoencoder on the scikit-learn digits (64-128-32-64, tanh) reconstructs the raw
pixel intensities (0 to 16) with a squared error summed over pixels and batch, as much VAE
code reduces it, and an auxiliary classifier on its 32-unit code learns the digit, its mean
cross-entropy weighted ``1e-4``. Forward and backward run in float16 on float32 weights.

The summed reconstruction error is large, so any one global scale that keeps its gradients
finite (near ``2**1``) leaves the classifier's gradients at the bottom of float16's
subnormals: rounded to a few ulps or to zero, and the classifier learns about half as well
as in float32. ``jdls.multi_loss_value_and_grad`` gives each loss its own scale, in one
backward pass: the classifier's head computes at its own scale and its accuracy is float32's.

Five runs from the same initialisation and batches: float32, float16 with one global scale
(``jdls.wrap(adam)`` with PyTorch's rule), float16 with per-loss scales (PyTorch's rule per
loss; then ``jdls.AdaptiveScale()`` per loss, given each loss's measurement by
``jdls.adjust_loss_scales``), and float16 without scaling. Run::

    python examples/multitask.py             # about 25 s on 2 CPU cores
    python examples/multitask.py --steps 500
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

import jdls

AUX_WEIGHT = 1e-4
RUNS = (
    "float32",
    "float16, one global scale",
    "float16, per-loss scales",
    "float16, per-loss Adaptive",
    "float16, no scaling",
)


class Autoencoder(nn.Module):
    """Encoder 64-128-32 (tanh), decoder 32-64, classifier 32-10; computes in ``dtype``."""

    dtype: Any = jnp.float16

    @nn.compact
    def __call__(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        h = x.astype(self.dtype)
        h = jnp.tanh(nn.Dense(128, dtype=self.dtype, name="encoder_0")(h))
        code = jnp.tanh(nn.Dense(32, dtype=self.dtype, name="encoder_1")(h))
        decoded = nn.Dense(x.shape[-1], dtype=self.dtype, name="decoder")(code)
        logits = nn.Dense(10, dtype=self.dtype, name="classifier")(code)
        return decoded.astype(jnp.float32), logits.astype(jnp.float32)


def load_data(seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The digits scaled to [0, 1], split 70/30 into train and test (stratified)."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    x, y = load_digits(return_X_y=True)
    x = (x / 16.0).astype(np.float32)
    return train_test_split(x, y.astype(np.int32), test_size=0.3, random_state=seed, stratify=y)


@dataclasses.dataclass
class Result:
    """One run: the classifier's test accuracy, the reconstruction's mean squared error per
    pixel (raw intensities), skipped steps and the final scale(s) as powers of two."""

    accuracy: float
    reconstruction: float
    skipped: int
    scales: dict[str, float]


def train(run: str, steps: int, batch: int, seed: int) -> Result:
    """Train one of ``RUNS`` with Adam (learning rate 1e-3, cosine decay)."""
    xtr, xte, ytr, yte = load_data()
    dtype = jnp.float32 if run == "float32" else jnp.float16
    model = Autoencoder(dtype)
    params = Autoencoder(jnp.float32).init(jax.random.key(seed), jnp.ones((1, 64)))["params"]

    def losses(p: Any, x: jax.Array, y: jax.Array) -> dict[str, jax.Array]:
        decoded, logits = model.apply({"params": p}, x)
        ce = optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
        return {"reconstruction": jnp.sum((decoded - 16 * x) ** 2), "classifier": AUX_WEIGHT * ce}

    def total(p: Any, x: jax.Array, y: jax.Array) -> jax.Array:
        return sum(losses(p, x, y).values())

    per_loss = run.startswith("float16, per-loss")
    # one global scale in the optimizer state; the per-loss scales live beside it
    scale = jdls.presets.pytorch() if run == "float16, one global scale" else jdls.NoOpScale()
    tx = jdls.wrap(optax.adam(optax.cosine_decay_schedule(1e-3, steps)), scale)
    per_loss_scale = jdls.AdaptiveScale if run.endswith("Adaptive") else jdls.presets.pytorch
    scales = {"reconstruction": per_loss_scale(), "classifier": per_loss_scale()}

    @jax.jit
    def step(params: Any, opt: Any, scales: dict, x: jax.Array, y: jax.Array) -> tuple:
        if per_loss:
            fn = jdls.multi_loss_value_and_grad(losses, scales, with_amax=True)
            _, grads, finite, amax = fn(params, x, y)
            scales = jdls.adjust_loss_scales(scales, finite, amax)  # each by its own gradients
        else:
            _, grads = jdls.get_scale(opt).value_and_grad(total)(params, x, y)
        updates, opt = tx.update(grads, opt, params)
        return optax.apply_updates(params, updates), opt, scales

    opt = tx.init(params)
    order = np.random.default_rng(seed).integers(0, len(xtr), (steps, batch))
    for idx in order:
        params, opt, scales = step(params, opt, scales, xtr[idx], ytr[idx])

    decoded, logits = Autoencoder(jnp.float32).apply({"params": params}, xte)
    if per_loss:
        final = {k: float(s.loss_scale) for k, s in scales.items()}
    else:
        final = {"global": float(jdls.get_scale(opt).loss_scale)}
    return Result(
        accuracy=float(jnp.mean(jnp.argmax(logits, -1) == yte)),
        reconstruction=float(jnp.mean((decoded - 16 * xte) ** 2)),
        skipped=int(jdls.stats(opt).skipped_steps),
        scales=final,
    )


def main(argv: Sequence[str] | None = None) -> dict[str, Result]:
    """Train every run; print a table; return the results by run."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2000, help="training steps per run")
    parser.add_argument("--batch", type=int, default=1024, help="batch size")
    parser.add_argument("--seed", type=int, default=0, help="initialisation and batch order")
    parser.add_argument("--quiet", action="store_true", help="print nothing")
    args = parser.parse_args(argv)

    results = {run: train(run, args.steps, args.batch, args.seed) for run in RUNS}
    if not args.quiet:
        print(f"{'run':28s} {'classifier acc':>14s} {'recon. MSE':>10s} {'skipped':>7s}  scales")
        for run, r in results.items():
            scales = ", ".join(f"{k} 2**{np.log2(v):.0f}" for k, v in r.scales.items())
            print(f"{run:28s} {r.accuracy:14.3f} {r.reconstruction:10.2f} {r.skipped:7d}  {scales}")
    return results


if __name__ == "__main__":
    main()
