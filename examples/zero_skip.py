"""Zero dropped batches: retrying scale-caused overflows inside the step, against skipping them.

A small MLP regresses a synthetic target with its forward and backward pass in float16
(float32 master weights), Adam with a cosine learning-rate schedule, and a dynamic loss scale
that grows every 10 finite steps up to ``2**16`` (so it keeps climbing back to where it
overflows, as real runs do). At random steps (``--inject-rate``) the batch carries an outlier
whose scaled gradient, ``3 * scale``, overflows float16 at ``2**15`` and ``2**16`` but not at
``2**14``: a **scale-caused** overflow, the kind every peer library answers by throwing the
batch away.

The same data, the same injected outliers, trained two ways:

* ``skip``: ``jdls.retrying(loss_fn, jdls.wrap(adam, scale), retries=0)``, the plain step:
  the overflowing batch is dropped, the step skipped, the scale halved. Adam's step count,
  and so the schedule, falls behind the data.
* ``retry``: ``jdls.retrying(loss_fn, jdls.wrap(adam, scale), retries=2)``: the gradients of
  the same batch are recomputed at the halved scale inside the compiled step, and Adam runs
  once on them. No batch is dropped; the schedule step equals the data step.

The script prints the dropped batches of each run and saves a plot (dropped batches, and the
schedule step against the data step), the one in docs/guides/retries.md.

Run (a few seconds)::

    python examples/zero_skip.py
    python examples/zero_skip.py --steps 600 --out docs/img/zero_skip.png
"""

from __future__ import annotations

import argparse
import itertools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jdls

OUTLIER = 3.0  # 3 * 2**15 = 98304 > 65504 (float16's maximum) > 3 * 2**14


def init(key: jax.Array, widths: Sequence[int] = (16, 64, 1)) -> dict:
    """An MLP's float32 parameters, and ``probe``: a parameter that only the injected outlier
    touches (its gradient carries the overflow; the model does not use it)."""
    layers = []
    keys = jax.random.split(key, len(widths) - 1)
    for k, (m, n) in zip(keys, itertools.pairwise(widths), strict=True):
        layers.append({"w": jax.random.normal(k, (m, n)) / np.sqrt(m), "b": jnp.zeros(n)})
    return {"layers": layers, "probe": jnp.zeros(())}


def loss_fn(params: dict, x: jax.Array, y: jax.Array, outlier: jax.Array) -> jax.Array:
    """Mean squared error in float16 compute, plus ``probe * outlier``: the outlier's scaled
    gradient ``outlier * scale`` overflows float16 when it exceeds 65504."""
    h = x.astype(jnp.float16)
    for i, layer in enumerate(params["layers"]):
        h = h @ layer["w"].astype(jnp.float16) + layer["b"].astype(jnp.float16)
        if i < len(params["layers"]) - 1:
            h = jax.nn.relu(h)
    mse = jnp.mean((h.astype(jnp.float32) - y) ** 2)
    probe = (params["probe"].astype(jnp.float16) * outlier.astype(jnp.float16)).astype(jnp.float32)
    return mse + probe


def make_tx(steps: int) -> optax.GradientTransformationExtraArgs:
    schedule = optax.cosine_decay_schedule(3e-3, steps)
    scale = jdls.DynamicScale(2.0**15, growth_interval=10, max_loss_scale=2.0**16)
    return jdls.wrap(optax.adam(schedule), scale)


def train(steps: int, inject: np.ndarray, retries: int, seed: int) -> dict:
    """Train; per data step: whether the batch was applied and the schedule's step."""
    key_p, key_x, key_w = jax.random.split(jax.random.key(seed), 3)
    params = init(key_p)
    w_true = jax.random.normal(key_w, (16, 1))
    tx = make_tx(steps)
    opt_state = tx.init(params)
    # Differentiate, retry an overflow at the backed-off scale, run Adam once, apply.
    train_step = jdls.retrying(loss_fn, tx, retries=retries)

    @jax.jit
    def step(params, opt_state, key, inject):
        x = jax.random.normal(key, (128, 16))
        y = jnp.tanh(x @ w_true)
        # The injected outlier: its scaled gradient 3 * scale overflows at 2**15, not at 2**14.
        outlier = jnp.where(inject, OUTLIER, 0.0)
        params, opt_state, loss = train_step(params, opt_state, x, y, outlier)
        stats = jdls.stats(opt_state)
        count = opt_state.inner_state[0].count  # Adam's step count: the schedule's step
        return params, opt_state, (loss, stats.finite, count)

    keys = jax.random.split(key_x, steps)
    applied, counts, losses = [], [], []
    for i in range(steps):
        params, opt_state, (loss, finite, count) = step(params, opt_state, keys[i], inject[i])
        applied.append(bool(finite))
        counts.append(int(count))
        losses.append(float(loss))
    stats = jdls.stats(opt_state)
    return {
        "applied": np.array(applied),
        "schedule_step": np.array(counts),
        "loss": np.array(losses),
        "dropped": int(stats.skipped_steps),
        "retried_steps": int(stats.retried_steps),
        "loss_scale": float(jdls.get_scale(opt_state).loss_scale),
    }


def plot(results: dict, inject: np.ndarray, path: str) -> None:
    """Dropped batches over the data steps, and the schedule step against the data step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = np.arange(1, len(inject) + 1)
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.8))
    styles = {
        "skip": ("tab:red", "skip only (retries=0)"),
        "retry": ("tab:blue", "jdls.retrying(retries=2)"),
    }
    for name, r in results.items():
        color, label = styles[name]
        left.plot(steps, np.cumsum(~r["applied"]), color=color, label=label)
        right.plot(steps, r["schedule_step"], color=color, label=label)
    for s in np.flatnonzero(inject) + 1:
        left.axvline(s, color="0.85", lw=0.6, zorder=0)
    left.set(xlabel="data step", ylabel="dropped batches", title="Dropped batches")
    right.plot(steps, steps, "k:", lw=1, label="schedule = data")
    right.set(xlabel="data step", ylabel="optimizer (schedule) step", title="Schedule vs data")
    left.legend(loc="upper left")
    right.legend(loc="upper left")
    fig.suptitle(
        f"float16: {int(inject.sum())} injected outliers (grey lines), "
        "overflowing at loss scales 2**15 and 2**16, not at 2**14"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> dict:
    """Train both ways; returns each run's results (``dropped``, ``schedule_step``, ...)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=400, help="data steps")
    parser.add_argument(
        "--inject-rate", type=float, default=0.1, help="fraction of steps with an outlier"
    )
    parser.add_argument("--seed", type=int, default=0, help="random seed")
    parser.add_argument("--out", default="zero_skip.png", help="where to save the plot")
    parser.add_argument("--no-plot", action="store_true", help="do not save the plot")
    parser.add_argument("--quiet", action="store_true", help="print only the summary")
    args = parser.parse_args(argv)

    inject = np.random.default_rng(args.seed).random(args.steps) < args.inject_rate
    results = {
        name: train(args.steps, inject, retries, args.seed)
        for name, retries in (("skip", 0), ("retry", 2))
    }
    for name, r in results.items():
        print(
            f"{name:5s}: dropped batches {r['dropped']:3d}, retried steps {r['retried_steps']:3d}, "
            f"schedule step {r['schedule_step'][-1]} of {args.steps} data steps, "
            f"final loss {r['loss'][-1]:.4f}, loss scale {r['loss_scale']:g}"
        )
    if not args.quiet:
        print(f"injected outliers: {int(inject.sum())} (overflowing at scales >= 2**15)")
    if not args.no_plot:
        plot(results, inject, args.out)
        if not args.quiet:
            print(f"saved {args.out}")
    return results


if __name__ == "__main__":
    main()
