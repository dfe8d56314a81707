"""``jdls.wrap_groups``: several optimizers, one scale; each group skips on its own gradients,
the scale backs off when any group overflowed. Checked step by step against PyTorch's own
multi-optimizer test (``test_grad_scaling_multiple``: two models, two optimizers, one
``GradScaler``, an inf in one optimizer's gradients)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _helpers import assert_bitwise_equal, maybe_jit, with_and_without_jit

import jdls


def linear_params(torch_model):
    """``Sequential(Linear, Linear)`` parameters as a list of ``{"w", "b"}`` (float32)."""
    return [
        {
            "w": jnp.asarray(layer.weight.detach().numpy()),
            "b": jnp.asarray(layer.bias.detach().numpy()),
        }
        for layer in torch_model
    ]


def forward(layers, x):
    for layer in layers:
        x = x @ layer["w"].T + layer["b"]
    return x


def mse(a, b):
    return jnp.mean((a - b) ** 2)


@pytest.mark.full
def test_matches_torch_grad_scaling_multiple():
    """torch's ``test_grad_scaling_multiple`` (test/test_cuda.py), on the CPU: the same models,
    data, losses, scaler (init 128, growth 2, interval 1) and injected inf, step by step."""
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)

    def model():
        return torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))

    model0, model1 = model(), model()
    data = [(torch.randn(8, 8), torch.randn(8, 8)) for _ in range(4)]
    skip_iter = 2
    opt0 = torch.optim.SGD(model0.parameters(), lr=1.0)
    opt1 = torch.optim.SGD(model1.parameters(), lr=1.0)
    scaler = torch.amp.GradScaler("cpu", init_scale=128.0, growth_factor=2.0, growth_interval=1)
    loss_fn = torch.nn.MSELoss()

    params = {"m0": linear_params(model0), "m1": linear_params(model1)}
    tx = jdls.wrap_groups(
        {"m0": optax.sgd(1.0), "m1": optax.sgd(1.0)},
        jdls.presets.pytorch(init_scale=128.0, growth_factor=2.0, growth_interval=1),
    )
    state = tx.init(params)

    def loss_jax(params, x, y):
        out0, out1 = forward(params["m0"], x), forward(params["m1"], x)
        return mse(0.3 * out0 + 0.7 * out1, y) + mse(0.6 * out0 - 0.4 * out1, y)

    @jax.jit
    def step(params, state, x, y, inject):
        _, grads = jdls.get_scale(state).value_and_grad(loss_jax)(params, x, y)
        w = grads["m1"][1]["w"]
        grads["m1"][1]["w"] = jnp.where(inject, jnp.full_like(w, jnp.inf), w)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    for i, (x, y) in enumerate(data):
        # torch, as in its test
        opt0.zero_grad()
        opt1.zero_grad()
        out0, out1 = model0(x), model1(x)
        loss0 = loss_fn(0.3 * out0 + 0.7 * out1, y)
        loss1 = loss_fn(0.6 * out0 - 0.4 * out1, y)
        scaler.scale(loss0).backward(retain_graph=True)
        scaler.scale(loss1).backward()
        if i == skip_iter:
            model1[1].weight.grad.data.fill_(float("inf"))
        scaler.unscale_(opt0)  # the test's "separately unscale for one optimizer"
        scaler.step(opt0)
        scaler.step(opt1)
        scaler.update()
        # jdls
        params, state = step(
            params, state, jnp.asarray(x.numpy()), jnp.asarray(y.numpy()), i == skip_iter
        )

        scale = jdls.get_scale(state)
        assert np.float32(scale.loss_scale).tobytes() == np.float32(scaler.get_scale()).tobytes()
        assert int(scale.state.counter) == int(scaler._get_growth_tracker())
        groups = jdls.group_stats(state)
        assert bool(groups["m0"].finite)
        assert bool(groups["m1"].finite) == (i != skip_iter)
        assert bool(jdls.stats(state).finite) == (i != skip_iter)
        for name, m in (("m0", model0), ("m1", model1)):
            for ours, theirs in zip(params[name], linear_params(m), strict=True):
                for k in ("w", "b"):
                    np.testing.assert_allclose(ours[k], theirs[k], rtol=1e-5, atol=1e-6)

    # torch's own assertion: grown three times, backed off once.
    assert scaler.get_scale() == 128.0 * 2.0**3 * 0.5
    assert float(jdls.get_scale(state).loss_scale) == 512.0
    assert int(jdls.group_stats(state)["m1"].skipped_steps) == 1
    assert int(jdls.group_stats(state)["m0"].skipped_steps) == 0


@with_and_without_jit
def test_each_group_skips_on_its_own_gradients(jit):
    tx = jdls.wrap_groups(
        {"gen": optax.adam(0.1), "disc": optax.sgd(0.5)}, jdls.DynamicScale(2.0**10)
    )
    params = {"gen": {"w": jnp.ones(3)}, "disc": {"w": jnp.ones(2), "b": jnp.zeros(1)}}
    state = tx.init(params)
    grads = {
        "gen": {"w": jnp.array([1.0, 2.0, 3.0])},
        "disc": {"w": jnp.array([jnp.nan, 1.0]), "b": jnp.ones(1)},
    }
    updates, new_state = maybe_jit(tx.update, jit)(grads, state, params)
    new_params = optax.apply_updates(params, updates)
    # The generator's step is exactly the one jdls.wrap(adam) alone takes.
    alone = jdls.wrap(optax.adam(0.1), jdls.DynamicScale(2.0**10))
    u, s = maybe_jit(alone.update, jit)(grads["gen"], alone.init(params["gen"]), params["gen"])
    assert_bitwise_equal(updates["gen"], u)
    assert_bitwise_equal(new_state.inner_state["gen"].inner_state, s.inner_state)
    # The discriminator is skipped: parameters and state bit for bit as they were.
    assert_bitwise_equal(new_params["disc"], params["disc"])
    assert_bitwise_equal(
        new_state.inner_state["disc"].inner_state, state.inner_state["disc"].inner_state
    )
    # One scale, backed off once.
    assert float(jdls.get_scale(new_state).loss_scale) == 2.0**9
    stats = jdls.stats(new_state)
    assert bool(stats.skipped) and int(stats.skipped_steps) == 1
    assert int(stats.cause) == jdls.SkipCause.GRADIENTS


def test_groups_stepped_in_turn_like_a_gan():
    """``scaler.step(opt_d); scaler.update()`` then ``scaler.step(opt_g); scaler.update()``:
    one group per update; the other group's state is untouched and has no say in the scale."""
    tx = jdls.wrap_groups(
        {"gen": optax.sgd(1.0), "disc": optax.sgd(1.0)}, jdls.DynamicScale(64.0, growth_interval=1)
    )
    params = {"gen": jnp.ones(2), "disc": jnp.ones(2)}
    state = tx.init(params)
    update = jax.jit(tx.update)
    u, state = update({"disc": jnp.array([jnp.inf, 0.0])}, state, {"disc": params["disc"]})
    assert list(u) == ["disc"] and u["disc"].tolist() == [-0.0, -0.0]
    assert float(jdls.get_scale(state).loss_scale) == 32.0
    u, state = update({"gen": jnp.ones(2)}, state, {"gen": params["gen"]})
    assert u["gen"].tolist() == [-1.0, -1.0]
    assert float(jdls.get_scale(state).loss_scale) == 64.0  # grew (interval 1)
    g = jdls.group_stats(state)
    assert int(g["disc"].skipped_steps) == 1 and int(g["gen"].skipped_steps) == 0


def test_accessors_and_errors():
    tx = jdls.wrap_groups(
        {"a": optax.sgd(0.1), "b": optax.sgd(0.1)}, jdls.DynamicScale(), max_norm=1.0
    )
    params = {"a": jnp.zeros(2), "b": jnp.zeros(2)}
    state = tx.init(params)
    assert float(jdls.get_scale(state).loss_scale) == 2.0**15
    state = jdls.set_scale(state, jdls.DynamicScale(8.0))
    assert float(jdls.get_scale(state).loss_scale) == 8.0
    u, _ = tx.update({"a": jnp.array([3.0, 4.0]), "b": jnp.zeros(2)}, state, params)
    np.testing.assert_allclose(np.asarray(u["a"]), [-0.06, -0.08], rtol=1e-6)  # clipped to 1
    with pytest.raises(ValueError, match="unknown: \\['c'\\]"):
        tx.update({"c": jnp.zeros(2)}, state, params)
    with pytest.raises(ValueError, match="missing: \\['b'\\]"):
        tx.init({"a": jnp.zeros(2)})
    with pytest.raises(TypeError, match="non-empty dict of optax transformations"):
        jdls.wrap_groups(optax.sgd(0.1))
    with pytest.raises(TypeError, match="does not support retries"):
        jdls.wrap_groups({"a": optax.sgd(0.1)}, jdls.DynamicScale(), retries=1)
    with pytest.raises(ValueError, match="not made by jdls.wrap_groups"):
        jdls.group_stats(jdls.wrap(optax.sgd(0.1), jdls.DynamicScale()).init(params))


@with_and_without_jit
def test_an_observing_rule_gets_the_groups_measurement(jit):
    """``AdaptiveScale`` over groups moves as under ``jdls.wrap`` with the same gradients (it
    used to stay at 1.0: the groups adjusted it without its measurement)."""
    params = {"a": {"w": jnp.zeros(2)}, "b": {"w": jnp.zeros(3)}}
    steps = [
        {"a": {"w": jnp.array([2.0**-20, 0.0])}, "b": {"w": jnp.array([0.0, 2.0**-22, 1e-9])}},
        {"a": {"w": jnp.array([1e-3, 0.0])}, "b": {"w": jnp.array([jnp.inf, 0.0, 0.0])}},
        {"a": {"w": jnp.array([1e-3, 1e-5])}, "b": {"w": jnp.array([3e-4, 0.0, 1.0])}},
    ]
    groups = jdls.wrap_groups({"a": optax.sgd(0.1), "b": optax.sgd(0.1)}, jdls.AdaptiveScale())
    single = jdls.wrap(optax.sgd(0.1), jdls.AdaptiveScale())
    g_state, s_state = groups.init(params), single.init(params)
    g_update, s_update = maybe_jit(groups.update, jit), maybe_jit(single.update, jit)
    for grads in steps:
        _, g_state = g_update(grads, g_state, params)
        _, s_state = s_update(grads, s_state, params)
        assert jdls.get_scale(g_state) == jdls.get_scale(s_state)
    assert float(jdls.get_scale(g_state).loss_scale) != 1.0
    # A group left out has no say: the measurement is the given group's.
    _, g_state = g_update({"a": {"w": jnp.array([2.0**-30, 0.0])}}, g_state, params)
    _, s_state = s_update(
        {"a": {"w": jnp.array([2.0**-30, 0.0])}, "b": {"w": jnp.zeros(3)}}, s_state, params
    )
    assert jdls.get_scale(g_state) == jdls.get_scale(s_state)


@with_and_without_jit
def test_an_observing_rule_over_groups_sees_the_backward_pass(jit):
    """Clipping in front of the groups: the rule sets the scale from the gradients the
    scale's ``value_and_grad`` returned, not the clipped ones, as under ``jdls.wrap``."""
    params = {"a": {"w": jnp.zeros(1)}, "b": {"w": jnp.zeros(1)}}

    def loss(p):  # gradient (300, 400): norm 500, largest 400
        return 300.0 * p["a"]["w"][0] + 400.0 * p["b"]["w"][0]

    def scale_after(tx):
        def step(state):
            _, grads = jdls.get_scale(state).value_and_grad(loss)(params)
            return tx.update(grads, state, params)[1]

        return float(jdls.get_scale(maybe_jit(step, jit)(tx.init(params))).loss_scale)

    clip = optax.clip_by_global_norm(1.0)
    groups = jdls.wrap_groups({"a": optax.sgd(0.1), "b": optax.sgd(0.1)})
    single = jdls.wrap(optax.sgd(0.1))
    # the largest 2**k with 400 * 2**k <= 65504 / 2**6 (the default margin): 2**1
    assert scale_after(optax.chain(clip, groups)) == scale_after(optax.chain(clip, single)) == 2.0


@with_and_without_jit
def test_nonfinite_paths_names_the_group_and_the_leaf(jit):
    tx = jdls.wrap_groups(
        {"gen": optax.sgd(0.1), "disc": optax.sgd(0.1)}, jdls.DynamicScale(), track_nonfinite=True
    )
    params = {"gen": {"w": jnp.zeros(2), "b": jnp.zeros(1)}, "disc": {"w": jnp.zeros(2)}}
    state = tx.init(params)
    assert jdls.nonfinite_paths(state) == []
    update = maybe_jit(tx.update, jit)
    grads = {
        "gen": {"w": jnp.ones(2), "b": jnp.array([jnp.nan])},
        "disc": {"w": jnp.array([jnp.inf, 0.0])},
    }
    _, state = update(grads, state, params)
    assert jdls.nonfinite_paths(state) == ["['disc']['w']", "['gen']['b']"]
    assert bool(jdls.group_stats(state)["disc"].nonfinite["w"])
    # Only the generator steps next: the discriminator's old flags do not linger.
    _, state = update({"gen": {"w": jnp.ones(2), "b": jnp.ones(1)}}, state, params)
    assert jdls.nonfinite_paths(state) == []
    without = jdls.wrap_groups({"gen": optax.sgd(0.1)}, jdls.DynamicScale())
    with pytest.raises(ValueError, match="track_nonfinite=True"):
        jdls.nonfinite_paths(without.init({"gen": {"w": jnp.zeros(1)}}))


@pytest.mark.full  # about 25 s; the quick run keeps the groups stepped in turn with sites
@with_and_without_jit
def test_groups_with_sites_from_accumulate_move_as_one_wrap(jit):
    """Sites among each group's parameters (a probe, an FP8 dot), the gradients from
    jdls.accumulate: the measurements are never counted as gradients (the observing default
    sets the scale as jdls.wrap does on the same gradients) and each group's sites take
    their new state through jdls.apply_updates, as under one wrap."""

    def group(w):
        return {
            "w": w,
            "probe": jdls.Site(jdls.Probe()),
            "dot": jdls.fp8.init(jdls.fp8.DelayedScaling(4)),
        }

    params = {"a": group(jnp.full((4, 3), 0.5)), "b": group(jnp.full((4, 3), -0.25))}

    def loss(p, x):
        total = 0.0
        for name in ("a", "b"):
            g = p[name]
            h = jdls.fp8.dot_general(x, g["w"], (((1,), (0,)), ((), ())), site=g["dot"])
            total = total + jnp.sum(jdls.apply_site(h, g["probe"]) ** 2)
        return total * 2.0**-10

    batches = jax.random.normal(jax.random.key(3), (3, 2, 4)) * 3.0

    def run(tx):
        p, state = params, tx.init(params)

        def step(p, state):
            _, grads, _ = jdls.accumulate(loss, jdls.get_scale(state), p, batches)
            updates, state = tx.update(grads, state, p)
            return jdls.apply_updates(p, updates, state), state

        step = maybe_jit(step, jit)
        for _ in range(3):
            p, state = step(p, state)
        return p, state

    got, g_state = run(jdls.wrap_groups({"a": optax.sgd(0.1), "b": optax.sgd(0.1)}))
    ref, s_state = run(jdls.wrap(optax.sgd(0.1)))
    assert jdls.get_scale(g_state) == jdls.get_scale(s_state)
    assert float(jdls.get_scale(g_state).loss_scale) > 2.0**10
    assert_bitwise_equal(got, ref)
    assert jdls.Telemetry.of(got).uses.tolist() == [1.0, 1.0]  # one use per micro-batch


def test_groups_stepped_in_turn_with_sites_and_sites_kept_from_the_wrap():
    """The GAN pattern with a probe in each group: the updates of the group stepped are
    applied with the whole parameters (the other group keeps its own); sites that no wrap
    saw (masked out of it) are refused with the fix named."""
    params = {
        "gen": {"w": jnp.ones(2), "probe": jdls.Site(jdls.Probe())},
        "disc": {"w": jnp.ones(2), "probe": jdls.Site(jdls.Probe())},
    }
    tx = jdls.wrap_groups({"gen": optax.sgd(0.5), "disc": optax.sgd(0.5)}, jdls.StaticScale(1.0))
    state = tx.init(params)

    def loss(p):
        return jnp.sum(jdls.apply_site(p["w"] * 3.0, p["probe"]) ** 2)

    grads = {"gen": jax.grad(loss)(params["gen"])}
    updates, state = tx.update(grads, state, params)
    new = jdls.apply_updates(params, updates, state)
    assert jdls.Telemetry.of(new["gen"]).amax.tolist() == [6.0]
    assert_bitwise_equal(new["disc"], params["disc"])
    assert new["gen"]["w"].tolist() == [-8.0, -8.0]  # 1 - 0.5 * 18

    sites_out = optax.masked(jdls.wrap(optax.sgd(0.5)), {"w": True, "probe": False})
    p = params["gen"]
    s = sites_out.init(p)
    u, s = sites_out.update(jax.grad(loss)(p), s, p)
    with pytest.raises(ValueError, match=r"no jdls.wrap in the optimizer state saw them"):
        jdls.apply_updates(p, u, s)
