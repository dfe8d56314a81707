"""``jdls.accumulate``: micro-batches checked (and retried) on their own inside one step; a bad
micro-batch drops only itself; the step is skipped past ``max_dropped``; and accumulation
across steps with ``jdls.wrap(optax.MultiSteps(...))``."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _helpers import assert_bitwise_equal, maybe_jit, tanh_stack, with_and_without_jit

import jdls


def loss_f32(params, batch):
    """A float32 loss: scaling by a power of two and unscaling is exact."""
    x, y = batch
    pred = jnp.tanh(x @ params["w"]) + params["b"]
    return jnp.mean((pred - y) ** 2)


def loss_f16(params, c):
    """``sum(w * c)`` in float16: overflows at ``2**15`` when ``c >= 2``, at ``2**14`` when
    ``c >= 4`` (as in tests/test_retry.py)."""
    w = params["w"].astype(jnp.float16)
    return jnp.sum((w * c.astype(jnp.float16)).astype(jnp.float32))


def micro_batches(k=5, seed=0):
    rng = np.random.default_rng(seed)
    xs = jnp.asarray(rng.standard_normal((k, 4, 3)).astype(np.float32))
    ys = jnp.asarray(rng.standard_normal((k, 4, 2)).astype(np.float32))
    return xs, ys


PARAMS = {"w": jnp.full((3, 2), 0.5), "b": jnp.zeros(2)}


def direct_mean(keep, xs, ys):
    """The mean gradient over the kept micro-batches, computed directly: the plain
    ``lax.scan`` of docs/guides/gradient-accumulation.md over those micro-batches only."""
    keep = jnp.asarray(list(keep))
    grad_fn = jdls.DynamicScale(2.0**15).value_and_grad(loss_f32)

    @jax.jit
    def mean(xs, ys, n):
        def add(total, batch):
            return jax.tree.map(jnp.add, total, grad_fn(PARAMS, batch)[1]), None

        zeros = jax.tree.map(jnp.zeros_like, PARAMS)
        total, _ = jax.lax.scan(add, zeros, (xs, ys))
        return jax.tree.map(lambda t: t / n, total)  # a runtime divisor: no reciprocal

    return mean(xs[keep], ys[keep], jnp.float32(len(keep)))


def loss_linear(params, x):
    """Gradients exactly ``x`` and ``2 x``: no rounding before the accumulation itself."""
    return jnp.sum(params["w"] * x) + jnp.sum(params["v"] * (2 * x))


@with_and_without_jit
def test_bad_micro_batch_drops_only_itself(jit):
    rng = np.random.default_rng(3)
    xs = rng.standard_normal((5, 3)).astype(np.float32)
    bad = xs.copy()
    bad[2, 1] = np.inf  # an inf in the data of micro-batch 2
    params = {"w": jnp.ones(3), "v": jnp.ones(3)}
    run = maybe_jit(
        lambda b: jdls.accumulate(loss_linear, jdls.DynamicScale(), params, b, max_dropped=1), jit
    )
    loss, grads, info = run(jnp.asarray(bad))
    assert int(info.kept) == 4 and int(info.dropped) == 1 and int(info.retries) == 0
    assert not bool(info.skip)
    assert np.asarray(info.kept_mask).tolist() == [True, True, False, True, True]
    # The mean over the kept micro-batches, computed directly: summed in order, divided by 4.
    total = np.zeros(3, np.float32)
    for i in (0, 1, 3, 4):
        total = total + xs[i]
    expected = total / np.float32(4)
    assert_bitwise_equal(grads, {"v": jnp.asarray(2 * expected), "w": jnp.asarray(expected)})
    losses = [float(loss_linear(params, xs[i])) for i in (0, 1, 3, 4)]
    np.testing.assert_allclose(float(loss), np.mean(losses), rtol=1e-6)
    # The dropped micro-batch is one overflow for the rule (the scale backs off once).
    assert float(info.scale.loss_scale) == 2.0**14


@with_and_without_jit
@pytest.mark.full(keep=1)
def test_dropping_equals_never_having_had_the_micro_batch(jit):
    """A model's loss: with a bad micro-batch dropped, ``accumulate`` gives bit for bit what it
    gives on the kept micro-batches alone, and the plain mean to float tolerance."""
    xs, ys = micro_batches()
    bad = xs.at[2, 1, 0].set(jnp.inf)
    run = maybe_jit(lambda s, b: jdls.accumulate(loss_f32, s, PARAMS, b, max_dropped=1)[1], jit)
    grads = run(jdls.DynamicScale(2.0**15), (bad, ys))
    keep = jnp.array([0, 1, 3, 4])
    assert_bitwise_equal(grads, run(jdls.DynamicScale(2.0**15), (xs[keep], ys[keep])))
    direct = direct_mean([0, 1, 3, 4], xs, ys)
    for k in PARAMS:
        np.testing.assert_allclose(np.asarray(grads[k]), np.asarray(direct[k]), rtol=1e-6)
    assert_bitwise_equal(
        jdls.accumulate(loss_f32, jdls.DynamicScale(), PARAMS, (xs, ys))[2].scale,
        jdls.DynamicScale(),
    )  # all finite: the scale is untouched


@with_and_without_jit
def test_tolerance_exceeded_skips_the_step(jit):
    xs, ys = micro_batches()
    bad = xs.at[1].set(jnp.nan).at[3].set(jnp.inf)  # two bad micro-batches
    tx = jdls.wrap(optax.sgd(0.1), jdls.DynamicScale())

    def step(params, opt_state, batches, max_dropped):
        scale = jdls.get_scale(opt_state)
        _, grads, info = jdls.accumulate(loss_f32, scale, params, batches, max_dropped=max_dropped)
        opt_state = jdls.set_scale(opt_state, info.scale)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, info

    step = maybe_jit(step, jit) if not jit else jax.jit(step, static_argnums=3)
    state = tx.init(PARAMS)
    new_params, new_state, info = step(PARAMS, state, (bad, ys), 1)
    assert int(info.dropped) == 2 and bool(info.skip)
    assert bool(jdls.stats(new_state).skipped)
    assert_bitwise_equal(new_params, PARAMS)
    # Two dropped micro-batches, the step skipped: two backoffs, one per overflow (the wrap's
    # skip stands for the second), as jdls.wrap(optax.MultiSteps(...)) fed them one by one.
    assert float(info.scale.loss_scale) == 2.0**14
    assert float(jdls.get_scale(new_state).loss_scale) == 2.0**13

    new_params, new_state, info = step(PARAMS, state, (bad, ys), 2)  # within the tolerance
    assert not bool(info.skip) and not bool(jdls.stats(new_state).skipped)
    expected = jax.tree.map(lambda p, g: p - 0.1 * g, PARAMS, direct_mean([0, 2, 4], xs, ys))
    for k in PARAMS:
        np.testing.assert_allclose(np.asarray(new_params[k]), np.asarray(expected[k]), rtol=1e-6)


@with_and_without_jit
def test_scale_caused_overflow_is_retried_not_dropped(jit):
    params = {"w": jnp.ones(3)}
    # Micro-batch 1 overflows at 2**15; four kept micro-batches: dividing by 4 is exact.
    cs = jnp.array([[0.5, 1.0, 0.5], [3.0, 1.0, 0.5], [0.25, 0.5, 0.75], [0.125, 0.5, 0.25]])
    scale = jdls.DynamicScale(2.0**15, growth_interval=100)
    run = maybe_jit(lambda s, b: jdls.accumulate(loss_f16, s, params, b, retries=2), jit)
    _, grads, info = run(scale, cs)
    assert int(info.kept) == 4 and int(info.dropped) == 0 and int(info.retries) == 1
    assert not bool(info.skip)
    # The retry settled at 2**14, which the next micro-batch uses too.
    assert float(info.scale.loss_scale) == 2.0**14 and int(info.scale.state.counter) == 0
    settled = jdls.DynamicScale(2.0**14, growth_interval=100)
    g = [
        jdls.DynamicScale(2.0**15).value_and_grad(loss_f16)(params, cs[0])[1],
        settled.value_and_grad(loss_f16)(params, cs[1])[1],
        settled.value_and_grad(loss_f16)(params, cs[2])[1],
        settled.value_and_grad(loss_f16)(params, cs[3])[1],
    ]
    g = [np.asarray(x["w"]) for x in g]  # summed in order and divided, in numpy float32
    expected = {"w": jnp.asarray((((g[0] + g[1]) + g[2]) + g[3]) / np.float32(4))}
    assert_bitwise_equal(grads, expected)

    # Without retries the same micro-batch is dropped.
    _, _, info = maybe_jit(lambda s, b: jdls.accumulate(loss_f16, s, params, b), jit)(scale, cs)
    assert int(info.dropped) == 1 and bool(info.skip)


@with_and_without_jit
def test_no_retry_at_the_rules_minimum(jit):
    """At its minimum the scale cannot go lower: a retry would recompute the same overflow,
    so the micro-batch is dropped at once, retries left unused."""
    params = {"w": jnp.ones(3)}
    cs = jnp.array([[0.5, 1.0, 0.5], [3.0, 1.0, 0.5]])  # the second overflows at 2**15
    floor = jdls.DynamicScale(2.0**15, min_loss_scale=2.0**15)
    run = maybe_jit(lambda s, b: jdls.accumulate(loss_f16, s, params, b, retries=3), jit)
    _, _, info = run(floor, cs)
    assert int(info.retries) == 0 and int(info.dropped) == 1
    # one binade above the minimum: one retry, at the minimum, which is finite there
    cs = jnp.array([[0.5, 0.5, 0.5], [1.5, 0.5, 0.5]])  # the second overflows at 2**16 only
    _, _, info = run(jdls.DynamicScale(2.0**16, min_loss_scale=2.0**15), cs)
    assert int(info.retries) == 1 and int(info.dropped) == 0


def test_forward_nan_micro_batch_is_never_retried():
    params = {"w": jnp.ones(3)}
    cs = jnp.array([[0.5, 1.0, 0.5], [jnp.nan, 1.0, 0.5]])
    _, _, info = jax.jit(
        lambda b: jdls.accumulate(
            loss_f16, jdls.DynamicScale(2.0**15), params, b, retries=3, max_dropped=1
        )
    )(cs)
    assert int(info.retries) == 0 and int(info.dropped) == 1
    assert float(info.scale.loss_scale) == 2.0**14  # one backoff, as a skipped step


def test_has_aux_returns_the_stacked_auxes():
    xs, ys = micro_batches(k=3)

    def loss_aux(params, batch):
        loss = loss_f32(params, batch)
        return loss, {"sq": loss * 2}

    (loss, aux), grads, _ = jax.jit(
        lambda b: jdls.accumulate(loss_aux, jdls.DynamicScale(), PARAMS, b, has_aux=True)
    )((xs, ys))
    assert aux["sq"].shape == (3,)
    np.testing.assert_allclose(float(loss) * 2, float(jnp.mean(aux["sq"])), rtol=1e-6)
    direct = direct_mean(range(3), xs, ys)
    for k in PARAMS:
        np.testing.assert_allclose(np.asarray(grads[k]), np.asarray(direct[k]), rtol=1e-6)


def test_inside_a_scan_over_steps_with_wrap():
    """A training loop as one ``lax.scan`` whose step accumulates: the same as a Python loop."""
    rng = np.random.default_rng(1)
    steps, k = 6, 3
    cs = rng.uniform(0.1, 0.9, (steps, k, 3)).astype(np.float32)
    cs[1, 2, 0] = 3.0  # scale-caused: retried
    cs[4, 0, 1] = np.inf  # bad data: dropped (tolerated)
    cs = jnp.asarray(cs)
    tx = jdls.wrap(optax.adam(0.05), jdls.DynamicScale(2.0**15, growth_interval=100))
    params = {"w": jnp.ones(3)}

    def step(carry, batches):
        p, s = carry
        _, grads, info = jdls.accumulate(
            loss_f16, jdls.get_scale(s), p, batches, retries=1, max_dropped=1
        )
        s = jdls.set_scale(s, info.scale)
        updates, s = tx.update(grads, s, p)
        return (optax.apply_updates(p, updates), s), (info.kept, info.retries)

    (p_scan, s_scan), (kept, tries) = jax.lax.scan(step, (params, tx.init(params)), cs)
    assert np.asarray(kept).tolist() == [3, 3, 3, 3, 2, 3]
    assert np.asarray(tries).tolist() == [0, 1, 0, 0, 0, 0]
    assert int(jdls.stats(s_scan).skipped_steps) == 0
    assert int(s_scan.inner_state[0].count) == steps  # no data step lost

    carry = (params, tx.init(params))
    jitted = jax.jit(step)
    for i in range(steps):
        carry, _ = jitted(carry, cs[i])
    np.testing.assert_allclose(np.asarray(carry[0]["w"]), np.asarray(p_scan["w"]), rtol=1e-6)
    assert float(jdls.get_scale(carry[1]).loss_scale) == float(jdls.get_scale(s_scan).loss_scale)


@pytest.mark.full
def test_multisteps_across_steps_skips_only_the_bad_micro_step():
    """``jdls.wrap(optax.MultiSteps(...))``: a bad micro-step is skipped and never enters the
    accumulator; the update is the mean of the finite micro-steps of the window."""
    xs, ys = micro_batches(k=4)
    tx = jdls.wrap(optax.MultiSteps(optax.sgd(0.1), every_k_schedule=3), jdls.DynamicScale())
    state = tx.init(PARAMS)

    @jax.jit
    def micro_step(params, state, batch):
        _, grads = jdls.get_scale(state).value_and_grad(loss_f32)(params, batch)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    params = PARAMS
    bad = (xs[1].at[0, 0].set(jnp.inf), ys[1])
    for batch in [(xs[0], ys[0]), bad, (xs[2], ys[2]), (xs[3], ys[3])]:
        params, state = micro_step(params, state, batch)
        assert all(bool(jnp.all(jnp.isfinite(a))) for a in jax.tree.leaves(state.inner_state))
    assert int(jdls.stats(state).skipped_steps) == 1
    # optax.MultiSteps keeps a running mean: acc + (g - acc) / n; mean of 0, 2, 3.
    g = [jax.grad(loss_f32)(PARAMS, (xs[i], ys[i])) for i in (0, 2, 3)]
    acc = jax.tree.map(jnp.zeros_like, PARAMS)
    for n, gi in enumerate(g, start=1):
        acc = jax.tree.map(lambda a, b, n=n: a + (b - a) / n, acc, gi)
    expected = jax.tree.map(lambda p, a: p - 0.1 * a, PARAMS, acc)
    for k in expected:
        np.testing.assert_allclose(np.asarray(params[k]), np.asarray(expected[k]), rtol=1e-6)


def test_errors_say_what_to_pass():
    xs, ys = micro_batches(k=3)
    with pytest.raises(ValueError, match="leading axis"):
        jdls.accumulate(loss_f32, jdls.DynamicScale(), PARAMS, (xs, ys[:2]))
    with pytest.raises(ValueError, match="retries=1 needs a scale that backs off"):
        jdls.accumulate(loss_f32, jdls.StaticScale(8.0), PARAMS, (xs, ys), retries=1)
    with pytest.raises(ValueError, match="max_dropped must be >= 0"):
        jdls.accumulate(loss_f32, jdls.DynamicScale(), PARAMS, (xs, ys), max_dropped=-1)
    with pytest.raises(TypeError, match="scale must be a jdls loss scale"):
        jdls.accumulate(loss_f32, 128.0, PARAMS, (xs, ys))


def test_multisteps_with_retries_recomputes_the_micro_step():
    """``jdls.retrying`` over ``jdls.wrap(optax.MultiSteps(...))``: a scale-caused overflow
    of one micro-step is retried before it reaches the accumulator."""
    tx = jdls.wrap(
        optax.MultiSteps(optax.sgd(1.0), every_k_schedule=2),
        jdls.DynamicScale(2.0**15, growth_interval=100),
    )
    params = {"w": jnp.ones(3)}
    state = tx.init(params)
    step = jdls.retrying(loss_f16, tx, retries=2)

    @jax.jit
    def micro_step(params, state, c):
        return step(params, state, c)[:2]

    params, state = micro_step(params, state, jnp.array([3.0, 1.0, 0.5]))  # retried once
    assert int(jdls.stats(state).retries) == 1 and bool(jdls.stats(state).finite)
    params, state = micro_step(params, state, jnp.array([1.0, 1.0, 0.5]))
    assert int(jdls.stats(state).skipped_steps) == 0
    # sgd(1.0) of the mean of the two micro-steps' gradients (exact in float16: c).
    assert params["w"].tolist() == [1.0 - 2.0, 0.0, 0.5]


def _per_layer_state(layers, scale):
    """A linen chain of ``layers`` with per-layer scales (``scale`` each), its TrainState
    (the wrap's scale a NoOpScale) and 3 float16 micro-batches of 4 rows."""
    import flax.linen as nn

    model = jdls.linen.layer_scales(nn.Sequential(layers), scale)
    xs = jax.random.normal(jax.random.key(1), (3, 4, 3)).astype(jnp.float16)
    variables = model.init(jax.random.key(0), xs[0])
    state = jdls.linen.TrainState.create(
        apply_fn=model.apply,
        params=variables["params"],
        sites=variables["jdls"],
        tx=jdls.wrap(optax.sgd(0.1), jdls.NoOpScale()),
    )
    return model, state, xs


@with_and_without_jit
@pytest.mark.full  # about 9 s; per-layer scales under accumulate: the dropped-micro-batch back-off test stays
def test_per_layer_scales_accumulate_through_the_state(jit):
    """A linen model with per-layer scales: the wrap's scale is a NoOpScale that cannot apply
    them, so accumulate refuses without ``value_and_grad`` and, given the state's, returns the
    mean of what the state's own step gives for each micro-batch, bit for bit; every layer
    measures its gradients (a layer measuring nothing would grow without bound)."""
    import flax.linen as nn

    model, state, xs = _per_layer_state([nn.Dense(16), nn.tanh, nn.Dense(1)], jdls.AdaptiveScale())

    def loss(v, x):
        return jnp.mean(model.apply(v, x) ** 2).astype(jnp.float32) * 2.0**-12

    with pytest.raises(ValueError, match="value_and_grad=state.value_and_grad"):
        jdls.accumulate(loss, state.scale, state.variables, xs)

    def step(state):
        _, grads, _ = jdls.accumulate(
            loss, state.scale, state.variables, xs, value_and_grad=state.value_and_grad
        )
        return grads

    grads = maybe_jit(step, jit)(state)

    def reference(state, n):  # the guide's plain lax.scan, a runtime divisor
        def add(total, x):
            grads = state.value_and_grad(loss)(state.variables, x)[1]["params"]
            return jax.tree.map(jnp.add, total, grads), None

        zeros = jax.tree.map(jnp.zeros_like, state.params)
        return jax.tree.map(lambda t: t / n, jax.lax.scan(add, zeros, xs)[0])

    total = maybe_jit(reference, jit)(state, jnp.float32(3.0))
    assert_bitwise_equal(grads["params"], total)
    state = state.apply_gradients(grads=grads)
    for name in ("layers_0", "layers_2"):
        value = state.sites[name]["layer_scale"].value
        assert float(value["amax"]) > 0.0 and float(value["finite"]) == 1.0
        assert float(value["scale"].loss_scale) < 2.0**30
    with pytest.raises(ValueError, match="retries=0"):
        jdls.accumulate(
            loss, state.scale, state.variables, xs, retries=1, value_and_grad=state.value_and_grad
        )


def test_a_layer_that_overflowed_in_a_dropped_micro_batch_backs_off():
    """Per-layer scales with jdls.accumulate and max_dropped=1: the micro-batch whose layers
    overflowed is dropped from the mean and the step is taken, but the layers saw the
    overflow (their measurements are of every micro-batch): each backs off, as the global
    scale backs off for a dropped micro-batch, instead of overflowing again next step."""
    import flax.linen as nn

    layers = [nn.Dense(16, dtype=jnp.float16), nn.tanh, nn.Dense(1, dtype=jnp.float16)]
    model, state, xs = _per_layer_state(layers, jdls.DynamicScale(2.0**12))
    weights = jnp.array([1.0, 1000.0, 1.0])  # the second micro-batch overflows float16

    def loss(v, batch):
        x, weight = batch
        return jnp.mean(model.apply(v, x).astype(jnp.float32) ** 2) * weight

    @jax.jit
    def step(state):
        _, grads, info = jdls.accumulate(
            loss,
            state.scale,
            state.variables,
            (xs, weights),
            value_and_grad=state.value_and_grad,
            max_dropped=1,
        )
        return state.apply_gradients(grads=grads), info

    new, info = step(state)
    assert int(info.dropped) == 1 and bool(new.stats.finite)  # the step was taken
    for name in ("layers_0", "layers_2"):
        value = new.sites[name]["layer_scale"].value
        assert float(value["finite"]) == 0.0
        assert float(value["scale"].loss_scale) == 2.0**11


def test_a_probe_over_micro_batches_reads_as_the_step():
    """A probe used once per micro-batch: one use, the step's largest magnitude, the counts
    of every micro-batch (not a NaN amax over 3 uses)."""
    sites = {"h": jdls.Site(jdls.Probe())}
    xs = jnp.array([[1.0, -2.0], [0.5, 4.0], [3.0, 0.0]])

    def loss(p, x):
        return jnp.sum(jdls.apply_site(p["w"] * x, p["h"]) ** 2)

    params = {"w": jnp.ones(2), **sites}
    _, grads, _ = jax.jit(lambda p: jdls.accumulate(loss, jdls.StaticScale(1.0), p, xs))(params)
    t = jdls.Telemetry.of({"h": grads["h"]})
    assert t.uses.tolist() == [1.0] and t.amax.tolist() == [8.0]  # 2 * 4.0
    np.testing.assert_allclose(t.zeros, [1.0 / 6.0], rtol=1e-6)  # one zero of the 6 values


def test_accumulating_needs_less_than_a_gradient_buffer_more_than_a_plain_scan():
    """Each micro-batch's check is a largest magnitude and a sum of squares beside the sum,
    not a ``lax.cond`` holding the gradients: the compiled step holds less than one gradient
    buffer more than a plain ``lax.scan`` summing unchecked gradients (here 0.33 at jax
    0.10.2 and 0.71 at the floors' jax 0.8.1; at 0.10.2, 1.50 with the exact-overflow branch in
    the scan)."""

    loss, params, gradient_buffer = tanh_stack()
    tx = jdls.wrap(optax.adam(1e-3), jdls.DynamicScale(2.0**10))
    xs = jnp.ones((4, 64, 256))

    def plain(params, state, xs):
        scale = jdls.get_scale(state)

        def body(total, x):
            return jax.tree_util.tree_map(
                jnp.add, total, scale.value_and_grad(loss)(params, x)
            ), None

        zeros = (jnp.float32(0), jax.tree_util.tree_map(jnp.zeros_like, params))
        (value, grads), _ = jax.lax.scan(body, zeros, xs)
        updates, state = tx.update(jax.tree_util.tree_map(lambda g: g / 4, grads), state, params)
        return optax.apply_updates(params, updates), state, value / 4

    def accumulated(params, state, xs):
        value, grads, info = jdls.accumulate(loss, jdls.get_scale(state), params, xs)
        updates, state = tx.update(grads, jdls.set_scale(state, info.scale), params)
        return optax.apply_updates(params, updates), state, value

    def temporaries(step):
        compiled = jax.jit(step, donate_argnums=(0, 1)).lower(params, tx.init(params), xs).compile()
        return compiled.memory_analysis().temp_size_in_bytes

    extra = (temporaries(accumulated) - temporaries(plain)) / gradient_buffer
    assert extra < 1.0, f"{extra:.2f} gradient buffers more than the plain scan"


@with_and_without_jit
def test_an_inf_measurement_beside_finite_gradients_drops_nothing(jit):
    """A measurement is never a gradient: a probe on the input, whose cotangent (``w`` times the
    scale) overflows float32 while the gradient of ``w`` (``x`` times the scale) does not,
    records inf; no micro-batch is dropped for it, and the step is taken, as the wrap
    decides from the gradients alone."""
    params = {"w": jnp.full(2, 1e37), "x": jdls.Site(jdls.Probe())}
    xs = jnp.array([[1.0, 2.0], [3.0, 4.0]])

    def loss(p, x):
        return jnp.sum(p["w"] * jdls.apply_site(x, p["x"]))

    def step(p):
        return jdls.accumulate(loss, jdls.StaticScale(64.0), p, xs)

    _, grads, info = maybe_jit(step, jit)(params)
    assert int(info.kept) == 2 and not bool(info.skip)
    assert grads["w"].tolist() == [2.0, 3.0]  # the mean of the two micro-batches' inputs
    assert jdls.Telemetry.of({"x": grads["x"]}).amax.tolist() == [np.inf]


@pytest.mark.parametrize(
    "rule",
    [
        pytest.param(lambda: jdls.DynamicScale(2.0**10), id="dynamic"),
        pytest.param(lambda: jdls.presets.pytorch(), id="pytorch", marks=pytest.mark.full),
    ],
)
@pytest.mark.parametrize("retries", [0, pytest.param(2, marks=pytest.mark.full)])
def test_a_skipped_step_backs_off_once_per_overflow_as_multisteps(rule, retries):
    """Bad data in 1, 2 or all 4 micro-batches: the scale after the guide's step (accumulate,
    set_scale, the wrap's skip) is the scale after feeding the same micro-batches one by one
    to ``jdls.wrap(optax.MultiSteps(...))``, each bad one skipped: one back-off per overflow,
    the wrap's skip standing for the last (with the defaults, one per skipped step, as
    PyTorch's). Bad data is never retried: ``retries`` change nothing. (A rule that moves
    on finite steps, ``AdaptiveScale``, moves on MultiSteps' finite micro-steps too.)"""
    params = {"w": jnp.ones(2)}
    loss = lambda p, x: jnp.sum(p["w"] * x)  # noqa: E731
    clean = jnp.array([[1.0, 1.0], [2.0, 1.0], [3.0, 3.0], [1.0, 2.0]])

    @functools.partial(jax.jit, static_argnums=1)
    def accumulated(xs, max_dropped):
        tx = jdls.wrap(optax.sgd(0.1), rule())
        state = tx.init(params)
        _, grads, info = jdls.accumulate(
            loss, jdls.get_scale(state), params, xs, retries=retries, max_dropped=max_dropped
        )
        _, state = tx.update(grads, jdls.set_scale(state, info.scale), params)
        return jdls.get_scale(state).loss_scale, jdls.stats(state).skipped

    @jax.jit
    def multisteps(xs):
        tx = jdls.wrap(optax.MultiSteps(optax.sgd(0.1), every_k_schedule=4), rule())
        state = tx.init(params)
        for x in xs:  # the micro-batches at the scale each found, as accumulate's
            _, grads = jdls.get_scale(state).value_and_grad(loss)(params, x)
            _, state = tx.update(grads, state, params)
        return jdls.get_scale(state).loss_scale

    for bad, max_dropped in (([1], 0), ([0, 2], 1), ([0, 1, 2, 3], 4)):
        xs = clean.at[jnp.array(bad), 0].set(jnp.inf)
        got, skipped = accumulated(xs, max_dropped)
        assert bool(skipped)
        assert float(got) == float(multisteps(xs)) < float(rule().loss_scale), bad
