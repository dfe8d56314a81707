"""Probes and per-layer scales put into an Equinox model by ``jdls.equinox.probes`` and
``jdls.equinox.layer_scales``, on a small Llama-like model written as Equinox codebases write
one: an embedding, a stack of layers made by ``eqx.filter_vmap`` and run by ``lax.scan`` of
``eqx.filter_checkpoint`` bodies, a final RMSNorm and a head of the codebase's own Linear.

* the sites are in forward order (embed, layers[0..3], norm, head), a row or scale per layer;
* the gradients are ``jax.value_and_grad``'s of the unwrapped model (float32);
* ``first_nonfinite()`` names the layer where an overflow starts;
* float16 trains with a scale per layer, behind ``jdls.clip`` or ``optax.clip_by_global_norm``
  (which count no site), in a ``jax.jit`` step taking the static half as a static argument;
* the sites survive a checkpoint filtered by ``jdls.equinox.checkpointed``, and the inexact
  filter's loss of their counters is pinned.
"""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _helpers import assert_bitwise_equal

import jdls

eqx = pytest.importorskip("equinox")
import jdls.equinox  # noqa: E402  (after the skip: it imports Equinox)

VOCAB, WIDTH, DEPTH, LENGTH, BATCH = 16, 8, 4, 6, 4
ROWS = ("embed", "layers[0]", "layers[1]", "layers[2]", "layers[3]", "norm", "head")


class Linear(eqx.Module):
    """The codebase's own Linear: no bias, on a batch of any leading shape."""

    weight: jax.Array

    def __init__(self, n_in: int, n_out: int, key: jax.Array):
        self.weight = jax.random.normal(key, (n_out, n_in)) / n_in**0.5

    def __call__(self, x: jax.Array) -> jax.Array:
        return x @ self.weight.T.astype(x.dtype)


class RMSNorm(eqx.Module):
    weight: jax.Array
    eps: float = eqx.field(static=True, default=1e-5)

    def __init__(self, width: int):
        self.weight = jnp.ones(width)

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        y = x32 * jax.lax.rsqrt(jnp.mean(x32**2, axis=-1, keepdims=True) + self.eps)
        return (y * self.weight).astype(x.dtype)


class Layer(eqx.Module):
    """A pre-norm residual block: causal attention (one head), then an MLP."""

    attn_norm: RMSNorm
    qkv: Linear
    out: Linear
    mlp_norm: RMSNorm
    up: Linear
    down: Linear

    def __init__(self, key: jax.Array):
        keys = jax.random.split(key, 4)
        self.attn_norm, self.mlp_norm = RMSNorm(WIDTH), RMSNorm(WIDTH)
        self.qkv = Linear(WIDTH, 3 * WIDTH, keys[0])
        self.out = Linear(WIDTH, WIDTH, keys[1])
        self.up = Linear(WIDTH, 2 * WIDTH, keys[2])
        self.down = Linear(2 * WIDTH, WIDTH, keys[3])

    def __call__(self, h: jax.Array) -> jax.Array:  # (batch, length, width)
        q, k, v = jnp.split(self.qkv(self.attn_norm(h)), 3, axis=-1)
        scores = (q @ jnp.swapaxes(k, -1, -2)).astype(jnp.float32) / WIDTH**0.5
        causal = jnp.tril(jnp.ones((h.shape[-2], h.shape[-2]), bool))
        weights = jax.nn.softmax(jnp.where(causal, scores, -jnp.inf), axis=-1)
        h = h + self.out(weights.astype(h.dtype) @ v)
        return h + self.down(jax.nn.silu(self.up(self.mlp_norm(h))))


class Llama(eqx.Module):
    embed: eqx.nn.Embedding
    layers: Layer  # a stack: every array has a leading axis of DEPTH
    norm: RMSNorm
    head: Linear

    def __init__(self, key: jax.Array):
        keys = jax.random.split(key, DEPTH + 2)
        self.embed = eqx.nn.Embedding(VOCAB, WIDTH, key=keys[0])
        self.layers = eqx.filter_vmap(Layer)(keys[1 : DEPTH + 1])
        self.norm = RMSNorm(WIDTH)
        self.head = Linear(WIDTH, VOCAB, keys[DEPTH + 1])

    def __call__(self, tokens: jax.Array, dtype=jnp.float32) -> jax.Array:
        h = jax.vmap(jax.vmap(self.embed))(tokens).astype(dtype)
        dynamic, static = eqx.partition(self.layers, eqx.is_array)

        @eqx.filter_checkpoint
        def body(h, layer):
            return eqx.combine(layer, static)(h), None

        h, _ = jax.lax.scan(body, h, dynamic)
        return self.head(self.norm(h))


def half(model):
    """The model's weights in float16 (its sites as they are)."""
    return jax.tree_util.tree_map(
        lambda p: p.astype(jnp.float16) if eqx.is_inexact_array(p) else p,
        model,
        is_leaf=jdls.is_site,
    )


def loss_fn(model, tokens, targets):
    logits = model(tokens).astype(jnp.float32)
    return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, targets))


def half_loss(model, tokens, targets):
    logits = half(model)(tokens, jnp.float16).astype(jnp.float32)
    return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, targets))


def batch(seed=0):
    tokens = jax.random.randint(jax.random.key(seed), (BATCH, LENGTH + 1), 0, VOCAB)
    return tokens[:, :-1], tokens[:, 1:]


STACKED = dict(stacked=lambda m: m.layers)


def probed(seed=0):
    return jdls.equinox.probes(Llama(jax.random.key(seed)), **STACKED)


def scaled(scale=None, seed=0):
    scale = jdls.AdaptiveScale(2.0**10) if scale is None else scale
    return jdls.equinox.layer_scales(Llama(jax.random.key(seed)), scale, **STACKED)


def assert_close_tree(a, b, rtol=1e-5):
    la, lb = jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)
    assert len(la) == len(lb)
    for x, y in zip(la, lb, strict=True):
        scale = float(jnp.max(jnp.abs(y))) or 1.0
        np.testing.assert_allclose(x, y, rtol=rtol, atol=1e-6 * scale)


def params_of(grads):
    """The parameters' gradients of a model with sites, as the bare model's tree."""
    return eqx.filter(jdls.equinox.unwrap(jdls.split_sites(grads)[0]), eqx.is_array)


# --------------------------------------------------------------------------------------------
# Probes.
# --------------------------------------------------------------------------------------------


@pytest.mark.full
def test_probes_wrap_the_top_level_modules_and_keep_the_model_working():
    bare = Llama(jax.random.key(0))
    model = probed()
    assert all(
        isinstance(m, jdls.equinox.Sited)
        for m in (model.embed, model.layers, model.norm, model.head)
    )
    assert model.layers.probe.value.shape == (DEPTH, 6)  # stacked with the layers
    assert model.head.weight is model.head.jdls_wrapped.weight  # attributes reach through
    zeroed = eqx.tree_at(lambda m: m.head.weight, model, jnp.zeros((VOCAB, WIDTH)))
    assert not bool(jnp.any(zeroed.head.jdls_wrapped.weight))  # and so does eqx.tree_at
    tokens, _ = batch()
    assert_bitwise_equal(model(tokens), bare(tokens))
    assert_bitwise_equal(jdls.equinox.unwrap(model), bare)


@pytest.mark.parametrize("jit", [True, False], ids=["jit", "eager"])
@pytest.mark.full  # 14 s; the quick run reads Equinox probe rows in test_first_nonfinite_names_where_an_overflow_in_layer_2_starts
def test_probe_rows_in_forward_order_and_gradients_exact(jit):
    model, (tokens, targets) = probed(), batch()
    scale = jdls.StaticScale(2.0**8)
    fn = jdls.equinox.value_and_grad(loss_fn, scale)
    loss, grads = (eqx.filter_jit(fn) if jit else fn)(model, tokens, targets)
    bare = jdls.equinox.unwrap(model)
    ref_loss, ref = jax.jit(jax.value_and_grad(loss_fn))(bare, tokens, targets)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
    assert_close_tree(params_of(grads), eqx.filter(ref, eqx.is_array))
    t = jdls.Telemetry.of(grads)
    assert t.names == ROWS
    # the embedding runs per token (jax.vmap): its one probe serves every use, and JAX adds
    # up their measurements; the others run on the batch, once
    assert np.asarray(t.uses).tolist() == [BATCH * LENGTH, 1, 1, 1, 1, 1, 1]
    assert bool(jnp.isnan(t.amax[0])) and bool(jnp.all(jnp.isfinite(t.amax[1:])))
    assert t.first_nonfinite() is None


@jax.custom_vjp
def backward_gain(x, gain):
    """The identity forward; backward, the cotangent times ``gain`` (rounded to its dtype)."""
    return x


def _gain_fwd(x, gain):
    return x, gain


def _gain_bwd(gain, g):
    return (g.astype(jnp.float32) * gain).astype(g.dtype), jnp.zeros_like(gain)


backward_gain.defvjp(_gain_fwd, _gain_bwd)


class Overflowing(eqx.Module):
    """``Layer`` whose backward pass multiplies the cotangent by ``gain[k]`` in layer ``k``."""

    layer: Layer
    gain: jax.Array

    def __call__(self, h):
        return backward_gain(self.layer(h), self.gain)


@pytest.mark.full  # about 8 s; tests/test_probe.py keeps first_nonfinite in the quick run
def test_first_nonfinite_names_where_an_overflow_in_layer_2_starts():
    """Layer 2's backward pass overflows float16: the probes after it in forward order
    (layers[2]'s output and above, reached first) stay finite, those before it go inf;
    ``first_nonfinite()`` names the first row the backward pass reached non-finite, layer 2's
    input, the output of layers[1]: the overflow is in the layer after it."""
    model = Llama(jax.random.key(0))
    gains = jnp.array([1.0, 1.0, 2.0**20, 1.0])
    model = eqx.tree_at(lambda m: m.layers, model, Overflowing(model.layers, gains))
    model = jdls.equinox.probes(model, **STACKED)
    tokens, targets = batch()
    fn = jdls.equinox.value_and_grad(half_loss, jdls.StaticScale(2.0**10))
    _, grads = eqx.filter_jit(fn)(model, tokens, targets)
    t = jdls.Telemetry.of(grads)
    assert t.names == ROWS
    assert np.asarray(t.nonfinite).tolist() == [1, 1, 1, 0, 0, 0, 0]
    assert t.first_nonfinite() == "layers[1]"


# --------------------------------------------------------------------------------------------
# Per-layer scales.
# --------------------------------------------------------------------------------------------


LEVELS = [2.0**4, 2.0**20, 2.0**-3, 2.0**12, 2.0**7, 2.0**1, 2.0**9]


def test_each_layer_gets_its_own_scale_in_forward_order():
    model = scaled()
    levels = jdls.equinox.get_layer_scales(model)
    assert tuple(levels) == ROWS and all(float(v) == 2.0**10 for v in levels.values())
    model = jdls.equinox.set_layer_scales(model, LEVELS)
    assert [float(v) for v in jdls.equinox.get_layer_scales(model).values()] == LEVELS
    assert model.layers.layer_scale.value["scale"].loss_scale.shape == (DEPTH,)
    positions = [model.embed, model.layers, model.norm, model.head]
    assert [m.layer_scale.kind.position for m in positions] == [0, 1, 2, 3]
    # one scale for all, its rule with it
    model = jdls.equinox.set_layer_scales(model, jdls.StaticScale(4.0))
    assert {float(v) for v in jdls.equinox.get_layer_scales(model).values()} == {4.0}


@pytest.mark.parametrize("jit", [True, False], ids=["jit", "eager"])
@pytest.mark.full  # about 5 s; the linen and NNX per-layer gradients stay in the quick run
def test_per_layer_gradients_equal_the_unwrapped_models(jit):
    model = jdls.equinox.set_layer_scales(scaled(), LEVELS)
    tokens, targets = batch()
    fn = jdls.equinox.layer_scaled_value_and_grad(loss_fn)
    loss, grads = (eqx.filter_jit(fn) if jit else fn)(model, tokens, targets)
    ref_loss, ref = jax.jit(jax.value_and_grad(loss_fn))(
        jdls.equinox.unwrap(model), tokens, targets
    )
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
    assert_close_tree(params_of(grads), eqx.filter(ref, eqx.is_array))
    measured = jdls.split_sites(grads)[1]
    assert measured.layers.layer_scale.value["amax"].shape == (DEPTH,)
    assert bool(jnp.all(measured.layers.layer_scale.value["finite"] == 1.0))


@pytest.mark.full
def test_probes_and_layer_scales_share_one_wrapper():
    model = jdls.equinox.probes(scaled(), **STACKED)
    assert model.layers.probe is not None and model.layers.layer_scale is not None
    assert isinstance(model.layers.jdls_wrapped, Layer)
    tokens, targets = batch()
    _, grads = jdls.equinox.layer_scaled_value_and_grad(loss_fn)(model, tokens, targets)
    assert jdls.Telemetry.of(grads).names == ROWS


def make_step(tx, loss=half_loss):
    """A ``jax.jit`` step taking the model's static half as a static argument."""

    @functools.partial(jax.jit, static_argnums=1)
    def step(params, static, opt_state, tokens, targets):
        model = eqx.combine(params, static)
        value, grads = jdls.equinox.layer_scaled_value_and_grad(loss)(model, tokens, targets)
        updates, opt_state = tx.update(grads, opt_state, eqx.filter(model, eqx.is_array))
        model = jdls.equinox.apply_updates(model, updates, opt_state)
        return eqx.filter(model, eqx.is_array), opt_state, value

    return step


def train(model, tx, steps, step=None):
    step = step or make_step(tx)
    params, static = eqx.partition(model, eqx.is_array)
    opt_state = tx.init(params)
    losses = []
    for _ in range(steps):
        params, opt_state, value = step(params, static, opt_state, *batch())
        losses.append(float(value))
    return eqx.combine(params, static), opt_state, losses


CLIPS = {
    "jdls.clip": lambda inner: optax.chain(jdls.clip(1.0), inner),
    "optax.clip_by_global_norm": lambda inner: optax.chain(optax.clip_by_global_norm(1.0), inner),
}


@pytest.mark.parametrize("clip", list(CLIPS))
@pytest.mark.full  # about 5 s; the rows and gradients tests stay quick
def test_float16_trains_with_a_scale_per_layer(clip):
    tx = CLIPS[clip](jdls.wrap(optax.adam(1e-2), jdls.NoOpScale()))
    traces = []
    step = make_step(tx, loss=lambda *a: (traces.append(1), half_loss(*a))[1])
    model, opt_state, losses = train(scaled(jdls.AdaptiveScale()), tx, 5, step)
    assert len(traces) == 1  # the static half is hashable and equal step after step
    assert losses[-1] < losses[0] and all(np.isfinite(losses))
    assert int(jdls.stats(opt_state).skipped_steps) == 0
    levels = jdls.equinox.get_layer_scales(model)
    assert tuple(levels) == ROWS
    assert len({float(v) for v in levels.values()}) > 1  # each layer its own headroom
    # the rule moved every scale from its start (1) to its layer's gradients
    assert all(float(v) > 1.0 for v in levels.values())


@pytest.mark.parametrize("clip", list(CLIPS))
@pytest.mark.full
def test_a_clip_in_front_counts_no_site(clip):
    """The clip in front of the wrap sees the parameters' gradients only: the step equals the
    one computed from the unwrapped model's gradients, clipped by their own norm."""
    model = jdls.equinox.set_layer_scales(scaled(), LEVELS)
    tokens, targets = batch()
    tx = CLIPS[clip](jdls.wrap(optax.sgd(1.0), jdls.NoOpScale()))
    params, static = eqx.partition(model, eqx.is_array)
    new, opt_state, _ = make_step(tx, loss_fn)(params, static, tx.init(params), tokens, targets)
    bare = jdls.equinox.unwrap(model)
    ref = eqx.filter(jax.jit(jax.grad(loss_fn))(bare, tokens, targets), eqx.is_array)
    norm = optax.tree.norm(ref)
    assert float(norm) > 1.0  # the clip acts
    expected = jax.tree_util.tree_map(
        lambda p, g: p - g / norm, eqx.filter(bare, eqx.is_array), ref
    )
    got = eqx.filter(jdls.equinox.unwrap(eqx.combine(new, static)), eqx.is_array)
    assert_close_tree(got, expected)
    if clip == "jdls.clip":  # it hands the norm it received to the wrap (optax's does not)
        np.testing.assert_allclose(jdls.stats(opt_state).grad_norm, norm, rtol=1e-5)


@pytest.mark.full
def test_probes_train_with_the_global_scale():
    """Probes with one global scale (``jdls.wrap``'s default): the README's step, with
    ``jdls.equinox.apply_updates`` recording each probe's measurement in the model."""
    tx = optax.chain(jdls.clip(1.0), jdls.wrap(optax.adam(1e-2)))
    model, (tokens, targets) = probed(), batch()
    opt_state = tx.init(eqx.filter(model, eqx.is_array))

    @eqx.filter_jit
    def step(model, opt_state):
        scale = jdls.get_scale(opt_state)
        loss, grads = jdls.equinox.value_and_grad(half_loss, scale)(model, tokens, targets)
        updates, opt_state = tx.update(grads, opt_state, eqx.filter(model, eqx.is_array))
        return jdls.equinox.apply_updates(model, updates, opt_state), opt_state, loss

    losses = []
    for _ in range(5):
        model, opt_state, loss = step(model, opt_state)
        losses.append(float(loss))
    assert losses[-1] < losses[0]
    t = jdls.Telemetry.of(model)  # the last step's measurements, in the model
    assert t.names == ROWS and np.asarray(t.uses)[1:].tolist() == [1.0] * 6


# --------------------------------------------------------------------------------------------
# Checkpoints.
# --------------------------------------------------------------------------------------------


@pytest.mark.full
def test_checkpoint_round_trip_keeps_the_sites_counters(tmp_path):
    """Saved with ``jdls.equinox.checkpointed`` (the inexact filter keeping the sites whole),
    restored into a fresh model: bit for bit, and the next step is the uninterrupted one's.
    The inexact filter alone restores the counters from the template: pinned here."""
    tx = jdls.wrap(optax.adam(1e-2), jdls.NoOpScale())
    model = scaled(jdls.DynamicScale(2.0**6, growth_interval=3))
    model, opt_state, _ = train(model, tx, 2)
    counter = lambda m: m.layers.layer_scale.value["scale"].state.counter  # noqa: E731
    assert np.asarray(counter(model)).tolist() == [2] * DEPTH

    path = tmp_path / "model.eqx"
    eqx.tree_serialise_leaves(path, (jdls.equinox.checkpointed(model), opt_state))
    template = scaled(jdls.DynamicScale(2.0**6, growth_interval=3), seed=1)
    saved, restored_state = eqx.tree_deserialise_leaves(
        path, (jdls.equinox.checkpointed(template), tx.init(eqx.filter(template, eqx.is_array)))
    )
    restored = eqx.combine(saved, template)
    assert_bitwise_equal(eqx.filter(restored, eqx.is_array), eqx.filter(model, eqx.is_array))
    step = make_step(tx)
    params, static = eqx.partition(model, eqx.is_array)
    a = step(params, static, opt_state, *batch())
    b = step(eqx.filter(restored, eqx.is_array), static, restored_state, *batch())
    assert_bitwise_equal(a, b)

    naive = tmp_path / "naive.eqx"
    eqx.tree_serialise_leaves(naive, eqx.filter(model, eqx.is_inexact_array))
    loaded = eqx.tree_deserialise_leaves(naive, eqx.filter(template, eqx.is_inexact_array))
    reset = eqx.combine(loaded, template)
    assert np.asarray(counter(reset)).tolist() == [0] * DEPTH  # the template's, not the run's


# --------------------------------------------------------------------------------------------
# Choosing the modules, and the errors.
# --------------------------------------------------------------------------------------------


@pytest.mark.full
def test_where_chooses_the_modules_by_function_or_class():
    model = Llama(jax.random.key(0))
    inner = jdls.equinox.probes(model, where=Linear, **STACKED)
    tokens, targets = batch()
    _, grads = jdls.equinox.value_and_grad(loss_fn, jdls.StaticScale(1.0))(inner, tokens, targets)
    names = jdls.Telemetry.of(grads).names
    layer = [f"layers/{n}[{k}]" for k in range(DEPTH) for n in ("qkv", "out", "up", "down")]
    # tree order: each layer's Linears in their fields' order, the stack layer by layer
    assert names == (*layer, "head")
    chosen = jdls.equinox.probes(model, where=lambda m: (m.embed, m.head))
    assert isinstance(chosen.head, jdls.equinox.Sited) and isinstance(chosen.layers, Layer)


def test_layers_out_of_forward_order_are_refused():
    model = Llama(jax.random.key(0))
    backwards = jdls.equinox.layer_scales(
        model, jdls.StaticScale(1.0), where=lambda m: (m.head, m.norm, m.layers, m.embed), **STACKED
    )
    with pytest.raises(ValueError, match=re.escape("in the order of positions [3, 2, 1, 0]")):
        jdls.equinox.layer_scaled_value_and_grad(loss_fn)(backwards, *batch())


def test_a_stack_not_named_stacked_is_refused_by_scan():
    """Without ``stacked=``, the stack's site is one module's: ``lax.scan`` refuses to slice
    it with the layers (docs/equinox.md quotes the message)."""
    model = jdls.equinox.probes(Llama(jax.random.key(0)))
    with pytest.raises(ValueError, match="scan got values with different leading axis sizes"):
        model(batch()[0])
    model = jdls.equinox.layer_scales(Llama(jax.random.key(0)), jdls.StaticScale(1.0))
    with pytest.raises(IndexError):  # a per-layer scale's scalars: no leading axis
        model(batch()[0])


def test_errors_name_the_fix():
    model = Llama(jax.random.key(0))
    with pytest.raises(ValueError, match="do not share a leading axis"):
        jdls.equinox.probes(model, stacked=lambda m: m)
    with pytest.raises(TypeError, match="not an eqx.Module"):
        jdls.equinox.probes(model, where=lambda m: m.head.weight)
    not_a_stack = jdls.equinox.probes(model, where=lambda m: m.head, stacked=lambda m: m.head)
    with pytest.raises(ValueError, match="called whole, not one layer at a time"):
        not_a_stack.head(jnp.ones(WIDTH))
    with pytest.raises(ValueError, match="holds a probe already"):
        jdls.equinox.probes(probed(), **STACKED)
    with pytest.raises(ValueError, match=re.escape("has 7 layers with a scale")):
        jdls.equinox.set_layer_scales(scaled(), [1.0, 2.0])
    with pytest.raises(ValueError, match="holds no per-layer scale"):
        jdls.equinox.set_layer_scales(probed(), jdls.StaticScale(1.0))


def test_a_layer_called_twice_is_refused_with_per_layer_scales() -> None:
    class Twice(eqx.Module):
        embed: eqx.nn.Linear
        shared: eqx.nn.Linear
        head: eqx.nn.Linear

        def __init__(self, key):
            k = jax.random.split(key, 3)
            self.embed = eqx.nn.Linear(3, 4, key=k[0])
            self.shared = eqx.nn.Linear(4, 4, key=k[1])
            self.head = eqx.nn.Linear(4, 1, key=k[2])

        def __call__(self, x):
            return self.head(jnp.tanh(self.shared(jnp.tanh(self.shared(self.embed(x))))))

    model = jdls.equinox.layer_scales(Twice(jax.random.key(0)), jdls.StaticScale(2.0))
    loss = lambda m: jnp.sum(m(jnp.ones(3)))  # noqa: E731
    with pytest.raises(ValueError, match=r"position\(s\) \[1\] was applied more than once"):
        jdls.equinox.layer_scaled_value_and_grad(loss)(model)


def _frozen(model, select, keep_sites):
    """Equinox's fine-tuning filter: ``select`` frozen; with ``keep_sites``, the sites stay
    trainable (the fix jdls's refusal names)."""
    spec = jax.tree_util.tree_map(eqx.is_array, model)
    spec = eqx.tree_at(
        select, spec, replace_fn=lambda s: jax.tree_util.tree_map(lambda _: False, s)
    )
    if keep_sites:
        spec = jax.tree_util.tree_map(
            lambda s, x: True if jdls.is_site(x) else s, spec, model, is_leaf=jdls.is_site
        )
    return eqx.partition(model, spec)


@pytest.mark.full  # about 14 s; tests/test_sites.py refuses a halved site in the quick run
def test_a_frozen_layer_keeps_its_sites_or_is_refused_naming_the_fix():
    """A filter that freezes a layer with its site (or ``eqx.is_inexact_array``, which moves a
    scale's integer counters to the static half) is refused where the half is differentiated
    or given to ``tx.init``, naming the fix; with the sites kept trainable the gradients are
    those of the frozen unwrapped model, and a jitted step trains the layers not frozen."""
    model = jdls.equinox.set_layer_scales(scaled(), LEVELS)
    tokens, targets = batch()
    tx = jdls.wrap(optax.sgd(0.1), jdls.NoOpScale())
    for diff, static in (
        _frozen(model, lambda m: m.head, keep_sites=False),
        eqx.partition(model, eqx.is_inexact_array),
    ):
        fn = jdls.equinox.layer_scaled_value_and_grad(
            lambda d, *b, static=static: loss_fn(eqx.combine(d, static), *b)
        )
        with pytest.raises(ValueError, match=r"freeze a layer's parameters but not its sites"):
            fn(diff, tokens, targets)
        with pytest.raises(ValueError, match=r"tx.init: the \w+ site at .* holds None"):
            tx.init(diff)

    diff, static = _frozen(model, lambda m: m.head, keep_sites=True)

    def loss(d, tokens, targets):
        return loss_fn(eqx.combine(d, static), tokens, targets)

    _, grads = jdls.equinox.layer_scaled_value_and_grad(loss)(diff, tokens, targets)
    bare_diff, bare_static = _frozen(jdls.equinox.unwrap(model), lambda m: m.head, False)
    want = jax.grad(lambda d: loss_fn(eqx.combine(d, bare_static), tokens, targets))(bare_diff)
    assert grads.head.jdls_wrapped.weight is None
    assert_close_tree(params_of(grads), eqx.filter(want, eqx.is_array))

    @eqx.filter_jit
    def step(diff, opt_state):
        _, grads = jdls.equinox.layer_scaled_value_and_grad(loss)(diff, tokens, targets)
        updates, opt_state = tx.update(grads, opt_state, diff)
        return jdls.equinox.apply_updates(diff, updates, opt_state), opt_state

    new, _ = step(diff, tx.init(diff))
    assert not np.array_equal(new.layers.jdls_wrapped.up.weight, diff.layers.jdls_wrapped.up.weight)
    assert new.head.jdls_wrapped.weight is None  # the frozen head stays in the static half
