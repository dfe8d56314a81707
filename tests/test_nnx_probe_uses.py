"""jdls.nnx.probes gives a row to every use of a module and to its methods, as jdls.linen.probes
does: with example inputs, one probe per call (a dropout applied twice: ``drop`` and
``drop#2``; ``nnx.Embed.attend``); with or without them, one per public method of the model's
own classes (``embedder.encode``, ``embedder.decode``). Checked against the bare model's
gradients (bit for bit) and the cotangents computed by hand with ``jax.vjp``."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from _helpers import maybe_jit, with_and_without_jit
from flax import nnx

import jdls

SCALE = 2.0**4
TOKENS = jnp.array([[1, 2, 3, 4], [5, 6, 7, 0]])


class Embedder(nnx.Module):
    """Called through its methods only: ``encode`` and ``decode`` (the head tied to the
    table)."""

    def __init__(self, rngs: nnx.Rngs) -> None:
        self.table = nnx.Param(jax.random.normal(rngs.params(), (8, 6)))

    def encode(self, tokens):
        return self.table[...][tokens]

    def decode(self, x):
        return x @ self.table[...].T


class Block(nnx.Module):
    """One dropout applied twice."""

    def __init__(self, rngs: nnx.Rngs) -> None:
        self.a = nnx.Linear(6, 6, rngs=rngs)
        self.b = nnx.Linear(6, 6, rngs=rngs)
        self.drop = nnx.Dropout(0.5, rngs=rngs)

    def __call__(self, x):
        h = self.drop(self.a(x))
        return 3.0 * self.drop(self.b(jnp.tanh(h)))


class Model(nnx.Module):
    def __init__(self, rngs: nnx.Rngs) -> None:
        self.embedder = Embedder(rngs)
        self.block = Block(rngs)

    def __call__(self, tokens):
        return self.embedder.decode(self.block(self.embedder.encode(tokens)))


def loss_fn(model, tokens):
    return jnp.sum(model(tokens) ** 2)


#: The rows, in forward order, with and without example inputs.
PER_USE = (
    "embedder.encode",
    "block/a",
    "block/drop",
    "block/b",
    "block/drop#2",
    "block",
    "embedder.decode",
    "Model",
)
SHARED = (
    "embedder.encode",
    "embedder.decode",
    "block/a",
    "block/b",
    "block/drop",
    "block",
    "Model",
)


def _measured(grads) -> jdls.Telemetry:
    return jdls.Telemetry.of(nnx.state(grads, jdls.nnx.SiteVariable))


def _by_hand(model: Model) -> dict[str, np.ndarray]:
    """Each row's amax: the largest magnitude of the scaled cotangent at that point, from
    ``jax.vjp`` of the pieces of the forward pass (the dropout masks drawn as the model's
    dropout draws them: the same stream, in the same order)."""
    bare = Model(nnx.Rngs(0))  # the same parameters and dropout stream
    e = bare.embedder.encode(TOKENS)
    a = bare.block.a(e)
    mask1 = bare.block.drop(jnp.ones_like(a))  # 0 or 1 / keep = 2: exact
    d1 = a * mask1
    b_of = lambda h: bare.block.b(jnp.tanh(h))  # noqa: E731
    b, b_vjp = jax.vjp(b_of, d1)
    mask2 = bare.block.drop(jnp.ones_like(b))
    out = 3.0 * (b * mask2)
    y, dec_vjp = jax.vjp(bare.embedder.decode, out)
    a_vjp = jax.vjp(bare.block.a, e)[1]
    g_y = 2.0 * y * SCALE  # the model's output, the decoder's
    (g_out,) = dec_vjp(g_y)  # the block's
    g_d2 = 3.0 * g_out
    g_b = g_d2 * mask2
    (g_d1,) = b_vjp(g_b)
    g_a = g_d1 * mask1
    (g_e,) = a_vjp(g_a)
    rows = {
        "embedder.encode": g_e,
        "block/a": g_a,
        "block/drop": g_d1,
        "block/b": g_b,
        "block/drop#2": g_d2,
        "block": g_out,
        "embedder.decode": g_y,
        "Model": g_y,
    }
    return {k: np.asarray(jnp.max(jnp.abs(v))) for k, v in rows.items()}


def _bare_grads(jit: bool):
    bare = Model(nnx.Rngs(0))
    return maybe_jit(nnx.grad(loss_fn), jit)(bare, TOKENS)


def _assert_same_param_grads(grads, ref) -> None:
    """The parameters' gradients of ``grads`` (an NNX state) equal ``ref``'s leaves exactly."""
    for got, want in zip(
        jax.tree_util.tree_leaves(nnx.state(grads, nnx.Not(jdls.nnx.SiteVariable))),
        jax.tree_util.tree_leaves(ref),
        strict=True,
    ):
        np.testing.assert_array_equal(got, want)


@with_and_without_jit
def test_a_row_per_use_and_per_method_equal_to_the_cotangents_by_hand(jit: bool) -> None:
    model = jdls.nnx.probes(Model(nnx.Rngs(0)), TOKENS)
    fn = jdls.nnx.value_and_grad(loss_fn, jdls.StaticScale(SCALE))
    _, grads = (nnx.jit(fn) if jit else fn)(model, TOKENS)
    t = _measured(grads)
    assert t.names == PER_USE
    assert np.asarray(t.uses).tolist() == [1.0] * len(PER_USE)
    hand = _by_hand(model)
    np.testing.assert_allclose(t.amax, [hand[n] for n in PER_USE], rtol=0 if not jit else 1e-6)
    assert len(set(np.asarray(t.amax).tolist())) == len(PER_USE) - 1  # decode's is the model's
    # the probes measure and change nothing: the bare model's gradients, bit for bit
    ref = _bare_grads(jit)
    _assert_same_param_grads(grads, ref)


@with_and_without_jit
def test_without_example_inputs_methods_get_a_row_and_a_shared_use_counts(jit: bool) -> None:
    model = jdls.nnx.probes(Model(nnx.Rngs(0)))
    fn = jdls.nnx.value_and_grad(loss_fn, jdls.StaticScale(SCALE))
    _, grads = (nnx.jit(fn) if jit else fn)(model, TOKENS)
    t = _measured(grads)
    assert t.names == SHARED  # a module's probes in the order of its class's methods
    uses = dict(zip(t.names, np.asarray(t.uses).tolist(), strict=True))
    assert uses == {**dict.fromkeys(SHARED, 1.0), "block/drop": 2.0}
    amax = dict(zip(t.names, np.asarray(t.amax), strict=True))
    assert np.isnan(amax["block/drop"])
    hand = _by_hand(model)
    for name in SHARED:
        if name != "block/drop":
            np.testing.assert_allclose(amax[name], hand[name], rtol=0 if not jit else 1e-6)
    ref = _bare_grads(jit)
    _assert_same_param_grads(grads, ref)


def test_probes_are_named_as_linen_names_its_variables() -> None:
    model = jdls.nnx.probes(Model(nnx.Rngs(0)), jax.ShapeDtypeStruct((2, 4), jnp.int32))
    sites = nnx.to_flat_state(nnx.state(model, jdls.nnx.SiteVariable))
    assert sorted("/".join(map(str, path)) for path, _ in sites) == [
        "block/a/jdls_probe",
        "block/b/jdls_probe",
        "block/drop/jdls_probe",
        "block/drop/jdls_probe#2",
        "block/jdls_probe",
        "embedder/jdls_probe.decode",
        "embedder/jdls_probe.encode",
        "jdls_probe",
    ]
    # the example pass ran abstractly: the dropout's stream did not move
    assert int(model.block.drop.rngs.count[...]) == 0


def _restored(model: Model, tmp_path) -> Model:
    """``model``'s parameters and sites saved with orbax and restored into a model built the
    same way (the RNG streams taken from ``model``: orbax before 0.11.26 cannot restore a
    key array)."""
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(tmp_path / "ckpt", nnx.state(model, nnx.Not(nnx.RngState)))
    checkpointer.wait_until_finished()
    template = jdls.nnx.probes(Model(nnx.Rngs(1)), TOKENS)
    graphdef, saved, _ = nnx.split(template, nnx.Not(nnx.RngState), nnx.RngState)
    restored = checkpointer.restore(tmp_path / "ckpt", saved)
    return nnx.merge(graphdef, restored, nnx.state(model, nnx.RngState))


@pytest.mark.parametrize("jit", [True, False], ids=["nnx.jit", "eager"])
@pytest.mark.full  # about 11 s; tests/test_nnx_sites.py's split, merge and restore tests stay quick
def test_split_merge_jit_and_restore_keep_the_rows_in_forward_order(jit: bool, tmp_path) -> None:
    model = jdls.nnx.probes(Model(nnx.Rngs(0)), TOKENS)
    merged = nnx.merge(*nnx.split(model))
    restored = _restored(model, tmp_path)
    assert list(vars(merged))[-2:] == ["embedder", "jdls_probe"]  # rebuilt sorted by name
    fn = jdls.nnx.value_and_grad(loss_fn, jdls.StaticScale(SCALE))
    fn = nnx.jit(fn) if jit else fn
    amaxes = []
    for m in (model, merged, restored):
        _, grads = fn(nnx.clone(m), TOKENS)
        t = _measured(grads)
        assert t.names == PER_USE
        amaxes.append(np.asarray(t.amax))
    np.testing.assert_array_equal(amaxes[0], amaxes[1])
    np.testing.assert_array_equal(amaxes[0], amaxes[2])


@pytest.mark.full  # 4-5 s; methods and uses are measured in the quick run by the test against the cotangents by hand
def test_the_optimizer_steps_and_records_every_row() -> None:
    model = jdls.nnx.probes(Model(nnx.Rngs(0)), TOKENS)
    bare = Model(nnx.Rngs(0))
    optimizer = jdls.nnx.Optimizer(model, jdls.wrap(optax.sgd(0.01)), wrt=nnx.Param)
    bare_optimizer = nnx.Optimizer(bare, optax.sgd(0.01), wrt=nnx.Param)

    def mean_loss(model, tokens):
        return jnp.mean(model(tokens) ** 2)

    @nnx.jit
    def step(model, optimizer):
        _, grads = jdls.nnx.value_and_grad(mean_loss, jdls.get_scale(optimizer))(model, TOKENS)
        optimizer.update(model, grads)
        return grads

    @nnx.jit
    def bare_step(model, optimizer):
        grads = nnx.grad(mean_loss)(model, TOKENS)
        optimizer.update(model, grads)

    for _ in range(3):
        grads = step(model, optimizer)
        bare_step(bare, bare_optimizer)
    measured, recorded = _measured(grads), _measured(model)
    assert recorded.names == PER_USE
    np.testing.assert_array_equal(recorded.amax, measured.amax)
    assert np.asarray(recorded.uses).tolist() == [1.0] * len(PER_USE)
    assert int(jdls.stats(optimizer).skipped_steps) == 0
    for got, want in zip(
        jax.tree_util.tree_leaves(nnx.state(model, nnx.Param)),
        jax.tree_util.tree_leaves(nnx.state(bare, nnx.Param)),
        strict=True,
    ):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)


class Tied(nnx.Module):
    """``nnx.Embed`` in and, through ``attend``, out."""

    def __init__(self) -> None:
        self.embed = nnx.Embed(8, 6, rngs=nnx.Rngs(0))
        self.linear = nnx.Linear(6, 6, rngs=nnx.Rngs(1))

    def __call__(self, tokens):
        return self.embed.attend(jnp.tanh(self.linear(self.embed(tokens))))


@pytest.mark.full  # 4-5 s; methods and uses are measured in the quick run by the test against the cotangents by hand
def test_embed_attend_gets_a_row_from_the_example_pass() -> None:
    model = jdls.nnx.probes(Tied(), TOKENS)
    fn = jdls.nnx.value_and_grad(loss_fn, jdls.StaticScale(SCALE))
    _, grads = nnx.jit(fn)(model, TOKENS)
    t = _measured(grads)
    assert t.names == ("embed", "linear", "embed.attend", "Tied")
    bare = Tied()
    h = jnp.tanh(bare.linear(bare.embed(TOKENS)))
    g_y = 2.0 * bare.embed.attend(h) * SCALE
    (g_h,) = jax.vjp(bare.embed.attend, h)[1](g_y)
    g_linear = g_h * (1 - h**2)
    cotangents = (g_linear @ bare.linear.kernel[...].T, g_linear, g_y, g_y)
    np.testing.assert_allclose(t.amax, [jnp.max(jnp.abs(g)) for g in cotangents], rtol=1e-6)
    # without inputs, Flax's own methods (attend) are not probed
    _, grads = fn(jdls.nnx.probes(Tied()), TOKENS)
    assert _measured(grads).names == ("embed", "linear", "Tied")


class Retraced(nnx.Module):
    """Its body traced twice in one pass (a shape check, then the run): each trace takes
    the same two probes."""

    def __init__(self) -> None:
        self.linear = nnx.Linear(3, 3, rngs=nnx.Rngs(0))

    def __call__(self, x):
        body = jax.checkpoint(lambda h: self.linear(jnp.tanh(self.linear(h))))
        jax.eval_shape(body, x)
        return body(x)


@with_and_without_jit
def test_a_body_traced_twice_takes_the_same_probes(jit: bool) -> None:
    model = jdls.nnx.probes(Retraced(), jnp.ones((2, 3)))
    fn = jdls.nnx.value_and_grad(lambda m, x: jnp.sum(m(x) ** 2), jdls.StaticScale(SCALE))
    _, grads = (nnx.jit(fn) if jit else fn)(model, jnp.ones((2, 3)))
    t = _measured(grads)
    assert t.names == ("linear", "linear#2", "Retraced")
    assert np.asarray(t.uses).tolist() == [1.0, 1.0, 1.0]
    bare = nnx.Linear(3, 3, rngs=nnx.Rngs(0))
    h1 = bare(jnp.ones((2, 3)))
    y, second = jax.vjp(lambda h: bare(jnp.tanh(h)), h1)
    g_y = 2.0 * y * SCALE
    (g_h1,) = second(g_y)
    np.testing.assert_allclose(
        t.amax, [jnp.max(jnp.abs(g)) for g in (g_h1, g_y, g_y)], rtol=0 if not jit else 1e-6
    )


DEPTH = 3


class Layer(nnx.Module):
    """A block of a stack, its dropout applied twice."""

    def __init__(self, rngs: nnx.Rngs) -> None:
        self.linear = nnx.Linear(6, 6, rngs=rngs)
        self.drop = nnx.Dropout(0.5, rngs=rngs)

    def __call__(self, h):
        return jnp.tanh(self.drop(self.linear(self.drop(h))))


class Stack(nnx.Module):
    """``DEPTH`` layers made by ``nnx.vmap`` (probed inside the constructor), run by
    ``nnx.scan`` over ``nnx.remat``, or one by one (the reference)."""

    def __init__(self, rngs: nnx.Rngs, probes: bool = True) -> None:
        self.embed = nnx.Linear(4, 6, rngs=rngs)

        @nnx.split_rngs(splits=DEPTH)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def create(rngs: nnx.Rngs) -> Layer:
            return jdls.nnx.probes(Layer(rngs)) if probes else Layer(rngs)

        self.layers = create(rngs)

    def __call__(self, x, unrolled=False):
        h = self.embed(x)
        if unrolled:
            graphdef, state = nnx.split(self.layers)
            for i in range(DEPTH):
                h = nnx.merge(graphdef, jax.tree_util.tree_map(lambda v, i=i: v[i], state))(h)
            return h

        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
        @nnx.remat
        def forward(h, layer):
            return layer(h)

        return forward(h, self.layers)


@pytest.mark.parametrize("jit", [True, False], ids=["nnx.jit", "eager"])
@pytest.mark.full  # about 8 s; the quick run probes a stack in tests/test_nnx_sites.py
def test_a_scanned_stack_gets_a_stacked_probe_per_use(jit: bool) -> None:
    x = jax.random.normal(jax.random.key(1), (5, 4))
    model = jdls.nnx.probes(Stack(nnx.Rngs(0)), x)
    site = model.layers.drop.jdls_probe.get_value()
    assert getattr(model.layers.drop, "jdls_probe#2").get_value().value.shape == (DEPTH, 6)
    assert site.value.shape == (DEPTH, 6)

    def loss(m, x, unrolled=False):
        return jnp.sum(m(x, unrolled) ** 2)

    fn = jdls.nnx.value_and_grad(loss, jdls.StaticScale(SCALE))
    _, grads = (nnx.jit(fn) if jit else fn)(nnx.clone(model), x)
    t = _measured(grads)
    rows = ("layers/drop", "layers/linear", "layers/drop#2", "layers")
    assert t.names == ("embed", *(f"{r}[{i}]" for i in range(DEPTH) for r in rows), "Stack")
    assert np.asarray(t.uses).tolist() == [1.0] * len(t.names)
    unrolled = jdls.nnx.value_and_grad(lambda m, x: loss(m, x, True), jdls.StaticScale(SCALE))
    _, ref_grads = unrolled(nnx.clone(model), x)
    ref = _measured(ref_grads)
    assert ref.names == t.names  # unrolled, each slice of a stacked probe is its own site
    np.testing.assert_allclose(t.amax, ref.amax, rtol=1e-6)
    bare = maybe_jit(nnx.grad(loss), jit)(Stack(nnx.Rngs(0), probes=False), x)
    _assert_same_param_grads(grads, bare)


class Nested(nnx.Module):
    """``__call__`` calls the module's own public method: one call, one probe (the
    outermost method's), as jdls.linen.probes does."""

    def __init__(self) -> None:
        self.linear = nnx.Linear(3, 3, rngs=nnx.Rngs(0))

    def project(self, x):
        return self.linear(x)

    def __call__(self, x):
        return jnp.tanh(self.project(x))


def test_a_method_calling_another_of_its_module_gives_one_row() -> None:
    x = jnp.ones((2, 3))
    loss = jdls.nnx.value_and_grad(lambda m, x: jnp.sum(m(x)), jdls.StaticScale(SCALE))
    model = jdls.nnx.probes(Nested(), x)
    assert jdls.Telemetry.of(loss(model, x)[1]).names == ("linear", "Nested")
    # called alone, the method has its own row; without inputs it has a probe, unused here
    bare = jdls.nnx.probes(Nested())
    t = jdls.Telemetry.of(loss(bare, x)[1])
    assert t.names == ("linear", "Nested", "Nested.project")
    assert np.asarray(t.uses).tolist() == [1.0, 1.0, 0.0]


def test_probes_called_again_keep_the_probes_and_bad_inputs_say_so() -> None:
    model = jdls.nnx.probes(Model(nnx.Rngs(0)), TOKENS)
    before = nnx.state(model, jdls.nnx.SiteVariable)
    jdls.nnx.probes(model, TOKENS)
    after = nnx.state(model, jdls.nnx.SiteVariable)
    assert jax.tree_util.tree_structure(before) == jax.tree_util.tree_structure(after)
    with pytest.raises(ValueError, match="could not be run on the example inputs"):
        jdls.nnx.probes(Model(nnx.Rngs(0)), jnp.ones((2, 4, 5)))


@pytest.mark.full  # about 5 s; tests/test_sites.py keeps stacked sites in the quick run
@with_and_without_jit
def test_stacked_names_a_vmap_stack_from_outside(jit) -> None:
    """``stacked=`` probes a stack made by ``nnx.vmap`` from outside its constructor: the
    same rows, measurements and gradients as probes put in inside it (the reference), where
    without it the example pass fails with an error naming ``stacked=``."""
    x = jax.random.normal(jax.random.key(1), (5, 4))

    def loss(m, x):
        return jnp.sum(m(x) ** 2)

    fn = maybe_jit(jdls.nnx.value_and_grad(loss, jdls.StaticScale(SCALE)), jit)
    model = jdls.nnx.probes(Stack(nnx.Rngs(0), probes=False), x, stacked=lambda m: m.layers)
    _, grads = fn(model, x)
    _, ref_grads = fn(jdls.nnx.probes(Stack(nnx.Rngs(0)), x), x)
    t, ref = _measured(grads), _measured(ref_grads)
    assert t.names == ref.names
    assert "layers/drop#2[2]" in t.names
    np.testing.assert_array_equal(t.amax, ref.amax)
    _assert_same_param_grads(grads, nnx.state(ref_grads, nnx.Not(jdls.nnx.SiteVariable)))
    with pytest.raises(ValueError, match=r"stacked=lambda m: m.layers"):
        jdls.nnx.probes(Stack(nnx.Rngs(0), probes=False), x)


def test_stacked_naming_a_module_that_is_not_a_stack_says_so() -> None:
    """A square ``nnx.Linear`` (kernel and bias share a leading axis) named by ``stacked=``
    gets a stack of probes; called as one layer in the example pass, it fails naming
    ``stacked=``."""
    model = nnx.Sequential(nnx.Linear(3, 3, rngs=nnx.Rngs(0)), jnp.tanh)
    with pytest.raises(ValueError, match=r"called outside a loop over the layers.*stacked="):
        jdls.nnx.probes(model, jnp.ones((2, 3)), stacked=lambda m: m.layers[0])
