"""jdls.rules.Adaptive computes, bit for bit, what its first, plainer formulation computed.

The rule's update is written to compile small (one packed selection of the next state); the
reference below is that plainer formulation, kept verbatim as the specification: every output
(the scale's bits and the six counters) must be identical for every input, jitted and not,
batched and not, including inputs no training run makes (negative or non-finite scales,
non-finite measurements, counters at their limits).

Two kinds of input are compared less strictly, because the plainer formulation itself gives
different results for them jitted and not (XLA's treatment depends on how it fuses the
operations): float32 subnormals (the inputs have none: they are flushed to zero) and NaN
(a NaN scale must stay NaN; its sign and payload may differ)."""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from jax import lax

import jdls
from jdls.rules import Adaptive

SETTINGS = settings(
    max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True
)
_F32, _I32 = jnp.float32, jnp.int32
_EXP_MIN, _EXP_MAX = -126, 127
_NONE = -(2**30)


# The reference: the rule's update as first written (one jnp.where per output).


def _pow2(exponent):
    e = jnp.clip(exponent, _EXP_MIN, _EXP_MAX).astype(_I32)
    return lax.bitcast_convert_type(jnp.left_shift(e + 127, 23), _F32)


def _select(finite, taken, skipped):
    return jax.tree_util.tree_map(
        lambda a, b: jnp.where(finite, a, b).astype(jnp.asarray(a).dtype), taken, skipped
    )


def _exponent_bounds(r):
    lo = _EXP_MIN if r.min_loss_scale is None else math.ceil(math.log2(r.min_loss_scale))
    hi = _EXP_MAX if r.max_loss_scale is None else math.floor(math.log2(r.max_loss_scale))
    return max(lo, _EXP_MIN), min(hi, _EXP_MAX)


def _clamp(r, loss_scale):
    lo = 2.0**_EXP_MIN if r.min_loss_scale is None else r.min_loss_scale
    hi = 2.0**_EXP_MAX if r.max_loss_scale is None else r.max_loss_scale
    return jnp.clip(loss_scale, _F32(lo), _F32(hi))


def _soon(r, state):
    c, window, interval = state.counter, _I32(r.margin_window), r.margin_interval
    after_lowering = (c >= interval) & (c % interval <= window)
    return (state.overflows == 0) & (c > 0) & ((c <= window) | after_lowering)


def _overflow(r, loss_scale, state):
    bits = jnp.minimum(
        jnp.left_shift(_I32(1), jnp.minimum(state.overflows, _I32(30))),
        _I32(r.max_backoff_bits),
    )
    backed_off = _clamp(r, loss_scale * _pow2(-bits))
    soon = _soon(r, state)
    margin = jnp.where(soon, jnp.minimum(state.margin + 1, _I32(r.max_margin)), state.margin)
    learning = jnp.where(state.overflows == 0, soon.astype(_I32), state.learning)
    overflows = jnp.minimum(state.overflows, _I32(2**30)) + 1
    return backed_off, jdls.rules.AdaptiveState(
        margin, _I32(0), overflows, state.settled, _I32(0), learning
    )


def reference_adjust(r, loss_scale, state, finite):
    backed_off, on_overflow = _overflow(r, loss_scale, state)
    counted = state.counter + 1
    grow = counted >= r.growth_interval
    grown = _clamp(r, jnp.where(grow, loss_scale * _F32(2.0), loss_scale))
    on_finite = jdls.rules.AdaptiveState(
        state.margin, jnp.where(grow, _I32(0), counted), _I32(0), state.settled, _I32(0), _I32(0)
    )
    return _select(finite, (grown, on_finite), (backed_off, on_overflow))


def reference_observe(r, loss_scale, state, finite, grad_amax):
    backed_off, on_overflow = _overflow(r, loss_scale, state)
    lo, hi = _exponent_bounds(r)
    amax = jnp.abs(grad_amax).astype(_F32)
    measured = (amax > 0) & jnp.isfinite(amax)
    f, g = math.frexp(float(jdls.finfo(r.compute_dtype).max))
    a, e = jnp.frexp(jnp.where(measured, amax, 1))
    k_at_zero_margin = _I32(g) - e - (a > _F32(f)).astype(_I32)
    _, e_scale = jnp.frexp(loss_scale.astype(_F32))
    log2_scale = e_scale - 1
    last_bits = jnp.minimum(
        jnp.left_shift(_I32(1), jnp.clip(state.overflows - 1, 0, 30)),
        _I32(r.max_backoff_bits),
    )
    lowest_overflow = log2_scale + last_bits
    learn = (state.learning > 0) & (state.overflows > 0) & measured
    needed = jnp.minimum(k_at_zero_margin - lowest_overflow + 1, _I32(r.max_margin))
    margin = jnp.where(learn, jnp.maximum(state.margin, needed), state.margin)
    counted = jnp.minimum(state.counter, _I32(2**30)) + 1
    lower = counted % r.margin_interval == 0
    k = jnp.clip(k_at_zero_margin - margin, lo, hi)
    margin = jnp.where(lower, jnp.maximum(margin - 1, _I32(r.min_margin)), margin)
    log2_max, log2_sub = r.format_range()
    jump = math.floor(log2_max - log2_sub + 1) - state.margin
    never = state.settled == _NONE
    look = never & (state.looking == 0)
    back = jnp.maximum(log2_scale - jump, _I32(min(15, g - 1)))
    after_overflows = ~never & (state.overflows > 0)
    target = jnp.where(
        look,
        log2_scale + jump,
        jnp.where(
            state.looking > 0,
            back,
            jnp.where(after_overflows, state.settled - state.learning, log2_scale),
        ),
    )
    moved = look | (state.looking > 0) | after_overflows
    held = jnp.where(moved, _pow2(jnp.clip(target, lo, hi)), loss_scale)
    grow = ~moved & (counted % r.growth_interval == 0)
    held = jnp.where(grow, held * _F32(2.0), held)
    predicted = jnp.where(measured, _pow2(k), held)
    settled = jnp.where(
        measured, k, jnp.where(state.looking > 0, jnp.clip(back, lo, hi), state.settled)
    )
    predicted = _clamp(r, jnp.where(jnp.isfinite(amax), predicted, _pow2(_I32(lo))))
    on_finite = jdls.rules.AdaptiveState(
        margin, counted, _I32(0), settled, (look & ~measured).astype(_I32), _I32(0)
    )
    return _select(finite, (predicted, on_finite), (backed_off, on_overflow))


# Inputs: random rules, and random states and measurements mixed with the values where the
# rule's branches turn (interval multiples, the window, saturation, the unsettled marker).


@st.composite
def rules(draw: Any) -> Adaptive:
    min_margin = draw(st.integers(0, 6))
    max_margin = draw(st.integers(min_margin, 30))
    lo = draw(st.sampled_from([None, 2.0**-20, 1.0, 3.0]))
    hi = draw(st.sampled_from([None, 2.0**24, 100.0, 2.0**100]))
    return Adaptive(
        compute_dtype=draw(st.sampled_from(["float16", "bfloat16", "float8_e4m3fn", "float32"])),
        margin=draw(st.integers(min_margin, max_margin)),
        min_margin=min_margin,
        max_margin=max_margin,
        margin_interval=draw(st.sampled_from([1, 2, 3, 7, 2000])),
        growth_interval=draw(st.sampled_from([1, 2, 5, 2000])),
        margin_window=draw(st.sampled_from([1, 4, 16, 5000])),
        max_backoff_bits=draw(st.sampled_from([1, 3, 8, 40])),
        min_loss_scale=lo,
        max_loss_scale=hi,
    )


def _mix(rng: np.random.Generator, n: int, special: list[int], low: int, high: int) -> np.ndarray:
    out = rng.integers(low, high, n, dtype=np.int64)
    pick = rng.random(n) < 0.5
    out[pick] = rng.choice(np.array(special, np.int64), int(pick.sum()))
    return out.astype(np.int32)


def inputs(rule: Adaptive, n: int, seed: int) -> tuple[Any, ...]:
    rng = np.random.default_rng(seed)
    big, i32max = 2**30, 2**31 - 1
    ivals = [rule.margin_interval * m + d for m in (0, 1, 2, 3) for d in (-1, 0, 1)]
    windows = [rule.margin_window + d for d in (-1, 0, 1)]
    counter = _mix(rng, n, [0, 1, 2, big - 1, big, big + 1, i32max, *ivals, *windows], 0, 2**31)
    overflows = _mix(rng, n, [0, 1, 2, 3, 4, 5, 29, 30, 31, 32, big, i32max], 0, 2**31)
    margin = _mix(rng, n, [rule.min_margin, rule.max_margin, 0, -1, 40], -50, 60)
    settled = _mix(rng, n, [_NONE, -126, 127, 0, 15, -(2**31), i32max], -200, 200)
    looking = _mix(rng, n, [0, 1], -3, 4)
    learning = _mix(rng, n, [0, 1], -3, 4)
    state = jdls.rules.AdaptiveState(
        *(jnp.asarray(x) for x in (margin, counter, overflows, settled, looking, learning))
    )
    special = np.array(
        [0.0, -0.0, np.inf, -np.inf, np.nan, 1.0, 2.0**-126, 2.0**-149, 2.0**127, 65504.0, 2.0**15],
        np.float32,
    )

    def floats() -> np.ndarray:
        bits = rng.integers(0, 2**32, n, dtype=np.uint64).astype(np.uint32).view(np.float32)
        pow2 = np.ldexp(np.float32(1), rng.integers(-140, 128, n)).astype(np.float32)
        out = np.where(rng.random(n) < 0.5, bits, pow2)
        pick = rng.random(n) < 0.3
        out[pick] = rng.choice(special, int(pick.sum()))
        out = out.astype(np.float32)
        return np.where(np.abs(out) < np.finfo(np.float32).tiny, np.float32(0), out)

    finite = jnp.asarray(rng.random(n) < 0.5)
    return jnp.asarray(floats()), state, finite, jnp.asarray(floats())


def assert_same(got: Any, want: Any) -> None:
    assert jax.tree_util.tree_structure(got) == jax.tree_util.tree_structure(want)
    for g, w in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want), strict=True):
        assert g.dtype == w.dtype and g.shape == w.shape
    for g, w in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want), strict=True):
        g, w = np.asarray(g), np.asarray(w)
        if g.dtype == np.float32:
            np.testing.assert_array_equal(np.isnan(g), np.isnan(w))
            g, w = (
                np.where(np.isnan(g), 0, g).view(np.int32),
                np.where(np.isnan(w), 0, w).view(np.int32),
            )
        np.testing.assert_array_equal(g, w)


@pytest.mark.full  # about 9 s; the quick run keeps the one-by-one comparison below
@SETTINGS
@given(rules(), st.integers(0, 2**16))
def test_observe_and_adjust_bit_identical_batched(rule: Adaptive, seed: int) -> None:
    scale, state, finite, amax = inputs(rule, 256, seed)
    new_observe = jax.jit(jax.vmap(rule.observe))
    old_observe = jax.jit(jax.vmap(lambda *a: reference_observe(rule, *a)))
    assert_same(new_observe(scale, state, finite, amax), old_observe(scale, state, finite, amax))
    new_adjust = jax.jit(jax.vmap(rule.adjust))
    old_adjust = jax.jit(jax.vmap(lambda *a: reference_adjust(rule, *a)))
    assert_same(new_adjust(scale, state, finite), old_adjust(scale, state, finite))


@pytest.mark.parametrize("jit", [True, False], ids=["jit", "eager"])
@pytest.mark.parametrize("rule", [Adaptive(), Adaptive("bfloat16", margin_interval=3, margin_window=2, growth_interval=2, max_backoff_bits=3, min_loss_scale=1.0, max_loss_scale=2.0**24)])  # fmt: skip
def test_observe_and_adjust_bit_identical_one_by_one(rule: Adaptive, jit: bool) -> None:
    scale, state, finite, amax = inputs(rule, 12, seed=7)
    wrap = jax.jit if jit else (lambda f: f)
    observe, adjust = wrap(rule.observe), wrap(rule.adjust)
    old_observe = wrap(lambda *a: reference_observe(rule, *a))
    old_adjust = wrap(lambda *a: reference_adjust(rule, *a))
    for i in range(12):
        s, st_, f, a = jax.tree_util.tree_map(lambda x, i=i: x[i], (scale, state, finite, amax))
        assert_same(observe(s, st_, f, a), old_observe(s, st_, f, a))
        assert_same(adjust(s, st_, f), old_adjust(s, st_, f))
        # Python scalars as a hand-made call gives them.
        assert_same(observe(s, st_, bool(f), a), old_observe(s, st_, bool(f), a))
