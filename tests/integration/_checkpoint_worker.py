"""Restore a checkpointed Flax ``TrainState`` in a fresh process and continue training.

Used by ``tests/integration/test_checkpoint.py`` (not collected by pytest: no ``test_`` prefix). The test
imports this module for the pieces both processes share (the scales, the state, the scanned
train step) and runs it as a script::

    python tests/integration/_checkpoint_worker.py cases.json

``cases.json`` holds a list of cases, each ``{"format": "orbax" | "flax", "path": ...,
"scale": <name in WRAPS>, "n_steps": N, "seed": S, "start": K, "out": <.npz path>}``. For each
case the worker builds the template state from scratch (as a new training script would),
restores the checkpoint into it, checks that the scale kept its rule, continues from step K to
step N on the same fault schedule, and writes the leaves of the restored and of the final state
to ``out``.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent  # tests/integration
sys.path[:0] = [str(HERE), str(HERE.parent), str(HERE.parent.parent)]  # + tests/, the repo
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import _mlp  # noqa: E402
import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax.training import train_state  # noqa: E402

import jdls  # noqa: E402

#: The optimizers checkpointed, each ``jdls.wrap`` of the inner optimizer with a scale that
#: exercises different counters.
WRAPS: dict[str, Callable[[optax.GradientTransformation], optax.GradientTransformation]] = {
    # hysteresis, counter_after_growth=1, min_scale_overflows
    "deepspeed": lambda inner: jdls.wrap(
        inner, jdls.presets.deepspeed(init_scale=2.0**16, scale_window=8, min_scale=4.0)
    ),
    # overflows since the last change, clamps, finiteness from the float32 norm
    "cerebras": lambda inner: jdls.presets.cerebras_wrap(
        inner, steps_per_increase=10, overflow_tolerance=0.25
    ),
    # the default rule
    "default": lambda inner: jdls.wrap(inner, jdls.DynamicScale(growth_interval=10)),
}


def make_state(scale_name: str, n_steps: int, seed: int) -> train_state.TrainState:
    tx = WRAPS[scale_name](_mlp.adamw_cosine(n_steps))
    return train_state.TrainState.create(apply_fn=_mlp.apply, params=_mlp.init_params(seed), tx=tx)


def _step(state: train_state.TrainState, spec: jax.Array) -> tuple[Any, None]:
    batch, kind, leaf, pos = spec[0], spec[1], spec[2], spec[3]
    x, y = _mlp.make_batch(batch)
    scale = jdls.get_scale(state)
    mult = _mlp.loss_multiplier(kind)
    _, grads = scale.value_and_grad(lambda p: _mlp.loss_fn(p, x, y) * mult)(state.params)
    grads = _mlp.inject(grads, kind, leaf, pos)
    return state.apply_gradients(grads=grads), None


@jax.jit
def _run(state: train_state.TrainState, specs: jax.Array, start: jax.Array, stop: jax.Array) -> Any:
    return jax.lax.fori_loop(start, stop, lambda i, s: _step(s, specs[i])[0], state)


def run(
    state: train_state.TrainState, specs: np.ndarray, start: int, stop: int
) -> train_state.TrainState:
    """Train on the steps ``start..stop-1`` of ``specs`` (one row per step).

    One compiled loop (the bounds are traced) serves every segment of the run, in this process
    and in the fresh one.
    """
    return _run(state, specs, np.int32(start), np.int32(stop))


def specs_for(n_steps: int, seed: int) -> np.ndarray:
    return _mlp.make_specs(n_steps, seed, fault_rate=0.4)


def leaves_npz(tree: Any) -> dict[str, np.ndarray]:
    return {f"leaf{i}": np.asarray(x) for i, x in enumerate(jax.tree.leaves(tree))}


def restore(case: dict[str, Any], template: train_state.TrainState) -> train_state.TrainState:
    if case["format"] == "orbax":
        import orbax.checkpoint as ocp

        # eval_shape gives the dtypes a jitted step produces (TrainState.step is int32 there).
        abstract = jax.eval_shape(lambda: template)
        with ocp.StandardCheckpointer() as checkpointer:
            return checkpointer.restore(case["path"], abstract)
    if case["format"] == "flax":
        from flax import serialization

        return serialization.from_bytes(template, Path(case["path"]).read_bytes())
    raise ValueError(f"unknown format {case['format']!r}")


def main(cases_file: str) -> None:
    cases = json.loads(Path(cases_file).read_text())
    for case in cases:
        template = make_state(case["scale"], case["n_steps"], case["seed"])
        restored = restore(case, template)
        scale = jdls.get_scale(restored)
        if not isinstance(scale, jdls.DynamicScale):
            raise SystemExit(f"{case}: restored a {type(scale).__name__}, not a DynamicScale")
        if scale.rule != jdls.get_scale(template).rule:
            raise SystemExit(f"{case}: the restored scale lost its rule: {scale.rule}")
        specs = specs_for(case["n_steps"], case["seed"])
        final = run(restored, specs, case["start"], case["n_steps"])
        np.savez(
            case["out"],
            rule=repr(scale.rule),
            **{f"restored_{k}": v for k, v in leaves_npz(restored).items()},
            **{f"final_{k}": v for k, v in leaves_npz(final).items()},
        )
        print(f"{case['format']}/{case['scale']}: restored at step {case['start']}, continued")


if __name__ == "__main__":
    main(sys.argv[1])
