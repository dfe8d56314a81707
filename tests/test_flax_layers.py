"""Every Flax layer a transformer uses works with jdls's sites: probes
(``jdls.linen.probes``, ``jdls.nnx.probes``) and per-layer scales (``jdls.linen.layer_scales``,
``jdls.nnx.layer_scales``) through each module that ``flax.linen`` and ``flax.nnx`` export.

The modules are those Flax exports, not a hand-picked list: every ``nn.Module`` subclass of
``flax.linen`` and every ``nnx.Module`` subclass of ``flax.nnx`` is either built here (a table
of how: constructor, call, input) or left out with a reason, and a test fails on one that is
in neither (a new Flax release adding a module) or in both.

Each covered module sits between two Dense layers (an embedding starts the chain), alone or as
the block of a stack scanned over its layers (``nn.scan``, ``nnx.scan``), in float32:

* probes: one telemetry row per module call, each used once, its largest cotangent finite
  and above zero; in linen in forward order (the order the bare model's modules return,
  recorded by ``nn.intercept_methods``), in NNX the rows of every module the bare model holds,
  the model's own last;
* per-layer scales ``2**0``, ``2**9``, ``2**18``, ... in forward order (a stack's layers each
  their own): the gradients are ``jax.grad``'s of the bare model, bit for bit eagerly (the
  backward pass is linear in the cotangent and every scale a power of two, so each rounding
  is the same rounding times a power of two); under ``jit``, and through a scan (XLA compiles
  the scan's body even eagerly), to float32 rounding of each layer's largest gradient: XLA
  compiles the two programs (one with a multiply at each layer's output, one without; a
  module alone under ``jit`` is held to the eager case's reference, computed once) into
  different fusions, which may add in another order. A gradient that cancels to about zero
  (a bias before a normalization over the batch) is then that rounding's size. Each layer's
  measurement is its own gradients' largest magnitude.

``nn.SelfAttention``'s ``__call__`` calls ``super().__call__``: one call of the module, one
row and one per-layer ratio (the inner call is not a second use).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _helpers import FULL_MATRIX
from flax import nnx

import jdls

B, T, W, VOCAB, DEPTH = 2, 4, 8, 11, 2


def _x() -> jax.Array:
    return jax.random.normal(jax.random.key(1), (B, T, W))


def _tokens() -> jax.Array:
    return jax.random.randint(jax.random.key(2), (B, T), 0, VOCAB)


def _causal() -> jax.Array:
    return nn.make_causal_mask(jnp.ones((B, T)))


@functools.cache
def _target() -> jax.Array:
    """The loss's fixed target, computed once and eagerly, also when first asked for inside a
    trace: a constant of every loss's program, not a threefry draw compiled into each one
    (that draw was most of the compile time of each NNX program, about 2 s of 2.2)."""
    with jax.ensure_compile_time_eval():
        return jax.random.normal(jax.random.key(3), (B, T, W))


def _normal(key, shape, dtype=jnp.float32):
    return 0.5 * jax.random.normal(key, shape, dtype)


@dataclasses.dataclass(frozen=True)
class Layer:
    """How to build one module and call it in a model: ``build`` makes it (NNX: from an
    ``nnx.Rngs``), ``call(module, h)`` applies it to the previous layer's output (``h``:
    ``(B, T, W)`` float32, or token ids ``(B, T)`` where ``tokens``). Its output is reshaped
    to ``(B, T, -1)`` for the next Dense."""

    build: Callable[..., Any]
    call: Callable[[Any, jax.Array], jax.Array] = lambda m, h: m(h)
    tokens: bool = False  # takes token ids: starts the chain, never in a stack
    mutable: tuple[str, ...] = ()  # linen collections a training step updates


# --------------------------------------------------------------------------------------------
# flax.linen: what is built, what is left out.
# --------------------------------------------------------------------------------------------

LINEN: dict[str, Layer] = {
    "Dense": Layer(lambda **kw: nn.Dense(W, **kw)),
    "DenseGeneral": Layer(lambda **kw: nn.DenseGeneral((2, W // 2), axis=-1, **kw)),
    "Einsum": Layer(lambda **kw: nn.Einsum((2, W, W // 2), "btd,hdf->bthf", **kw)),
    "Embed": Layer(lambda **kw: nn.Embed(VOCAB, W, **kw), tokens=True),
    "Dropout": Layer(lambda **kw: nn.Dropout(0.5, deterministic=False, **kw)),
    "LayerNorm": Layer(lambda **kw: nn.LayerNorm(**kw)),
    "RMSNorm": Layer(lambda **kw: nn.RMSNorm(**kw)),
    "GroupNorm": Layer(lambda **kw: nn.GroupNorm(num_groups=2, **kw)),
    "InstanceNorm": Layer(lambda **kw: nn.InstanceNorm(**kw)),
    "BatchNorm": Layer(
        lambda **kw: nn.BatchNorm(use_running_average=False, **kw), mutable=("batch_stats",)
    ),
    "MultiHeadDotProductAttention": Layer(
        lambda **kw: nn.MultiHeadDotProductAttention(
            2, dropout_rate=0.5, deterministic=False, **kw
        ),
        lambda m, h: m(h, h, mask=_causal()),
    ),
    "MultiHeadAttention": Layer(lambda **kw: nn.MultiHeadAttention(2, normalize_qk=True, **kw)),
    "SelfAttention": Layer(
        lambda **kw: nn.SelfAttention(2, **kw), lambda m, h: m(h, mask=_causal())
    ),
    "PReLU": Layer(lambda **kw: nn.PReLU(**kw)),
    # a transformer's MLP block; its layers its own (parent=None: not the caller's)
    "Sequential": Layer(
        lambda **kw: nn.Sequential(
            [nn.Dense(2 * W, parent=None), nn.gelu, nn.Dense(W, parent=None)], **kw
        )
    ),
}

_CONV = "convolution: image models, not in a transformer"
_RNN = "recurrent: not in a transformer"
_FP8 = (
    "Flax's FP8 dot_general, injected into Dense/Einsum (dot_general_cls), not a layer; FP8 "
    "with jdls is jdls.fp8 (tests/test_fp8_linen.py)"
)
_REPARAM = "re-parametrizes another layer's weights (GANs): not in a transformer"
LINEN_LEFT_OUT: dict[str, str] = {
    "Module": "the base class",
    "Conv": _CONV,
    "ConvLocal": _CONV,
    "ConvTranspose": _CONV,
    "ConvLSTMCell": _RNN,
    "GRUCell": _RNN,
    "LSTMCell": _RNN,
    "MGUCell": _RNN,
    "OptimizedLSTMCell": _RNN,
    "SimpleCell": _RNN,
    "RNNCellBase": _RNN + " (the cells' base class)",
    "RNN": _RNN + " (runs a cell over time)",
    "Bidirectional": _RNN + " (two RNNs)",
    "SpectralNorm": _REPARAM,
    "WeightNorm": _REPARAM,
    "Fp8DotGeneral": _FP8,
    "Fp8DotGeneralOp": _FP8,
    "Fp8DirectDotGeneralOp": _FP8,
    "NANOOFp8DotGeneralOp": _FP8,
    "Fp8Einsum": _FP8,
}

# --------------------------------------------------------------------------------------------
# flax.nnx: what is built, what is left out.
# --------------------------------------------------------------------------------------------

NNX: dict[str, Layer] = {
    "Linear": Layer(lambda r: nnx.Linear(W, W, rngs=r)),
    "LinearGeneral": Layer(lambda r: nnx.LinearGeneral(W, (2, W // 2), rngs=r)),
    "Einsum": Layer(lambda r: nnx.Einsum("btd,hdf->bthf", (2, W, W // 2), (2, W // 2), rngs=r)),
    "Embed": Layer(lambda r: nnx.Embed(VOCAB, W, rngs=r), tokens=True),
    "Dropout": Layer(lambda r: nnx.Dropout(0.5, rngs=r)),
    "LayerNorm": Layer(lambda r: nnx.LayerNorm(W, rngs=r)),
    "RMSNorm": Layer(lambda r: nnx.RMSNorm(W, rngs=r)),
    "GroupNorm": Layer(lambda r: nnx.GroupNorm(W, num_groups=2, rngs=r)),
    "InstanceNorm": Layer(lambda r: nnx.InstanceNorm(W, rngs=r)),
    "BatchNorm": Layer(lambda r: nnx.BatchNorm(W, rngs=r)),
    # without attention dropout: under nnx.scan over an nnx.vmap stack, the bare model's
    # attention with dropout_rate=0.5 (deterministic=False) returned zeros (jdls not involved)
    "MultiHeadAttention": Layer(
        lambda r: nnx.MultiHeadAttention(2, W, normalize_qk=True, decode=False, rngs=r),
        lambda m, h: m(h, mask=_causal()),
    ),
    "PReLU": Layer(lambda r: nnx.PReLU()),
    "LoRA": Layer(lambda r: nnx.LoRA(W, 2, W, b_initializer=_normal, rngs=r)),
    "LoRALinear": Layer(lambda r: nnx.LoRALinear(W, W, lora_rank=2, b_initializer=_normal, rngs=r)),
    # a transformer's MLP block
    "Sequential": Layer(
        lambda r: nnx.Sequential(
            nnx.Linear(W, 2 * W, rngs=r), nnx.gelu, nnx.Linear(2 * W, W, rngs=r)
        )
    ),
}

NNX_LEFT_OUT: dict[str, str] = {
    "Module": "the base class",
    "Dict": "a container of modules, not a layer",
    "List": "a container of modules, not a layer",
    "Conv": _CONV,
    "ConvTranspose": _CONV,
    "GRUCell": _RNN,
    "LSTMCell": _RNN,
    "OptimizedLSTMCell": _RNN,
    "SimpleCell": _RNN,
    "RNNCellBase": _RNN + " (the cells' base class)",
    "RNN": _RNN + " (runs a cell over time)",
    "Bidirectional": _RNN + " (two RNNs)",
    "SpectralNorm": _REPARAM,
    "WeightNorm": _REPARAM,
}


def _exported(package: Any, base: type) -> set[str]:
    return {
        name
        for name, value in vars(package).items()
        if inspect.isclass(value) and issubclass(value, base)
    }


@pytest.mark.parametrize(
    "package, base, covered, left_out",
    [(nn, nn.Module, LINEN, LINEN_LEFT_OUT), (nnx, nnx.Module, NNX, NNX_LEFT_OUT)],
    ids=["linen", "nnx"],
)
def test_every_exported_module_is_covered_or_left_out_with_a_reason(
    package: Any, base: type, covered: dict, left_out: dict
) -> None:
    exported = _exported(package, base)
    assert not set(covered) & set(left_out), "in both tables"
    unclassified = exported - set(covered) - set(left_out)
    assert not unclassified, (
        f"{package.__name__} exports modules in neither table: {sorted(unclassified)}; build "
        "each one a transformer uses in the covered table, leave the others out with a reason"
    )
    assert all(left_out.values())


def _cases(
    covered: dict[str, Layer],
    package: Any,
    quick: set[tuple[str, bool]],
    xfail: dict[tuple[str, bool], str] | None = None,
) -> list:
    """``(name, scanned, jit)`` for every covered module Flax exports: alone and scanned (an
    embedding alone only), jitted and eagerly (scanned eagerly: ``JDLS_FULL_MATRIX=1``). The quick run keeps ``quick`` (jitted); the
    cases in ``xfail`` (module, scanned) fail for the jdls bug it names."""
    xfail = xfail or {}
    cases = []
    for name, layer in covered.items():
        if not hasattr(package, name):  # an older Flax (the floors): not exported there
            continue
        for scanned in (False,) if layer.tokens else (False, True):
            # eagerly and scanned (float32 rounding, as jitted) only with JDLS_FULL_MATRIX=1
            for jit in (True, False) if FULL_MATRIX or not scanned else (True,):
                keep = jit and (name, scanned) in quick
                ident = f"{name}-{'scanned' if scanned else 'alone'}-{'jit' if jit else 'eager'}"
                marks = [] if keep else [pytest.mark.full]
                if (name, scanned) in xfail:
                    reason = xfail[name, scanned]
                    marks.append(pytest.mark.xfail(strict=True, reason=reason))
                cases.append(pytest.param(name, scanned, jit, id=ident, marks=marks))
    return cases


def _maybe_jit(fn: Callable, jit: bool) -> Callable:
    return jax.jit(fn) if jit else fn


#: The bare models' eager loss and gradients of the modules alone, by (test, module): the eager
#: case's reference (bit for bit), which the jitted case shares (to float32 rounding) instead
#: of compiling a second program of the bare model (about 0.2 to 2 s a case).
_EAGER_REFERENCES: dict[tuple[str, str], tuple[Any, Any]] = {}


def _bare_reference(
    key: tuple[str, str], loss: Callable, params: Any, inputs: Any, jit: bool, scanned: bool
) -> tuple[Any, Any]:
    """``jax.value_and_grad(loss)(params)``: a module alone, eagerly, once per ``key`` (the
    same ``inputs``, everything the loss reads, checked bit for bit on reuse); a scanned
    stack under ``jit`` when ``jit``, as the model (no eager case shares it)."""
    if scanned:
        return _maybe_jit(jax.value_and_grad(loss), jit)(params)
    if key not in _EAGER_REFERENCES:
        _EAGER_REFERENCES[key] = (inputs, jax.value_and_grad(loss)(params))
    seen, reference = _EAGER_REFERENCES[key]
    assert jax.tree.structure(seen) == jax.tree.structure(inputs), key
    for a, b in zip(jax.tree.leaves(seen), jax.tree.leaves(inputs), strict=True):
        if jnp.issubdtype(a.dtype, jax.dtypes.prng_key):  # an NNX model's Rngs
            a, b = jax.random.key_data(a), jax.random.key_data(b)
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=str(key))
    return reference


def _assert_grads_equal(grads: dict, ref: dict, exact: bool) -> None:
    """Bit for bit, or (``exact`` False: under ``jit`` or ``scan``) to float32 rounding of
    each layer's largest gradient (see the module docstring)."""
    assert jax.tree.structure(grads) == jax.tree.structure(ref)
    for layer, tree in ref.items():
        top = max(float(np.max(np.abs(g))) for g in jax.tree.leaves(tree))
        for (path, a), b in zip(
            jax.tree_util.tree_leaves_with_path(grads[layer]), jax.tree.leaves(tree), strict=True
        ):
            a, b = np.asarray(a), np.asarray(b)
            where = layer + jax.tree_util.keystr(path)
            assert a.dtype == b.dtype == np.float32 and a.shape == b.shape, where
            if exact:
                np.testing.assert_array_equal(a, b, err_msg=where)
            else:
                np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6 * top, err_msg=where)


def _assert_rows(t: jdls.Telemetry, names: tuple[str, ...]) -> None:
    """One row per module call: each used once, its largest cotangent finite and above 0."""
    assert t.names == names
    assert np.asarray(t.uses).tolist() == [1.0] * len(names)
    amax = np.asarray(t.amax)
    assert np.all(np.isfinite(amax)) and np.all(amax > 0), dict(zip(names, amax, strict=True))
    assert not np.any(np.asarray(t.nonfinite))


# --------------------------------------------------------------------------------------------
# linen
# --------------------------------------------------------------------------------------------


class LinenBlock(nn.Module):
    """The module under test, its output reshaped for the next layer: a stack's block."""

    layer: Layer

    @nn.compact
    def __call__(self, h, _=None):
        out = self.layer.call(self.layer.build(name="layer"), h)
        return out.reshape(B, T, -1), None


class LinenChain(nn.Module):
    """Dense, the module, Dense (an embedding: the module, Dense, Dense); or Dense, a stack
    of ``DEPTH`` blocks run by ``nn.scan``, Dense."""

    layer: Layer
    scanned: bool = False

    @nn.compact
    def __call__(self, x):
        if self.layer.tokens:
            h = self.layer.call(self.layer.build(name="layer"), x)
            h = nn.Dense(W, name="dense_0")(h)
            return nn.Dense(W, name="dense_1")(h)
        h = nn.Dense(W, name="dense_0")(x)
        if self.scanned:
            axes = {c: 0 for c in ("params", "jdls", *self.layer.mutable)}
            stack = nn.scan(
                LinenBlock,
                variable_axes=axes,
                split_rngs={"params": True, "dropout": True},
                length=DEPTH,
            )
            h, _ = stack(self.layer, name="blocks")(h, None)
        else:
            h = self.layer.call(self.layer.build(name="layer"), h).reshape(B, T, -1)
        return nn.Dense(W, name="dense_1")(h)


def _linen_input(layer: Layer) -> jax.Array:
    return _tokens() if layer.tokens else _x()


def _linen_loss(model: nn.Module, layer: Layer, rest: dict, x: jax.Array) -> Callable:
    """``loss(variables)``: ``rest`` (the batch statistics) updated but not differentiated."""
    target = _target()

    def loss(variables):
        kwargs = {"rngs": {"dropout": jax.random.key(4)}}
        if layer.mutable:
            out, _ = model.apply({**variables, **rest}, x, mutable=list(layer.mutable), **kwargs)
        else:
            out = model.apply(variables, x, **kwargs)
        return jnp.sum(out * target)

    return loss


def _linen_calls(model: nn.Module, variables: dict, x: jax.Array) -> tuple[str, ...]:
    """The paths of the modules the bare model calls, in the order they return."""
    order: list[str] = []

    def record(next_fun, args, kwargs, context):
        out = next_fun(*args, **kwargs)
        if context.method_name == "__call__" and context.module.scope.path:
            order.append("/".join(context.module.scope.path))
        return out

    with nn.intercept_methods(record):
        model.apply(variables, x, rngs={"dropout": jax.random.key(4)}, mutable=True)
    return tuple(dict.fromkeys(order))


def _linen_rows(layer: Layer, scanned: bool, variables: dict, x: jax.Array) -> tuple[str, ...]:
    """The telemetry rows expected: one per module call; a stack's layer by layer."""
    calls = _linen_calls(LinenChain(layer), variables, x)
    if not scanned:
        return calls
    inner = [c for c in calls if c == "layer" or c.startswith("layer/")]
    per_layer = [f"blocks/{c}[{{i}}]" for c in inner] + ["blocks[{i}]"]
    stack = [row.format(i=i) for i in range(DEPTH) for row in per_layer]
    return ("dense_0", *stack, "dense_1")


@pytest.mark.parametrize(
    "name, scanned, jit",
    _cases(LINEN, nn, {("Dense", False)}),
)  # attention (14 s) in the full suite; the NNX probes test keeps MultiHeadAttention quick
@pytest.mark.full(keep=1)  # about 7 s a case
def test_linen_probes_give_one_finite_row_per_module_call(
    name: str, scanned: bool, jit: bool
) -> None:
    layer = LINEN[name]
    x = _linen_input(layer)
    model = jdls.linen.probes(LinenChain(layer, scanned))
    variables = model.init({"params": jax.random.key(0), "dropout": jax.random.key(4)}, x)
    diff = {k: variables[k] for k in ("params", "jdls")}
    rest = {k: v for k, v in variables.items() if k not in diff}
    loss = _linen_loss(model, layer, rest, x)
    _, grads = _maybe_jit(jdls.StaticScale(2.0**8).value_and_grad(loss), jit)(diff)
    t = jdls.Telemetry.of(grads["jdls"])
    if scanned:
        bare = LinenChain(layer).init(jax.random.key(0), x)
    else:
        bare = {"params": variables["params"], **rest}
    _assert_rows(t, _linen_rows(layer, scanned, bare, x))


def _far_apart(sites: Any) -> Any:
    """The layers' scales far apart: ``2**0``, ``2**9``, ``2**18``, ... in forward order (a
    stack's layers each their own)."""
    found = [s for s in jax.tree.leaves(sites, is_leaf=jdls.is_site) if _is_layer_site(s)]
    first, k = {}, 0
    for site in sorted(found, key=lambda s: s.kind.position):
        first[site.kind.position] = k
        k += int(np.prod(jnp.shape(site.value["scale"].loss_scale)))

    def set_level(site):
        if not _is_layer_site(site):
            return site
        value = dict(site.value)
        shape = jnp.shape(value["scale"].loss_scale)
        k = first[site.kind.position]
        exponents = np.arange(k, k + int(np.prod(shape))) * 9.0
        value["scale"] = value["scale"].replace(
            loss_scale=jnp.asarray(2.0**exponents).reshape(shape)
        )
        return jdls.Site(site.kind, value)

    return jax.tree.map(set_level, sites, is_leaf=jdls.is_site)


def _is_layer_site(site: Any) -> bool:
    return jdls.is_site(site) and isinstance(site.kind, jdls.LayerScale)


@pytest.mark.parametrize("name, scanned, jit", _cases(LINEN, nn, {("LayerNorm", True)}))
def test_linen_layer_scales_give_the_bare_models_gradients(
    name: str, scanned: bool, jit: bool
) -> None:
    layer = LINEN[name]
    x = _linen_input(layer)
    bare = LinenChain(layer, scanned)
    model = jdls.linen.layer_scales(bare, jdls.AdaptiveScale())
    variables = model.init({"params": jax.random.key(0), "dropout": jax.random.key(4)}, x)
    rest = {k: v for k, v in variables.items() if k not in ("params", "jdls")}
    sites = _far_apart(variables["jdls"])
    first = "layer" if layer.tokens else "dense_0"
    middle = "blocks" if scanned else ("dense_0" if layer.tokens else "layer")
    positions = {k: s["layer_scale"].kind.position for k, s in sites.items()}
    assert positions == {first: 0, middle: 1, "dense_1": 2}
    state = jdls.linen.TrainState.create(
        apply_fn=model.apply,
        params=variables["params"],
        sites=sites,
        tx=jdls.wrap(optax.sgd(0.1), jdls.NoOpScale()),
    )
    loss = _linen_loss(model, layer, rest, x)
    value, grads = _maybe_jit(state.value_and_grad(loss), jit)(state.variables)
    bare_loss = _linen_loss(bare, layer, rest, x)
    ref_value, ref = _bare_reference(
        ("linen", name),
        lambda p: bare_loss({"params": p}),
        variables["params"],
        (variables["params"], rest, x),
        jit,
        scanned,
    )
    _assert_grads_equal(grads["params"], ref, exact=not (jit or scanned))
    np.testing.assert_allclose(value, ref_value, rtol=1e-6)
    # each layer's measurement: its own gradients' largest magnitude, finite
    for key, measured in grads["jdls"].items():
        _assert_measured(measured["layer_scale"].value, grads["params"].get(key, {}))


def _assert_measured(value: dict, grads: Any) -> None:
    """A layer's measurement: its own gradients' largest magnitude (per stacked layer; 0
    without parameters), all finite."""
    shape = jnp.shape(value["amax"])
    own = [jnp.abs(g).reshape(*shape, -1).max(-1) for g in jax.tree.leaves(grads)]
    expected = jnp.max(jnp.stack(own), axis=0) if own else jnp.zeros(shape)
    np.testing.assert_array_equal(value["amax"], expected)
    assert np.asarray(value["finite"]).tolist() == np.ones(shape).tolist()


# --------------------------------------------------------------------------------------------
# NNX
# --------------------------------------------------------------------------------------------


class NnxBlock(nnx.Module):
    """The module under test, its output reshaped for the next layer: a stack's block."""

    def __init__(self, name: str, rngs: nnx.Rngs) -> None:
        self.kind = name
        self.layer = NNX[name].build(rngs)

    def __call__(self, h):
        return NNX[self.kind].call(self.layer, h).reshape(B, T, -1)


class NnxChain(nnx.Module):
    """Dense, the module, Dense (an embedding: the module, Dense, Dense); or Dense, a stack
    of ``DEPTH`` blocks made by ``nnx.vmap`` and run by ``nnx.scan``, Dense. ``probes`` and
    ``scales``: the stack's sites, made in its constructor (one per layer)."""

    def __init__(
        self, name: str, rngs: nnx.Rngs, scanned: bool = False, probes: bool = False, scales=None
    ) -> None:
        self.kind, self.scanned = name, scanned
        if NNX[name].tokens:
            self.layer = NNX[name].build(rngs)
        self.dense_0 = nnx.Linear(W, W, rngs=rngs)
        if scanned:

            @nnx.split_rngs(splits=DEPTH)
            @nnx.vmap(in_axes=(0,), out_axes=0)
            def create(rngs: nnx.Rngs) -> NnxBlock:
                block = NnxBlock(name, rngs)
                if probes:
                    jdls.nnx.probes(block)
                if scales is not None:
                    jdls.nnx.layer_scale(block, scales, 1)
                return block

            self.blocks = create(rngs)
        elif not NNX[name].tokens:
            self.layer = NNX[name].build(rngs)
        self.dense_1 = nnx.Linear(W, W, rngs=rngs)
        if scanned and scales is not None:
            jdls.nnx.layer_scale(self.dense_0, scales, 0)
            jdls.nnx.layer_scale(self.dense_1, scales, 2)

    def __call__(self, x):
        layer = NNX[self.kind]
        if layer.tokens:
            return self.dense_1(self.dense_0(layer.call(self.layer, x)))
        h = self.dense_0(x)
        if self.scanned:

            @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
            def forward(h, block):
                return block(h)

            h = forward(h, self.blocks)
        else:
            h = layer.call(self.layer, h).reshape(B, T, -1)
        return self.dense_1(h)


def _nnx_loss(model: NnxChain, x: jax.Array) -> jax.Array:
    return jnp.sum(model(x) * _target())


def _nnx_rows(model: NnxChain, scanned: bool) -> set[str]:
    """The rows expected: every module called (all but containers), a stack's per layer, the
    model's own named after its class."""
    rows = set()
    for path, module in nnx.iter_modules(model):
        if isinstance(module, nnx.List | nnx.Dict):
            continue
        name = "/".join(map(str, path)) or type(module).__name__
        if scanned and path[:1] == ("blocks",):
            rows |= {f"{name}[{i}]" for i in range(DEPTH)}
        else:
            rows.add(name)
    return rows


@pytest.mark.parametrize("name, scanned, jit", _cases(NNX, nnx, {("MultiHeadAttention", False)}))
def test_nnx_probes_give_one_finite_row_per_module_call(
    name: str, scanned: bool, jit: bool
) -> None:
    layer = NNX[name]
    x = _tokens() if layer.tokens else _x()
    model = jdls.nnx.probes(NnxChain(name, nnx.Rngs(0), scanned, probes=True))
    fn = jdls.nnx.value_and_grad(_nnx_loss, jdls.StaticScale(2.0**8))
    _, grads = (nnx.jit(fn) if jit else fn)(model, x)
    t = jdls.Telemetry.of(nnx.state(grads, jdls.nnx.SiteVariable))
    expected = _nnx_rows(NnxChain(name, nnx.Rngs(0), scanned), scanned)
    assert sorted(t.names) == sorted(expected)
    assert t.names[-1] == "NnxChain"
    _assert_rows(t, t.names)


def _site_variables(model: Any) -> list[Any]:
    return [v for _, v in nnx.iter_graph(model) if isinstance(v, jdls.nnx.SiteVariable)]


@pytest.mark.parametrize("name, scanned, jit", _cases(NNX, nnx, {("Embed", False)}))
@pytest.mark.full  # about 9 s; the linen layer-scales and nnx probes tests stay, and the matrix's nnx cells
def test_nnx_layer_scales_give_the_bare_models_gradients(
    name: str, scanned: bool, jit: bool
) -> None:
    layer = NNX[name]
    x = _tokens() if layer.tokens else _x()
    if scanned:
        model = NnxChain(name, nnx.Rngs(0), scanned, scales=jdls.AdaptiveScale())
    else:
        model = jdls.nnx.layer_scales(NnxChain(name, nnx.Rngs(0)), jdls.AdaptiveScale())
    variables = _site_variables(model)
    for variable, site in zip(
        variables, _far_apart([v.get_value() for v in variables]), strict=True
    ):
        variable.set_value(site)
    fn = jdls.nnx.layer_scaled_value_and_grad(_nnx_loss)
    value, grads = (nnx.jit(fn) if jit else fn)(model, x)
    bare = NnxChain(name, nnx.Rngs(0), scanned)
    graphdef, params, rest = nnx.split(bare, nnx.Param, ...)

    def bare_loss(p):
        return _nnx_loss(nnx.merge(graphdef, p, rest, copy=True), x)

    ref_value, ref = _bare_reference(
        ("nnx", name), bare_loss, params, (params, rest, x), jit, scanned
    )
    got = nnx.to_pure_dict(nnx.state(grads, nnx.Not(jdls.nnx.SiteVariable)))
    _assert_grads_equal(got, nnx.to_pure_dict(ref), exact=not (jit or scanned))
    np.testing.assert_allclose(value, ref_value, rtol=1e-6)
    # each layer's measurement: its own gradients' largest magnitude, finite
    for path, measured in nnx.to_flat_state(nnx.state(grads, jdls.nnx.SiteVariable)):
        _assert_measured(measured.get_value().value, got.get(path[0], {}))
