"""Presets reproduce their library's loss-scale trajectory exactly, step by step.

Differential tests drive the real peers where they are installed (torch's own CPU kernel
``torch._amp_update_scale_``, ``flax.training.dynamic_scale.DynamicScale``,
``jmp.DynamicLossScale``) and the reference state machines of ``reference_rules.py`` for the
others (Keras, DeepSpeed, Megatron-LM, Cerebras), over hypothesis-generated sequences of
finite and non-finite steps: sparse, dense and bursty overflow. Every comparison is exact
(float32 bit patterns and integer counters), jitted and not.
"""

from __future__ import annotations

import functools
import inspect
import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import reference_rules as ref
from _helpers import F32_MAX, with_and_without_jit
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import jdls

TINY = float(np.finfo(np.float32).tiny)
SETTINGS = settings(
    max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True
)

# --------------------------------------------------------------------------------------------
# Sequences of steps: True = finite gradients.
# --------------------------------------------------------------------------------------------

sparse = st.lists(st.sampled_from([True] * 24 + [False]), min_size=1, max_size=150)
dense = st.lists(st.sampled_from([True, False, False]), min_size=1, max_size=150)
bursty = st.lists(st.tuples(st.booleans(), st.integers(1, 25)), min_size=1, max_size=12).map(
    lambda runs: [flag for flag, n in runs for _ in range(n)]
)
flag_sequences = st.one_of(sparse, dense, bursty)
factors = st.sampled_from([2.0, 1.5, 3.0, 4.0, 1.25])  # float32-representable
backoffs = st.sampled_from([0.5, 0.25, 0.75, 0.125])
intervals = st.integers(1, 6)
init_scales = st.one_of(
    st.integers(-20, 127).map(lambda e: 2.0**e),
    st.floats(2.0**-10, 2.0**100, allow_nan=False, width=32),
)


@functools.cache
def _jitted_adjust():
    return jax.jit(lambda s, f: s.adjust(f))


def trajectory(scale, flags, jit):
    """States after each step: (loss_scale as float32 bits, the scale object)."""
    adjust = _jitted_adjust() if jit else (lambda s, f: s.adjust(f))
    out = []
    for f in flags:
        scale = adjust(scale, f)
        out.append(scale)
    return out


def start_at(factory, init_name, s0, minimum, **kwargs):
    """The preset ``factory(**{init_name: s0}, **kwargs)``; like the libraries, presets accept
    a start below the rule's minimum (it applies from the first backoff)."""
    del minimum
    return getattr(jdls.presets, factory)(**{init_name: s0}, **kwargs)


def same_f32(a, b) -> bool:
    a, b = np.float32(a), np.float32(b)
    return a.view(np.uint32) == b.view(np.uint32)


def assert_same_scales(ours, theirs, flags, stop=lambda value: False):
    for i, (s, value) in enumerate(zip(ours, theirs, strict=True)):
        if stop(value):
            return
        assert same_f32(s.loss_scale, value), (
            f"step {i}: jdls {float(s.loss_scale)!r} != peer {value!r}; flags[:i+1]={flags[: i + 1]}"
        )


# --------------------------------------------------------------------------------------------
# PyTorch: torch's own update kernel.
# --------------------------------------------------------------------------------------------


def torch_trajectory(flags, init_scale, growth_factor, backoff_factor, growth_interval):
    torch = pytest.importorskip("torch")
    scale = torch.tensor([init_scale], dtype=torch.float32)
    tracker = torch.tensor([0], dtype=torch.int32)
    out = []
    for f in flags:
        found_inf = torch.tensor([0.0 if f else 1.0])
        torch._amp_update_scale_(
            scale, tracker, found_inf, growth_factor, backoff_factor, growth_interval
        )
        out.append((scale.item(), int(tracker.item())))
    return out


@with_and_without_jit
@SETTINGS
@given(flags=flag_sequences, g=factors, b=backoffs, n=intervals, s0=init_scales)
@pytest.mark.full  # about 15 s; the presets' own rule tests stay quick
def test_pytorch_matches_torch_kernel(jit, flags, g, b, n, s0):
    kwargs = dict(init_scale=s0, growth_factor=g, backoff_factor=b, growth_interval=n)
    theirs = torch_trajectory(flags, **kwargs)
    ours = trajectory(jdls.presets.pytorch(**kwargs), flags, jit)
    for i, (s, (value, tracker)) in enumerate(zip(ours, theirs, strict=True)):
        if value < TINY:  # torch keeps float32 subnormals, XLA flushes them (see docs)
            break
        assert same_f32(s.loss_scale, value), (i, float(s.loss_scale), value, flags[: i + 1])
        assert int(s.state.counter) == tracker
    # The pure-Python reference agrees too (used where torch is absent).
    reference = ref.PyTorch(**kwargs)
    assert_same_scales(ours, [reference.step(f) for f in flags], flags, stop=lambda v: v < TINY)


@pytest.mark.full  # 9 s; the PyTorch rule is checked against torch's kernel in the quick run
def test_pytorch_growth_to_inf_is_dropped():
    s = jdls.presets.pytorch(init_scale=2.0**127, growth_interval=1)
    s = s.adjust(True)
    assert float(s.loss_scale) == 2.0**127 and int(s.state.counter) == 0
    assert torch_trajectory([True], 2.0**127, 2.0, 0.5, 1)[0][0] == 2.0**127


# --------------------------------------------------------------------------------------------
# Flax: flax.training.dynamic_scale.DynamicScale, driven through its value_and_grad.
# --------------------------------------------------------------------------------------------


@functools.cache
def _flax_step():
    def step(ds, finite):
        c = jnp.where(finite, 1.0, jnp.inf)
        ds, is_fin, _, _ = ds.value_and_grad(lambda x: x * c)(jnp.float32(1.0))
        return ds, is_fin

    return jax.jit(step)


def flax_trajectory(flags, **kwargs):
    """Flax's (scale, fin_steps, is_fin) after each step. ``is_fin`` is what Flax saw: the
    flag, except at a scale of 0 (reachable with ``minimum_scale=None``), where Flax's
    unscaled gradient is 0 / 0 = NaN on every step."""
    from flax.training.dynamic_scale import DynamicScale

    ds = DynamicScale(**kwargs)
    out = []
    for f in flags:
        before = float(ds.scale)
        ds, is_fin = _flax_step()(ds, f)
        assert bool(is_fin) == (f and before != 0.0)
        out.append((float(ds.scale), int(ds.fin_steps), bool(is_fin)))
    return out


@with_and_without_jit
@SETTINGS
@given(
    flags=flag_sequences,
    g=factors,
    b=backoffs,
    n=intervals,
    s0=init_scales,
    minimum=st.sampled_from([TINY, 1.0, None, 2.0**-10]),
)
@pytest.mark.full
def test_flax_matches_flax(jit, flags, g, b, n, s0, minimum):
    theirs = flax_trajectory(
        flags,
        growth_factor=g,
        backoff_factor=b,
        growth_interval=n,
        scale=jnp.float32(s0),
        minimum_scale=minimum,
    )
    scale = start_at(
        "flax",
        "scale",
        s0,
        minimum,
        growth_factor=g,
        backoff_factor=b,
        growth_interval=n,
        minimum_scale=minimum,
    )
    # jdls is given the flags Flax saw (they differ only once Flax's scale is 0).
    ours = trajectory(scale, [seen for _, _, seen in theirs], jit)
    for i, (s, (value, fin_steps, _)) in enumerate(zip(ours, theirs, strict=True)):
        assert same_f32(s.loss_scale, value), (i, float(s.loss_scale), value, flags[: i + 1])
        assert int(s.state.counter) == fin_steps


def test_flax_clamps_growth_at_float32_max():
    s = jdls.presets.flax(growth_interval=1, scale=2.0**127)
    s = s.adjust(True).adjust(True)
    assert float(s.loss_scale) == F32_MAX
    assert (
        flax_trajectory([True, True], growth_interval=1, scale=jnp.float32(2.0**127))[-1][0]
        == F32_MAX
    )


# --------------------------------------------------------------------------------------------
# jmp.
# --------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=64)
def _jmp_step(period, factor, min_loss_scale):
    jmp = pytest.importorskip("jmp")

    def step(loss_scale, counter, finite):
        s = jmp.DynamicLossScale(
            loss_scale,
            counter,
            period=period,
            factor=factor,
            min_loss_scale=jnp.float32(min_loss_scale),
        )
        s = s.adjust(finite)
        return s.loss_scale, s.counter

    return jax.jit(step)


@with_and_without_jit
@SETTINGS
@given(
    flags=flag_sequences,
    factor=st.sampled_from([2, 3, 4, 1.5]),
    period=intervals,
    s0=init_scales,
    minimum=st.sampled_from([1.0, 2.0**-5, 64.0]),
)
@pytest.mark.full
def test_jmp_matches_jmp(jit, flags, factor, period, s0, minimum):
    step = _jmp_step(period, factor, minimum)
    ls, counter = jnp.float32(s0), jnp.int32(0)
    ours = trajectory(
        start_at(
            "jmp", "loss_scale", s0, minimum, period=period, factor=factor, min_loss_scale=minimum
        ),
        flags,
        jit,
    )
    for i, f in enumerate(flags):
        ls, counter = step(ls, counter, f)
        assert same_f32(ours[i].loss_scale, ls), (
            i,
            float(ours[i].loss_scale),
            float(ls),
            flags[: i + 1],
        )
        assert int(ours[i].state.counter) == int(counter)


# --------------------------------------------------------------------------------------------
# Keras, DeepSpeed, Megatron-LM, Cerebras: reference state machines from the rules.
# --------------------------------------------------------------------------------------------


@with_and_without_jit
@SETTINGS
@given(flags=flag_sequences, n=intervals, s0=init_scales)
def test_keras_matches_reference(jit, flags, n, s0):
    reference = ref.Keras(initial_scale=s0, dynamic_growth_steps=n)
    ours = trajectory(jdls.presets.keras(initial_scale=s0, dynamic_growth_steps=n), flags, jit)
    assert_same_scales(ours, [reference.step(f) for f in flags], flags)


def test_keras_reaches_inf_and_zero_like_keras():
    """Keras has no clamp: jdls reproduces its scale reaching inf (and 0 after flushing)."""
    up = jdls.presets.keras(initial_scale=2.0**127, dynamic_growth_steps=1).adjust(True)
    assert float(up.loss_scale) == np.inf and ref.Keras(2.0**127, 1).step(True) == np.inf
    down = jdls.presets.keras(initial_scale=2.0**-126)
    assert float(down.adjust(False).loss_scale) == 0.0


@with_and_without_jit
@SETTINGS
@given(
    flags=flag_sequences,
    factor=st.sampled_from([2.0, 4.0]),
    window=intervals,
    s0=st.integers(-10, 100).map(lambda e: 2.0**e),
    min_scale=st.sampled_from([1.0, 2.0**-4, 2.0**8]),
    delayed_shift=st.integers(1, 4),
    consecutive=st.booleans(),
)
@pytest.mark.full(keep=1)
def test_deepspeed_matches_reference(
    jit, flags, factor, window, s0, min_scale, delayed_shift, consecutive
):
    kwargs = dict(
        init_scale=s0,
        scale_factor=factor,
        scale_window=window,
        min_scale=min_scale,
        delayed_shift=delayed_shift,
        consecutive_hysteresis=consecutive,
    )
    reference = ref.DeepSpeed(**kwargs)
    del kwargs["init_scale"]
    ours = trajectory(start_at("deepspeed", "init_scale", s0, min_scale, **kwargs), flags, jit)
    for i, f in enumerate(flags):
        value = reference.step(f)
        if value > F32_MAX:  # DeepSpeed's Python float goes beyond float32 (see docs)
            break
        assert same_f32(ours[i].loss_scale, value), (
            i,
            float(ours[i].loss_scale),
            value,
            flags[: i + 1],
        )
        assert int(ours[i].state.hysteresis) == reference.cur_hysteresis
        assert int(ours[i].state.min_scale_overflows) == reference.errors


def test_deepspeed_error_at_min_scale_is_recorded_and_raised_on_host():
    s = jdls.presets.deepspeed(init_scale=2.0, min_scale=1.0, delayed_shift=1)
    s = s.adjust(False)  # 2 -> 1: fine
    s.check()
    s = jax.jit(lambda s: s.adjust(False))(s)  # at the minimum: DeepSpeed would raise
    assert float(s.loss_scale) == 1.0 and int(s.state.min_scale_overflows) == 1
    with pytest.raises(jdls.MinimumScaleError, match="already at its minimum"):
        s.check()
    quiet = jdls.presets.deepspeed(init_scale=1.0, delayed_shift=1, raise_error_at_min_scale=False)
    assert quiet.adjust(False).check() is not None


@with_and_without_jit
@SETTINGS
@given(
    flags=flag_sequences,
    g=factors,
    b=backoffs,
    n=intervals,
    s0=init_scales,
    min_scale=st.sampled_from([1.0, 2.0**-6, 2.0**10]),
    hysteresis=st.integers(1, 4),
)
@pytest.mark.full(keep=1)
def test_megatron_matches_reference(jit, flags, g, b, n, s0, min_scale, hysteresis):
    kwargs = dict(
        initial_scale=s0,
        min_scale=min_scale,
        growth_factor=g,
        backoff_factor=b,
        growth_interval=n,
        hysteresis=hysteresis,
    )
    reference = ref.Megatron(**kwargs)
    del kwargs["initial_scale"]
    ours = trajectory(start_at("megatron", "initial_scale", s0, min_scale, **kwargs), flags, jit)
    assert_same_scales(ours, [reference.step(f) for f in flags], flags)


@with_and_without_jit
@SETTINGS
@given(
    flags=flag_sequences,
    spi=intervals,
    s0=st.one_of(st.none(), init_scales),
    min_scale=st.sampled_from([2.0**-14, 1.0, 2.0**4]),
    max_scale=st.sampled_from([2.0**15, 2.0**31, 2.0**6]),
    tolerance=st.sampled_from([0.0, 0.1, 0.25, 0.5, 1 / 3]),
)
@pytest.mark.full(keep=1)
def test_cerebras_matches_reference(jit, flags, spi, s0, min_scale, max_scale, tolerance):
    kwargs = dict(
        init_scale=s0,
        steps_per_increase=spi,
        min_loss_scale=min_scale,
        max_loss_scale=max_scale,
        overflow_tolerance=tolerance,
    )
    reference = ref.Cerebras(**kwargs)
    ours = trajectory(jdls.presets.cerebras(**kwargs), flags, jit)
    skipped = 0  # a wrap statistic now (jdls.stats(opt_state).skipped_steps): counted here
    for i, f in enumerate(flags):
        value = reference.step(f)
        skipped += not f
        assert same_f32(ours[i].loss_scale, value), (
            i,
            float(ours[i].loss_scale),
            value,
            flags[: i + 1],
        )
        state = jdls.presets.to_cerebras_state_dict(ours[i], num_skipped_steps=skipped)
        assert state == {
            "loss_scale": float(value),
            "steps_since_rescale": reference.steps_since_rescale,
            "overflows_since_rescale": reference.overflows_since_rescale,
            "num_skipped_steps": reference.num_skipped_steps,
        }


# --------------------------------------------------------------------------------------------
# Defaults, documented behaviours and validation of the presets.
# --------------------------------------------------------------------------------------------


def test_preset_defaults():
    assert float(jdls.presets.pytorch().loss_scale) == 2.0**16
    assert jdls.presets.pytorch().rule.growth_interval == 2000
    assert isinstance(jdls.presets.pytorch(enabled=False), jdls.NoOpScale)
    flax = jdls.presets.flax()
    assert float(flax.loss_scale) == 65536.0 and flax.rule.min_loss_scale == TINY
    assert flax.rule.growth_interval == 2001  # grows on the 2001st finite step, as Flax
    assert float(jdls.presets.keras().loss_scale) == 2.0**15
    ds = jdls.presets.deepspeed()
    assert float(ds.loss_scale) == 2.0**32 and int(ds.state.hysteresis) == 2
    mg = jdls.presets.megatron()
    assert float(mg.loss_scale) == 2.0**32 and mg.rule.growth_interval == 1000
    cb = jdls.presets.cerebras()
    assert float(cb.loss_scale) == 2.0**15 and cb.rule.min_loss_scale == 2.0**-14
    assert cb.rule.growth_interval == 2001
    assert float(jdls.presets.cerebras(half_dtype="cbfloat16").loss_scale) == 2.0**31
    assert float(jdls.presets.cerebras(half_dtype="bfloat16").loss_scale) == 2.0**15
    assert float(jdls.presets.cerebras(init_scale=2.0**20).loss_scale) == 2.0**15  # clamped


@pytest.mark.parametrize(
    ("spellings", "maximum"),
    [
        (["float16", jnp.float16, np.dtype("float16")], 2.0**15),
        (["bfloat16", jnp.bfloat16, np.dtype(jnp.bfloat16)], 2.0**15),
        (["cbfloat16", jdls.cbfloat16, jdls.FloatFormat(6, 9)], 2.0**31),
    ],
    ids=["float16", "bfloat16", "cbfloat16"],
)
def test_cerebras_half_dtype_takes_every_spelling_of_a_format(spellings, maximum):
    scales = [jdls.presets.cerebras(half_dtype=h) for h in spellings]
    assert all(s.rule == scales[0].rule for s in scales)
    assert all(float(s.loss_scale) == maximum for s in scales)


@pytest.mark.parametrize("bad", ["fp16", jnp.float32, jnp.int8, 16])
def test_cerebras_half_dtype_that_is_not_a_half_format_says_what_to_pass(bad):
    with pytest.raises(ValueError, match=r"half_dtype must be one of .*: pass .*jdls\.cbfloat16"):
        jdls.presets.cerebras(half_dtype=bad)


def test_cerebras_static_and_none():
    static = jdls.presets.cerebras(loss_scale=128.0)
    assert isinstance(static, jdls.StaticScale) and float(static.loss_scale) == 128.0
    assert isinstance(jdls.presets.cerebras(loss_scale=None), jdls.NoOpScale)


def test_cerebras_overflow_tolerance_forgives_and_can_grow_on_an_overflow_step():
    s = jdls.presets.cerebras(init_scale=8.0, steps_per_increase=3, overflow_tolerance=0.5)
    got = [float((s := s.adjust(f)).loss_scale) for f in [True, False, True, False]]
    # ratios 0/1, 1/2 (not > 0.5), 1/3, then 2/4 = 0.5 on the 4th step: that step grows.
    assert got == [8.0, 8.0, 8.0, 16.0]


@pytest.mark.parametrize(
    ("factory", "kwargs", "message"),
    [
        ("pytorch", {"growth_factor": 0.9}, "growth_factor must be > 1, got 0.9"),
        ("pytorch", {"backoff_factor": 1.5}, "backoff_factor must be in the open interval"),
        ("pytorch", {"growth_interval": 0}, "growth_interval must be >= 1, got 0"),
        ("pytorch", {"init_scale": 0.0}, "init_scale must be a finite number > 0"),
        ("flax", {"growth_interval": 0}, "growth_interval must be >= 1"),
        ("flax", {"scale": float("nan")}, "^scale must be a number, got nan"),
        ("keras", {"dynamic_growth_steps": 0}, "dynamic_growth_steps must be >= 1"),
        ("deepspeed", {"scale_window": 0}, "scale_window must be >= 1"),
        ("deepspeed", {"delayed_shift": 0}, "delayed_shift must be >= 1"),
        ("deepspeed", {"min_scale": 0.0}, "^min_scale must be a finite number > 0"),
        ("megatron", {"hysteresis": 0}, "hysteresis must be >= 1"),
        # Megatron-LM accepts a start below min_scale, and so does the preset.
        ("megatron", {"min_scale": 4.0, "initial_scale": 1.0}, None),
        ("megatron", {"min_scale": 4.0, "initial_scale": 4.0}, None),
        ("cerebras", {"min_loss_scale": 2.0**-15}, r"min_loss_scale must be >= 2\*\*-14"),
        ("cerebras", {"overflow_tolerance": -1.0}, "^overflow_tolerance must be >= 0, got -1.0"),
        ("cerebras", {"steps_per_increase": 0}, "steps_per_increase must be >= 1"),
        (
            "cerebras",
            {"min_loss_scale": 2.0**10, "max_loss_scale": 2.0**5},
            "min_loss_scale must be <=",
        ),
        ("cerebras", {"loss_scale": "auto"}, 'loss_scale must be "dynamic"'),
        ("cerebras", {"loss_scale": -3.0}, "loss_scale must be a finite number > 0"),
        ("cerebras", {"half_dtype": "float8"}, "half_dtype must be one of"),
        ("jmp", {"loss_scale": 4.0, "factor": 1}, "^factor must be > 1, got 1"),
        ("jmp", {"loss_scale": 4.0, "period": 0}, "period must be >= 1"),
    ],
)
def test_preset_validation(factory, kwargs, message):
    if message is None:  # accepted, as the library accepts it
        getattr(jdls.presets, factory)(**kwargs)
        return
    with pytest.raises(ValueError, match=message):
        getattr(jdls.presets, factory)(**kwargs)


# Every argument a preset validates, and the values that sweep its checks.
_VALIDATED = {
    "pytorch": {"init_scale", "growth_factor", "backoff_factor", "growth_interval"},
    "flax": {"growth_factor", "backoff_factor", "growth_interval", "fin_steps", "scale"}
    | {"minimum_scale"},
    "jmp": {"loss_scale", "counter", "period", "factor", "min_loss_scale"},
    "keras": {"initial_scale", "dynamic_growth_steps"},
    "deepspeed": {"init_scale", "scale_factor", "scale_window", "min_scale", "delayed_shift"},
    "deepspeed_fp16": {"init_scale", "scale_window", "min_scale"},
    "megatron": {"initial_scale", "min_scale", "growth_factor", "backoff_factor"}
    | {"growth_interval", "hysteresis"},
    "cerebras": {"loss_scale", "init_scale", "steps_per_increase", "min_loss_scale"}
    | {"max_loss_scale", "overflow_tolerance", "half_dtype", "max_gradient_norm"},
}
_BAD = [-1, 0, 0.5, 1, 1.5, float("nan"), float("inf"), "x", 1e39, 1e-45, 2**31 - 1, 2**24 + 1]
# jdls's own names, which a preset whose library spells them otherwise must not show.
_JDLS_NAMES = (
    {"loss_scale", "min_loss_scale", "max_loss_scale", "growth_factor"}
    | {"backoff_factor", "growth_interval", "hysteresis", "tolerance", "counter"}
    | {"error_at_min_scale", "refill_hysteresis_on_finite", "counter_after_growth"}
)


@pytest.mark.parametrize("preset", sorted(_VALIDATED))
def test_every_preset_error_names_the_argument_as_spelled(preset):
    """Every validated argument of every preset, swept with bad values: the error starts with
    the argument's name as the preset spells it, and names no jdls argument the preset does
    not have (``cerebras(overflow_tolerance=-0.1)`` said ``tolerance must be >= 0``)."""
    factory = getattr(jdls.presets, preset)
    params = set(inspect.signature(factory).parameters)
    required = {"loss_scale": 4.0} if preset == "jmp" else {}
    failed = set()
    for name in sorted(params):
        for bad in _BAD:
            try:
                factory(**{**required, name: bad})
            except (TypeError, ValueError) as e:
                failed.add(name)
                message = str(e)
                assert message.startswith(f"{name} ") or message.startswith(
                    f"presets.{preset} builds"
                ), (name, bad, message)
                words = set(re.findall(r"\b[a-z_]+\b", message))
                assert not (words & _JDLS_NAMES) - params, (name, bad, message)
    assert failed == _VALIDATED[preset]


def test_jmp_integer_scales_are_taken_exactly_or_refused():
    """jmp warns on integer arrays (its own ``adjust`` then fails); ``presets.jmp`` takes an
    integer that float32 holds exactly, with no warning, and refuses one it would round."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        scale = jdls.presets.jmp(jnp.int32(2**15), min_loss_scale=np.int64(2))
    assert scale.loss_scale.dtype == jnp.float32 and float(scale.loss_scale) == 2.0**15
    assert scale.rule.min_loss_scale == 2.0
    for name in ("loss_scale", "min_loss_scale"):
        args = {"loss_scale": 4.0, name: jnp.int32(2**24 + 1)}
        with pytest.raises(ValueError, match=f"^{name} must be a number float32 holds exactly"):
            jdls.presets.jmp(**args)


def test_cerebras_max_gradient_norm_belongs_to_the_wrap():
    """presets.cerebras no longer takes max_gradient_norm: cerebras_wrap does, and checks it."""
    with pytest.raises(TypeError, match=r"jdls.presets.cerebras_wrap\(optimizer, max_gradient"):
        jdls.presets.cerebras(max_gradient_norm=-1.0)
    with pytest.raises(ValueError, match="max_gradient_norm must be a finite number > 0"):
        jdls.presets.cerebras_wrap(optax.sgd(0.1), max_gradient_norm=-1.0)


@pytest.mark.full
def test_scan_and_loop_agree_for_every_preset():
    flags = np.random.default_rng(0).random(400) > 0.1
    for scale in [
        jdls.presets.pytorch(growth_interval=3),
        jdls.presets.flax(growth_interval=3),
        jdls.presets.jmp(loss_scale=2.0**15, period=3),
        jdls.presets.keras(dynamic_growth_steps=3),
        jdls.presets.deepspeed(scale_window=3),
        jdls.presets.megatron(growth_interval=3),
        jdls.presets.cerebras(steps_per_increase=3, overflow_tolerance=0.2),
    ]:
        loop = trajectory(scale, list(flags), jit=True)
        _, scanned = jax.jit(lambda s, f: jax.lax.scan(lambda c, x: (c.adjust(x),) * 2, s, f))(
            scale, jnp.asarray(flags)
        )
        # Every child: the scale and each of the rule's counters.
        paths = jax.tree_util.tree_flatten_with_path(scanned)[0]
        assert jax.tree_util.keystr(paths[0][0]) == ".loss_scale"
        assert len(paths) == 1 + len(scale.state)
        for j, (path, leaves) in enumerate(paths):
            np.testing.assert_array_equal(
                np.array([jax.tree_util.tree_leaves(s)[j] for s in loop]),
                leaves,
                err_msg=f"{scale.rule!r}{jax.tree_util.keystr(path)}",
            )
