"""The composition matrix of the sites (per-layer scales and probes): every cell computes.

Capabilities: per-layer scales (hand-placed ``jdls.layer_site`` sites,
``jdls.linen.layer_scales``, ``jdls.nnx.layer_scales``) and probes (hand-placed
``jdls.Probe`` sites, ``jdls.linen.probes``, ``jdls.nnx.probes``). Compositions: none, an
outer ``jax.jit``, an inner ``jax.jit`` of the forward, ``nn.jit`` / ``nnx.jit``,
``jax.checkpoint`` / ``nn.remat`` / ``nnx.remat``, ``lax.scan`` over stacked layers /
``nn.scan`` / ``nnx.scan`` (one site per layer, stacked), an inner ``vmap`` (a site per
example, batched along the vmap axis), an outer ``vmap``, ``shard_map`` with ``check_vma`` on
and off, ``pmap``, positional Python arguments (bool, str, callable), ``has_aux``. Parameter
dtypes float32 / bfloat16 / float16, with or without an integer and a ``None`` leaf.

Each cell equals its reference:

* per-layer scales: the gradients are ``jax.value_and_grad``'s of the same function under
  the same composition (power-of-two scales, nothing under- or overflows), to the parameter
  dtype's rounding of the two programs;
* probes: the telemetry equals the statistics of the cotangent at each site, computed
  directly from the cotangents of zero perturbations placed where the sites are (with the
  same stacking: one per layer of a scan, one per example of an inner vmap), by the
  statistics function that tests/test_probe.py checks against hand-computed values.

An integer parameter is held fixed (``None`` gradient), as ``eqx.filter_value_and_grad``
does; plain ``jax.value_and_grad`` refuses it, so its reference uses ``allow_int``. No cell is
refused. CI runs a fixed sample covering every value of every axis; ``JDLS_FULL_MATRIX=1``
runs all.
"""

from __future__ import annotations

import itertools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _helpers import FULL_MATRIX, closing_over_sites, pcast_varying
from flax import nnx
from jax.sharding import PartitionSpec as P

import jdls
from jdls._sites.probe import statistics

CAPABILITIES = (
    "layer_sites",
    "linen_layer_scales",
    "nnx_layer_scales",
    "probe_sites",
    "linen_probes",
    "nnx_probes",
)
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

N_DEVICES = 2
AXIS = "d"
WIDTH = 4
BATCH = 4
DEPTH = 3
LAYER_SCALES = (2.0**8, 2.0**4, 2.0**1)
PROBE_SCALE = 2.0**4
STATICS = (True, "sum", jnp.tanh)


def _applicable(cap, comp):
    return not (comp == "framework_jit" and cap in ("layer_sites", "probe_sites"))


def _all_combinations():
    return [c for c in itertools.product(*AXES) if _applicable(c[0], c[1])]


def _sample():
    """A fixed subset in which every value of every axis appears: for each composition one
    per-layer and one probe capability in rotation (two of each for the inner compositions);
    dtypes and leaves rotate over the cells."""
    chosen = []
    for i, comp in enumerate(COMPOSITIONS):
        chosen += [(CAPABILITIES[i % 3], comp), (CAPABILITIES[3 + (i + 1) % 3], comp)]
        if comp in ("inner_jit", "framework_jit", "checkpoint", "scan", "inner_vmap"):
            chosen += [(CAPABILITIES[(i + 1) % 3], comp), (CAPABILITIES[3 + (i + 2) % 3], comp)]
    chosen = [c for c in dict.fromkeys(chosen) if _applicable(*c)]
    cells = [
        (cap, comp, DTYPES[k % len(DTYPES)], LEAVES[(k // len(DTYPES)) % len(LEAVES)])
        for k, (cap, comp) in enumerate(chosen)
    ]
    return sorted(cells, key=_all_combinations().index)


CELLS = _all_combinations() if FULL_MATRIX else _sample()
# The quick run (tests/conftest.py) takes one cell of each composition, the cells together
# holding every capability, dtype and kind of leaf (the cheapest such cells of the sample);
# the other cells are marked full.
QUICK = (
    ("layer_sites", "none", "float32", "plain"),
    ("nnx_probes", "outer_jit", "float32", "int"),
    ("linen_probes", "inner_jit", "bfloat16", "none"),
    ("nnx_probes", "framework_jit", "bfloat16", "plain"),
    ("nnx_layer_scales", "checkpoint", "bfloat16", "int"),
    ("layer_sites", "scan", "float16", "none"),
    ("nnx_probes", "inner_vmap", "bfloat16", "int"),
    ("nnx_probes", "outer_vmap", "float32", "none"),
    ("probe_sites", "shard_map_vma", "float16", "none"),
    ("layer_sites", "shard_map_novma", "float32", "plain"),
    ("linen_layer_scales", "pmap", "float16", "plain"),
    ("nnx_layer_scales", "static_args", "bfloat16", "int"),
    ("layer_sites", "has_aux", "float32", "none"),
)


def _cells(cells):
    return [
        pytest.param(*c, id="-".join(c), marks=() if c in QUICK else (pytest.mark.full,))
        for c in cells
    ]


def test_sample_covers_every_value():
    sample = _sample()
    assert len(set(sample)) == len(sample)
    for axis, values in enumerate(AXES):
        assert {c[axis] for c in sample} == set(values)
        assert {c[axis] for c in QUICK} == set(values)
    assert set(QUICK) <= set(sample)


# --------------------------------------------------------------------------------------------
# The loss: three tanh layers of width 4, in the parameters' dtype.
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


def _varying(tree):
    """Inside shard_map: the sites (or perturbations) of each device its own."""
    manual = tuple(getattr(jax.sharding.get_abstract_mesh(), "manual_axes", ()))
    return pcast_varying(tree, manual) if manual else tree


_ALLOW_INT = [False]  # the references differentiate integer leaves only when asked


def _int_as_none(tree):
    return jax.tree_util.tree_map(
        lambda g: None if getattr(g, "dtype", None) == jax.dtypes.float0 else g, tree
    )


def _layer_site(i):
    return jdls.layer_site(jdls.StaticScale(LAYER_SCALES[i]), i)


def _stacked_layer_site():
    """One site for the three layers of a scan, each at its own scale."""
    sites = [jdls.layer_site(jdls.StaticScale(s), 0) for s in LAYER_SCALES]
    return jax.tree_util.tree_map(lambda *v: jnp.stack(v), *sites)


# --------------------------------------------------------------------------------------------
# Probes' reference: zero perturbations where the sites are, their cotangents' statistics.
# --------------------------------------------------------------------------------------------


def _perturbations(sites, shapes):
    """Zeros shaped like the values the sites see (``shapes``: site path -> shape, dtype),
    in a tree shaped like ``sites``."""

    def one(path, site):
        if not isinstance(site, jdls.Site) or not isinstance(site.kind, jdls.Probe):
            return site
        shape, dtype = shapes[jax.tree_util.keystr(path)]
        return jnp.zeros(shape, dtype)

    return jax.tree_util.tree_map_with_path(one, sites, is_leaf=jdls.is_site)


def _measured_like(sites, cotangents):
    """The probes' measurements computed from the perturbations' cotangents, as sites."""

    def one(site, cot):
        if not isinstance(site, jdls.Site) or not isinstance(site.kind, jdls.Probe):
            return site
        stack = site.value.shape[:-1]
        per_use = cot.reshape(int(np.prod(stack, dtype=int)), *cot.shape[len(stack) :])
        values = jax.vmap(lambda c: statistics([c], site.kind.compute_dtype))(per_use)
        return jdls.Site(site.kind, values.reshape(*stack, -1))

    return jax.tree_util.tree_map(one, sites, cotangents, is_leaf=jdls.is_site)


def _probe_table(measured):
    t = jdls.Telemetry.of(measured)
    table = jnp.stack([t.amax, t.flushed, t.zeros, t.nonfinite, t.uses], axis=-1)
    return t.names, table


def _probe_pair(run, sites, has_aux, shapes_of):
    """(actual, reference) for ``run(p, sites, mark, x, *statics)``: actual passes values
    through the sites, the reference adds perturbations there."""

    def actual(p, x, *statics):
        s = _varying(sites)
        fn = jdls.StaticScale(PROBE_SCALE).value_and_grad(
            lambda q, s: run(q, s, jdls.apply_site, x, *statics), (0, 1), has_aux
        )
        value, (grads, measured) = fn(p, s)
        return value, grads, _probe_table(measured)

    def reference(p, x, *statics):
        shapes = shapes_of(p, x, *statics)
        eps = _varying(_perturbations(sites, shapes))

        def scaled(q, e):
            out = run(q, e, lambda h, e: h + e, x, *statics)
            loss, aux = out if has_aux else (out, None)
            return loss * PROBE_SCALE, (loss, aux)

        (_, (loss, aux)), (grads, cot) = jax.value_and_grad(
            scaled, (0, 1), has_aux=True, allow_int=_ALLOW_INT[0]
        )(p, eps)
        grads = jax.tree_util.tree_map(
            lambda g: g if g.dtype == jax.dtypes.float0 else g / PROBE_SCALE, grads
        )
        measured = _measured_like(sites, cot)
        # each use measured once: the reference's uses are 1 where a site was reached
        return ((loss, aux) if has_aux else loss), grads, _probe_table(measured)

    return actual, reference


# --------------------------------------------------------------------------------------------
# Hand-placed sites.
# --------------------------------------------------------------------------------------------

NAMES = ("d0", "d1", "d2")


def _hand_params(dtype, leaves, comp):
    rng = np.random.default_rng(0)
    p = {n: {"w": jnp.asarray(rng.standard_normal((WIDTH, WIDTH)) * 0.5, dtype)} for n in NAMES}
    if comp == "scan":  # the layers stacked, like their site
        p = {"layers": {"w": jnp.stack([p[n]["w"] for n in NAMES])}}
    first, last = ("layers", "layers") if comp == "scan" else ("d0", "d2")
    if leaves == "int":
        p[first]["count"] = jnp.int32(3)
    if leaves == "none":
        p[last]["nothing"] = None
    return p


def _layer(w, h):
    return jnp.tanh(h.astype(w.dtype) @ w)


def _hand_forward(p, sites, mark, x, comp):
    def body(p, sites, x):
        h = x
        for n in NAMES:
            h = mark(_layer(p[n]["w"], h), sites[n])
        return h

    if comp == "inner_jit":
        return jax.jit(body, static_argnums=())(p, sites, x)
    if comp == "checkpoint":
        return jax.checkpoint(body)(p, sites, x)
    if comp == "unrolled_scan":  # the scan's layers one by one (the site's key per layer)
        h = x
        for w in p["layers"]["w"]:
            h = mark(_layer(w, h), sites["layers"])
        return h
    if comp == "scan":
        ws = p["layers"]["w"]
        h, _ = jax.lax.scan(
            lambda h, ws: (mark(_layer(ws[0], h), ws[1]), None),
            x.astype(ws.dtype),
            (ws, sites["layers"]),
        )
        return h
    if comp == "inner_vmap":  # a probe per example; a layer's scale shared by the examples
        axes = jax.tree_util.tree_map(
            lambda s: (
                None if isinstance(s, jdls.Site) and isinstance(s.kind, jdls.LayerScale) else 0
            ),
            sites,
            is_leaf=jdls.is_site,
        )
        return jax.vmap(lambda s, xi: body(p, s, xi), in_axes=(axes, 0))(sites, x)
    return body(p, sites, x)


def _hand_sites(kind, comp):
    if comp == "scan":
        return {"layers": _stacked_layer_site() if kind == "layer" else _probe_stack(DEPTH)}
    stack = (BATCH,) if comp == "inner_vmap" else ()
    if kind == "layer":
        return {n: _layer_site(i) for i, n in enumerate(NAMES)}
    return {n: _probe_stack(*stack) for n in NAMES}


def _probe_stack(*stack):
    site = jdls.Site(jdls.Probe())
    return site.stacked(*stack) if stack else site


def _hand(cap, comp, dtype, leaves):
    """(the jdls function, the reference function, the arguments)."""
    has_aux = comp == "has_aux"
    x = _x()

    def run(p, sites, mark, x, *statics):
        return _finish(_hand_forward(p, sites, mark, x, comp), comp, statics)

    if cap == "layer_sites":
        sites = _hand_sites("layer", comp)

        def actual(p, x, *statics):
            fn = jdls.layer_scaled_value_and_grad(
                lambda q, s: run(q, s, jdls.apply_site, x, *statics), has_aux=has_aux
            )
            value, (grads, _) = fn(p, _varying(sites))
            return value, grads, None

        reference = _plain(lambda q, x, *st: run(q, sites, jdls.apply_site, x, *st), has_aux)
        return actual, reference, (_hand_params(dtype, leaves, comp), x)

    sites = _hand_sites("probe", comp)

    def shapes_of(p, x, *statics):
        found = {}

        def mark(h, key):
            found[key] = (h.shape, h.dtype)
            return h

        keys = jax.tree_util.tree_map_with_path(
            lambda path, s: jax.tree_util.keystr(path), sites, is_leaf=jdls.is_site
        )
        # the shape each site sees, stacked as the site is (a scan's layers, vmap's examples)
        jax.eval_shape(lambda q: _hand_forward(q, keys, mark, x, _flat(comp)), p)
        stack = {"scan": (DEPTH,), "inner_vmap": (BATCH,)}.get(comp, ())
        if comp == "inner_vmap":
            found = {k: (s[1:], d) for k, (s, d) in found.items()}
        return {k: ((*stack, *s), d) for k, (s, d) in found.items()}

    actual, reference = _probe_pair(run, sites, has_aux, shapes_of)
    return actual, reference, (_hand_params(dtype, leaves, comp), x)


def _flat(comp):
    """The composition whose forward records each site's key once: scan and vmap unrolled."""
    return {"scan": "unrolled_scan", "inner_vmap": "none"}.get(comp, "none")


def _plain(fun, has_aux):
    def fn(p, x, *statics):
        value, grads = jax.value_and_grad(fun, has_aux=has_aux, allow_int=_ALLOW_INT[0])(
            p, x, *statics
        )
        return value, grads, None

    return fn


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
        return _LinenLayer(self.dtype, name="cell")(h), None


class _LinenMLP(nn.Module):
    dtype: str
    comp: str

    @nn.compact
    def __call__(self, x):
        if self.comp == "scan":
            scanned = nn.scan(
                _LinenCell,
                variable_axes={"params": 0, "jdls": 0},
                split_rngs={"params": True},
                length=DEPTH,
            )
            return scanned(self.dtype, name="layers")(x.astype(self.dtype), None)[0]
        cls = {"framework_jit": nn.jit(_LinenLayer), "checkpoint": nn.remat(_LinenLayer)}.get(
            self.comp, _LinenLayer
        )
        h = x
        for i in range(DEPTH):
            h = cls(self.dtype, name=f"layer{i}")(h)
        return h


def _linen(cap, comp, dtype, leaves):
    base = _LinenMLP(dtype, comp)
    model = (
        jdls.linen.layer_scales(base, jdls.StaticScale(1.0))
        if cap == "linen_layer_scales"
        else jdls.linen.probes(base)
    )
    variables = model.init(jax.random.key(0), _x())
    params, sites = dict(variables["params"]), variables["jdls"]
    if cap == "linen_layer_scales":  # each layer its own scale (the stack: one per layer)

        def level(path, site):
            if path[0].key == "layers":
                scale = _stacked_layer_site().value["scale"]
            else:
                scale = jdls.StaticScale(LAYER_SCALES[int(path[0].key[-1])])
            return jdls.Site(site.kind, {**site.value, "scale": scale})

        sites = jax.tree_util.tree_map_with_path(level, sites, is_leaf=jdls.is_site)
    names = ["layers"] if comp == "scan" else [f"layer{i}" for i in range(DEPTH)]
    if leaves == "int":  # under nn.scan, one per iteration
        count = jnp.full((DEPTH,), 3, jnp.int32) if comp == "scan" else jnp.int32(3)
        params[names[0]] = {**params[names[0]], "count": count}
    if leaves == "none":
        params[names[-1]] = {**params[names[-1]], "nothing": None}
    has_aux = comp == "has_aux"

    def forward(variables, x):
        def apply(v, x):
            return model.apply(v, x)

        if comp == "inner_jit":
            return jax.jit(apply)(variables, x)
        if comp == "inner_vmap":  # the sites shared by the examples: counts sum, see below
            return jax.vmap(lambda xi: apply(variables, xi))(x)
        return apply(variables, x)

    def plain(v, x, *statics):
        return _finish(forward(v, x), comp, statics)

    if cap == "linen_layer_scales":

        def actual(p, x, *statics):
            state = jdls.linen.TrainState.create(
                apply_fn=None, params=p, tx=jdls.wrap(_sgd(), jdls.NoOpScale()), sites=sites
            )
            fn = state.value_and_grad(lambda v: plain(v, x, *statics), has_aux=has_aux)
            value, grads = fn({"params": p, "jdls": _varying(sites)})
            return value, grads["params"], None

        def reference(p, x, *statics):
            fn = jax.value_and_grad(
                lambda q: plain({"params": q, "jdls": sites}, x, *statics),
                has_aux=has_aux,
                allow_int=_ALLOW_INT[0],
            )
            value, grads = fn(p)
            return value, grads, None

        return actual, reference, (params, _x())

    def probed(p, s, x, *statics):
        return plain({"params": p, "jdls": s}, x, *statics)

    return _framework_probes(probed, sites, has_aux, comp), None, (params, _x())


def _sgd():
    import optax

    return optax.sgd(0.1)


# --------------------------------------------------------------------------------------------
# Flax NNX: three child layers in an nnx.List (or a stack made by nnx.vmap, run by nnx.scan).
# --------------------------------------------------------------------------------------------


class _NNXLayer(nnx.Module):
    def __init__(self, dtype, rngs):
        self.lin = nnx.Linear(WIDTH, WIDTH, dtype=dtype, param_dtype=dtype, rngs=rngs)

    def __call__(self, h):
        return jnp.tanh(self.lin(h))


class _NNXMLP(nnx.Module):
    def __init__(self, dtype, leaves, comp, cap):
        if comp == "scan":

            @nnx.split_rngs(splits=DEPTH)
            @nnx.vmap(in_axes=(0,), out_axes=0)
            def create(rngs):
                layer = _NNXLayer(dtype, rngs)
                if cap == "nnx_probes":
                    jdls.nnx.probes(layer)
                else:
                    jdls.nnx.layer_scale(layer, jdls.StaticScale(1.0), 0)
                return layer

            self.stack = create(nnx.Rngs(0))
        else:
            self.layers = nnx.List([_NNXLayer(dtype, nnx.Rngs(i)) for i in range(DEPTH)])
        if leaves == "int":
            self.count = nnx.Variable(jnp.int32(3))
        if leaves == "none":
            self.nothing = None

    def __call__(self, x, comp):
        if comp == "scan":

            @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
            def forward(h, layer):
                return layer(h)

            return forward(x.astype(self.stack.lin.kernel.dtype), self.stack)
        h = x
        for layer in self.layers:
            if comp == "framework_jit":
                h = nnx.jit(lambda m, h: m(h))(layer, h)
            elif comp == "checkpoint":
                h = nnx.remat(lambda m, h: m(h))(layer, h)
            elif comp == "inner_jit":
                graphdef, state = nnx.split(layer)
                h = jax.jit(lambda s, h, g=graphdef: nnx.merge(g, s)(h))(state, h)
            elif comp == "inner_vmap":
                h = jax.vmap(lambda hi, m=layer: m(hi))(h)
            else:
                h = layer(h)
        return h


def _nnx(cap, comp, dtype, leaves):
    """The functions take ``((params, sites, rest), x, *statics)``: the model is merged
    inside."""
    model = _NNXMLP(dtype, leaves, comp, cap)
    if cap == "nnx_probes" and comp != "scan":
        jdls.nnx.probes(model)
    elif cap == "nnx_layer_scales" and comp != "scan":
        for i, layer in enumerate(model.layers):
            jdls.nnx.layer_scale(layer, jdls.StaticScale(LAYER_SCALES[i]), i)
    if cap == "nnx_layer_scales" and comp == "scan":
        site = model.stack.jdls_layer_scale.get_value()
        model.stack.jdls_layer_scale.set_value(
            jdls.Site(site.kind, {**site.value, "scale": _stacked_layer_site().value["scale"]})
        )
    graphdef, params, sites, rest = nnx.split(model, nnx.Param, jdls.nnx.SiteVariable, ...)
    has_aux = comp == "has_aux"

    def loss_fn(m, x, *statics):
        return _finish(m(x, comp), comp, statics)

    def merged(pr):
        p, s, r = pr
        return nnx.merge(graphdef, p, _varying(s), r, copy=True)

    if cap == "nnx_layer_scales":

        def actual(pr, x, *statics):
            fn = jdls.nnx.layer_scaled_value_and_grad(
                lambda m: loss_fn(m, x, *statics), has_aux=has_aux
            )
            value, grads = fn(merged(pr))
            return value, nnx.to_pure_dict(nnx.state(grads, nnx.Not(jdls.nnx.SiteVariable))), None

        def reference(pr, x, *statics):
            p, s, r = pr
            fn = jax.value_and_grad(
                lambda q: loss_fn(nnx.merge(graphdef, q, s, r, copy=True), x, *statics),
                has_aux=has_aux,
                allow_int=_ALLOW_INT[0],
            )
            value, grads = fn(p)
            return value, nnx.to_pure_dict(grads), None

        return actual, reference, ((params, sites, rest), _x())

    def probed(pr, x, *statics):
        fn = jdls.nnx.value_and_grad(
            lambda m: loss_fn(m, x, *statics), jdls.StaticScale(PROBE_SCALE), has_aux=has_aux
        )
        value, grads = fn(merged(pr))
        measured = nnx.to_pure_dict(nnx.state(grads, jdls.nnx.SiteVariable))
        return (
            value,
            nnx.to_pure_dict(nnx.state(grads, nnx.Not(jdls.nnx.SiteVariable))),
            _probe_table(measured),
        )

    return probed, None, ((params, sites, rest), _x())


def _framework_probes(probed, sites, has_aux, comp):
    """A linen model's probes: ``(value, grads, table)`` of ``probed(p, sites, x, *st)``."""

    def actual(p, x, *statics):
        fn = jdls.StaticScale(PROBE_SCALE).value_and_grad(
            lambda q, s: probed(q, s, x, *statics), (0, 1), has_aux
        )
        value, (grads, measured) = fn(p, _varying(sites))  # per device under shard_map
        return value, grads, _probe_table(measured)

    return actual


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
    if cap in ("layer_sites", "probe_sites"):
        return _hand(cap, comp, dtype, leaves)
    if cap in ("linen_layer_scales", "linen_probes"):
        return _linen(cap, comp, dtype, leaves)
    return _nnx(cap, comp, dtype, leaves)


def _widen(g):
    g = jnp.asarray(g)
    return g.astype(jnp.promote_types(g.dtype, jnp.float32)) if _is_float(g) else g


def _is_float(g):
    return jnp.issubdtype(g.dtype, jnp.floating)


def _assert_close(actual, expected, what, dtype):
    a_leaves, a_def = jax.tree_util.tree_flatten(actual)
    e_leaves, e_def = jax.tree_util.tree_flatten(expected)
    assert a_def == e_def, (what, a_def, e_def)
    rtol = {"float32": 1e-5, "bfloat16": 2e-2, "float16": 2e-3}[dtype]
    for a, e in zip(a_leaves, e_leaves, strict=True):
        a, e = np.asarray(a), np.asarray(e)
        assert a.dtype == e.dtype and a.shape == e.shape, (what, a.dtype, e.dtype)
        scale = float(np.max(np.abs(e.astype(np.float64)))) if e.size else 0.0
        np.testing.assert_allclose(
            a.astype(np.float64), e.astype(np.float64), rtol=rtol, atol=rtol * scale, err_msg=what
        )


INNER = ("inner_jit", "framework_jit", "checkpoint")
FRAMEWORK_PROBES = ("linen_probes", "nnx_probes")


def _run_both(cap, comp, dtype, leaves):
    """The jdls cell's result and its reference's, each under the outer composition."""
    actual, reference, (params, x) = _build(cap, comp, dtype, leaves)
    if reference is None:  # a framework's probes: the same model without the inner transform
        ref_comp = "none" if comp in INNER else comp
        reference, _, _ = _build(cap, ref_comp, dtype, leaves)  # run on the cell's parameters
    else:  # JAX's own value_and_grad of the bare function, the sites held fixed
        reference = closing_over_sites(reference)
    try:
        expected = _outer(reference, comp, params, x)
    except TypeError as error:  # plain JAX refuses an integer parameter
        assert leaves == "int", error
        # jdls holds the integer leaf fixed (gradient None), as eqx.filter_value_and_grad
        # does: the float leaves equal JAX's with allow_int, the integer leaf's float0 is None.
        _ALLOW_INT[0] = True
        try:
            (value, grads, table), names = _outer(reference, comp, params, x)
        finally:
            _ALLOW_INT[0] = False
        expected = (value, _int_as_none(grads), table), names
    return _outer(actual, comp, params, x), expected


@pytest.mark.parametrize(("cap", "comp", "dtype", "leaves"), _cells(CELLS))
def test_cell_equals_its_reference(cap, comp, dtype, leaves):
    if cap in FRAMEWORK_PROBES and comp == "scan":
        _check_scanned_framework_probes(cap, dtype, leaves)
        return
    ((value, grads, table), names), ((e_value, e_grads, e_table), e_names) = _run_both(
        cap, comp, dtype, leaves
    )
    _assert_close(value, e_value, "value", dtype)
    # jdls returns unscaled gradients at least float32 wide (``LossScale.unscale``)
    _assert_close(grads, jax.tree_util.tree_map(_widen, e_grads), "grads", dtype)
    if table is None:
        return
    assert names == e_names
    if cap in FRAMEWORK_PROBES and comp == "inner_vmap":
        # one site shared by the examples: JAX adds up their measurements. The fractions are
        # the whole batch's; the largest magnitude is not a sum of maxima: NaN, uses = BATCH.
        # (a probe outside the vmap, the model's own, is used once and measures as usual)
        a, e = np.asarray(table), np.asarray(e_table)
        shared = a[..., 4] == BATCH
        assert np.all(shared | (a[..., 4] == 1)) and np.any(shared)
        assert np.all(np.isnan(a[..., 0][shared]))
        np.testing.assert_allclose(a[..., 1:4], e[..., 1:4], rtol=1e-5)
        np.testing.assert_allclose(a[~shared], e[~shared], rtol=2e-3)
        return
    if cap == "probe_sites" and comp in ("shard_map_vma", "shard_map_novma", "pmap"):
        e_table = _global_table(e_table)  # jax.grad's per device; jdls's: every device's
    _assert_close(table, e_table, "statistics", dtype)
    assert np.all(np.asarray(table)[..., 4] == 1.0)  # every site used once


def _global_table(table):
    """Per-device probe rows (amax, flushed, zeros, nonfinite, uses) combined as jdls returns
    them on every device: the largest amax, the fractions of the equal shards together, any
    non-finite, one use each."""
    t = np.asarray(table, np.float64)
    combined = np.stack(
        [
            t[..., 0].max(0),
            t[..., 1].mean(0),
            t[..., 2].mean(0),
            t[..., 3].max(0),
            t[..., 4].max(0),
        ],
        axis=-1,
    )
    return np.broadcast_to(combined, t.shape).astype(np.asarray(table).dtype)


def _check_scanned_framework_probes(cap, dtype, leaves):
    """nn.scan / nnx.scan of probed layers: one site per layer, each measured once, and the
    statistics those of the same layers unrolled (tests/test_linen_sites.py and
    tests/test_nnx_sites.py compare them with the unrolled model for float16 stacks)."""
    actual, _, (params, x) = _build(cap, "scan", dtype, leaves)
    (_, _, table), names = _outer(actual, "scan", params, x)
    stacked = [n for n in names if "[" in n]
    layers = [int(n.rsplit("[", 1)[1].rstrip("]")) for n in stacked]
    per_layer = len(stacked) // DEPTH
    # in forward order: layer 0's rows, then layer 1's, as many each
    assert len(stacked) >= DEPTH and layers == [i // per_layer for i in range(len(stacked))]
    table = np.asarray(table)
    assert np.all(table[:, 4] == 1.0) and np.all(table[:, 0] > 0)
