"""jdls._numerics.scalars.one_kernel: a step's scalar bookkeeping in one kernel, bit for bit.

The wrap passes its statistics through it and the adaptive rule its scale and counters; both
must come out exactly as they went in, for every float32 bit pattern (NaN payloads, signed
zeros, infinities) and every int32, jitted and not; a float32 subnormal comes back as it is or
as a zero of its sign, as from any arithmetic operation on XLA:CPU, which flushes them.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
from _helpers import maybe_jit, with_and_without_jit
from hypothesis import given, settings
from hypothesis import strategies as st

import jdls
from jdls._numerics.scalars import one_kernel

_EDGES = [0x7FC00001, 0xFFC00000, 0x7F800001, 0x7F800000, 0xFF800000, 0x80000000, 0, 1, 0x80000001]


@with_and_without_jit
@settings(max_examples=40, deadline=None)
@given(
    bits=st.lists(st.integers(0, 2**32 - 1), min_size=1, max_size=6),
    ints=st.lists(st.integers(-(2**31), 2**31 - 1), min_size=1, max_size=4),
)
def test_every_value_comes_back_bit_for_bit(jit, bits, ints):
    floats = [jnp.asarray(np.uint32(b).view(np.float32)) for b in bits + _EDGES]
    counters = [jnp.asarray(i, jnp.int32) for i in ints]
    out = maybe_jit(one_kernel, jit)((floats, counters))
    for x, y in zip(floats + counters, out[0] + out[1], strict=True):
        assert y.dtype == x.dtype and y.shape == ()
        x, y = np.asarray(x), np.asarray(y)
        if x.dtype == np.float32 and 0 < abs(x) < np.finfo(np.float32).tiny:
            assert y.tobytes() in (x.tobytes(), np.copysign(np.float32(0), x).tobytes())
        else:
            assert y.tobytes() == x.tobytes()


@with_and_without_jit
def test_other_leaves_pass_as_they_are(jit):
    tree = {
        "flag": jnp.asarray(True),
        "vector": jnp.arange(3.0),
        "half": jnp.asarray(1.5, jnp.float16),
        "n": jnp.asarray(7, jnp.int32),
        "x": jnp.asarray(-0.0, jnp.float32),
        "none": None,
    }
    out = maybe_jit(one_kernel, jit)(tree)
    assert jax.tree.structure(out) == jax.tree.structure(tree)
    for x, y in zip(jax.tree.leaves(tree), jax.tree.leaves(out), strict=True):
        assert y.dtype == x.dtype and np.asarray(y).tobytes() == np.asarray(x).tobytes()
    alone = {"n": jnp.asarray(7, jnp.int32), "flag": jnp.asarray(True)}
    assert one_kernel(alone) is alone  # fewer than two scalars: nothing to gather


def _reductions(scale):
    """The multi-output reductions in the jaxpr of a wrap's update (one per ``one_kernel``)."""
    params = {"w": jnp.ones((8, 4)), "b": jnp.ones(4)}
    tx = jdls.wrap(optax.adam(1e-3), scale)
    jaxpr = jax.make_jaxpr(lambda g, s: tx.update(g, s, params))(params, tx.init(params))
    return [e for e in jaxpr.jaxpr.eqns if e.primitive.name == "reduce" and len(e.outvars) > 1]


def test_the_wrap_gathers_its_scalars():
    """The statistics' counters and the norm come out of one reduction, and so do the
    adaptive rule's scale and counters: two kernels where there were a dozen."""
    default = _reductions(jdls.AdaptiveScale())
    assert sorted(len(e.outvars) for e in default) == [6, 7]  # statistics; scale + 6 counters
    assert [len(e.outvars) for e in _reductions(jdls.DynamicScale())] == [6]
