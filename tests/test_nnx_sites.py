"""Sites in Flax NNX models: jdls.nnx.probes and per-layer scales on a stack of blocks made
with nnx.vmap and run with nnx.scan and nnx.remat, the sites updated by jdls.nnx.Optimizer,
compared with the same blocks called one by one."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _helpers import closing_over_sites
from flax import nnx

import jdls

DEPTH, WIDTH = 4, 8


class Block(nnx.Module):
    def __init__(self, rngs: nnx.Rngs, dtype=jnp.float16):
        self.linear = nnx.Linear(WIDTH, WIDTH, dtype=dtype, rngs=rngs)

    def __call__(self, h):
        return jnp.tanh(self.linear(h) + 1.0)


class Model(nnx.Module):
    def __init__(self, rngs: nnx.Rngs, dtype=jnp.float16, probes=False, scales=None):
        self.embed = nnx.Linear(4, WIDTH, dtype=dtype, rngs=rngs)

        @nnx.split_rngs(splits=DEPTH)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def create(rngs: nnx.Rngs) -> Block:
            block = Block(rngs, dtype)
            if probes:
                jdls.nnx.probes(block)  # inside the constructor: one probe per layer
            if scales is not None:
                jdls.nnx.layer_scale(block, scales, 1)  # the stack: position 1 of 3
            return block

        self.blocks = create(rngs)
        self.head = nnx.Linear(WIDTH, 1, dtype=dtype, rngs=rngs)
        if scales is not None:
            jdls.nnx.layer_scale(self.embed, scales, 0)
            jdls.nnx.layer_scale(self.head, scales, 2)

    def __call__(self, x, unrolled=False):
        h = self.embed(x)
        if unrolled:  # the reference: each block called by itself
            for i in range(DEPTH):
                h = _block(self.blocks, i)(h)
        else:

            @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
            @nnx.remat
            def forward(h, block):
                return block(h)

            h = forward(h, self.blocks)
        return self.head(h).astype(jnp.float32)


def _block(blocks: Block, i: int) -> Block:
    graphdef, state = nnx.split(blocks)
    return nnx.merge(graphdef, jax.tree_util.tree_map(lambda v: v[i], state))


def _x():
    return jax.random.normal(jax.random.key(1), (16, 4))


def loss_fn(model, x, unrolled=False):
    return jnp.mean(model(x, unrolled) ** 2)


@pytest.mark.full
def test_probes_in_a_vmapped_stack_run_by_scan_and_remat_give_a_row_per_layer() -> None:
    model = jdls.nnx.probes(Model(nnx.Rngs(0), probes=True))
    x = _x()
    scale = jdls.StaticScale(2.0**8)
    _, grads = nnx.jit(jdls.nnx.value_and_grad(loss_fn, scale))(model, x)
    t = jdls.Telemetry.of(nnx.state(grads, jdls.nnx.SiteVariable))
    layers = [n for i in range(DEPTH) for n in (f"blocks/linear[{i}]", f"blocks[{i}]")]
    assert t.names == ("embed", *layers, "head", "Model")  # the forward order
    assert np.asarray(t.uses).tolist() == [1.0] * len(t.names)
    _, ref_grads = jdls.nnx.value_and_grad(lambda m, x: loss_fn(m, x, True), scale)(model, x)
    ref = jdls.Telemetry.of(nnx.state(ref_grads, jdls.nnx.SiteVariable))
    # unrolled, each slice of the stacked probe is its own site: the same rows
    assert ref.names == t.names
    np.testing.assert_allclose(t.amax, ref.amax, rtol=2e-3)
    for a, b in zip(
        jax.tree_util.tree_leaves(nnx.state(grads, nnx.Not(jdls.nnx.SiteVariable))),
        jax.tree_util.tree_leaves(nnx.state(ref_grads, nnx.Not(jdls.nnx.SiteVariable))),
        strict=True,
    ):
        np.testing.assert_allclose(a, b, rtol=2e-3, atol=1e-6)


def test_the_optimizer_updates_the_sites_and_not_the_parameters_with_them() -> None:
    model = jdls.nnx.probes(Model(nnx.Rngs(0), probes=True))
    optimizer = jdls.nnx.Optimizer(model, jdls.wrap(optax.sgd(0.1)), wrt=nnx.Param)
    x = _x()

    @nnx.jit
    def step(model, optimizer, x):
        _, grads = jdls.nnx.value_and_grad(loss_fn, jdls.get_scale(optimizer))(model, x)
        optimizer.update(model, grads)
        return grads

    grads = step(model, optimizer, x)
    measured = jdls.Telemetry.of(nnx.state(grads, jdls.nnx.SiteVariable))
    recorded = jdls.Telemetry.of(nnx.state(model, jdls.nnx.SiteVariable))
    np.testing.assert_allclose(recorded.amax, measured.amax)
    assert int(jdls.stats(optimizer).skipped_steps) == 0


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "nnx.jit"])
@pytest.mark.full
def test_per_layer_scales_in_a_vmapped_scanned_remat_stack_are_exact(jit: bool) -> None:
    """float32, the stack's layers each at their own scale: the gradients are nnx.grad's,
    and jdls.nnx.Optimizer adjusts each layer's scale from its own gradients."""
    model = Model(nnx.Rngs(0), jnp.float32, scales=jdls.AdaptiveScale(2.0**4))
    levels = jnp.array([2.0**e for e in (20, -6, 12, 3)])
    site = model.blocks.jdls_layer_scale.get_value()
    value = {**site.value, "scale": site.value["scale"].replace(loss_scale=levels)}
    model.blocks.jdls_layer_scale.set_value(jdls.Site(site.kind, value))
    x = _x()
    fn = jdls.nnx.layer_scaled_value_and_grad(loss_fn)
    fn = nnx.jit(fn) if jit else fn
    loss, grads = fn(model, x)
    ref_loss, ref = closing_over_sites(nnx.value_and_grad(loss_fn))(model, x)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
    for a, b in zip(
        jax.tree_util.tree_leaves(nnx.state(grads, nnx.Not(jdls.nnx.SiteVariable))),
        jax.tree_util.tree_leaves(ref),
        strict=True,
    ):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7 * float(jnp.max(jnp.abs(b))))
    optimizer = jdls.nnx.Optimizer(
        model, jdls.wrap(optax.sgd(0.1), jdls.NoOpScale()), wrt=nnx.Param
    )
    optimizer.update(model, grads)
    new = model.blocks.jdls_layer_scale.get_value().value
    kernel = jnp.abs(
        nnx.state(grads, nnx.Not(jdls.nnx.SiteVariable))["blocks"]["linear"]["kernel"].get_value()
    )
    assert new["scale"].loss_scale.shape == (DEPTH,)
    assert np.all(np.asarray(new["amax"]) >= np.asarray(kernel.reshape(DEPTH, -1).max(1)))
    assert not np.all(np.asarray(new["scale"].loss_scale) == np.asarray(levels))


def test_nnx_jit_traced_before_keeps_the_sites() -> None:
    model = jdls.nnx.probes(Model(nnx.Rngs(0), probes=True))
    x = _x()
    forward = nnx.jit(loss_fn)
    forward(model, x)  # traced and cached: an evaluation step
    _, grads = jdls.nnx.value_and_grad(forward, jdls.StaticScale(8.0))(model, x)
    t = jdls.Telemetry.of(nnx.state(grads, jdls.nnx.SiteVariable))
    assert np.asarray(t.uses).tolist() == [1.0] * len(t.names) and len(t.names) == 11


class _Overflow(nnx.Module):
    """12 layers; the model's output overflows float16 in the backward pass at layers/11's
    output (the scaled cotangent 4 * 60000)."""

    def __init__(self) -> None:
        self.layers = nnx.List(
            [nnx.Linear(3 if i == 0 else 4, 4, rngs=nnx.Rngs(i)) for i in range(12)]
        )

    def __call__(self, x):
        for layer in self.layers:
            x = layer(x)
        return x.astype(jnp.float16) * jnp.float16(60000.0)


@pytest.mark.parametrize("jit", [True, False], ids=["nnx.jit", "eager"])
@pytest.mark.full(keep=1)
def test_probes_follow_the_forward_order_through_split_and_merge(jit: bool) -> None:
    model = jdls.nnx.probes(_Overflow())
    model = nnx.merge(*nnx.split(model))  # attributes rebuilt in sorted order

    def loss(m, x):
        return jnp.sum(m(x)).astype(jnp.float32)

    fn = jdls.nnx.value_and_grad(loss, jdls.StaticScale(4.0))
    _, grads = (nnx.jit(fn) if jit else fn)(model, jnp.ones((2, 3)))
    t = jdls.Telemetry.of(nnx.state(grads, jdls.nnx.SiteVariable))
    layers = tuple(f"layers/{i}" for i in range(12))
    assert t.names == (*layers, "_Overflow")  # the model's own probe: its class name
    assert np.asarray(t.nonfinite).tolist() == [1.0] * 12 + [0.0]
    assert t.first_nonfinite() == "layers/11"


class _Named(nnx.Module):
    """Two layers whose names sort against the forward order."""

    def __init__(self, scale=None) -> None:
        self.z_first = nnx.Linear(3, 4, rngs=nnx.Rngs(0))
        self.a_second = nnx.Linear(4, 2, rngs=nnx.Rngs(1))
        if scale is not None:
            jdls.nnx.layer_scales(self, scale)

    def __call__(self, x):
        return self.a_second(jnp.tanh(self.z_first(x)))


def _named_loss(m, x):
    return jnp.sum(m(x) ** 2)


def _set_scales(model: _Named) -> None:
    # far apart: a layer unscaled by the other's scale is off by 2**18
    model.z_first.jdls_layer_scale.set_value(jdls.layer_site(jdls.StaticScale(2.0**20), 0))
    model.a_second.jdls_layer_scale.set_value(jdls.layer_site(jdls.StaticScale(4.0), 1))


@pytest.mark.parametrize("jit", [True, False], ids=["nnx.jit", "eager"])
@pytest.mark.full(keep=1)
def test_layer_positions_survive_split_merge_and_restore_bit_for_bit(jit: bool) -> None:
    model = _Named(jdls.StaticScale(1.0))
    _set_scales(model)
    graphdef, state = nnx.split(model)
    # a restore: an abstract model built the same way, its state replaced by the saved one
    abstract = nnx.eval_shape(lambda: _Named(jdls.StaticScale(1.0)))
    restored_def, restored = nnx.split(abstract)
    restored = jax.tree_util.tree_map(lambda _, v: v, restored, state)
    for m in (nnx.merge(graphdef, state), nnx.merge(restored_def, restored)):
        assert list(vars(m))[-2:] == ["a_second", "z_first"]  # rebuilt sorted by name
        assert m.z_first.jdls_layer_scale.get_value().kind.position == 0
        fn = jdls.nnx.layer_scaled_value_and_grad(_named_loss)
        _, grads = (nnx.jit(fn) if jit else fn)(m, jnp.ones((2, 3)))
        g, params, rest = nnx.split(m, nnx.Param, ...)
        bare = jax.grad(
            lambda p, g=g, rest=rest: _named_loss(nnx.merge(g, p, rest), jnp.ones((2, 3)))
        )
        ref = closing_over_sites(jax.jit(bare) if jit else bare)(params)
        for a, b in zip(
            jax.tree_util.tree_leaves(nnx.state(grads, nnx.Not(jdls.nnx.SiteVariable))),
            jax.tree_util.tree_leaves(ref),
            strict=True,
        ):
            np.testing.assert_array_equal(a, b)


def test_layer_scales_on_a_rebuilt_model_keep_or_refuse_the_order() -> None:
    model = _Named(jdls.StaticScale(1.0))
    merged = nnx.merge(*nnx.split(model))
    # called again on layers that hold sites: their positions stay
    jdls.nnx.layer_scales(merged, jdls.StaticScale(2.0))
    assert merged.z_first.jdls_layer_scale.get_value().kind.position == 0
    # called first on a rebuilt model: numbered by sorted names, refused at the first step
    bare = nnx.merge(*nnx.split(_Named()))
    jdls.nnx.layer_scales(bare, jdls.StaticScale(2.0))
    with pytest.raises(ValueError, match="call it where the model is built"):
        jdls.nnx.layer_scaled_value_and_grad(_named_loss)(bare, jnp.ones((2, 3)))


def test_one_dot_general_in_two_layers_is_refused() -> None:
    dot = jdls.fp8.nnx.DotGeneral(jdls.fp8.DelayedScaling(16))
    model = nnx.Sequential(
        nnx.Linear(3, 4, dot_general=dot, rngs=nnx.Rngs(0)),
        nnx.Linear(4, 4, dot_general=dot, rngs=nnx.Rngs(1)),
    )
    match = "layers/0/dot_general/site and at layers/1/dot_general/site.*one per layer"
    with pytest.raises(ValueError, match=match):
        jdls.nnx.Optimizer(model, jdls.wrap(optax.sgd(0.1)), wrt=nnx.Param)
    with pytest.raises(ValueError, match=match):
        jdls.nnx.probes(model)
    with pytest.raises(ValueError, match="one per layer"):
        jdls.nnx.layer_scales(model, jdls.StaticScale(2.0))
    # one DotGeneral per layer: accepted
    model = nnx.Sequential(
        *(
            nnx.Linear(3, 3, dot_general=jdls.fp8.nnx.DotGeneral(), rngs=nnx.Rngs(i))
            for i in range(2)
        )
    )
    jdls.nnx.Optimizer(jdls.nnx.probes(model), jdls.wrap(optax.sgd(0.1)), wrt=nnx.Param)


def test_layer_scales_refuse_one_layer_at_two_places() -> None:
    layer = nnx.Linear(3, 3, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="layers/2 is the one at layers/0"):
        jdls.nnx.layer_scales(nnx.Sequential(layer, nnx.tanh, layer), jdls.StaticScale(2.0))


def test_an_optimizer_over_every_variable_is_refused_with_the_fix():
    model = jdls.nnx.probes(nnx.Linear(2, 1, rngs=nnx.Rngs(0)))
    with pytest.raises(ValueError, match=r"wrt=nnx\.Param"):
        jdls.nnx.Optimizer(model, jdls.wrap(optax.sgd(0.1)), wrt=nnx.Variable)
    jdls.nnx.Optimizer(model, jdls.wrap(optax.sgd(0.1)), wrt=nnx.Param)
