"""jdls._numerics.norm.global_norm and the skip branch (jdls._transforms.skip.cond_branches): the exactness that
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
from _helpers import enable_x64, jitted_in_quick_run, maybe_jit, with_and_without_jit
from jax.sharding import PartitionSpec as P

import jdls
from jdls._numerics.norm import amax, global_norm


def _leaves(dtype: str, big: float) -> list[jax.Array]:
    rng = np.random.default_rng(0)
    return [
        jnp.asarray(rng.standard_normal(37).astype(dtype)),
        jnp.asarray((rng.standard_normal((5, 7)) * big).astype(dtype)),
        jnp.asarray(np.array([1.5, -2.0], dtype)),
    ]


@with_and_without_jit
def test_norm_is_optax_bit_for_bit(jit):
    leaves = _leaves("float32", 3.0)
    n = maybe_jit(lambda ls: global_norm(ls, per_leaf=True), jit)(leaves)
    theirs = maybe_jit(optax.tree.norm, jit)(leaves)
    assert bool(n.finite) and not bool(n.robust)
    assert np.asarray(n.norm).tobytes() == np.asarray(theirs).tobytes()
    assert not np.asarray(n.leaf_nonfinite).any()


@jitted_in_quick_run  # eager about 18 s, jitted 5
@pytest.mark.full  # about 5 s jitted
def test_many_leaves_keep_optax_order(jit):
    """Past a few leaves the per-leaf sums and maxima are combined over one stacked vector
    (a loop for the sum): the norm is still optax's bit for bit, the largest magnitude
    exact, the per-leaf flags right, on the ordinary and the exact pass."""
    rng = np.random.default_rng(4)
    leaves = [
        jnp.asarray(rng.standard_normal(int(rng.integers(8, 300))).astype("float32") * 3.0**k)
        for k in range(-12, 12)  # 24 leaves: past the 16 combined as a chain
    ]
    measure = maybe_jit(lambda ls: global_norm(ls, per_leaf=True, largest=True), jit)
    n = measure(leaves)
    theirs = maybe_jit(optax.tree.norm, jit)(leaves)
    assert bool(n.finite) and not bool(n.robust)
    assert np.asarray(n.norm).tobytes() == np.asarray(theirs).tobytes()
    assert np.asarray(n.amax).tobytes() == _abs_max(leaves).tobytes()
    assert not np.asarray(n.leaf_nonfinite).any()
    big = [x * 1e25 for x in leaves[:18]] + leaves[18:]  # squares overflow, values finite
    n = measure(big)
    assert bool(n.finite) and bool(n.robust)
    assert np.asarray(n.amax).tobytes() == _abs_max(big).tobytes()
    exact = np.sqrt(sum(np.sum(np.square(np.asarray(x, np.float64))) for x in big))
    np.testing.assert_allclose(float(n.norm), exact, rtol=1e-5)
    big[20] = big[20].at[0].set(np.inf)
    n = measure(big)
    assert not bool(n.finite)
    assert np.flatnonzero(np.asarray(n.leaf_nonfinite)).tolist() == [20]


@with_and_without_jit
@pytest.mark.parametrize("dtype,big", [("float32", 1e25), ("float64", 1e200)])
@pytest.mark.full(keep=1)
def test_overflowing_finite_sum_is_finite(jit, dtype, big):
    with enable_x64(dtype == "float64"):
        leaves = _leaves(dtype, big)
        assert not np.isfinite(float(optax.tree.norm(leaves)))  # the plain sum overflows
        n = maybe_jit(lambda ls: global_norm(ls, per_leaf=True), jit)(leaves)
        assert bool(n.finite) and bool(n.robust)
        assert not np.asarray(n.leaf_nonfinite).any()
        exact = np.sqrt(sum(np.sum(np.square(np.asarray(x, np.float64) / big)) for x in leaves))
        np.testing.assert_allclose(float(n.norm) / big, exact, rtol=1e-5)


@with_and_without_jit
@pytest.mark.parametrize("shape", [(1,), (1, 1), (2,)])
@pytest.mark.full(keep=1)
def test_a_one_element_leaf_past_the_square_range_is_finite(jit, shape):
    # 2**64 squared overflows float32: the exact pass scales by 2**-96 before squaring. A
    # constant scale let XLA fold it through the square of a one-element leaf, (x*c)**2 ->
    # x*x*c*c, so the step was reported non-finite (and skipped) with norm inf.
    grads = {"a": jnp.full(shape, 2.0**64), "b": jnp.ones(3)}
    n = maybe_jit(lambda ls: global_norm(ls), jit)(jax.tree.leaves(grads))
    assert bool(n.finite) and bool(n.robust)
    exact = np.sqrt(np.prod(shape) * 2.0**128 + 3)
    assert float(n.norm) == np.float32(exact)
    tx = jdls.wrap(optax.sgd(1.0), jdls.StaticScale(1.0))
    _, state = maybe_jit(tx.update, jit)(grads, tx.init(grads), grads)
    assert bool(jdls.stats(state).finite) and int(jdls.stats(state).skipped_steps) == 0


@with_and_without_jit
@pytest.mark.parametrize("bad", [np.inf, -np.inf, np.nan])
@pytest.mark.parametrize("dtype,big", [("float32", 1e25), ("float64", 1e200), ("float32", 1.0)])
@pytest.mark.full(keep=1)
def test_nonfinite_leaves_are_flagged(jit, bad, dtype, big):
    with enable_x64(dtype == "float64"):
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


@with_and_without_jit
@pytest.mark.parametrize("track", [False, True])
@pytest.mark.full(keep=1)
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


# --------------------------------------------------------------------------------------------
# The largest magnitude (what an observing rule such as AdaptiveScale gets), beside the sum.
# --------------------------------------------------------------------------------------------


def _abs_max(leaves: list[jax.Array]) -> np.ndarray:
    """The reference: ``max(|x|)`` over every leaf, rounded to float32, as XLA computes it
    (on CPU it flushes subnormal inputs to zero)."""
    return np.asarray(jax.jit(amax)(leaves))


def _random_tree(rng: np.random.Generator, exponent: int) -> list[jax.Array]:
    leaves = []
    for _ in range(int(rng.integers(1, 5))):
        size = int(rng.choice([1, 7, 300, 20_000]))  # small leaves share one reduction
        dtype = rng.choice(["float32", "float16", "bfloat16"])
        x = rng.standard_normal(size) * 2.0 ** (exponent + int(rng.integers(-4, 4)))
        with np.errstate(over="ignore"):
            leaves.append(jnp.asarray(x.astype(np.float32)).astype(dtype))
    return leaves


@with_and_without_jit
@pytest.mark.full
def test_largest_is_the_abs_max_bit_for_bit(jit):
    """Across the whole float32 range, small and large leaves, 16-bit and float32: the largest
    magnitude measured beside the sum equals max(|x|) exactly, and the norm is the one
    measured without it where the squares are normal floats (below, XLA:CPU may flush
    subnormal squares to zero in one compiled form and not in the other)."""
    rng = np.random.default_rng(1)
    measure = maybe_jit(lambda ls: global_norm(ls, largest=True), jit)
    plain = maybe_jit(lambda ls: global_norm(ls).norm, jit)
    for exponent in [-140, -100, -70, -64, -63, -62, -30, 0, 30, 62, 63, 64, 100, 126]:
        for _ in range(3):
            leaves = _random_tree(rng, exponent)
            n = measure(leaves)
            assert n.amax is not None and n.amax.dtype == jnp.float32
            if bool(n.finite):
                assert np.asarray(n.amax).tobytes() == _abs_max(leaves).tobytes(), exponent
                if -55 <= exponent <= 60:
                    assert np.asarray(n.norm).tobytes() == np.asarray(plain(leaves)).tobytes()


@with_and_without_jit
@pytest.mark.parametrize(
    "leaves",
    [
        [jnp.zeros(3)],  # nothing measured
        [jnp.zeros(20_000), jnp.array([3e-20, 0.0])],  # a zero large leaf, a tiny small one
        [jnp.full(20_000, 1e-30, jnp.float32)],  # squares below the smallest normal
        [jnp.full(20_000, 1e-30, jnp.float32), jnp.array([0.25], jnp.float16)],
        [jnp.array([3e38, -3e38, 1.0])],  # the sum of squares overflows: still finite
        [jnp.full(20_000, 2e19, jnp.float32), jnp.array([1.0])],  # squares overflow
        [jnp.array([1 + 2j, 3 - 4j], jnp.complex64), jnp.array([1e-30])],
    ],
    ids=["zeros", "zero-large", "tiny-large", "tiny-and-normal", "huge", "huge-large", "complex"],
)
@pytest.mark.full(keep=2)
def test_largest_is_exact_at_the_edges(jit, leaves):
    n = maybe_jit(lambda ls: global_norm(ls, largest=True), jit)(leaves)
    assert bool(n.finite)
    assert np.asarray(n.amax).tobytes() == _abs_max(leaves).tobytes()


@pytest.mark.full
def test_largest_in_float64():
    with enable_x64(True):
        rng = np.random.default_rng(2)
        for exponent in [-600, -520, -511, -300, 0, 300, 511, 600]:
            leaves = [
                jnp.asarray(rng.standard_normal(20_000) * 2.0**exponent),
                jnp.asarray(rng.standard_normal(5) * 2.0 ** (exponent - 3)),
            ]
            n = jax.jit(lambda ls: global_norm(ls, largest=True))(leaves)
            assert np.asarray(n.amax).tobytes() == _abs_max(leaves).tobytes(), exponent


@with_and_without_jit
@pytest.mark.parametrize("bad", [np.inf, np.nan])
def test_observing_wrap_skips_a_nan_in_a_large_leaf(jit, bad):
    """XLA's max reduction drops a NaN in a large array on CPU: finiteness must come from the
    sum of squares, never from the largest magnitude."""
    # the trap: XLA:CPU's max drops it (jax 0.10; older releases give the NaN)
    dropped = float(jax.jit(jnp.max)(jnp.ones(20_000).at[3].set(np.nan)))
    assert dropped == 1.0 or np.isnan(dropped)
    params = {"w": jnp.zeros(20_000), "b": jnp.zeros(3)}
    tx = jdls.wrap(optax.sgd(0.1), jdls.AdaptiveScale(2.0**10))
    state = tx.init(params)
    grads = {"w": jnp.full(20_000, 1e-3).at[3].set(bad), "b": jnp.ones(3)}
    updates, state = maybe_jit(tx.update, jit)(grads, state, params)
    assert bool(jdls.stats(state).skipped)
    assert float(jdls.get_scale(state).loss_scale) == 2.0**9
    assert not np.asarray(updates["w"]).any()


def test_largest_inside_shard_map_is_agreed():
    mesh = jax.make_mesh((4,), ("d",))
    leaves = [jnp.arange(64.0) / 8 - 7.0, jnp.linspace(-3.0, 2.0, 80_000)]
    leaves[1] = leaves[1].at[70_000].set(41.0)  # on the last device only

    def local(ls):
        return global_norm(ls, axis_name="d", sharded=[True, True], largest=True).amax

    run = jax.jit(
        jax.shard_map(local, mesh=mesh, in_specs=(P("d"),), out_specs=P(), check_vma=True)
    )
    put = lambda ls: jax.device_put(ls, jax.sharding.NamedSharding(mesh, P("d")))  # noqa: E731
    assert float(run(put(leaves))) == 41.0


def _cases(dtype: str = "float32") -> dict[str, list[jax.Array]]:
    """Gradients of every kind the decision must tell apart."""
    cases = {"usual": _leaves(dtype, 3.0), "sum overflows": _leaves(dtype, 1e25)}
    for name, bad in (("inf", np.inf), ("-inf", -np.inf), ("nan", np.nan)):
        for where, big in (("small", 1.0), ("beside an overflow", 1e25)):
            leaves = _leaves(dtype, big)
            leaves[2] = leaves[2].at[1].set(bad)
            cases[f"{name}, {where}"] = leaves
    # XLA:CPU's max reduction drops a NaN in a large array: the sum must catch it
    cases["nan in a large leaf"] = [jnp.full(20_000, 1e-3).at[3].set(np.nan), jnp.ones(3)]
    cases["one element past 2**64"] = [jnp.full((1,), 2.0**64), jnp.ones(3)]
    return cases


@with_and_without_jit
@pytest.mark.parametrize("case", list(_cases()))
@pytest.mark.full(keep=1)
def test_without_the_exact_pass_the_decision_is_the_same(jit, case):
    """With the largest magnitude measured, finiteness needs no second pass: the same
    decision as the exact pass on every kind of gradient; the norm is optax's, bit for bit
    (inf once the sum of squares overflows, where the exact pass gives it up to float32's
    largest value); the largest magnitude is the same."""
    leaves = _cases()[case]
    fast = maybe_jit(lambda ls: global_norm(ls, largest=True, exact_overflow=False), jit)(leaves)
    exact = maybe_jit(lambda ls: global_norm(ls, largest=True), jit)(leaves)
    finite = case in ("usual", "sum overflows", "one element past 2**64")
    assert bool(fast.finite) == bool(exact.finite) == finite
    assert bool(fast.robust) == bool(exact.robust)
    theirs = np.float32(optax.tree.norm(leaves))
    assert np.asarray(fast.norm).tobytes() == theirs.tobytes() or (
        np.isnan(theirs) and np.isnan(fast.norm)
    )
    if bool(exact.finite):
        assert float(fast.amax) == float(exact.amax)
    if not bool(exact.robust):
        assert np.asarray(fast.norm).tobytes() == np.asarray(exact.norm).tobytes()


def test_without_the_exact_pass_wide_leaves_keep_it():
    """A float64 or complex magnitude can overflow float32, where the largest magnitude is
    measured: those leaves keep the exact pass, and a finite step stays finite."""
    huge = jnp.full(4, 3e38 + 3e38j, jnp.complex64)  # |z| overflows float32
    n = global_norm([huge, jnp.ones(3)], largest=True, exact_overflow=False)
    assert bool(n.finite) and bool(n.robust)  # its norm, past float32, is inf
    with enable_x64(True):
        big = [jnp.full(3, 1e200, jnp.float64), jnp.ones(3, jnp.float64)]
        n = global_norm(big, largest=True, exact_overflow=False)
        assert bool(n.finite) and bool(n.robust)
        np.testing.assert_allclose(float(n.norm), np.sqrt(3) * 1e200, rtol=1e-12)
    with pytest.raises(ValueError, match="needs largest=True"):
        global_norm([jnp.ones(3)], exact_overflow=False)
    with pytest.raises(ValueError, match="per_leaf=False"):
        global_norm([jnp.ones(3)], largest=True, per_leaf=True, exact_overflow=False)


@pytest.mark.parametrize("bad", [np.inf, np.nan, None])
@pytest.mark.full(keep=1)
def test_without_the_exact_pass_inside_shard_map(bad):
    """Across devices the decision is agreed: an inf or a NaN on one device skips on all."""
    mesh = jax.make_mesh((4,), ("d",))
    leaves = [jnp.linspace(-3.0, 2.0, 64), jnp.arange(32.0)]
    if bad is not None:
        leaves[1] = leaves[1].at[30].set(bad)  # on the last device only

    def local(ls):
        n = global_norm(ls, axis_name="d", sharded=[True, True], largest=True, exact_overflow=False)
        return n.finite, n.norm, n.amax

    run = jax.jit(
        jax.shard_map(local, mesh=mesh, in_specs=(P("d"),), out_specs=P(), check_vma=True)
    )
    put = lambda ls: jax.device_put(ls, jax.sharding.NamedSharding(mesh, P("d")))  # noqa: E731
    finite, norm, top = run(put(leaves))
    assert bool(finite) == (bad is None)
    if bad is None:
        whole = global_norm(leaves, largest=True)
        np.testing.assert_allclose(float(norm), float(whole.norm), rtol=1e-6)
        assert float(top) == 31.0


@with_and_without_jit
def test_default_wrap_takes_a_step_whose_squares_overflow(jit):
    """Gradients past 2**64 in norm are finite: the default applies the step, as the classic
    rule does; its ``grad_norm`` is optax's (inf), the classic rule's the exact norm."""
    params = {"a": jnp.zeros(4), "b": jnp.zeros(3)}
    grads = {"a": jnp.full(4, 1e25), "b": jnp.ones(3)}
    for scale, norm in ((jdls.AdaptiveScale(), np.inf), (jdls.DynamicScale(), 2e25)):
        tx = jdls.wrap(optax.sgd(1e-30), scale)
        updates, state = maybe_jit(tx.update, jit)(grads, tx.init(params), params)
        stats = jdls.stats(state)
        assert bool(stats.finite) and int(stats.skipped_steps) == 0
        np.testing.assert_allclose(float(stats.grad_norm), norm, rtol=1e-6)
        np.testing.assert_allclose(np.asarray(updates["a"]), -1e-5, rtol=1e-6)


@pytest.mark.parametrize("axis_type", ["Explicit", "Auto"])
def test_largest_with_leaves_sharded_differently(axis_type):
    """Leaves with different shardings under jit, explicit or automatic: exact, and no
    gradient gathered across devices for it (only the reductions' all-reduces)."""
    mesh = jax.make_mesh((4,), ("d",), axis_types=(getattr(jax.sharding.AxisType, axis_type),))
    rng = np.random.default_rng(3)
    shapes = {"w": (64, 32), "b": (64,), "s": (5,), "v": (32, 4)}
    specs = {"w": P("d"), "b": P("d"), "s": P(), "v": P(None, "d")}
    raw = {k: jnp.asarray(rng.standard_normal(v), jnp.float32) for k, v in shapes.items()}
    raw["s"] = raw["s"].at[2].set(-9.5)
    tree = jax.device_put(raw, {k: jax.sharding.NamedSharding(mesh, s) for k, s in specs.items()})
    with jax.set_mesh(mesh):
        measure = jax.jit(lambda t: global_norm(jax.tree_util.tree_leaves(t), largest=True).amax)
        assert float(measure(tree)) == 9.5
        assert "all-gather" not in measure.lower(tree).compile().as_text()


@pytest.mark.full
def test_wrap_measures_beside_the_sum():
    """The observing wrap measures the largest magnitude beside the sum of squares: one
    ``max(abs)`` per leaf, exact, and no second measurement in a ``lax.cond`` of its own (the
    classic rule measures nothing)."""
    params = {"w": jnp.ones((200, 100)), "b": jnp.ones(100), "c": jnp.ones((3, 4), jnp.float16)}

    def top(scale):
        tx = jdls.wrap(optax.sgd(0.1), scale)
        state = tx.init(params)
        jaxpr = jax.make_jaxpr(lambda g, s: tx.update(g, s, params))(params, state)
        return [e.primitive.name for e in jaxpr.jaxpr.eqns]

    adaptive, classic = top(jdls.AdaptiveScale()), top(jdls.DynamicScale())
    # the update branches; the classic rule also has the norm's exact pass, which the
    # largest magnitude makes needless for the default (it decides finiteness itself)
    assert adaptive.count("cond") == 1 and classic.count("cond") == 2
    assert adaptive.count("reduce_max") == 4  # one per leaf, one across them
    assert classic.count("reduce_max") == 0
    # and the scale follows the largest gradient as before: 2**(16 - 6 - 1) for amax 1.0
    tx = jdls.wrap(optax.sgd(0.1), jdls.AdaptiveScale())
    state = tx.init(params)
    grads = jax.tree_util.tree_map(lambda p: p * 0.5, params)
    grads["w"] = grads["w"].at[7, 3].set(-1.0)
    _, state = jax.jit(tx.update)(grads, state, params)
    assert float(jdls.get_scale(state).loss_scale) == 2.0**9
