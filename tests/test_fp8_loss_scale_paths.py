"""FP8 dots told the scale of their cotangent on the per-layer and per-loss paths: the output
gradient's recorded amax is the unscaled one (that of the global path at scale 1), and the
scales do not change the gradients (jdls/_sites/backward_scale.py)."""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _helpers import assert_bitwise_equal, closing_over_sites, maybe_jit, with_and_without_jit

import jdls
from jdls import fp8

DN = (((1,), (0,)), ((), ()))
RECIPE = fp8.DelayedScaling(4)


def _grad_amaxes(grads):
    """The recorded output-gradient amax of every FP8 site of ``grads``, by path."""
    return {k: np.asarray(v["grad"]["amax"]) for k, v in fp8.telemetry(grads).items()}


def _assert_amaxes(got, want):
    assert sorted(got) == sorted(want)
    for k in want:
        assert np.all(np.isfinite(want[k])), f"{k}: no amax recorded ({want[k]})"
        np.testing.assert_allclose(got[k], want[k], rtol=1e-6, err_msg=k)


# --------------------------------------------------------------------------------------------
# Per-layer scales, Flax linen.
# --------------------------------------------------------------------------------------------


class _Linen(nn.Module):
    @nn.compact
    def __call__(self, x):
        dot = functools.partial(fp8.linen.DotGeneral, recipe=RECIPE)
        x = jnp.tanh(nn.Dense(16, dot_general_cls=dot, dtype=jnp.float16, name="a")(x))
        return nn.Dense(4, dot_general_cls=dot, dtype=jnp.float16, name="b")(x)


def _with_layer_scales(sites, exponents):
    def one(path, s):
        if isinstance(s, jdls.Site) and isinstance(s.kind, jdls.LayerScale):
            scale = jdls.StaticScale(2.0 ** exponents[path[0].key])
            return jdls.layer_site(scale, s.kind.position)
        return s

    return jax.tree_util.tree_map_with_path(one, sites, is_leaf=jdls.is_site)


@with_and_without_jit
@pytest.mark.parametrize(
    "exponents",
    [
        pytest.param((4, 14), id="apart", marks=pytest.mark.full),
        pytest.param((10, 20), id="past_the_cap", marks=pytest.mark.full),
    ],
)  # 13-23 s a case; the NNX and Equinox tests below record unscaled amaxes in the quick run,
# and test_layer_scales_change_neither_the_gradients_nor_the_fp8_states layer scales far apart
def test_linen_layers_record_the_unscaled_output_gradient_amax(exponents, jit):
    """A float16 model, layer scales far apart (the second case: the last layer's past
    float16's seed cap of 2**15, every layer then computing at its scale times 2**15 over it):
    each dot's recorded amax is the global path's at scale 1, not times its layer's scale."""
    model = jdls.linen.layer_scales(_Linen(), jdls.StaticScale(1.0))
    x = 0.25 * jax.random.normal(jax.random.key(1), (8, 8))
    variables = model.init(jax.random.key(0), x)
    sites = _with_layer_scales(variables["jdls"], dict(zip("ab", exponents, strict=True)))
    variables = {**variables, "jdls": sites}

    def loss(v, x):  # output gradients below 1: 2**15 times them stays in float16
        return (jnp.sum(model.apply(v, x).astype(jnp.float32) ** 2) / 16).astype(jnp.float16)

    fn = maybe_jit(jdls.linen.value_and_grad(loss, jdls.NoOpScale()), jit)
    _, grads = fn(variables, x)
    _, reference = jdls.StaticScale(1.0).value_and_grad(loss)(variables, x)
    got, want = _grad_amaxes(grads["jdls"]), _grad_amaxes(reference["jdls"])
    _assert_amaxes(got, want)
    assert all(0 < v < 1 for v in want.values())  # unscaled: not 2**4 or 2**14 times larger


class _Block(nn.Module):
    @nn.compact
    def __call__(self, h, _):
        dot = functools.partial(fp8.linen.DotGeneral, recipe=RECIPE)
        return jnp.tanh(nn.Dense(8, dot_general_cls=dot)(h)), None


class _Stacked(nn.Module):
    """An embedding, three blocks under nn.scan, a head: every dot FP8."""

    @nn.compact
    def __call__(self, x):
        dot = functools.partial(fp8.linen.DotGeneral, recipe=RECIPE)
        h = nn.Dense(8, dot_general_cls=dot, name="embed")(x)
        stack = nn.scan(
            _Block, variable_axes={"params": 0, "jdls": 0}, split_rngs={"params": True}, length=3
        )
        h = stack(name="layers")(h, None)[0]
        return nn.Dense(2, dot_general_cls=dot, name="head")(h)


@pytest.mark.full  # 22 s; the quick run tells a scanned stack in test_a_scanned_stack_tells_each_layer_its_own_scale
@with_and_without_jit
def test_linen_embedding_scanned_blocks_and_head_each_told_their_own_scale(jit):
    """Under jdls.linen.layer_scales the embedding and the head are layers of their own (every
    top-level submodule gets a site), and nn.scan slices the told factor with the stacked FP8
    sites: every dot records the global path's amax at scale 1."""
    model = jdls.linen.layer_scales(_Stacked(), jdls.StaticScale(1.0))
    x = jax.random.normal(jax.random.key(1), (4, 8))
    variables = model.init(jax.random.key(0), x)
    levels = {"embed": 2.0**3, "layers": jnp.asarray([2.0**5, 2.0**12, 2.0**1]), "head": 2.0**9}

    def one(path, s):
        if isinstance(s, jdls.Site) and isinstance(s.kind, jdls.LayerScale):
            level = jnp.broadcast_to(jnp.asarray(levels[path[0].key], jnp.float32), (3,))
            scale = jax.tree.map(lambda a: level if a.ndim else level[0], s.value["scale"])
            return jdls.Site(s.kind, {**s.value, "scale": scale})
        return s

    scaled = {
        **variables,
        "jdls": jax.tree_util.tree_map_with_path(one, variables["jdls"], is_leaf=jdls.is_site),
    }

    def loss(v, x):
        return jnp.sum(model.apply(v, x) ** 2)

    fn = maybe_jit(jdls.linen.value_and_grad(loss, jdls.NoOpScale()), jit)
    _, grads = fn(scaled, x)
    _, reference = jdls.StaticScale(1.0).value_and_grad(loss)(variables, x)
    got, want = _grad_amaxes(grads["jdls"]), _grad_amaxes(reference["jdls"])
    _assert_amaxes(got, want)
    assert np.shape(got["layers/Dense_0/DotGeneral_0/fp8"]) == (3,)


# --------------------------------------------------------------------------------------------
# Per-layer scales by hand: a chain and a scanned stack.
# --------------------------------------------------------------------------------------------


def _chain(exponents):
    keys = jax.random.split(jax.random.key(3), 3)
    params = {
        name: {"w": jax.random.normal(k, (8, 8)) / 3, "fp8": fp8.init(RECIPE)}
        for name, k in zip("abc", keys, strict=True)
    }
    sites = {
        name: jdls.layer_site(jdls.StaticScale(2.0**e), i)
        for i, (name, e) in enumerate(zip("abc", exponents, strict=True))
    }
    return params, sites


def _chain_loss(params, sites, x):
    for name in "abc":
        layer = params[name]
        x = jnp.tanh(fp8.dot_general(x, layer["w"], DN, site=layer["fp8"]))
        x = jdls.apply_site(x, sites[name])
    return jnp.sum(x**2)


def _fp8_only(tree):
    return jax.tree_util.tree_map(
        lambda s: s if jdls.is_site(s) and isinstance(s.kind, fp8.Fp8) else None,
        tree,
        is_leaf=jdls.is_site,
    )


@pytest.mark.full  # about 4 s
@with_and_without_jit
def test_layer_scales_change_neither_the_gradients_nor_the_fp8_states(jit):
    """Per-layer scales that move every step (powers of two, far apart) give the gradients and
    the FP8 states (histories, scales) of layer scales of 1, bit for bit, from the first step
    on whose scales were 1 (a fresh site quantizes as its cotangent comes)."""
    fn = maybe_jit(jdls.layer_scaled_value_and_grad(_chain_loss), jit)
    update = maybe_jit(jdls.update_sites, jit)
    runs = {"ones": [(0, 0, 0)] * 4, "moving": [(0, 0, 0), (4, 14, 9), (20, 2, 11), (6, 6, 16)]}
    out = {}
    for name, schedule in runs.items():
        params, _ = _chain((0, 0, 0))
        grads_seen, states_seen = [], []
        for step, exponents in enumerate(schedule):
            _, sites = _chain(exponents)
            x = jax.random.normal(jax.random.key(10 + step), (4, 8)) * (1 + step)
            _, (grads, _) = fn(params, sites, x)
            g, measured = jdls.split_sites(grads)
            params = update(params, measured, jnp.bool_(True))
            grads_seen.append(g)
            states_seen.append(_fp8_only(params))
        out[name] = (grads_seen, states_seen)
    assert_bitwise_equal(out["moving"], out["ones"])
    # and the histories hold unscaled amaxes: the global path's at scale 1
    params, sites = _chain((4, 14, 9))
    x = jax.random.normal(jax.random.key(5), (4, 8))
    _, (grads, _) = fn(params, sites, x)
    reference = closing_over_sites(jax.jit(jdls.StaticScale(1.0).value_and_grad(_chain_loss)))(
        params, _chain((0, 0, 0))[1], x
    )
    _assert_amaxes(_grad_amaxes(grads), _grad_amaxes(reference[1]))


@with_and_without_jit
def test_a_scanned_stack_tells_each_layer_its_own_scale(jit):
    """``lax.scan`` over stacked layers: each layer's dot is told its own scale (the factor
    rides stacked with the FP8 site and is sliced with it)."""
    n = 3
    w = jax.random.normal(jax.random.key(0), (n, 8, 8)) / 3
    params = {"stack": {"w": w, "fp8": fp8.init(RECIPE).stacked(n)}}
    site = jdls.layer_site(jdls.StaticScale(1.0), 0).stacked(n)
    levels = jnp.asarray([2.0**3, 2.0**15, 2.0**8], jnp.float32)
    value = {**site.value, "scale": jax.tree.map(lambda _: levels, site.value["scale"])}
    sites = {"stack": jdls.Site(site.kind, value)}
    plain = {"stack": jdls.Site(site.kind, site.value)}

    def loss(params, sites, x):
        def body(h, layer):
            p, s = layer
            h = jnp.tanh(fp8.dot_general(h, p["w"], DN, site=p["fp8"]))
            return jdls.apply_site(h, s), None

        h, _ = jax.lax.scan(body, x, (params["stack"], sites["stack"]))
        return jnp.sum(h**2)

    x = jax.random.normal(jax.random.key(1), (4, 8))
    _, (grads, _) = maybe_jit(jdls.layer_scaled_value_and_grad(loss), jit)(params, sites, x)
    global_path = closing_over_sites(jax.jit(jdls.StaticScale(1.0).value_and_grad(loss)))
    _, reference = global_path(params, plain, x)
    got, want = _grad_amaxes(grads), _grad_amaxes(reference)
    _assert_amaxes(got, want)
    assert np.shape(got["stack/fp8"]) == (n,)


def test_an_fp8_site_in_no_layer_is_refused():
    """By hand, an FP8 site must sit in its layer's parameters: one elsewhere (beside the
    per-layer sites, under a key of no layer) has no known scale, and is refused as a
    parameter in no layer is."""
    params, sites = _chain((0, 0, 0))
    head = fp8.init(RECIPE)
    sites = {**sites, "head_fp8": head}

    def loss(params, sites, x):
        y = _chain_loss(params, sites, x)
        return jnp.sum(fp8.dot_general(x, params["a"]["w"], DN, site=sites["head_fp8"])) + y

    with pytest.raises(ValueError, match="FP8 sites are in no layer.*head_fp8"):
        jdls.layer_scaled_value_and_grad(loss)(params, sites, jnp.ones((4, 8)))


# --------------------------------------------------------------------------------------------
# Per-layer scales, NNX and Equinox.
# --------------------------------------------------------------------------------------------


@pytest.mark.full  # about 3 s; the linen layers' case stays in the quick run
def test_nnx_layers_record_the_unscaled_output_gradient_amax():
    from flax import nnx

    def linear(i):
        return nnx.Linear(8, 8, dot_general=fp8.nnx.DotGeneral(RECIPE), rngs=nnx.Rngs(i))

    model = nnx.Sequential(linear(0), nnx.tanh, linear(1))
    model = jdls.nnx.layer_scales(model, jdls.StaticScale(1.0))
    x = jax.random.normal(jax.random.key(2), (4, 8))

    def loss(m, x):
        return jnp.sum(m(x) ** 2)

    _, reference = nnx.jit(jdls.nnx.value_and_grad(loss, jdls.StaticScale(1.0)))(model, x)
    for layer, e in zip((model.layers[0], model.layers[2]), (4, 14), strict=True):
        position = layer.jdls_layer_scale.get_value().kind.position
        layer.jdls_layer_scale.set_value(jdls.layer_site(jdls.StaticScale(2.0**e), position))
    _, grads = nnx.jit(jdls.nnx.layer_scaled_value_and_grad(loss))(model, x)
    _assert_amaxes(_grad_amaxes(grads), _grad_amaxes(reference))


@pytest.mark.full  # about 3 s; the linen layers' case stays in the quick run
def test_equinox_layers_record_the_unscaled_output_gradient_amax():
    eqx = pytest.importorskip("equinox")
    import jdls.equinox
    import jdls.fp8.equinox

    class Net(eqx.Module):
        a: eqx.Module
        b: eqx.Module

        def __call__(self, x):
            return self.b(jnp.tanh(self.a(x)))

    ka, kb = jax.random.split(jax.random.key(0))
    net = Net(
        fp8.equinox.Linear(8, 8, recipe=RECIPE, key=ka),
        fp8.equinox.Linear(8, 4, recipe=RECIPE, key=kb),
    )
    model = jdls.equinox.layer_scales(net, jdls.StaticScale(1.0))
    model = jdls.equinox.set_layer_scales(model, [2.0**4, 2.0**14])
    x = jax.random.normal(jax.random.key(2), (4, 8))

    def loss(m, x):
        return jnp.sum(m(x) ** 2)

    _, grads = eqx.filter_jit(jdls.equinox.layer_scaled_value_and_grad(loss))(model, x)
    plain = jdls.equinox.set_layer_scales(model, [1.0, 1.0])
    reference_fn = eqx.filter_jit(jdls.equinox.value_and_grad(loss, jdls.StaticScale(1.0)))
    _, reference = reference_fn(plain, x)
    _assert_amaxes(_grad_amaxes(grads), _grad_amaxes(reference))


@with_and_without_jit
def test_an_equinox_loss_combining_a_closed_over_static_half_names_the_fix(jit):
    """A loss that rebuilds the model from a closed-over static half (``eqx.combine(params,
    static)`` inside it) meets the FP8 sites the per-layer differentiation told their scale
    beside untold copies: JAX's pytree error names the fix (combine before the call), and
    the fix gives the gradients of the model. (Telling the sites without changing their type
    would change every site's pytree structure, which orbax checkpoints written before
    record.)"""
    eqx = pytest.importorskip("equinox")
    import jdls.equinox
    import jdls.fp8.equinox

    class Net(eqx.Module):
        a: eqx.Module
        b: eqx.Module

        def __call__(self, x):
            return self.b(jax.nn.relu(self.a(x)))

    ka, kb = jax.random.split(jax.random.key(0))
    net = Net(
        fp8.equinox.Linear(8, 8, recipe=RECIPE, key=ka),
        fp8.equinox.Linear(8, 4, recipe=RECIPE, key=kb),
    )
    model = jdls.equinox.set_layer_scales(
        jdls.equinox.layer_scales(net, jdls.StaticScale(1.0)), [2.0**4, 2.0**14]
    )
    params, static = eqx.partition(model, eqx.is_array)
    x = jax.random.normal(jax.random.key(2), (16, 8))

    def loss(m, x):
        return jnp.mean((m(x) - 1.0) ** 2)  # the batch at once: one use of each site

    wrap = eqx.filter_jit if jit else (lambda f: f)
    partitioned = jdls.equinox.layer_scaled_value_and_grad(
        lambda p, x: loss(eqx.combine(p, static), x)
    )
    with pytest.raises(ValueError, match=r"combine before the call"):
        wrap(partitioned)(params, x)
    fixed = wrap(jdls.equinox.layer_scaled_value_and_grad(loss))
    _, grads = fixed(eqx.combine(params, static), x)
    _, want = fixed(model, x)
    assert_bitwise_equal(eqx.filter(grads, eqx.is_array), eqx.filter(want, eqx.is_array))
    assert all(v.max() > 0 for v in _grad_amaxes(grads).values())


# --------------------------------------------------------------------------------------------
# Per-loss scales.
# --------------------------------------------------------------------------------------------


def _two_heads():
    k = jax.random.split(jax.random.key(0), 3)
    return {
        "trunk": {"w": jax.random.normal(k[0], (8, 16)), "fp8": fp8.init(RECIPE)},
        "a": {"w": jax.random.normal(k[1], (16, 4)), "fp8": fp8.init(RECIPE)},
        "b": {"w": jax.random.normal(k[2], (16, 2)), "fp8": fp8.init(RECIPE)},
    }


def _losses(p, x):
    h = jnp.tanh(fp8.dot_general(x, p["trunk"]["w"], DN, site=p["trunk"]["fp8"]))
    ya = fp8.dot_general(h, p["a"]["w"], DN, site=p["a"]["fp8"])
    yb = fp8.dot_general(h, p["b"]["w"], DN, site=p["b"]["fp8"])
    return {"a": jnp.sum(ya**2), "b": 1e-3 * jnp.sum(yb**3)}


@with_and_without_jit
@pytest.mark.parametrize(
    "weights",
    [
        pytest.param(None, id="unweighted"),
        pytest.param({"a": 2.0, "b": 0.5}, id="weighted"),
    ],
)
@pytest.mark.full  # about 4 s; the scanned stack's per-layer scales stay in the quick run
def test_one_backward_pass_tells_each_dot_its_regions_scale(weights, jit):
    """``backward="one"``: a head's dot runs at its loss's scale, the trunk's at the smaller
    of the two; each records the amax of the gradient of the weighted sum of the losses, as
    the global path at scale 1 does on that sum; the gradients are those of before (the told
    scale moves measurements only)."""
    p, x = _two_heads(), jax.random.normal(jax.random.key(3), (8, 8))
    scales = {"a": jdls.StaticScale(2.0**4), "b": jdls.StaticScale(2.0**12)}
    fn = maybe_jit(jdls.multi_loss_value_and_grad(_losses, scales, weights), jit)
    _, grads, _ = fn(p, x)
    w = weights or {"a": 1.0, "b": 1.0}

    def total(p, x):
        return sum(w[k] * v for k, v in _losses(p, x).items())

    _, reference = jax.jit(jdls.StaticScale(1.0).value_and_grad(total))(p, x)
    _assert_amaxes(_grad_amaxes(grads), _grad_amaxes(reference))


def test_per_loss_backward_passes_refuse_an_fp8_site_naming_one():
    """``backward="per_loss"``: one forward pass serves every loss's backward pass, each at
    its own scale, so no pass can tell a dot its scale: an FP8 site among the differentiated
    arguments is refused at trace time, naming ``backward="one"``, which measures it
    unscaled (above)."""
    p, x = _two_heads(), jax.random.normal(jax.random.key(3), (8, 8))
    scales = {"a": jdls.StaticScale(2.0**4), "b": jdls.StaticScale(2.0**12)}
    fn = jdls.multi_loss_value_and_grad(_losses, scales, backward="per_loss")
    for run in (fn, jax.jit(fn)):
        with pytest.raises(ValueError, match=r"3 such sites.*Use backward='one'"):
            run(p, x)


# --------------------------------------------------------------------------------------------
# An inner jax.jit: the loss scale is read while tracing, so it is part of the cache key.
# --------------------------------------------------------------------------------------------


def _traced_once(form):
    """A forward pass ``(site, x) -> output`` whose trace JAX keeps and reuses across
    calls: a ``jax.jit``, a ``lax.scan`` or a ``jax.checkpoint`` of a module-level
    function."""
    w = jnp.array([[2.0], [1.0]])

    def dot(site, x):
        return fp8.dot_general(x, w, DN, site=site)

    if form == "jax.jit":
        return jax.jit(dot)
    if form == "jax.checkpoint":
        return jax.checkpoint(dot)
    body = lambda _, site: (None, dot(site, _X))  # noqa: E731
    return lambda sites, x: jnp.sum(jax.lax.scan(body, None, sites)[1])


_X = jnp.array([[1.0, -3.5]])


@pytest.mark.parametrize(
    "form",
    [
        "jax.jit",
        pytest.param("lax.scan", marks=pytest.mark.full),  # 6 s: the same key, another cache
        pytest.param("jax.checkpoint", marks=pytest.mark.full),  # 9 s
    ],
)
def test_an_eager_step_retraces_a_kept_trace_at_each_new_loss_scale(form):
    """A step that is not jitted, around a forward pass traced once and reused by JAX: the
    differentiation's cache key is the concrete loss scale, so the kept trace is traced again
    at each new scale and each step measures the unscaled output gradient (1.0 at every
    scale; a trace that read the first step's scale as a constant recorded 2.0 at the
    second). A float16 loss past its seed cap (2**16, 2**17) too, after a float32 one (the
    cap keys the backward pass's trace)."""
    forward = _traced_once(form)
    site = fp8.init(RECIPE)
    if form == "lax.scan":
        site = jax.tree.map(lambda a: jnp.stack([a, a]), site)
    for dtype, values in ((jnp.float32, (1024.0, 2048.0, 4.0)), (jnp.float16, (2.0**16, 2.0**17))):

        def loss(site, dtype=dtype):
            return jnp.sum(forward(site, _X)).astype(dtype)

        for value in values:
            grads = jdls.DynamicScale(value).value_and_grad(loss)(site)[1]
            np.testing.assert_array_equal(grads.value.meter.grad.amax, 1.0, err_msg=str(value))


@pytest.mark.full  # 3 s; the quick run retraces a jax.jit forward pass above
def test_an_eager_nnx_step_retraces_an_nnx_jit_forward_at_each_new_loss_scale():
    """The NNX form, with a forward pass that updates batch statistics: they still reach the
    model, and its sites stay plain sites."""
    from flax import nnx

    class Model(nnx.Module):
        def __init__(self):
            dot = fp8.nnx.DotGeneral(RECIPE)
            self.dense = nnx.Linear(2, 2, dot_general=dot, rngs=nnx.Rngs(0))
            self.norm = nnx.BatchNorm(2, rngs=nnx.Rngs(0))

        def __call__(self, x):
            return self.norm(self.dense(x))

    model = Model()
    forward = nnx.jit(lambda m, x: m(x))
    x = jnp.array([[1.0, -3.5], [2.0, 0.5]])
    forward(model, x)  # an evaluation first: traced with no loss scale
    weights = jnp.array([[1.0, 0.0], [0.0, 0.0]])  # a sum over the batch would be 0

    def amax(fun, value):
        loss = lambda m: jnp.sum(fun(m, x) * weights)  # noqa: E731
        _, grads = jdls.nnx.value_and_grad(loss, jdls.DynamicScale(value))(model)
        return float(grads["dense"]["dot_general"]["site"].get_value().value.meter.grad.amax)

    want = amax(forward, 1.0)  # the trace kept from here read 1.0 as a constant before
    assert want > 0
    assert [amax(forward, value) for value in (1024.0, 2048.0)] == [want, want]
    assert type(model.dense.dot_general.site.get_value()) is jdls.Site
    assert float(jnp.abs(model.norm.mean[...]).sum()) > 0  # the forward pass's update kept


def test_an_inner_jit_traced_outside_the_differentiation_is_traced_again():
    """A jitted forward pass traced first outside jdls (an evaluation), then called inside the
    jitted steps' ``value_and_grad`` at the optimizer state's scale: each step's dot reads its
    own loss scale (the recorded output-gradient amax is the unscaled 1.0, where the reused
    trace read none: 1024 and 2048), and a second jitted step calling the same forward pass
    traces it again (its reused trace held a tracer of the first step's: JAX's
    UnexpectedTracerError)."""
    w = jnp.array([[2.0], [1.0]])
    x = jnp.array([[1.0, -3.5]])

    @jax.jit
    def forward(site, x):
        return fp8.dot_general(x, w, DN, site=site)

    tx = jdls.wrap(optax.sgd(0.1), jdls.DynamicScale())
    site = fp8.init(RECIPE)
    forward(site, x)  # an evaluation: traced with no loss scale

    def grads_of(weight):
        def grads(site, opt_state):
            def loss(s):
                return weight * jnp.sum(forward(s, x))

            return jdls.get_scale(opt_state).value_and_grad(loss)(site)[1]

        return jax.jit(grads)

    step, other_step = grads_of(1.0), grads_of(2.0)
    for value in (1024.0, 2048.0):
        opt_state = jdls.set_scale(tx.init({}), jdls.DynamicScale(value))
        assert float(step(site, opt_state).value.meter.grad.amax) == 1.0
        assert float(other_step(site, opt_state).value.meter.grad.amax) == 2.0
