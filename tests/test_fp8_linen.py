"""jdls.fp8 in Flax linen: Dense / DenseGeneral / Einsum, Flax parity, nn.scan and nn.remat."""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _helpers import assert_bitwise_equal
from flax.linen import fp8_ops

import jdls
from jdls import fp8

LENGTH = 4


def _batch(step):
    k = jax.random.split(jax.random.key(100 + step), 2)
    x = jax.random.normal(k[0], (8, 16)) * 10.0 ** (step % 3 - 1)
    return x, jax.random.normal(k[1], (8, 4))


class _Mlp(nn.Module):
    dot: object

    @nn.compact
    def __call__(self, x):
        x = nn.Dense(32, dot_general_cls=self.dot)(x)
        x = nn.gelu(x)
        return nn.DenseGeneral(4, dot_general_cls=self.dot)(x)


def _mse(y, t):
    return jnp.mean((y - t) ** 2)


@pytest.mark.parametrize("op", ["direct", "nanoo"])
@pytest.mark.full
def test_dense_trains_bit_identically_to_flax_fp8_ops(op):
    """Ten SGD steps of a two-layer MLP: the parameters, FP8 scales and histories of
    jdls.fp8.linen.DotGeneral with the Flax preset equal Flax's own FP8 op's, bit for bit."""
    flax_op = {"direct": fp8_ops.Fp8DirectDotGeneralOp, "nanoo": fp8_ops.NANOOFp8DotGeneralOp}
    flax_model = _Mlp(functools.partial(flax_op[op], amax_history_length=LENGTH))
    recipe = fp8.flax_fp8_ops(LENGTH, op=op)
    jdls_model = _Mlp(functools.partial(fp8.linen.DotGeneral, recipe=recipe))
    x, _ = _batch(0)
    flax_vars = flax_model.init(jax.random.key(0), x)
    jdls_vars = jdls_model.init(jax.random.key(0), x)
    assert_bitwise_equal(jdls_vars["params"], flax_vars["params"])
    owg = fp8_ops.OVERWRITE_WITH_GRADIENT

    @jax.jit
    def flax_step(variables, x, t):
        grads = jax.grad(lambda v: _mse(flax_model.apply(v, x), t))(variables)
        params = jax.tree.map(lambda p, g: p - 0.1 * g, variables["params"], grads["params"])
        return {"params": params, owg: grads[owg]}

    @jax.jit
    def jdls_step(variables, x, t):
        grads = jax.grad(lambda v: _mse(jdls_model.apply(v, x), t))(variables)
        params = jax.tree.map(lambda p, g: p - 0.1 * g, variables["params"], grads["params"])
        return {"params": params, "jdls": jdls.update_sites(variables["jdls"], grads["jdls"])}

    for step in range(10):
        x, t = _batch(step)
        flax_vars = flax_step(flax_vars, x, t)
        jdls_vars = jdls_step(jdls_vars, x, t)
        assert_bitwise_equal(jdls_vars["params"], flax_vars["params"])
    for layer, flax_layer in flax_vars[owg].items():
        (flax_meta,) = flax_layer.values()  # the one FP8 op of the layer
        site = jdls_vars["jdls"][layer]["DotGeneral_0"]["fp8"].value
        for role, name in (("lhs", "input"), ("rhs", "kernel"), ("grad", "output_grad")):
            history = flax_meta[f"{name}_amax_history"]
            assert_bitwise_equal(getattr(site, role).history, history)


@pytest.mark.full
def test_einsum_equals_flax_fp8_einsum():
    x = jax.random.normal(jax.random.key(1), (2, 3, 8))
    w = jax.random.normal(jax.random.key(2), (8, 5))
    eq = "btd,df->btf"
    flax_op = fp8_ops.Fp8Einsum(amax_history_length=LENGTH)
    jdls_op = fp8.linen.Einsum(fp8.flax_fp8_ops(LENGTH))
    fv = flax_op.init(jax.random.key(0), eq, x, w)
    jv = jdls_op.init(jax.random.key(0), eq, x, w)
    owg = fp8_ops.OVERWRITE_WITH_GRADIENT
    for _ in range(3):
        y0, g0 = jax.value_and_grad(
            lambda v, x, w: jnp.sum(flax_op.apply(v, eq, x, w) ** 2), (0, 1, 2)
        )(fv, x, w)
        y1, g1 = jax.value_and_grad(
            lambda v, x, w: jnp.sum(jdls_op.apply(v, eq, x, w) ** 2), (0, 1, 2)
        )(jv, x, w)
        assert_bitwise_equal(y1, y0)
        assert_bitwise_equal(g1[1:], g0[1:])
        fv = {owg: g0[0][owg]}
        jv = {"jdls": jdls.update_sites(jv["jdls"], g1[0]["jdls"])}
        x = x * 3.0


class _Block(nn.Module):
    recipe: object

    @nn.compact
    def __call__(self, h, _):
        dot = functools.partial(fp8.linen.DotGeneral, recipe=self.recipe)
        return h + nn.Dense(h.shape[-1], dot_general_cls=dot)(jnp.tanh(h)), None


class _Stack(nn.Module):
    recipe: object
    layers: int = 3
    remat: bool = True

    @nn.compact
    def __call__(self, h):
        block = nn.remat(_Block) if self.remat else _Block
        scanned = nn.scan(
            block,
            variable_axes={"params": 0, "jdls": 0},
            split_rngs={"params": True},
            length=self.layers,
        )
        return scanned(self.recipe, name="blocks")(h, None)[0]


class _Unrolled(nn.Module):
    recipe: object
    layers: int = 3

    @nn.compact
    def __call__(self, h):
        for i in range(self.layers):
            h = _Block(self.recipe, name=f"b{i}")(h, None)[0]
        return h


@pytest.mark.full
def test_scanned_rematerialised_stack_has_one_site_per_layer():
    """nn.scan(nn.remat(block)) gives each layer its own site, exactly as unrolled layers."""
    recipe = fp8.DelayedScaling(LENGTH)
    stack, unrolled = _Stack(recipe), _Unrolled(recipe)
    h = jax.random.normal(jax.random.key(3), (4, 8))
    sv = stack.init(jax.random.key(0), h)
    site = sv["jdls"]["blocks"]["Dense_0"]["DotGeneral_0"]["fp8"]
    assert site.value.lhs.history.shape == (3, LENGTH)
    # the unrolled model with the same parameters, layer by layer
    kernels = sv["params"]["blocks"]["Dense_0"]

    def layer(tree, i):
        return jax.tree.map(lambda a: a[i], tree)

    uv = {
        "params": {f"b{i}": {"Dense_0": layer(kernels, i)} for i in range(3)},
        "jdls": {f"b{i}": {"Dense_0": {"DotGeneral_0": {"fp8": layer(site, i)}}} for i in range(3)},
    }

    def step(model, v, h):
        loss, grads = jax.value_and_grad(lambda v: jnp.sum(model.apply(v, h) ** 2))(v)
        return loss, grads, jdls.update_sites(v["jdls"], grads["jdls"])

    for _ in range(3):
        l0, _, sites0 = jax.jit(functools.partial(step, stack))(sv, h)
        l1, _, sites1 = jax.jit(functools.partial(step, unrolled))(uv, h)
        np.testing.assert_allclose(l0, l1, rtol=1e-6)
        s0 = sites0["blocks"]["Dense_0"]["DotGeneral_0"]["fp8"].value
        for i in range(3):
            s1 = sites1[f"b{i}"]["Dense_0"]["DotGeneral_0"]["fp8"].value
            np.testing.assert_allclose(s0.lhs.history[i], s1.lhs.history, rtol=1e-6)
            np.testing.assert_allclose(s0.grad.history[i], s1.grad.history, rtol=1e-6)
        sv = {"params": sv["params"], "jdls": sites0}
        uv = {"params": uv["params"], "jdls": sites1}
        h = h * 2.0
    rows = fp8.telemetry(sites0)
    assert len(rows["blocks/Dense_0/DotGeneral_0/fp8"]["lhs"]["amax"]) == 3


@pytest.mark.full  # about 8 s; the linen FP8 einsum and dict-state tests stay quick
def test_train_state_updates_fp8_sites_with_no_extra_line():
    """jdls.linen.TrainState: value_and_grad and apply_gradients, nothing FP8-specific; the
    FP8 state never reaches clipping, weight decay or the optimizer's state."""
    recipe = fp8.DelayedScaling(LENGTH)
    model = _Mlp(functools.partial(fp8.linen.DotGeneral, recipe=recipe))
    x, t = _batch(1)
    variables = model.init(jax.random.key(0), x)
    tx = jdls.wrap(
        optax.chain(optax.clip_by_global_norm(1e-3), optax.adamw(1e-3, weight_decay=0.5))
    )
    state = jdls.linen.TrainState.create(
        apply_fn=model.apply, params=variables["params"], tx=tx, sites=variables["jdls"]
    )

    @jax.jit
    def step(state, x, t):
        loss_fn = lambda v: _mse(state.apply_fn(v, x), t)  # noqa: E731
        loss, grads = state.value_and_grad(loss_fn)(state.variables)
        return state.apply_gradients(grads=grads), loss

    for i in range(3):
        x, t = _batch(i)
        state, _ = step(state, x, t)
        site = state.sites["Dense_0"]["DotGeneral_0"]["fp8"].value
        assert float(site.lhs.history[0]) == float(jnp.max(jnp.abs(x)))
    assert int(state.stats.skipped_steps) == 0
    # the optimizer's state is that of the parameters alone
    expected = jax.tree.structure(tx.init(variables["params"]))
    assert jax.tree.structure(state.opt_state) == expected
