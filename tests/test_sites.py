"""State at a site as data, in hand-written JAX: probes and per-layer scales inside
lax.scan over stacked layers, jax.checkpoint (with a policy), an inner jax.jit (traced
before, too), lax.cond, lax.fori_loop, an inner vmap, an outer vmap and shard_map.

Each composition is compared with its reference: the same layers unrolled in Python (no
transformation), whose telemetry tests/test_probe.py checks against statistics computed from
the cotangents, and whose per-layer gradients equal float32 ``jax.grad``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _helpers import (
    assert_bitwise_equal,
    closing_over_sites,
    maybe_jit,
    pcast_varying,
    with_and_without_jit,
)

import jdls

DEPTH, WIDTH, BATCH = 4, 8, 6
F16 = jnp.float16


def _params() -> dict:
    k = jax.random.split(jax.random.key(0), 2)
    return {
        "w": jax.random.normal(k[0], (DEPTH, WIDTH, WIDTH)) / WIDTH**0.5,
        "b": jnp.linspace(-1.0, 1.0, DEPTH * WIDTH).reshape(DEPTH, WIDTH),
    }


def _x() -> jax.Array:
    return jax.random.normal(jax.random.key(1), (BATCH, WIDTH))


def layer(w: jax.Array, b: jax.Array, h: jax.Array, dtype) -> jax.Array:
    return jnp.tanh(h @ w.astype(dtype) + b.astype(dtype))


def stack(sites: list[jdls.Site]) -> jdls.Site:
    """Sites of one kind stacked along a new leading axis (one per layer)."""
    return jax.tree_util.tree_map(lambda *v: jnp.stack(v), *sites)


def index(tree, i):
    return jax.tree_util.tree_map(lambda v: v[i], tree)


# --------------------------------------------------------------------------------------------
# The compositions: each a loss(params, sites, x) with one site per layer.
# --------------------------------------------------------------------------------------------


def unrolled(params, sites, x, dtype=F16):
    h = x.astype(dtype)
    for i in range(DEPTH):
        h = jdls.apply_site(layer(params["w"][i], params["b"][i], h, dtype), index(sites, i))
    return jnp.mean(h.astype(jnp.float32) ** 2)


def _body(dtype):
    def body(h, p):
        w, b, site = p
        return jdls.apply_site(layer(w, b, h, dtype), site), None

    return body


def scanned(params, sites, x, dtype=F16):
    h, _ = jax.lax.scan(_body(dtype), x.astype(dtype), (params["w"], params["b"], sites))
    return jnp.mean(h.astype(jnp.float32) ** 2)


def scanned_remat(params, sites, x, dtype=F16):
    body = jax.checkpoint(_body(dtype), policy=jax.checkpoint_policies.nothing_saveable)
    h, _ = jax.lax.scan(body, x.astype(dtype), (params["w"], params["b"], sites))
    return jnp.mean(h.astype(jnp.float32) ** 2)


def scanned_remat_dots(params, sites, x, dtype=F16):
    policy = jax.checkpoint_policies.checkpoint_dots
    body = jax.checkpoint(_body(dtype), policy=policy)
    h, _ = jax.lax.scan(body, x.astype(dtype), (params["w"], params["b"], sites))
    return jnp.mean(h.astype(jnp.float32) ** 2)


@jax.jit
def _jitted_layer(w, b, h, site):
    return jdls.apply_site(layer(w, b, h, h.dtype), site)


def inner_jit(params, sites, x, dtype=F16):
    h = x.astype(dtype)
    for i in range(DEPTH):
        h = _jitted_layer(params["w"][i], params["b"][i], h, index(sites, i))
    return jnp.mean(h.astype(jnp.float32) ** 2)


def inner_cond(params, sites, x, dtype=F16):
    """Layer 1 inside lax.cond (a layer either way, its site in both branches)."""
    h = x.astype(dtype)
    for i in range(DEPTH):
        w, b, site = params["w"][i], params["b"][i], index(sites, i)
        if i == 1:
            h = jax.lax.cond(
                jnp.sum(x) > -1e9,
                lambda h, w=w, b=b, site=site: jdls.apply_site(layer(w, b, h, dtype), site),
                lambda h, w=w, b=b, site=site: jdls.apply_site(layer(w, -b, h, dtype), site),
                h,
            )
        else:
            h = jdls.apply_site(layer(w, b, h, dtype), site)
    return jnp.mean(h.astype(jnp.float32) ** 2)


def fori(params, sites, x, dtype=F16):
    def body(i, h):
        w, b, site = index((params["w"], params["b"], sites), i)
        return jdls.apply_site(layer(w, b, h, dtype), site)

    h = jax.lax.fori_loop(0, DEPTH, body, x.astype(dtype))
    return jnp.mean(h.astype(jnp.float32) ** 2)


COMPOSITIONS: dict[str, Callable] = {
    "lax.scan": scanned,
    "lax.scan + jax.checkpoint": scanned_remat,
    "lax.scan + jax.checkpoint(checkpoint_dots)": scanned_remat_dots,
    "inner jax.jit": inner_jit,
    "lax.cond": inner_cond,
    "lax.fori_loop": fori,
}


def probes() -> jdls.Site:
    return jdls.Site(jdls.Probe()).stacked(DEPTH)


def telemetry_of(loss, scale, jit, *args):
    fn = scale.value_and_grad(loss, argnums=(0, 1))
    value, (grads, measured) = maybe_jit(fn, jit)(*args)
    return value, grads, jdls.Telemetry.of({"layers": measured})


# --------------------------------------------------------------------------------------------
# Probes.
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(COMPOSITIONS))
@with_and_without_jit
# the capability matrix's quick cells hold each of these compositions
@pytest.mark.full
def test_probes_measure_each_layer_under(name: str, jit: bool) -> None:
    params, x, scale = _params(), _x(), jdls.StaticScale(2.0**6)
    value, grads, t = telemetry_of(COMPOSITIONS[name], scale, jit, params, probes(), x)
    ref_value, ref_grads, ref = telemetry_of(unrolled, scale, jit, params, probes(), x)
    assert t.names == tuple(f"layers[{i}]" for i in range(DEPTH))  # a row per layer
    assert np.asarray(t.uses).tolist() == [1.0] * DEPTH
    for a, b in zip((t.amax, t.flushed, t.zeros, t.nonfinite), ref[1:5], strict=True):
        np.testing.assert_allclose(a, b, rtol=2e-3)  # XLA fuses the programs differently
    np.testing.assert_allclose(value, ref_value, rtol=1e-6)
    leaves = jax.tree_util.tree_leaves
    for a, b in zip(leaves(grads), leaves(ref_grads), strict=True):
        np.testing.assert_allclose(a, b, rtol=2e-3, atol=1e-6)
    assert float(jnp.min(t.amax)) > 0


@pytest.mark.parametrize("name", ["lax.scan", "lax.scan + jax.checkpoint"])
@pytest.mark.full  # about 6 s; each probe test of a composition compares with the unrolled one
def test_probes_in_float32_equal_the_unrolled_ones(name: str) -> None:
    """Eager float32: the scanned, rematerialised stack measures what the unrolled layers
    measure (to float32 rounding: a scan body is compiled, the unrolled layers are not)."""
    params, x, scale = _params(), _x(), jdls.StaticScale(2.0**6)

    def f32(loss):
        return lambda p, s, x: loss(p, s, x, jnp.float32)

    _, grads, t = telemetry_of(f32(COMPOSITIONS[name]), scale, False, params, probes(), x)
    _, ref_grads, ref = telemetry_of(f32(unrolled), scale, False, params, probes(), x)
    assert t.names == ref.names
    for a, b in zip(jax.tree_util.tree_leaves(t), jax.tree_util.tree_leaves(ref), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6)
    np.testing.assert_allclose(grads["w"], ref_grads["w"], rtol=1e-5, atol=1e-7)


@pytest.mark.full  # about 10 s; the nn.jit and nnx.jit traced-before tests stay in the quick run
def test_a_jitted_function_traced_before_keeps_its_sites() -> None:
    """The site is an argument of the jitted function: a trace cached by an earlier call
    (an evaluation step, outside any differentiation) has it, and measures."""
    params, x, scale = _params(), _x(), jdls.StaticScale(2.0**6)
    evaluate = jax.jit(unrolled)
    evaluate(params, probes(), x)  # traced and cached, no differentiation
    _jitted_layer(params["w"][0], params["b"][0], x.astype(F16), index(probes(), 0))
    _, _, t = telemetry_of(evaluate, scale, False, params, probes(), x)
    _, _, again = telemetry_of(inner_jit, scale, False, params, probes(), x)
    _, _, ref = telemetry_of(unrolled, scale, False, params, probes(), x)
    assert np.asarray(t.uses).tolist() == [1.0] * DEPTH
    np.testing.assert_allclose(t.amax, ref.amax, rtol=2e-3)
    np.testing.assert_allclose(again.amax, ref.amax, rtol=2e-3)


def test_a_site_in_the_branch_not_taken_reports_no_measurement() -> None:
    def loss(params, sites, x):
        h = layer(params["w"][0], params["b"][0], x, jnp.float32)
        h = jax.lax.cond(
            jnp.sum(x) > 1e9,  # never
            lambda h: jdls.apply_site(h * 2.0, index(sites, 0)),
            lambda h: jdls.apply_site(h, index(sites, 1)),
            h,
        )
        return jnp.sum(h)

    _, _, t = telemetry_of(loss, jdls.StaticScale(1.0), True, _params(), probes(), _x())
    assert np.asarray(t.uses)[:2].tolist() == [0.0, 1.0]
    assert np.isnan(float(t.amax[0])) and float(t.amax[1]) == 1.0


@pytest.mark.full  # about 5 s; the shared-site inner vmap test and an inner_vmap cell of the matrix stay
def test_an_inner_vmap_with_a_site_per_example_measures_each_example() -> None:
    """Statistics per example: the site batched along the vmap axis."""
    params, x, scale = _params(), _x(), jdls.StaticScale(2.0**6)

    def loss(params, sites, x):
        def one(h, site):
            return jdls.apply_site(layer(params["w"][0], params["b"][0], h, F16), site)

        return jnp.mean(jax.vmap(one)(x.astype(F16), sites).astype(jnp.float32) ** 2)

    sites = jdls.Site(jdls.Probe()).stacked(BATCH)
    _, _, t = telemetry_of(loss, scale, True, params, sites, x)
    assert len(t.names) == BATCH and np.asarray(t.uses).tolist() == [1.0] * BATCH

    def per_example(params, site, x1):  # the reference: one example at a time
        h = jdls.apply_site(layer(params["w"][0], params["b"][0], x1[None].astype(F16), F16), site)
        return jnp.sum(h.astype(jnp.float32) ** 2) / (BATCH * WIDTH)

    for i in range(BATCH):
        _, _, r = telemetry_of(per_example, scale, True, params, jdls.Site(jdls.Probe()), x[i])
        np.testing.assert_allclose(t.amax[i], r.amax[0], rtol=1e-3)
        np.testing.assert_allclose(t.zeros[i], r.zeros[0])


def test_a_site_shared_by_an_inner_vmap_sums_counts_and_reports_no_max() -> None:
    """One unbatched site for the whole vmap: JAX adds up the measurements of its uses. The
    counts and fractions are those of the whole batch; the largest magnitude is not a sum of
    maxima: NaN, and ``uses`` says why."""
    params, x, scale = _params(), _x(), jdls.StaticScale(2.0**6)

    def loss(params, site, x, batched):
        def one(h):
            return jdls.apply_site(layer(params["w"][0], params["b"][0], h, F16), site)

        h = jax.vmap(one)(x.astype(F16)) if batched else one(x.astype(F16))
        return jnp.mean(h.astype(jnp.float32) ** 2)

    site = jdls.Site(jdls.Probe())
    _, _, shared = telemetry_of(lambda p, s, x: loss(p, s, x, True), scale, True, params, site, x)
    _, _, whole = telemetry_of(lambda p, s, x: loss(p, s, x, False), scale, True, params, site, x)
    assert float(shared.uses[0]) == BATCH and float(whole.uses[0]) == 1.0
    assert np.isnan(float(shared.amax[0]))
    np.testing.assert_allclose(shared.zeros, whole.zeros)
    np.testing.assert_allclose(shared.flushed, whole.flushed)


@pytest.mark.full  # about 6 s; the capability matrix keeps an outer_vmap cell in the quick run
def test_an_outer_vmap_keeps_one_measurement_per_example() -> None:
    params, x, scale = _params(), _x(), jdls.StaticScale(2.0**6)

    def step(x1):
        return telemetry_of(unrolled, scale, False, params, probes(), x1[None])[2]

    t = jax.jit(jax.vmap(step))(x)
    assert t.amax.shape == (BATCH, DEPTH)
    for i in range(BATCH):
        np.testing.assert_allclose(t.amax[i], step(x[i]).amax, rtol=1e-3)


@pytest.mark.parametrize("check_vma", [True, False])
@pytest.mark.full  # about 6 s; tests/test_measured.py keeps a data-parallel measurement quick
def test_probes_under_shard_map_measure_every_device(check_vma: bool) -> None:
    from jax.sharding import Mesh
    from jax.sharding import PartitionSpec as P

    mesh = Mesh(np.array(jax.devices()[:2]), ("data",))
    params, scale = _params(), jdls.StaticScale(2.0**6)
    x = jax.random.normal(jax.random.key(3), (2, BATCH, WIDTH))

    def step(x):
        # sites that vary over the devices, or replicated ones: jdls returns the global
        # value either way (a replicated site's measurements combined by the kind's rule,
        # not summed as JAX's transpose would sum the cotangent of a replicated input)
        sites = pcast_varying(probes(), "data") if check_vma else probes()
        t = telemetry_of(scanned_remat, scale, False, params, sites, x[0])[2]
        shared = telemetry_of(scanned_remat, scale, False, params, probes(), x[0])[2]
        return t.amax[None], shared.uses[None]

    amax, uses = jax.jit(
        jax.shard_map(
            step,
            mesh=mesh,
            in_specs=P("data"),
            out_specs=(P("data"), P("data")),
            check_vma=check_vma,
        )
    )(x)
    refs = [telemetry_of(unrolled, scale, False, params, probes(), x[d])[2].amax for d in range(2)]
    for d in range(2):  # every device holds the largest of the devices' amax
        np.testing.assert_allclose(amax[d], np.maximum(*refs), rtol=2e-3)
    # one use per layer, as on one device: the devices' uses are not added up
    assert np.asarray(uses).tolist() == [[1.0] * DEPTH] * 2


# --------------------------------------------------------------------------------------------
# Per-layer scales.
# --------------------------------------------------------------------------------------------

EXPONENTS = (30, -6, 12, 3)


def layer_sites() -> jdls.Site:
    """One stacked per-layer site: the stack is one position, its layers in index order."""
    return stack([jdls.layer_site(jdls.StaticScale(2.0**e), 0) for e in EXPONENTS])


@pytest.mark.parametrize("name", list(COMPOSITIONS))
@with_and_without_jit
# the quick run keeps one composition; the capability matrix's quick cells hold each of them
@pytest.mark.full(keep=1)
def test_per_layer_scales_are_exact_under(name: str, jit: bool) -> None:
    """float32, scales 2**36 apart: the gradients are float32 jax.grad's, each layer of the
    stack unscaled by its own scale."""
    params, x = _params(), _x()

    def f32(loss):
        return lambda p, s, x: loss(p, s, x, jnp.float32)

    fn = maybe_jit(jdls.layer_scaled_value_and_grad(f32(COMPOSITIONS[name])), jit)
    value, (grads, measured) = fn(params, layer_sites(), x)
    ref_value, ref = closing_over_sites(
        maybe_jit(jax.value_and_grad(f32(COMPOSITIONS[name])), jit)
    )(params, layer_sites(), x)
    np.testing.assert_allclose(value, ref_value, rtol=1e-6)
    for key in ("w", "b"):
        np.testing.assert_allclose(grads[key], ref[key], rtol=1e-5, atol=1e-7)
    assert measured.value["finite"].tolist() == [1.0] * DEPTH
    amax = jnp.max(jnp.abs(grads["w"]).reshape(DEPTH, -1), axis=1)
    amax = jnp.maximum(amax, jnp.max(jnp.abs(grads["b"]), axis=1))
    assert measured.value["amax"].tolist() == amax.tolist()


def test_per_layer_scales_stacked_equal_the_unrolled_sites() -> None:
    """Eager float32: a scanned, rematerialised stack with a stacked site gives the unrolled
    layers' gradients (to float32 rounding: the scan body is compiled), and four sites at four
    positions in a list give them bit for bit."""
    params, x = _params(), _x()
    f32 = lambda loss: lambda p, s, x: loss(p, s, x, jnp.float32)  # noqa: E731
    fn = jdls.layer_scaled_value_and_grad
    _, (stacked, _) = fn(f32(scanned_remat))(params, layer_sites(), x)
    _, (unrolled_grads, _) = fn(f32(unrolled))(params, layer_sites(), x)
    for key in ("w", "b"):
        np.testing.assert_allclose(stacked[key], unrolled_grads[key], rtol=1e-5, atol=1e-7)

    def separate(params, sites, x):  # four sites, positions 0..3, in a list
        h = x
        for i in range(DEPTH):
            h = jdls.apply_site(layer(params["w"][i], params["b"][i], h, jnp.float32), sites[i])
        return jnp.mean(h**2)

    sites = [jdls.layer_site(jdls.StaticScale(2.0**e), i) for i, e in enumerate(EXPONENTS)]
    split = {"w": list(params["w"]), "b": list(params["b"])}
    per_layer = [{"w": split["w"][i], "b": split["b"][i]} for i in range(DEPTH)]
    _, (grads, _) = fn(lambda p, s, x: separate(_stacked(p), s, x))(per_layer, sites, x)
    assert_bitwise_equal(_stacked(grads), unrolled_grads)


def _stacked(per_layer: list[dict]) -> dict:
    return {k: jnp.stack([p[k] for p in per_layer]) for k in per_layer[0]}


@pytest.mark.full  # about 6 s; the stacked-equals-unrolled test stays in the quick run
def test_per_layer_scales_recover_float16_gradients_in_a_scanned_remat_stack() -> None:
    """float16, a stack whose layers' gradients span more than float16 holds: one global
    scale flushes the first layers' gradients, per-layer scales inside the scanned,
    rematerialised stack keep them."""
    depth, width = 12, 32
    k = jax.random.split(jax.random.key(0), 2)
    params = {
        "w": jax.random.normal(k[0], (depth, width, width)) / width**0.5,
        "b": jnp.full((depth, width), 3.0),  # saturated tanh: the signal shrinks with depth
    }
    x = jax.random.normal(k[1], (64, width))

    def loss(params, sites, x, dtype=F16):
        body = jax.checkpoint(_body(dtype))
        h, _ = jax.lax.scan(body, x.astype(dtype), (params["w"], params["b"], sites))
        return 1e-3 * jnp.mean(h.astype(jnp.float32) ** 2)

    def site_for(scales):
        return stack([jdls.layer_site(jdls.StaticScale(s), 0) for s in scales])

    expected = closing_over_sites(jax.grad(loss))(params, site_for([1.0] * depth), x, jnp.float32)
    amax = np.max(np.abs(np.asarray(expected["w"])).reshape(depth, -1), axis=1)
    best = [2.0 ** np.floor(np.log2(65504 * 2.0**-6 / a)) for a in amax]
    fn = jax.jit(jdls.layer_scaled_value_and_grad(loss))
    _, (one, _) = fn(params, site_for([min(best)] * depth), x)
    _, (own, measured) = fn(params, site_for(best), x)
    ref = np.asarray(expected["w"]) != 0

    def flushed(g):
        return float(np.mean((np.asarray(g["w"]) == 0)[ref]))

    print(
        f"span 2**{np.log2(amax.max() / amax.min()):.1f}: flushed {flushed(one):.3f} global, "
        f"{flushed(own):.3f} per layer"
    )
    assert flushed(one) >= 0.2 and flushed(own) * 8 <= flushed(one)
    assert measured.value["finite"].tolist() == [1.0] * depth


def test_a_stacked_site_is_updated_layer_by_layer() -> None:
    sites = stack([jdls.layer_site(jdls.AdaptiveScale(2.0**10), 0) for _ in range(3)])
    measured = jdls.Site(
        sites.kind,
        {
            "scale": None,
            "ratio": jnp.zeros(3),
            "amax": jnp.array([2.0**-20, 2.0**-2, 1.0]),
            "finite": jnp.array([1.0, 1.0, 1.0]),
        },
    )
    new = jax.jit(jdls.update_sites)(sites, measured, True)
    assert new.value["scale"].loss_scale.tolist() == [2.0**29, 2.0**11, 2.0**9]
    skipped = jdls.update_sites(sites, measured, False)
    assert skipped.value["scale"].loss_scale.tolist() == [2.0**10] * 3


def test_probes_and_per_layer_sites_together() -> None:
    """Both kinds in one tree: the per-layer differentiation measures the probes too, at each
    layer's own scale."""
    params, x = _params(), _x()

    def loss(params, sites, x):
        h = x
        for i in range(DEPTH):
            h = layer(params["stack"]["w"][i], params["stack"]["b"][i], h, jnp.float32)
            h = jdls.apply_site(h, index(sites["probe"], i))
            h = jdls.apply_site(h, index(sites["stack"], i))
        return jnp.mean(h**2)

    # the per-layer site of params["stack"] is sites["stack"]; the probes are anywhere
    sites = {"probe": probes(), "stack": layer_sites()}
    fn = jdls.layer_scaled_value_and_grad(loss)
    _, (_, measured) = fn({"stack": params}, sites, x)
    t = jdls.Telemetry.of(measured)
    assert len(t.names) == DEPTH and np.asarray(t.uses).tolist() == [1.0] * DEPTH
    f32 = lambda p, s, x: unrolled(p, s, x, jnp.float32)  # noqa: E731
    _, _, plain = telemetry_of(f32, jdls.StaticScale(1.0), False, params, probes(), x)
    # each probe sits before its layer's site in the forward pass, after it in the backward
    # pass: it sees the cotangent at its layer's own scale
    levels = np.array([2.0**e for e in EXPONENTS])
    np.testing.assert_allclose(t.amax, np.asarray(plain.amax) * levels, rtol=2e-3)


@dataclasses.dataclass(frozen=True)
class _Count(jdls.SiteKind):
    """A kind that counts its uses, to test the mechanism alone."""

    def init(self):
        return jnp.zeros((), jnp.float32)

    def backward(self, residuals, g):
        return g, jnp.ones((), jnp.float32)

    def update(self, value, measurement, finite):
        return jnp.where(finite, value + measurement, value)


def test_update_sites_is_skip_aware_and_leaves_other_leaves_alone() -> None:
    tree = {"w": jnp.ones(2), "count": jdls.Site(_Count()).stacked(2)}
    measured = jax.grad(
        lambda t: (
            jnp.sum(jdls.apply_site(t["w"], index(t["count"], 0)))
            + jnp.sum(jdls.apply_site(t["w"], index(t["count"], 1)))
        )
    )(tree)
    assert measured["count"].value.tolist() == [1.0, 1.0]
    taken = jdls.update_sites(tree, measured, True)
    assert taken["count"].value.tolist() == [1.0, 1.0] and taken["w"] is tree["w"]
    assert jdls.update_sites(tree, measured, False)["count"].value.tolist() == [0.0, 0.0]
    rest, sites = jdls.split_sites(measured)
    assert rest["count"] is None and sites["w"] is None
    assert_bitwise_equal(jdls.merge_sites(rest, sites), measured)


def test_apply_site_says_what_to_pass() -> None:
    with pytest.raises(TypeError, match="jdls.Site"):
        jdls.apply_site(jnp.ones(2), jdls.Probe())  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="SiteKind"):
        jdls.Site("probe")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="stack of 4"):
        jdls.apply_site(jnp.ones(2), probes())


def test_wrap_keeps_sites_from_the_optimizer_and_updates_them() -> None:
    """Sites among the parameters: never clipped, decayed or given to the inner optimizer;
    jdls.wrap keeps each one updated by its kind (skip-aware) in its state, the update at a
    site is None, jdls.apply_updates puts the new state in place, and optax.apply_updates
    refuses (it has no new state to put there)."""
    import optax

    params = {"w": jnp.ones(3), "probe": jdls.Site(jdls.Probe()), "count": jdls.Site(_Count())}

    def loss(p):
        h = jdls.apply_site(jdls.apply_site(p["w"] * 2.0, p["probe"]), p["count"])
        return jnp.sum(h)

    tx = optax.chain(
        jdls.clip(1e-3), jdls.wrap(optax.adamw(1e-2, weight_decay=0.5), jdls.NoOpScale())
    )
    state = tx.init(params)
    _, grads = jdls.StaticScale(4.0).value_and_grad(loss)(params)
    assert grads["probe"].value.tolist() == [4.0, 3.0, 3.0, 0.0, 0.0, 1.0]  # not unscaled
    updates, state = jax.jit(tx.update)(grads, state, params)
    new = jdls.apply_updates(params, updates, state)
    assert new["probe"].value.tolist() == grads["probe"].value.tolist()
    assert float(new["count"].value) == 1.0
    plain = optax.chain(optax.clip_by_global_norm(1e-3), optax.adamw(1e-2, weight_decay=0.5))
    w = {"w": params["w"]}
    expected, _ = plain.update({"w": grads["w"]}, plain.init(w), w)
    np.testing.assert_array_equal(new["w"], params["w"] + expected["w"])
    with pytest.raises(ValueError, match="structure|Custom node type mismatch"):  # by JAX release
        optax.apply_updates(params, updates)
    bad = {**grads, "w": jnp.full(3, jnp.nan)}
    updates, state = tx.update(bad, state, new)
    skipped = jdls.apply_updates(new, updates, state)
    assert float(skipped["count"].value) == 1.0  # _Count does not count a skipped step
    np.testing.assert_array_equal(skipped["w"], new["w"])


@pytest.mark.full  # about 8 s; probes under shard_map and tests/test_measured.py's overflow on one device stay
def test_update_sites_combines_the_devices_measurements_as_each_kind_says() -> None:
    """shard_map, a different batch shard per device, sites varying per device: with
    axis_name, probes sum their counts and take the largest magnitude, per-layer scales the
    largest magnitude and the least finiteness; every device then holds the same sites."""
    from jax.sharding import Mesh
    from jax.sharding import PartitionSpec as P

    mesh = Mesh(np.array(jax.devices()[:2]), ("data",))
    params, scale = _params(), jdls.StaticScale(2.0**6)
    x = jax.random.normal(jax.random.key(3), (2, BATCH, WIDTH))

    def step(x):
        sites = pcast_varying(probes(), "data")
        _, (_, measured) = scale.value_and_grad(scanned, (0, 1))(params, sites, x[0])
        new = jdls.update_sites(sites, measured, True, axis_name="data")
        return jax.tree_util.tree_map(lambda v: v[None], new)

    new = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=P("data"), out_specs=P("data")))(x)
    assert np.all(np.asarray(new.value)[0] == np.asarray(new.value)[1])
    per_device = [telemetry_of(unrolled, scale, False, params, probes(), x[d])[2] for d in (0, 1)]
    whole = jdls.Telemetry.of(jax.tree_util.tree_map(lambda v: v[0], new))
    np.testing.assert_allclose(
        whole.amax, np.maximum(per_device[0].amax, per_device[1].amax), rtol=2e-3
    )
    assert np.asarray(whole.uses).tolist() == [1.0] * DEPTH
    np.testing.assert_allclose(
        whole.zeros, (np.asarray(per_device[0].zeros) + np.asarray(per_device[1].zeros)) / 2
    )


@pytest.mark.parametrize(
    "site",
    [jdls.Site(jdls.Probe()), jdls.layer_site(jdls.AdaptiveScale(), 0)],
    ids=["probe", "layer_scale"],
)
def test_a_sites_pytree_structure_is_the_one_checkpoints_were_written_with(site):
    """A site flattens to its value alone (no empty node beside it, not even a None): orbax
    restores a checkpoint by comparing its recorded key paths, empty nodes included, with the
    target's, so any change refuses every checkpoint written before."""
    paths = jax.tree_util.tree_flatten_with_path(site.value, is_leaf=lambda x: x is None)[0]
    got = jax.tree_util.tree_flatten_with_path(site, is_leaf=lambda x: x is None)[0]
    assert [p for p, _ in got] == [(jax.tree_util.GetAttrKey("value"), *p) for p, _ in paths]
    assert (
        jax.tree_util.tree_structure(site).num_nodes
        == 1 + jax.tree_util.tree_structure(site.value).num_nodes
    )


@with_and_without_jit
def test_a_site_a_filter_halved_is_refused_naming_the_fix(jit):
    """``eqx.is_inexact_array`` moves a scale's integer counters to the static half, and a
    filter that freezes a layer moves its whole site: ``tx.init`` and ``jdls.update_sites``
    refuse such a half, naming the fix, instead of failing inside a kind's update."""
    site = jdls.layer_site(jdls.DynamicScale(), 0)
    whole = {"w": jnp.ones(3), "site": site}
    halves = {
        "counters": jax.tree_util.tree_map(lambda x: x if x.dtype.kind == "f" else None, site),
        "frozen": jax.tree_util.tree_map(lambda x: None, site),
    }
    tx = jdls.wrap(optax.sgd(0.1))
    maybe = jax.jit if jit else (lambda f: f)
    maybe(tx.init)(whole)  # whole: accepted
    for half in halves.values():
        with pytest.raises(ValueError, match=r"tx.init: the LayerScale site at site holds None"):
            maybe(tx.init)({"w": jnp.ones(3), "site": half})
        with pytest.raises(ValueError, match=r"freeze a layer's parameters but not its sites"):
            maybe(jdls.update_sites)({"site": half}, {"site": site})


@pytest.mark.parametrize("retries", [0, 2])
def test_a_step_donating_parameters_and_state_with_sites_runs(retries):
    """The wrap's state holds the sites in buffers of its own, from ``tx.init`` and after an
    eager ``jdls.apply_updates``: a step that donates both (``donate_argnums=(0, 1)``, as the
    guides do) is never given one buffer twice."""

    def loss_fn(p, x):
        h = jdls.apply_site(p["w"].astype(jnp.float16) * x.astype(jnp.float16), p["probe"])
        return jnp.sum(h.astype(jnp.float32))

    tx = jdls.wrap(optax.adam(1e-3), jdls.DynamicScale(2.0**15))
    params = {"w": jnp.ones(3), "probe": jdls.Site(jdls.Probe())}
    opt_state = tx.init(params)

    def shared(p, s):
        ours = {id(x) for x in jax.tree_util.tree_leaves(p)}
        return [x for x in jax.tree_util.tree_leaves(s) if id(x) in ours]

    assert not shared(params, opt_state)
    step = jax.jit(jdls.retrying(loss_fn, tx, retries=retries), donate_argnums=(0, 1))
    x = jnp.array([3.0, 1.0, 0.5])  # overflows at 2**15, not at 2**14
    params, opt_state, _ = step(params, opt_state, x)
    assert int(jdls.stats(opt_state).retries) == min(retries, 1)
    # an eager step, then the donating one again
    loss, grads = jdls.get_scale(opt_state).value_and_grad(loss_fn)(params, x / 4)
    updates, opt_state = tx.update(grads, opt_state, params, value=loss)
    params = jdls.apply_updates(params, updates, opt_state)
    assert not shared(params, opt_state)
    params, opt_state, _ = step(params, opt_state, x / 4)
    assert bool(jdls.stats(opt_state).finite)
