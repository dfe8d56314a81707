"""The compatibility matrix: every setup a JAX user has, with inf/NaN steps.

Axes: parameter dtype x sharding x optimizer x skip mechanism, and the model kind that holds
the parameters: a dict, Flax linen's variables, an NNX ``nnx.State`` of ``nnx.Param``,
Equinox's arrays (an ``eqx.Module`` filtered
with ``eqx.filter(model, eqx.is_array)``: ``None`` where the model holds a function). Each combination trains a small
model for a few steps twice, from the same gradients: once clean, once with an inf step and a
NaN step inserted. The inserted steps must be skipped and leave no trace: the two runs end
with bit-identical parameters and inner optimizer states. A combination that plain optax
itself cannot run (an optimizer without complex support) must make jdls raise too.

CI runs a fixed pseudo-random sample that covers every value of every axis
(:data:`SAMPLE_SIZE` combinations) with dict parameters, and for every other model kind a
smaller sample covering every dtype, sharding and optimizer; ``JDLS_FULL_MATRIX=1`` runs all of
them for every model kind.
"""

from __future__ import annotations

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _helpers import FULL_MATRIX, assert_bitwise_equal, covering_sample, enable_x64
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jdls

DTYPES = ("float32", "bfloat16", "float16", "float64", "complex64")
SHARDINGS = ("none", "auto", "explicit", "shard_map_sharded", "shard_map_replicated", "pmap")
OPTIMIZERS = (
    "sgd",
    "momentum",
    "adam",
    "adafactor",
    "lion",
    "lookahead",
    "multisteps",
    "inject_hyperparams",
)
SKIPS = ("cond", "select")
MODEL_KINDS = ("dict", "linen", "nnx", "equinox")

SAMPLE_SIZE = 40
N_DEVICES = 2
CLEAN_STEPS = 3
AXIS = "d"


def _all_combinations():
    return list(itertools.product(DTYPES, SHARDINGS, OPTIMIZERS, SKIPS))


def _sample(size=SAMPLE_SIZE, seed=12):
    """A fixed pseudo-random subset in which every value of every axis appears."""
    return covering_sample(_all_combinations(), (DTYPES, SHARDINGS, OPTIMIZERS, SKIPS), size, seed)


def _kind_sample(kind):
    """For a model kind other than dict: each optimizer once, dtypes and shardings cycled."""
    start = MODEL_KINDS.index(kind)
    return [
        (DTYPES[(i + start) % len(DTYPES)], SHARDINGS[(i + 2 * start) % len(SHARDINGS)], o, s)
        for i, (o, s) in enumerate(zip(OPTIMIZERS, itertools.cycle(SKIPS)))
    ]


FULL = FULL_MATRIX
COMBINATIONS = _all_combinations() if FULL else _sample()
KIND_COMBINATIONS = [
    (kind, *c)
    for kind in MODEL_KINDS[1:]
    for c in (_all_combinations() if FULL else _kind_sample(kind))
]
# The quick run (tests/conftest.py) takes the fewest cells that hold every value of every axis,
# and one cell of each other model kind; the others are marked full.
QUICK = {*_sample(0), *((kind, *c) for kind in MODEL_KINDS[1:] for c in _kind_sample(kind)[:1])}


# Seen at jax 0.8.1 (the oldest release jdls supports), passing from jax 0.10: adafactor's
# state of complex parameters leaves the step varying over the shard_map axis, and the scan over
# the steps refuses the carry.
_OLD_JAX = tuple(int(p) for p in jax.__version__.split(".")[:2]) < (0, 10)
_OLD_JAX_COMPLEX = pytest.mark.xfail(
    _OLD_JAX, reason="complex adafactor state under shard_map on jax < 0.10", strict=False
)


def _cells(cells):
    def marks(c):
        full = () if c in QUICK else (pytest.mark.full,)
        old = "complex64" in c and "shard_map_sharded" in c and "adafactor" in c
        return (*full, _OLD_JAX_COMPLEX) if old else full

    return [pytest.param(*c, id="-".join(c), marks=marks(c)) for c in cells]


def test_sample_covers_every_value():
    sample = _sample()
    assert len(sample) == SAMPLE_SIZE
    for axis, values in enumerate((DTYPES, SHARDINGS, OPTIMIZERS, SKIPS)):
        assert {c[axis] for c in sample} == set(values)
    for kind in MODEL_KINDS[1:]:
        sample = _kind_sample(kind)
        for axis, values in enumerate((DTYPES, SHARDINGS, OPTIMIZERS)):
            assert {c[axis] for c in sample} == set(values), (kind, axis)


# --------------------------------------------------------------------------------------------
# Model kinds: the same two leaves, ``w`` and ``b``, held as each library holds them.
# --------------------------------------------------------------------------------------------


@functools.cache
def _equinox_model():
    import equinox as eqx

    class Model(eqx.Module):
        """A model's arrays as ``eqx.filter(model, eqx.is_array)`` gives them: the
        activation function the model holds is None here."""

        w: object
        b: object
        activation: object
        name: str = eqx.field(static=True, default="affine")

    return Model


def _as_kind(kind, tree):
    """``tree``, a dict with keys ``w`` and ``b``, held as ``kind`` holds parameters."""
    if kind == "dict":
        return tree
    if kind == "linen":
        return {"params": {"Dense_0": {"kernel": tree["w"], "bias": tree["b"]}}}
    if kind == "nnx":  # nnx.state(model, nnx.Param) of an nnx.Linear
        from flax import nnx

        return nnx.State({"kernel": nnx.Param(tree["w"]), "bias": nnx.Param(tree["b"])})
    if kind == "equinox":
        return _equinox_model()(tree["w"], tree["b"], None)
    raise ValueError(kind)


def _is_w(path):
    """Whether a key path leads to ``w`` (a linen ``kernel``), in any model kind."""
    return any(getattr(k, "key", getattr(k, "name", None)) in ("w", "kernel") for k in path)


# --------------------------------------------------------------------------------------------
# Builders.
# --------------------------------------------------------------------------------------------


def _optimizer(name):
    if name == "sgd":
        return optax.sgd(0.1)
    if name == "momentum":
        return optax.sgd(0.1, momentum=0.9)
    if name == "adam":
        return optax.adam(1e-2)
    if name == "adafactor":
        return optax.adafactor(1e-2)
    if name == "lion":
        return optax.lion(1e-2)
    if name == "lookahead":
        return optax.lookahead(optax.adam(1e-2), sync_period=2, slow_step_size=0.5)
    if name == "multisteps":
        return optax.MultiSteps(optax.adam(1e-2), every_k_schedule=2)
    if name == "inject_hyperparams":
        return optax.inject_hyperparams(optax.adam)(learning_rate=1e-2)
    raise ValueError(name)


def _params(dtype, optimizer):
    rng = np.random.default_rng(0)

    def make(shape):
        x = rng.standard_normal(shape)
        if dtype == "complex64":
            x = x + 1j * rng.standard_normal(shape)
        return jnp.asarray(x, dtype)

    params = {"w": make((4, 2)), "b": make((2,))}
    if optimizer == "lookahead":
        return optax.LookaheadParams.init_synced(params)
    return params


def _grad_sequence(dtype, inject):
    """Gradients for every step, stacked, per device: shape (devices, steps, ...).

    With ``inject``, an inf step and a NaN step are inserted (on one device only) after the
    first and the second clean step.
    """
    rng = np.random.default_rng(1)

    def make(shape):
        x = rng.standard_normal((N_DEVICES, CLEAN_STEPS, *shape))
        if dtype == "complex64":
            x = x + 1j * rng.standard_normal(x.shape)
        return x

    grads = {"w": make((4, 2)), "b": make((2,))}
    if inject:

        def insert(x):
            bad = np.zeros_like(x[:, :1])
            inf, nan = bad.copy(), bad.copy()
            inf[0, 0, 0] = np.inf
            nan[-1, 0, -1] = np.nan
            return np.concatenate([x[:, :1], inf, x[:, 1:2], nan, x[:, 2:]], axis=1)

        grads = {k: insert(v) for k, v in grads.items()}
    return {k: jnp.asarray(v, dtype) for k, v in grads.items()}


def _fast(params):
    return params.fast if isinstance(params, optax.LookaheadParams) else params


def _train(tx, params, grads_seq, axis_name=None):
    """init, then one update per step of ``grads_seq`` (leading axis: steps)."""

    def step(carry, grads):
        params, state = carry
        if axis_name is not None:  # data parallel: average the per-device gradients
            grads = jax.lax.pmean(grads, axis_name)
        updates, state = tx.update(grads, state, params)
        return (optax.apply_updates(params, updates), state), None

    state = tx.init(params)
    (params, state), _ = jax.lax.scan(step, (params, state), grads_seq)
    return params, state


def _run(dtype, sharding, optimizer, skip, inner=None, kind="dict"):
    """Final (params, state) of the clean run and of the run with inserted inf/NaN steps,
    compiled as one program; ``inner`` given: plain optax instead of the wrap; ``kind``: the
    model kind holding the parameters."""
    params = _params(dtype, optimizer)
    if isinstance(params, optax.LookaheadParams):
        params = optax.LookaheadParams(_as_kind(kind, params.fast), _as_kind(kind, params.slow))
    else:
        params = _as_kind(kind, params)
    grads = (_grad_sequence(dtype, inject=False), _grad_sequence(dtype, inject=True))
    mesh_devices = jax.devices()[:N_DEVICES]

    def make_tx(axis_name=None, sharded=None):
        if inner is not None:
            return inner
        return jdls.wrap(
            _optimizer(optimizer),
            jdls.DynamicScale(),
            skip_with=skip,
            axis_name=axis_name,
            sharded=sharded,
        )

    def both(train):
        return lambda p, g: (train(p, g[0]), train(p, g[1]))

    def place(tree, mesh, spec_of):
        return jax.tree_util.tree_map_with_path(
            lambda path, x: jax.device_put(x, NamedSharding(mesh, spec_of(path, x))), tree
        )

    is_w = _is_w

    if sharding in ("none", "auto", "explicit"):
        whole = jax.tree_util.tree_map(lambda g: g.sum(axis=0) / N_DEVICES, grads)
        whole = tuple(_as_kind(kind, g) for g in whole)
        tx = make_tx()
        run = jax.jit(both(lambda p, g: _train(tx, p, g)))
        if sharding == "none":
            return run(params, whole)
        kind = AxisType.Auto if sharding == "auto" else AxisType.Explicit
        mesh = jax.make_mesh((N_DEVICES,), (AXIS,), axis_types=(kind,), devices=mesh_devices)
        params = place(params, mesh, lambda path, x: P(AXIS, None) if is_w(path) else P())
        whole = place(whole, mesh, lambda path, x: P(None, AXIS, None) if is_w(path) else P())
        if sharding == "auto":
            return run(params, whole)
        with jax.set_mesh(mesh):
            return run(params, whole)

    if sharding == "pmap":
        tx = make_tx(axis_name=AXIS, sharded=False)
        replicated = jax.tree_util.tree_map(lambda x: jnp.stack([x] * N_DEVICES), params)
        run = jax.pmap(
            both(lambda p, g: _train(tx, p, g, AXIS)), axis_name=AXIS, devices=mesh_devices
        )
        return run(replicated, tuple(_as_kind(kind, g) for g in grads))

    # shard_map: the whole run inside; per-device states come out stacked.
    mesh = jax.make_mesh((N_DEVICES,), (AXIS,), devices=mesh_devices)
    sharded_w = sharding == "shard_map_sharded"

    def spec(path, _):
        return P(AXIS, None) if sharded_w and is_w(path) else P()

    if sharded_w:
        # Each device holds its rows of w and their gradients (no averaging): (devices,
        # steps, 2, 2); the gradients of b are averaged over devices.
        def split_w(g):
            g_w = g["w"].sum(axis=0) / N_DEVICES
            return {"w": jnp.stack(jnp.split(g_w, N_DEVICES, axis=1)), "b": g["b"]}

        grads = tuple(split_w(g) for g in grads)
    grads = tuple(_as_kind(kind, g) for g in grads)
    sharded = _as_kind(kind, {"w": True, "b": False}) if sharded_w else None
    tx = make_tx(axis_name=AXIS, sharded=sharded)

    def train(p, g):
        g = jax.tree_util.tree_map(lambda x: x[0], g)
        if sharded_w:
            g = jax.tree_util.tree_map_with_path(
                lambda path, x: x if is_w(path) else jax.lax.pmean(x, AXIS), g
            )
            p, state = _train(tx, p, g)
        else:
            p, state = _train(tx, p, g, AXIS)
        return p, jax.tree_util.tree_map(lambda x: jnp.asarray(x)[None], state)

    param_specs = jax.tree_util.tree_map_with_path(spec, params)
    grad_specs = _as_kind(kind, {"w": P(AXIS), "b": P(AXIS)})  # the leading axis: devices
    params = place(params, mesh, spec)
    grads = place(grads, mesh, lambda path, x: P(AXIS))
    run = jax.jit(
        jax.shard_map(
            both(train),
            mesh=mesh,
            in_specs=(param_specs, (grad_specs, grad_specs)),
            out_specs=((param_specs, P(AXIS)), (param_specs, P(AXIS))),
        )
    )
    return run(params, grads)


def _inner_state(state):
    return state.inner_state if isinstance(state, jdls.WrapState) else state


@pytest.mark.parametrize(("dtype", "sharding", "optimizer", "skip"), _cells(COMBINATIONS))
def test_injected_steps_leave_no_trace(dtype, sharding, optimizer, skip):
    _check_no_trace("dict", dtype, sharding, optimizer, skip)


@pytest.mark.parametrize(
    ("kind", "dtype", "sharding", "optimizer", "skip"), _cells(KIND_COMBINATIONS)
)
def test_model_kinds(kind, dtype, sharding, optimizer, skip):
    if kind == "equinox":
        pytest.importorskip("equinox")
    _check_no_trace(kind, dtype, sharding, optimizer, skip)


def test_equinox_kind_is_what_eqx_filter_gives():
    eqx = pytest.importorskip("equinox")
    model = _equinox_model()(jnp.ones((4, 2)), jnp.zeros(2), jax.nn.relu)
    filtered = eqx.filter(model, eqx.is_array)
    assert filtered.activation is None
    expected = _as_kind("equinox", {"w": model.w, "b": model.b})
    assert jax.tree_util.tree_structure(filtered) == jax.tree_util.tree_structure(expected)


def _check_no_trace(kind, dtype, sharding, optimizer, skip):
    with enable_x64(dtype == "float64"):
        try:
            (clean_params, clean_state), (params, state) = _run(
                dtype, sharding, optimizer, skip, kind=kind
            )
        except Exception as error:
            # Valid only where plain optax, unsharded, cannot run this dtype either.
            with pytest.raises(type(error)):
                _run(dtype, "none", optimizer, skip, inner=_optimizer(optimizer), kind=kind)
            pytest.xfail(f"optax itself does not support this combination: {error!r:.200}")
    skipped = np.asarray(jdls.stats(state).skipped_steps)
    assert np.all(skipped == 2), skipped
    assert np.all(np.asarray(jdls.stats(clean_state).skipped_steps) == 0)
    assert jax.tree_util.tree_leaves(_fast(params))[0].dtype == jnp.dtype(dtype)
    assert jax.tree_util.tree_structure(_fast(params)) == jax.tree_util.tree_structure(
        _as_kind(kind, {"w": 0, "b": 0})
    )
    assert_bitwise_equal(params, clean_params)
    assert_bitwise_equal(_inner_state(state), _inner_state(clean_state))
