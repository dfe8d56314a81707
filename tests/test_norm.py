"""jdls._norm.global_norm and the skip branch (jdls._skip.cond_branches): the exactness that
the work to shorten compile times must keep.

* the finiteness decision is exact: a finite gradient whose sum of squares overflows is
  finite, an inf or NaN is not (float32, and float64 with x64);
* the per-leaf flags name exactly the non-finite leaves;
* on finite gradients the norm is ``optax.tree.norm``'s, bit for bit;
* under ``jit`` and not, and inside ``shard_map`` with ``axis_name``;
* a skipped step returns ``-0.0`` updates (``p + u == p`` bit for bit) and the old state.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _helpers import maybe_jit
from jax.sharding import PartitionSpec as P

import jdls
from jdls._norm import global_norm


def _leaves(dtype: str, big: float) -> list[jax.Array]:
    rng = np.random.default_rng(0)
    return [
        jnp.asarray(rng.standard_normal(37).astype(dtype)),
        jnp.asarray((rng.standard_normal((5, 7)) * big).astype(dtype)),
        jnp.asarray(np.array([1.5, -2.0], dtype)),
    ]


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_norm_is_optax_bit_for_bit(jit):
    leaves = _leaves("float32", 3.0)
    n = maybe_jit(lambda ls: global_norm(ls, per_leaf=True), jit)(leaves)
    theirs = maybe_jit(optax.tree.norm, jit)(leaves)
    assert bool(n.finite) and not bool(n.robust)
    assert np.asarray(n.norm).tobytes() == np.asarray(theirs).tobytes()
    assert not np.asarray(n.leaf_nonfinite).any()


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("dtype,big", [("float32", 1e25), ("float64", 1e200)])
def test_overflowing_finite_sum_is_finite(jit, dtype, big):
    with jax.enable_x64(dtype == "float64"):
        leaves = _leaves(dtype, big)
        assert not np.isfinite(float(optax.tree.norm(leaves)))  # the plain sum overflows
        n = maybe_jit(lambda ls: global_norm(ls, per_leaf=True), jit)(leaves)
        assert bool(n.finite) and bool(n.robust)
        assert not np.asarray(n.leaf_nonfinite).any()
        exact = np.sqrt(sum(np.sum(np.square(np.asarray(x, np.float64) / big)) for x in leaves))
        np.testing.assert_allclose(float(n.norm) / big, exact, rtol=1e-5)


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("bad", [np.inf, -np.inf, np.nan])
@pytest.mark.parametrize("dtype,big", [("float32", 1e25), ("float64", 1e200), ("float32", 1.0)])
def test_nonfinite_leaves_are_flagged(jit, bad, dtype, big):
    with jax.enable_x64(dtype == "float64"):
        leaves = _leaves(dtype, big)
        leaves[2] = leaves[2].at[1].set(bad)
        n = maybe_jit(lambda ls: global_norm(ls, per_leaf=True), jit)(leaves)
        assert not bool(n.finite)
        assert np.asarray(n.leaf_nonfinite).tolist() == [False, False, True]


def test_inside_shard_map_with_axis_name():
    mesh = jax.make_mesh((4,), ("d",))
    leaves = [x.reshape(-1)[:32] for x in _leaves("float32", 1e25)[:2]]
    leaves.append(jnp.arange(8.0, dtype=jnp.float32))

    def local(ls):
        n = global_norm(ls, axis_name="d", sharded=[True] * len(ls), per_leaf=True)
        return n.finite, n.norm, n.leaf_nonfinite

    run = jax.jit(
        jax.shard_map(local, mesh=mesh, in_specs=(P("d"),), out_specs=P(), check_vma=True)
    )
    put = lambda ls: jax.device_put(ls, jax.sharding.NamedSharding(mesh, P("d")))  # noqa: E731
    finite, norm, flags = run(put(leaves))
    assert bool(finite) and not np.asarray(flags).any()
    whole = global_norm(leaves)
    np.testing.assert_allclose(float(norm), float(whole.norm), rtol=1e-6)

    bad = [leaves[0], leaves[1], leaves[2].at[5].set(np.inf)]  # on one device only
    finite, _, flags = run(put(bad))
    assert not bool(finite)
    assert np.asarray(flags).tolist() == [False, False, True]


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("track", [False, True])
def test_skipped_step_is_bit_exact(jit, track):
    params = {"w": jnp.array([1.0, -0.0, 3.0]), "b": jnp.array([[0.5]], jnp.float16)}
    tx = jdls.wrap(optax.adam(1e-2), jdls.DynamicScale(), track_nonfinite=track)
    state = tx.init(params)
    grads = {"w": jnp.array([1.0, jnp.nan, 2.0]), "b": jnp.array([[1.0]], jnp.float16)}
    updates, new_state = maybe_jit(tx.update, jit)(grads, state, params)
    for u in jax.tree_util.tree_leaves(updates):
        assert np.signbit(np.asarray(u)).all() and not np.asarray(u).any()  # -0.0
    new_params = optax.apply_updates(params, updates)
    new, old_params = jax.tree_util.tree_leaves(new_params), jax.tree_util.tree_leaves(params)
    for a, b in zip(new, old_params, strict=True):
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes()
    old = jax.tree_util.tree_leaves(state.inner_state)
    for a, b in zip(jax.tree_util.tree_leaves(new_state.inner_state), old, strict=True):
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes()
    if track:
        assert bool(new_state.stats.nonfinite["w"]) and not bool(new_state.stats.nonfinite["b"])
