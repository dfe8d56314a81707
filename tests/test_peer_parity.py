"""Peer parity: hysteresis semantics (DeepSpeed's two settings), jmp's inputs and
``presets.from_jmp``, and DeepSpeed's non-ZeRO fp16 optimizers (``presets.deepspeed_fp16``).

Every comparison is exact: float32 bit patterns of the scale after every step.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import reference_rules as ref

import jdls

F32_MAX = float(np.finfo(np.float32).max)

# Overflow patterns that tell "h - 1 overflows between growths" from "h - 1 in a row":
# isolated overflows separated by finite runs shorter than the growth window.
SPARSE = [True, False, True, False, True, True, False, True, False] + [True] * 5 + [False]
BURSTS = [False, False, True] * 3 + [True] * 6 + [False, False, False, True, False]
PATTERNS = {"sparse": SPARSE, "bursts": BURSTS, "mixed": SPARSE + BURSTS + SPARSE}


def _bits(x) -> int:
    return int(np.float32(x).view(np.uint32))


def _trajectory(scale, flags):
    adjust = jax.jit(lambda s, f: s.adjust(f))
    out = []
    for f in flags:
        scale = adjust(scale, jnp.asarray(f))
        out.append(float(scale.loss_scale))
    return out


def _reference(machine, flags):
    return [machine.step(f) for f in flags]


# --------------------------------------------------------------------------------------------
# Item 7: hysteresis.
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("pattern", sorted(PATTERNS))
@pytest.mark.parametrize("consecutive", [False, True], ids=["between-growths", "in-a-row"])
@pytest.mark.parametrize("delayed_shift", [2, 3])
def test_deepspeed_hysteresis_settings_match_reference(pattern, consecutive, delayed_shift):
    flags = PATTERNS[pattern]
    kwargs = dict(
        init_scale=2.0**16,
        scale_window=4,
        delayed_shift=delayed_shift,
        consecutive_hysteresis=consecutive,
    )
    ours = _trajectory(jdls.presets.deepspeed(**kwargs), flags)
    theirs = _reference(ref.DeepSpeed(**kwargs), flags)
    assert [_bits(x) for x in ours] == [_bits(x) for x in theirs], (ours, theirs)


def test_hysteresis_counts_overflows_between_growths():
    """``hysteresis=h`` forgives h - 1 overflows between growths; with
    ``refill_hysteresis_on_finite`` it forgives h - 1 non-finite steps in a row."""
    flags = SPARSE  # isolated overflows, never two in a row, no growth (window 4, runs < 4)
    between = jdls.presets.deepspeed(init_scale=2.0**16, scale_window=8, delayed_shift=2)
    in_a_row = jdls.presets.deepspeed(
        init_scale=2.0**16, scale_window=8, delayed_shift=2, consecutive_hysteresis=True
    )
    a, b = _trajectory(between, flags), _trajectory(in_a_row, flags)
    # Between growths: the first overflow is forgiven, every later one backs off.
    assert a[1] == 2.0**16 and a[3] == 2.0**15 and a[6] == 2.0**14
    # In a row: every isolated overflow is forgiven.
    assert set(b) == {2.0**16}
    # The same holds for the default rule, which documents it.
    rule = jdls.rules.GrowBackoff(growth_interval=100, hysteresis=2)
    s = jdls.DynamicScale(1024.0, rule)
    for f in [False, True, False]:
        s = s.adjust(f)
    assert float(s.loss_scale) == 512.0
    rule = jdls.rules.GrowBackoff(
        growth_interval=100, hysteresis=2, refill_hysteresis_on_finite=True
    )
    s = jdls.DynamicScale(1024.0, rule)
    for f in [False, True, False]:
        s = s.adjust(f)
    assert float(s.loss_scale) == 1024.0
    assert "between" in jdls.rules.GrowBackoff.__doc__


# --------------------------------------------------------------------------------------------
# Item 10: jmp.
# --------------------------------------------------------------------------------------------


def test_jmp_preset_takes_what_jmp_takes():
    s = jdls.presets.jmp(
        loss_scale=jnp.float32(2.0**15),
        counter=jnp.zeros([], jnp.int32),
        period=2000.0,
        factor=2,
        min_loss_scale=0.0,
    )
    assert s.rule.growth_interval == 2000 and s.rule.min_loss_scale is None
    assert int(s.state.counter) == 0
    s = jdls.presets.jmp(loss_scale=4.0, counter=np.int32(3), period=np.float32(5.0))
    assert int(s.state.counter) == 3 and s.rule.min_loss_scale == 1.0
    s = jdls.presets.jmp(loss_scale=4.0, min_loss_scale=jnp.ones([], jnp.float32))
    assert s.rule.min_loss_scale == 1.0
    with pytest.raises(ValueError, match="period must be a whole number, got 2000.5"):
        jdls.presets.jmp(loss_scale=4.0, period=2000.5)
    with pytest.raises(ValueError, match="min_loss_scale must be >= 0"):
        jdls.presets.jmp(loss_scale=4.0, min_loss_scale=-1.0)
    with pytest.raises(ValueError, match="counter must be in"):
        jdls.presets.jmp(loss_scale=4.0, counter=jnp.int32(5), period=5)
    with pytest.raises(TypeError, match="counter must be an int"):
        jdls.presets.jmp(loss_scale=4.0, counter=jnp.zeros(2, jnp.int32))


def _jmp_trajectory(jmp_scale, flags):
    """jmp's own ``adjust``, jitted. jmp loses ``min_loss_scale`` in a pytree round trip, so
    the scale is rebuilt inside the jitted function with the minimum as an argument."""
    cls, period, factor = type(jmp_scale), jmp_scale.period, jmp_scale.factor

    @jax.jit
    def adjust(loss_scale, counter, minimum, finite):
        new = cls(loss_scale, counter, period, factor, minimum).adjust(finite)
        return new.loss_scale, new.counter

    ls, counter, minimum = jmp_scale.loss_scale, jmp_scale.counter, jmp_scale.min_loss_scale
    out = []
    for f in flags:
        ls, counter = adjust(ls, counter, minimum, jnp.asarray(f))
        out.append((float(ls), int(counter)))
    return out


@pytest.mark.parametrize(
    "fields",
    [
        dict(loss_scale=2.0**15, counter=0, period=3, factor=2, min_loss_scale=1.0),
        dict(loss_scale=2.0**15, counter=2, period=3.0, factor=2, min_loss_scale=0.0),
        dict(loss_scale=8.0, counter=1, period=2, factor=2, min_loss_scale=2.0),
        dict(loss_scale=2.0**125, counter=0, period=1, factor=2, min_loss_scale=1.0),
    ],
    ids=["default-floor", "no-floor-float-period", "floor-2", "growth-to-inf"],
)
@pytest.mark.full(keep=1)
def test_from_jmp_follows_jmp_bit_for_bit(fields):
    jmp = pytest.importorskip("jmp")
    theirs = jmp.DynamicLossScale(
        loss_scale=jnp.float32(fields["loss_scale"]),
        counter=jnp.asarray(fields["counter"], jnp.int32),
        period=fields["period"],
        factor=fields["factor"],
        min_loss_scale=jnp.float32(fields["min_loss_scale"]),
    )
    ours = jdls.presets.from_jmp(theirs)
    flags = [True] * 5 + [False] * 3 + [True, False] * 3 + [True] * 4 + [False] * 140
    expected = _jmp_trajectory(theirs, flags)
    adjust = jax.jit(lambda s, f: s.adjust(f))
    for i, f in enumerate(flags):
        ours = adjust(ours, jnp.asarray(f))
        assert _bits(ours.loss_scale) == _bits(expected[i][0]), (i, ours, expected[i])
        assert int(ours.state.counter) == expected[i][1], i


def test_from_jmp_rejects_other_scales():
    jmp = pytest.importorskip("jmp")
    with pytest.raises(TypeError, match="jdls.StaticScale"):
        jdls.presets.from_jmp(jmp.StaticLossScale(jnp.float32(4.0)))


# --------------------------------------------------------------------------------------------
# Item 11: DeepSpeed's two paths.
# --------------------------------------------------------------------------------------------


class DeepSpeedFP16Optimizer:
    """``FP16_Optimizer._update_scale`` (fused and unfused), line by line: no hysteresis,
    no error at the minimum, factor 2; Python floats."""

    def __init__(self, init_scale=2.0**32, scale_window=1000, min_loss_scale=1.0):
        self.cur_scale = float(init_scale)
        self.scale_window = scale_window
        self.min_loss_scale = min_loss_scale
        self.scale_factor = 2
        self.cur_iter = 0
        self.last_overflow_iter = -1

    def step(self, finite):
        if not finite:
            self.cur_scale = max(self.cur_scale / self.scale_factor, self.min_loss_scale)
            self.last_overflow_iter = self.cur_iter
        else:
            stable_interval = (self.cur_iter - self.last_overflow_iter) - 1
            if (stable_interval > 0) and (stable_interval % self.scale_window == 0):
                self.cur_scale *= self.scale_factor
        self.cur_iter += 1
        return self.cur_scale


@pytest.mark.parametrize("pattern", sorted(PATTERNS))
@pytest.mark.parametrize("window", [1, 3])
def test_deepspeed_fp16_optimizer_path(pattern, window):
    flags = PATTERNS[pattern] + [False] * 30 + [True] * 10
    ours = _trajectory(
        jdls.presets.deepspeed_fp16(init_scale=2.0**16, scale_window=window, min_scale=4.0), flags
    )
    theirs = _reference(
        DeepSpeedFP16Optimizer(init_scale=2.0**16, scale_window=window, min_loss_scale=4.0), flags
    )
    assert [_bits(x) for x in ours] == [_bits(x) for x in theirs]


def test_deepspeed_fp16_never_raises_and_zero_path_does():
    fp16 = jdls.presets.deepspeed_fp16(init_scale=1.0)
    for _ in range(3):
        fp16 = fp16.adjust(False)
    assert fp16.check() is fp16 and float(fp16.loss_scale) == 1.0
    zero = jdls.presets.deepspeed(init_scale=1.0, delayed_shift=1)
    with pytest.raises(jdls.MinimumScaleError):
        zero.adjust(False).check()
    # The config's hysteresis matters on the ZeRO path only.
    flags = [False, True, True]
    assert _trajectory(jdls.presets.deepspeed(init_scale=64.0), flags)[0] == 64.0
    assert _trajectory(jdls.presets.deepspeed_fp16(init_scale=64.0), flags)[0] == 32.0
