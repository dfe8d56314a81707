"""Sites in Flax NNX models: jdls.nnx.probes and per-layer scales on a stack of blocks made
with nnx.vmap and run with nnx.scan and nnx.remat, the sites updated by jdls.nnx.Optimizer,
compared with the same blocks called one by one."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
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
    stack = [f"blocks[{i}]" for i in range(DEPTH)] + [f"blocks/linear[{i}]" for i in range(DEPTH)]
    assert sorted(t.names) == sorted(["", "embed", "head", *stack])
    assert np.asarray(t.uses).tolist() == [1.0] * len(t.names)
    _, ref_grads = jdls.nnx.value_and_grad(lambda m, x: loss_fn(m, x, True), scale)(model, x)
    ref = jdls.Telemetry.of(nnx.state(ref_grads, jdls.nnx.SiteVariable))
    # unrolled, each slice of the stacked probe is its own site: the same rows
    assert ref.names == t.names
    np.testing.assert_allclose(t.amax, ref.amax, rtol=2e-3)
    for a, b in zip(
        jax.tree_util.tree_leaves(nnx.state(grads, nnx.Param)),
        jax.tree_util.tree_leaves(nnx.state(ref_grads, nnx.Param)),
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
    ref_loss, ref = nnx.value_and_grad(loss_fn)(model, x)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
    for a, b in zip(
        jax.tree_util.tree_leaves(nnx.state(grads, nnx.Param)),
        jax.tree_util.tree_leaves(ref),
        strict=True,
    ):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7 * float(jnp.max(jnp.abs(b))))
    optimizer = jdls.nnx.Optimizer(
        model, jdls.wrap(optax.sgd(0.1), jdls.NoOpScale()), wrt=nnx.Param
    )
    optimizer.update(model, grads)
    new = model.blocks.jdls_layer_scale.get_value().value
    kernel = jnp.abs(nnx.state(grads, nnx.Param)["blocks"]["linear"]["kernel"].get_value())
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
