"""Probes and the telemetry of the backward pass: statistics of the cotangents, the first
non-finite layer in backward order, the measurement as the gradient of the probe's site."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _helpers import maybe_jit, with_and_without_jit

import jdls


def probed(loss, scale, argnums=0, has_aux=False):
    """``(value, grads, telemetry)`` of ``loss(*params, sites, *args)``: the sites follow
    the differentiated arguments."""
    nums = (argnums,) if isinstance(argnums, int) else tuple(argnums)
    sites_at = max(nums) + 1

    def fn(*args):
        value, grads = scale.value_and_grad(loss, (*nums, sites_at), has_aux)(*args)
        *grads, measured = grads
        return (
            value,
            grads[0] if isinstance(argnums, int) else tuple(grads),
            jdls.Telemetry.of(measured),
        )

    return fn


@with_and_without_jit
def test_statistics_of_the_scaled_cotangent(jit):
    def loss(w, sites, x):
        h = jdls.apply_site(w * x, sites["h"])  # float32 cotangent: d loss / d h = c
        return jnp.sum(h * jnp.array([1e-9, 2.0**-20, 0.0, 4.0]))

    fn = maybe_jit(probed(loss, jdls.StaticScale(2.0**4)), jit)
    value, grads, t = fn(jnp.ones(4), {"h": jdls.Site(jdls.Probe())}, jnp.ones(4))
    assert t.names == ("h",)
    assert float(t.amax[0]) == 64.0  # 4 * 16: the scaled cotangent
    # 1e-9 * 16 flushes to zero in float16; 2**-20 * 16 does not: 1 of 3 nonzero values.
    assert math.isclose(float(t.flushed[0]), 1 / 3, rel_tol=1e-6)
    assert float(t.zeros[0]) == 0.25
    assert float(t.nonfinite[0]) == 0.0
    assert float(t.uses[0]) == 1.0
    np.testing.assert_allclose(grads, [1e-9, 2.0**-20, 0.0, 4.0], rtol=1e-6)
    assert float(value) == pytest.approx(4.0 + 1e-9 + 2.0**-20)
    assert float(t.headroom_bits()[0]) == pytest.approx(math.log2(65504 / 64))


def test_the_measurement_counts_and_the_site_records_it():
    """The site's value after update_sites is the last measurement: largest magnitude,
    values, nonzero values, flushed values, non-finite values, uses."""

    def loss(w, sites):
        return jnp.sum(jdls.apply_site(w, sites["h"]) * jnp.array([1e-9, 3.0, 0.0]))

    sites = {"h": jdls.Site(jdls.Probe())}
    _, (_, measured) = jdls.StaticScale(1.0).value_and_grad(loss, (0, 1))(jnp.ones(3), sites)
    assert measured["h"].value.tolist() == [3.0, 3.0, 2.0, 1.0, 0.0, 1.0]
    recorded = jdls.update_sites(sites, measured, False)  # recorded on a skipped step too
    assert recorded["h"].value.tolist() == [3.0, 3.0, 2.0, 1.0, 0.0, 1.0]
    assert jdls.Telemetry.of(recorded).names == ("h",)


@with_and_without_jit
@pytest.mark.full(keep=1)
def test_a_nan_in_a_large_cotangent_is_flagged(jit):
    """XLA's max reduction drops a NaN in a large array on CPU: the nonfinite statistic must
    not be read off the largest magnitude."""

    def loss(w, sites):
        h = jdls.apply_site(w * 2.0, sites["h"])
        return jnp.sum(h * jnp.ones(20_000).at[3].set(jnp.nan))

    fn = maybe_jit(probed(loss, jdls.StaticScale(1.0)), jit)
    _, _, t = fn(jnp.ones(20_000), {"h": jdls.Site(jdls.Probe())})
    assert float(t.nonfinite[0]) == 1.0
    assert t.first_nonfinite() == "h"


@with_and_without_jit
def test_float16_statistics_in_one_integer_pass_count_what_the_float_tests_count(jit):
    """A float16 cotangent in float16 compute is measured from its bits: the same counts
    and largest magnitude as the float tests (a float32 copy), zeros of both signs,
    subnormals, infinities and NaNs included; a NaN makes the largest magnitude NaN."""
    rng = np.random.default_rng(0)
    values = rng.standard_normal(30_000).astype(np.float16) * np.float16(2.0**-12)
    values[:9] = [0.0, -0.0, 2.0**-24, -(2.0**-24), 2.0**-15, 65504.0, -65504.0, 1.0, -3.0]
    flagged = values.copy()
    flagged[[100, 20_000]] = [np.inf, -np.inf]
    flagged[[7, 29_999]] = np.nan

    def reference(g):
        g = np.asarray(g, np.float32)
        finite = np.isfinite(g)
        amax = np.nan if np.isnan(g).any() else np.max(np.abs(g))
        return [float(amax), g.size, int(np.count_nonzero(g)), 0, int((~finite).sum()), 1]

    stats = maybe_jit(lambda g: jdls._sites.probe.statistics([g], "float16"), jit)
    for case in (values, flagged):
        got = np.asarray(stats(jnp.asarray(case, jnp.float16))).tolist()
        want = reference(case)
        assert got[1:] == want[1:]
        assert got[0] == want[0] or (math.isnan(got[0]) and math.isnan(want[0]))
    assert math.isnan(np.asarray(stats(jnp.asarray(flagged, jnp.float16)))[0])


def test_probes_leave_the_gradients_bit_for_bit_unchanged():
    def loss(w, site=None):
        h = w.astype(jnp.float16) * 3
        h = h if site is None else jdls.apply_site(h, site)
        return jnp.sum(jnp.tanh(h).astype(jnp.float32))

    w = jnp.linspace(-2, 2, 7)
    scale = jdls.StaticScale(1024.0)
    _, plain = scale.value_and_grad(loss)(w)
    _, probed_grads, _ = probed(loss, scale)(w, jdls.Site(jdls.Probe()))
    assert np.asarray(plain).tobytes() == np.asarray(probed_grads).tobytes()


def test_first_nonfinite_layer_in_backward_order():
    def loss(w, sites):  # a list: forward order is tree order
        a = jdls.apply_site(w, sites[0])
        b = jdls.apply_site(a.astype(jnp.float16) * 1e3, sites[1])
        c = jdls.apply_site(b * 1e3, sites[2])
        return jnp.sum(c.astype(jnp.float32) * 100.0)

    sites = [jdls.Site(jdls.Probe()) for _ in range(3)]
    _, grads, t = probed(loss, jdls.StaticScale(2.0**8))(jnp.ones(2), sites)
    assert t.names == ("0", "1", "2")
    # the third gets 100 * 256 = 25600 (a float16 number); the second 25600 * 1e3: inf.
    assert t.first_nonfinite() == "1"
    assert not bool(jdls.all_finite(grads))
    assert t.as_dict()["2"]["nonfinite"] == 0.0


def test_a_pytree_through_one_site_is_measured_together():
    def loss(w, sites):
        a, b = jdls.apply_site((w, 2 * w), sites["pair"])
        return jnp.sum(a) + 3 * jnp.sum(b)

    _, _, t = probed(loss, jdls.StaticScale(1.0))(jnp.ones(2), {"pair": jdls.Site(jdls.Probe())})
    assert t.names == ("pair",) and float(t.amax[0]) == 3.0


def test_argnums_and_has_aux():
    def loss(a, b, sites):
        return jnp.sum(jdls.apply_site(a * b, sites["ab"])), "aux"

    fn = probed(loss, jdls.StaticScale(2.0), argnums=(0, 1), has_aux=True)
    (value, aux), (ga, gb), t = fn(
        jnp.full(2, 3.0), jnp.full(2, 5.0), {"ab": jdls.Site(jdls.Probe())}
    )
    assert aux == "aux" and float(value) == 30.0
    assert ga.tolist() == [5.0, 5.0] and gb.tolist() == [3.0, 3.0]
    assert float(t.amax[0]) == 2.0


@pytest.mark.full  # about 5 s (matplotlib)
def test_plot_headroom(tmp_path):
    pytest.importorskip("matplotlib")
    z = jnp.zeros(2)
    history = [jdls.Telemetry(("a", "b"), jnp.array([2.0**k, 1.0]), z, z, z) for k in range(4)]
    path = tmp_path / "headroom.png"
    fig = jdls.plot_headroom(history, path=str(path))
    assert path.stat().st_size > 0
    assert len(fig.axes[0].lines) == 3  # two probes and the zero line
    with pytest.raises(ValueError, match="at least one Telemetry"):
        jdls.plot_headroom([])


def test_a_bad_compute_dtype_says_what_to_pass():
    with pytest.raises(TypeError, match="finfo expects a floating-point dtype"):
        jdls.Probe(compute_dtype="int8")


def test_a_format_spelled_any_way_makes_one_probe():
    spellings = ("float16", jnp.float16, np.dtype("float16"))
    probes = [jdls.Probe(compute_dtype=s) for s in spellings]
    assert all(p == probes[0] and hash(p) == hash(probes[0]) for p in probes)
    assert jdls.Probe(compute_dtype="cbfloat16").compute_dtype is jdls.cbfloat16
    # one site kind, so one trace: the same static configuration whatever the spelling
    traces = []

    def loss(site, x):
        traces.append(None)
        return jnp.sum(jdls.apply_site(x, site) ** 2)

    grad = jax.jit(jax.grad(loss))
    for p in probes:
        grad(jdls.Site(p), jnp.ones(3, jnp.float16))
    assert len(traces) == 1


def _measured(amax: float, nonfinite: float = 0.0, stack: int = 0) -> jax.Array:
    row = jnp.array([amax, 4.0, 4.0, 0.0, nonfinite, 1.0], jnp.float32)
    return (
        jnp.broadcast_to(row, (stack, 6)) + jnp.arange(stack)[:, None] * jnp.eye(6)[0]
        if stack
        else row
    )


@with_and_without_jit
def test_rows_follow_the_probes_positions_not_the_tree_order(jit: bool) -> None:
    def probe(position, amax, nonfinite=0.0, stack=0, name=None):
        return jdls.Site(
            jdls.Probe(position=position, name=name), _measured(amax, nonfinite, stack)
        )

    tree = {
        "layers_10": {"probe": probe(2, 10.0, 1.0)},
        "layers_9": {"probe": probe(1, 9.0, 1.0)},
        "blocks": {"probe": probe(4, 100.0, stack=2), "inner": {"probe": probe(3, 50.0, stack=2)}},
        "probe": probe(5, 1.0, name="Net"),
        "hand": jdls.Site(jdls.Probe(), _measured(7.0)),  # no position: after the others
        "first": {"probe": probe(0, 3.0, 1.0)},
    }
    t = maybe_jit(jdls.Telemetry.of, jit)(tree)
    assert t.names == (
        "first", "layers_9", "layers_10",
        "blocks/inner[0]", "blocks[0]", "blocks/inner[1]", "blocks[1]",  # layer by layer
        "Net", "hand",
    )  # fmt: skip
    assert np.asarray(t.amax).tolist() == [3.0, 9.0, 10.0, 50.0, 100.0, 51.0, 101.0, 1.0, 7.0]
    assert t.first_nonfinite() == "layers_10"


def test_a_probe_at_the_root_of_the_tree_has_a_name() -> None:
    assert jdls.Telemetry.of(jdls.Site(jdls.Probe())).names == ("(root)",)
    assert jdls.Telemetry.of(jdls.Site(jdls.Probe(name="Net"))).names == ("Net",)
    with pytest.raises(TypeError, match="takes an int"):
        jdls.Probe(position=1.5)


def test_a_lost_measurement_is_shown_as_lost_not_as_a_crash() -> None:
    """A measurement multiplied by 0 or NaN (optax.clip_by_global_norm in front of the wrap on
    a step that overflowed) decodes to NaN: the table says it was lost and names the fix."""
    z = jnp.zeros(2)
    nan = jnp.array([jnp.nan, 0.0])
    t = jdls.Telemetry(
        ("lost", "kept"), jnp.array([jnp.nan, 3.0]), z, z, nan, jnp.array([jnp.nan, 1.0])
    )
    lost, kept = t.table().splitlines()[1:]
    assert "measurement lost" in lost and "jdls.clip keeps it" in lost
    assert lost.split()[5:7] == ["?", "?"]
    assert kept.split()[5:7] == ["no", "1"]


def test_optax_clip_in_front_loses_an_overflowing_steps_measurement_and_jdls_clip_keeps_it() -> (
    None
):
    params = {"w": jnp.ones(3), "probe": jdls.Site(jdls.Probe())}

    def loss(p, x):
        return jnp.sum(jdls.apply_site(p["w"] * x, p["probe"]).astype(jnp.float16) * 2.0**15)

    x = jnp.full(3, 4.0)  # the float16 cotangent 2**15 * ... overflows: a skipped step
    rows = {}
    for name, clip in (("optax", optax.clip_by_global_norm(1.0)), ("jdls", jdls.clip(1.0))):
        tx = optax.chain(clip, jdls.wrap(optax.sgd(0.1), jdls.StaticScale(2.0**4)))
        state = tx.init(params)
        _, grads = jdls.get_scale(state).value_and_grad(loss)(params, x)
        updates, state = tx.update(grads, state, params)
        assert not bool(jdls.stats(state).finite)
        new = jdls.apply_updates(params, updates, state)  # the probe records the step
        rows[name] = jdls.Telemetry.of({"probe": new["probe"]}).table().splitlines()[1]
    assert "measurement lost" in rows["optax"]
    assert "measurement lost" not in rows["jdls"] and " yes " in rows["jdls"]
