"""jdls.fp8: recipes, the FP8 dot, Flax fp8_ops bit for bit, skip-awareness, telemetry."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from _helpers import assert_bitwise_equal, maybe_jit, with_and_without_jit
from flax.linen import fp8_ops

from jdls import fp8

DN = (((1,), (0,)), ((), ()))


def _flax_step(op, x, w, ct, meta, compute):
    """One step of Flax's FP8 dot: output, dx, dw and the new meta (its OWG gradients)."""

    def f(x, w, meta):
        if op == "direct":
            return fp8_ops.fp8_scaled_dot_general(
                x, w, DN, preferred_element_type=compute, quantize_compute_type=compute, **meta
            )
        e4, e5 = (
            (jnp.float8_e4m3fnuz, jnp.float8_e5m2fnuz)
            if op == "nanoo"
            else (jnp.float8_e4m3fn, jnp.float8_e5m2)
        )
        xq = fp8_ops.in_qdq(compute, e4, x, meta["lhs_scale"], meta["lhs_amax_history"])
        wq = fp8_ops.in_qdq(compute, e4, w, meta["rhs_scale"], meta["rhs_amax_history"])
        y = fp8_ops.dot_general_with_precision(xq, wq, DN)
        return fp8_ops.out_qdq(compute, e5, y, meta["grad_scale"], meta["grad_amax_history"])

    y, vjp = jax.vjp(f, x, w, meta)
    dx, dw, new_meta = vjp(ct)
    return y, dx, dw, new_meta


def _jdls_step(x, w, ct, state):
    def f(x, w, state):
        return fp8.dot_general(x, w, DN, state=state)

    y, vjp = jax.vjp(f, x, w, state)
    dx, dw, dstate = vjp(ct)
    return y, dx, dw, fp8.update(state, dstate)


def _flax_meta(length):
    meta = {}
    for k in ("lhs", "rhs", "grad"):
        meta[f"{k}_scale"] = jnp.ones((1,), jnp.float32)
        meta[f"{k}_amax_history"] = jnp.zeros((length,), jnp.float32)
    return meta


def _inputs(step, dtype):
    """Magnitudes that change from step to step by orders of magnitude (scales must follow)."""
    k = jax.random.split(jax.random.key(step), 3)
    big = 10.0 ** ((step * 7) % 5 - 2)
    x = (jax.random.normal(k[0], (8, 16)) * big).astype(dtype)
    w = (jax.random.normal(k[1], (16, 4)) / (1 + step % 3)).astype(dtype)
    ct = (jax.random.normal(k[2], (8, 4)) * 10.0 ** (step % 4 - 1)).astype(dtype)
    return x, w, ct


@pytest.mark.parametrize("op", ["direct", "qdq", "nanoo"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@with_and_without_jit
def test_flax_preset_is_bit_identical_to_flax(op, dtype, jit):
    """Outputs, gradients, scales and histories equal Flax's fp8_ops bit for bit, step by step."""
    length = 4
    meta = _flax_meta(length)
    state = fp8.init(fp8.flax_fp8_ops(length, op=op))
    flax_step = (
        maybe_jit(_flax_step, jit) if not jit else jax.jit(_flax_step, static_argnums=(0, 5))
    )
    jdls_step = maybe_jit(_jdls_step, jit)
    for step in range(12):
        x, w, ct = _inputs(step, dtype)
        used = state  # jdls keeps the scale a step will use; Flax returns it as its gradient
        y0, dx0, dw0, meta = flax_step(op, x, w, ct, meta, dtype)
        y1, dx1, dw1, state = jdls_step(x, w, ct, state)
        assert_bitwise_equal(y1, y0)
        assert_bitwise_equal(dx1, dx0)
        assert_bitwise_equal(dw1, dw0)
        for role in ("lhs", "rhs", "grad"):
            assert_bitwise_equal(getattr(used, role).scale, meta[f"{role}_scale"][0])
            assert_bitwise_equal(getattr(state, role).history, meta[f"{role}_amax_history"])
