"""The shortest complete use of jdls: float16 compute, float32 weights, dynamic loss scaling.

A linear model learns ``y = x @ w_true`` with its forward and backward pass in float16. Three
things make it mixed-precision training with dynamic loss scaling:

1. ``tx = jdls.wrap(optax.adam(...))``: the optimizer skips a step whose gradients hold an inf
   or NaN and adjusts the loss scale after every step;
2. ``scale = jdls.get_scale(opt_state)``: the scale for this step;
3. ``scale.value_and_grad(loss_fn)``: scales the loss, differentiates, and returns the
   unscaled loss and the unscaled gradients (float32).

Run::

    python examples/quickstart.py
    python examples/quickstart.py --steps 50
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import optax
from tqdm import trange

import jdls


def loss_fn(params: dict, x: jax.Array, y: jax.Array) -> jax.Array:
    """Mean squared error of a linear model computed in float16 (weights stored in float32)."""
    pred = x.astype(jnp.float16) @ params["w"].astype(jnp.float16)
    return jnp.mean((pred.astype(jnp.float32) - y) ** 2)


def main(argv: Sequence[str] | None = None) -> dict:
    """Train; returns the final loss, loss scale and number of skipped steps."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300, help="training steps")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)

    kx, kw = jax.random.split(jax.random.key(0))
    x = jax.random.normal(kx, (256, 16))
    y = x @ jax.random.normal(kw, (16, 1))
    params = {"w": jnp.zeros((16, 1), jnp.float32)}  # float32 master weights

    tx = jdls.wrap(optax.adam(5e-2))  # default jdls.AdaptiveScale(): follows the gradients
    opt_state = tx.init(params)

    @jax.jit
    def train_step(params: dict, opt_state: jdls.WrapState) -> tuple:
        scale = jdls.get_scale(opt_state)
        loss, grads = scale.value_and_grad(loss_fn)(params, x, y)  # unscaled, float32
        updates, opt_state = tx.update(grads, opt_state, params)  # skipped if not finite
        return optax.apply_updates(params, updates), opt_state, loss

    loss = jnp.inf
    for _ in trange(args.steps, desc="quickstart", disable=args.quiet):
        params, opt_state, loss = train_step(params, opt_state)

    result = {
        "loss": float(loss),
        "loss_scale": float(jdls.get_scale(opt_state).loss_scale),
        "skipped_steps": int(jdls.stats(opt_state).skipped_steps),
    }
    print(
        f"loss {result['loss']:.3g}, loss scale {result['loss_scale']:g}, "
        f"skipped steps {result['skipped_steps']}"
    )
    return result


if __name__ == "__main__":
    main()
