"""The NVFP4 recipe as a jdls.fp8 recipe: its three dots from the public pieces, stochastic
rounding's seed as site state (reproducible, advanced by applied steps only, independent per
layer and per device), skip-awareness, high-precision layers and every framework."""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _helpers import assert_bitwise_equal, closing_over_sites, maybe_jit, with_and_without_jit
from flax import serialization
from jax.sharding import PartitionSpec as P

import jdls
from jdls import fp8

DN = (((1,), (0,)), ((), ()))


def _operands(m=48, k=32, n=24, seed=0):
    k1, k2, k3 = jax.random.split(jax.random.key(seed), 3)
    x = jax.random.normal(k1, (m, k)) * jnp.exp(jax.random.normal(k3, (m, k)))
    w = jax.random.normal(k2, (k, n)) * 0.1
    return x, w


def _cotangent(m=48, n=24, seed=1):
    return jax.random.normal(jax.random.key(seed), (m, n)) * 1e-3


def _vjp(x, w, g, site):
    y, pull = jax.vjp(lambda x, w, s: fp8.dot_general(x, w, DN, site=s), x, w, site)
    dx, dw, measured = pull(g)
    return y, dx, dw, measured


@functools.partial(jax.jit, static_argnums=1)
def _qd(x, block):
    return fp8.dequantize_nvfp4(fp8.quantize_nvfp4(x, block))


@pytest.mark.parametrize(
    ("jit", "transform"),
    [
        pytest.param(True, True, marks=pytest.mark.full, id="jit-rht"),
        pytest.param(True, False, marks=pytest.mark.full, id="jit-no_rht"),
        # eagerly, without the transform only: the transform's eager case took 89 s
        pytest.param(False, False, marks=pytest.mark.full, id="eager-no_rht"),
    ],
)
def test_three_dots_are_the_public_pieces(jit, transform):
    """Forward: activations in 1x16 blocks along K, the weight in 16x16 tiles; input
    gradient: the output gradient along N and the same weight tiles; weight gradient: both
    inputs along the tokens, after the Hadamard transform (rounding to nearest here)."""
    x, w = _operands()
    g = _cotangent()
    site = fp8.init(fp8.nvfp4(stochastic_rounding=False, hadamard=transform))
    y, dx, dw, _ = maybe_jit(_vjp, jit)(x, w, g, site)
    hp = jax.lax.Precision.HIGHEST
    wq = _qd(w, (16, 16))
    xt, gt = (fp8.hadamard(x, 0), fp8.hadamard(g, 0)) if transform else (x, g)
    expected = [
        jnp.dot(_qd(x, (1, 16)), wq, precision=hp),
        jnp.dot(_qd(g, (1, 16)), wq.T, precision=hp),
        jnp.dot(_qd(xt, (16, 1)).T, _qd(gt, (16, 1)), precision=hp),
    ]
    for got, want in zip((y, dx, dw), expected, strict=True):
        # the same products; only the float32 accumulation order may differ
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-6 * float(jnp.max(jnp.abs(want))))


@pytest.mark.full
def test_weight_tiles_are_one_weight_in_both_dots():
    """A 16x16 tile is a tile of the transpose: the forward and the input-gradient dot see
    the same weight, bit for bit; 1x16 blocks along the two axes differ."""
    w = _operands(k=40, n=56)[1]
    assert_bitwise_equal(_qd(w, (16, 16)).T, _qd(w.T, (16, 16)))
    assert not np.array_equal(_qd(w, (16, 1)), _qd(w, (1, 16)))


@pytest.mark.full
def test_hadamard_leaves_a_dot_unchanged_and_pads_the_tokens():
    x, g = _operands(m=40)[0], _cotangent(m=40)
    xt, gt = fp8.hadamard(x, 0), fp8.hadamard(g, 0)
    assert xt.shape == (48, 32)
    np.testing.assert_allclose(xt.T @ gt, x.T @ g, rtol=2e-5, atol=1e-7)


@with_and_without_jit
@pytest.mark.full  # about 6 s; tests/test_nvfp4.py keeps stochastic rounding bit for bit
def test_stochastic_rounding_is_reproducible_and_seeded(jit):
    x, w = _operands()
    g = _cotangent()
    vjp = maybe_jit(_vjp, jit)
    a = fp8.init(fp8.nvfp4(), key=jax.random.key(0))
    b = fp8.init(fp8.nvfp4(), key=jax.random.key(1))
    _, dx_a, dw_a, _ = vjp(x, w, g, a)
    _, dx_a2, dw_a2, _ = vjp(x, w, g, a)
    _, dx_b, dw_b, _ = vjp(x, w, g, b)
    assert_bitwise_equal((dx_a, dw_a), (dx_a2, dw_a2))
    assert not np.array_equal(dx_a, dx_b) and not np.array_equal(dw_a, dw_b)
    # Without stochastic rounding the seed changes nothing.
    off = functools.partial(fp8.nvfp4, stochastic_rounding=False)
    _, dx_c, _, _ = vjp(x, w, g, fp8.init(off(), key=jax.random.key(0)))
    _, dx_d, _, _ = vjp(x, w, g, fp8.init(off(), key=jax.random.key(1)))
    assert_bitwise_equal(dx_c, dx_d)


@with_and_without_jit
@pytest.mark.full  # 7 s; a skipped NVFP4 step keeps its bits in the quick run
def test_the_step_advances_on_applied_steps_only(jit):
    """An applied step advances the bits; a skipped step keeps them, so a step redone after
    a skip draws the same bits."""
    x, w = _operands()
    g = _cotangent()
    vjp, update = maybe_jit(_vjp, jit), maybe_jit(jdls.update_sites, jit)
    site = fp8.init(fp8.nvfp4(), key=jax.random.key(3))
    _, dx0, _, measured = vjp(x, w, g, site)
    skipped = update(site, measured, jnp.asarray(False))
    applied = update(site, measured, jnp.asarray(True))
    assert float(skipped.value.grad.step) == 0.0 and float(applied.value.grad.step) == 1.0
    assert_bitwise_equal(skipped.value.grad.seed, site.value.grad.seed)
    assert_bitwise_equal(vjp(x, w, g, skipped)[1], dx0)
    assert not np.array_equal(vjp(x, w, g, applied)[1], dx0)


def test_a_non_finite_value_skips_the_step_and_keeps_the_bits():
    """A NaN in the forward operand (NaN block scale) or an inf in the output gradient
    reaches the gradients: jdls.wrap skips, the parameters and the site's step stay."""
    x, w = _operands()
    g = _cotangent()
    tx = jdls.wrap(optax.sgd(0.1))
    site = fp8.init(fp8.nvfp4(), key=jax.random.key(0))
    for bad_x, bad_g in [(x.at[3, 5].set(jnp.nan), g), (x, g.at[7, 2].set(jnp.inf))]:
        _, _, dw, measured = jax.jit(_vjp)(bad_x, w, bad_g, site)
        assert not bool(jnp.all(jnp.isfinite(dw)))
        state = tx.init(w)
        updates, state = tx.update(dw, state, w)
        finite = jdls.stats(state).finite
        assert not bool(finite)
        assert_bitwise_equal(optax.apply_updates(w, updates), w)
        new = jdls.update_sites(site, measured, finite)
        assert_bitwise_equal(new.value.grad.step, site.value.grad.step)


@pytest.mark.full
def test_a_nan_block_dequantizes_to_nan_and_leaves_the_others():
    x = jnp.ones((2, 32)).at[0, 3].set(jnp.nan)
    q = fp8.quantize_nvfp4(x)
    assert q.codes.tolist() == [[0x7F, 126], [126, 126]]
    d = fp8.dequantize_nvfp4(q)
    assert bool(jnp.all(jnp.isnan(d[0, :16]))) and bool(jnp.all(d[0, 16:] == 1.0))


@pytest.mark.full
def test_devices_draw_their_own_bits():
    """Inside shard_map, each device rounds its shard with its own bits: identical shards
    give different input gradients with stochastic rounding, the same without."""
    mesh = jax.make_mesh((2,), ("data",), devices=jax.devices()[:2])
    x, w = _operands(m=32)
    g = _cotangent(m=32)
    x2, g2 = jnp.concatenate([x, x]), jnp.concatenate([g, g])

    def dx_of(recipe):
        site = fp8.init(recipe, key=jax.random.key(0))

        def per_device(x, g):
            return _vjp(x, w, g, site)[1]

        spec = P("data")
        f = jax.shard_map(per_device, mesh=mesh, in_specs=(spec, spec), out_specs=spec)
        shard = jax.sharding.NamedSharding(mesh, spec)
        return np.asarray(jax.jit(f)(jax.device_put(x2, shard), jax.device_put(g2, shard)))

    dx = dx_of(fp8.nvfp4())
    assert not np.array_equal(dx[:32], dx[32:])
    dx = dx_of(fp8.nvfp4(stochastic_rounding=False))
    assert_bitwise_equal(dx[:32], dx[32:])


@with_and_without_jit
@pytest.mark.parametrize("high", ["bf16", pytest.param("fp8", marks=pytest.mark.full)])
def test_a_kept_dot_runs_in_high_precision(jit, high):
    x, w = _operands()
    g = _cotangent()
    site = fp8.init(fp8.nvfp4(high_precision=high))
    kept = fp8.keep_high_precision({"d": site}, ["d"])["d"]
    assert float(kept.value.grad.keep) == 1.0
    y, _, _, _ = maybe_jit(_vjp, jit)(x, w, g, kept)
    if high == "bf16":
        r = lambda v: v.astype(jnp.bfloat16).astype(jnp.float32)  # noqa: E731
        expected = jnp.dot(r(x), r(w), precision=jax.lax.Precision.HIGHEST)
        np.testing.assert_allclose(y, expected, rtol=1e-6)
    nvfp4_y = maybe_jit(_vjp, jit)(x, w, g, site)[0]
    err = lambda v: float(jnp.linalg.norm(v - x @ w) / jnp.linalg.norm(x @ w))  # noqa: E731
    assert err(y) < err(nvfp4_y) / 4


class _Block(nn.Module):
    recipe: fp8.NVFP4Scaling

    @nn.compact
    def __call__(self, x, _):
        dot = functools.partial(fp8.linen.DotGeneral, recipe=self.recipe)
        return x + nn.Dense(32, dot_general_cls=dot)(jnp.tanh(x)), None


class _Stack(nn.Module):
    recipe: fp8.NVFP4Scaling

    @nn.compact
    def __call__(self, x):
        scan = nn.scan(
            nn.remat(_Block),
            variable_axes={"params": 0, "jdls": 0},
            split_rngs={"params": True},
            length=4,
        )
        x, _ = scan(self.recipe, name="blocks")(x, None)
        return nn.Dense(1)(x)


@pytest.mark.full  # about 8 s
def test_scanned_linen_layers_own_seeds_rank_and_keep():
    """nn.scan(nn.remat) of NVFP4 layers: one seed per layer, the weight-gradient error per
    layer from telemetry, and the worst layer kept in bfloat16 through its site state."""
    model = _Stack(fp8.nvfp4(measure_error=True))
    x = jax.random.normal(jax.random.key(1), (64, 32))
    t = jnp.sum(x, -1, keepdims=True)
    variables = model.init(jax.random.key(0), x)
    seeds = variables["jdls"]["blocks"]["Dense_0"]["DotGeneral_0"]["fp8"].value.grad.seed
    assert len(set(np.asarray(seeds).tolist())) == 4
    state = jdls.linen.TrainState.create(
        apply_fn=model.apply,
        params=variables["params"],
        sites=variables["jdls"],
        tx=jdls.wrap(optax.adam(1e-3)),
    )

    @jax.jit
    def step(state):
        loss_fn = lambda v: jnp.mean((model.apply(v, x) - t) ** 2)  # noqa: E731
        loss, grads = jax.value_and_grad(loss_fn)(state.variables)
        return state.apply_gradients(grads=grads), loss

    state, _ = step(state)
    ranked = fp8.rank_layers(state.sites)
    assert [r.layer for r in ranked if r.path.startswith("blocks")] != []
    assert len(ranked) == 4 and all(0 < r.error < 1 for r in ranked)
    assert ranked[0].error >= ranked[-1].error
    chosen = fp8.suggest_high_precision(state.sites, 0.25)
    assert chosen == [ranked[0].name]
    sites = fp8.keep_high_precision(state.sites, chosen)
    keep = sites["blocks"]["Dense_0"]["DotGeneral_0"]["fp8"].value.lhs.keep
    assert keep.tolist() == [1.0 if i == ranked[0].layer else 0.0 for i in range(4)]
    state, loss = step(state.replace(sites=sites))
    assert bool(jnp.isfinite(loss))
    steps = state.sites["blocks"]["Dense_0"]["DotGeneral_0"]["fp8"].value.grad.step
    assert steps.tolist() == [2.0] * 4
    with pytest.raises(ValueError, match="no NVFP4 site at"):
        fp8.keep_high_precision(state.sites, [("blocks/Dense_1/DotGeneral_0/fp8", 0)])


def test_nnx_and_equinox_layers_draw_seeds_from_their_keys():
    from flax import nnx

    rngs = nnx.Rngs(0)
    a, b = fp8.nnx.DotGeneral(fp8.nvfp4(), rngs=rngs), fp8.nnx.DotGeneral(fp8.nvfp4(), rngs=rngs)
    seed = lambda d: float(d.site.get_value().value.grad.seed)  # noqa: E731
    assert seed(a) != seed(b)
    eqx_fp8 = pytest.importorskip("jdls.fp8.equinox")
    la = eqx_fp8.Linear(4, 2, recipe=fp8.nvfp4(), key=jax.random.key(0))
    lb = eqx_fp8.Linear(4, 2, recipe=fp8.nvfp4(), key=jax.random.key(1))
    assert float(la.site.value.grad.seed) != float(lb.site.value.grad.seed)


@pytest.mark.full
def test_state_survives_a_checkpoint_and_an_inexact_filter():
    """The state is float32 (restored by flax serialization, kept by a filter of inexact
    arrays); a state saved before measurements had ``error`` still restores."""
    site = fp8.init(fp8.nvfp4(), key=jax.random.key(5))
    x, w = _operands()
    measured = jax.jit(_vjp)(x, w, _cotangent(), site)[3]
    site = jax.jit(jdls.update_sites)(site, measured, jnp.asarray(True))
    saved = serialization.to_state_dict(site)
    restored = serialization.from_state_dict(fp8.init(fp8.nvfp4()), saved)
    assert_bitwise_equal(restored, site)
    assert all(jnp.issubdtype(v.dtype, jnp.inexact) for v in jax.tree.leaves(site))
    old = serialization.to_state_dict(fp8.init(fp8.DelayedScaling(4)))
    for meter in ("meter", "pending"):
        for role in ("lhs", "rhs", "grad"):
            del old["value"][meter][role]["error"]
    restored = serialization.from_state_dict(fp8.init(fp8.DelayedScaling(4)), old)
    assert float(restored.value.meter.grad.error) == 0.0


@pytest.mark.full
def test_float16_with_loss_scaling_trains():
    """float16 compute, a small loss weight, jdls's dynamic loss scale: the NVFP4 dots see
    the scaled gradient and the steps train."""
    x, w = _operands(m=64, k=32, n=16)
    t = x @ jax.random.normal(jax.random.key(9), (32, 16)) * 0.1
    site = fp8.init(fp8.nvfp4(), key=jax.random.key(0))
    tx = jdls.wrap(optax.adam(1e-2))
    opt_state = tx.init(w)

    def loss_fn(w, site):
        y = fp8.dot_general(x.astype(jnp.float16), w.astype(jnp.float16), DN, site=site)
        return jnp.mean((y.astype(jnp.float32) - t) ** 2) * 2.0**-10

    @jax.jit
    def step(w, site, opt_state):
        scale = jdls.get_scale(opt_state)
        loss, (gw, measured) = scale.value_and_grad(loss_fn, argnums=(0, 1))(w, site)
        updates, opt_state = tx.update(gw, opt_state, w)
        site = jdls.update_sites(site, measured, jdls.stats(opt_state).finite)
        return optax.apply_updates(w, updates), site, opt_state, loss

    losses = []
    for _ in range(30):
        w, site, opt_state, loss = step(w, site, opt_state)
        losses.append(float(loss))
    assert losses[-1] < 0.5 * losses[0]
    assert 0 < float(site.value.grad.step) <= 30


@pytest.mark.full
def test_a_retried_step_draws_the_bits_of_the_step_it_retries():
    """jdls.retrying recomputes an overflowing float16 step at a lower scale: params and
    sites equal, bit for bit, the step taken directly at that scale (same random bits)."""
    x = jax.random.normal(jax.random.key(2), (32, 16))

    def loss_fn(p, x):
        y = fp8.dot_general(x.astype(jnp.float16), p["w"].astype(jnp.float16), DN, site=p["dot"])
        return jnp.sum(y.astype(jnp.float32))

    params = {
        "w": jax.random.normal(jax.random.key(3), (16, 8)),
        "dot": fp8.init(fp8.nvfp4(), key=jax.random.key(4)),
    }

    def run(scale, retries):
        tx = jdls.wrap(optax.sgd(1e-3), jdls.DynamicScale(scale))
        step = jax.jit(jdls.retrying(loss_fn, tx, retries=retries))
        return step(params, tx.init(params), x)

    p1, s1, _ = run(2.0**15, 6)
    assert int(jdls.stats(s1).retries) >= 1 and bool(jdls.stats(s1).finite)
    settled = float(jdls.get_scale(s1).loss_scale)
    p2, s2, _ = run(settled, 0)
    assert int(jdls.stats(s2).retries) == 0 and bool(jdls.stats(s2).finite)
    assert_bitwise_equal(p1, p2)
    assert float(p1["dot"].value.grad.step) == 1.0


@pytest.mark.full
def test_accumulate_is_the_mean_of_the_micro_batches():
    """jdls.accumulate over NVFP4 dots: the weight gradient is the mean of the micro-batches'
    (each drawing the step's bits), the site's measurement their largest amax."""
    xs = jax.random.normal(jax.random.key(6), (3, 32, 16))
    p = {"w": jax.random.normal(jax.random.key(7), (16, 8)), "dot": fp8.init(fp8.nvfp4())}

    def loss_fn(p, x):
        return jnp.mean(jnp.tanh(fp8.dot_general(x, p["w"], DN, site=p["dot"])) ** 2)

    scale = jdls.NoOpScale()
    _, grads, _ = jax.jit(lambda p, xs: jdls.accumulate(loss_fn, scale, p, xs))(p, xs)
    each = [jax.jit(jax.grad(loss_fn))(p, x) for x in xs]
    mean = sum(g["w"] for g in each) / 3
    np.testing.assert_allclose(grads["w"], mean, rtol=1e-6, atol=1e-9)
    amaxes = [float(g["dot"].value.meter.grad.amax) for g in each]
    assert float(grads["dot"].value.meter.grad.amax) == max(amaxes)


@pytest.mark.parametrize(
    "recipe",
    [
        pytest.param(fp8.nvfp4(), marks=pytest.mark.full),
        pytest.param(fp8.mx(), marks=pytest.mark.full),
    ],
    ids=["nvfp4", "mx"],
)
def test_a_batch_sharded_on_an_explicit_mesh_trains_as_on_one_device(recipe):
    """jax.make_mesh's default (explicit) axes, the tokens sharded: blocks along the token
    axis stay on their devices, and the gradients are those of one device (the weight
    gradient to float32 rounding: its tokens are summed across devices)."""
    explicit = (jax.sharding.AxisType.Explicit,)  # jax.make_mesh's default from jax 0.9
    mesh = jax.make_mesh((4,), ("d",), devices=jax.devices()[:4], axis_types=explicit)
    x, w = _operands(m=128)
    c = _cotangent(m=128)

    def loss(x, w, site):
        return jnp.sum(fp8.dot_general(x, w, DN, site=site) * c)

    site = fp8.init(recipe, key=jax.random.key(0))
    grad = closing_over_sites(jax.jit(jax.grad(loss, argnums=(0, 1))))  # the site held fixed
    dx1, dw1 = grad(x, w, site)
    sharded = jax.device_put(x, jax.sharding.NamedSharding(mesh, P("d")))
    dx, dw = grad(sharded, w, site)
    assert_bitwise_equal(np.asarray(dx), np.asarray(dx1))
    np.testing.assert_allclose(
        np.asarray(dw), np.asarray(dw1), rtol=0, atol=1e-6 * float(jnp.abs(dw1).max())
    )


@pytest.mark.full
def test_nnx_state_is_ranked_and_kept():
    """The layer tools take an NNX state (the site inside its SiteVariable): keep a layer
    with nnx.update."""
    from flax import nnx

    recipe = fp8.nvfp4(measure_error=True)
    model = nnx.Linear(
        32, 16, dot_general=fp8.nnx.DotGeneral(recipe, rngs=nnx.Rngs(1)), rngs=nnx.Rngs(0)
    )
    x = jax.random.normal(jax.random.key(2), (32, 32))
    optimizer = jdls.nnx.Optimizer(model, jdls.wrap(optax.adam(1e-3)), wrt=nnx.Param)

    @nnx.jit
    def step(model, optimizer):
        loss = jdls.nnx.value_and_grad(lambda m: jnp.mean(m(x) ** 2), jdls.get_scale(optimizer))
        optimizer.update(model, loss(model)[1])

    step(model, optimizer)
    state = nnx.state(model, jdls.nnx.SiteVariable)
    ranked = fp8.rank_layers(state)
    assert [r.name for r in ranked] == [("dot_general/site", None)] and 0 < ranked[0].error < 1
    nnx.update(model, fp8.keep_high_precision(state, fp8.suggest_high_precision(state)))
    assert float(model.dot_general.site.get_value().value.rhs.keep) == 1.0


def test_keep_high_precision_names_a_wrong_layer():
    sites = {
        "blocks": fp8.init(fp8.nvfp4(), jax.random.key(0), stack=4),
        "head": fp8.init(fp8.nvfp4()),
    }
    kept = fp8.keep_high_precision(sites, ("blocks", -1))  # one name, not in a list
    assert kept["blocks"].value.lhs.keep.tolist() == [0.0, 0.0, 0.0, 1.0]
    for layer, match in [(4, "outside the stack of 4"), (-5, "outside"), (1.0, "must be an int")]:
        with pytest.raises(ValueError, match=match):
            fp8.keep_high_precision(sites, [("blocks", layer)])
    with pytest.raises(ValueError, match="is one NVFP4 site, not a stack"):
        fp8.keep_high_precision(sites, [("head", 0)])
    assert fp8.keep_high_precision(sites, "head")["head"].value.grad.keep.tolist() == 1.0
    with pytest.raises(TypeError, match="stochastic_rounding must be True or False"):
        fp8.nvfp4(stochastic_rounding="yes")
    with pytest.raises(ValueError, match="amax must be"):
        fp8.quantize_nvfp4(jnp.ones((2, 16)), amax=-1.0)


def test_signs_are_refused_not_rounded_as_the_transform_refuses_them():
    te = list(fp8.TE_SIGNS)
    # a float or NumPy vector of exact signs is taken, kept as the ints TE_SIGNS holds
    assert fp8.NVFP4Scaling(signs=np.asarray(te, np.float32)).signs == fp8.TE_SIGNS
    assert fp8.NVFP4Scaling(signs=[float(s) for s in te]) == fp8.nvfp4()
    assert fp8.NVFP4Scaling(signs=(1,) * 16).signs == (1,) * 16
    bad = [
        [1.5, *te[1:]],  # int(1.5) would be 1
        [True, *[s == 1 for s in te[1:]]],  # bools are not signs
        [True, *te[1:]],  # nor is one among ints (it would become 1 in an array)
        [*te[:3], np.bool_(True), *te[4:]],  # which would turn this -1 into +1
        ["1", *te[1:]],
        te[:15],
        [0, *te[1:]],
    ]
    for signs in bad:
        with pytest.raises(ValueError, match="signs must be 16 values, each \\+1 or -1"):
            fp8.NVFP4Scaling(signs=signs)
        with pytest.raises(ValueError, match="signs must be 16 values, each \\+1 or -1"):
            fp8.hadamard(jnp.ones((16, 2)), 0, signs=signs)
