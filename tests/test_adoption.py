"""Traps met porting real scanned language models to jdls (Gemma in Flax linen, Llama 3 in
Equinox): a missing ``"jdls"`` collection named by its cause, a codebase's own NaN guard
beside jdls's skips, the model's own overflow named, an Equinox model's static half
hashable for ``jax.jit(..., static_argnums=...)``, a first float16 step whose gradients all
flushed (a small loss weight) skipped rather than counted, and probe rows that explain
themselves (a row per module call and per method, a shared site's uses and fix)."""

from __future__ import annotations

import functools
import warnings

import flax.errors
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _helpers import assert_bitwise_equal

import jdls

WIDTH, DEPTH = 4, 2

# --------------------------------------------------------------------------------------------
# A missing "jdls" collection: the error names the fix.
# --------------------------------------------------------------------------------------------

_FP8 = functools.partial(jdls.fp8.linen.DotGeneral, recipe=jdls.fp8.DelayedScaling(4))


class _Block(nn.Module):
    fp8: bool = False

    @nn.compact
    def __call__(self, h, _):
        dot = {"dot_general_cls": _FP8} if self.fp8 else {}
        return jnp.tanh(nn.Dense(WIDTH, **dot)(h)), None


class _LM(nn.Module):
    """A Gemma-like stack: an embedding, then the blocks under nn.scan."""

    axes: tuple[str, ...] = ("params", "jdls")
    fp8: bool = False

    @nn.compact
    def __call__(self, x):
        h = x if self.fp8 else nn.Dense(WIDTH, name="embed")(x)
        stack = nn.scan(
            _Block,
            variable_axes=dict.fromkeys(self.axes, 0),
            split_rngs={"params": True},
            length=DEPTH,
        )
        return stack(self.fp8, name="layers")(h, None)[0]


_X = jnp.ones((2, WIDTH))
_SCAN_LINE = 'variable_axes={"params": 0, "jdls": 0}'
_INIT_LINE = 'mutable=["params", "jdls"]'
_EVAL_LINE = 'model.apply({"params": params, "jdls": variables["jdls"]}'

_MODELS = {
    "probes": lambda axes: jdls.linen.probes(_LM(axes)),
    "layer_scales": lambda axes: jdls.linen.layer_scales(_LM(axes), jdls.StaticScale(8.0)),
    "fp8": lambda axes: _LM(axes, fp8=True),
}


def _raises(call, *lines):
    """The error is a Flax ScopeCollectionNotFound (and a ValueError) quoting ``lines``."""
    with pytest.raises(flax.errors.ScopeCollectionNotFound) as info:
        call()
    assert isinstance(info.value, ValueError)
    for line in lines:
        assert line in str(info.value), str(info.value)
    return str(info.value)


@pytest.mark.parametrize("sites", list(_MODELS))
def test_a_scan_without_jdls_in_variable_axes_is_named(sites):
    """``"jdls": 0`` missing from nn.scan's variable_axes: init and a jitted init say so, and
    name only that fix."""
    model = _MODELS[sites](("params",))
    message = _raises(lambda: model.init(jax.random.key(0), _X), _SCAN_LINE, "nn.scan")
    assert _INIT_LINE not in message and _EVAL_LINE not in message
    _raises(lambda: jax.jit(model.init)(jax.random.key(0), _X), _SCAN_LINE)


@pytest.mark.parametrize("sites", list(_MODELS))
def test_an_apply_used_as_init_without_jdls_in_mutable_is_named(sites):
    """The codebase's own init, ``model.apply(..., mutable=["params"])``: the error says to
    add "jdls" to mutable."""
    model = _MODELS[sites](("params", "jdls"))
    rngs = {"params": jax.random.key(0)}
    _raises(lambda: model.apply({}, _X, rngs=rngs, mutable=["params"]), _INIT_LINE)
    _, variables = model.apply({}, _X, rngs=rngs, mutable=["params", "jdls"])  # the fix
    assert sorted(variables) == ["jdls", "params"]


def test_an_fp8_evaluation_with_params_only_is_named():
    """An evaluator applying ``{"params": ...}`` only to an FP8 model (whose dots compute
    with their sites): the error shows the apply with the sites, eagerly and under jit; with
    them the model runs."""
    model = _MODELS["fp8"](("params", "jdls"))
    variables = model.init(jax.random.key(0), _X)
    params_only = {"params": variables["params"]}
    _raises(lambda: model.apply(params_only, _X), _EVAL_LINE)
    _raises(lambda: jax.jit(model.apply)(params_only, _X), _EVAL_LINE)
    assert model.apply(variables, _X).shape == _X.shape


@pytest.mark.parametrize("sites", ["probes", "layer_scales"])
def test_a_measuring_model_evaluated_with_params_only_is_the_bare_model(sites):
    """Probes and per-layer scales only measure and scale the backward pass: an evaluator or
    sampler applying ``{"params": ...}`` only gets the bare model's output, bit for bit,
    eagerly and under jit (and the model with its sites gives the same)."""
    model = _MODELS[sites](("params", "jdls"))
    variables = model.init(jax.random.key(0), _X)
    params_only = {"params": variables["params"]}
    bare = _LM(("params", "jdls")).apply(params_only, _X)
    assert_bitwise_equal(model.apply(params_only, _X), bare)
    assert_bitwise_equal(
        jax.jit(model.apply)(params_only, _X),
        jax.jit(_LM(("params", "jdls")).apply)(params_only, _X),
    )
    assert_bitwise_equal(model.apply(variables, _X), bare)


def test_the_error_inside_a_scan_names_the_scan_and_the_path():
    """Where the first missing site is inside the scan (no module before it), the error
    points there: the scan's path and the site's."""
    model = _LM(("params",), fp8=True)
    message = _raises(lambda: model.init(jax.random.key(0), _X), "/scan(layers)")
    assert 'the FP8 dot site "fp8"' in message


def test_variables_of_another_model_are_named():
    """Sites of the probes given to a model whose sites are per-layer scales: the variables
    came from another model."""
    probed = jdls.linen.probes(_LM())
    scaled = jdls.linen.layer_scales(_LM(), jdls.StaticScale(8.0))
    variables = probed.init(jax.random.key(0), _X)
    _raises(lambda: scaled.apply(variables, _X), "made by another model")


def test_the_error_pickles():
    """The error survives a process boundary (a multi-host launcher re-raising it)."""
    import pickle

    model = _MODELS["probes"](("params",))
    with pytest.raises(flax.errors.ScopeCollectionNotFound) as info:
        model.init(jax.random.key(0), _X)
    again = pickle.loads(pickle.dumps(info.value))
    assert type(again) is type(info.value) and str(again) == str(info.value)


# --------------------------------------------------------------------------------------------
# An Equinox model's static half is hashable: jax.jit(step, static_argnums=...) takes it.
# --------------------------------------------------------------------------------------------


@functools.cache
def _layer_class():
    eqx = pytest.importorskip("equinox")

    class Layer(eqx.Module):
        """A Llama-like layer with a probe and a per-layer scale among its fields."""

        weight: jax.Array
        probe: jdls.Site
        layer_scale: jdls.Site

        def __call__(self, x):
            h = jdls.apply_site(jnp.tanh(x @ self.weight), self.probe)
            return jdls.apply_site(h, self.layer_scale)

    return Layer


def _llama_like_layer():
    return _layer_class()(
        jnp.eye(WIDTH), jdls.Site(jdls.Probe()), jdls.layer_site(jdls.DynamicScale(2.0**4), 0)
    )


def test_an_equinox_static_half_with_sites_is_a_static_argument():
    """``eqx.partition(model, eqx.is_array)``'s static half, holding a probe and a per-layer
    scale (whose value is a dict), is hashable; two equal halves hash equal, so a jitted step
    taking it as a static argument runs, and compiles once for both."""
    import equinox as eqx

    dynamic, static = eqx.partition(_llama_like_layer(), eqx.is_array)
    _, again = eqx.partition(_llama_like_layer(), eqx.is_array)
    assert static == again and hash(static) == hash(again)
    traces = []

    @functools.partial(jax.jit, static_argnums=1)
    def step(dynamic, static, x):
        traces.append(1)

        def loss(d):
            return jnp.sum(eqx.combine(d, static)(x))

        return jdls.StaticScale(8.0).value_and_grad(loss)(dynamic)

    loss, grads = step(dynamic, static, _X)
    loss_again, _ = step(dynamic, again, _X)
    assert len(traces) == 1 and float(loss) == float(loss_again)
    assert float(jdls.Telemetry.of(grads.probe).uses[0]) == 1.0  # the probe measured


def test_a_site_with_arrays_stays_unhashable():
    """A site holding arrays is unhashable, as arrays are (no identity hash that a jit
    cache would mistake for equality)."""
    with pytest.raises(TypeError, match="unhashable"):
        hash(jdls.layer_site(jdls.DynamicScale(), 0))


# --------------------------------------------------------------------------------------------
# A loop's own checks: "skipped by jdls, and why" in one line.
# --------------------------------------------------------------------------------------------


def _f16_loss(params, x):
    h = x.astype(jnp.float16) * params["w"].astype(jnp.float16)
    return jnp.mean(h.astype(jnp.float32))


def _guarded_step(tx):
    @jax.jit
    def step(params, opt_state, x):
        loss, grads = jdls.get_scale(opt_state).value_and_grad(_f16_loss)(params, x)
        updates, opt_state = tx.update(grads, opt_state, params, value=loss)
        return optax.apply_updates(params, updates), opt_state, optax.tree.norm(grads)

    return step


def test_a_loops_nan_guard_lets_jdls_overflows_pass_and_stops_on_a_nan_loss():
    """The codebase's ``if not np.isfinite(grad_norm): raise``, with the documented line
    beside it: a backward overflow at 2**15 (skipped, the scale backs off) passes; a NaN
    batch (the loss itself) stops it, named FORWARD."""
    tx = jdls.wrap(optax.sgd(0.1), jdls.DynamicScale())
    params = {"w": jnp.ones(4)}
    opt_state = tx.init(params)
    step = _guarded_step(tx)
    assert jdls.skip_cause(opt_state) is jdls.SkipCause.NONE
    assert not jdls.skip_cause(opt_state)  # falsy: nothing skipped
    x = jnp.full(4, 8.0)  # 8 / 4 * 2**15 = 65536: the float16 gradient overflows
    params, opt_state, grad_norm = step(params, opt_state, x)
    assert not np.isfinite(grad_norm)
    cause = jdls.skip_cause(opt_state)
    assert cause is jdls.SkipCause.GRADIENTS and cause.handled  # the guard lets it pass
    params, opt_state, grad_norm = step(params, opt_state, x)
    assert np.isfinite(grad_norm) and jdls.skip_cause(opt_state) is jdls.SkipCause.NONE
    _, opt_state, grad_norm = step(params, opt_state, x.at[0].set(jnp.nan))
    cause = jdls.skip_cause(opt_state)
    assert not np.isfinite(grad_norm)
    assert cause is jdls.SkipCause.FORWARD and not cause.handled  # the guard stops


def test_skip_cause_inside_jit_points_to_stats():
    tx = jdls.wrap(optax.sgd(0.1))
    with pytest.raises(TypeError, match=r"outside jit .*jdls.stats\(opt_state\).cause"):
        jax.jit(jdls.skip_cause)(tx.init({"w": jnp.zeros(2)}))


# --------------------------------------------------------------------------------------------
# The model's own overflow is named: SkipCause.MODEL, and a warning once.
# --------------------------------------------------------------------------------------------


def _rmsnorm_loss(params, x):
    """A float16 RMSNorm whose input holds a value above float16's range: the loss is NaN
    whatever the scale."""
    h = (x * params["w"]).astype(jnp.float16)
    y = h / jnp.sqrt(jnp.mean(h * h))
    return jnp.mean(y.astype(jnp.float32) ** 2)


def test_a_model_that_overflows_at_every_scale_is_named_model_and_warned_once():
    """The default scale backs off to ~1e-38 on a forward overflow; once it has fallen below
    2**-24 the cause is MODEL (not handled), and jdls.skip_cause warns, once per line."""
    tx = jdls.wrap(optax.sgd(0.1))

    @jax.jit
    def step(params, opt_state, x):
        _, grads = jdls.get_scale(opt_state).value_and_grad(_rmsnorm_loss)(params, x)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    params = {"w": jnp.ones(8)}
    opt_state = tx.init(params)
    x = jnp.full(8, 300.0).at[0].set(7e4)
    params, opt_state = step(params, opt_state, x)
    assert jdls.skip_cause(opt_state) is jdls.SkipCause.GRADIENTS  # at 2**15: the scale's
    causes = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")
        for _ in range(40):
            params, opt_state = step(params, opt_state, x)
            causes.append(jdls.skip_cause(opt_state))
    assert float(jdls.get_scale(opt_state).loss_scale) < 2.0**-24
    assert causes[-1] is jdls.SkipCause.MODEL and not causes[-1].handled
    assert int(jdls.stats(opt_state).cause) == jdls.SkipCause.MODEL  # on device, in jit
    said = [w for w in caught if "jdls.SkipCause.MODEL" in str(w.message)]
    assert len(said) == 1 and said[0].category is RuntimeWarning
    assert "float32" in str(said[0].message) and said[0].filename == __file__


@pytest.mark.parametrize(
    ("scale", "value", "want"),
    [
        (jdls.DynamicScale(), None, jdls.SkipCause.GRADIENTS),  # 2**15: the scale's doing
        (jdls.DynamicScale(1.0), None, jdls.SkipCause.MODEL),  # its minimum: cannot go lower
        (jdls.AdaptiveScale(0.5), None, jdls.SkipCause.GRADIENTS),  # below 1, still lowers
        (jdls.StaticScale(2.0**-30), None, jdls.SkipCause.MODEL),  # below the floor
        (jdls.StaticScale(2.0**-30), jnp.nan, jdls.SkipCause.MODEL),  # a NaN loss too
        (jdls.NoOpScale(), None, jdls.SkipCause.GRADIENTS),  # per-layer / per-loss scales'
        (jdls.DynamicScale(), jnp.nan, jdls.SkipCause.FORWARD),
    ],
    ids=[
        "dynamic",
        "at-minimum",
        "adaptive-below-1",
        "static-floor",
        "floor-nan-loss",
        "noop",
        "forward",
    ],
)
def test_which_skips_are_the_models_own(scale, value, want):
    tx = jdls.wrap(optax.sgd(0.1), scale)
    params = {"w": jnp.zeros(2)}
    extra = {} if value is None else {"value": jnp.float32(value)}
    _, state = jax.jit(tx.update)(
        {"w": jnp.array([jnp.inf, 0.0])}, tx.init(params), params, **extra
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        assert jdls.skip_cause(state) is want


def test_wrap_groups_names_the_models_overflow_by_the_shared_scale():
    """The groups run at NoOpScale inside; the shared scale decides MODEL."""
    params = {"gen": {"w": jnp.zeros(2)}, "disc": {"w": jnp.zeros(2)}}
    grads = {"gen": {"w": jnp.ones(2)}, "disc": {"w": jnp.array([jnp.nan, 0.0])}}
    for scale, want in [
        (jdls.DynamicScale(), jdls.SkipCause.GRADIENTS),
        (jdls.DynamicScale(1.0), jdls.SkipCause.MODEL),
    ]:
        tx = jdls.wrap_groups({"gen": optax.sgd(0.1), "disc": optax.sgd(0.1)}, scale)
        _, state = tx.update(grads, tx.init(params), params)
        assert int(jdls.stats(state).cause) == want


# --------------------------------------------------------------------------------------------
# A first step that counts: gradients that all flushed are skipped, not counted.
# --------------------------------------------------------------------------------------------

_LR = 1e-3
_WEIGHT = 2.0**-20  # a loss weight of a real codebase (a z-loss, an auxiliary loss)


def _weighted_loss(params, x, dtype=jnp.float16, weight=_WEIGHT):
    """A two-layer model computed in ``dtype``, its loss times ``2**-20``: at the default
    scale's start (1) every float16 gradient flushes to zero."""
    h = jnp.tanh(x.astype(dtype) @ params["a"]["w"].astype(dtype))
    y = (h @ params["b"]["w"].astype(dtype)).astype(jnp.float32)
    return weight * jnp.mean(y**2)


def _weighted_model():
    key = jax.random.key(0)
    params = {
        "a": {"w": jax.random.normal(key, (8, 16)) * 0.3},
        "b": {"w": jax.random.normal(jax.random.fold_in(key, 1), (16, 4)) * 0.3},
    }
    return params, jax.random.normal(jax.random.fold_in(key, 2), (256, 8))


def _adam_counts(opt_state):
    found = jax.tree_util.tree_leaves(
        opt_state, is_leaf=lambda x: isinstance(x, optax.ScaleByAdamState)
    )
    return {int(s.count) for s in found if isinstance(s, optax.ScaleByAdamState)}


def _steps(path, params, x, loss_fn=_weighted_loss):
    """A jitted train step of Adam with the default scale on ``path``, and its state."""
    if path == "wrap_groups":
        tx = jdls.wrap_groups({"a": optax.adam(_LR), "b": optax.adam(_LR)})
    else:
        tx = jdls.wrap(optax.adam(_LR))
    if path.startswith("retrying"):
        retries = 2 if path == "retrying" else 0
        step = jax.jit(jdls.retrying(loss_fn, tx, retries=retries))
        return (lambda p, s: step(p, s, x)[:2]), tx.init(params)
    if path == "linen":

        @jax.jit
        def train_step(params, state):
            _, grads = state.value_and_grad(loss_fn)(params, x)
            state = state.apply_gradients(grads=grads)
            return state.params, state

        return train_step, jdls.linen.TrainState.create(apply_fn=None, params=params, tx=tx)

    @jax.jit
    def step(params, opt_state):
        _, grads = jdls.get_scale(opt_state).value_and_grad(loss_fn)(params, x)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    return step, tx.init(params)


def _float32_first_step(params, x):
    grads = jax.grad(functools.partial(_weighted_loss, dtype=jnp.float32))(params, x)
    adam = optax.adam(_LR)
    updates, _ = adam.update(grads, adam.init(params), params)
    return optax.apply_updates(params, updates)


def _assert_moved_as(new, want, params):
    for got, expected, p in zip(
        jax.tree_util.tree_leaves(new),
        jax.tree_util.tree_leaves(want),
        jax.tree_util.tree_leaves(params),
        strict=True,
    ):
        # every entry moved as float32's first step moves it, to float16's rounding
        np.testing.assert_allclose(got - p, expected - p, rtol=0, atol=_LR * 1e-2)


def _opt_state(state):
    return state.opt_state if isinstance(state, jdls.linen.TrainState) else state


@pytest.mark.parametrize("path", ["wrap", "wrap_groups", "linen", "retrying-0"])
@pytest.mark.full(keep=1)
def test_a_first_step_whose_gradients_all_flushed_is_skipped_not_counted(path):
    """Loss weight 2**-20 in float16 at the default scale's start: every gradient flushes.
    Step 1 is skipped (SkipCause.UNDERFLOW): Adam's count stays 0, no parameter moves, and
    the scale looks higher; step 2 is Adam's first step, float32's. (Before, step 1 counted:
    Adam's count 1 with zero moments, a schedule one step on, and a first real update 0.73
    of float32's.)"""
    params, x = _weighted_model()
    step, state = _steps(path, params, x)
    new, state = step(params, state)
    opt_state = _opt_state(state)
    assert _adam_counts(opt_state) == {0}
    assert jax.tree_util.tree_all(jax.tree.map(jnp.array_equal, new, params))
    cause = jdls.skip_cause(opt_state)
    assert cause is jdls.SkipCause.UNDERFLOW and cause.handled
    assert int(jdls.stats(opt_state).skipped_steps) == 1
    new, state = step(new, state)
    assert _adam_counts(_opt_state(state)) == {1}
    assert jdls.skip_cause(_opt_state(state)) is jdls.SkipCause.NONE
    _assert_moved_as(new, _float32_first_step(params, x), params)


def test_retrying_looks_within_the_step_and_step_1_is_float32s():
    """``jdls.retrying`` recomputes the flushed step at the scale the rule looks at: step 1
    is Adam's first step (one retry), nothing skipped."""
    params, x = _weighted_model()
    step, opt_state = _steps("retrying", params, x)
    new, opt_state = step(params, opt_state)
    assert _adam_counts(opt_state) == {1}
    stats = jdls.stats(opt_state)
    assert int(stats.skipped_steps) == 0 and int(stats.retries) == 1
    _assert_moved_as(new, _float32_first_step(params, x), params)


def test_exact_zeros_are_taken_and_a_frozen_model_is_skipped_once():
    """A loss weighted 0 (its value 0): nothing could flush, the steps are taken as always.
    A frozen model (a loss that is not zero, gradients exactly zero): one step skipped, the
    look finds zeros again, and every later step is taken: no loop."""
    params, x = _weighted_model()
    for loss_fn, skipped in [
        (functools.partial(_weighted_loss, weight=0.0), 0),
        (lambda p, x: _weighted_loss(jax.lax.stop_gradient(p), x), 1),
    ]:
        step, opt_state = _steps("wrap", params, x, loss_fn)
        new = params
        for _ in range(5):
            new, opt_state = step(new, opt_state)
        assert int(jdls.stats(opt_state).skipped_steps) == skipped
        assert _adam_counts(opt_state) == {5 - skipped}


def test_all_zero_gradients_without_a_loss_are_taken_as_before():
    """``tx.update`` given zeros by hand, no loss known (no ``value``, no
    ``scale.value_and_grad`` in the trace): the step is taken, as before."""
    tx = jdls.wrap(optax.adam(_LR))
    params = {"w": jnp.ones(2)}
    _, opt_state = tx.update({"w": jnp.zeros(2)}, tx.init(params), params)
    assert _adam_counts(opt_state) == {1} and not jdls.skip_cause(opt_state)
    _, opt_state = tx.update({"w": jnp.zeros(2)}, tx.init(params), params, value=jnp.ones(()))
    assert jdls.skip_cause(opt_state) is jdls.SkipCause.UNDERFLOW  # with the loss: skipped


# --------------------------------------------------------------------------------------------
# Telemetry rows that explain themselves: a row per module call, methods other than
# __call__ probed, and a shared site's row says its uses and the fix.
# --------------------------------------------------------------------------------------------


class _Embedder(nn.Module):
    """Gemma's embedder: one table, ``encode`` at the bottom, ``decode`` (tied) at the top."""

    vocab: int = 7

    def setup(self):
        self.table = self.param("table", nn.initializers.normal(1.0), (self.vocab, WIDTH))

    def encode(self, tokens):
        return self.table[tokens]

    def decode(self, h):
        return h @ self.table.T


class _TwiceBlock(nn.Module):
    """A block whose dropout (one module) is applied twice, as in Gemma's linen block."""

    @nn.compact
    def __call__(self, h, _):
        drop = nn.Dropout(0.5, deterministic=True)
        y = drop(jnp.tanh(nn.Dense(WIDTH)(h)))
        return h + drop(2.0 * y), None


class _TiedLM(nn.Module):
    def setup(self):
        self.embedder = _Embedder()
        self.blocks = nn.scan(
            _TwiceBlock,
            variable_axes={"params": 0, "jdls": 0},
            split_rngs={"params": True},
            length=DEPTH,
        )()

    def __call__(self, tokens):
        h, _ = self.blocks(self.embedder.encode(tokens), None)
        return self.embedder.decode(h)


_TOKENS = jnp.array([[0, 3, 5], [6, 1, 2]])
_ROWS = (
    "embedder.encode",
    *[
        row
        for i in range(DEPTH)
        for row in (
            f"blocks/Dense_0[{i}]",
            f"blocks/Dropout_0[{i}]",
            f"blocks/Dropout_0#2[{i}]",
            f"blocks[{i}]",
        )
    ],
    "embedder.decode",
)


@functools.cache
def _tied_telemetry(scale=2.0**10):
    model = jdls.linen.probes(_TiedLM())
    variables = model.init(jax.random.key(0), _TOKENS)

    def loss(v):
        return _WEIGHT * jnp.mean(model.apply(v, _TOKENS) ** 2)

    _, grads = jax.jit(jdls.StaticScale(scale).value_and_grad(loss))(variables)
    return model, variables, jdls.Telemetry.of(grads["jdls"])


def test_each_call_and_method_of_a_module_is_its_own_row_in_forward_order():
    """The dropout applied twice per block gives two rows, ``Dropout_0`` and ``Dropout_0#2``
    (before: one row, amax NaN, uses 2); the embedder's ``encode`` and ``decode`` each a row
    (before: none), first and last: every row measured once."""
    _, _, t = _tied_telemetry()
    assert t.names == _ROWS
    assert t.uses.tolist() == [1.0] * len(_ROWS)
    assert bool(jnp.all(jnp.isfinite(t.amax)))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing shared: as_dict does not warn
        assert set(t.as_dict()) == set(_ROWS)


def test_the_decode_row_is_the_cotangent_the_loss_weight_hits_first():
    """``embedder.decode``'s amax is the largest scaled cotangent of the logits: the loss's
    weight times the scale times d(mean(y**2))/dy, measured before any layer."""
    model, variables, t = _tied_telemetry(scale=2.0**10)
    logits = model.apply(variables, _TOKENS)
    want = jnp.max(jnp.abs(2.0**10 * _WEIGHT * 2 * logits / logits.size))
    got = t.amax[t.names.index("embedder.decode")]
    np.testing.assert_allclose(float(got), float(want), rtol=1e-6)


def test_a_site_shared_by_two_uses_says_so_in_its_row():
    """A site passed through twice (one site closed over by a loop, an NNX module called
    twice): the table's row names its uses and the fix, and as_dict warns with both."""
    site = jdls.Site(jdls.Probe())

    def loss(x, sites):
        h = jdls.apply_site(jnp.tanh(x), sites["shared"])
        h = jdls.apply_site(jnp.tanh(h), sites["shared"])
        return jnp.sum(jdls.apply_site(h, sites["once"]))

    measured = jax.grad(loss, argnums=1)(jnp.ones(3), {"shared": site, "once": site})
    t = jdls.Telemetry.of(measured)
    rows = dict(zip(t.names, t.table().splitlines()[1:], strict=True))
    assert "used 2 times in one step" in rows["shared"]
    assert "give each use its own site" in rows["shared"]
    assert rows["once"].rstrip().endswith(" 1")  # measured once: no note
    with pytest.warns(UserWarning, match=r"shared \(2 uses\).*Give each use its own site"):
        table = t.as_dict()
    assert table["shared"]["uses"] == 2.0 and np.isnan(table["shared"]["amax"])


class _Decoder(nn.Module):
    """Decodes only when asked (a sampler's path): init does not call ``decode``."""

    @nn.compact
    def __call__(self, tokens, decode=False):
        embedder = _Embedder()
        h = jnp.tanh(embedder.encode(tokens))
        return embedder.decode(h) if decode else h


def test_a_method_that_init_did_not_call_goes_unprobed_without_an_error():
    model = jdls.linen.probes(_Decoder())
    variables = model.init(jax.random.key(0), _TOKENS)
    assert sorted(variables["jdls"]["_Embedder_0"]) == ["probe.encode"]
    _, grads = jdls.StaticScale(8.0).value_and_grad(
        lambda v: jnp.sum(model.apply(v, _TOKENS, decode=True))
    )(variables)
    assert jdls.Telemetry.of(grads["jdls"]).names == ("_Embedder_0.encode",)
