"""Block scaling (MX, DeepSeek-V3) against independent host references, bit for bit.

The references are written here from the rules as their sources state them, in numpy
(float64 or IEEE float32 without flush-to-zero), never from jdls code:

- down: the OCP MX reference emulator (microsoft/microxcaling ``_shared_exponents`` and
  ``_quantize_mx``): ``floor(log2(amax))`` with ``amax == 0`` read as the smallest normal,
  minus the element format's ``emax``, raised to -127;
- up: JAX's ``cast_to_e8m0_with_rounding_up`` applied to the float32 quotient ``amax / fmax``
  (exponent field, plus one where the mantissa is non-zero, except at the largest exponent
  and below ``2**-127``);
- outlier_aware: qwix's ``compute_scale_zero_point`` for ``mxfp8`` / ``mxfp4`` (quotient,
  1.0 below ``sqrt(tiny)``, times ``c``, rounded to bfloat16, exponent bits kept).

Elements: ``clip(x / 2**e, -fmax, fmax)`` rounded by ml_dtypes.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest
from _helpers import inner_jits, programs_lowered

import jdls
from jdls import fp8
from jdls.fp8._block import (
    ELEMENT_FORMATS,
    block_stats,
    dequantize_blocks,
    element_format,
    quantize_blocks,
)
from jdls.fp8._block_dot import BlockScaling, block_dot_general, deepseek, mx
from jdls.fp8._e8m0 import outlier_constant, shared_exponent

ML_DTYPES = {
    "e4m3": ml_dtypes.float8_e4m3fn,
    "e5m2": ml_dtypes.float8_e5m2,
    "e2m3": ml_dtypes.float6_e2m3fn,
    "e3m2": ml_dtypes.float6_e3m2fn,
    "e2m1": ml_dtypes.float4_e2m1fn,
}
RULES = ("up", "down", "outlier_aware")


# ------------------------------------------------------------------------------------------
# References (host, numpy).
# ------------------------------------------------------------------------------------------


def ref_down(amax: np.ndarray, fmax: float) -> np.ndarray:
    with np.errstate(invalid="ignore", divide="ignore"):  # NaN bit patterns, log2(0)
        a = amax.astype(np.float64)
        e = np.floor(np.log2(np.where(a == 0, 2.0**-126, a))) - math.floor(math.log2(fmax))
    e = np.where(np.isfinite(a), np.maximum(e, -127), np.nan)
    return np.where(np.isnan(e), 255, e + 127).astype(np.int64)


def ref_up(amax: np.ndarray, fmax: float) -> np.ndarray:
    with np.errstate(invalid="ignore", over="ignore"):
        q = amax.astype(np.float32) / np.float32(fmax)
    bits = q.view(np.uint32).astype(np.int64)
    field, frac = bits >> 23, bits & 0x7FFFFF
    below = (field == 0) & (frac <= 0x400000)
    up = (frac > 0) & (field != 254) & ~below
    return np.where(np.isfinite(amax), field + up, 255)


def ref_outlier_aware(amax: np.ndarray, fmax: float, mantissa_bits: int) -> np.ndarray:
    with np.errstate(invalid="ignore", over="ignore"):
        s = amax.astype(np.float32) / np.float32(fmax)
        s = np.where(s < np.sqrt(np.finfo(np.float32).tiny), np.float32(1.0), s)
        t = (s * np.float32(outlier_constant(mantissa_bits))).astype(ml_dtypes.bfloat16)
    return ((t.view(np.uint16) & 0x7F80) >> 7).astype(np.int64)


def ref_codes(amax: np.ndarray, rule: str, fmt: str) -> np.ndarray:
    f = ELEMENT_FORMATS[fmt]
    if rule == "down":
        return ref_down(amax, f.max)
    if rule == "up":
        return ref_up(amax, f.max)
    return ref_outlier_aware(amax, f.max, f.mantissa_bits)


def ref_quantize(x: np.ndarray, rule: str, fmt: str) -> tuple[np.ndarray, np.ndarray]:
    """Blocks along the last axis of ``x`` (float32, shape (n, block)): codes and values."""
    f = ELEMENT_FORMATS[fmt]
    amax = np.max(np.abs(x.astype(np.float64)), axis=-1)
    amax = np.where(np.isnan(x).any(-1), np.nan, amax).astype(np.float32)
    codes = ref_codes(amax, rule, fmt)
    e = np.where(codes == 255, 0, codes - 127)[:, None]
    with np.errstate(invalid="ignore", over="ignore"):
        q = np.clip(np.ldexp(x.astype(np.float64), -e), -f.max, f.max)
    q = np.where(codes[:, None] == 255, 0.0, q).astype(np.float32)
    return codes, q.astype(ML_DTYPES[fmt])


def ref_dequantize(codes: np.ndarray, values: np.ndarray) -> np.ndarray:
    e = np.where(codes == 255, 0, codes - 127)[:, None]
    r = np.ldexp(values.astype(np.float64), e)
    r = np.where(np.abs(r) < 2.0**-126, np.copysign(0.0, r), r)  # XLA CPU's flush-to-zero
    with np.errstate(over="ignore"):
        return np.where(codes[:, None] == 255, np.nan, r).astype(np.float32)


# ------------------------------------------------------------------------------------------
# Inputs.
# ------------------------------------------------------------------------------------------


def special_amax(fmax: float) -> np.ndarray:
    """Zero, every power of two and its neighbours, ``fmax * 2**k`` and its neighbours, the
    rounding boundaries below ``2**-126``, the largest float32, inf and NaN."""
    f32 = np.float32
    powers = [math.ldexp(1.0, k) for k in range(-149, 128)]
    fm = [fmax * math.ldexp(1.0, k) for k in range(-160, 128)]
    fm = [v for v in fm if 2.0**-149 <= v <= float(np.finfo(f32).max)]
    bounds = [fmax * 2.0**-127 * (1 + 2.0**-23), fmax * 2.0**-127, fmax * 2.0**-126]
    base = np.array(powers + fm + bounds + [2.0**-63 * fmax], np.float64).astype(f32)
    bits = base.view(np.uint32).astype(np.int64)
    near = np.concatenate([bits + d for d in (-2, -1, 0, 1, 2)])
    near = near[(near >= 0) & (near < 0x7F800000)].astype(np.uint32).view(f32)
    extra = np.array([0.0, np.finfo(f32).max, np.finfo(f32).tiny, np.inf, np.nan], f32)
    return np.concatenate([near, extra])


def random_amax(n: int, seed: int) -> np.ndarray:
    """``n`` random non-negative float32 bit patterns (subnormals, inf and NaN included)."""
    rng = np.random.default_rng(seed)
    bits = rng.integers(0, 0x7FFFFFFF, n, dtype=np.uint32, endpoint=True)
    return bits.view(np.float32)


def random_blocks(n: int, block: int, seed: int) -> np.ndarray:
    """``n`` blocks of float32 values: each block spans up to 40 binades below a random top
    exponent (subnormals included); some blocks hold zeros only, inf, NaN or 2**+-127."""
    rng = np.random.default_rng(seed)
    top = rng.integers(0, 255, (n, 1))
    field = np.maximum(top - rng.integers(0, 40, (n, block)), 0)
    bits = (field << 23) | rng.integers(0, 1 << 23, (n, block))
    bits |= rng.integers(0, 2, (n, block)) << 31
    x = bits.astype(np.uint32).view(np.float32)
    kind = rng.integers(0, 64, n)
    x[kind == 0] = 0.0
    x[kind == 1, 3] = np.inf
    x[kind == 2, 5] = -np.inf
    x[kind == 3, 7] = np.nan
    x[kind == 4, 0] = 2.0**127
    x[kind == 5] = np.float32(2.0**-127) * rng.integers(-1, 2, (int((kind == 5).sum()), block))
    return x


def _codes_of(amax: np.ndarray, rule: str, fmt: str) -> np.ndarray:
    f = ELEMENT_FORMATS[fmt]
    a = jnp.asarray(amax.view(np.uint32))
    return np.asarray(
        jax.jit(shared_exponent, static_argnums=(1, 2, 3))(a, rule, f.max, f.mantissa_bits)
    )


# ------------------------------------------------------------------------------------------
# Shared exponents.
# ------------------------------------------------------------------------------------------


def _check_codes(amax: np.ndarray, rule: str, fmt: str) -> None:
    got = _codes_of(amax, rule, fmt)
    want = ref_codes(amax, rule, fmt)
    finite = np.isfinite(amax)
    np.testing.assert_array_equal(got[finite], want[finite])
    assert (got[~finite] == 255).all()
    if rule != "up":  # the OCP emulator and qwix give NaN / inf scales: E8M0's code 255
        np.testing.assert_array_equal(want[~finite], 255)


@pytest.mark.parametrize("fmt", sorted(ELEMENT_FORMATS))
@pytest.mark.parametrize("rule", RULES)
def test_shared_exponent_matches_reference_on_specials(rule, fmt):
    amax = np.concatenate([special_amax(ELEMENT_FORMATS[fmt].max), random_amax(1 << 14, 7)])
    _check_codes(amax, rule, fmt)


@pytest.mark.full
@pytest.mark.parametrize("fmt", sorted(ELEMENT_FORMATS))
@pytest.mark.parametrize("rule", RULES)
def test_shared_exponent_matches_reference_on_a_million_patterns(rule, fmt):
    _check_codes(random_amax(1 << 20, 8), rule, fmt)


def test_rounding_up_differs_from_jax_only_for_nan():
    # JAX's formula adds one to the exponent field 255 of a NaN quotient and wraps the uint8
    # to 0 (the smallest scale); block scaling keeps the NaN scale. inf agrees (255).
    amax = np.array([np.inf, np.nan], np.float32)
    np.testing.assert_array_equal(_codes_of(amax, "up", "e4m3"), [255, 255])
    np.testing.assert_array_equal(ref_up(amax, 448.0), [255, 255])  # the reference keeps it


def test_rounding_up_clips_one_amax_and_down_clips_below_its_bound():
    """``"up"`` clips exactly one amax per format, the float32 value one ulp above
    ``fmax * 2**-127`` (its quotient rounds to the subnormal ``2**-127``), by less than
    ``1e-7``; ``"down"`` leaves the maximum below ``2**(floor(log2 fmax) + 1)``: 1.14x fmax
    for e4m3, e5m2 and e3m2, 1.07x for e2m3, 1.33x for e2m1."""
    amax = random_amax(1 << 16, 3)
    amax = amax[np.isfinite(amax)]
    for fmt, f in ELEMENT_FORMATS.items():
        edge = np.float32(np.float64(f.max) * 2.0**-127)
        near = (edge.view(np.uint32) + np.arange(-64, 65)).astype(np.uint32).view(np.float32)
        both = np.concatenate([amax, near])
        for rule in ("up", "down"):
            e = _codes_of(both, rule, fmt).astype(np.int64) - 127
            top = both.astype(np.float64) / np.ldexp(1.0, e)
            if rule == "up":
                over = both[top > f.max]
                assert over.tolist() == [float(np.nextafter(edge, np.float32(1)))], fmt
                assert top.max() / f.max < 1 + 1e-7, fmt
            else:
                bound = 2.0 ** (np.floor(np.log2(f.max)) + 1)
                assert (top[both > 2.0**-100] < bound).all(), fmt
                assert top.max() > 0.99 * bound, fmt  # the bound is reached


def test_outlier_constants_are_qwix_constants():
    assert outlier_constant(3) == 60 / 31
    assert outlier_constant(1) == 12 / 7


# ------------------------------------------------------------------------------------------
# Block quantization.
# ------------------------------------------------------------------------------------------


def _check_quantize(x: np.ndarray, rule: str, fmt: str) -> None:
    block = x.shape[1]
    fn = jax.jit(lambda v: quantize_blocks(v, (1, block), fmt, rule))
    q = fn(jnp.asarray(x))
    codes, values = ref_quantize(x, rule, fmt)
    np.testing.assert_array_equal(np.asarray(q.codes)[:, 0], codes)
    got = np.asarray(q.values)
    if got.dtype == np.float32:  # FP6: values held in float32
        np.testing.assert_array_equal(
            got.view(np.uint32), values.astype(np.float32).view(np.uint32)
        )
    else:
        np.testing.assert_array_equal(got.view(np.uint8), values.view(np.uint8))
    deq = np.asarray(jax.jit(dequantize_blocks)(q))
    np.testing.assert_array_equal(
        deq.view(np.uint32), ref_dequantize(codes, values).view(np.uint32)
    )


@pytest.mark.parametrize("rule", RULES)
@pytest.mark.full(keep=1)
def test_mxfp8_quantize_matches_reference(rule):
    _check_quantize(random_blocks(1 << 14, 32, 99), rule, "e4m3")


@pytest.mark.full
@pytest.mark.parametrize("rule", RULES)
def test_mxfp8_quantize_matches_reference_on_a_million_blocks(rule):
    for chunk in range(8):  # 8 x 2**17 blocks of 32
        _check_quantize(random_blocks(1 << 17, 32, 100 + chunk), rule, "e4m3")


@pytest.mark.parametrize("fmt", ["e5m2", "e2m3", "e3m2", "e2m1"])
@pytest.mark.parametrize("rule", RULES)
@pytest.mark.full(keep=1)
def test_other_mx_formats_quantize_matches_reference(rule, fmt):
    _check_quantize(random_blocks(1 << 14, 32, 11), rule, fmt)


@pytest.mark.full
def test_quantize_not_jitted_equals_jitted():
    x = random_blocks(256, 32, 5)
    a = quantize_blocks(jnp.asarray(x), (1, 32), "e4m3", "down")
    b = jax.jit(lambda v: quantize_blocks(v, (1, 32), "e4m3", "down"))(jnp.asarray(x))
    np.testing.assert_array_equal(np.asarray(a.codes), np.asarray(b.codes))
    np.testing.assert_array_equal(
        np.asarray(a.values).view(np.uint8), np.asarray(b.values).view(np.uint8)
    )


@pytest.mark.full
def test_blocks_in_two_dimensions_and_padding():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((200, 130)).astype(np.float32) * np.exp(
        3 * rng.standard_normal((200, 1))
    )
    q = quantize_blocks(jnp.asarray(x), (128, 128), "e4m3", "up")
    assert q.codes.shape == (2, 2) and q.values.shape == x.shape
    padded = np.zeros((256, 256), np.float32)
    padded[:200, :130] = x
    tiles = padded.reshape(2, 128, 2, 128).transpose(0, 2, 1, 3).reshape(4, -1)
    codes, values = ref_quantize(tiles, "up", "e4m3")
    np.testing.assert_array_equal(np.asarray(q.codes).reshape(-1), codes)
    back = values.reshape(2, 2, 128, 128).transpose(0, 2, 1, 3).reshape(256, 256)[:200, :130]
    np.testing.assert_array_equal(np.asarray(q.values).view(np.uint8), back.view(np.uint8))


@pytest.mark.full  # about 4 s
def test_a_non_finite_value_makes_its_block_nan_and_only_its_block():
    x = jnp.array([[1.0, jnp.inf, 2.0, 3.0], [1.0, 2.0, jnp.nan, 4.0]])
    q = quantize_blocks(x, (1, 2), "e2m1", "up")  # FP4 has no NaN: the scale carries it
    deq = np.asarray(dequantize_blocks(q))
    assert np.isnan(deq[0, :2]).all() and np.isfinite(deq[0, 2:]).all()
    assert np.isnan(deq[1, 2:]).all() and np.isfinite(deq[1, :2]).all()


@pytest.mark.full
def test_block_stats_counts_clipped_flushed_and_nonfinite_blocks():
    x = jnp.array([[449.0, 1.0, 1.0, 1.0, 2.0**-20, 1.0, jnp.nan, 1.0]])
    down = {k: float(v) for k, v in block_stats(x, (1, 2), "e4m3", "down").items()}
    up = {k: float(v) for k, v in block_stats(x, (1, 2), "e4m3", "up").items()}
    assert down == {"clipped": 0.25, "flushed": 0.125, "nonfinite": 0.25, "amax": np.inf}
    assert up == {"clipped": 0.0, "flushed": 0.125, "nonfinite": 0.25, "amax": np.inf}


def test_bad_arguments_say_what_to_pass():
    with pytest.raises(ValueError, match="rounding must be one of"):
        quantize_blocks(jnp.ones((2, 32)), (1, 32), "e4m3", "nearest")
    with pytest.raises(ValueError, match="element format must be one of"):
        element_format("int8")
    with pytest.raises(ValueError, match="one positive block length per axis"):
        quantize_blocks(jnp.ones((2, 32)), (32,), "e4m3")
    with pytest.raises(ValueError, match="weight_block"):
        BlockScaling(weight_block=(128,))


# ------------------------------------------------------------------------------------------
# Dots: forward against jax.lax.scaled_dot, gradients against the same quantized dots.
# ------------------------------------------------------------------------------------------


def _lognormal(shape, seed):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal(shape) * np.exp(rng.standard_normal(shape))).astype(np.float32)


def _dot32(a, b, dn):
    """A float32-accumulated dot of dequantized operands, given (exactly) as bfloat16."""
    assert (a.astype(jnp.bfloat16).astype(jnp.float32) == a).all()
    assert (b.astype(jnp.bfloat16).astype(jnp.float32) == b).all()
    return jax.lax.dot_general(
        a.astype(jnp.bfloat16),
        b.astype(jnp.bfloat16),
        dn,
        precision=jax.lax.Precision.HIGHEST,
        preferred_element_type=jnp.float32,
    )


def _dot64(a, b, dn):
    """The dot of ``a`` and ``b`` in float64, in numpy (JAX without x64 would compute it in
    float32); contraction dimensions only, no batch dimensions."""
    (lc, rc), (lb, rb) = dn
    assert not lb and not rb
    return np.tensordot(np.asarray(a, np.float64), np.asarray(b, np.float64), (lc, rc))


@functools.partial(jax.jit, static_argnums=(2, 3, 4))
def _mx_scaled_dot(x, w, dn, fmt, rule):
    """The reference of the MX forward: ``jax.lax.scaled_dot`` of the blocks, one program (not
    each quantization's operations compiled one by one, eagerly)."""
    qx = quantize_blocks(x, (1, 1, 32), fmt, rule)
    qw = quantize_blocks(w, (1, 32, 1), fmt, rule)
    return jax.lax.scaled_dot(
        qx.values,
        qw.values,
        lhs_scale=qx.scales,
        rhs_scale=qw.scales,
        dimension_numbers=dn,
        preferred_element_type=jnp.float32,
    )


@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2", "e2m1"])
@pytest.mark.full
def test_mx_forward_equals_scaled_dot(rule, fmt):
    x, w = jnp.asarray(_lognormal((2, 16, 96), 1)), jnp.asarray(_lognormal((2, 96, 24), 2))
    dn = (((2,), (1,)), ((0,), (0,)))
    want = _mx_scaled_dot(x, w, dn, fmt, rule)
    got = jax.jit(lambda a, b: block_dot_general(a, b, dn, mx(fmt, rule)))(x, w)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


@pytest.mark.full
def test_deepseek_forward_equals_scaled_dot():
    x, w = jnp.asarray(_lognormal((32, 256), 3)), jnp.asarray(_lognormal((256, 256), 4))
    dn = (((1,), (0,)), ((), ()))

    @jax.jit  # the reference, one program
    def reference(x, w):
        qx = quantize_blocks(x, (1, 128), "e4m3", "up")
        qw = quantize_blocks(w, (128, 128), "e4m3", "up")
        rhs_scale = jnp.repeat(qw.scales_float32, 128, axis=1)  # scaled_dot: one per column
        return jax.lax.scaled_dot(
            qx.values,
            qw.values,
            lhs_scale=qx.scales_float32,
            rhs_scale=rhs_scale,
            dimension_numbers=dn,
            preferred_element_type=jnp.float32,
        )

    want = reference(x, w)
    got = block_dot_general(x, w, dn, deepseek())  # eagerly
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


@functools.partial(jax.jit, static_argnums=(1, 2, 3))
def _deq(x, block_shape, fmt, rule):
    return dequantize_blocks(quantize_blocks(x, block_shape, fmt, rule))


@functools.partial(jax.jit, static_argnums=(3, 4))
def _value_and_vjp(x, w, g, dn, recipe):
    y, vjp = jax.vjp(lambda a, b: block_dot_general(a, b, dn, recipe), x, w)
    return (y, *vjp(g))


@pytest.mark.parametrize("recipe", [deepseek(), mx(), mx("e4m3", "down", backward="e5m2")])
@pytest.mark.full
def test_gradients_equal_float32_dots_of_the_requantized_operands(recipe):
    x, w = jnp.asarray(_lognormal((256, 384), 5)), jnp.asarray(_lognormal((384, 256), 6))
    g = jnp.asarray(_lognormal((256, 256), 7))
    dn = (((1,), (0,)), ((), ()))
    y, dx, dw = _value_and_vjp(x, w, g, dn, recipe)
    n, r, fw, bw = recipe.block, recipe.rounding, recipe.forward, recipe.backward
    wb = recipe.weight_block
    w_k = wb if isinstance(wb, tuple) else (wb, 1)
    w_n = wb if isinstance(wb, tuple) else (1, wb)
    want_y = _dot32(_deq(x, (1, n), fw, r), _deq(w, w_k, fw, r), dn)
    want_dx = _dot32(_deq(g, (1, n), bw, r), _deq(w, w_n, fw, r), (((1,), (1,)), ((), ())))
    want_dw = _dot32(_deq(x, (n, 1), fw, r), _deq(g, (n, 1), bw, r), (((0,), (0,)), ((), ())))
    for got, want in ((y, want_y), (dx, want_dx), (dw, want_dw)):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    # The same dots in float64: float32 accumulation is the only difference.
    want64 = _dot64(_deq(g, (1, n), bw, r), _deq(w, w_n, fw, r), (((1,), (1,)), ((), ())))
    np.testing.assert_allclose(np.asarray(dx), want64, rtol=1e-4, atol=1e-3)


def test_an_eager_call_compiles_a_few_programs_not_one_per_operation():
    # Op by op, a block dot's value and gradients lowered 637 programs (18.7 s the first time
    # on a 2-core CPU), quantize_blocks 95, quantize_nvfp4 73 and hadamard 70.
    x, w, g = jnp.ones((3, 80)), jnp.ones((80, 7)), jnp.ones((3, 7))

    def dot_and_grads():
        dn = (((1,), (0,)), ((), ()))
        y, vjp = jax.vjp(lambda a, b: block_dot_general(a, b, dn, deepseek()), x, w)
        return y, vjp(g)

    assert programs_lowered(dot_and_grads) <= 8
    # Inside a user's jit the compiled rules are inlined: no inner call in the program.
    inner = inner_jits(dot_and_grads)
    assert not inner & {"_block_dot_fwd", "_block_dot_bwd"}, inner
    assert programs_lowered(lambda: fp8.quantize_blocks(jnp.ones((5, 160)), (1, 32), "e4m3")) <= 4
    assert programs_lowered(lambda: fp8.quantize_nvfp4(jnp.ones((5, 176)))) <= 4
    assert programs_lowered(lambda: fp8.hadamard(jnp.ones((37, 24)), 0)) <= 4  # 70 op by op


@pytest.mark.full
def test_dot_not_jitted_equals_jitted():
    x, w = jnp.asarray(_lognormal((4, 64), 12)), jnp.asarray(_lognormal((64, 8), 13))
    g = jnp.asarray(_lognormal((4, 8), 14))
    dn = (((1,), (0,)), ((), ()))
    y, vjp = jax.vjp(lambda a, b: block_dot_general(a, b, dn, deepseek()), x, w)
    for got, want in zip((y, *vjp(g)), _value_and_vjp(x, w, g, dn, deepseek()), strict=True):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


@pytest.mark.full
def test_gradients_with_batch_and_several_free_axes():
    x = jnp.asarray(_lognormal((3, 4, 5, 64), 8))  # batch, two free axes, contraction
    w = jnp.asarray(_lognormal((3, 64, 6, 2), 9))  # batch, contraction, two free axes
    dn = (((3,), (1,)), ((0,), (0,)))
    y, dx, dw = _value_and_vjp(x, w, jnp.ones((3, 4, 5, 6, 2)), dn, mx())
    assert y.shape == jax.lax.dot_general(x, w, dn).shape
    x3, w3 = x.reshape(3, 20, 64), w.reshape(3, 64, 12)
    g3 = jnp.ones((3, 20, 12))
    want_dx = _dot32(
        _deq(g3, (1, 1, 32), "e4m3", "up"),
        _deq(w3, (1, 1, 32), "e4m3", "up"),
        (((2,), (2,)), ((0,), (0,))),
    )
    want_dw = _dot32(
        _deq(x3, (1, 32, 1), "e4m3", "up"),
        _deq(g3, (1, 32, 1), "e4m3", "up"),
        (((1,), (1,)), ((0,), (0,))),
    )
    np.testing.assert_array_equal(np.asarray(dx).reshape(3, 20, 64), np.asarray(want_dx))
    np.testing.assert_array_equal(np.asarray(dw).reshape(3, 64, 12), np.asarray(want_dw))


def test_gradients_keep_input_dtypes():
    x, w = jnp.ones((8, 64), jnp.bfloat16), jnp.ones((64, 4), jnp.float16)
    dn = (((1,), (0,)), ((), ()))
    loss = lambda a, b: block_dot_general(a, b, dn).astype(jnp.float32).sum()  # noqa: E731
    dx, dw = jax.jit(jax.grad(loss, argnums=(0, 1)))(x, w)
    assert dx.dtype == jnp.bfloat16 and dw.dtype == jnp.float16


@pytest.mark.full(keep=1)
@pytest.mark.parametrize("recipe", [mx("e2m1"), mx(), deepseek()])
def test_an_inf_cotangent_gives_non_finite_gradients(recipe):
    # Per-tensor FP8 dots that clip would launder it into finite gradients.
    x, w = jnp.asarray(_lognormal((8, 256), 10)), jnp.asarray(_lognormal((256, 16), 11))
    dn = (((1,), (0,)), ((), ()))
    _, dx, dw = _value_and_vjp(x, w, jnp.zeros((8, 16)).at[2, 3].set(jnp.inf), dn, recipe)
    assert not np.isfinite(np.asarray(dx)).all()
    assert not np.isfinite(np.asarray(dw)).all()


def test_an_inf_activation_gives_a_non_finite_output():
    x = jnp.ones((4, 64)).at[1, 5].set(jnp.inf)
    dot = jax.jit(block_dot_general, static_argnums=2)
    y = dot(x, jnp.ones((64, 2)), (((1,), (0,)), ((), ())))
    y = np.asarray(y)
    assert np.isnan(y[1]).all() and np.isfinite(y[[0, 2, 3]]).all()


# ------------------------------------------------------------------------------------------
# Block scaling as a jdls.fp8 recipe: the same dot, site and layers as per-tensor recipes.
# ------------------------------------------------------------------------------------------


def _site_step(x, w, g, dn, site):
    y, vjp = jax.vjp(lambda a, b, s: fp8.dot_general(a, b, dn, site=s), x, w, site)
    return (y, *vjp(g))


def _dot32_f32(a, b, dn):
    return jax.lax.dot_general(a, b, dn, preferred_element_type=jnp.float32)


@pytest.mark.parametrize("recipe", [mx(), mx("e2m1", "down"), deepseek()])
@pytest.mark.full
def test_recipe_in_the_fp8_dot_gives_the_requantized_float32_dots(recipe):
    x, w = jnp.asarray(_lognormal((256, 256), 15)), jnp.asarray(_lognormal((256, 256), 16))
    g = jnp.asarray(_lognormal((256, 256), 17))
    dn = (((1,), (0,)), ((), ()))
    site = fp8.init(recipe)
    y, dx, dw, _ = jax.jit(
        lambda a, b, c, s: _site_step(a, b, c, dn, s)  # site is a pytree
    )(x, w, g, site)
    n, r, fw, bw, wb = (
        recipe.block,
        recipe.rounding,
        recipe.forward,
        recipe.backward,
        recipe.weight_block,
    )
    w_k = wb if isinstance(wb, tuple) else (wb, 1)
    w_n = wb if isinstance(wb, tuple) else (1, wb)
    want = [
        _dot32_f32(_deq(x, (1, n), fw, r), _deq(w, w_k, fw, r), dn),
        _dot32_f32(_deq(g, (1, n), bw, r), _deq(w, w_n, fw, r), (((1,), (1,)), ((), ()))),
        _dot32_f32(_deq(x, (n, 1), fw, r), _deq(g, (n, 1), bw, r), (((0,), (0,)), ((), ()))),
    ]
    for got, exp in zip((y, dx, dw), want, strict=True):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(exp))
    # the stand-alone block dot (bfloat16 operands, as scaled_dot) differs only in accumulation;
    # jitted: a reference here, one program (eagerly, about 200 operations compiled one by one)
    y2 = jax.jit(block_dot_general, static_argnums=(2, 3))(x, w, dn, recipe)
    np.testing.assert_allclose(np.asarray(y), np.asarray(y2), rtol=1e-5, atol=1e-4)


@pytest.mark.full  # about 4 s; the non-finite block test stays in the quick run
def test_recipe_measurement_reports_clipped_blocks_and_flushed_values():
    x = jnp.array([[449.0, 1.0, 1.0, 1.0, 2.0**-20, 1.0, 3.0, 1.0]])
    recipe = dataclasses.replace(mx("e4m3", "down"), block=2)
    q, m = recipe.quantize(x, recipe.init("lhs"), "lhs", (1,))
    assert float(m.amax) == 449.0
    assert float(m.saturated) == 0.25  # one block of four clipped its maximum
    assert float(m.flushed) == 0.125  # 2**-20 next to 1.0
    assert q.values.tolist() == [[448.0, 1.0, 1.0, 1.0, 0.0, 1.0, 3.0, 1.0]]
    _, m_up = dataclasses.replace(recipe, rounding="up").quantize(x, None, "lhs", (1,))
    assert float(m_up.saturated) == 0.0
    _, m_bad = recipe.quantize(x.at[0, 3].set(jnp.nan), None, "lhs", (1,))
    assert float(m_bad.amax) == np.inf


@pytest.mark.full
def test_recipe_values_where_the_block_does_not_divide():
    q, _ = mx().quantize(jnp.ones((3, 40)), None, "lhs", (1,))
    assert q.values.shape == (3, 40) and q.scale.shape == ()  # 40 is not a multiple of 32
    np.testing.assert_array_equal(np.asarray(q.dequantize()), np.ones((3, 40)))


def test_a_block_scale_below_float32s_normal_range_keeps_its_values():
    """A block whose E8M0 scale is 2**-127 (code 0): its values times the scale are normal
    float32 numbers, and the FP8 dot gives what the stand-alone block dot gives (a float32
    product with the scale would have flushed it to zero)."""
    x, w = jnp.full((4, 32), 1e-36), jnp.full((32, 2), 1e29)
    dn = (((1,), (0,)), ((), ()))
    assert (
        int(
            jax.jit(quantize_blocks, static_argnums=(1, 2, 3))(x, (1, 32), "e4m3", "up").codes[0, 0]
        )
        == 0
    )
    y = jax.jit(lambda x, w, s: fp8.dot_general(x, w, dn, site=s))(x, w, fp8.init(mx()))
    y2 = jax.jit(lambda x, w: block_dot_general(x, w, dn, mx()))(x, w)
    np.testing.assert_array_equal(np.asarray(y), np.asarray(y2))
    assert float(y[0, 0]) == pytest.approx(3.2e-6, rel=0.05)


@pytest.mark.full
def test_a_model_switches_between_per_tensor_and_block_scaling_by_its_recipe():
    x = jnp.asarray(_lognormal((4, 64), 18))

    def run(recipe):
        dot = functools.partial(fp8.linen.DotGeneral, recipe=recipe)
        model = nn.Dense(8, dot_general_cls=dot)
        variables = jax.jit(model.init)(jax.random.key(0), x)
        loss = lambda v: jnp.sum(model.apply(v, x) ** 2)  # noqa: E731
        value, grads = jax.jit(jax.value_and_grad(loss))(variables)
        return variables, value, grads

    for recipe in (fp8.CurrentScaling(), mx(), deepseek(), mx("e2m1", "outlier_aware")):
        _, value, grads = run(recipe)
        assert np.isfinite(float(value))
        assert np.isfinite(np.asarray(grads["params"]["kernel"])).all()
        meter = grads["jdls"]["DotGeneral_0"]["fp8"].value.meter
        assert float(meter.lhs.amax) == float(np.abs(np.asarray(x)).max())


def test_jdls_wrap_skips_a_step_whose_block_scaled_gradient_overflowed():
    x, w = jnp.asarray(_lognormal((8, 64), 19)), jnp.asarray(_lognormal((64, 4), 20))
    dn = (((1,), (0,)), ((), ()))
    _, _, dw, _ = jax.jit(lambda a, b, c, s: _site_step(a, b, c, dn, s))(
        x, w, jnp.zeros((8, 4)).at[1, 1].set(jnp.inf), fp8.init(mx())
    )
    tx = jdls.wrap(optax.sgd(0.1), jdls.StaticScale(1.0))
    opt_state = tx.init(w)
    _, opt_state = tx.update(dw, opt_state, w)
    assert int(jdls.stats(opt_state).skipped_steps) == 1


def test_telemetry_reports_each_sites_clipped_blocks_and_flushed_values():
    x = jnp.ones((2, 64)).at[0, 0].set(449.0).at[1, 40].set(2.0**-20)
    w = jnp.ones((64, 4))
    dn = (((1,), (0,)), ((), ()))
    sites = {"down": fp8.init(mx("e4m3", "down")), "up": fp8.init(mx("e4m3", "up"))}
    step = jax.jit(
        lambda s: jax.grad(
            lambda s: sum(jnp.sum(fp8.dot_general(x, w, dn, site=v)) for v in s.values())
        )(s)
    )
    sites = jdls.update_sites(sites, step(sites))
    rows = fp8.telemetry(sites)
    # x has 4 blocks of 32: the 449 clips its block's maximum when rounding down
    assert rows["down"]["lhs"] == {"amax": 449.0, "saturated": 0.25, "flushed": 1 / 128, "uses": 1}
    assert rows["up"]["lhs"] == {"amax": 449.0, "saturated": 0.0, "flushed": 1 / 128, "uses": 1}
