"""A small MLP train step with fault injection, shared by the reliability tests.

Not a test module (no ``test_`` prefix): ``integration/test_soak.py``,
``integration/test_checkpoint.py``, ``integration/test_distributed.py`` and the subprocess
workers (``integration/_checkpoint_worker.py``, ``integration/_two_process_worker.py``)
import it, so the main process and a fresh process run the very same step.

One step takes a *spec*, four int32 numbers:

* ``batch``: the index of the batch (the batch is generated from it, inside the step);
* ``kind``: 0 for a clean step, else one of :data:`KINDS` (inf, -inf or NaN written into one
  element of one gradient leaf, or the loss multiplied by inf, -inf or NaN);
* ``leaf``, ``pos``: for gradient faults, which leaf and which element (modulo its size).

A clean reference run feeds the same step function the specs of the clean steps only, so
"the faulty run equals the run that never saw the faulty batches" is a comparison between two
runs of one compiled function.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jdls

IN, HIDDEN, OUT, BATCH = 8, 32, 4, 16

#: Fault kinds; the index is the ``kind`` of a spec (0 is a clean step).
KINDS = ("none", "grad+inf", "grad-inf", "grad-nan", "loss+inf", "loss-inf", "loss-nan")
_VALUES = np.array([1.0, np.inf, -np.inf, np.nan, np.inf, -np.inf, np.nan], np.float32)
N_LEAVES = 4


def init_params(seed: int = 0) -> dict[str, Any]:
    k1, k2 = jax.random.split(jax.random.PRNGKey(seed))
    return {
        "dense1": {
            "kernel": jax.random.normal(k1, (IN, HIDDEN), jnp.float32) / np.sqrt(IN),
            "bias": jnp.zeros((HIDDEN,), jnp.float32),
        },
        "dense2": {
            "kernel": jax.random.normal(k2, (HIDDEN, OUT), jnp.float32) / np.sqrt(HIDDEN),
            "bias": jnp.zeros((OUT,), jnp.float32),
        },
    }


def apply(params: Any, x: jax.Array) -> jax.Array:
    h = jax.nn.relu(x @ params["dense1"]["kernel"] + params["dense1"]["bias"])
    return h @ params["dense2"]["kernel"] + params["dense2"]["bias"]


def make_batch(index: jax.Array, batch: int = BATCH) -> tuple[jax.Array, jax.Array]:
    """Batch number ``index``: a deterministic regression problem."""
    key = jax.random.fold_in(jax.random.PRNGKey(1234), index)
    x = jax.random.normal(key, (batch, IN), jnp.float32)
    y = jnp.sin(x[:, :OUT] * 2.0) + 0.1 * x[:, OUT:]
    return x, y


def loss_fn(params: Any, x: jax.Array, y: jax.Array) -> jax.Array:
    return jnp.mean((apply(params, x) - y) ** 2)


def inject(grads: Any, kind: jax.Array, leaf: jax.Array, pos: jax.Array) -> Any:
    """Write the fault value of ``kind`` into element ``pos`` of gradient leaf ``leaf``.

    On a clean step (or a loss fault) every element is written back as it was: bit-identical.
    """
    value = jnp.asarray(_VALUES)[kind]
    grad_fault = (kind >= 1) & (kind <= 3)
    leaves, treedef = jax.tree_util.tree_flatten(grads)
    out = []
    for i, g in enumerate(leaves):
        flat = g.reshape(-1)
        j = pos % flat.size
        hit = grad_fault & (leaf == i)
        flat = flat.at[j].set(jnp.where(hit, value.astype(g.dtype), flat[j]))
        out.append(flat.reshape(g.shape))
    return jax.tree_util.tree_unflatten(treedef, out)


def loss_multiplier(kind: jax.Array) -> jax.Array:
    """1.0 on a clean step, inf, -inf or NaN on a loss fault."""
    value = jnp.asarray(_VALUES)[kind]
    return jnp.where(kind >= 4, value, jnp.float32(1.0))


def train_step(
    tx: optax.GradientTransformation, params: Any, opt_state: Any, spec: jax.Array
) -> tuple[Any, Any, Any]:
    """One step: scale the loss, differentiate, unscale, inject, update (jdls.wrap skips)."""
    batch, kind, leaf, pos = spec[0], spec[1], spec[2], spec[3]
    x, y = make_batch(batch)
    scale = jdls.get_scale(opt_state)
    mult = loss_multiplier(kind)
    loss, grads = scale.value_and_grad(lambda p: loss_fn(p, x, y) * mult)(params)
    grads = inject(grads, kind, leaf, pos)
    updates, new_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), new_state, loss


def make_specs(
    n_steps: int, seed: int, *, fault_rate: float = 0.15, batch_offset: int = 0
) -> np.ndarray:
    """``n_steps`` specs in segments: calm runs, sparse and dense faults, bursts of faults.

    Calm runs let the scale grow to its maximum, bursts drive it to its minimum.
    """
    rng = np.random.default_rng(seed)
    kinds = np.zeros(n_steps, np.int32)
    t = 0
    while t < n_steps:
        segment = rng.choice(["calm", "sparse", "dense", "burst"], p=[0.3, 0.4, 0.2, 0.1])
        length = int(rng.integers(5, 40) if segment == "burst" else rng.integers(50, 400))
        rate = {"calm": 0.0, "sparse": fault_rate / 3, "dense": 0.5, "burst": 1.0}[segment]
        n = min(length, n_steps - t)
        faulty = rng.random(n) < rate
        kinds[t : t + n] = np.where(faulty, rng.integers(1, len(KINDS), n), 0)
        t += n
    specs = np.zeros((n_steps, 4), np.int32)
    specs[:, 0] = batch_offset + np.arange(n_steps)
    specs[:, 1] = kinds
    specs[:, 2] = rng.integers(0, N_LEAVES, n_steps)
    specs[:, 3] = rng.integers(0, 1 << 20, n_steps)
    return specs


def clean_specs(specs: np.ndarray) -> np.ndarray:
    """The reference run's specs: the clean steps only, same batches, in the same order."""
    return specs[specs[:, 1] == 0]


def fault_counts(specs: np.ndarray) -> dict[str, int]:
    counts = np.bincount(specs[:, 1], minlength=len(KINDS))
    return {name: int(c) for name, c in zip(KINDS[1:], counts[1:], strict=True)}


def adamw_cosine(total_steps: int) -> optax.GradientTransformation:
    """The inner optimizer of the reliability tests: adamw with a warmup-cosine schedule."""
    schedule = optax.warmup_cosine_decay_schedule(
        init_value=0.0,
        peak_value=3e-3,
        warmup_steps=max(total_steps // 20, 1),
        decay_steps=max(total_steps, 2),
    )
    return optax.adamw(schedule, weight_decay=1e-4)
