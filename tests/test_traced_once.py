"""jdls's own arithmetic in a step (a rule's update, a site kind's update, the coding of a
measurement, the first pass of the norm) is one program per configuration and shapes: traced
once and kept, inlined inside a user's jit, one compiled program when called eagerly."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import optax
from _helpers import assert_bitwise_equal, inner_jits, programs_lowered

import jdls
from jdls.rules import GrowBackoff

_RULE_TRACES: list[int] = []
_KIND_TRACES: list[int] = []


class _CountingRule(GrowBackoff):
    """GrowBackoff that counts how often its update is traced (or run op by op)."""

    def adjust(self, loss_scale, state, finite):
        _RULE_TRACES.append(1)
        return super().adjust(loss_scale, state, finite)


@dataclasses.dataclass(frozen=True)
class _ListedRule(GrowBackoff):
    """A user's rule that does not hash (a list among its fields)."""

    tags: list = dataclasses.field(default_factory=lambda: ["mine"])

    def adjust(self, loss_scale, state, finite):
        _RULE_TRACES.append(1)
        return super().adjust(loss_scale, state, finite)


@dataclasses.dataclass(frozen=True)
class _Largest(jdls.SiteKind):
    """Records the largest cotangent seen; counts how often its update is traced."""

    def init(self):
        return jnp.zeros((), jnp.float32)

    def backward(self, residuals, g):
        return g, jnp.max(jnp.abs(g[0])).astype(jnp.float32)

    def update(self, value, measurement, finite):
        _KIND_TRACES.append(1)
        return jnp.maximum(value, measurement)


def test_a_rule_is_traced_once_for_every_program_and_the_eager_call():
    scale = jdls.DynamicScale(8.0, _CountingRule(growth_interval=3))
    _RULE_TRACES.clear()
    once = jax.jit(lambda s: s.adjust(True))(scale)
    twice = jax.jit(lambda s: s.adjust(False).adjust(True))(scale)  # another program
    eager = scale.adjust(True)
    assert len(_RULE_TRACES) == 1
    assert_bitwise_equal(once, eager)
    assert float(twice.loss_scale) == 4.0 and int(twice.state.counter) == 1
    assert programs_lowered(lambda: scale.adjust(False)) == 0  # compiled already


def test_a_rule_that_does_not_hash_runs_as_written():
    rule = _ListedRule(growth_interval=2)
    scale = jdls.DynamicScale(8.0, rule)
    _RULE_TRACES.clear()
    grown = scale.adjust(True).adjust(True)
    assert float(grown.loss_scale) == 16.0 and len(_RULE_TRACES) == 2
    want = jdls.DynamicScale(8.0, GrowBackoff(growth_interval=2)).adjust(True).adjust(True)
    assert_bitwise_equal((grown.loss_scale, grown.state), (want.loss_scale, want.state))


def test_a_kind_is_updated_by_one_trace_for_all_its_sites():
    sites = {name: jdls.Site(_Largest()) for name in ("a", "b", "c")}

    def loss(x, s):
        return sum(jnp.sum(jdls.apply_site(x, s[n]) * k) for k, n in ((1, "a"), (2, "b"), (3, "c")))

    _, measured = jax.grad(loss, (0, 1))(jnp.ones(19), sites)
    _KIND_TRACES.clear()
    eager = jdls.update_sites(sites, measured)
    jitted = jax.jit(jdls.update_sites)(sites, measured)
    assert len(_KIND_TRACES) == 1  # three sites, eager and jitted
    assert [float(eager[n].value) for n in "abc"] == [1.0, 2.0, 3.0]
    assert_bitwise_equal(eager, jitted)


def test_inside_a_users_jit_the_compiled_pieces_are_inlined():
    sites = {"h": jdls.Site(jdls.Probe())}
    params = {"w": jnp.ones((5, 3)), **sites}

    def loss(p, x):
        return jnp.sum(jdls.apply_site(x @ p["w"], p["h"]) ** 2)

    tx = jdls.wrap(optax.adam(1e-3))
    state = tx.init(params)

    def step(p, s, x):
        _, grads = jdls.get_scale(s).value_and_grad(loss)(p, x)
        updates, s = tx.update(grads, s, p)
        return jdls.apply_updates(p, updates, s), s

    ours = {"_compiled_rule", "_kind_update", "_first_pass", "_coded", "_decode"}
    assert not inner_jits(step, params, state, jnp.ones((2, 5))) & ours
    # eagerly (shapes of this test alone): 65 programs on jax 0.10.2, 128 op by op
    assert programs_lowered(lambda: step(params, state, jnp.ones((4, 7, 5)))) <= 80
