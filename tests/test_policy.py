"""Tests of jdls._floats.policy: jmp-compatible policies with native and emulated formats."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _helpers import assert_bitwise_equal, f32_bits, maybe_jit, with_and_without_jit

import jdls
from jdls._floats.formats import FloatFormat, cbfloat16
from jdls._floats.policy import Policy, get_policy

F32, F16, BF16 = np.dtype("float32"), np.dtype("float16"), np.dtype(jnp.bfloat16)


# --------------------------------------------------------------------------------------------
# Parsing.
# --------------------------------------------------------------------------------------------

JMP_STRINGS = [
    "params=float32,compute=float16,output=float32",
    "p=f32,c=f16,o=f32",
    "c=f16",
    "p=f16,c=bf16",
    "p=bf16",
    "o=bfloat16",
    "params=full,compute=half,output=full",
    "f16",
    "bf16",
    "full",
    "half",
    "float32",
    "bfloat16",
]


@pytest.mark.parametrize("name", JMP_STRINGS)
def test_parses_like_jmp(name):
    jmp = pytest.importorskip("jmp")
    ours, theirs = get_policy(name), jmp.get_policy(name)
    assert ours.param_dtype == theirs.param_dtype
    assert ours.compute_dtype == theirs.compute_dtype
    assert ours.output_dtype == theirs.output_dtype
    assert str(ours) == str(theirs)


def test_defaults_follow_jmp():
    assert get_policy("c=f16") == Policy(F32, F16, F16)  # output follows compute
    assert get_policy("p=f16,c=bf16") == Policy(F16, BF16, BF16)
    assert get_policy("p=bf16") == Policy(BF16, BF16, BF16)  # compute follows params
    assert get_policy("o=f16") == Policy(F32, F32, F16)


def test_emulated_and_float8_names():
    policy = get_policy("params=float32,compute=cbfloat16,output=float32")
    assert policy.compute_dtype is cbfloat16
    assert policy.param_dtype == policy.output_dtype == F32
    assert get_policy("c=cbf16") == Policy(F32, cbfloat16, cbfloat16)
    assert get_policy("cbfloat16") == Policy(cbfloat16, cbfloat16, cbfloat16)
    for name in ("float8_e4m3", "float8_e5m2", "float8_e3m4", "float8_e4m3fn"):
        assert get_policy(f"c={name}").compute_dtype == np.dtype(getattr(jnp, name))
    assert get_policy(" p = f32 , c = cbfloat16 ") == get_policy("p=f32,c=cbfloat16")


@pytest.mark.parametrize(
    "name",
    [
        "p=f32,c=cbfloat16,o=f32",
        "cbfloat16",
        "c=float8_e4m3",
        "p=f16,c=bf16,o=f32",
        "p=float8_e5m2,c=cbfloat16,o=bf16",
    ],
)
def test_str_round_trip(name):
    policy = get_policy(name)
    assert get_policy(str(policy)) == policy


def test_policy_normalises_fields():
    policy = Policy(jnp.float32, jnp.float16, "bf16")
    assert policy == get_policy("p=f32,c=f16,o=bf16")
    assert isinstance(policy.param_dtype, np.dtype)
    assert policy.compute_dtype == jnp.float16  # compares like jmp's scalar-type fields
    assert hash(policy) == hash(get_policy("p=f32,c=f16,o=bf16"))
    assert Policy(F32, FloatFormat(6, 9), F32) == get_policy("c=cbfloat16,o=f32")
    assert policy.with_output_dtype(cbfloat16).output_dtype is cbfloat16
    assert policy.with_output_dtype("f32") == Policy(F32, F16, F32)


@pytest.mark.parametrize(
    "name, error, message",
    [
        ("c=float17", ValueError, "Unknown dtype 'float17'.*accepted names are: half, bf16"),
        ("params=f32,compute=int8", ValueError, "Unknown dtype 'int8'.*cbfloat16"),
        ("x=f32", ValueError, "Unknown key 'x'.*'params', 'compute' or 'output'"),
        ("p=f32,c", ValueError, "Malformed part 'c'.*key=dtype"),
        ("", ValueError, "Unknown dtype ''"),
        ("float", ValueError, "Unknown dtype 'float'"),
        (None, TypeError, "policy_name must be a str"),
    ],
)
def test_bad_policy_strings(name, error, message):
    with pytest.raises(error, match=message):
        get_policy(name)


def test_bad_policy_fields():
    with pytest.raises(ValueError, match="compute_dtype must be a floating dtype, got int32"):
        Policy(jnp.float32, jnp.int32, jnp.float32)
    with pytest.raises(TypeError, match="param_dtype must be a floating dtype, a dtype name"):
        Policy(object(), jnp.float32, jnp.float32)
    with pytest.raises(ValueError, match="Unknown dtype 'f8'"):
        Policy("f8", "f32", "f32")


# --------------------------------------------------------------------------------------------
# Native casts behave like jmp's.
# --------------------------------------------------------------------------------------------


def test_native_casts_match_jmp():
    jmp = pytest.importorskip("jmp")
    tree = {
        "w": jnp.linspace(-1.0, 1.0, 7) * 1e-5,
        "n": np.linspace(0.0, 1.0, 3, dtype=np.float32),
        "i": jnp.arange(3),
        "s": 1.5,
        "none": None,
    }
    for name in ("p=f32,c=f16,o=f32", "p=f32,c=bf16,o=f16", "p=f16,c=f32"):
        ours, theirs = get_policy(name), jmp.get_policy(name)
        for method in ("cast_to_param", "cast_to_compute", "cast_to_output"):
            got = getattr(ours, method)(tree)
            want = getattr(theirs, method)(tree)
            assert got["none"] is None and got["s"] == 1.5
            assert got["i"].dtype == jnp.int32
            assert isinstance(got["n"], np.ndarray) == isinstance(want["n"], np.ndarray)
            for key in ("w", "n", "i"):
                assert_bitwise_equal(got[key], want[key])


def test_native_backward_is_jax_transpose():
    # Native float16 compute: the cotangent w.r.t. the f16 value is f16, so 1e-8 underflows.
    policy = get_policy("p=f32,c=f16,o=f32")
    grad = jax.grad(lambda w: (policy.cast_to_compute(w).astype(jnp.float32) * 1e-8).sum())
    np.testing.assert_array_equal(np.asarray(grad(jnp.ones(3))), np.zeros(3, np.float32))


# --------------------------------------------------------------------------------------------
# Emulated casts: values and cotangents on the grid.
# --------------------------------------------------------------------------------------------

VALUES = np.array(
    [1.0 + 2.0**-10, 1e-13, 3e-12, 5e9, -0.1, 1e-9, -(2.0**-40), 2.0**-39], np.float32
)


@with_and_without_jit
def test_forward_rounds_to_grid(jit):
    policy = get_policy("params=float32,compute=cbfloat16,output=float32")
    tree = {"x": VALUES, "i": jnp.arange(2), "none": None, "h": jnp.ones(2, jnp.float16)}
    out = maybe_jit(policy.cast_to_compute, jit)(tree)
    assert out["none"] is None and out["i"].dtype == jnp.int32
    assert out["x"].dtype == jnp.float32 and out["h"].dtype == jnp.float32
    assert_bitwise_equal(out["x"], cbfloat16.round(VALUES))
    assert_bitwise_equal(out["h"], np.ones(2, np.float32))


@with_and_without_jit
def test_backward_of_cast_to_compute_rounds_cotangent(jit):
    policy = get_policy("params=float32,compute=cbfloat16,output=float32")
    cotangent = jnp.asarray(VALUES)

    def loss(w):
        return jnp.vdot(policy.cast_to_compute(w), cotangent)

    grad = maybe_jit(jax.grad(loss), jit)(jnp.ones_like(cotangent))
    want = cbfloat16.round(VALUES)
    assert_bitwise_equal(grad, want)
    # 1e-13 and -2**-40 underflowed (to +0 and -0), 5e9 overflowed to inf.
    assert list(f32_bits(want)[[1, 6]]) == [0, 0x80000000] and np.isinf(want[3])


@with_and_without_jit
def test_backward_of_cast_to_output_rounds_to_compute_grid(jit):
    # The output cast's input is a compute (cbfloat16) value: its cotangent is cbfloat16.
    policy = get_policy("p=f32,c=cbfloat16,o=f32")
    cotangent = jnp.asarray(VALUES)
    grad = maybe_jit(jax.grad(lambda y: jnp.vdot(policy.cast_to_output(y), cotangent)), jit)
    assert_bitwise_equal(grad(jnp.ones(VALUES.size)), cbfloat16.round(VALUES))
    # With float32 compute the output cast is the identity, forward and backward.
    plain = get_policy("p=f32,c=f32,o=f32")
    grad32 = jax.grad(lambda y: jnp.vdot(plain.cast_to_output(y), cotangent))
    assert_bitwise_equal(grad32(jnp.ones(VALUES.size)), VALUES)


def test_backward_rounds_destination_then_source():
    # params cbfloat16, compute float16: the cotangent is f16 (JAX), then cbfloat16.
    policy = get_policy("p=cbfloat16,c=f16,o=f32")
    g = np.array([1e-6, 1e-9, 70000.0, 1.0 + 2.0**-10, 1.0 + 3 * 2.0**-10], np.float32)

    def loss(w):
        return jnp.vdot(policy.cast_to_compute(w).astype(jnp.float32), g)

    with np.errstate(over="ignore"):
        want = cbfloat16.round(g.astype(np.float16).astype(np.float32))
    assert_bitwise_equal(jax.grad(loss)(jnp.ones(5)), want)
    assert float(want[1]) == 0.0 and np.isinf(want[2])  # f16 underflow / overflow
    # float16 keeps 1 + 2**-10 and 1 + 3 * 2**-10; both are cbfloat16 ties, to even.
    assert (float(want[3]), float(want[4])) == (1.0, 1.0 + 2.0**-8)


def test_cast_to_param_backward_uses_compute_grid():
    policy = get_policy("p=f32,c=cbfloat16,o=f32")
    g = jnp.asarray(VALUES)
    grad = jax.grad(lambda w: jnp.vdot(policy.cast_to_param(w), g))(jnp.ones(VALUES.size))
    assert_bitwise_equal(grad, cbfloat16.round(VALUES))
    # Forward: float32 values are unchanged by a float32 param cast.
    assert_bitwise_equal(policy.cast_to_param(jnp.asarray(VALUES)), VALUES)


def test_vmap_and_static_policy():
    policy = get_policy("c=cbfloat16")

    @jax.jit(static_argnums=0)
    def f(p, x):
        return jax.vmap(p.cast_to_compute)(x)

    x = jnp.asarray(VALUES).reshape(2, 4)
    assert_bitwise_equal(f(policy, x), cbfloat16.round(x))


def test_mlp_gradients_underflow_like_the_format():
    """A whole model: emulated gradients equal float32 gradients rounded at the casts."""
    policy = get_policy("p=f32,c=cbfloat16,o=f32")
    w = jax.random.normal(jax.random.key(1), (8, 4))
    # Multiples of 1/8: every sum below is exact, whatever the summation order.
    x = jax.random.randint(jax.random.key(2), (16, 8), -8, 9).astype(jnp.float32) / 8

    def loss(w, scale):
        wc, xc = policy.cast_to_compute((w, x))
        return scale * jnp.sum(policy.cast_to_output(xc @ wc))

    # dL/dw = x_c^T @ round_cb(scale * ones); with scale 1e-14 the cotangent underflows.
    assert not np.any(np.asarray(jax.grad(loss)(w, 1e-14)))
    g = jax.grad(loss)(w, 2.0**-20)
    xc = cbfloat16.round(x)
    want = cbfloat16.round(xc.T @ jnp.full((16, 4), 2.0**-20))
    assert_bitwise_equal(g, want)


def test_exported():
    for name in ("Policy", "get_policy"):
        assert name in jdls.__all__ and getattr(jdls, name) is getattr(jdls._floats.policy, name)
