"""Float16 training with and without dynamic loss scaling, on the scikit-learn digits.

A Flax linen MLP (64-256-256-10) learns to classify the 8x8 digits of scikit-learn (1,797
images, shipped with the package: nothing is downloaded). The parameters are float32 master
weights; every step casts them and the inputs to the compute format, so the forward *and the
backward* pass run in that format: in JAX the cotangent of a float16 operation is float16, so
the gradients of the activations and the weights are float16 values too. The logits are cast
back to float32 for the loss. The same run is trained three ways, from the same initial
parameters and the same batches:

* ``float32``: compute in float32, no loss scaling;
* ``float16``: compute in float16, no loss scaling;
* ``float16+jdls``: compute in float16 with ``jdls.wrap`` and a dynamic loss scale.

Why float16 alone fails here. The loss is ``loss_weight * mean cross-entropy`` with
``loss_weight = 5e-6``: the small factor that real losses carry (an auxiliary loss with a
small coefficient, a per-token loss summed and divided by a large fixed normaliser). The
cotangent of each logit is ``loss_weight * (softmax - one_hot) / batch_size``, at most
``5e-6 / 256 = 1.95e-8`` in magnitude with a batch of 256. Casting it to float16 rounds it to
0: float16's smallest subnormal number is ``2**-24 = 6.0e-8``, and anything below half of it,
``2**-25 = 3.0e-8``, rounds to zero. Every gradient computed from those cotangents, the whole
backward pass, is then exactly zero, and the float16 model never leaves its initialisation.
(With a batch of 256, any loss weight below ``256 * 2**-25 = 7.6e-6`` does this; larger
weights, such as ``1e-5``, lose only part of the gradient: see docs/convergence.md.)

Why float32 is unaffected. Adam divides the gradient by the square root of its running second
moment, so multiplying the loss by a constant does not change its updates, as long as the
gradients stay well above Adam's ``eps = 1e-8``, as they do here: the weight gradients are
sums over the batch, much larger than the cotangents of single logits. The float32 run reaches
the same accuracy with ``--loss-weight 1``.

What jdls does. ``scale.value_and_grad`` multiplies the loss by the loss scale before the
backward pass and divides the float16 gradients by it afterwards (in float32), so the
cotangents live ``loss_scale`` times higher, inside float16's range. The scale starts at
``2**15`` and doubles after every 50 finite steps with no upper bound (as PyTorch's
``GradScaler``); once a gradient overflows float16 (inf), ``jdls.wrap`` skips that step
exactly (parameters and Adam state unchanged) and halves the scale. The scale climbs to the
level this loss needs and oscillates just under the overflow threshold: here the first
overflow comes at ``2**42`` and the run ends at ``2**40``; times the loss weight (``5e-6``,
about ``2**-17.6``) that is ``2**22.4``, the usual range of loss scales.

The script prints a table (test accuracy, the fraction of gradient elements that are exactly
zero, averaged over the applied steps, skipped steps and the final loss scale) and saves a
plot of the training loss, the loss scale, the skipped steps and the zero-gradient fraction. Even in
float32 some gradients are exactly zero: the weights from pixels that are blank in every image
of the batch, and the weights to and from ReLU units inactive on the whole batch.

Other formats can be added with ``--formats``: ``bfloat16`` and ``cbfloat16`` (the Cerebras
format, emulated through ``jdls.get_policy``), each with or without ``+jdls``.

Run (about 30 seconds on 2 CPU cores)::

    python examples/demo.py
    python examples/demo.py --steps 500 --out /tmp/demo.png
    python examples/demo.py --formats float32,float16,float16+jdls,bfloat16,cbfloat16+jdls
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import time
from collections.abc import Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax.training import train_state
from tqdm import tqdm

import jdls

DEFAULT_FORMATS = "float32,float16,float16+jdls"
KNOWN_DTYPES = ("float32", "float16", "bfloat16", "cbfloat16")


class MLP(nn.Module):
    """A two-hidden-layer MLP whose activations are cast to the policy's compute format.

    For native formats (float16, bfloat16) the casts after the layers are no-ops: the layers
    already compute in that dtype. For emulated formats (cbfloat16) they round the values and,
    in the backward pass, their cotangents to the format's grid.
    """

    policy: jdls.Policy
    hidden: int = 256

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        cast = self.policy.cast_to_compute
        x = cast(x)
        x = cast(nn.relu(cast(nn.Dense(self.hidden)(x))))
        x = cast(nn.relu(cast(nn.Dense(self.hidden)(x))))
        return self.policy.cast_to_output(cast(nn.Dense(10)(x)))


@dataclasses.dataclass
class Result:
    """What one training run measured."""

    name: str
    accuracy: float  # on the test set, in [0, 1]
    zero_fraction: float  # fraction of gradient elements exactly 0, mean over applied steps
    skipped: int  # steps skipped because a gradient was not finite
    loss_scale: float  # final loss scale
    seconds: float
    loss: np.ndarray  # per step: the unweighted training cross-entropy
    scale: np.ndarray  # per step: the loss scale used for that step
    skipped_so_far: np.ndarray  # per step: skipped steps up to and including that step
    zeros: np.ndarray  # per step: fraction of gradient elements exactly 0 (nan if skipped)


def load_data(seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The digits, scaled to [0, 1], split 70/30 into train and test (stratified)."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32)
    y = digits.target.astype(np.int32)
    x_train, x_test, y_train, y_test = train_test_split(
        x, y, test_size=0.3, random_state=seed, stratify=y
    )
    return x_train, y_train, x_test, y_test


def parse_format(spec: str) -> tuple[str, bool]:
    """``"float16+jdls"`` -> ``("float16", True)``."""
    dtype, _, suffix = spec.strip().partition("+")
    if dtype not in KNOWN_DTYPES or suffix not in ("", "jdls"):
        raise argparse.ArgumentTypeError(
            f"unknown format {spec!r}: use one of {', '.join(KNOWN_DTYPES)}, "
            "optionally followed by +jdls (e.g. float16+jdls)"
        )
    return dtype, suffix == "jdls"


def batch_indices(n: int, batch_size: int, steps: int, seed: int) -> np.ndarray:
    """Indices of ``steps`` batches: shuffled epochs, the incomplete last batch dropped."""
    rng = np.random.default_rng(seed)
    per_epoch = n // batch_size
    epochs = math.ceil(steps / per_epoch)
    order = [rng.permutation(n)[: per_epoch * batch_size] for _ in range(epochs)]
    return np.concatenate(order).reshape(-1, batch_size)[:steps].astype(np.int32)


def train(
    spec: str,
    args: argparse.Namespace,
    data: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray],
    batches: np.ndarray,
) -> Result:
    """Train one model in the format ``spec`` and measure it."""
    dtype, scaled = parse_format(spec)
    policy = jdls.get_policy(f"params=float32,compute={dtype},output=float32")
    model = MLP(policy)
    x_train, y_train, x_test, y_test = (jnp.asarray(a) for a in data)
    params = model.init(jax.random.key(args.seed), x_train[:1])["params"]  # float32

    if scaled:
        scale: jdls.LossScale = jdls.DynamicScale(
            loss_scale=2.0**15, growth_interval=args.growth_interval, max_loss_scale=None
        )
    else:
        scale = jdls.NoOpScale()
    schedule = optax.cosine_decay_schedule(args.learning_rate, args.steps)
    state = train_state.TrainState.create(
        apply_fn=model.apply, params=params, tx=jdls.wrap(optax.adam(schedule), scale)
    )
    loss_weight = args.loss_weight

    def loss_fn(params: Any, x: jax.Array, y: jax.Array) -> tuple[jax.Array, jax.Array]:
        compute_params = policy.cast_to_compute(params)  # float32 master -> compute format
        logits = state.apply_fn({"params": compute_params}, x)  # float32 (output format)
        cross_entropy = optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
        return loss_weight * cross_entropy, cross_entropy

    @jax.jit
    def train_step(state: train_state.TrainState, idx: jax.Array) -> tuple[Any, dict]:
        scale = jdls.get_scale(state.opt_state)
        (_, cross_entropy), grads = scale.value_and_grad(loss_fn, has_aux=True)(
            state.params, x_train[idx], y_train[idx]
        )
        leaves = jax.tree.leaves(grads)
        zeros = sum(jnp.sum(g == 0) for g in leaves) / sum(g.size for g in leaves)
        state = state.apply_gradients(grads=grads)  # skipped if not finite; adjusts the scale
        stats = jdls.stats(state.opt_state)
        metrics = {
            "loss": cross_entropy,
            "scale": scale.loss_scale,
            "skipped": stats.skipped_steps,
            "zeros": zeros,
            "finite": stats.finite,
        }
        return state, metrics

    @jax.jit
    def accuracy(params: Any) -> jax.Array:
        logits = model.apply({"params": policy.cast_to_compute(params)}, x_test)
        return jnp.mean(jnp.argmax(logits, axis=-1) == y_test)

    start = time.perf_counter()
    history = []
    with tqdm(batches, desc=f"{spec:>15}", unit="step", leave=True, disable=args.quiet) as bar:
        for step, idx in enumerate(bar):
            state, metrics = train_step(state, idx)
            history.append(metrics)
            if step % 100 == 0 or step == len(batches) - 1:
                bar.set_postfix(
                    loss=f"{float(metrics['loss']):.3f}", scale=f"{float(metrics['scale']):.3g}"
                )
    history = jax.device_get(history)
    final = jdls.stats(state.opt_state)
    final_scale = jdls.get_scale(state.opt_state)
    acc = float(accuracy(state.params))
    seconds = time.perf_counter() - start
    column = {key: np.array([h[key] for h in history]) for key in history[0]}
    zeros = np.where(column["finite"], column["zeros"], np.nan)  # skipped steps: not counted
    return Result(
        name=spec,
        accuracy=acc,
        zero_fraction=float(np.nanmean(zeros)) if column["finite"].any() else float("nan"),
        skipped=int(final.skipped_steps),
        loss_scale=float(final_scale.loss_scale),
        seconds=seconds,
        loss=column["loss"],
        scale=column["scale"],
        skipped_so_far=column["skipped"],
        zeros=zeros,
    )


def format_scale(value: float) -> str:
    """``34359738368.0`` -> ``"2^35"``; other values in short scientific notation."""
    if value > 0 and math.log2(value).is_integer():
        return f"2^{int(math.log2(value))}"
    return f"{value:.3g}"


def table(results: Sequence[Result]) -> str:
    """The comparison table, as text."""
    header = f"{'format':<16}{'accuracy':>10}{'zero grads':>12}{'skipped':>9}{'loss scale':>12}"
    lines = [header, "-" * len(header)]
    for r in results:
        lines.append(
            f"{r.name:<16}{100 * r.accuracy:>9.2f}%{100 * r.zero_fraction:>11.1f}%"
            f"{r.skipped:>9d}{format_scale(r.loss_scale):>12}"
        )
    return "\n".join(lines)


def plot(results: Sequence[Result], path: str, title: str) -> None:
    """Save loss, loss scale, skipped steps and zero-gradient fraction over training."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(11, 7), sharex=True)
    panels = [
        (axes[0, 0], "loss", "training cross-entropy (running mean of 20 steps)", "log"),
        (axes[0, 1], "scale", "loss scale", "log2"),
        (axes[1, 0], "skipped_so_far", "skipped steps (cumulative)", "linear"),
        (axes[1, 1], "zeros", "fraction of gradient elements = 0", "linear"),
    ]
    styles = ["-", "-", "--", ":", "-."]
    for ax, field, label, yscale in panels:
        for i, r in enumerate(results):
            values = getattr(r, field)
            if field == "loss":  # a running mean makes the curves readable
                values = np.convolve(values, np.ones(20) / 20, mode="valid")
            style = styles[i % len(styles)]
            ax.plot(np.arange(len(values)), values, style, label=r.name, linewidth=1.4)
        if yscale == "log2":
            ax.set_yscale("log", base=2)
        else:
            ax.set_yscale(yscale)
        ax.set_title(label)
        ax.grid(True, alpha=0.3)
    axes[1, 0].set_xlabel("step")
    axes[1, 1].set_xlabel("step")
    axes[0, 0].legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Train a Flax MLP on the digits in float32, float16 and float16 + jdls, "
        "print a comparison table and save a plot.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--steps", type=int, default=2000, help="training steps per format")
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--learning-rate", type=float, default=1e-3, help="Adam, cosine decay")
    parser.add_argument(
        "--loss-weight",
        type=float,
        default=5e-6,
        help="factor on the cross-entropy; small values underflow in float16",
    )
    parser.add_argument(
        "--growth-interval", type=int, default=50, help="finite steps before the scale doubles"
    )
    parser.add_argument(
        "--formats",
        default=DEFAULT_FORMATS,
        help=f"comma-separated formats among {', '.join(KNOWN_DTYPES)}, each optionally +jdls",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="demo.png", help="where to save the plot")
    parser.add_argument("--no-plot", action="store_true", help="do not save the plot")
    parser.add_argument("--quiet", action="store_true", help="no progress bars")
    args = parser.parse_args(argv)
    args.format_list = [s.strip() for s in args.formats.split(",") if s.strip()]
    for spec in args.format_list:
        try:
            parse_format(spec)
        except argparse.ArgumentTypeError as error:
            parser.error(str(error))
    if args.steps < 1:
        parser.error(f"--steps must be >= 1, got {args.steps}")
    return args


def main(argv: Sequence[str] | None = None) -> dict[str, Result]:
    """Run the demo; returns the results by format name."""
    args = parse_args(argv)
    start = time.perf_counter()
    data = load_data(args.seed)
    if args.batch_size > len(data[0]):
        raise SystemExit(f"--batch-size must be <= {len(data[0])}, got {args.batch_size}")
    batches = batch_indices(len(data[0]), args.batch_size, args.steps, args.seed)
    results = [train(spec, args, data, batches) for spec in args.format_list]
    print()
    print(
        f"digits MLP, {args.steps} steps of batch {args.batch_size}, "
        f"loss weight {args.loss_weight:g}, Adam lr {args.learning_rate:g}"
    )
    print(table(results))
    if not args.no_plot:
        title = (
            f"Flax MLP on digits: loss weight {args.loss_weight:g}, batch {args.batch_size}, "
            f"{args.steps} steps"
        )
        plot(results, args.out, title)
        print(f"plot saved to {args.out}")
    print(f"total time {time.perf_counter() - start:.1f} s")
    return {r.name: r for r in results}


if __name__ == "__main__":
    main()
