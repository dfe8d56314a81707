"""Fault-injection soak: thousands of steps with inf, -inf and NaN injected, nothing corrupted.

A small MLP trains under ``lax.scan`` with ``jdls.wrap(adamw + warmup-cosine schedule)``.
On random steps (sparse, dense and in bursts) an inf, -inf or NaN is written into one element
of a random gradient leaf, or the loss is multiplied by inf, -inf or NaN. Checked:

* **every step** (running counters in the scan carry): no NaN or inf ever reaches the
  parameters or the inner optimizer state; every injected fault is detected and no clean step
  is skipped; a skipped step leaves the parameters and the inner state bit for bit as they
  were; the per-leaf flags (``track_nonfinite``) name exactly the leaf that was hit;
* **the scale and the counters**, step by step, against a plain-Python reference state
  machine fed the same finite/non-finite sequence (loss scale bit for bit, ``skipped_steps``,
  ``consecutive_skips``);
* **at the end**: parameters and inner state (Adam moments, step counts of the optimizer and
  of the schedule) are bit-identical to a reference run that simply omits the faulty steps'
  batches, and the inner step count equals the number of clean steps.

The scales stay powers of two, so scaling and unscaling are exact in float32, and the
reference run's different scale history cannot change a bit of the gradients.

CI mode runs a few thousand steps per configuration. The long soak (100k steps per
configuration) runs with ``JDLS_SOAK=1`` or ``--soak-steps N``::

    JDLS_SOAK=1 pytest tests/integration/test_soak.py -m slow -s
    pytest tests/integration/test_soak.py --soak-steps 200000 -s
"""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Callable
from typing import Any

import _mlp
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import reference_rules as ref
from _helpers import host_bytes, same_bits

import jdls

CI_STEPS = 3000
LONG_STEPS = 100_000
F32 = np.float32


# --------------------------------------------------------------------------------------------
# Reference state machines (plain Python) for the scales soaked here.
# --------------------------------------------------------------------------------------------


class JdlsDefault:
    """``jdls.DynamicScale(...)``: halve on overflow (not below min), double after
    ``growth_interval`` finite steps in a row (not above max)."""

    def __init__(self, loss_scale, growth_interval, min_loss_scale=1.0, max_loss_scale=2.0**24):
        self.scale = F32(loss_scale)
        self.counter = 0
        self.growth_interval = growth_interval
        self.min, self.max = F32(min_loss_scale), F32(max_loss_scale)

    def step(self, finite):
        if finite:
            self.counter += 1
            if self.counter == self.growth_interval:
                self.scale = min(self.scale * F32(2.0), self.max)
                self.counter = 0
        else:
            self.scale = max(self.scale * F32(0.5), self.min)
            self.counter = 0
        return self.scale


class SkipCounter:
    """What ``jdls.stats`` must report: skipped steps in total and in a row."""

    def __init__(self):
        self.skipped = 0
        self.consecutive = 0

    def step(self, finite):
        if finite:
            self.consecutive = 0
        else:
            self.skipped += 1
            self.consecutive += 1
        return self.skipped, self.consecutive


# --------------------------------------------------------------------------------------------
# Configurations: (make the wrapped optimizer from the inner one, make reference).
# --------------------------------------------------------------------------------------------


@functools.cache
def _configs() -> dict[
    str, tuple[Callable[[optax.GradientTransformation], Any], Callable[[], Any]]
]:
    return {
        # The default rule (bounds [1, 2**24]) with a short growth interval, skipped with
        # lax.cond.
        "default-cond": (
            lambda inner: jdls.wrap(
                inner,
                jdls.DynamicScale(growth_interval=10),
                skip_with="cond",
                track_nonfinite=True,
            ),
            lambda: JdlsDefault(2.0**15, 10),
        ),
        # Cerebras: overflow tolerance, clamps [2**-14, 2**15] every step, and its
        # max_gradient_norm (global-norm clipping fused into the wrap); skipped with select.
        "cerebras-select-clip": (
            lambda inner: jdls.presets.cerebras_wrap(
                inner,
                steps_per_increase=30,
                max_gradient_norm=1.0,
                skip_with="select",
                track_nonfinite=True,
            ),
            lambda: ref.Cerebras(steps_per_increase=30),
        ),
    }


CONFIGS = ["default-cond", "cerebras-select-clip"]


def make_tx(name: str, total_steps: int) -> optax.GradientTransformation:
    make, _ = _configs()[name]
    return make(_mlp.adamw_cosine(total_steps))


# --------------------------------------------------------------------------------------------
# The scanned run with its per-step checks.
# --------------------------------------------------------------------------------------------

CHECKS = ("nonfinite_reached_state", "fault_missed_or_clean_skipped", "skip_not_exact", "bad_flags")


def expected_leaf_flags(kind: jax.Array, leaf: jax.Array) -> jax.Array:
    """Per-leaf non-finite flags after a fault of ``kind`` in ``leaf``."""
    leaves = jnp.arange(_mlp.N_LEAVES)
    grad_fault = (kind >= 1) & (kind <= 3)
    loss_fault = kind >= 4  # inf * g is ±inf, and inf * 0 is NaN: every leaf is hit
    return (grad_fault & (leaves == leaf)) | loss_fault


@functools.cache
def _runner(name: str, total_steps: int):
    tx = make_tx(name, total_steps)

    def body(carry, spec):
        params, state, violations = carry
        new_params, new_state, _ = _mlp.train_step(tx, params, state, spec)
        stats = jdls.stats(new_state)
        clean = spec[1] == 0
        reached = ~(jdls.all_finite(new_params) & jdls.all_finite(new_state.inner_state))
        missed = stats.finite != clean
        unchanged = same_bits(new_params, params) & same_bits(
            new_state.inner_state, state.inner_state
        )
        not_exact = ~clean & ~unchanged
        flags = jnp.stack(jax.tree_util.tree_leaves(stats.nonfinite))
        bad_flags = ~jnp.all(flags == expected_leaf_flags(spec[1], spec[2]))
        violations = violations + jnp.stack([reached, missed, not_exact, bad_flags]).astype(
            jnp.int32
        )
        out = (jdls.get_scale(new_state).loss_scale, stats.skipped_steps, stats.consecutive_skips)
        return (new_params, new_state, violations), out

    @jax.jit
    def run(params, state, specs):
        violations = jnp.zeros((len(CHECKS),), jnp.int32)
        (params, state, violations), trace = jax.lax.scan(body, (params, state, violations), specs)
        return params, state, violations, trace

    return tx, run


def soak(name: str, n_steps: int, seed: int) -> dict[str, Any]:
    """Run the faulty and the reference runs, check everything, return the figures."""
    specs = _mlp.make_specs(n_steps, seed)
    clean = _mlp.clean_specs(specs)
    tx, run = _runner(name, n_steps)
    params0 = _mlp.init_params(seed)

    start = time.perf_counter()
    params, state, violations, trace = jax.block_until_ready(run(params0, tx.init(params0), specs))
    ref_params, ref_state, ref_violations, _ = jax.block_until_ready(
        run(params0, tx.init(params0), clean)
    )
    wall = time.perf_counter() - start

    # Per-step checks, counted in the scan.
    assert dict(zip(CHECKS, np.asarray(violations).tolist(), strict=True)) == dict.fromkeys(
        CHECKS, 0
    )
    assert np.asarray(ref_violations).tolist() == [0] * len(CHECKS)

    # Scale and counters, step by step, against the references.
    finite = specs[:, 1] == 0
    scales, skipped, consecutive = (np.asarray(x) for x in trace)
    reference, counter = _configs()[name][1](), SkipCounter()
    for t, f in enumerate(finite):
        expected = F32(reference.step(bool(f)))
        assert scales[t].view(np.uint32) == expected.view(np.uint32), (t, scales[t], expected)
        assert (int(skipped[t]), int(consecutive[t])) == counter.step(bool(f)), t

    # The end: bit-identical to the run that never saw the faulty batches.
    assert host_bytes(params) == host_bytes(ref_params)
    assert host_bytes(state.inner_state) == host_bytes(ref_state.inner_state)
    counts = optax.tree_utils.tree_get_all_with_path(state.inner_state, "count")
    assert len(counts) >= 2  # adam's and the schedule's
    assert all(int(c) == len(clean) for _, c in counts), counts
    assert int(jdls.stats(state).skipped_steps) == n_steps - len(clean)

    return {
        "config": name,
        "steps": n_steps,
        "faults": _mlp.fault_counts(specs),
        "faulty_steps": n_steps - len(clean),
        "scale_min": float(scales.min()),
        "scale_max": float(scales.max()),
        "wall_s": round(wall, 2),
    }


def _report(figures: dict[str, Any], record_property: Any) -> None:
    for key, value in figures.items():
        record_property(key, value)
    print(f"\nsoak figures: {figures}")


# --------------------------------------------------------------------------------------------
# Tests.
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", CONFIGS)
@pytest.mark.full
def test_soak_ci(name, record_property):
    figures = soak(name, CI_STEPS, seed=CONFIGS.index(name))
    # The schedule of faults reaches both ends of the scale's range.
    if name == "default-cond":
        assert figures["scale_min"] == 1.0 and figures["scale_max"] == 2.0**24
    else:
        assert figures["scale_min"] == 2.0**-14 and figures["scale_max"] == 2.0**15
    assert all(n > 0 for n in figures["faults"].values())
    _report(figures, record_property)


def _long_steps(config: pytest.Config) -> int | None:
    steps = config.getoption("--soak-steps", default=None)
    if steps:
        return int(steps)
    if os.environ.get("JDLS_SOAK", "") not in ("", "0"):
        return LONG_STEPS
    return None


@pytest.mark.slow
@pytest.mark.parametrize("name", CONFIGS)
def test_soak_long(name, request, record_property):
    steps = _long_steps(request.config)
    if steps is None:
        pytest.skip("long soak: set JDLS_SOAK=1 or pass --soak-steps N")
    figures = soak(name, steps, seed=100 + CONFIGS.index(name))
    _report(figures, record_property)
