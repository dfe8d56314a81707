"""Sites in Flax linen models: jdls.linen.probes and jdls.linen.layer_scales on a stack of
blocks run by nn.scan(nn.remat(Block)), jdls.linen.TrainState carrying the sites, compared
with the same blocks unrolled in Python."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _helpers import (
    closing_over_sites,
    decoded,
    jitted_in_quick_run,
    maybe_jit,
    with_and_without_jit,
)

import jdls

DEPTH, WIDTH = 4, 8


class Block(nn.Module):
    dtype: object = jnp.float16

    @nn.compact
    def __call__(self, h, _=None):
        return jnp.tanh(nn.Dense(WIDTH, dtype=self.dtype, name="dense")(h) + 1.0), None


class Scanned(nn.Module):
    dtype: object = jnp.float16
    remat: bool = True

    @nn.compact
    def __call__(self, x):
        h = nn.Dense(WIDTH, dtype=self.dtype, name="embed")(x)
        block = nn.remat(Block) if self.remat else Block
        stack = nn.scan(
            block,
            variable_axes={"params": 0, "jdls": 0},
            split_rngs={"params": True},
            length=DEPTH,
        )
        h, _ = stack(self.dtype, name="blocks")(h, None)
        return nn.Dense(1, dtype=self.dtype, name="head")(h).astype(jnp.float32)


class Unrolled(nn.Module):
    """The same layers, one module per block (the reference)."""

    dtype: object = jnp.float16

    @nn.compact
    def __call__(self, x):
        h = nn.Dense(WIDTH, dtype=self.dtype, name="embed")(x)
        for i in range(DEPTH):
            h, _ = Block(self.dtype, name=f"block_{i}")(h)
        return nn.Dense(1, dtype=self.dtype, name="head")(h).astype(jnp.float32)


def _x():
    return jax.random.normal(jax.random.key(1), (16, 4))


def unstack(tree: dict) -> dict:
    """The scanned model's variables as the unrolled model's (block_i for blocks[i])."""
    out = {k: v for k, v in tree.items() if k != "blocks"}
    for i in range(DEPTH):
        out[f"block_{i}"] = jax.tree_util.tree_map(lambda a, i=i: a[i], tree["blocks"])
    return out


def state_of(model, x, scale=None):
    scale = jdls.NoOpScale() if scale is None else scale
    variables = model.init(jax.random.key(0), x)
    return jdls.linen.TrainState.create(
        apply_fn=model.apply,
        params=variables["params"],
        sites=variables["jdls"],
        tx=jdls.wrap(optax.sgd(0.1), scale),
    )


def train_step(state, x):
    loss, grads = state.value_and_grad(lambda v: jnp.mean(state.apply_fn(v, x) ** 2))(
        state.variables
    )
    return state.apply_gradients(grads=grads), loss, grads


@pytest.mark.parametrize("remat", [True, False], ids=["nn.remat", "plain"])
@with_and_without_jit
@pytest.mark.full
def test_probes_in_a_scanned_stack_give_a_row_per_layer(remat: bool, jit: bool) -> None:
    x = _x()
    state = state_of(jdls.linen.probes(Scanned(remat=remat)), x, jdls.StaticScale(2.0**8))
    new, _, grads = maybe_jit(train_step, jit)(state, x)
    t = jdls.Telemetry.of(grads["jdls"])
    assert t.names == (
        "embed",
        "blocks/dense[0]",
        "blocks[0]",
        "blocks/dense[1]",
        "blocks[1]",
        "blocks/dense[2]",
        "blocks[2]",
        "blocks/dense[3]",
        "blocks[3]",
        "head",
    )  # fmt: skip: the forward order, a stack's layers one after the other
    assert np.asarray(t.uses).tolist() == [1.0] * 10
    # the reference: the same blocks unrolled, the same parameters
    reference = jdls.linen.probes(Unrolled())
    ref_vars = reference.init(jax.random.key(0), x)
    params = unstack(state.params)
    _, ref_grads = jdls.StaticScale(2.0**8).value_and_grad(
        lambda v: jnp.mean(reference.apply(v, x) ** 2)
    )({"params": params, "jdls": ref_vars["jdls"]})
    ref = jdls.Telemetry.of(ref_grads["jdls"])
    by_name = dict(zip(ref.names, np.asarray(ref.amax), strict=True))
    blocks = [name for i in range(DEPTH) for name in (f"block_{i}/dense", f"block_{i}")]
    assert ref.names == ("embed", *blocks, "head")
    for i in range(DEPTH):
        np.testing.assert_allclose(t.amax[1 + 2 * i], by_name[f"block_{i}/dense"], rtol=2e-3)
        np.testing.assert_allclose(t.amax[2 + 2 * i], by_name[f"block_{i}"], rtol=2e-3)
    # the step recorded the measurement in the sites
    np.testing.assert_allclose(jdls.Telemetry.of(new.sites).amax, t.amax)
    for a, b in zip(
        jax.tree_util.tree_leaves(unstack(grads["params"])),
        jax.tree_util.tree_leaves(ref_grads["params"]),
        strict=True,
    ):
        np.testing.assert_allclose(a, b, rtol=2e-3, atol=1e-6)


@with_and_without_jit
@pytest.mark.full
def test_layer_scales_in_a_scanned_remat_stack_are_exact(jit: bool) -> None:
    """float32, a scale per layer (the scanned stack's layers each their own): the gradients
    are jax.grad's, and each site is adjusted from its own layer's gradients."""
    x = _x()
    model = jdls.linen.layer_scales(Scanned(jnp.float32), jdls.AdaptiveScale(2.0**8))
    state = state_of(model, x)
    levels = {"embed": 2.0**30, "head": 2.0**-4}
    stacked = jnp.array([2.0**e for e in (3, 20, -6, 12)])

    def set_level(path, site):
        key = path[0].key  # the layer: "embed", "blocks" (stacked) or "head"
        value = dict(site.value)
        level = stacked if key == "blocks" else jnp.float32(levels[key])
        value["scale"] = value["scale"].replace(loss_scale=level)
        return jdls.Site(site.kind, value)

    sites = jax.tree_util.tree_map_with_path(set_level, state.sites, is_leaf=jdls.is_site)
    state = state.replace(sites=sites)
    new, loss, grads = maybe_jit(train_step, jit)(state, x)
    ref_loss, ref = closing_over_sites(
        jax.value_and_grad(
            lambda p: jnp.mean(model.apply({"params": p, "jdls": state.sites}, x) ** 2)
        )
    )(state.params)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
    for a, b in zip(
        jax.tree_util.tree_leaves(grads["params"]), jax.tree_util.tree_leaves(ref), strict=True
    ):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7 * float(jnp.max(jnp.abs(b))))
    blocks = new.sites["blocks"]["layer_scale"].value
    assert blocks["scale"].loss_scale.shape == (DEPTH,)
    amax = jnp.max(
        jnp.stack(
            [
                jnp.abs(g).reshape(DEPTH, -1).max(1)
                for g in jax.tree_util.tree_leaves(grads["params"]["blocks"])
            ]
        ),
        axis=0,
    )
    np.testing.assert_allclose(blocks["amax"], amax)
    assert not np.all(np.asarray(blocks["scale"].loss_scale) == np.asarray(stacked))


@pytest.mark.full  # about 8 s; tests/test_sites.py's skip-aware update_sites test stays
def test_a_skipped_step_keeps_the_scales_and_records_the_probes() -> None:
    x = _x().at[0, 0].set(jnp.inf)
    state = state_of(jdls.linen.layer_scales(Scanned(), jdls.AdaptiveScale(2.0**8)), x)
    new, _, _ = jax.jit(train_step)(state, x)
    assert not bool(new.stats.finite)
    old_levels = [
        s.value["scale"].loss_scale
        for s in jax.tree_util.tree_leaves(state.sites, is_leaf=jdls.is_site)
    ]
    new_levels = [
        s.value["scale"].loss_scale
        for s in jax.tree_util.tree_leaves(new.sites, is_leaf=jdls.is_site)
    ]
    for a, b in zip(old_levels, new_levels, strict=True):
        assert np.all(np.asarray(b) <= np.asarray(a))  # nothing grows on a skipped step
    probes = state_of(jdls.linen.probes(Scanned()), x)
    after, _, _ = jax.jit(train_step)(probes, x)
    assert float(jnp.max(jdls.Telemetry.of(after.sites).nonfinite)) == 1.0


@pytest.mark.full  # about 4 s; the nn.jit trace-reuse tests stay in the quick run
def test_a_jitted_apply_traced_before_keeps_its_sites() -> None:
    """An evaluation step traced the jitted apply before, outside any differentiation: the
    sites are the apply's own variables, so the cached trace has them."""
    x = _x()
    model = jdls.linen.probes(Scanned())
    state = state_of(model, x)
    apply = jax.jit(model.apply)
    apply(state.variables, x)  # traced and cached
    loss_fn = lambda v: jnp.mean(apply(v, x) ** 2)  # noqa: E731
    _, grads = state.value_and_grad(loss_fn)(state.variables)
    t = jdls.Telemetry.of(grads["jdls"])
    assert np.asarray(t.uses).tolist() == [1.0] * len(t.names) and len(t.names) == 10


def test_nn_jit_inside_the_model_keeps_its_sites() -> None:
    class Jitted(nn.Module):
        @nn.compact
        def __call__(self, x):
            h = nn.jit(Block)(name="block")(x)[0]
            return nn.Dense(1, name="head")(h)

    x = _x()
    model = jdls.linen.probes(Jitted())
    state = state_of(model, x)
    _, grads = state.value_and_grad(lambda v: jnp.mean(model.apply(v, x) ** 2))(state.variables)
    t = jdls.Telemetry.of(grads["jdls"])
    assert "block" in t.names and np.asarray(t.uses).tolist() == [1.0] * len(t.names)
    assert float(jnp.min(t.amax)) > 0


#: one class: nn.jit reuses the first block's trace (and the sites made in it) for the others
JittedBlock = nn.jit(Block)


class JitBlocks(nn.Module):
    """Unrolled's layers, each block in nn.jit."""

    dtype: object = jnp.float16

    @nn.compact
    def __call__(self, x):
        h = nn.Dense(WIDTH, dtype=self.dtype, name="embed")(x)
        for i in range(DEPTH):
            h, _ = JittedBlock(self.dtype, name=f"block_{i}")(h)
        return nn.Dense(1, dtype=self.dtype, name="head")(h).astype(jnp.float32)


def _with_levels(sites, levels):
    def set_level(path, site):
        value = dict(site.value)
        value["scale"] = value["scale"].replace(loss_scale=jnp.float32(levels[path[0].key]))
        return jdls.Site(site.kind, value)

    return jax.tree_util.tree_map_with_path(set_level, sites, is_leaf=jdls.is_site)


@jitted_in_quick_run  # eager about 5 s, jitted 2
@pytest.mark.full  # about 5 s; the nn.jit probe-order test stays quick
def test_layer_scales_of_blocks_each_in_nn_jit_are_exact(jit: bool) -> None:
    """Blocks of one class each in nn.jit: each block its own place in the chain, set by the
    wrapper outside the blocks' (shared) trace; the gradients and the adjusted scales equal
    those of the same model without nn.jit, and the gradients jax.grad's."""
    x = _x()
    model = jdls.linen.layer_scales(JitBlocks(jnp.float32), jdls.AdaptiveScale(2.0**8))
    state = state_of(model, x)
    names = ["embed", *[f"block_{i}" for i in range(DEPTH)], "head"]
    assert {k: s["layer_scale"].kind.position for k, s in state.sites.items()} == {
        name: k for k, name in enumerate(names)
    }
    exponents = (30, 3, 20, -6, 12, -4)
    state = state.replace(
        sites=_with_levels(state.sites, {n: 2.0**e for n, e in zip(names, exponents, strict=True)})
    )
    new, loss, grads = maybe_jit(train_step, jit)(state, x)
    # the same model without nn.jit: the same parameters and sites (the same paths)
    unjitted = jdls.linen.layer_scales(Unrolled(jnp.float32), jdls.AdaptiveScale(2.0**8))
    ref_new, ref_loss, ref_grads = maybe_jit(train_step, jit)(
        state.replace(apply_fn=unjitted.apply), x
    )
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
    for a, b in zip(
        jax.tree_util.tree_leaves((decoded(grads), new.sites)),
        jax.tree_util.tree_leaves((decoded(ref_grads), ref_new.sites)),
        strict=True,
    ):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7 * float(jnp.max(jnp.abs(b))))
    plain = jax.grad(lambda p: jnp.mean(Unrolled(jnp.float32).apply({"params": p}, x) ** 2))
    for a, b in zip(
        jax.tree_util.tree_leaves(grads["params"]),
        jax.tree_util.tree_leaves(plain(state.params)),
        strict=True,
    ):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7 * float(jnp.max(jnp.abs(b))))


def test_layer_scales_under_nn_jit_traced_before_are_the_wrappers_own() -> None:
    """A per-layer-scaled model traced the nn.jit blocks before with another scale: the sites
    of the next one are its own (its scale, its positions), jitted init or not."""
    x = _x()
    jdls.linen.layer_scales(JitBlocks(), jdls.StaticScale(2.0**4)).init(jax.random.key(0), x)
    model = jdls.linen.layer_scales(JitBlocks(), jdls.AdaptiveScale(2.0**8))
    for init in (model.init, jax.jit(model.init)):
        sites = init(jax.random.key(0), x)["jdls"]
        found = {k: s["layer_scale"] for k, s in sites.items()}
        assert [found[k].kind.position for k in ("embed", "block_0", "block_3", "head")] == [
            0, 1, DEPTH, DEPTH + 1
        ]  # fmt: skip
        for site in found.values():
            assert isinstance(site.value["scale"], jdls.DynamicScale)
            assert float(site.value["scale"].loss_scale) == 2.0**8


class DecoratedBlock(nn.Module):
    @nn.jit  # one jitted method for every instance, in every model
    @nn.compact
    def __call__(self, h):
        return jnp.tanh(nn.Dense(WIDTH, name="dense")(h))


class DecoratedBlocks(nn.Module):
    @nn.compact
    def __call__(self, x):
        for i in range(2):
            x = DecoratedBlock(name=f"block_{i}")(x)
        return x


@pytest.mark.full  # 6 s; its per-layer sibling under nn.jit is quick
def test_nn_jit_traced_before_without_sites_keeps_the_sites() -> None:
    """The bare model traced its nn.jit blocks first (init and apply): the probed model's
    init does not reuse that trace (its sites would be missing), nor does the bare model
    reuse the probed one's afterwards."""
    x, key = _x(), jax.random.key(0)
    bare = DecoratedBlocks()
    bare.apply(bare.init(key, x), x)
    model = jdls.linen.probes(bare)
    state = state_of(model, x)
    assert sorted(state.sites) == ["block_0", "block_1"]
    _, grads = state.value_and_grad(lambda v: jnp.mean(model.apply(v, x) ** 2))(state.variables)
    t = jdls.Telemetry.of(grads["jdls"])
    assert t.names == ("block_0/dense", "block_0", "block_1/dense", "block_1")
    assert np.asarray(t.uses).tolist() == [1.0] * 4
    assert sorted(bare.init(key, x)) == ["params"]
    scaled = jdls.linen.layer_scales(bare, jdls.StaticScale(2.0))
    sites = scaled.init(key, x)["jdls"]
    assert [sites[f"block_{i}"]["layer_scale"].kind.position for i in range(2)] == [0, 1]


def test_train_state_with_sites_says_what_to_pass() -> None:
    x = _x()
    state = state_of(jdls.linen.probes(Scanned()), x)
    with pytest.raises(ValueError, match="state.variables"):
        state.apply_gradients(grads=state.params)


@jitted_in_quick_run  # eager about 9 s on 2 cores, jitted 2
@pytest.mark.full  # about 8 s; tests/test_sites.py keeps probes and per-layer sites together
def test_probes_of_a_model_with_layer_scales_have_both_sites(jit: bool) -> None:
    """jdls.linen.probes(jdls.linen.layer_scales(model, scale)): one wrapper, a per-layer
    scale and a probe at each layer; the gradients are those of the per-layer scales alone."""
    x = _x()
    scaled = jdls.linen.layer_scales(Scanned(), jdls.AdaptiveScale(2.0**8))
    both = jdls.linen.probes(scaled)
    state = state_of(both, x)
    assert sorted(state.sites["blocks"]) == ["dense", "layer_scale", "probe"]
    assert sorted(state.sites["blocks"]["dense"]) == ["probe"]
    new, loss, grads = maybe_jit(train_step, jit)(state, x)
    alone = state_of(scaled, x)
    _, ref_loss, ref = maybe_jit(train_step, jit)(alone, x)
    assert loss == ref_loss
    for a, b in zip(
        jax.tree_util.tree_leaves(grads["params"]),
        jax.tree_util.tree_leaves(ref["params"]),
        strict=True,
    ):
        np.testing.assert_array_equal(a, b)
    t = jdls.Telemetry.of(grads["jdls"])
    assert len(t.names) == 10 and np.asarray(t.uses).tolist() == [1.0] * 10
    assert new.sites["blocks"]["layer_scale"].value["scale"].loss_scale.shape == (DEPTH,)


class DropBlock(nn.Module):
    """A block with dropout, ``train`` given positionally."""

    @nn.compact
    def __call__(self, h, train):
        h = jnp.tanh(nn.Dense(WIDTH, name="dense")(h) + 1.0)
        return nn.Dropout(0.5, deterministic=not train)(h)


class DropBlocks(nn.Module):
    """Blocks of one class, each in ``nn.jit`` or not, ``train`` passed on positionally."""

    jitted: bool = True

    @nn.compact
    def __call__(self, x, train):
        block = nn.jit(DropBlock, static_argnums=(2,)) if self.jitted else DropBlock
        h = nn.Dense(WIDTH, name="embed")(x)
        for i in range(DEPTH):
            h = block(name=f"block_{i}")(h, train)
        return nn.Dense(1, name="head")(h)


@jitted_in_quick_run
@pytest.mark.full  # about 12 s; the blocks-each-in-nn.jit test stays in the quick run
def test_layer_scales_of_nn_jit_blocks_with_a_positional_train_flag(jit: bool) -> None:
    """A positional ``train`` flag reaches blocks each in ``nn.jit`` (static there) through
    the per-layer-scales wrapper: dropout on in training, off in evaluation, and the
    parameters' gradients those of the bare model (jax.grad), each layer at its own scale."""
    x = _x()
    model = jdls.linen.layer_scales(DropBlocks(), jdls.AdaptiveScale(2.0**8))
    variables = model.init(jax.random.key(0), x, False)
    names = ["embed", *[f"block_{i}" for i in range(DEPTH)], "head"]
    variables = {
        **variables,
        "jdls": _with_levels(
            variables["jdls"], {n: 2.0 ** (3 * k - 4) for k, n in enumerate(names)}
        ),
    }
    rngs = {"dropout": jax.random.key(7)}
    bare = DropBlocks()
    grad = jdls.NoOpScale().value_and_grad  # the sites' counters are integers
    for train in (True, False):

        def loss(v, m=model, t=train):
            return jnp.mean(m.apply(v, x, t, rngs=rngs) ** 2)

        grads = maybe_jit(lambda v, f=loss: grad(f)(v)[1], jit)(variables)
        ref = jax.grad(lambda p, t=train: loss({"params": p}, bare, t))(variables["params"])
        for a, b in zip(jax.tree.leaves(grads["params"]), jax.tree.leaves(ref), strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)
    # dropout is on in training only
    out = [model.apply(variables, x, t, rngs=rngs) for t in (True, False)]
    assert not np.allclose(out[0], out[1])
    np.testing.assert_array_equal(out[1], bare.apply({"params": variables["params"]}, x, False))


class _Overflow(nn.Module):
    """12 Dense layers (``layers_0`` to ``layers_11``); the loss overflows float16 at the
    last layer's output cotangent, so the backward pass goes non-finite from there on."""

    @nn.compact
    def __call__(self, x):
        for i in range(12):
            x = nn.Dense(4, name=f"layers_{i}")(x)
        return x.astype(jnp.float16) * jnp.float16(60000.0)


@with_and_without_jit
@pytest.mark.full  # about 4 s; the forward order through nn.jit blocks stays in the quick run
def test_probes_follow_the_forward_order_past_ten_layers(jit: bool) -> None:
    model = jdls.linen.probes(_Overflow())
    x = jnp.ones((2, 3))
    variables = model.init(jax.random.key(0), x)
    names = tuple(f"layers_{i}" for i in range(12))
    positions = [variables["jdls"][n]["probe"].kind.position for n in names]
    assert positions == list(range(12))

    def loss(v):
        return jnp.sum(model.apply(v, x)).astype(jnp.float32)

    # the scaled cotangent 4 * 60000 overflows float16 at the model's output
    _, grads = maybe_jit(jdls.StaticScale(4.0).value_and_grad(loss), jit)(variables)
    t = jdls.Telemetry.of(grads["jdls"])
    assert t.names == names  # "layers_10" sorts before "layers_9" in the tree
    assert np.asarray(t.nonfinite).tolist() == [1.0] * 12
    assert t.first_nonfinite() == "layers_11"


class _JitBlock(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.Dense(4)(x)
        x = nn.LayerNorm()(x)
        return nn.Dense(4)(x)


class _JitBlocks(nn.Module):
    @nn.compact
    def __call__(self, x):
        for i in range(3):
            x = nn.jit(_JitBlock)(name=f"b{i}")(x)
        return x


def test_probes_inside_nn_jit_blocks_follow_the_forward_order() -> None:
    # nn.jit reuses b1's trace for b2: b2's returns are never seen, its order is b1's
    model = jdls.linen.probes(_JitBlocks())
    x = jnp.ones((2, 3))
    variables = model.init(jax.random.key(0), x)
    _, grads = jax.jit(jax.value_and_grad(lambda v: jnp.sum(model.apply(v, x))))(variables)
    inner = ("Dense_0", "LayerNorm_0", "Dense_1")
    expected = tuple(n for b in ("b0", "b1", "b2") for n in (*(f"{b}/{i}" for i in inner), b))
    assert jdls.Telemetry.of(grads["jdls"]).names == expected
    assert jdls.Telemetry.of(variables["jdls"]).names == expected


class _CalledTwice(nn.Module):
    @nn.compact
    def __call__(self, x):
        shared = nn.Dense(4, name="shared")
        return nn.Dense(1, name="head")(jnp.tanh(shared(jnp.tanh(shared(nn.Dense(4)(x))))))


def test_a_layer_called_twice_is_refused_with_per_layer_scales() -> None:
    """Its cotangent would cross its scale's boundary twice and its gradients be unscaled by
    the wrong scale: refused while tracing, naming the layer."""
    model = jdls.linen.layer_scales(_CalledTwice(), jdls.AdaptiveScale())
    with pytest.raises(ValueError, match="layer 'shared' was called 2 times in one step"):
        model.init(jax.random.key(0), jnp.ones((2, 3)))
