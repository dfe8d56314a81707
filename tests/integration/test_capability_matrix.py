"""The composition matrix of the advanced capabilities: never a silently different result.

Capabilities: per-layer scales (hand-placed ``jdls.layer_boundary``, ``jdls.linen.layer_boundaries``,
NNX ``jdls.nnx.layer_scaled_value_and_grad``) and probes (``jdls.probe``, ``jdls.linen.probes``,
``jdls.nnx.probes``). Compositions: none, an outer ``jax.jit``, an inner ``jax.jit`` of the forward,
``nn.jit`` / ``nnx.jit``, ``jax.checkpoint`` / ``nn.remat`` / ``nnx.remat``, ``lax.scan`` over
layers / ``nn.scan``, an inner and an outer ``vmap``, ``shard_map`` with ``check_vma`` on and
off, ``pmap``, positional Python arguments (bool, str, callable), ``has_aux``. Parameter
dtypes float32 / bfloat16 / float16, with or without an integer and a ``None`` leaf.

Each cell either equals its reference or raises a clear error at trace time:

* gradients: ``jax.value_and_grad`` of the same function, unscaled, under the same
  composition (power-of-two scales, nothing under- or overflows: bit for bit);
* probes: the statistics computed directly from the cotangents, read as the gradients of zero
  perturbations added where the probes sit;
* refused cells (:data:`REFUSED`) raise the error that names the construct; a cell that plain
  ``jax.value_and_grad`` itself refuses (an integer parameter) makes jdls raise the same type.

CI runs a fixed sample covering every value of every axis; ``JDLS_FULL_MATRIX=1`` runs all.
"""

from __future__ import annotations

import functools
import itertools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _helpers import FULL_MATRIX
from flax import nnx
from jax.sharding import PartitionSpec as P

import jdls
from jdls._nnx_hooks import hook_outputs, module_name

CAPABILITIES = ("boundaries", "linen_boundaries", "nnx_layers", "probe", "probe_linen", "probe_nnx")
COMPOSITIONS = (
    "none",
    "outer_jit",
    "inner_jit",
    "framework_jit",
    "checkpoint",
    "scan",
    "inner_vmap",
    "outer_vmap",
    "shard_map_vma",
    "shard_map_novma",
    "pmap",
    "static_args",
    "has_aux",
)
DTYPES = ("float32", "bfloat16", "float16")
LEAVES = ("plain", "int", "none")
AXES = (CAPABILITIES, COMPOSITIONS, DTYPES, LEAVES)

NESTED = "nested JAX transformation"
COPY = "a copy of"
#: (capability family, composition) -> the error's pattern; every other cell computes.
REFUSED = {
    (cap, comp): NESTED
    for cap in CAPABILITIES
    for comp in ("inner_jit", "framework_jit", "checkpoint", "scan", "inner_vmap")
    if not (comp == "framework_jit" and cap in ("boundaries", "probe"))  # no framework
}
for _cap in ("nnx_layers", "probe_nnx"):  # NNX transformations call copies of the modules
    for _comp in ("inner_jit", "framework_jit", "checkpoint"):
        REFUSED[(_cap, _comp)] = COPY

N_DEVICES = 2
AXIS = "d"
WIDTH = 4
BATCH = 4
LAYER_SCALES = (2.0**8, 2.0**4, 2.0**1)
PROBE_SCALE = 2.0**4
STATICS = (True, "sum", jnp.tanh)


def _applicable(cap, comp):
    return not (comp == "framework_jit" and cap in ("boundaries", "probe"))


def _all_combinations():
    return [c for c in itertools.product(*AXES) if _applicable(c[0], c[1])]


def _sample():
    """A fixed subset in which every value of every axis appears: every refused
    (capability, composition) pair (they fail at trace time, fast), and for each composition
    that computes, one per-layer and one probe capability in rotation; dtypes and leaves
    rotate over the cells."""
    pairs = [p for p in itertools.product(CAPABILITIES, COMPOSITIONS) if _applicable(*p)]
    computing = [c for c in COMPOSITIONS if all((cap, c) not in REFUSED for cap in CAPABILITIES)]
    chosen = [p for p in pairs if p in REFUSED]
    for i, comp in enumerate(computing):
        chosen += [(CAPABILITIES[i % 3], comp), (CAPABILITIES[3 + (i + 1) % 3], comp)]
    cells = [
        (cap, comp, DTYPES[k % len(DTYPES)], LEAVES[(k // len(DTYPES)) % len(LEAVES)])
        for k, (cap, comp) in enumerate(chosen)
    ]
    return sorted(cells, key=_all_combinations().index)


FULL = FULL_MATRIX
CELLS = _all_combinations() if FULL else _sample()


def test_sample_covers_every_value():
    sample = _sample()
    assert len(set(sample)) == len(sample) == 44
    for axis, values in enumerate(AXES):
        assert {c[axis] for c in sample} == set(values)
    assert {c[:2] for c in sample} >= set(REFUSED)


# --------------------------------------------------------------------------------------------
# The loss: three tanh layers of width 4, in the parameters' dtype; the statistics and the
# reference perturbations.
# --------------------------------------------------------------------------------------------


def _x():
    return jnp.asarray(np.random.default_rng(1).standard_normal((BATCH, WIDTH)), jnp.float32)


def _finish(h, comp, statics):
    """The scalar loss of the last layer's output (float32), ``(loss, aux)`` with has_aux."""
    y = h.astype(jnp.float32)
    if comp == "static_args":
        train, mode, act = statics
        assert isinstance(train, bool) and isinstance(mode, str) and callable(act)
        y = act(y) if train else y
        loss = jnp.sum(y**2) if mode == "sum" else jnp.mean(y**2)
    else:
        assert not statics
        loss = jnp.sum(y**2)
    if comp == "has_aux":
        return loss, {"mean": jnp.mean(y)}
    return loss


def _stats(g):
    """amax, flushed (in float16), zeros, non-finite of one cotangent, from its values."""
    c = g.astype(jnp.float32)
    nonzero = jnp.sum(c != 0)
    amax = jnp.max(jnp.abs(c))
    if g.dtype == jnp.float16:
        flushed = jnp.zeros((), jnp.float32)
    else:
        flushed = jnp.sum((c != 0) & (c.astype(jnp.float16) == 0)) / jnp.maximum(nonzero, 1)
    return jnp.stack(
        [amax, flushed, 1 - nonzero / c.size, (~jnp.isfinite(amax)).astype(jnp.float32)]
    ).astype(jnp.float32)


# The references differentiate integer leaves only when asked (``float0`` gradients, which
# the comparison reads as ``None``): jdls holds them fixed as eqx.filter_value_and_grad does.
_ALLOW_INT = [False]


def _int_as_none(tree):
    return jax.tree_util.tree_map(
        lambda g: None if getattr(g, "dtype", None) == jax.dtypes.float0 else g, tree
    )


def _perturbed_value_and_grad(run, has_aux):
    """The probes' reference: ``run(p, mark, *rest)`` with ``mark(x, name) = x + eps[name]``;
    returns (value, grads of p, stats table) with the loss scaled by PROBE_SCALE."""

    def fn(p, *rest):
        shapes = {}

        def record(x, name):
            shapes[name] = (x.shape, x.dtype)
            return x

        jax.eval_shape(lambda q: [run(q, record, *rest), None][1], p)
        names = list(shapes)

        def scaled(q, eps):
            out = run(q, lambda x, name: x + eps[name], *rest)
            loss, aux = out if has_aux else (out, None)
            return loss * PROBE_SCALE, (loss, aux)

        eps = {n: jnp.zeros(s, d) for n, (s, d) in shapes.items()}
        manual = tuple(jax.sharding.get_abstract_mesh().manual_axes)
        if manual:  # inside shard_map: each device's own cotangents, not their sum
            eps = {n: jax.lax.pcast(e, manual, to="varying") for n, e in eps.items()}
        (_, (loss, aux)), (grads, cot) = jax.value_and_grad(
            scaled, (0, 1), has_aux=True, allow_int=_ALLOW_INT[0]
        )(p, eps)
        grads = jax.tree_util.tree_map(
            lambda g: g if g.dtype == jax.dtypes.float0 else g / PROBE_SCALE, grads
        )
        table = jnp.stack([_stats(cot[n]) for n in names])
        return ((loss, aux) if has_aux else loss), grads, (tuple(names), table)

    return fn


# --------------------------------------------------------------------------------------------
# Hand-placed boundaries and probes.
# --------------------------------------------------------------------------------------------

NAMES = ("d0", "d1", "d2")


def _hand_params(dtype, leaves):
    rng = np.random.default_rng(0)
    p = {n: {"w": jnp.asarray(rng.standard_normal((WIDTH, WIDTH)) * 0.5, dtype)} for n in NAMES}
    if leaves == "int":
        p["d0"]["count"] = jnp.int32(3)
    if leaves == "none":
        p["d2"]["nothing"] = None
    return p


def _hand_forward(p, x, mark, comp):
    def layer(w, h):
        return jnp.tanh(h.astype(w.dtype) @ w)

    def body(p, x):
        h = x
        for n in NAMES:
            h = mark(layer(p[n]["w"], h), n)
        return h

    if comp == "inner_jit":
        return jax.jit(body)(p, x)
    if comp == "checkpoint":
        return jax.checkpoint(body)(p, x)
    if comp == "scan":
        ws = jnp.stack([p[n]["w"] for n in NAMES])
        h, _ = jax.lax.scan(
            lambda h, w: (mark(layer(w, h), "layers"), None), x.astype(ws.dtype), ws
        )
        return h
    if comp == "inner_vmap":
        return jax.vmap(lambda xi: body(p, xi))(x)
    return body(p, x)


def _identity(x, name):
    del name
    return x


def _hand(cap, comp, dtype, leaves):
    """(the jdls function, the reference function, the arguments)."""
    has_aux = comp == "has_aux"

    def run(p, mark, x, *statics):
        return _finish(_hand_forward(p, x, mark, comp), comp, statics)

    if cap == "boundaries":
        scales = {n: jdls.StaticScale(s) for n, s in zip(NAMES, LAYER_SCALES, strict=True)}
        actual = jdls.layer_scaled_value_and_grad(
            lambda p, x, *s: run(p, jdls.layer_boundary, x, *s), scales, has_aux=has_aux
        )
        reference = _plain_value_and_grad(lambda p, x, *s: run(p, _identity, x, *s), has_aux)
    else:
        actual = _telemetry_table(
            jdls.probed_value_and_grad(
                lambda p, x, *s: run(p, jdls.probe, x, *s),
                jdls.StaticScale(PROBE_SCALE),
                has_aux=has_aux,
            )
        )
        reference = _perturbed_value_and_grad(run, has_aux)
    return actual, reference, (_hand_params(dtype, leaves), _x())


def _plain_value_and_grad(fun, has_aux):
    def fn(p, *args):
        value, grads = jax.value_and_grad(fun, has_aux=has_aux, allow_int=_ALLOW_INT[0])(p, *args)
        return value, grads, None

    return fn


def _telemetry_table(fn):
    """``(value, grads, (names, table))`` from ``probed_value_and_grad``'s result."""

    @functools.wraps(fn)
    def wrapped(*args):
        value, grads, t = fn(*args)
        table = jnp.stack([t.amax, t.flushed, t.zeros, t.nonfinite], axis=-1)
        return value, grads, (t.names, table)

    return wrapped


# --------------------------------------------------------------------------------------------
# Flax linen: three top-level layers (or one nn.scan of three).
# --------------------------------------------------------------------------------------------


class _LinenLayer(nn.Module):
    dtype: str

    @nn.compact
    def __call__(self, h):
        return jnp.tanh(nn.Dense(WIDTH, dtype=self.dtype, param_dtype=self.dtype)(h))


class _LinenCell(nn.Module):
    dtype: str

    @nn.compact
    def __call__(self, h, _):
        return _LinenLayer(self.dtype)(h), None


class _LinenMLP(nn.Module):
    dtype: str
    comp: str

    @nn.compact
    def __call__(self, x):
        if self.comp == "scan":
            scanned = nn.scan(
                _LinenCell, variable_axes={"params": 0}, split_rngs={"params": True}, length=3
            )
            return scanned(self.dtype, name="layers")(x.astype(self.dtype), None)[0]
        cls = {"framework_jit": nn.jit(_LinenLayer), "checkpoint": nn.remat(_LinenLayer)}.get(
            self.comp, _LinenLayer
        )
        h = x
        for i in range(3):
            h = cls(self.dtype, name=f"layer{i}")(h)
        return h


def _linen(cap, comp, dtype, leaves):
    model = _LinenMLP(dtype, comp)
    params = dict(model.init(jax.random.key(0), _x())["params"])
    names = ["layers"] if comp == "scan" else [f"layer{i}" for i in range(3)]
    if leaves == "int":  # under nn.scan, one per iteration
        count = jnp.full((3,), 3, jnp.int32) if comp == "scan" else jnp.int32(3)
        params[names[0]] = {**params[names[0]], "count": count}
    if leaves == "none":
        params[names[-1]] = {**params[names[-1]], "nothing": None}
    has_aux = comp == "has_aux"

    def forward(p, x):
        def apply(p, x):
            return model.apply({"params": p}, x)

        if comp == "inner_jit":
            return jax.jit(apply)(p, x)
        if comp == "inner_vmap":
            return jax.vmap(lambda xi: apply(p, xi))(x)
        return apply(p, x)

    def plain(p, x, *statics):
        return _finish(forward(p, x), comp, statics)

    if cap == "linen_boundaries":
        scales = {n: jdls.StaticScale(s) for n, s in zip(names, LAYER_SCALES, strict=False)}

        def loss(p, x, *statics):
            with jdls.linen.layer_boundaries():
                return plain(p, x, *statics)

        actual = jdls.layer_scaled_value_and_grad(loss, scales, has_aux=has_aux)
        reference = _plain_value_and_grad(plain, has_aux)
    else:

        def probed(p, x, *statics):
            with jdls.linen.probes():
                return plain(p, x, *statics)

        actual = _telemetry_table(
            jdls.probed_value_and_grad(probed, jdls.StaticScale(PROBE_SCALE), has_aux=has_aux)
        )

        def run(p, mark, x, *statics):
            def interceptor(next_fun, args, kwargs, context):
                out = next_fun(*args, **kwargs)
                if context.method_name != "__call__":
                    return out
                return mark(out, "/".join(str(q) for q in context.module.path))

            with nn.intercept_methods(interceptor):
                return plain(p, x, *statics)

        reference = _perturbed_value_and_grad(run, has_aux)
    return actual, reference, (params, _x())


# --------------------------------------------------------------------------------------------
# Flax NNX: three child layers in an nnx.List; the state goes in, the model is merged inside.
# --------------------------------------------------------------------------------------------


class _NNXLayer(nnx.Module):
    def __init__(self, dtype, rngs):
        self.lin = nnx.Linear(WIDTH, WIDTH, dtype=dtype, param_dtype=dtype, rngs=rngs)

    def __call__(self, h):
        return jnp.tanh(self.lin(h))


class _NNXMLP(nnx.Module):
    def __init__(self, dtype, leaves):
        self.layers = nnx.List([_NNXLayer(dtype, nnx.Rngs(i)) for i in range(3)])
        if leaves == "int":
            self.count = nnx.Variable(jnp.int32(3))
        if leaves == "none":
            self.nothing = None

    def __call__(self, x, comp):
        h = x
        for layer in self.layers:
            if comp == "framework_jit":
                h = nnx.jit(lambda m, h: m(h))(layer, h)
            elif comp == "checkpoint":
                h = nnx.remat(lambda m, h: m(h))(layer, h)
            elif comp == "inner_jit":
                graphdef, state = nnx.split(layer)
                h = jax.jit(lambda s, h, g=graphdef: nnx.merge(g, s)(h))(state, h)
            elif comp == "scan":
                h, _ = jax.lax.scan(lambda c, _, m=layer: (m(c), None), h, None, length=1)
            elif comp == "inner_vmap":
                h = jax.vmap(lambda hi, m=layer: m(hi))(h)
            else:
                h = layer(h)
        return h


def _nnx(cap, comp, dtype, leaves):
    """The functions take ``((params, rest), x, *statics)``: the model is merged inside, so
    that its variables belong to the trace they are used in."""
    model = _NNXMLP(dtype, leaves)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    has_aux = comp == "has_aux"

    def loss_fn(m, x, *statics):
        return _finish(m(x, comp), comp, statics)

    if cap == "nnx_layers":
        scales = {f"layers/{i}": jdls.StaticScale(s) for i, s in enumerate(LAYER_SCALES)}
        fn = jdls.nnx.layer_scaled_value_and_grad(loss_fn, scales, has_aux=has_aux)

        def actual(pr, x, *statics):
            value, grads, finite = fn(nnx.merge(graphdef, *pr), x, *statics)
            return value, nnx.to_pure_dict(grads), finite

        def reference(pr, x, *statics):
            p, r = pr
            grad_fn = jax.value_and_grad(
                lambda q: loss_fn(nnx.merge(graphdef, q, r), x, *statics),
                has_aux=has_aux,
                allow_int=_ALLOW_INT[0],
            )
            value, grads = grad_fn(p)
            return value, nnx.to_pure_dict(grads), None

    else:

        def probed(p, r, x, *statics):
            m = nnx.merge(graphdef, p, r)
            with jdls.nnx.probes(m):
                return loss_fn(m, x, *statics)

        probed_fn = _telemetry_table(
            jdls.probed_value_and_grad(probed, jdls.StaticScale(PROBE_SCALE), has_aux=has_aux)
        )

        def actual(pr, x, *statics):
            value, grads, telemetry = probed_fn(*pr, x, *statics)
            return value, nnx.to_pure_dict(grads), telemetry

        def run(p, mark, r, x, *statics):
            m = nnx.merge(graphdef, p, r)
            hooks = [
                (module, functools.partial(mark, name=module_name(path)))
                for path, module in nnx.iter_modules(m)
            ]
            with hook_outputs(hooks):
                return loss_fn(m, x, *statics)

        perturbed = _perturbed_value_and_grad(run, has_aux)

        def reference(pr, x, *statics):
            value, grads, telemetry = perturbed(*pr, x, *statics)
            return value, nnx.to_pure_dict(grads), telemetry

    return actual, reference, ((params, rest), _x())


# --------------------------------------------------------------------------------------------
# The outer compositions, applied alike to the jdls function and to its reference.
# --------------------------------------------------------------------------------------------


def _split_statics(result):
    """Names (static) apart from the arrays, so that outer transformations see arrays only."""
    value, grads, extra = result
    names, table = extra if isinstance(extra, tuple) else (None, extra)
    return (value, grads, table), names


def _outer(fn, comp, params, x):
    """Run ``fn(params, x, *statics)`` under the outer composition ``comp``."""
    names = []

    def arrays(p, x, *statics):
        out, n = _split_statics(fn(p, x, *statics))
        names.append(n)
        return out

    if comp == "static_args":
        return arrays(params, x, *STATICS), names[0]
    if comp == "outer_jit":
        return jax.jit(arrays)(params, x), names[0]
    if comp == "outer_vmap":
        return jax.vmap(arrays, in_axes=(None, 0))(params, x), names[0]
    devices = jax.devices()[:N_DEVICES]
    if comp == "pmap":
        xs = x.reshape(N_DEVICES, BATCH // N_DEVICES, WIDTH)
        out = jax.pmap(arrays, in_axes=(None, 0), devices=devices)(params, xs)
        return out, names[0]
    if comp in ("shard_map_vma", "shard_map_novma"):
        mesh = jax.make_mesh((N_DEVICES,), (AXIS,), devices=devices)
        x = jax.device_put(x, jax.sharding.NamedSharding(mesh, P(AXIS)))
        sharded = jax.shard_map(
            lambda p, x: jax.tree_util.tree_map(lambda a: jnp.asarray(a)[None], arrays(p, x)),
            mesh=mesh,
            in_specs=(P(), P(AXIS)),
            out_specs=P(AXIS),
            check_vma=comp == "shard_map_vma",
        )
        return jax.jit(sharded)(params, x), names[0]
    return arrays(params, x), names[0]


def _build(cap, comp, dtype, leaves):
    if cap in ("boundaries", "probe"):
        return _hand(cap, comp, dtype, leaves)
    if cap in ("linen_boundaries", "probe_linen"):
        return _linen(cap, comp, dtype, leaves)
    return _nnx(cap, comp, dtype, leaves)


def _widen(g):
    g = jnp.asarray(g)
    return g.astype(jnp.promote_types(g.dtype, jnp.float32)) if _is_float(g) else g


def _is_float(g):
    return jnp.issubdtype(g.dtype, jnp.floating)


def _assert_equal(actual, expected, what):
    a_leaves, a_def = jax.tree_util.tree_flatten(actual)
    e_leaves, e_def = jax.tree_util.tree_flatten(expected)
    assert a_def == e_def, (what, a_def, e_def)
    for a, e in zip(a_leaves, e_leaves, strict=True):
        a, e = np.asarray(a), np.asarray(e)
        assert a.dtype == e.dtype and a.shape == e.shape, (what, a.dtype, e.dtype)
        np.testing.assert_array_equal(a.astype(np.float64), e.astype(np.float64), err_msg=what)


@pytest.mark.parametrize(
    ("cap", "comp", "dtype", "leaves"), CELLS, ids=["-".join(c) for c in CELLS]
)
def test_cell_equals_its_reference_or_is_refused(cap, comp, dtype, leaves):
    actual, reference, (params, x) = _build(cap, comp, dtype, leaves)
    refused = REFUSED.get((cap, comp))
    if refused is not None:
        with pytest.raises(ValueError, match=refused):
            _outer(actual, comp, params, x)
        return
    try:
        expected, expected_names = _outer(reference, comp, params, x)
    except TypeError as error:  # plain JAX refuses an integer parameter
        assert leaves == "int", error
        try:
            _outer(actual, comp, params, x)
        except TypeError:
            return  # jdls refuses it too
        # jdls holds the integer leaf fixed (gradient None), as eqx.filter_value_and_grad does:
        # the float leaves equal JAX's with allow_int, the integer leaf's float0 is None.
        _ALLOW_INT[0] = True
        try:
            expected, expected_names = _outer(reference, comp, params, x)
        finally:
            _ALLOW_INT[0] = False
        expected = (expected[0], _int_as_none(expected[1]), *expected[2:])
    (value, grads, extra), names = _outer(actual, comp, params, x)
    _assert_equal(value, expected[0], "value")
    # jdls returns unscaled gradients at least float32 wide (``LossScale.unscale``)
    _assert_equal(grads, jax.tree_util.tree_map(_widen, expected[1]), "grads")
    if cap in ("probe", "probe_linen", "probe_nnx"):
        assert names == expected_names
        _assert_equal(extra, expected[2], "statistics")
    else:
        assert all(bool(np.all(f)) for f in jax.tree_util.tree_leaves(extra))
