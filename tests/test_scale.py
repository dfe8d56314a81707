"""The scale objects: pytree structure, scale/unscale dtypes, value_and_grad, all_finite."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _helpers import F32_MAX, assert_bitwise_equal, maybe_jit, with_and_without_jit

import jdls


def kinds():
    return [
        ("dynamic", jdls.DynamicScale(1024.0)),
        ("static", jdls.StaticScale(1024.0)),
        ("noop", jdls.NoOpScale()),
    ]


# --------------------------------------------------------------------------------------------
# Pytree structure.
# --------------------------------------------------------------------------------------------


def test_dynamic_scale_children_are_arrays_and_config_is_static():
    scale = jdls.DynamicScale(256.0, growth_interval=7, min_loss_scale=0.25, hysteresis=3)
    leaves, treedef = jax.tree_util.tree_flatten(scale)
    assert [leaf.dtype for leaf in leaves] == [jnp.float32] + [jnp.int32] * 3
    assert all(leaf.shape == () for leaf in leaves)
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(scale)[0]]
    # The children are the scale and the rule's counters (GrowBackoff: GrowBackoffState).
    assert paths == [
        ".loss_scale",
        ".state.counter",
        ".state.hysteresis",
        ".state.min_scale_overflows",
    ]
    assert isinstance(scale.state, jdls.rules.GrowBackoff.State)
    restored = jax.tree_util.tree_unflatten(treedef, leaves)
    assert restored.rule == scale.rule  # every piece of configuration survives
    assert restored.rule == jdls.rules.GrowBackoff(
        growth_interval=7, min_loss_scale=0.25, hysteresis=3
    )
    assert [int(x) for x in restored.state] == [0, 3, 0]


def test_round_trip_keeps_minimum_unlike_jmp():
    """jmp's DynamicLossScale drops min_loss_scale when flattened; jdls keeps it."""
    scale = jdls.presets.jmp(loss_scale=4.0, min_loss_scale=2.0)

    @jax.jit
    def three_overflows(s):
        for _ in range(3):
            s = s.adjust(False)
        return s

    out = three_overflows(scale)
    assert out.rule.min_loss_scale == 2.0
    assert float(out.loss_scale) == 2.0  # clamped at the minimum, under jit

    jmp = pytest.importorskip("jmp")
    peer = jmp.DynamicLossScale(jnp.float32(4.0), min_loss_scale=jnp.float32(2.0))
    leaves, treedef = jax.tree_util.tree_flatten(peer)
    peer_restored = jax.tree_util.tree_unflatten(treedef, leaves)
    # The peer's defect this test guards against: its minimum is reset to 1.
    assert float(peer_restored.min_loss_scale) == 1.0


def test_rule_changes_recompile_data_changes_do_not():
    traces = []

    @jax.jit
    def f(s):
        traces.append(1)
        return s.adjust(True)

    f(jdls.DynamicScale(8.0))
    f(jdls.DynamicScale(16.0))
    assert len(traces) == 1
    f(jdls.DynamicScale(8.0, growth_interval=3))
    assert len(traces) == 2


def test_static_and_noop_are_pytrees():
    static = jdls.StaticScale(3.0)
    leaves, treedef = jax.tree_util.tree_flatten(static)
    assert len(leaves) == 1 and float(leaves[0]) == 3.0
    assert float(jax.tree_util.tree_unflatten(treedef, leaves).loss_scale) == 3.0
    noop = jdls.NoOpScale()
    assert jax.tree_util.tree_leaves(noop) == []
    assert float(jax.tree_util.tree_map(lambda x: x, noop).loss_scale) == 1.0


def test_vmap_over_a_batch_of_scales():
    scales = jax.vmap(lambda s: jdls.DynamicScale(2.0).replace(loss_scale=s))(
        jnp.array([4.0, 8.0, 16.0])
    )
    finite = jnp.array([True, False, True])
    out = jax.vmap(lambda s, f: s.adjust(f))(scales, finite)
    np.testing.assert_array_equal(out.loss_scale, [4.0, 4.0, 16.0])
    np.testing.assert_array_equal(out.state.counter, [1, 0, 1])
    np.testing.assert_array_equal(out.state.hysteresis, [1, 1, 1])
    np.testing.assert_array_equal(out.state.min_scale_overflows, [0, 0, 0])
    # The skip count is no longer the scale's (jdls.stats(opt_state).skipped_steps): the
    # overflowing member is the one that backed off.
    np.testing.assert_array_equal(out.loss_scale < scales.loss_scale, ~finite)


# --------------------------------------------------------------------------------------------
# The default scale.
# --------------------------------------------------------------------------------------------


def test_default_documented_values():
    s = jdls.DynamicScale()
    r = s.rule
    assert float(s.loss_scale) == 2.0**15
    assert (r.growth_factor, r.backoff_factor, r.growth_interval) == (2.0, 0.5, 2000)
    assert (r.min_loss_scale, r.max_loss_scale, r.hysteresis) == (1.0, 2.0**24, 1)


def test_default_never_reaches_zero_inf_or_nan():
    s = jdls.DynamicScale(growth_interval=1)  # fastest possible growth
    scan = jax.jit(
        lambda s, flags: jax.lax.scan(lambda c, f: (c.adjust(f), c.loss_scale), s, flags)
    )
    s, hist = scan(s, jnp.zeros(300, bool))  # 300 overflows in a row
    assert float(s.loss_scale) == 1.0 and float(hist.min()) == 1.0
    s, hist = scan(s, jnp.ones(300, bool))  # 300 growths in a row
    assert float(s.loss_scale) == 2.0**24 and float(hist.max()) == 2.0**24
    s = jdls.DynamicScale()  # the true default: 20k finite steps, 10 growths, then clamped
    s, hist = scan(s, jnp.ones(20_000 * 2, bool))
    assert float(s.loss_scale) == 2.0**24
    assert bool(jnp.all(jnp.isfinite(hist) & (hist >= 1.0)))


@with_and_without_jit
def test_exact_trajectory(jit):
    adjust = maybe_jit(lambda s, f: s.adjust(f), jit)
    s = jdls.DynamicScale(8.0, growth_interval=2, min_loss_scale=2.0, max_loss_scale=16.0)
    got, skipped = [], 0  # the skip count is a wrap statistic now: counted here
    for f in [True, True, True, True, False, False, False, True, False, True, True]:
        s = adjust(s, f)
        skipped += not f
        got.append((float(s.loss_scale), int(s.state.counter), skipped))
    assert got == [
        (8.0, 1, 0),
        (16.0, 0, 0),
        (16.0, 1, 0),
        (16.0, 0, 0),  # growth clamped at the maximum
        (8.0, 0, 1),
        (4.0, 0, 2),
        (2.0, 0, 3),
        (2.0, 1, 3),
        (2.0, 0, 4),  # backoff clamped at the minimum
        (2.0, 1, 4),
        (4.0, 0, 4),
    ]


@with_and_without_jit
def test_hysteresis(jit):
    adjust = maybe_jit(lambda s, f: s.adjust(f), jit)
    s = jdls.DynamicScale(64.0, hysteresis=3, growth_interval=2)
    seq = [False, False, False, False, True, True, False, False]
    got = []
    for f in seq:
        s = adjust(s, f)
        got.append((float(s.loss_scale), int(s.state.hysteresis)))
    # Two overflows forgiven, then every overflow backs off until a growth refills.
    assert got == [
        (64.0, 2),
        (64.0, 1),
        (32.0, 1),
        (16.0, 1),
        (16.0, 1),
        (32.0, 3),
        (32.0, 2),
        (32.0, 1),
    ]


def back_off_cases():
    """Scales whose rule forgives overflows, in states with some hysteresis (or overflows)
    used, and ones that forgive none."""
    megatron = jdls.presets.megatron(initial_scale=64.0, hysteresis=3, growth_interval=4)
    deepspeed = jdls.presets.deepspeed(init_scale=64.0, delayed_shift=4, scale_window=4)
    cerebras = jdls.presets.cerebras(init_scale=64.0, overflow_tolerance=0.4)
    return {
        "megatron": megatron,
        "megatron_one_used": megatron.adjust(False),
        "deepspeed": deepspeed,
        "deepspeed_at_min": jdls.presets.deepspeed(init_scale=1.0, delayed_shift=2),
        "deepspeed_consecutive": jdls.presets.deepspeed(
            init_scale=64.0, delayed_shift=3, consecutive_hysteresis=True
        ),
        "cerebras_after_finite_steps": cerebras.adjust(True).adjust(True).adjust(True),
        "cerebras_tolerance_1": jdls.presets.cerebras(init_scale=64.0, overflow_tolerance=1.0),
        "dynamic": jdls.DynamicScale(64.0),
        "adaptive": jdls.AdaptiveScale(64.0),
    }


@pytest.mark.parametrize("name", list(back_off_cases()))
@with_and_without_jit
def test_back_off_counts_the_overflows_that_lower_the_scale(name, jit):
    """``back_off()`` is ``adjust(False)`` repeated until the rule backs off (the scale is
    lower, or clamped at the minimum: there DeepSpeed's error counts it), or once where no
    number of overflows backs off: the scale and every counter."""
    scale = back_off_cases()[name]
    if name == "deepspeed_at_min":  # delayed_shift 2: the second overflow backs off (clamped)
        want = scale.adjust(False).adjust(False)
        assert int(want.state.min_scale_overflows) == 1
    elif name == "cerebras_tolerance_1":  # no fraction of overflows exceeds 1
        want = scale.adjust(False)
    else:
        want = scale.adjust(False)
        while float(want.loss_scale) == float(scale.loss_scale):
            want = want.adjust(False)
    got = maybe_jit(lambda s: s.back_off(), jit)(scale)
    assert_bitwise_equal(got, want)
    lowered = float(got.loss_scale) < float(scale.loss_scale)
    assert lowered == (name not in ("deepspeed_at_min", "cerebras_tolerance_1"))


@with_and_without_jit
def test_static_and_noop_never_change(jit):
    for _, scale in kinds()[1:]:
        out = maybe_jit(lambda s: s.adjust(False).adjust(True), jit)(scale)
        assert float(out.loss_scale) == float(scale.loss_scale)


# --------------------------------------------------------------------------------------------
# scale / unscale.
# --------------------------------------------------------------------------------------------


@with_and_without_jit
@pytest.mark.parametrize("scale", [s for _, s in kinds()], ids=[n for n, _ in kinds()])
def test_dtypes(scale, jit):
    tree = {
        "f16": jnp.full((2,), 3.0, jnp.float16),
        "bf16": jnp.full((2,), 3.0, jnp.bfloat16),
        "f32": jnp.full((2,), 3.0, jnp.float32),
        "int": jnp.arange(2, dtype=jnp.int32),
        "bool": jnp.array([True, False]),
        "none": None,
    }
    scaled = maybe_jit(scale.scale, jit)(tree)
    unscaled = maybe_jit(scale.unscale, jit)(tree)
    assert scaled["none"] is None and unscaled["none"] is None
    for k in ("f16", "bf16", "f32", "int", "bool"):
        assert scaled[k].dtype == tree[k].dtype, k
    assert unscaled["f16"].dtype == jnp.float32
    assert unscaled["bf16"].dtype == jnp.float32
    assert unscaled["f32"].dtype == jnp.float32
    np.testing.assert_array_equal(unscaled["int"], tree["int"])
    np.testing.assert_array_equal(unscaled["bool"], tree["bool"])
    s = float(scale.loss_scale)
    np.testing.assert_array_equal(scaled["f32"], np.float32(3.0 * s))
    np.testing.assert_array_equal(unscaled["f32"], np.float32(3.0 / s))


@with_and_without_jit
def test_unscale_of_half_gradients_loses_nothing(jit):
    # 2**-14 / 2**16 = 2**-30: a float16 result would flush to zero; float32 keeps it.
    grads = jnp.array([2.0**-14, 65504.0, 2.0**-24], jnp.float16)
    out = maybe_jit(jdls.StaticScale(2.0**16).unscale, jit)(grads)
    assert out.dtype == jnp.float32
    np.testing.assert_array_equal(out, np.array([2.0**-30, 65504.0 / 2**16, 2.0**-40], np.float32))


@with_and_without_jit
def test_scale_float16_forms_product_in_float32(jit):
    # 0.001 * 2**20 = 1048.576 fits float16, though 2**20 itself does not.
    out = maybe_jit(jdls.StaticScale(2.0**20).scale, jit)(jnp.float16(0.001))
    assert out.dtype == jnp.float16
    assert float(out) == float(np.float16(np.float32(np.float16(0.001)) * np.float32(2**20)))
    # A product beyond float16's range really overflows: that is what loss scaling detects.
    assert np.isinf(float(jdls.StaticScale(2.0**20).scale(jnp.float16(1.0))))


# --------------------------------------------------------------------------------------------
# value_and_grad.
# --------------------------------------------------------------------------------------------


def loss_fn(w, x):
    return jnp.mean((x @ w.astype(jnp.float16)).astype(jnp.float32) ** 2) * 1e-3


@with_and_without_jit
@pytest.mark.parametrize("scale", [s for _, s in kinds()], ids=[n for n, _ in kinds()])
@pytest.mark.full(keep=1)
def test_matches_jax_value_and_grad(scale, jit):
    w = jnp.linspace(-1, 1, 12, dtype=jnp.float32).reshape(4, 3)
    x = jnp.linspace(0, 2, 8, dtype=jnp.float32).reshape(2, 4)
    f = lambda w, x: jnp.sum((x @ w) ** 2)  # noqa: E731
    value, grads = maybe_jit(scale.value_and_grad(f), jit)(w, x)
    ref_value, ref_grads = jax.value_and_grad(f)(w, x)
    assert float(value) == float(ref_value)  # the value is the loss, never re-divided
    np.testing.assert_allclose(grads, ref_grads, rtol=1e-6)  # power-of-2 scale: exact-ish


@with_and_without_jit
def test_has_aux_and_argnums(jit):
    scale = jdls.DynamicScale(2.0**10)

    def f(a, b):
        return jnp.sum(a * b), {"aux": a.sum()}

    a, b = jnp.array([1.0, 2.0]), jnp.array([3.0, 4.0])
    (value, aux), (ga, gb) = maybe_jit(scale.value_and_grad(f, argnums=(0, 1), has_aux=True), jit)(
        a, b
    )
    (rv, raux), (rga, rgb) = jax.value_and_grad(f, argnums=(0, 1), has_aux=True)(a, b)
    assert float(value) == float(rv) and float(aux["aux"]) == float(raux["aux"])
    np.testing.assert_array_equal(ga, rga)
    np.testing.assert_array_equal(gb, rgb)


def test_float16_underflow_is_rescued_by_scaling():
    w = jnp.full((4, 3), 1e-2, jnp.float32)
    x = jnp.full((2, 4), 1e-2, jnp.float32)
    _, unscaled = jdls.NoOpScale().value_and_grad(loss_fn)(w, x)
    _, scaled = jdls.StaticScale(2.0**14).value_and_grad(loss_fn)(w, x)
    assert unscaled.dtype == scaled.dtype == jnp.float32
    assert float(jnp.abs(unscaled).max()) == 0.0  # flushed in float16
    assert float(jnp.abs(scaled).min()) > 0.0
    exact = jax.grad(lambda w: jnp.mean((x @ w) ** 2) * 1e-3)(w)  # all in float32
    np.testing.assert_allclose(scaled, exact, rtol=1e-2)


def test_overflowing_scaled_loss_gives_nonfinite_grads_but_exact_value():
    f = lambda w: jnp.sum(w.astype(jnp.float16) * 1000.0)  # noqa: E731
    value, grads = jdls.StaticScale(2.0**16).value_and_grad(f)(jnp.ones(2))
    assert float(value) == 2000.0
    assert not bool(jdls.all_finite(grads))


def test_has_aux_requires_pair():
    with pytest.raises(TypeError, match="pair"):
        jdls.DynamicScale().value_and_grad(lambda w: w.sum(), has_aux=True)(jnp.ones(2))


# --------------------------------------------------------------------------------------------
# all_finite.
# --------------------------------------------------------------------------------------------


@with_and_without_jit
@pytest.mark.parametrize("special", [np.inf, -np.inf, np.nan])
def test_detects_each_special(special, jit):
    tree = {"a": jnp.ones(3), "b": [jnp.zeros((2, 2), jnp.float16), None]}
    bad = {"a": jnp.ones(3), "b": [jnp.zeros((2, 2), jnp.float16).at[1, 0].set(special), None]}
    f = maybe_jit(jdls.all_finite, jit)
    assert bool(f(tree)) is True
    assert bool(f(bad)) is False


@with_and_without_jit
def test_ignores_non_float_and_handles_empty(jit):
    f = maybe_jit(jdls.all_finite, jit)
    assert bool(f({"step": jnp.array(3), "mask": jnp.array([True])})) is True
    assert bool(f({})) is True
    assert bool(f([None, ()])) is True
    assert f({}).dtype == jnp.bool_ and f({}).shape == ()


def test_large_finite_values_are_finite():
    # A sum-based check would overflow here and report a false non-finite.
    assert bool(jdls.all_finite(jnp.full((1000,), F32_MAX))) is True


# --------------------------------------------------------------------------------------------
# Validation.
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"growth_factor": 0.5}, "growth_factor must be > 1, got 0.5"),
        ({"growth_factor": 1.0}, "growth_factor must be > 1, got 1.0"),
        ({"growth_factor": float("inf")}, "growth_factor must be > 1"),
        ({"backoff_factor": 1.0}, r"backoff_factor must be in the open interval \(0, 1\), got 1.0"),
        ({"backoff_factor": 0.0}, "backoff_factor must be in the open interval"),
        ({"backoff_factor": -0.5}, "backoff_factor must be in the open interval"),
        ({"growth_interval": 0}, "growth_interval must be >= 1, got 0"),
        ({"growth_interval": -3}, "growth_interval must be >= 1, got -3"),
        ({"loss_scale": 0.0}, "loss_scale must be a finite number > 0, got 0.0"),
        ({"loss_scale": -1.0}, "loss_scale must be a finite number > 0"),
        ({"loss_scale": float("inf")}, "loss_scale must be a finite number > 0"),
        ({"loss_scale": float("nan")}, "loss_scale must be a number, got nan"),
        ({"loss_scale": 1e39}, "loss_scale must fit in float32"),
        ({"loss_scale": 1e-39}, "loss_scale must be a normal float32 number"),
        ({"loss_scale": 0.5}, r"loss_scale must be within \[min_loss_scale, max_loss_scale\]"),
        ({"loss_scale": 2.0**25}, "loss_scale must be within"),
        ({"min_loss_scale": 0.0}, "min_loss_scale must be a finite number > 0"),
        ({"max_loss_scale": float("inf")}, "max_loss_scale must be a finite number > 0"),
        (
            {"min_loss_scale": 8.0, "max_loss_scale": 4.0},
            "min_loss_scale must be <= max_loss_scale",
        ),
        ({"hysteresis": 0}, "hysteresis must be >= 1, got 0"),
    ],
)
def test_invalid_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        jdls.DynamicScale(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"growth_interval": 2.5}, "growth_interval must be an int, got 2.5"),
        ({"hysteresis": True}, "hysteresis must be an int"),
        ({"loss_scale": "big"}, "loss_scale must be a real number, got 'big'"),
    ],
)
def test_invalid_types(kwargs, message):
    with pytest.raises(TypeError, match=message):
        jdls.DynamicScale(**kwargs)


def test_static_scale_validation():
    for bad in (0.0, -2.0, float("inf")):
        with pytest.raises(ValueError, match="loss_scale must be a finite number > 0"):
            jdls.StaticScale(bad)


def test_rule_validation_and_initial_state_counters():
    with pytest.raises(ValueError, match="tolerance must be >= 0, got -0.1"):
        jdls.rules.OverflowTolerance(tolerance=-0.1)
    with pytest.raises(ValueError, match="counter_after_growth must be 0 or 1"):
        jdls.rules.GrowBackoff(counter_after_growth=2)
    rule = jdls.rules.GrowBackoff(growth_interval=5)
    with pytest.raises(ValueError, match=r"counter must be < growth_interval \(5\), got 5"):
        jdls.DynamicScale(1.0, rule, state=rule.initial_state(counter=5))
    rule = jdls.rules.GrowBackoff(hysteresis=2)
    with pytest.raises(ValueError, match=r"hysteresis must be in \[1, 2\]"):
        jdls.DynamicScale(1.0, rule, state=rule.initial_state(hysteresis=3))
    with pytest.raises(TypeError, match="rule must be a jdls.rules.Rule, got dict"):
        jdls.DynamicScale(1.0, {"growth_interval": 3})  # type: ignore[arg-type]
    # Counters within range are kept exactly (the old from_rule(rule, x, counter, hysteresis)).
    rule = jdls.rules.GrowBackoff(growth_interval=5, hysteresis=2)
    scale = jdls.DynamicScale(1.0, rule, state=rule.initial_state(counter=4, hysteresis=1))
    assert (int(scale.state.counter), int(scale.state.hysteresis)) == (4, 1)
    assert float(scale.adjust(True).loss_scale) == 2.0  # the 5th counted step grows
    with pytest.raises(TypeError, match="unknown fields"):
        jdls.DynamicScale().replace(scale=1.0)


def test_scales_compare_by_value():
    """Value equality, as jmp's and Flax struct's scales: same kind, same rule, equal arrays
    (they compared by identity, so a tree_map copy was unequal)."""
    scale = jdls.DynamicScale(1024.0, growth_interval=3)
    copy = jax.tree_util.tree_map(lambda x: x, scale)
    assert copy is not scale and copy == scale
    assert jax.jit(lambda s: s)(scale) == scale
    assert scale.adjust(True) != scale  # the counter moved
    assert scale.adjust(False) != scale  # the scale moved
    assert scale != jdls.DynamicScale(1024.0, growth_interval=4)  # another rule
    assert scale != jdls.StaticScale(1024.0) and scale != 1024.0
    assert jdls.StaticScale(2.0) == jdls.StaticScale(2.0) != jdls.StaticScale(4.0)
    assert jdls.NoOpScale() == jdls.NoOpScale() != jdls.StaticScale(1.0)
    assert jdls.AdaptiveScale() == jdls.AdaptiveScale() != jdls.AdaptiveScale(margin=5)
    # Same values in another dtype are another state.
    assert scale != scale.replace(loss_scale=jnp.float16(1024.0))
    # Batched (vmapped) scales compare element-wise, all elements at once.
    batch = jax.vmap(lambda x: jdls.DynamicScale(2.0).replace(loss_scale=x))(jnp.ones(3))
    assert batch == jax.tree_util.tree_map(jnp.copy, batch)
    assert batch != jax.tree_util.tree_map(lambda x: x.at[1].add(1), batch)
    assert batch != scale


SPELLINGS = {
    "float16": ("float16", jnp.float16, np.float16, np.dtype("float16")),
    "bfloat16": ("bfloat16", jnp.bfloat16, np.dtype(jnp.bfloat16)),
    "cbfloat16": ("cbfloat16", jdls.cbfloat16, jdls.FloatFormat(6, 9, name="my_cb16")),
}


@pytest.mark.parametrize("fmt", list(SPELLINGS))
def test_a_format_spelled_any_way_makes_one_rule(fmt):
    """``compute_dtype`` is kept in one form, whatever its spelling: equal rules and scales
    compare equal (transitively), hash alike, key jit's cache once and pass through a scan
    carry; the format is the same (finfo)."""
    spellings = SPELLINGS[fmt]
    rules = [jdls.rules.Adaptive(compute_dtype=d) for d in spellings]
    scales = [jdls.AdaptiveScale(compute_dtype=d) for d in spellings]
    for rule, scale in zip(rules, scales, strict=True):
        assert rule == rules[0] and hash(rule) == hash(rules[0])
        assert scale == scales[0] and scale.rule == rule
        assert jax.tree_util.tree_structure(scale) == jax.tree_util.tree_structure(scales[0])
        assert rule.format_range() == rules[0].format_range()
        assert jdls.finfo(rule.compute_dtype).max == jdls.finfo(spellings[0]).max
    if fmt == "cbfloat16":
        assert all(isinstance(r.compute_dtype, jdls.FloatFormat) for r in rules)
        assert rules[2].compute_dtype.name == "my_cb16"  # the label given is kept
    else:
        assert all(r.compute_dtype == np.dtype(fmt) for r in rules)
    assert rules[0] != jdls.rules.Adaptive(compute_dtype="float32")

    traces = []

    @jax.jit
    def f(scale):
        traces.append(1)
        return scale.loss_scale * 2

    for scale in scales:
        f(scale)
    assert len(traces) == 1

    # set_scale with another spelling inside lax.scan: the carry keeps its type
    tx = jdls.wrap(optax.sgd(0.1), scales[0])
    params = {"w": jnp.ones(2)}

    def body(state, scale):
        return jdls.set_scale(state, scale), None

    for scale in scales[1:]:
        state, _ = jax.lax.scan(lambda s, _, scale=scale: body(s, scale), tx.init(params), None, 2)
        assert jdls.get_scale(state) == scales[0]


def test_scale_equality_under_tracing_is_an_error_and_scales_are_unhashable():
    scale = jdls.DynamicScale(1024.0)
    with pytest.raises(TypeError, match=r"inside a traced function.*jnp.all\(a.loss_scale"):
        jax.jit(lambda a, b: a == b)(scale, scale)
    with pytest.raises(TypeError, match="unhashable"):
        hash(scale)
    with pytest.raises(TypeError, match="unhashable"):
        hash(jdls.StaticScale(2.0))
    assert hash(jdls.NoOpScale()) == hash(jdls.NoOpScale())
    assert jax.jit(lambda s: s.loss_scale * 2)(scale) == 2048.0  # pytrees need no hash
