"""NVFP4 quantization, its decoding and the random Hadamard transform, held bit for bit to an
independent numpy reference (``tests/nvfp4_reference.py``, written from the formulas of
/work/shared/reference/nvfp4-training.md sections 1, 2, 4 and 5, never from jdls code).

Arithmetic of both: IEEE float32, round to nearest even, FTZ/DAZ (what XLA:CPU does). Compared
bit for bit: the E2M1 element bytes, the E4M3 scale bytes, the tensor amax and decode scale,
and the dequantized float32 values (NaN compared as NaN). What the data aims at:

- log-normal values over about 30 binades, with zero blocks, blocks of -0, grid-exact blocks;
- an all-zero tensor, subnormal inputs (flushed), products that come out subnormal (flushed);
- blocks whose E4M3 scale is subnormal or 0 (block amax / tensor amax below 2**-6/448, 2**-10/448);
- a given ``amax`` above and below the true one (the scale saturates at 448, and the unclamped
  scale exceeds 464, where an E4M3 cast without the clamp gives NaN);
- inf and NaN elements (the block's scale byte is 0x7F, it decodes to NaN, other blocks are
  unchanged, the tensor amax is over the finite values);
- block amaxes aimed at E4M3 rounding midpoints, where the order of the scale arithmetic
  (``amax_b * fp32(S_enc * fp32(1/6))``, not ``amax_b / 6 * S_enc``) decides the byte; the test
  shows that the other order gives other bytes on those blocks;
- stochastic rounding with given bits, including bits whose u equals the rounding fraction
  exactly (u < frac rounds up, u == frac does not), and unbiasedness over many draws;
- the Hadamard transform against the in-order butterfly, and its orthogonality;
- float16 inputs (their subnormals are normal float32 values: not flushed), other ranks and
  block shapes, and the transpose consistency of 16x16 tiles.

Each comparison would fail on a known wrong variant: the other scale order (midpoint blocks),
no FTZ (subnormal cases, Hadamard tiles of subnormals), u <= frac or the low 24 bits as u
(boundary bits), no clamp before the E4M3 cast (given amax), the amax over non-finite values,
S_enc = FLT_MAX at amax 0 (TE's Python references), e_b = S_enc / s_b, q * (s_b * S_dec),
another butterfly stage order, -0 in a non-finite block.

The quick run compares about 1e5 values per data set (1.1M in all), jitted; the full suite
adds the eager cases, drawn shapes, and a million blocks (16.8M values each for 1x16 and
16x16, and a million blocks aimed at E4M3 midpoints).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import nvfp4_reference as R
import pytest
from _helpers import maybe_jit, with_and_without_jit
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jdls import fp8

DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16}
BLOCKS = {"1x16": (1, 16), "16x16": (16, 16)}
#: How many standard errors a Monte Carlo mean may lie from its expectation. With the
#: fixed seeds below the largest observed deviation is well inside; 5 SE is a two-sided
#: probability of 5.7e-7 per element under the normal approximation.
K_SE = 5.0

#: bfloat16 inputs in the full suite (read exactly as float32, they change no arithmetic).
dtypes = pytest.mark.parametrize(
    "dtype",
    [pytest.param(n, marks=[pytest.mark.full] if n != "float32" else []) for n in DTYPES],
    ids=list(DTYPES),
)
blocks = pytest.mark.parametrize("block", list(BLOCKS), ids=list(BLOCKS))


# ------------------------------------------------------------------------------------------
# Data.
# ------------------------------------------------------------------------------------------


def lognormal(rng: np.random.Generator, shape, binades: float = 30.0) -> np.ndarray:
    """Signed values whose log2 magnitude is normal with +-3 sigma = ``binades`` / 2."""
    e = rng.normal(0.0, binades / 6, shape)
    return (np.exp2(e) * rng.choice([-1.0, 1.0], shape)).astype(np.float32)


def mixed(rng: np.random.Generator, shape) -> np.ndarray:
    """Log-normal values with zero 1x16 runs, a zero 16x16 tile, runs of -0, runs of
    grid-exact values (E2M1 grid values times a power of two, the run's max 6 times it), and a
    sixth of the 16x16 tiles scaled down by 2**-5 .. 2**-30."""
    x = lognormal(rng, shape)
    rows, cols = shape
    for _ in range(max(1, rows * cols // 2000)):
        r, c = rng.integers(rows), rng.integers(max(1, cols // 16)) * 16
        kind = rng.integers(3)
        seg = x[r, c : c + 16]
        if kind == 0:
            seg[:] = 0.0
        elif kind == 1:
            seg[:] = -0.0
        else:
            g = rng.choice(R.E2M1_GRID, seg.shape) * rng.choice([-1, 1], seg.shape)
            g[0] = 6.0
            seg[:] = (g * np.exp2(rng.integers(-20, 20))).astype(np.float32)
    tiles = [(i, j) for i in range(rows // 16) for j in range(cols // 16)]
    for k in rng.permutation(len(tiles))[: max(1, len(tiles) // 6)]:
        i, j = tiles[k]  # tiles shrunk by 2**-5 .. 2**-30: small and zero E4M3 scales
        x[16 * i : 16 * i + 16, 16 * j : 16 * j + 16] *= np.float32(np.exp2(-rng.uniform(5, 30)))
    x[16:32, 16:32] = 0.0
    return x


# ------------------------------------------------------------------------------------------
# jdls under test, and the comparison.
# ------------------------------------------------------------------------------------------


@functools.cache
def _quantizer(block_shape: tuple[int, ...], jit: bool):
    """x, bits, amax -> (values, codes, amax, decode, dequantized), one compiled function per
    block shape (jax.jit caches the traces per argument shape)."""

    def run(x, bits, amax):
        q = fp8.quantize_nvfp4(x, block_shape, bits=bits, amax=amax)
        return q.values, q.codes, q.amax, q.decode, fp8.dequantize_nvfp4(q)

    return maybe_jit(run, jit)


def _mismatch(name: str, got: np.ndarray, want: np.ndarray, x=None, per=None) -> str:
    bad = np.argwhere(got != want)
    lines = [f"{name}: {len(bad)} of {want.size} differ"]
    for idx in bad[:5]:
        idx = tuple(int(i) for i in idx)
        extra = ""
        if x is not None:
            extra = f" x={np.float32(x[idx])!r}"
        if per is not None:
            extra += f" {per(idx)}"
        lines.append(f"  at {idx}: got {got[idx]:#x} want {want[idx]:#x}{extra}")
    return "\n".join(lines)


def assert_matches_reference(x, block_shape, jit, *, bits=None, amax=None):
    """jdls's quantize and dequantize of ``x`` equal the reference's bit for bit; returns the
    reference result."""
    block_shape = tuple(block_shape)
    ref = R.quantize(x, block_shape, bits=bits, amax=amax)
    ref_deq = R.dequantize(ref)
    jamax = None if amax is None else jnp.float32(amax)
    out = _quantizer(block_shape, jit)(x, bits, jamax)
    values, codes, got_amax, decode, deq = (np.asarray(a) for a in jax.device_get(out))

    assert values.dtype == ml_dtypes.float4_e2m1fn and values.shape == np.shape(x), (
        values.dtype,
        values.shape,
    )
    assert codes.dtype == np.uint8 and codes.shape == ref.codes.shape, (codes.dtype, codes.shape)
    assert got_amax.dtype == np.float32 and got_amax.shape == (), (got_amax.dtype, got_amax.shape)
    assert decode.dtype == np.float32 and decode.shape == (), (decode.dtype, decode.shape)
    assert deq.dtype == np.float32 and deq.shape == np.shape(x), (deq.dtype, deq.shape)

    x32 = np.asarray(x).astype(np.float32)

    def block_of(idx):
        b = tuple(i // s for i, s in zip(idx, block_shape, strict=True))
        return (
            f"block {b} code {ref.codes[b]:#x} S_dec_b={ref.block_scale[b]!r} "
            f"e_b={ref.encode[b]!r} y={ref.scaled[idx]!r}"
        )

    errors = []
    if got_amax.view(np.uint32) != np.float32(ref.amax).view(np.uint32):
        errors.append(f"amax: got {got_amax!r} want {ref.amax!r}")
    if decode.view(np.uint32) != np.float32(ref.decode).view(np.uint32):
        errors.append(f"decode: got {decode!r} want {ref.decode!r}")
    if not np.array_equal(codes, ref.codes):
        errors.append(
            _mismatch(
                "codes",
                codes,
                ref.codes,
                per=lambda b: f"S_dec_b={ref.block_scale[b]!r} amax={ref.amax!r}",
            )
        )
    if not np.array_equal(values.view(np.uint8), ref.value_bytes):
        errors.append(_mismatch("values", values.view(np.uint8), ref.value_bytes, x32, block_of))
    got_bits = np.where(np.isnan(deq), np.uint32(0x7FC00000), deq.view(np.uint32))
    want_bits = np.where(np.isnan(ref_deq), np.uint32(0x7FC00000), ref_deq.view(np.uint32))
    if not np.array_equal(got_bits, want_bits):
        errors.append(_mismatch("dequantized", got_bits, want_bits, x32, block_of))
    assert not errors, "\n".join(errors)
    return ref


# ------------------------------------------------------------------------------------------
# 1. Self-checks of the reference.
# ------------------------------------------------------------------------------------------


def _around(points, ulps: int = 3) -> np.ndarray:
    """``points`` (positive float32) and their neighbours up to ``ulps`` ulps, both signs."""
    p = np.asarray(points, dtype=np.float32)
    p = p[p > 0]
    near = np.concatenate([R.next_f32(p, k) for k in range(-ulps, ulps + 1)])
    near = near[np.isfinite(near)]
    return np.concatenate([near, -near, [0.0, -0.0]]).astype(np.float32)


def test_reference_e2m1_rne_matches_ml_dtypes_on_every_tie():
    ties = {0.25: 0.0, 0.75: 1.0, 1.25: 1.0, 1.75: 2.0, 2.5: 2.0, 3.5: 4.0, 5.0: 4.0}
    got = R.e2m1_rne(np.float32(list(ties)))
    np.testing.assert_array_equal(got, np.float32(list(ties.values())))
    g = R.E2M1_GRID.astype(np.float64)
    points = np.concatenate([g, (g[:-1] + g[1:]) / 2, [6.5, 7.0, 100.0, 2.0**-20]])
    rng = np.random.default_rng(0)
    y = np.concatenate(
        [
            _around(points),
            rng.uniform(-8, 8, 10**5).astype(np.float32),
            np.float32([np.inf, -np.inf, 1e-40, -1e-40, np.finfo(np.float32).max]),
        ]
    )
    mine = R.e2m1_rne(y)
    theirs = np.clip(y, -6, 6).astype(ml_dtypes.float4_e2m1fn).astype(np.float32)
    np.testing.assert_array_equal(mine.view(np.uint32), theirs.view(np.uint32))  # signed zeros
    assert np.all(np.abs(mine) <= 6) and np.all(np.isin(np.abs(mine), R.E2M1_GRID))


def test_reference_e4m3_clamp_then_cast():
    v = np.concatenate([R.e4m3_values(), R.e4m3_midpoints()])
    v = _around(v)
    v = np.concatenate([v[v > 0], np.float32([0, 449, 463.99, 464, 470, 1e6, 3e38, np.inf])])
    np.testing.assert_array_equal(R.e4m3_code(v), R.e4m3_rne_independent(v))
    assert np.all(R.e4m3_code(np.float32([448, 460, 464, 470, 1e6, np.inf])) == 0x7E)
    # the trap the clamp avoids: ml_dtypes' cast alone turns anything above 464 into NaN (464
    # itself is a tie and goes to 448)
    above = np.float32([R.next_f32(np.float32(464), 1), 470.0, 1e6, np.inf])
    assert np.all(above.astype(ml_dtypes.float8_e4m3fn).view(np.uint8) & 0x7F == 0x7F)
    # every midpoint is a tie: it goes to the even code
    m = R.e4m3_midpoints().astype(np.float32)
    assert np.all(R.e4m3_code(m) % 2 == 0)
    # the subnormal E4M3 range: 2**-9 steps, 2**-10 rounds to 0, 3 * 2**-10 to 2 * 2**-9
    np.testing.assert_array_equal(
        R.e4m3_code(np.float32([2.0**-10, 3 * 2.0**-10, 2.0**-9, 7 * 2.0**-9])), [0, 2, 1, 7]
    )


def test_reference_stochastic_rounding_is_unbiased():
    """71 values (grid points, ties, random) x 50,000 uniform 24-bit draws: each mean lies within
    K_SE = 5 standard errors of y (SE from the exact Bernoulli variance); grid points and 0 are
    reproduced on every draw."""
    rng = np.random.default_rng(1)
    g = R.E2M1_GRID
    y = np.concatenate(
        [g, -g, (g[:-1] + g[1:]) / 2, rng.uniform(-6, 6, 48), [2.0**-20, 6.0 - 2.0**-21]]
    ).astype(np.float32)
    y = y[:71]
    draws = 50_000
    bits = rng.integers(0, 2**32, (draws, y.size), dtype=np.uint32)
    q = R.e2m1_sr(np.broadcast_to(y, bits.shape), bits).astype(np.float64)
    a = np.abs(y).astype(np.float64)
    step = np.where(a < 2, 0.5, np.where(a < 4, 1.0, 2.0))
    frac = (a - np.floor(a / step) * step) / step
    se = step * np.sqrt(frac * (1 - frac) / draws)
    dev = np.abs(q.mean(axis=0) - y)
    on_grid = frac == 0
    assert np.all(q[:, on_grid] == y[on_grid])
    assert np.all(dev[~on_grid] <= K_SE * se[~on_grid]), np.max(dev[~on_grid] / se[~on_grid])
    assert np.all(np.isin(np.abs(q), g))
    # the ends of u: u = 0 rounds every off-grid value up, u = 1 - 2**-24 none
    up0 = R.e2m1_sr(y, np.zeros(y.shape, np.uint32))
    top = R.e2m1_sr(y, np.full(y.shape, 0xFFFFFFFF, np.uint32))
    np.testing.assert_array_equal(np.abs(up0)[~on_grid], (a - frac * step + step)[~on_grid])
    np.testing.assert_array_equal(np.abs(top)[~on_grid], (a - frac * step)[~on_grid])
    # u == frac does not round up, u one step below does; the low 8 bits are not used
    half = np.float32([1.25, -2.5, 5.0])  # frac 0.5
    at = np.full(3, (1 << 23) << 8 | 0xFF, np.uint32)
    below = np.full(3, ((1 << 23) - 1) << 8, np.uint32)
    np.testing.assert_array_equal(R.e2m1_sr(half, at), np.float32([1.0, -2.0, 4.0]))
    np.testing.assert_array_equal(R.e2m1_sr(half, below), np.float32([1.5, -3.0, 6.0]))
    # signed zeros stay signed, values above 6 clamp
    np.testing.assert_array_equal(
        R.e2m1_sr(np.float32([-0.0, 0.0, -7.0]), np.zeros(3, np.uint32)).view(np.uint32),
        np.float32([-0.0, 0.0, -6.0]).view(np.uint32),
    )


def test_reference_scale_order_matters_at_e4m3_midpoints():
    """On blocks aimed at E4M3 midpoints the other order, fp32(amax_b / 6) * S_enc, gives
    other scale bytes, so a bit-for-bit test on such blocks tells the orders apart (on random
    data it almost never does)."""
    total, differ, ties = 0, 0, 0
    for tensor_amax in np.float32([1.0, 3.0, 7.25, 2688.0, 1e-3]):
        am, aims = R.midpoint_amaxes(tensor_amax)
        x = np.concatenate([[tensor_amax], am]).astype(np.float32)[:, None]
        x = np.pad(x, [(0, 0), (0, 15)])
        kernel = R.quantize(x, amax=None)
        other = R.quantize(x, order="div6")
        assert kernel.amax == tensor_amax
        total += am.size
        differ += int(np.sum(kernel.codes != other.codes))
        ties += int(np.sum(kernel.block_scale[1:, 0] == aims))
    assert total > 1500 and ties > 200, (total, ties)
    assert differ > 20, differ


def test_reference_round_trip_error_bound():
    """|x - dequantize(quantize(x))| <= max(half grid step at |y|, |y| - 6) * s_b * S_dec, on
    elements whose decoded products are normal floats (doc section 2.4), with zero-scale
    blocks excluded (they decode to 0)."""
    rng = np.random.default_rng(2)
    for block in BLOCKS.values():
        x = lognormal(rng, (256, 256))
        q = R.quantize(x, block)
        d = R.dequantize(q).astype(np.float64)
        s_b = R._per_element(R.e4m3_value(q.codes), x.shape, block).astype(np.float64)
        ok = s_b > 0
        with np.errstate(divide="ignore", invalid="ignore"):
            y = np.abs(x.astype(np.float64) / (s_b * float(q.decode)))
            step = np.where(y < 2, 0.5, np.where(y < 4, 1.0, 2.0))
            bound = np.maximum(step / 2, y - 6) * s_b * float(q.decode)
        err = np.abs(x - d)
        assert np.all(err[ok] <= bound[ok] * (1 + 2.0**-20)), np.max((err / bound)[ok])
        assert np.all(d[~ok] == 0)


def test_reference_hadamard():
    """The butterfly equals (v * s) @ H16 / 4 (float64) to float32 rounding, exactly on small
    integers; M = diag(s) H / 4 is orthogonal; another stage order rounds differently."""
    h = R.hadamard_matrix()
    np.testing.assert_array_equal(h @ h.T, 16 * np.eye(16))
    m = np.diag(R.TE_SIGNS.astype(np.float64)) @ h / 4
    np.testing.assert_array_equal(m @ m.T, np.eye(16))
    rng = np.random.default_rng(3)
    ints = rng.integers(-1000, 1000, (64, 32)).astype(np.float32)
    np.testing.assert_array_equal(
        R.hadamard(ints), (ints.reshape(64, 2, 16).astype(np.float64) @ m).reshape(64, 32)
    )
    x = rng.standard_normal((512, 48)).astype(np.float32)
    exact = (x.reshape(512, 3, 16).astype(np.float64) @ m).reshape(512, 48)
    np.testing.assert_allclose(R.hadamard(x), exact, rtol=0, atol=4 * 2.0**-24 * np.abs(x).max())
    reordered = R.hadamard(x, order=(8, 4, 2, 1))
    assert np.sum(reordered != R.hadamard(x)) > 100
    # axis and padding: a length-40 axis 0 becomes 48 long, the padding transforms as zeros
    y = R.hadamard(x[:40], axis=0)
    assert y.shape == (48, 48)
    np.testing.assert_array_equal(y, R.hadamard(np.pad(x[:40], [(0, 8), (0, 0)]).T).T)


# ------------------------------------------------------------------------------------------
# 2. jdls against the reference, bit for bit.
# ------------------------------------------------------------------------------------------


@with_and_without_jit
@blocks
@dtypes
def test_lognormal_bit_for_bit(jit, block, dtype):
    """98,000 log-normal values over about 30 binades, with zero, -0 and grid-exact runs; both
    axes padded for 16x16 blocks."""
    rng = np.random.default_rng(10)
    x = mixed(rng, (250, 392)).astype(DTYPES[dtype])
    ref = assert_matches_reference(x, BLOCKS[block], jit)
    nonzero = ref.block_scale > 0
    codes = ref.codes
    # the data reach every kind of scale: zero (flushed), subnormal, normal, 448
    assert np.sum((codes == 0) & nonzero) > 10, "no zero-scale blocks"
    assert np.sum((codes > 0) & (codes < 8)) > 10, "no subnormal-scale blocks"
    assert np.any(codes == 0x7E)


@with_and_without_jit
def test_zero_blocks_and_all_zero_tensor(jit):
    x = np.zeros((32, 48), np.float32)
    ref = assert_matches_reference(x, (1, 16), jit)
    assert ref.amax == 0 and ref.decode == 1 and np.all(ref.codes == 0)
    x[:, 16:32] = -0.0
    ref = assert_matches_reference(x, (16, 16), jit)
    assert np.all(ref.value_bytes[:, 16:32] == 0x8)  # -0 stays -0
    x = lognormal(np.random.default_rng(11), (32, 48))
    x[3] = 0.0
    x[16:32, 32:48] = -0.0
    for block in BLOCKS.values():
        assert_matches_reference(x, block, jit)


@with_and_without_jit
@dtypes
def test_subnormal_inputs_and_results(jit, dtype):
    """Subnormal inputs read as zero (all-subnormal blocks and an all-subnormal tensor, which
    has amax 0); products that come out subnormal are flushed: x * e_b in a tensor of huge
    amax, S_dec = 1 / S_enc and the decoded values in a tensor of tiny amax."""
    rng = np.random.default_rng(12)
    sub = np.float32([1e-40, -1e-40, 2.0**-149, -(2.0**-130), 1e-39, 5e-41])
    if dtype == "bfloat16":
        sub = np.float32([2.0**-130, -(2.0**-127), 2.0**-133, -(2.0**-128), 2.0**-126 * 0.5, 0])
    cases = []
    x = lognormal(rng, (32, 64))
    x[0, :16] = rng.choice(sub, 16)  # an all-subnormal block
    x[1::3, 1::5] = rng.choice(sub, x[1::3, 1::5].shape)
    cases.append(x)
    cases.append(rng.choice(sub, (32, 64)).astype(np.float32))  # amax 0 after DAZ
    big = lognormal(rng, (32, 64), binades=10) * np.float32(1e-10)
    big[5, 7] = 1e30  # x * e_b subnormal in that block
    cases.append(big)
    for scale in (1e-33, 2e-35, 1e-37):  # S_dec near / below the normal range, S_enc overflow
        tiny = lognormal(rng, (32, 64), binades=6) * np.float32(scale)
        cases.append(tiny)
    for c in cases:
        for block in BLOCKS.values():
            assert_matches_reference(c.astype(DTYPES[dtype]), block, jit)


@with_and_without_jit
@blocks
def test_subnormal_and_zero_block_scales(jit, block):
    """Blocks whose amax is 2**-1 .. 2**-24 of the tensor amax: their E4M3 scale goes
    subnormal below 2**-6 / 448 and 0 below 2**-10 / 448 (the block then decodes to 0)."""
    rng = np.random.default_rng(13)
    b0, b1 = BLOCKS[block]
    x = lognormal(rng, (4 * b0, 64 * 16), binades=4)
    counts = (4, 64)
    ratio = np.exp2(-rng.uniform(0, 24, counts)).astype(np.float32)
    ratio[0, 0] = 1.0
    scale = R._per_element(ratio, x.shape, (b0, b1))
    x = (x / np.abs(x).max() * scale).astype(np.float32)
    x[0, 0] = 1.0  # the tensor amax
    ref = assert_matches_reference(x, (b0, b1), jit)
    r = ref.block_scale / 448
    assert np.sum((ref.codes == 0) & (r > 0)) >= 10
    assert np.sum((ref.codes > 0) & (ref.codes < 8)) >= 5
    d = R.dequantize(ref)
    assert np.all(d[R._per_element(ref.codes == 0, x.shape, (b0, b1))] == 0)


@with_and_without_jit
@blocks
def test_given_amax(jit, block):
    """amax given larger (scales shrink), smaller (scales saturate at 448, elements at 6; the
    unclamped scale exceeds 464, where a cast without the clamp gives NaN), 0 and
    subnormal (S_enc = 1), FLT_MAX, a tiny normal (2688 / A overflows: S_enc = FLT_MAX and
    S_dec = 1 / FLT_MAX flushes to 0), and inf (S_enc = 0, so 1)."""
    rng = np.random.default_rng(14)
    x = lognormal(rng, (64, 96), binades=12)
    true = np.float32(np.abs(x).max())
    saturated = 0
    for amax in (true * 4, true / 4, true / 1000, 0.0, 1e-40, np.finfo(np.float32).max, 1e-37):
        ref = assert_matches_reference(x, BLOCKS[block], jit, amax=np.float32(amax))
        if amax == true / 4:
            assert np.sum(ref.block_scale > 464) > 0 and np.any(ref.codes == 0x7E)
            saturated += int(np.sum(np.abs(ref.scaled) > 6))
    assert saturated > 0
    ref = assert_matches_reference(x, BLOCKS[block], jit, amax=np.float32(np.inf))
    assert ref.decode == 1


@with_and_without_jit
@dtypes
@blocks
def test_nonfinite_blocks(jit, dtype, block):
    """A block holding inf, -inf or NaN gets scale byte 0x7F and decodes to NaN; the other
    blocks are what they are with those elements replaced by 0; the tensor amax is over the
    finite values (also the largest one, which here shares a block with a NaN)."""
    rng = np.random.default_rng(15)
    b = BLOCKS[block]
    x = lognormal(rng, (48, 80), binades=16)
    x[20, 41] = np.float32(np.abs(x).max() * 2)
    special = {(3, 5): np.inf, (17, 70): -np.inf, (20, 40): np.nan, (47, 79): np.nan}
    for idx, v in special.items():
        x[idx] = v
    x = x.astype(DTYPES[dtype])
    ref = assert_matches_reference(x, b, jit)
    assert ref.amax == np.float32(np.abs(x.astype(np.float32)[20, 41]))
    bad_blocks = {(i // b[0], j // b[1]) for i, j in special}
    assert np.all(ref.codes[tuple(np.array(sorted(bad_blocks)).T)] == 0x7F)
    assert np.sum(ref.codes == 0x7F) == len(bad_blocks)
    cleaned = x.copy()
    for idx in special:
        cleaned[idx] = 0
    clean = R.quantize(cleaned, b)
    good = ref.codes != 0x7F
    np.testing.assert_array_equal(ref.codes[good], clean.codes[good])
    assert clean.amax == ref.amax
    # all non-finite: amax 0
    nan = np.full((16, 32), np.nan, np.float32)
    nan[0, 0] = np.inf
    ref = assert_matches_reference(nan.astype(DTYPES[dtype]), b, jit)
    assert ref.amax == 0 and np.all(ref.codes == 0x7F)


RANKS = {
    "1d-16": ((100,), (16,)),
    "3d-1x1x16": ((3, 20, 40), (1, 1, 16)),
    "3d-1x16x16": ((3, 20, 40), (1, 16, 16)),
    "16x1": ((40, 24), (16, 1)),
    "4x8": ((30, 50), (4, 8)),
}


@pytest.mark.parametrize("case", list(RANKS))
def test_other_ranks_and_block_shapes(case):
    """Other ranks and block shapes (padding on every axis), jitted."""
    shape, block = RANKS[case]
    x = lognormal(np.random.default_rng(22), shape, binades=20)
    x.reshape(-1)[::37] = 0.0
    assert_matches_reference(x, block, True)


@with_and_without_jit
def test_float16_inputs(jit):
    """float16 widens exactly to float32, so its subnormals (6e-8 .. 6e-5) are normal float32
    values and must not be flushed."""
    rng = np.random.default_rng(23)
    x = (lognormal(rng, (64, 64), binades=6) * np.float32(2.0**-16)).astype(np.float16)
    x[0, :16] = np.float16(2.0**-24) * np.arange(1, 17, dtype=np.float16)  # float16 subnormals
    ref = assert_matches_reference(x, (1, 16), jit)
    assert ref.codes[0, 0] >= 8 and np.all(R.dequantize(ref)[0, 8:16] != 0)
    assert np.sum(np.abs(x.astype(np.float32)) < np.float32(2.0**-14)) > 1000


@with_and_without_jit
def test_tiles_are_transpose_consistent(jit):
    """16x16 tiles quantize W and W.T to the same values (the point of 2D weight scaling), and
    16x1 blocks of x are 1x16 blocks of x.T; bit for bit, through jdls."""
    rng = np.random.default_rng(24)
    w = mixed(rng, (48, 80))
    fwd = np.asarray(_quantizer((16, 16), jit)(w, None, None)[4])
    bwd = np.asarray(_quantizer((16, 16), jit)(np.ascontiguousarray(w.T), None, None)[4])
    np.testing.assert_array_equal(fwd.T.view(np.uint32), bwd.view(np.uint32))
    cols = _quantizer((16, 1), jit)(w, None, None)
    rows = _quantizer((1, 16), jit)(np.ascontiguousarray(w.T), None, None)
    np.testing.assert_array_equal(np.asarray(cols[1]).T, np.asarray(rows[1]))
    np.testing.assert_array_equal(
        np.asarray(cols[0]).view(np.uint8).T, np.asarray(rows[0]).view(np.uint8)
    )


def midpoint_tensor(rng, tensor_amax, block_shape, counts):
    """A tensor of ``counts`` blocks whose amaxes are aimed at E4M3 midpoints (the reference's
    ``midpoint_amaxes``), cycled to fill; block (0, 0) holds ``tensor_amax``. Each block's
    other elements are uniform below its amax."""
    am, _ = R.midpoint_amaxes(tensor_amax)
    n = counts[0] * counts[1]
    per_block = np.resize(rng.permutation(am), n).reshape(counts).astype(np.float32)
    per_block[0, 0] = tensor_amax
    shape = (counts[0] * block_shape[0], counts[1] * block_shape[1])
    u = rng.uniform(-0.99, 0.99, shape).astype(np.float32)
    x = (u * R._per_element(per_block, shape, block_shape)).astype(np.float32)
    sign = rng.choice(np.float32([-1, 1]), counts)
    x[:: block_shape[0], :: block_shape[1]] = per_block * sign
    return x


MIDPOINT_AMAXES = np.float32([1.0, 3.0, 7.25, 448.0, 2688.0, 1e-3, 0.1, 1e4, 2.0**-40, 6e9])


@with_and_without_jit
@blocks
def test_e4m3_midpoint_blocks(jit, block):
    """Block amaxes aimed at E4M3 rounding midpoints, for 10 tensor amaxes: 5,120 blocks
    (1x16) or 1,280 tiles (16x16) (82,000 values for 1x16, 330,000 for 16x16). The other order (amax_b / 6 * S_enc) gives other bytes on some of them, so the
    codes comparison would catch it."""
    rng = np.random.default_rng(16)
    b = BLOCKS[block]
    counts = (32, 16) if b == (1, 16) else (2, 64)
    differ = 0
    for a in MIDPOINT_AMAXES:
        x = midpoint_tensor(rng, a, b, counts)
        ref = assert_matches_reference(x, b, jit)
        assert ref.amax == a
        differ += int(np.sum(R.quantize(x, b, order="div6").codes != ref.codes))
    assert differ >= 20, differ


# ------------------------------------------------------------------------------------------
# 3. Stochastic rounding.
# ------------------------------------------------------------------------------------------


def boundary_bits(rng, ref_scaled) -> tuple[np.ndarray, int]:
    """Random bits, except where the rounding fraction of y is a multiple of 2**-24: there
    u == frac (must not round up) or u == frac - 2**-24 (must round up), with random low 8
    bits. Returns the bits and how many elements got u == frac with frac > 0."""
    a = np.minimum(np.abs(ref_scaled.astype(np.float64)), 6.0)
    step = np.where(a < 2, 0.5, np.where(a < 4, 1.0, 2.0))
    frac = (a - np.floor(a / step) * step) / step
    k = frac * 2.0**24
    exact = (k == np.floor(k)) & (k >= 1)
    bits = rng.integers(0, 2**32, a.shape, dtype=np.uint32)
    low = rng.integers(0, 256, a.shape).astype(np.uint32)
    at = exact & (rng.random(a.shape) < 0.5)
    below = exact & ~at
    ki = np.where(exact, k, 1).astype(np.uint32)
    bits = np.where(at, (ki << np.uint32(8)) | low, bits)
    bits = np.where(below, ((ki - np.uint32(1)) << np.uint32(8)) | low, bits)
    return bits.astype(np.uint32), int(np.sum(at))


@with_and_without_jit
@blocks
@dtypes
def test_stochastic_rounding_bit_for_bit(jit, block, dtype):
    """The same bits give the same bytes: random words, and words that put u exactly on the
    rounding fraction (u < frac rounds up; u <= frac would differ on those) or one step
    below; the low 8 bits of each word are random and must not matter."""
    rng = np.random.default_rng(17)
    b = BLOCKS[block]
    x = mixed(rng, (96, 200))
    x[7, 9], x[40, 100] = np.inf, np.nan  # non-finite blocks: 0 whatever the bits
    x = x.astype(DTYPES[dtype])
    plain = R.quantize(x, b)
    bits, at = boundary_bits(rng, plain.scaled)
    assert at > 300, at
    ref = assert_matches_reference(x, b, jit, bits=bits)
    # u <= frac would round those up: the comparison above tells them apart
    a = np.minimum(np.abs(plain.scaled), 6)
    step = np.where(a < 2, 0.5, np.where(a < 4, 1.0, 2.0))
    loose = R.e2m1_sr(plain.scaled, bits - np.uint32(1 << 8) * (bits >= (1 << 8)))
    assert np.sum(loose != ref.values.astype(np.float32)) > 100
    assert np.all(np.abs(ref.values.astype(np.float32) - np.clip(plain.scaled, -6, 6)) < step)
    # random bits alone, and with a given amax 4 times too small (clipped elements stay at 6)
    random_bits = rng.integers(0, 2**32, x.shape, dtype=np.uint32)
    assert_matches_reference(x, b, jit, bits=random_bits)
    small = np.float32(ref.amax / 4)
    clipped = assert_matches_reference(x, b, jit, bits=random_bits, amax=small)
    assert np.sum(np.abs(clipped.scaled) > 6) > 100


@with_and_without_jit
def test_stochastic_rounding_is_unbiased(jit):
    """4 blocks of 16 (block amaxes over 5 decades) x 4,096 independent draws: the mean of
    dequantize(quantize(x, bits)) lies within K_SE = 5 standard errors of x for every element
    whose scaled magnitude is at most 6 (SE from the exact Bernoulli variance of the
    reference's y), plus 2**-21 |x| for the float32 rounding of the scales; elements on the
    grid come back the same on every draw. Rounding goes both ways (SR is not a no-op)."""
    rng = np.random.default_rng(18)
    x = rng.uniform(-1, 1, (4, 16)).astype(np.float32)
    x *= np.float32([[1.0], [1e-2], [1e-4], [3e-5]])
    x[1, 3] = 0.0
    draws = 4096
    tiled = np.tile(x, (draws, 1))
    bits = rng.integers(0, 2**32, tiled.shape, dtype=np.uint32)
    out = _quantizer((1, 16), jit)(tiled, bits, None)
    vals, deq = np.asarray(out[0]).astype(np.float32), np.asarray(out[4]).astype(np.float64)
    vals = vals.reshape(draws, 4, 16)
    deq = deq.reshape(draws, 4, 16)
    ref = R.quantize(x)
    scale = R._per_element(R.e4m3_value(ref.codes), x.shape, (1, 16)).astype(np.float64)
    scale *= float(ref.decode)
    y = ref.scaled.astype(np.float64)
    a = np.abs(y)
    step = np.where(a < 2, 0.5, np.where(a < 4, 1.0, 2.0))
    frac = (a - np.floor(a / step) * step) / step
    unclipped = a <= 6
    assert np.sum(unclipped) >= 60
    se = step * np.sqrt(frac * (1 - frac) / draws) * scale
    dev = np.abs(deq.mean(axis=0) - x)
    tol = K_SE * se + 2.0**-21 * np.abs(x)
    assert np.all(dev[unclipped] <= tol[unclipped]), np.max(
        (dev / np.maximum(se, 1e-300))[unclipped]
    )
    on_grid = unclipped & (frac == 0)
    assert np.all(vals[:, on_grid] == y[on_grid])
    off = unclipped & (frac > 0)
    ups = np.abs(vals) > np.floor(a / step) * step
    assert np.all(ups[:, off].any(axis=0)) and np.all((~ups[:, off]).any(axis=0))


# ------------------------------------------------------------------------------------------
# 4. The Hadamard transform.
# ------------------------------------------------------------------------------------------


@functools.cache
def _hadamard(axis: int, signs: tuple[float, ...] | None, jit: bool):
    sg = None if signs is None else np.float32(signs)
    return maybe_jit(lambda x: fp8.hadamard(x, axis=axis, signs=sg), jit)


def assert_hadamard_matches(x, axis, jit, signs=None):
    want = R.hadamard(x, axis, signs)
    got = np.asarray(_hadamard(axis, None if signs is None else tuple(signs), jit)(x))
    assert got.dtype == np.float32 and got.shape == want.shape, (got.dtype, got.shape)
    if not np.array_equal(got.view(np.uint32), want.view(np.uint32)):
        raise AssertionError(
            _mismatch("hadamard", got.view(np.uint32), want.view(np.uint32), None, None)
        )
    return want


@with_and_without_jit
@dtypes
def test_hadamard_bit_for_bit(jit, dtype):
    """Along the last axis (3-D), along axis 0 of length 40 (padded to 48), with other signs;
    values from normal to log-normal over 30 binades with subnormals (flushed)."""
    rng = np.random.default_rng(19)
    x = rng.standard_normal((3, 5, 64)).astype(np.float32)
    assert_hadamard_matches(x.astype(DTYPES[dtype]), -1, jit)
    y = lognormal(rng, (40, 24))
    y[::7, ::3] = np.float32(1e-40)
    tiny = np.float32(2.0**-126 * 0.75)  # subnormal in float32 and bfloat16
    y[0:16, 2] = tiny * rng.choice(np.float32([-1, 1]), 16)  # a tile read as zeros
    y[16:32, 4] = np.float32(2.0**-125) * rng.choice(np.float32([-1, 1]), 16)  # w * 0.25 flushes
    y = y.astype(DTYPES[dtype])
    out = assert_hadamard_matches(y, 0, jit)
    assert out.shape == (48, 24)
    signs = rng.choice([-1.0, 1.0], 16)
    assert_hadamard_matches(y, 0, jit, signs=tuple(signs))
    z = lognormal(rng, (8, 50)).astype(DTYPES[dtype])
    assert assert_hadamard_matches(z, 1, jit).shape == (8, 64)
    # another stage order would fail the comparison on this data
    assert np.sum(R.hadamard(x, order=(8, 4, 2, 1)) != R.hadamard(x)) > 0


def test_hadamard_refuses_an_axis_out_of_bounds_and_traced_signs():
    with pytest.raises(ValueError, match=r"axis 2 is out of bounds .* from -2 to 1"):
        fp8.hadamard(jnp.ones((16, 2)), 2)
    with pytest.raises(ValueError, match="out of bounds"):
        fp8.hadamard(jnp.ones((16, 2)), -3)
    with pytest.raises(ValueError, match="signs must be 16 values"):
        fp8.hadamard(jnp.ones((16, 2)), 0, signs=(1, -1))
    with pytest.raises(TypeError, match="known while tracing.*static argument"):
        jax.jit(lambda x, s: fp8.hadamard(x, 0, s))(jnp.ones((16, 2)), jnp.ones(16))


@with_and_without_jit
def test_hadamard_is_orthogonal(jit):
    """hadamard(a, 0).T @ hadamard(b, 0) equals a.T @ b to float32 rounding of the transform
    (4096 x 64 and 4096 x 48, errors relative to |a|.T @ |b|); the transposed matrix undoes it:
    M = diag(s) H / 4, so w @ M.T = hadamard(w, signs=ones) * s tile by tile."""
    rng = np.random.default_rng(20)
    a = rng.standard_normal((4096, 64)).astype(np.float32)
    b = rng.standard_normal((4096, 48)).astype(np.float32)
    ha = np.asarray(_hadamard(0, None, jit)(a)).astype(np.float64)
    hb = np.asarray(_hadamard(0, None, jit)(b)).astype(np.float64)
    exact = a.T.astype(np.float64) @ b
    scale = np.abs(a.T.astype(np.float64)) @ np.abs(b)
    assert np.max(np.abs(ha.T @ hb - exact) / scale) < 2.0**-23
    ones = tuple([1.0] * 16)
    back = (
        np.asarray(_hadamard(0, ones, jit)(ha.astype(np.float32)))
        * np.tile(R.TE_SIGNS, 4096 // 16)[:, None]
    )
    np.testing.assert_allclose(back, a, rtol=0, atol=2.0**-21 * np.abs(a).max())


# ------------------------------------------------------------------------------------------
# The array type.
# ------------------------------------------------------------------------------------------


@with_and_without_jit
def test_nvfp4_array_fields_and_dequantize_of_the_array(jit):
    """The array's fields and scale properties; dequantize_nvfp4 of the array (a pytree:
    returned from jit, passed into jit) eagerly and jitted."""
    rng = np.random.default_rng(21)
    x = mixed(rng, (40, 72))
    x[5, 5] = np.nan
    q = maybe_jit(lambda x: fp8.quantize_nvfp4(x, (16, 16)), jit)(x)
    ref = R.quantize(x, (16, 16))
    assert tuple(q.block_shape) == (16, 16)
    assert q.scales.dtype == ml_dtypes.float8_e4m3fn
    np.testing.assert_array_equal(np.asarray(q.scales).view(np.uint8), ref.codes)
    sf = np.asarray(q.scales_float32)
    assert sf.dtype == np.float32
    np.testing.assert_array_equal(np.isnan(sf), ref.codes == 0x7F)
    np.testing.assert_array_equal(sf[ref.codes != 0x7F], R.e4m3_value(ref.codes)[ref.codes != 0x7F])
    eager = np.asarray(fp8.dequantize_nvfp4(q))
    jitted = np.asarray(jax.jit(fp8.dequantize_nvfp4)(q))
    want = R.dequantize(ref)
    for got in (eager, jitted):
        np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
        ok = ~np.isnan(want)
        np.testing.assert_array_equal(got[ok].view(np.uint32), want[ok].view(np.uint32))


# ------------------------------------------------------------------------------------------
# Full suite: a million blocks.
# ------------------------------------------------------------------------------------------


@pytest.mark.full
@blocks
def test_million_blocks(block):
    """1x16: 1,000,000 blocks (16M values); 16x16: 65,536 tiles (16.8M values), jitted."""
    rng = np.random.default_rng(30)
    shape = (62_500, 256) if block == "1x16" else (4096, 4096)
    x = mixed(rng, shape)
    assert_matches_reference(x, BLOCKS[block], True)
    bits = rng.integers(0, 2**32, shape, dtype=np.uint32)
    assert_matches_reference(x.astype(ml_dtypes.bfloat16), BLOCKS[block], True, bits=bits)


@pytest.mark.full
@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True
)
@given(
    shape=st.lists(st.integers(1, 40), min_size=1, max_size=3),
    data=st.data(),
    seed=st.integers(0, 2**32 - 1),
    binades=st.floats(1, 60),
    sr=st.booleans(),
)
def test_drawn_shapes_and_data(shape, data, seed, binades, sr):
    """Drawn ranks, shapes, block shapes (1 .. 16 per axis), spreads of the data, with and
    without stochastic rounding, jitted."""
    block = tuple(data.draw(st.sampled_from([1, 2, 5, 16])) for _ in shape)
    rng = np.random.default_rng(seed)
    x = lognormal(rng, tuple(shape), binades=binades)
    bits = rng.integers(0, 2**32, x.shape, dtype=np.uint32) if sr else None
    assert_matches_reference(x, block, True, bits=bits)


@pytest.mark.full
def test_million_midpoint_blocks():
    """About a million 1x16 blocks aimed at E4M3 midpoints, for 2,000 tensor amaxes spread
    over 2**-60 .. 2**60, jitted."""
    rng = np.random.default_rng(31)
    differ = 0
    for a in np.exp2(rng.uniform(-60, 60, 2000)).astype(np.float32):
        x = midpoint_tensor(rng, a, (1, 16), (512, 1))
        ref = assert_matches_reference(x, (1, 16), True)
        differ += int(np.sum(R.quantize(x, order="div6").codes != ref.codes))
    assert differ > 1000, differ
