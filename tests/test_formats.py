"""Tests of jdls._floats (formats, lookup, storage): bit-exact emulation of IEEE-style float formats.

References: ml_dtypes/numpy conversions for the formats they have (float16, bfloat16,
float8_e5m2, float8_e4m3, float8_e3m4, all IEEE-style with inf/NaN), and, for the others
(cbfloat16, custom widths and biases), an independent float64 oracle (`oracle_round`),
itself checked against numpy and ml_dtypes first.
"""

from __future__ import annotations

import math

import hypothesis.extra.numpy as hnp
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from _helpers import f32_bits, maybe_jit, with_and_without_jit
from hypothesis import given, settings
from hypothesis import strategies as st

import jdls
from jdls._floats.formats import FloatFormat, FormatInfo, cbfloat16
from jdls._floats.lookup import finfo
from jdls._floats.storage import compress, decompress

# name -> (format, numpy dtype); only the IEEE-style ml_dtypes types (inf and NaN encoded
# with the all-ones exponent, as FloatFormat does). float8_e4m3fn/fnuz/b11fnuz, e5m2fnuz,
# e8m0fnu and the float6/float4 types have other special values and are not IEEE-style.
SHARED = {
    "float16": (FloatFormat(5, 10), np.dtype(np.float16)),
    "bfloat16": (FloatFormat(8, 7), np.dtype(ml_dtypes.bfloat16)),
    "float8_e5m2": (FloatFormat(5, 2), np.dtype(ml_dtypes.float8_e5m2)),
    "float8_e4m3": (FloatFormat(4, 3), np.dtype(ml_dtypes.float8_e4m3)),
    "float8_e3m4": (FloatFormat(3, 4), np.dtype(ml_dtypes.float8_e3m4)),
}
SHARED_NAMES = list(SHARED)

# Formats without an ml_dtypes twin, checked against the oracle. (8, 2) has subnormals
# below 2**-126 (float32 subnormals); (6, 9, bias=20) and (4, 5, bias=3) have custom biases.
CUSTOM = {
    "cbfloat16": cbfloat16,
    "e2m1": FloatFormat(2, 1),
    "e3m2": FloatFormat(3, 2),
    "e4m5_b3": FloatFormat(4, 5, bias=3),
    "e6m9_b20": FloatFormat(6, 9, bias=20),
    "e7m12": FloatFormat(7, 12),
    "e8m2": FloatFormat(8, 2),
    "e5m21": FloatFormat(5, 21),
    "e5m23": FloatFormat(5, 23),
}
CUSTOM_NAMES = list(CUSTOM)


# --------------------------------------------------------------------------------------------
# Helpers and the independent oracle.
# --------------------------------------------------------------------------------------------


def assert_same_floats(got, want, inputs=None) -> None:
    """Bit-for-bit equality of float32 arrays, with any NaN matching any NaN."""
    got = np.asarray(got)
    want = np.asarray(want, dtype=np.float32)
    assert got.dtype == np.float32, got.dtype
    assert got.shape == want.shape
    nan_got, nan_want = np.isnan(got), np.isnan(want)
    bad = (nan_got != nan_want) | (~nan_want & (f32_bits(got) != f32_bits(want)))
    if bad.any():
        i = np.flatnonzero(bad.ravel())[:5]
        x = "" if inputs is None else f" inputs={np.asarray(inputs).ravel()[i]!r}"
        raise AssertionError(
            f"{bad.sum()} of {bad.size} differ; first at {i}:{x} "
            f"got={got.ravel()[i]!r} ({[hex(v) for v in f32_bits(got).ravel()[i]]}) "
            f"want={want.ravel()[i]!r} ({[hex(v) for v in f32_bits(want).ravel()[i]]})"
        )


def oracle_round(fmt: FloatFormat, x: np.ndarray) -> np.ndarray:
    """Round to nearest, ties to even, by the textbook formula in float64 (exact here).

    |x| = f * 2**p with f in [0.5, 1); the format's quantum at |x| is
    2**(max(p - 1, emin) - m); the result is rint(|x| / quantum) * quantum (numpy's rint
    rounds half to even), and inf when it exceeds the largest finite value.
    """
    x = np.asarray(x, np.float32)
    with np.errstate(invalid="ignore"):
        return _oracle_round(fmt, x)


def _oracle_round(fmt: FloatFormat, x: np.ndarray) -> np.ndarray:
    ax = np.abs(x.astype(np.float64))
    m = fmt.mantissa_bits
    _, p = np.frexp(ax)
    qexp = np.maximum(p - 1, fmt.emin) - m
    r = np.ldexp(np.rint(np.ldexp(ax, -qexp)), qexp)
    max_ = math.ldexp(2.0 - 2.0**-m, fmt.emax)
    r = np.where(r > max_, np.inf, r)
    r = np.where(np.isfinite(ax), r, ax)  # inf stays inf, NaN stays NaN
    return np.copysign(r, x).astype(np.float32)


def oracle_decode(fmt: FloatFormat, codes: np.ndarray) -> np.ndarray:
    """Value of each encoding by the IEEE-754 formula, in float64, cast to float32 (exact)."""
    e, m = fmt.exponent_bits, fmt.mantissa_bits
    codes = codes.astype(np.int64)
    s = (codes >> (e + m)) & 1
    ef = (codes >> m) & ((1 << e) - 1)
    mf = codes & ((1 << m) - 1)
    sub = np.ldexp(mf.astype(np.float64), fmt.emin - m)
    nrm = np.ldexp(1.0 + mf / 2.0**m, ef - fmt.bias)
    v = np.where(ef == 0, sub, nrm)
    v = np.where(ef == (1 << e) - 1, np.where(mf == 0, np.inf, np.nan), v)
    return np.where(s == 1, -v, v).astype(np.float32)


def code_values(fmt: FloatFormat, codes: np.ndarray) -> np.ndarray:
    """float64 values of non-negative finite codes; the +inf code stands for 2**(emax+1)."""
    inf_code = ((1 << fmt.exponent_bits) - 1) << fmt.mantissa_bits
    v = oracle_decode(fmt, np.minimum(codes, inf_code - 1)).astype(np.float64)
    return np.where(codes >= inf_code, math.ldexp(1.0, fmt.emax + 1), v)


def sample_codes(fmt: FloatFormat) -> np.ndarray:
    """All non-negative finite codes, or for wide formats the first 4096 (subnormals), 4096
    around the smallest normal, the top 4096 and 20000 random ones."""
    n = ((1 << fmt.exponent_bits) - 1) << fmt.mantissa_bits
    if n <= 1 << 16:
        return np.arange(n)
    sub = 1 << fmt.mantissa_bits
    rng = np.random.default_rng(0)
    parts = [
        np.arange(4096),
        np.arange(sub - 2048, sub + 2048),
        np.arange(n - 4096, n),
        rng.integers(0, n, 20000),
    ]
    return np.unique(np.clip(np.concatenate(parts), 0, n - 1))


def structured_inputs(fmt: FloatFormat) -> np.ndarray:
    """float32 inputs that probe the rounding: values of the format (all of them for formats
    of up to 2**16 values), the exact midpoints to their upper neighbours (ties), one
    float32 ulp either side of values and midpoints, the overflow threshold and its
    neighbours, the smallest subnormal, half of it and specials; with both signs."""
    codes = sample_codes(fmt)
    vals, nxt = code_values(fmt, codes), code_values(fmt, codes + 1)
    mids = (vals + nxt) / 2
    with np.errstate(over="ignore"):  # 2**(emax + 1) may be 2**128: inf, a fine input too
        exact = mids.astype(np.float32) == mids
        pts = np.concatenate([vals, nxt, mids[exact]]).astype(np.float32)
    up = np.nextafter(pts, np.float32(np.inf))
    down = np.nextafter(pts, np.float32(0))
    f32 = np.finfo(np.float32)
    tiny_sub = math.ldexp(1.0, fmt.emin - fmt.mantissa_bits)
    extra = np.array(
        [
            0.0,
            np.inf,
            np.nan,
            f32.max,
            f32.smallest_normal,
            f32.smallest_subnormal,
            3 * f32.smallest_subnormal,
            tiny_sub,
            tiny_sub / 2,
            tiny_sub * 0.75,
            tiny_sub * 1.5,
            tiny_sub * 2.5,
            float(fmt.finfo.max),
            math.ldexp(2.0 - 2.0 ** -(fmt.mantissa_bits + 1), fmt.emax),  # overflow threshold
        ],
        dtype=np.float32,
    )
    extra = np.concatenate([extra, np.nextafter(extra, np.float32(0))])
    out = np.concatenate([pts, up, down, extra])
    return np.concatenate([out, -out])


def strided_float32_patterns(step: int = 4093) -> np.ndarray:
    """Every ``step``-th float32 bit pattern (both signs, all exponents, NaN and inf)."""
    return np.arange(0, 1 << 32, step, dtype=np.uint64).astype(np.uint32).view(np.float32)


def all_codes(fmt: FloatFormat) -> np.ndarray:
    return np.arange(1 << fmt.bits, dtype=np.uint32).astype(fmt.storage_dtype)


def reference(dtype: np.dtype, x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore", invalid="ignore"):
        return x.astype(dtype).astype(np.float32)


# --------------------------------------------------------------------------------------------
# The oracle is right (checked against numpy's and ml_dtypes' correctly rounded casts).
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", SHARED_NAMES)
def test_oracle_agrees_with_numpy_and_ml_dtypes(name):
    fmt, dtype = SHARED[name]
    x = np.concatenate([structured_inputs(fmt), strided_float32_patterns(65537)])
    assert_same_floats(oracle_round(fmt, x), reference(dtype, x), x)
    codes = all_codes(fmt)
    assert_same_floats(oracle_decode(fmt, codes), codes.view(dtype).astype(np.float32))


def test_numpy_float16_reference_is_correctly_rounded():
    # numpy's float32 -> float16 cast, the reference for float16, checked by hand at ties.
    x = np.array(
        [1 + 2.0**-11, 1 + 3 * 2.0**-11, 2.0**-25, 3 * 2.0**-25, 65520.0, 65519.996],
        np.float32,
    )
    want = np.array([1.0, 1 + 2 * 2.0**-10, 0.0, 2.0**-23, np.inf, 65504.0], np.float32)
    assert_same_floats(reference(np.dtype(np.float16), x), want)


# --------------------------------------------------------------------------------------------
# Bit-for-bit agreement with ml_dtypes / numpy.
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", SHARED_NAMES)
@pytest.mark.full(keep=1)
def test_all_encodings_vs_ml_dtypes(name):
    """Every bit pattern: from_bits, round of the decoded value, to_bits round trip."""
    fmt, dtype = SHARED[name]
    codes = all_codes(fmt)
    values = codes.view(dtype).astype(np.float32)
    assert_same_floats(fmt.from_bits(codes), values)
    assert_same_floats(fmt.round(values), values)
    bits = np.asarray(fmt.to_bits(values))
    assert bits.dtype == fmt.storage_dtype and bits.dtype.itemsize == np.dtype(dtype).itemsize
    nan = np.isnan(values)
    np.testing.assert_array_equal(bits[~nan], codes[~nan])
    # NaN encodes as the canonical quiet NaN, which is also what numpy/ml_dtypes give np.nan.
    canonical = np.float32(np.nan).astype(dtype).view(fmt.storage_dtype)
    assert np.all(bits[nan] == canonical)


@pytest.mark.parametrize("name", SHARED_NAMES)
@pytest.mark.full(keep=1)
def test_round_structured_vs_ml_dtypes(name):
    fmt, dtype = SHARED[name]
    x = structured_inputs(fmt)
    assert_same_floats(fmt.round(x), reference(dtype, x), x)
    nan = np.isnan(x)
    want_bits = reference(dtype, x[~nan]).astype(dtype).view(fmt.storage_dtype)
    np.testing.assert_array_equal(np.asarray(fmt.to_bits(x[~nan])), want_bits)


@pytest.mark.parametrize("name", SHARED_NAMES)
def test_round_strided_float32_patterns_vs_ml_dtypes(name):
    fmt, dtype = SHARED[name]
    x = strided_float32_patterns()
    assert x.size > 1_000_000
    assert_same_floats(fmt.round(x), reference(dtype, x), x)


@settings(max_examples=60, deadline=None)
@given(
    name=st.sampled_from(SHARED_NAMES),
    x=hnp.arrays(np.float32, 64, elements=st.floats(width=32, allow_subnormal=True)),
)
def test_round_hypothesis_vs_ml_dtypes(name, x):
    fmt, dtype = SHARED[name]
    assert_same_floats(fmt.round(x), reference(dtype, x), x)


# --------------------------------------------------------------------------------------------
# cbfloat16 and other formats, against the oracle.
# --------------------------------------------------------------------------------------------


def test_cbfloat16_all_encodings():
    codes = all_codes(cbfloat16)
    assert codes.size == 1 << 16
    values = oracle_decode(cbfloat16, codes)
    assert_same_floats(cbfloat16.from_bits(codes), values)
    assert_same_floats(cbfloat16.round(values), values)
    nan = np.isnan(values)
    assert nan.sum() == 2 * 511  # both signs, all non-zero mantissas
    bits = np.asarray(cbfloat16.to_bits(values))
    np.testing.assert_array_equal(bits[~nan], codes[~nan])
    assert np.all(bits[nan] == 0x7F00)
    # Distinct finite codes decode to distinct values (only +-0 share one).
    finite = values[np.isfinite(values)]
    assert np.unique(finite).size == finite.size - 1


@pytest.mark.parametrize("name", CUSTOM_NAMES)
@pytest.mark.full(keep=1)
def test_round_vs_oracle(name):
    fmt = CUSTOM[name]
    x = np.concatenate([structured_inputs(fmt), strided_float32_patterns(16411)])
    assert_same_floats(fmt.round(x), oracle_round(fmt, x), x)
    # to_bits / from_bits round trip equals round (NaN aside).
    ok = ~np.isnan(x)
    assert_same_floats(fmt.from_bits(fmt.to_bits(x[ok])), oracle_round(fmt, x[ok]), x[ok])


@pytest.mark.parametrize("name", ["e2m1", "e3m2", "e4m5_b3", "e8m2"])
def test_small_formats_all_encodings(name):
    fmt = CUSTOM[name]
    codes = all_codes(fmt)
    values = oracle_decode(fmt, codes)
    assert_same_floats(fmt.from_bits(codes), values)
    nan = np.isnan(values)
    np.testing.assert_array_equal(np.asarray(fmt.to_bits(values))[~nan], codes[~nan])


@settings(max_examples=40, deadline=None)
@given(
    name=st.sampled_from(CUSTOM_NAMES),
    x=hnp.arrays(np.float32, 64, elements=st.floats(width=32, allow_subnormal=True)),
)
def test_round_hypothesis_vs_oracle(name, x):
    fmt = CUSTOM[name]
    assert_same_floats(fmt.round(x), oracle_round(fmt, x), x)


def test_float32_itself_is_identity():
    """FloatFormat(8, 23) is float32: round and to_bits are the identity (NaN aside)."""
    fmt = FloatFormat(8, 23)
    x = strided_float32_patterns(8191)
    ok = ~np.isnan(x)
    assert_same_floats(fmt.round(x[ok]), x[ok])
    np.testing.assert_array_equal(np.asarray(fmt.to_bits(x[ok])), f32_bits(x[ok]))


def test_cbfloat16_special_values():
    s = 2.0**-39  # smallest subnormal
    cases = [
        (1.0 + 2.0**-10, 1.0),  # tie between 1 and 1 + 2**-9: even
        (1.0 + 3 * 2.0**-10, 1.0 + 2 * 2.0**-9),  # tie: even is the upper one
        (2.0**-40, 0.0),  # half the smallest subnormal: tie, to even (zero)
        (float(np.nextafter(np.float32(2.0**-40), np.float32(1))), s),  # above half: up
        (3 * 2.0**-40, 2 * s),  # tie between 1 and 2 subnormal steps: even
        (s, s),
        (2.0**-30, 2.0**-30),  # smallest normal
        (2.0**-30 - 2.0**-40, 2.0**-30),  # tie at the top of the subnormals: up (even)
        ((2 - 2.0**-9) * 2.0**31, (2 - 2.0**-9) * 2.0**31),  # largest finite
        ((2 - 2.0**-10) * 2.0**31, math.inf),  # overflow threshold: tie goes to inf
        (float(np.nextafter(np.float32((2 - 2.0**-10) * 2.0**31), np.float32(0))), 4290772992.0),
        (1e30, math.inf),
        (-0.0, -0.0),
        (-(2.0**-41), -0.0),  # underflow keeps the sign
        (-math.inf, -math.inf),
    ]
    x = np.array([c[0] for c in cases], np.float32)
    want = np.array([c[1] for c in cases], np.float32)
    assert_same_floats(cbfloat16.round(x), want, x)
    assert np.isnan(np.asarray(cbfloat16.round(np.float32(np.nan))))
    np.testing.assert_array_equal(
        np.asarray(cbfloat16.to_bits(np.array([0, -0.0, 1, -2, np.inf, -np.inf, s], np.float32))),
        np.array([0, 0x8000, 0x3E00, 0xC000, 0x7E00, 0xFE00, 1], np.uint16),
    )


# --------------------------------------------------------------------------------------------
# Transformations: jit, vmap, grad.
# --------------------------------------------------------------------------------------------


@with_and_without_jit
def test_round_to_bits_from_bits(jit):
    x = np.array([1.0 + 2.0**-10, 3e-12, -1e30, 0.1], np.float32)
    rnd = maybe_jit(cbfloat16.round, jit)
    enc = maybe_jit(cbfloat16.to_bits, jit)
    dec = maybe_jit(cbfloat16.from_bits, jit)
    assert_same_floats(rnd(x), oracle_round(cbfloat16, x))
    assert_same_floats(dec(enc(x)), oracle_round(cbfloat16, x))


@with_and_without_jit
def test_straight_through_gradient(jit):
    x = jnp.array([1.0 + 2.0**-10, 1e-13, 1e30, 0.3])
    grad = maybe_jit(jax.grad(lambda v: jnp.sum(cbfloat16.round(v) * jnp.arange(4.0))), jit)
    assert_same_floats(grad(x), np.arange(4.0))
    primal, tangent = jax.jvp(cbfloat16.round, (x,), (jnp.full(4, 0.5),))
    assert_same_floats(tangent, np.full(4, 0.5))
    assert_same_floats(primal, oracle_round(cbfloat16, np.asarray(x)))


def test_vmap():
    x = jnp.linspace(-3.0, 3.0, 12).reshape(3, 4) * 1e-11
    assert_same_floats(jax.vmap(cbfloat16.round)(x), oracle_round(cbfloat16, np.asarray(x)))
    bits = jax.vmap(cbfloat16.to_bits)(x)
    assert bits.dtype == jnp.uint16 and bits.shape == (3, 4)


def test_format_is_static_config():
    @jax.jit(static_argnums=0)
    def f(fmt, x):
        return fmt.round(x)

    x = jnp.array([1.0 + 2.0**-8])
    assert float(f(cbfloat16, x)[0]) == 1.0 + 2.0**-8
    assert float(f(FloatFormat(5, 2), x)[0]) == 1.0
    assert hash(FloatFormat(6, 9)) == hash(cbfloat16)
    assert FloatFormat(6, 9) == cbfloat16 and FloatFormat(6, 9, bias=30) != cbfloat16


def test_narrow_float_inputs_are_widened_exactly():
    x16 = np.array([1.5, 2.0**-24, -3.0], np.float16)
    out = cbfloat16.round(jnp.asarray(x16))
    assert out.dtype == jnp.float32
    assert_same_floats(out, oracle_round(cbfloat16, x16.astype(np.float32)))
    bf = jnp.array([1.0 + 2.0**-7], jnp.bfloat16)
    assert float(cbfloat16.round(bf)[0]) == 1.0 + 2.0**-7


# --------------------------------------------------------------------------------------------
# Layout, finfo.
# --------------------------------------------------------------------------------------------


def test_layout_and_defaults():
    assert (cbfloat16.exponent_bits, cbfloat16.mantissa_bits, cbfloat16.bias) == (6, 9, 31)
    assert cbfloat16.name == "cbfloat16" and jdls.cbfloat16 is cbfloat16
    assert (cbfloat16.bits, cbfloat16.emin, cbfloat16.emax) == (16, -30, 31)
    assert cbfloat16.storage_dtype == np.uint16
    assert FloatFormat(4, 3).storage_dtype == np.uint8
    assert FloatFormat(7, 12).storage_dtype == np.uint32
    assert FloatFormat(5, 10).name == "float16_e5m10"
    assert FloatFormat(6, 9, bias=20).name == "float16_e6m9_b20"
    assert [FloatFormat(e, 3).bias for e in range(2, 9)] == [1, 3, 7, 15, 31, 63, 127]


FINFO_FIELDS = [
    "bits",
    "nexp",
    "iexp",
    "nmant",
    "machep",
    "negep",
    "minexp",
    "maxexp",
    "eps",
    "epsneg",
    "max",
    "min",
    "smallest_normal",
    "tiny",
    "smallest_subnormal",
]


@pytest.mark.parametrize("name", SHARED_NAMES)
def test_finfo_matches_ml_dtypes(name):
    fmt, dtype = SHARED[name]
    ours, theirs = fmt.finfo, ml_dtypes.finfo(dtype)
    assert isinstance(ours, FormatInfo) and ours.dtype == fmt
    for field in FINFO_FIELDS:
        a, b = getattr(ours, field), getattr(theirs, field)
        assert float(a) == float(b), (field, a, b)
    # precision/resolution: numpy's definition int(-log10(eps)); ml_dtypes hard-codes 1 for
    # every float8 type, which differs from that definition for e4m3 and e5m2 (documented).
    assert ours.precision == int(-math.log10(float(theirs.eps)))
    if fmt.bits == 16:
        assert (ours.precision, float(ours.resolution)) == (
            theirs.precision,
            float(theirs.resolution),
        )
    else:
        assert theirs.precision == 1
        assert ours.precision == {"float8_e5m2": 0, "float8_e4m3": 0, "float8_e3m4": 1}[name]


def test_cbfloat16_finfo():
    info = finfo("cbfloat16")
    assert info is cbfloat16.finfo and finfo(cbfloat16) is info
    assert float(info.max) == (2 - 2.0**-9) * 2.0**31 == -float(info.min)
    assert float(info.smallest_normal) == float(info.tiny) == 2.0**-30
    assert float(info.smallest_subnormal) == 2.0**-39
    assert (float(info.eps), float(info.epsneg)) == (2.0**-9, 2.0**-10)
    assert (info.bits, info.nexp, info.nmant, info.minexp, info.maxexp) == (16, 6, 9, -30, 32)
    assert (info.machep, info.negep, info.precision) == (-9, -10, 2)
    assert float(info.resolution) == float(cbfloat16.round(np.float32(0.01)))
    assert info.name == "cbfloat16" and "cbfloat16" in str(info)
    # Every finfo value is a value of the format.
    for field in ("max", "min", "eps", "epsneg", "tiny", "smallest_subnormal", "resolution"):
        v = getattr(info, field)
        assert float(cbfloat16.round(v)) == float(v), field


def test_finfo_delegates_for_native_dtypes():
    assert finfo("float16") == ml_dtypes.finfo(np.float16)
    assert float(finfo(jnp.bfloat16).max) == float(ml_dtypes.finfo(ml_dtypes.bfloat16).max)
    assert float(finfo("float8_e4m3").max) == 240.0
    assert float(finfo(np.dtype("float32")).eps) == 2.0**-23


# --------------------------------------------------------------------------------------------
# 16-bit storage.
# --------------------------------------------------------------------------------------------


@with_and_without_jit
def test_compress_round_trip(jit):
    key = jax.random.key(0)
    tree = {
        "w": jax.random.normal(key, (64, 32)) * 1e-6,
        "b": jnp.linspace(-1e10, 1e10, 32),
        "step": jnp.array(7, jnp.int32),
        "mask": jnp.array([True, False]),
        "none": None,
        "half": jnp.ones(3, jnp.float16) / 3,
    }
    packed = maybe_jit(compress, jit)(tree)
    assert packed["none"] is None
    assert packed["w"].dtype == jnp.uint16 and packed["b"].dtype == jnp.uint16
    assert packed["step"].dtype == jnp.int32 and int(packed["step"]) == 7
    assert packed["mask"].dtype == jnp.bool_
    assert packed["w"].nbytes * 2 == tree["w"].nbytes
    assert packed["b"].nbytes * 2 == tree["b"].nbytes
    back = maybe_jit(decompress, jit)(packed)
    assert back["none"] is None and int(back["step"]) == 7
    for name in ("w", "b", "half"):
        assert back[name].dtype == jnp.float32
        assert_same_floats(back[name], cbfloat16.round(tree[name]))


def test_memory_halves_for_the_whole_tree():
    tree = [np.ones((256, 256), np.float32), np.zeros(1000, np.float32)]
    packed = compress(tree)
    before = sum(x.nbytes for x in tree)
    after = sum(x.nbytes for x in packed)
    assert after * 2 == before


def test_eight_bit_format():
    fmt = FloatFormat(4, 3)
    x = jnp.array([0.3, -250.0, 1e-3])
    packed = compress({"x": x}, fmt=fmt)
    assert packed["x"].dtype == jnp.uint8
    back = decompress(packed, fmt=fmt)["x"]
    assert_same_floats(back, x.astype(jnp.float8_e4m3).astype(jnp.float32))


# --------------------------------------------------------------------------------------------
# Bad input.
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "args, kwargs, error, message",
    [
        ((1, 9), {}, ValueError, "exponent_bits must be >= 2.*got 1"),
        ((9, 9), {}, ValueError, "exponent_bits must be <= 8.*got 9"),
        ((6, 0), {}, ValueError, "mantissa_bits must be >= 1.*got 0"),
        ((6, 24), {}, ValueError, "mantissa_bits must be <= 23.*got 24"),
        ((6, 9), {"bias": 128}, ValueError, r"bias must be in \[-65, 127\].*got 128"),
        ((8, 7), {"bias": 126}, ValueError, r"bias must be in \[127, 127\].*got 126"),
        ((6, 9), {"bias": -66}, ValueError, r"bias must be in \[-65, 127\].*got -66"),
        ((6.0, 9), {}, TypeError, "exponent_bits must be an int, got 6.0"),
        ((6, True), {}, TypeError, "mantissa_bits must be an int, got True"),
        ((6, 9), {"bias": 31.0}, TypeError, "bias must be an int"),
        ((6, 9), {"name": ""}, TypeError, "name must be a non-empty str"),
    ],
)
def test_bad_formats(args, kwargs, error, message):
    with pytest.raises(error, match=message):
        FloatFormat(*args, **kwargs)


def test_extreme_biases_that_are_accepted():
    # The bias rule's two ends: emin = -126 and emax = 127 are still exact.
    low, high = FloatFormat(6, 9, bias=127), FloatFormat(6, 9, bias=-65)
    assert (low.emin, high.emax) == (-126, 127)
    for fmt in (low, high):
        x = structured_inputs(fmt)
        assert_same_floats(fmt.round(x), oracle_round(fmt, x), x)


@pytest.mark.parametrize(
    "x, message",
    [
        (np.array([1, 2], np.int32), "round expects floating-point values.*int32"),
        (3, "round expects floating-point values.*int"),
        (True, "round expects floating-point values.*bool"),
        (jnp.array([1], jnp.uint16), "round expects floating-point values.*uint16"),
        (np.array([1.0]), "round expects float32 values, got float64"),
    ],
)
def test_round_rejects_non_float32(x, message):
    with pytest.raises(TypeError, match=message):
        cbfloat16.round(x)


def test_other_bad_inputs():
    with pytest.raises(TypeError, match="to_bits expects floating-point values"):
        cbfloat16.to_bits(np.arange(3))
    with pytest.raises(TypeError, match="from_bits expects an integer array.*got dtype float32"):
        cbfloat16.from_bits(np.ones(3, np.float32))
    with pytest.raises(TypeError, match="finfo expects a floating-point dtype.*cbfloat16"):
        finfo("int32")
    with pytest.raises(TypeError, match="finfo expects"):
        finfo("cbfloat17")
    with pytest.raises(TypeError, match="fmt must be a jdls.FloatFormat"):
        compress({"a": jnp.ones(2)}, fmt="cbfloat16")
    with pytest.raises(TypeError, match="fmt must be a jdls.FloatFormat"):
        decompress({"a": jnp.ones(2)}, fmt=np.float16)


def test_from_bits_reads_only_the_low_bits():
    codes = np.array([0x3E00, 0x13E00, -1], np.int64).astype(np.int32)
    out = np.asarray(cbfloat16.from_bits(codes))
    assert out[0] == out[1] == 1.0 and np.isnan(out[2])


@pytest.mark.parametrize(
    "name, module",
    [
        ("FloatFormat", "formats"),
        ("FormatInfo", "formats"),
        ("cbfloat16", "formats"),
        ("compress", "storage"),
        ("decompress", "storage"),
        ("finfo", "lookup"),
    ],
)
def test_exported(name, module):
    import importlib

    private = importlib.import_module(f"jdls._floats.{module}")
    assert name in jdls.__all__ and getattr(jdls, name) is getattr(private, name)


# --------------------------------------------------------------------------------------------
# Python floats (float64) are rounded once, exactly, not float64 -> float32 -> format.
# --------------------------------------------------------------------------------------------


def fraction_round(fmt: FloatFormat, v: float) -> float:
    """Round to nearest, ties to even, in exact rational arithmetic (fractions.Fraction)."""
    from fractions import Fraction

    if not math.isfinite(v) or v == 0.0:
        return v
    ax = abs(Fraction(v))
    p = ax.numerator.bit_length() - ax.denominator.bit_length()  # 2**p <= ax < 2**(p + 2)
    p = p + 1 if Fraction(2) ** (p + 1) <= ax else p
    quantum = Fraction(2) ** (max(p, fmt.emin) - fmt.mantissa_bits)
    n, rest = divmod(ax, quantum)
    n += rest > quantum / 2 or (rest == quantum / 2 and n % 2 == 1)
    r = n * quantum
    r = math.inf if r > Fraction(float(fmt.finfo.max)) else float(r)
    return math.copysign(r, v)


def double_rounding_traps(fmt: FloatFormat) -> list[float]:
    """Float64 values that float32 rounds onto a tie of ``fmt`` (or off one), both signs:
    ties of normal and subnormal numbers and the overflow threshold, each times
    ``1 +- 2**-30`` and ``1 +- 2**-40`` (below float32's half ulp), and the exact ties."""
    m, emin, emax = fmt.mantissa_bits, fmt.emin, fmt.emax
    ties = [math.ldexp(k + 0.5, emin - m) for k in range(4)]  # subnormal ties, at 0 too
    ties += [math.ldexp(1 + (k + 0.5) * 2.0**-m, p) for k in range(4) for p in (emin, 0, 3)]
    ties += [math.ldexp(2 - 2.0 ** -(m + 1), emax)]  # overflow threshold
    values = [
        t * (1 + d) for t in ties for d in (0.0, 2.0**-30, -(2.0**-30), 2.0**-40, -(2.0**-40))
    ]
    return values + [-v for v in values]


def test_round_python_float_once_float16():
    fmt = FloatFormat(5, 10)
    assert (
        float(fmt.round(1 + 2**-11 + 2**-40))
        == 1.0009765625
        == float(np.float16(1 + 2**-11 + 2**-40))
    )
    values = double_rounding_traps(fmt)
    with np.errstate(over="ignore"):  # numpy rounds float64 to float16 once, exactly
        want = np.array(values, np.float64).astype(np.float16).astype(np.float32)
    assert_same_floats(jnp.stack([fmt.round(v) for v in values]), want, values)
    assert_same_floats(fmt.round(values), want, values)  # a list of Python floats
    assert_same_floats(fmt.round(np.float64(values[7])), want[7])
    assert (np.asarray(fmt.to_bits(values)) == want.astype(np.float16).view(np.uint16)).all()


@pytest.mark.parametrize(
    "fmt", [FloatFormat(8, 7), cbfloat16, FloatFormat(4, 3)], ids=lambda fmt: fmt.name
)
def test_round_python_float_once_exact_reference(fmt):
    # ml_dtypes converts float64 to bfloat16 through float32 (twice rounded): the reference
    # here is exact rational arithmetic; the float16 test above checks it against numpy.
    values = double_rounding_traps(fmt)
    want = np.array([fraction_round(fmt, v) for v in values], np.float32)
    assert_same_floats(fmt.round(values), want, values)
    assert_same_floats(jnp.stack([fmt.round(v) for v in values]), want, values)
    f16 = FloatFormat(5, 10)
    with np.errstate(over="ignore"):
        assert [fraction_round(f16, v) for v in double_rounding_traps(f16)] == [
            float(np.float16(v)) for v in double_rounding_traps(f16)
        ]


def test_round_python_float_specials_and_jit():
    for v in (0.0, -0.0, math.inf, -math.inf, 1e300, -1e300, 1e-320, -1e-320):
        got = np.asarray(cbfloat16.round(v))
        assert got.dtype == np.float32 and got.shape == ()
        assert got == fraction_round(cbfloat16, v) and np.signbit(got) == np.signbit(v)
    assert np.isnan(cbfloat16.round(math.nan))
    trap = 1 + 2**-10 + 2**-40  # a cbfloat16 tie in float32, above it in float64
    assert float(jax.jit(lambda: cbfloat16.round(trap))()) == 1 + 2**-9
    assert int(cbfloat16.to_bits(trap)) == 0x3E01
    # float64 arrays are still rejected (under jit they could not be rounded on the host).
    with pytest.raises(TypeError, match="round expects float32 values, got float64"):
        cbfloat16.round(np.array([trap]))
