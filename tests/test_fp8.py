"""jdls.fp8: recipes, the FP8 dot, Flax fp8_ops bit for bit, skip-awareness, telemetry."""

from __future__ import annotations

import functools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _helpers import (
    assert_bitwise_equal,
    inner_jits,
    maybe_jit,
    programs_lowered,
    with_and_without_jit,
)
from flax.linen import fp8_ops
from flax.training import train_state

import jdls
from jdls import fp8
from jdls._sites.update import update_sites

DN = (((1,), (0,)), ((), ()))


def _flax_step(op, x, w, ct, meta, compute):
    """One step of Flax's FP8 dot: output, dx, dw and the new meta (its OWG gradients)."""

    def f(x, w, meta):
        if op == "direct":
            return fp8_ops.fp8_scaled_dot_general(
                x, w, DN, preferred_element_type=compute, quantize_compute_type=compute, **meta
            )
        e4, e5 = (
            (jnp.float8_e4m3fnuz, jnp.float8_e5m2fnuz)
            if op == "nanoo"
            else (jnp.float8_e4m3fn, jnp.float8_e5m2)
        )
        xq = fp8_ops.in_qdq(compute, e4, x, meta["lhs_scale"], meta["lhs_amax_history"])
        wq = fp8_ops.in_qdq(compute, e4, w, meta["rhs_scale"], meta["rhs_amax_history"])
        y = fp8_ops.dot_general_with_precision(xq, wq, DN)
        return fp8_ops.out_qdq(compute, e5, y, meta["grad_scale"], meta["grad_amax_history"])

    y, vjp = jax.vjp(f, x, w, meta)
    dx, dw, new_meta = vjp(ct)
    return y, dx, dw, new_meta


def _jdls_step(x, w, ct, site):
    def f(x, w, site):
        return fp8.dot_general(x, w, DN, site=site)

    y, vjp = jax.vjp(f, x, w, site)
    dx, dw, measured = vjp(ct)
    return y, dx, dw, update_sites(site, measured)


def _flax_meta(length):
    meta = {}
    for k in ("lhs", "rhs", "grad"):
        meta[f"{k}_scale"] = jnp.ones((1,), jnp.float32)
        meta[f"{k}_amax_history"] = jnp.zeros((length,), jnp.float32)
    return meta


def _inputs(step, dtype):
    """Magnitudes that change from step to step by orders of magnitude (scales must follow)."""
    k = jax.random.split(jax.random.key(step), 3)
    big = 10.0 ** ((step * 7) % 5 - 2)
    x = (jax.random.normal(k[0], (8, 16)) * big).astype(dtype)
    w = (jax.random.normal(k[1], (16, 4)) / (1 + step % 3)).astype(dtype)
    ct = (jax.random.normal(k[2], (8, 4)) * 10.0 ** (step % 4 - 1)).astype(dtype)
    return x, w, ct


@pytest.mark.parametrize("op", ["direct", "qdq", "nanoo"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@with_and_without_jit
@pytest.mark.full(keep=1)
def test_flax_preset_is_bit_identical_to_flax(op, dtype, jit):
    """Outputs, gradients, scales and histories equal Flax's fp8_ops bit for bit, step by step.

    Flax's step is compiled in both cases: called eagerly, jdls compiles its FP8 dot's forward
    and backward rules as one program each, as a jitted step compiles Flax's ops, where Flax
    called eagerly dispatches op by op. XLA rounds a fused program differently from the same
    operations one at a time (on an AVX2 CPU the qdq weight gradient moved by an ulp, with no
    difference on an AVX-512 one), so the eager pair would compare XLA's two modes."""
    length = 4
    meta = _flax_meta(length)
    site = fp8.init(fp8.flax_fp8_ops(length, op=op))
    flax_step = jax.jit(_flax_step, static_argnums=(0, 5))
    jdls_step = maybe_jit(_jdls_step, jit)
    for step in range(12):
        x, w, ct = _inputs(step, dtype)
        used = site.value  # jdls keeps the scale a step will use; Flax returns it as a gradient
        y0, dx0, dw0, meta = flax_step(op, x, w, ct, meta, dtype)
        y1, dx1, dw1, site = jdls_step(x, w, ct, site)
        assert_bitwise_equal(y1, y0)
        assert_bitwise_equal(dx1, dx0)
        assert_bitwise_equal(dw1, dw0)
        for role in ("lhs", "rhs", "grad"):
            assert_bitwise_equal(getattr(used, role).scale, meta[f"{role}_scale"][0])
            assert_bitwise_equal(getattr(site.value, role).history, meta[f"{role}_amax_history"])


_FLAX_OPS = {
    "direct": nn.Fp8DirectDotGeneralOp,
    "qdq": nn.Fp8DotGeneralOp,
    "nanoo": nn.NANOOFp8DotGeneralOp,
}


class _Bf16Mlp(nn.Module):
    """Two ``nn.Dense(dtype=bfloat16)`` with float32 parameters: each casts its kernel and
    its input to bfloat16 before the dot (how mixed precision trains)."""

    dot: Any

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        h = nn.Dense(48, dtype=jnp.bfloat16, dot_general_cls=self.dot)(x)
        return nn.Dense(24, dtype=jnp.bfloat16, dot_general_cls=self.dot)(nn.gelu(h))


@pytest.mark.parametrize(
    "op",
    [
        "direct",
        pytest.param("qdq", marks=pytest.mark.full),
        pytest.param("nanoo", marks=pytest.mark.full),
    ],
)
@with_and_without_jit
@pytest.mark.filterwarnings("ignore:The Fp8DotGeneralOp is deprecated:DeprecationWarning")
@pytest.mark.full  # about 12 s; test_flax_preset_is_bit_identical_to_flax stays in the quick run
def test_flax_preset_trains_a_bfloat16_dense_as_flax(op, jit):
    """Train steps of float32 parameters in bfloat16 Dense layers (each casts its kernel to
    bfloat16), Flax's op against the preset: outputs, gradients, scales and histories bit for
    bit. Jitted, XLA:CPU rounds a bfloat16 graph by its shape (jdls/fp8/_dot.py, _grad_of)."""
    length = 4
    flax_model = _Bf16Mlp(functools.partial(_FLAX_OPS[op], amax_history_length=length))
    recipe = fp8.flax_fp8_ops(length, op=op)
    jdls_model = _Bf16Mlp(functools.partial(fp8.linen.DotGeneral, recipe=recipe))
    x = jnp.ones((32, 40))
    variables = flax_model.init(jax.random.key(0), x)
    params, sites = variables["params"], jdls_model.init(jax.random.key(0), x)["jdls"]
    tx = optax.sgd(0.01)
    flax_state = train_state.TrainState.create(apply_fn=flax_model.apply, params=variables, tx=tx)
    opt_state = tx.init(params)

    def flax_step(state, x, t):
        def loss(variables):
            y = state.apply_fn(variables, x)
            return jnp.mean((y.astype(jnp.float32) - t) ** 2), y

        (_, y), grads = jax.value_and_grad(loss, has_aux=True)(state.params)
        return state.apply_gradients(grads=grads), y, grads["params"]

    def jdls_step(params, sites, opt_state, x, t):
        def loss(params, sites):
            y = jdls_model.apply({"params": params, "jdls": sites}, x)
            return jnp.mean((y.astype(jnp.float32) - t) ** 2), y

        (_, y), (grads, measured) = jax.value_and_grad(loss, (0, 1), has_aux=True)(params, sites)
        updates, opt_state = tx.update(grads, opt_state)
        params = optax.apply_updates(params, updates)
        return params, jdls.update_sites(sites, measured), opt_state, y, grads

    flax_step, jdls_step = maybe_jit(flax_step, jit), maybe_jit(jdls_step, jit)
    rng = np.random.default_rng(0)
    for step in range(4):
        x = rng.standard_normal((32, 40)).astype(np.float32) * 10.0 ** (step % 3 - 1)
        t = rng.standard_normal((32, 24)).astype(np.float32)
        used = sites  # jdls keeps the scales a step uses; Flax returns them as gradients
        flax_state, y0, grads0 = flax_step(flax_state, x, t)
        params, sites, opt_state, y1, grads1 = jdls_step(params, sites, opt_state, x, t)
        assert_bitwise_equal(y1, y0)
        assert_bitwise_equal(grads1, grads0)
        for layer, dots in flax_state.params[fp8_ops.OVERWRITE_WITH_GRADIENT].items():
            (meta,) = dots.values()
            state, before = (s[layer]["DotGeneral_0"]["fp8"].value for s in (sites, used))
            for role, name in (("lhs", "input"), ("rhs", "kernel"), ("grad", "output_grad")):
                assert_bitwise_equal(getattr(before, role).scale, meta[f"{name}_scale"][0])
                assert_bitwise_equal(getattr(state, role).history, meta[f"{name}_amax_history"])


# --------------------------------------------------------------------------------------------
# Skip-awareness: Flax's failures reproduced, and jdls's behaviour on the same inputs.
# --------------------------------------------------------------------------------------------


def _amaxes():
    return [1.0, 1.0, 1.0, float("inf")] + [100.0] * 19


def _e5m2_scale(amax):
    """Flax's and jdls's scale for ``amax`` in float32: ``1 / (57344 / amax)``."""
    return float(np.float32(1.0) / (np.float32(57344.0) / np.float32(amax)))


def test_flax_freezes_the_scale_for_a_window_after_an_inf():
    """Flax keeps the pre-inf scale while the inf is in the history (16 steps of 16)."""
    length, e5 = 16, jnp.float8_e5m2
    scale, history = jnp.ones((1,), jnp.float32), jnp.zeros((length,), jnp.float32)
    used = []
    for a in _amaxes():
        scale, history = fp8_ops.update_fp8_meta(jnp.full((4,), a), e5, scale, history)
        used.append(float(scale[0]))
    # update_fp8_meta returns the scale step t quantizes with: steps 4 to 19, while the true
    # amax is 100, keep amax 1's scale (100x saturation); step 20, when the inf has left the
    # window, tracks the amax again.
    assert used[4:20] == [_e5m2_scale(1.0)] * 16
    assert used[20:] == [_e5m2_scale(100.0)] * 3


def test_jdls_scale_follows_the_amax_one_step_after_an_inf():
    """The inf does not enter the history: the first finite step after it sets the scale."""
    recipe = fp8.DelayedScaling(history_length=16)
    state = recipe.init("grad")
    used = []
    for a in _amaxes():
        used.append(float(state.scale))
        m = fp8.Measurement(jnp.float32(a), jnp.float32(0), jnp.float32(0))
        state = recipe.update(state, m, "grad", jnp.bool_(not np.isfinite(a)))
    # used[t] is the scale of step t. Step 4, the first after the inf, has only amax 1 in
    # its history (delayed scaling always lags a jump by a step); step 5 tracks amax 100.
    assert used[3:5] == [_e5m2_scale(1.0)] * 2
    assert used[5:] == [_e5m2_scale(100.0)] * 18


def test_flax_launders_an_inf_cotangent_into_finite_gradients():
    meta = _flax_meta(4)
    x, w, ct = _inputs(0, jnp.float32)
    ct = ct.at[0, 0].set(jnp.inf)
    _, dx, dw, _ = _flax_step("direct", x, w, ct, meta, jnp.float32)
    assert bool(jnp.all(jnp.isfinite(dx))) and bool(jnp.all(jnp.isfinite(dw)))


@pytest.mark.parametrize("recipe", [fp8.DelayedScaling(4), fp8.CurrentScaling()], ids=str)
@pytest.mark.parametrize("where", ["lhs", "rhs", "grad"])
@pytest.mark.parametrize("bad", [float("inf"), float("nan")])
@with_and_without_jit
@pytest.mark.full(keep=1)
def test_an_inf_or_nan_at_a_quantize_point_reaches_the_gradients(recipe, where, bad, jit):
    x, w, ct = _inputs(1, jnp.float32)
    x = x.at[0, 0].set(bad) if where == "lhs" else x
    w = w.at[0, 0].set(bad) if where == "rhs" else w
    ct = ct.at[0, 0].set(bad) if where == "grad" else ct
    y, dx, dw, site = maybe_jit(_jdls_step, jit)(x, w, ct, fp8.init(recipe))
    grads_finite = bool(jnp.all(jnp.isfinite(dx))) and bool(jnp.all(jnp.isfinite(dw)))
    assert not grads_finite
    assert float(getattr(site.value.meter, where).amax) == np.inf
    if where != "grad":
        assert not bool(jnp.all(jnp.isfinite(y)))


def test_jdls_wrap_skips_a_step_whose_fp8_gradient_overflowed():
    site = fp8.init(fp8.DelayedScaling(4))
    x, w, ct = _inputs(2, jnp.float32)
    ct = ct.at[1, 1].set(jnp.inf)
    _, _, dw, _ = _jdls_step(x, w, ct, site)
    tx = jdls.wrap(optax.sgd(0.1), jdls.StaticScale(1.0))
    opt_state = tx.init(w)
    _, opt_state = tx.update(dw, opt_state, w)
    assert int(jdls.stats(opt_state).skipped_steps) == 1


# --------------------------------------------------------------------------------------------
# Telemetry and the recipes' arithmetic.
# --------------------------------------------------------------------------------------------


def test_measurement_counts_saturated_and_flushed_values():
    recipe = fp8.DelayedScaling(4)
    state = recipe.init("lhs")  # scale 1: e4m3 saturates above 448, flushes below 2**-10
    x = jnp.array([1000.0, -500.0, 1.0, 2.0**-12, 0.0, 3.0, 2.0**-11, -(2.0**-20)])
    q, m = recipe.quantize(x, state, "lhs")
    assert float(m.amax) == 1000.0
    assert float(m.saturated) == 2 / 8
    # over all 8 values, the zero included (not 3 / 7 of the non-zero ones, docs/fp8.md)
    assert float(m.flushed) == 3 / 8  # 2**-12, 2**-11 (a tie, to even: 0), -2**-20
    assert q.values.astype(jnp.float32).tolist()[:3] == [448.0, -448.0, 1.0]


@pytest.mark.parametrize(
    ("role", "formats", "kept", "changed"),
    [
        # e4m3fn: 448 = 1.110b x 2**8, spacing 32: up to the tie 464 (to even: 448) unchanged
        ("lhs", "hybrid", [448.00003, 460.0, 464.0], [464.0001, 500.0]),
        # e5m2: 57344 = 1.11b x 2**15 (odd), spacing 8192: the tie 61440 rounds away
        ("grad", "hybrid", [57344.004, 61439.996], [61440.0, 70000.0]),
        # e4m3fnuz: 240 = 1.111b x 2**7 (odd), spacing 16: the tie 248 rounds away
        ("lhs", "fnuz", [240.00002, 247.99998], [248.0, 300.0]),
    ],
)
def test_saturated_counts_only_the_values_the_clip_changed(role, formats, kept, changed):
    """A value above the format's maximum that rounds to it anyway (``x / scale`` one float32
    ulp above ``fmax``, as current scaling gives) is not saturated: the clip changed nothing.
    Each value's quantization with and without the clip shows which."""
    recipe = fp8.DelayedScaling(4, formats=formats)
    fmt = recipe.formats.backward if role == "grad" else recipe.formats.forward
    fmax = fp8.format_max(fmt)
    for value in kept + changed:
        _, m = recipe.quantize(jnp.array([value], jnp.float32), recipe.init(role), role)
        rounds_to_fmax = float(np.float32(value).astype(fmt).astype(np.float32)) == fmax
        assert rounds_to_fmax == (value in kept), value
        assert float(m.saturated) == (0.0 if value in kept else 1.0), value


@pytest.mark.parametrize("algorithm", ["max", "most_recent"])
@pytest.mark.parametrize("margin", [0, 1, 3])
def test_transformer_engine_preset_follows_te_formulas(algorithm, margin):
    """TE: history[0] = amax; sf = (fmax / amax) / 2**margin from max(history) or history[0],
    keeping the old sf for amax <= 0 or non-finite; roll(-1) then history[0] = 0."""
    length, fmax = 5, np.float32(448.0)
    recipe = fp8.transformer_engine(length, algorithm, margin)
    state = recipe.init("lhs")
    te_history, te_sf = np.zeros(length, np.float32), np.float32(1.0)
    rng = np.random.default_rng(0)
    for step in range(30):
        amax = np.float32(10.0 ** rng.uniform(-3, 3)) if step % 7 else np.float32(0.0)
        te_history[0] = amax
        chosen = te_history.max() if algorithm == "max" else te_history[0]
        sf = (fmax / chosen) / np.float32(2.0**margin) if chosen > 0 else te_sf
        te_sf = np.float32(sf) if np.isfinite(sf) else te_sf
        te_history = np.roll(te_history, -1)
        te_history[0] = 0.0
        m = fp8.Measurement(jnp.float32(amax), jnp.float32(0), jnp.float32(0))
        state = recipe.update(state, m, "lhs")
        assert float(state.scale) == float(np.float32(1.0) / te_sf)


def test_power_of_two_scales_round_the_factor_down():
    scale = fp8.scale_from_amax(jnp.float32(3.0), jnp.float32(1.0), 448.0, power_of_two=True)
    assert float(scale) == 2.0**-7  # 448 / 3 = 149.3 -> 128
    scale = fp8.scale_from_amax(jnp.float32(3.0), jnp.float32(1.0), 448.0, 2, True)
    assert float(scale) == 2.0**-5  # 149.3 / 4 = 37.3 -> 32


def test_a_tiny_amax_keeps_the_previous_scale():
    """Flax's factor overflows to inf for amax below fmax / f32max (scale 0, then NaN)."""
    scale = fp8.scale_from_amax(jnp.float32(1e-40), jnp.float32(0.25), 448.0)
    assert float(scale) == 0.25


@pytest.mark.parametrize(
    "formats", ["hybrid", "e4m3", "fnuz", "e4m3fnuz", fp8.Formats(jdls.FloatFormat(4, 3), "e5m2")]
)
@with_and_without_jit
@pytest.mark.full
def test_dot_equals_the_float32_dot_of_the_quantized_values(formats, jit):
    """With power-of-two scales the FP8 dot and its gradients are exactly the float32 dots of
    the dequantized values (general dimension numbers: batch and two contracted axes)."""
    recipe = fp8.CurrentScaling(power_of_two=True, formats=formats)
    dn = (((2, 3), (1, 3)), ((0,), (0,)))
    k = jax.random.split(jax.random.key(3), 3)
    x = jax.random.normal(k[0], (2, 3, 4, 5))
    w = jax.random.normal(k[1], (2, 4, 6, 5)) * 30
    ct = jax.random.normal(k[2], (2, 3, 6)) * 1e-3

    def f(x, w, site):
        return fp8.dot_general(x, w, dn, site=site)

    y, vjp = jax.vjp(maybe_jit(f, jit), x, w, fp8.init(recipe))
    dx, dw, _ = vjp(ct)
    qx, _ = recipe.quantize(x, recipe.init("lhs"), "lhs")
    qw, _ = recipe.quantize(w, recipe.init("rhs"), "rhs")
    qg, _ = recipe.quantize(ct, recipe.init("grad"), "grad")
    hp = jax.lax.Precision.HIGHEST

    def ref(a, b):
        return jax.lax.dot_general(a, b, dn, precision=hp, preferred_element_type=jnp.float32)

    y_ref, ref_vjp = jax.vjp(ref, qx.dequantize(), qw.dequantize())
    dx_ref, dw_ref = ref_vjp(qg.dequantize())
    np.testing.assert_array_equal(y, y_ref)
    np.testing.assert_array_equal(dx, dx_ref)
    np.testing.assert_array_equal(dw, dw_ref)


def test_formats_parse_and_reject():
    assert fp8.Formats.parse("fnuz").forward == jnp.float8_e4m3fnuz
    with pytest.raises(ValueError, match="hybrid"):
        fp8.Formats.parse("e3m4")
    with pytest.raises(ValueError, match="FloatFormat"):
        fp8.Formats(jnp.float16)


def test_site_state_round_trips_through_pytrees_and_jit():
    site = fp8.init(fp8.DelayedScaling(8, "most_recent", margin=1, formats="e4m3"))
    leaves, treedef = jax.tree_util.tree_flatten(site)
    back = jax.tree_util.tree_unflatten(treedef, leaves)
    assert back.kind == site.kind
    assert jax.jit(lambda s: s)(site).kind == site.kind


@pytest.mark.parametrize(
    "recipe, size",
    [(fp8.CurrentScaling(), 48), (fp8.DelayedScaling(), 64), (fp8.AdaptiveScaling(), 80)],
    ids=["current", "delayed", "adaptive"],
)
def test_an_eager_dot_compiles_a_few_programs_and_a_jitted_one_inlines_them(recipe, size):
    # Op by op, one dot's value and gradients lowered 72 programs with CurrentScaling, 50 with
    # DelayedScaling and AdaptiveScaling (3 s the first time on a 2-core CPU). The shapes are
    # this test's own, so that no program is in JAX's in-memory caches.
    site = fp8.init(recipe)
    x, w, g = jnp.ones((3, size)), jnp.ones((size, 5)), jnp.ones((3, 5))

    def dot_and_grads(x, w, site):
        y, vjp = jax.vjp(lambda a, b, s: fp8.dot_general(a, b, DN, site=s), x, w, site)
        return y, vjp(g)

    assert programs_lowered(lambda: dot_and_grads(x, w, site)) <= 6
    # Inside a user's jit, the rules are inlined: the program holds the operations, as it
    # did before they were compiled apart, and no inner call.
    inner = inner_jits(dot_and_grads, x, w, site)
    assert inner and not inner & {"_forward", "_backward"}  # jax.numpy's own stay (clip, ...)
    eager, jitted = dot_and_grads(x, w, site), jax.jit(dot_and_grads)(x, w, site)
    assert_bitwise_equal(eager, jitted)


def test_dot_refuses_what_is_not_an_fp8_site():
    with pytest.raises(TypeError, match=r"jdls\.fp8\.init"):
        fp8.dot_general(jnp.ones((2, 2)), jnp.ones((2, 2)), DN, site=None)


@pytest.mark.parametrize("recipe_cls", [fp8.DelayedScaling, fp8.CurrentScaling])
def test_every_spelling_of_the_compute_dtype_is_one_recipe(recipe_cls):
    """jnp.bfloat16, "bfloat16" and np.dtype: one value, equal recipes, one compilation."""
    spellings = [jnp.bfloat16, "bfloat16", np.dtype(jnp.bfloat16)]
    recipes = [recipe_cls(compute_dtype=d) for d in spellings]
    assert all(r == recipes[0] and hash(r) == hash(recipes[0]) for r in recipes)
    assert all(type(r.compute_dtype) is type(np.dtype(jnp.bfloat16)) for r in recipes)
    assert recipe_cls(compute_dtype=None).compute_dtype is None
    traces = []

    @jax.jit
    def step(site, x):
        traces.append(1)
        loss = lambda s: jnp.sum(fp8.dot_general(x, x.T, DN, site=s))  # noqa: E731
        return jdls.update_sites(site, jax.grad(loss)(site))

    x = jnp.array([[1.0, -3.5]])
    outs = [step(fp8.init(r), x) for r in recipes]
    assert len(traces) == 1
    for out in outs[1:]:
        assert_bitwise_equal(out, outs[0])


def test_a_compute_dtype_that_is_not_a_dtype_says_what_to_pass():
    with pytest.raises(TypeError, match=r"compute_dtype must be a floating-point dtype: pass"):
        fp8.DelayedScaling(compute_dtype="int32")
    with pytest.raises(TypeError, match=r"not the emulated format .*formats="):
        fp8.CurrentScaling(compute_dtype=jdls.cbfloat16)
