"""jdls.clip and the fused clipping of jdls.wrap: optax's results on finite gradients, safe
on non-finite ones and on finite gradients whose norm overflows float32."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _helpers import INF, NAN, assert_bitwise_equal, maybe_jit, with_and_without_jit

import jdls


def assert_close(a, b):
    """Equal up to rounding: the same arithmetic compiled in a different context.

    XLA rewrites ``g / n`` into ``g * (1 / n)`` and folds scalar factors (the clipping factor,
    adam's ``1 - b1``) differently depending on what it fuses, so the clipped gradients may
    differ in the last bit and adam carries that on. Tolerance: 1e-6 relative, plus 1e-6 of
    the largest magnitude for elements where adam's moments nearly cancel.
    """
    assert jax.tree_util.tree_structure(a) == jax.tree_util.tree_structure(b)
    for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b), strict=True):
        x, y = np.asarray(x), np.asarray(y)
        assert x.dtype == y.dtype and x.shape == y.shape
        if np.issubdtype(x.dtype, np.floating):
            atol = 1e-6 * float(np.max(np.abs(y), initial=0.0))
            np.testing.assert_allclose(x, y, rtol=1e-6, atol=atol)
        else:
            np.testing.assert_array_equal(x, y)


def grads_of(seed, scale=1.0):
    rng = np.random.default_rng(seed)
    return {
        "a": jnp.asarray(scale * rng.standard_normal((3, 4)).astype(np.float32)),
        "b": [jnp.asarray(scale * rng.standard_normal(5).astype(np.float32))],
        "c": jnp.asarray(np.float32(scale * rng.standard_normal())),
    }


@with_and_without_jit
@pytest.mark.parametrize("max_norm", [0.1, 3.0, 100.0])
@pytest.mark.full(keep=1)
def test_equals_optax_on_finite_gradients(max_norm, jit):
    # Norms of these gradients are about 4.5: some limits clip, some do not.
    for seed in range(2):
        grads = grads_of(seed)
        ours, _ = maybe_jit(jdls.clip(max_norm).update, jit)(grads, optax.EmptyState())
        theirs, _ = maybe_jit(optax.clip_by_global_norm(max_norm).update, jit)(
            grads, optax.EmptyState()
        )
        assert_bitwise_equal(ours, theirs)


@with_and_without_jit
@pytest.mark.parametrize("bad", [INF, -INF, NAN])
@pytest.mark.full(keep=1)
def test_nonfinite_gradients_pass_through(bad, jit):
    grads = grads_of(0, scale=10.0)
    grads["a"] = grads["a"].at[1, 2].set(bad)
    out, _ = maybe_jit(jdls.clip(1.0).update, jit)(grads, optax.EmptyState())
    assert_bitwise_equal(out, grads)
    # What optax does instead: the finite elements become zeros (or NaN), the inf NaN.
    theirs, _ = optax.clip_by_global_norm(1.0).update(grads, optax.EmptyState())
    assert not np.isfinite(np.asarray(theirs["a"][1, 2]))
    if not np.isnan(bad):
        assert np.all(np.asarray(theirs["b"][0]) == 0)


@with_and_without_jit
def test_norm_overflowing_float32_still_clips(jit):
    # The norm is 6e38 > float32 max: optax's norm is inf and every update becomes 0.
    grads = {"a": jnp.array([3e38, -3e38]), "b": jnp.array([3e38, 3e38])}
    out, _ = maybe_jit(jdls.clip(2.0).update, jit)(grads, optax.EmptyState())
    np.testing.assert_array_equal(out["a"], [1.0, -1.0])
    np.testing.assert_array_equal(out["b"], [1.0, 1.0])
    theirs, _ = optax.clip_by_global_norm(2.0).update(grads, optax.EmptyState())
    np.testing.assert_array_equal(theirs["a"], [0.0, -0.0])


@with_and_without_jit
def test_squares_overflowing_float32_still_clips(jit):
    # Squares (1e40) overflow, the norm (2e20) does not.
    grads = {"a": jnp.array([1e20, -1e20, 1e20, 1e20]), "tiny": jnp.array([1e-30])}
    out, _ = maybe_jit(jdls.clip(1.0).update, jit)(grads, optax.EmptyState())
    np.testing.assert_array_equal(out["a"], [0.5, -0.5, 0.5, 0.5])
    assert 0.0 <= float(out["tiny"][0]) < 1e-45


def test_a_limit_above_an_overflowing_norm_leaves_gradients_alone():
    grads = {"a": jnp.array([1e20, 1e20])}  # norm 1.4e20 < limit 1e30
    out, _ = jdls.clip(1e30).update(grads, optax.EmptyState())
    assert_bitwise_equal(out, grads)


def test_float16_leaves_are_clipped_in_float32():
    grads = {"h": jnp.array([300.0, 400.0], jnp.float16), "f": jnp.zeros(2)}
    out, _ = jdls.clip(1.0).update(grads, optax.EmptyState())
    assert out["h"].dtype == jnp.float16
    np.testing.assert_array_equal(out["h"], np.array([0.6, 0.8], np.float16))
    # optax squares in float16: 300**2 overflows and the update becomes zero.
    theirs, _ = optax.clip_by_global_norm(1.0).update(grads, optax.EmptyState())
    np.testing.assert_array_equal(theirs["h"], [0.0, 0.0])


@with_and_without_jit
def test_max_value(jit):
    grads = {
        "f": jnp.array([-5.0, -1.0, 0.5, 2.0, INF, -INF, NAN]),
        "i": jnp.array([7, -9]),
        "none": None,
    }
    out, _ = maybe_jit(jdls.clip(max_value=1.5).update, jit)(grads, optax.EmptyState())
    np.testing.assert_array_equal(out["f"], [-1.5, -1.0, 0.5, 1.5, INF, -INF, NAN])
    assert_bitwise_equal(out["i"], grads["i"])
    assert out["none"] is None


@with_and_without_jit
def test_integer_bool_none_and_empty(jit):
    grads = {
        "n": jnp.array([10**6]),
        "b": jnp.array(True),
        "x": None,
        "w": jnp.array([3.0, 4.0]),
    }
    out, _ = maybe_jit(jdls.clip(1.0).update, jit)(grads, optax.EmptyState())
    assert_bitwise_equal(out["n"], grads["n"]) and out["x"] is None
    assert bool(out["b"])
    np.testing.assert_allclose(out["w"], [0.6, 0.8], rtol=1e-7)
    out, _ = maybe_jit(jdls.clip(1.0).update, jit)({}, optax.EmptyState())
    assert out == {}
    out, _ = maybe_jit(jdls.clip(1.0).update, jit)({"e": jnp.zeros((0, 3))}, optax.EmptyState())
    assert out["e"].shape == (0, 3)


def test_traced_limit_from_inject_hyperparams():
    tx = optax.inject_hyperparams(jdls.clip)(max_norm=1.0)
    state = tx.init({"w": jnp.zeros(2)})
    out, state = jax.jit(tx.update)({"w": jnp.array([3.0, 4.0])}, state)
    np.testing.assert_allclose(out["w"], [0.6, 0.8], rtol=1e-7)
    state.hyperparams["max_norm"] = jnp.asarray(10.0)
    out, _ = jax.jit(tx.update)({"w": jnp.array([3.0, 4.0])}, state)
    np.testing.assert_array_equal(out["w"], [3.0, 4.0])


def test_arguments():
    with pytest.raises(ValueError, match="max_norm or max_value, not both"):
        jdls.clip(1.0, 1.0)
    with pytest.raises(ValueError, match="leave jdls.clip out"):
        jdls.clip()
    for bad in (0.0, -1.0, INF, NAN):
        with pytest.raises(ValueError, match="max_norm must be a finite number > 0"):
            jdls.clip(max_norm=bad)
        with pytest.raises(ValueError, match="max_value must be a finite number > 0"):
            jdls.clip(max_value=bad)
    with pytest.raises(TypeError, match="max_norm must be a number"):
        jdls.clip(max_norm="1.0")
    with pytest.raises(ValueError, match="must be a scalar"):
        jdls.clip(max_norm=jnp.ones(2))
    assert jdls.clip(max_norm=jnp.float32(2.0)) is not None
    with pytest.raises(ValueError, match="sharded=True"):
        jdls.clip(1.0, axis_name="i")


# --------------------------------------------------------------------------------------------
# In a chain with jdls.wrap, and fused into it (max_norm).
# --------------------------------------------------------------------------------------------


def adam_with_schedule():
    return optax.adam(optax.cosine_decay_schedule(1e-2, decay_steps=5))


@with_and_without_jit
def test_chain_matches_optax_chain_on_finite_steps(jit):
    ours = optax.chain(jdls.clip(1.0), jdls.wrap(adam_with_schedule(), jdls.DynamicScale()))
    theirs = optax.chain(optax.clip_by_global_norm(1.0), adam_with_schedule())
    s1, s2 = ours.init(grads_of(0)), theirs.init(grads_of(0))
    up1, up2 = maybe_jit(ours.update, jit), maybe_jit(theirs.update, jit)
    for seed in range(2):
        grads = grads_of(seed, scale=[0.01, 10.0][seed])
        u1, s1 = up1(grads, s1)
        u2, s2 = up2(grads, s2)
        assert_close(u1, u2)
    assert_close(s1[1].inner_state, s2[1])


@with_and_without_jit
def test_fused_equals_chain(jit):
    check_fused_equals_chain("cond", jit)


def test_fused_equals_chain_with_select():
    check_fused_equals_chain("select", jit=True)


def check_fused_equals_chain(skip_with, jit):
    """wrap(inner, max_norm=c) matches chain(clip(c), wrap(inner)) through overflowing norms
    and skipped steps (same decisions, same norm, updates within a few ulps)."""
    fused = jdls.wrap(adam_with_schedule(), jdls.DynamicScale(), max_norm=1.0, skip_with=skip_with)
    chained = optax.chain(jdls.clip(1.0), jdls.wrap(adam_with_schedule(), jdls.DynamicScale()))
    params = grads_of(0)
    s1, s2 = fused.init(params), chained.init(params)
    up1, up2 = maybe_jit(fused.update, jit), maybe_jit(chained.update, jit)
    huge = {"a": jnp.full((3, 4), 3e38), "b": [jnp.full(5, -3e38)], "c": jnp.float32(1.0)}
    bad = grads_of(2)
    bad["b"][0] = bad["b"][0].at[3].set(NAN)
    for grads in [grads_of(0, 0.01), huge, bad, grads_of(1, 10.0)]:
        u1, s1 = up1(grads, s1, params)
        u2, s2 = up2(grads, s2, params)
        assert_close(u1, u2)
        assert bool(jdls.stats(s1).finite) == bool(jdls.stats(s2).finite)
        norm = float(jdls.stats(s1).grad_norm)
        if grads is huge:
            assert norm == INF
        elif grads is bad:
            assert np.isnan(norm)
        else:
            expected = float(optax.tree.norm(grads))
            assert norm == expected
    assert_close(s1.inner_state, s2[1].inner_state)
    assert int(jdls.stats(s1).skipped_steps) == 1


def test_fused_clip_matches_optax_clip_then_adam():
    fused = jdls.wrap(optax.adam(1e-2), jdls.DynamicScale(), max_norm=0.5)
    plain = optax.chain(optax.clip_by_global_norm(0.5), optax.adam(1e-2))
    s1, s2 = fused.init(grads_of(0)), plain.init(grads_of(0))
    for seed in range(2):
        u1, s1 = jax.jit(fused.update)(grads_of(seed), s1)
        u2, s2 = jax.jit(plain.update)(grads_of(seed), s2)
        assert_close(u1, u2)


def test_cerebras_formula_differs_by_at_most_1e_6_relative():
    """Documented difference: Cerebras multiplies by min(c / (norm + 1e-6), 1)."""
    grads = grads_of(0, scale=3.0)
    norm = float(optax.tree.norm(grads))
    out, _ = jdls.clip(1.0).update(grads, optax.EmptyState())
    coef = min(1.0 / (norm + 1e-6), 1.0)
    for ours, g in zip(jax.tree.leaves(out), jax.tree.leaves(grads), strict=True):
        np.testing.assert_allclose(ours, np.asarray(g) * coef, rtol=2e-6)
