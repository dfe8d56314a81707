"""Property tests at the extremes: long sequences under ``lax.scan``, scales reaching 0 and inf.

``test_presets.py`` compares every preset with its library over short sequences (up to 150
steps). Here the sequences are long (thousands of steps, compiled once with ``lax.scan``),
made of runs of finite and non-finite steps long enough to drive each scale to the ends of its
range, and the comparison goes on past those ends:

* the default ``jdls.DynamicScale()`` stays within ``[1, 2**24]`` (finite, never 0) for any
  sequence, and follows its rule exactly;
* every preset reproduces its library **including where the library itself reaches inf or 0**
  (Keras and Megatron-LM grow to inf and stay there; Keras halves down to 0; PyTorch flushes
  to 0 where torch keeps a subnormal scale, DeepSpeed's float64 scale leaves float32's range:
  there the exact statement of what jdls does is tested, see ``docs/reliability.md``);
* ``jdls.wrap``: the statistics (``finite``, ``skipped_steps``, ``consecutive_skips``), the
  scale and the inner step count match a plain-Python reference for any sequence of finite and
  non-finite (inf, -inf, NaN) gradients, for every preset and both ``skip_with`` modes;
* a scale that reached 0 or inf (a dead run, as in the library it mirrors) never lets a NaN
  into the parameters: every step is skipped.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import reference_rules as ref
from _helpers import F32_MAX, same_bits
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import jdls

F32 = np.float32
TINY = float(np.finfo(np.float32).tiny)
LONG = 2048  # steps per sequence for the presets
SETTINGS = settings(
    max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True
)


def runs(max_run: int, length: int) -> st.SearchStrategy[np.ndarray]:
    """Sequences of ``length`` flags (True: finite) made of runs of 1 to ``max_run`` steps,
    repeated cyclically up to ``length``."""
    return st.lists(st.tuples(st.booleans(), st.integers(1, max_run)), min_size=1, max_size=30).map(
        lambda rs: np.resize(
            np.repeat(np.array([f for f, _ in rs]), np.array([n for _, n in rs])), length
        )
    )


def powers_of_two(lo: int, hi: int) -> st.SearchStrategy[float]:
    return st.integers(lo, hi).map(lambda e: 2.0**e)


def any_scale(lo: float, hi: float) -> st.SearchStrategy[float]:
    return st.one_of(
        powers_of_two(int(np.log2(lo)), int(np.log2(hi))),
        st.floats(lo, hi, allow_nan=False, width=32),
    )


@jax.jit
def scan_scale(scale: jdls.DynamicScale, flags: jax.Array) -> tuple[jax.Array, ...]:
    """The scale's data after each step: ``(loss_scale, state)``, the rule's counters
    (compiled once per rule and length)."""

    def body(s, f):
        s = s.adjust(f)
        return s, (s.loss_scale, s.state)

    return jax.lax.scan(body, scale, flags)[1]


def as_bits(values) -> np.ndarray:
    with np.errstate(over="ignore"):
        return np.asarray(values, np.float32).view(np.uint32)


def first_difference(ours, theirs) -> int | None:
    diff = np.nonzero(as_bits(ours) != as_bits(theirs))[0]
    return int(diff[0]) if diff.size else None


def assert_same_trajectory(ours, theirs, flags):
    i = first_difference(ours, theirs)
    assert i is None, (
        f"step {i}: jdls {float(ours[i])!r} != reference {float(theirs[i])!r}; "
        f"flags around it: {flags[max(0, i - 5) : i + 1].tolist()}"
    )


# --------------------------------------------------------------------------------------------
# The default DynamicScale(): always within [1, 2**24].
# --------------------------------------------------------------------------------------------


def default_reference(flags, s0, growth_interval, lo=1.0, hi=2.0**24):
    """The default rule, run by run (closed form): halve per overflow down to ``lo``, double
    per ``growth_interval`` finite steps up to ``hi``."""
    scale, counter, out = F32(s0), 0, []
    for f in flags:
        if f:
            counter += 1
            if counter == growth_interval:
                scale, counter = min(scale * F32(2), F32(hi)), 0
        else:
            scale, counter = max(scale * F32(0.5), F32(lo)), 0
        out.append(scale)
    return np.array(out, np.float32)


@SETTINGS
@given(flags=runs(5000, 30_000), s0=any_scale(1.0, 2.0**24))
def test_default_scale_stays_within_bounds_for_any_long_sequence(flags, s0):
    scales, state = scan_scale(jdls.DynamicScale(s0), jnp.asarray(flags))
    scales = np.asarray(scales)
    assert np.all(np.isfinite(scales)) and scales.min() >= 1.0 and scales.max() <= 2.0**24
    assert np.asarray(state.counter).max() < 2000
    assert_same_trajectory(scales, default_reference(flags, s0, 2000), flags)


@SETTINGS
@given(flags=runs(300, LONG), s0=any_scale(1.0, 2.0**24))
def test_default_rule_with_fast_growth_pins_to_both_bounds(flags, s0):
    scales = np.asarray(scan_scale(jdls.DynamicScale(s0, growth_interval=1), jnp.asarray(flags))[0])
    assert scales.min() >= 1.0 and scales.max() <= 2.0**24
    assert_same_trajectory(scales, default_reference(flags, s0, 1), flags)


def test_default_bounds_are_reached_and_held():
    flags = np.array([False] * 40 + [True] * 2000 * 30 + [False] * 40)
    scales = np.asarray(scan_scale(jdls.DynamicScale(), jnp.asarray(flags))[0])
    assert scales[39] == 1.0 and scales[40 + 2000 * 24 - 1] == 2.0**24
    assert scales.max() == 2.0**24 and scales[-1] == 1.0


# --------------------------------------------------------------------------------------------
# Presets at the extremes, against their libraries.
# --------------------------------------------------------------------------------------------


def _torch_trajectory(flags, init_scale, growth_factor, backoff_factor, growth_interval):
    torch = pytest.importorskip("torch")
    scale = torch.tensor([init_scale], dtype=torch.float32)
    tracker = torch.tensor([0], dtype=torch.int32)
    inf, zero = torch.tensor([1.0]), torch.tensor([0.0])
    out = np.empty(len(flags), np.float32)
    for i, f in enumerate(flags):
        torch._amp_update_scale_(
            scale, tracker, zero if f else inf, growth_factor, backoff_factor, growth_interval
        )
        out[i] = scale.item()
    return out


@pytest.mark.full  # about 6 s; tests/test_presets.py checks the PyTorch rule against torch in the quick run
@SETTINGS
@given(flags=runs(400, LONG), s0=any_scale(2.0**-100, 2.0**127), n=st.sampled_from([1, 3]))
def test_pytorch_to_zero_and_to_float32_max(flags, s0, n):
    """Exact while torch's scale is a normal float32 (it never becomes inf: a growth to inf is
    dropped). Torch keeps subnormal scales down to 2**-149; XLA flushes them to 0, so from the
    first step where torch's scale is subnormal, jdls's scale is 0 and stays 0 (see docs)."""
    kwargs = dict(init_scale=s0, growth_factor=2.0, backoff_factor=0.5, growth_interval=n)
    theirs = _torch_trajectory(flags, **kwargs)
    ours = np.asarray(scan_scale(jdls.presets.pytorch(**kwargs), jnp.asarray(flags))[0])
    assert np.all(np.isfinite(ours)) and np.all(np.isfinite(theirs))
    sub = np.nonzero((theirs != 0) & (np.abs(theirs) < TINY))[0]
    stop = int(sub[0]) if sub.size else len(flags)
    assert_same_trajectory(ours[:stop], theirs[:stop], flags)
    assert np.all(ours[stop:] == 0.0)


def test_pytorch_flushed_scale_does_not_come_back():
    """The one divergence from torch, at scales below 2**-126: torch's subnormal scale can grow
    back; jdls's was flushed to 0 and stays 0 (every step is skipped: the run is dead)."""
    flags = np.array([False] * 30 + [True] * 100)
    kwargs = dict(init_scale=2.0**-100, growth_factor=2.0, backoff_factor=0.5, growth_interval=1)
    theirs = _torch_trajectory(flags, **kwargs)
    ours = np.asarray(scan_scale(jdls.presets.pytorch(**kwargs), jnp.asarray(flags))[0])
    assert theirs[25] == ours[25] == 2.0**-126
    assert theirs[29] == 2.0**-130 and theirs[-1] == 2.0**-30  # torch: subnormal, then back
    assert np.all(ours[26:] == 0.0)  # jdls: 0 from the first subnormal on


@SETTINGS
@given(flags=runs(400, LONG), s0=any_scale(2.0**-100, 2.0**127), n=st.sampled_from([1, 4]))
def test_keras_to_inf_and_to_zero(flags, s0, n):
    """Keras has no clamp: inf after enough growth (then inf / 2 is inf: it stays), 0 after
    enough halving (then 0 * 2 is 0: it stays). jdls follows it bit for bit, both ways."""
    reference = ref.Keras(initial_scale=s0, dynamic_growth_steps=n)
    with np.errstate(over="ignore"):
        theirs = [reference.step(bool(f)) for f in flags]
    ours = np.asarray(scan_scale(jdls.presets.keras(s0, n), jnp.asarray(flags))[0])
    assert_same_trajectory(ours, theirs, flags)
    for end in (0.0, np.inf):  # once reached, an end is never left
        hit = np.nonzero(ours == end)[0]
        if hit.size:
            assert np.all(ours[hit[0] :] == end)


def test_keras_reaches_both_ends_within_a_sequence():
    flags = np.array([True] * 200 + [False] * 50 + [False] * 400)
    up = np.asarray(scan_scale(jdls.presets.keras(2.0**-20, 1), jnp.asarray(flags[:200]))[0])
    assert up[146] == 2.0**127 and up[147] == np.inf and np.all(up[147:] == np.inf)
    down = np.asarray(scan_scale(jdls.presets.keras(2.0**-20, 1), jnp.asarray(flags[200:]))[0])
    assert down[105] == 2.0**-126 and down[106] == 0.0 and np.all(down[106:] == 0.0)


@SETTINGS
@given(
    flags=runs(400, LONG),
    s0=any_scale(1.0, 2.0**127),
    hysteresis=st.sampled_from([1, 3]),
)
def test_megatron_to_inf(flags, s0, hysteresis):
    """Megatron-LM: no maximum, float32: the scale can reach inf and then stays inf (inf times
    the backoff factor is inf); the minimum keeps it from 0."""
    kwargs = dict(initial_scale=s0, min_scale=1.0, growth_interval=2, hysteresis=hysteresis)
    reference = ref.Megatron(**kwargs)
    with np.errstate(over="ignore"):
        theirs = [reference.step(bool(f)) for f in flags]
    ours = np.asarray(scan_scale(jdls.presets.megatron(**kwargs), jnp.asarray(flags))[0])
    assert_same_trajectory(ours, theirs, flags)
    assert ours.min() >= 1.0


@SETTINGS
@given(flags=runs(400, LONG), s0=powers_of_two(0, 120))
def test_deepspeed_beyond_float32(flags, s0):
    """DeepSpeed computes in Python floats: its scale can exceed float32's max (3.4e38) and come
    back. jdls's float32 scale becomes inf at that step and stays inf (see docs)."""
    kwargs = dict(init_scale=s0, scale_window=2, min_scale=1.0, delayed_shift=2)
    reference = ref.DeepSpeed(**kwargs)
    theirs = np.array([reference.step(bool(f)) for f in flags], np.float64)
    ours = np.asarray(scan_scale(jdls.presets.deepspeed(**kwargs), jnp.asarray(flags))[0])
    over = np.nonzero(theirs > F32_MAX)[0]
    stop = int(over[0]) if over.size else len(flags)
    assert_same_trajectory(ours[:stop], theirs[:stop], flags)
    assert np.all(ours[stop:] == np.inf)


def test_deepspeed_inf_is_sticky_where_deepspeed_comes_back():
    flags = np.array([True] * 30 + [False] * 40)
    kwargs = dict(init_scale=2.0**120, scale_window=1, min_scale=1.0, delayed_shift=1)
    reference = ref.DeepSpeed(**kwargs)
    theirs = [reference.step(bool(f)) for f in flags]
    ours = np.asarray(scan_scale(jdls.presets.deepspeed(**kwargs), jnp.asarray(flags))[0])
    assert max(theirs) == 2.0**149 and theirs[-1] == 2.0**109  # DeepSpeed: out and back
    first = theirs.index(2.0**128)
    assert ours[first - 1] == 2.0**127 and np.all(ours[first:] == np.inf)


@functools.cache
def _flax_scan():
    def body(ds, finite):
        c = jnp.where(finite, 1.0, jnp.inf)
        ds = ds.value_and_grad(lambda x: x * c)(jnp.float32(1.0))[0]
        return ds, ds.scale

    return jax.jit(lambda ds, flags: jax.lax.scan(body, ds, flags)[1])


@SETTINGS
@given(flags=runs(400, LONG), s0=any_scale(2.0**-120, 2.0**127))
def test_flax_clamps_at_float32_max_and_tiny(flags, s0):
    """Flax clamps growth at float32's max (not a power of two) and backoff at
    ``minimum_scale`` (float32 tiny by default): never inf, never 0."""
    from flax.training.dynamic_scale import DynamicScale

    theirs = np.asarray(
        _flax_scan()(DynamicScale(growth_interval=1, scale=jnp.float32(s0)), jnp.asarray(flags))
    )
    ours = np.asarray(
        scan_scale(jdls.presets.flax(growth_interval=1, scale=s0), jnp.asarray(flags))[0]
    )
    assert_same_trajectory(ours, theirs, flags)
    assert ours.min() >= TINY and ours.max() <= F32_MAX


@functools.cache
def _jmp_scan(period):
    import jmp

    def body(carry, finite):
        ls, counter = carry
        s = jmp.DynamicLossScale(
            loss_scale=ls, counter=counter, period=period, factor=2, min_loss_scale=F32(1.0)
        )
        s = s.adjust(finite)
        return (s.loss_scale, s.counter), s.loss_scale

    return jax.jit(lambda ls, flags: jax.lax.scan(body, (ls, jnp.int32(0)), flags)[1])


@SETTINGS
@given(flags=runs(400, LONG), s0=any_scale(1.0, 2.0**127))
def test_jmp_holds_at_its_largest_finite_scale(flags, s0):
    """jmp drops a growth to inf (the scale stays at its last finite value) and stops at
    ``min_loss_scale``."""
    pytest.importorskip("jmp")
    theirs = np.asarray(_jmp_scan(1)(jnp.float32(s0), jnp.asarray(flags)))
    ours = np.asarray(scan_scale(jdls.presets.jmp(loss_scale=s0, period=1), jnp.asarray(flags))[0])
    assert_same_trajectory(ours, theirs, flags)
    assert np.all(np.isfinite(ours)) and ours.min() >= 1.0


@SETTINGS
@given(
    flags=runs(400, LONG),
    s0=any_scale(2.0**-14, 2.0**31),
    tolerance=st.sampled_from([0.0, 0.3]),
)
def test_cerebras_clamps_at_both_ends(flags, s0, tolerance):
    kwargs = dict(steps_per_increase=2, overflow_tolerance=tolerance, half_dtype="cbfloat16")
    reference = ref.Cerebras(init_scale=s0, max_loss_scale=2.0**31, **kwargs_ref(kwargs))
    theirs = [reference.step(bool(f)) for f in flags]
    ours = np.asarray(
        scan_scale(jdls.presets.cerebras(init_scale=s0, **kwargs), jnp.asarray(flags))[0]
    )
    assert_same_trajectory(ours, theirs, flags)
    assert ours.min() >= 2.0**-14 and ours.max() <= 2.0**31


def kwargs_ref(kwargs):
    return {k: v for k, v in kwargs.items() if k != "half_dtype"}


# --------------------------------------------------------------------------------------------
# jdls.wrap: skips, statistics and the scale against a Python reference.
# --------------------------------------------------------------------------------------------

WRAP_STEPS = 400


def _wrap_cases():
    """(scale, reference factory) per preset; the references step on a finite flag."""
    return {  # Cerebras' wrap options (skip_norm_overflow) are in _WRAP_OPTIONS
        "default": (lambda: jdls.DynamicScale(growth_interval=3), None),
        "pytorch": (
            lambda: jdls.presets.pytorch(init_scale=2.0**10, growth_interval=3),
            lambda: ref.PyTorch(init_scale=2.0**10, growth_interval=3),
        ),
        "flax": (lambda: jdls.presets.flax(growth_interval=3, scale=2.0**10), None),
        "jmp": (lambda: jdls.presets.jmp(loss_scale=2.0**10, period=3), None),
        "keras": (
            lambda: jdls.presets.keras(2.0**10, 3),
            lambda: ref.Keras(2.0**10, 3),
        ),
        "deepspeed": (
            lambda: jdls.presets.deepspeed(init_scale=2.0**10, scale_window=3),
            lambda: ref.DeepSpeed(init_scale=2.0**10, scale_window=3),
        ),
        "megatron": (
            lambda: jdls.presets.megatron(initial_scale=2.0**10, growth_interval=3),
            lambda: ref.Megatron(initial_scale=2.0**10, growth_interval=3),
        ),
        "cerebras": (
            lambda: jdls.presets.cerebras(steps_per_increase=3, overflow_tolerance=0.2),
            lambda: ref.Cerebras(steps_per_increase=3, overflow_tolerance=0.2),
        ),
    }


#: Wrap arguments of a preset besides its scale: Cerebras decides finiteness from the float32
#: norm, now a wrap argument (what jdls.presets.cerebras_wrap passes for a dynamic scale).
_WRAP_OPTIONS = {"cerebras": {"skip_norm_overflow": True}}


@functools.cache
def _wrap_runner(name: str, skip_with: str):
    make_scale, _ = _wrap_cases()[name]
    schedule = optax.cosine_decay_schedule(1e-2, WRAP_STEPS)
    tx = jdls.wrap(
        optax.adamw(schedule), make_scale(), skip_with=skip_with, **_WRAP_OPTIONS.get(name, {})
    )
    params = {"w": jnp.linspace(-1.0, 1.0, 5), "b": jnp.zeros(())}
    specials = jnp.array([jnp.inf, -jnp.inf, jnp.nan])

    def body(carry, x):
        params, state = carry
        t, finite = x
        grads = jax.tree.map(lambda p: jnp.cos(p + t.astype(jnp.float32)), params)
        bad = specials[t % 3]
        grads["w"] = grads["w"].at[t % 5].set(jnp.where(finite, grads["w"][t % 5], bad))
        updates, new_state = tx.update(grads, state, params)
        new_params = optax.apply_updates(params, updates)
        kept = same_bits(new_params, params)
        s = jdls.stats(new_state)
        count = new_state.inner_state[0].count
        return (new_params, new_state), (
            s.finite,
            s.skipped_steps,
            s.consecutive_skips,
            jdls.get_scale(new_state).loss_scale,
            count,
            kept,
            jdls.all_finite(new_params),
        )

    @jax.jit
    def run(flags):
        steps = jnp.arange(flags.shape[0], dtype=jnp.int32)
        return jax.lax.scan(body, (params, tx.init(params)), (steps, flags))[1]

    return run


@settings(
    max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True
)
@given(flags=runs(40, WRAP_STEPS), name=st.sampled_from(sorted(_wrap_cases())))
@pytest.mark.parametrize("skip_with", ["cond", "select"])
@pytest.mark.full
def test_wrap_statistics_and_scale_match_reference(skip_with, flags, name):
    finite, skipped, consecutive, scales, count, kept, params_finite = (
        np.asarray(x) for x in _wrap_runner(name, skip_with)(jnp.asarray(flags))
    )
    # Skipped exactly on the non-finite steps; counters as a Python count gives them.
    np.testing.assert_array_equal(finite, flags)
    np.testing.assert_array_equal(skipped, np.cumsum(~flags))
    expected_consecutive, run = [], 0
    for f in flags:
        run = 0 if f else run + 1
        expected_consecutive.append(run)
    np.testing.assert_array_equal(consecutive, expected_consecutive)
    # The inner optimizer counts only the applied steps; a skipped step changes no parameter.
    np.testing.assert_array_equal(count, np.cumsum(flags))
    assert np.all(kept[~flags])
    assert np.all(params_finite)
    # The scale follows its rule (reference where one exists; else the preset's own adjust).
    make_scale, make_reference = _wrap_cases()[name]
    if make_reference is None:
        expected = np.asarray(scan_scale(make_scale(), jnp.asarray(flags))[0])
    else:
        reference = make_reference()
        with np.errstate(over="ignore"):
            expected = [reference.step(bool(f)) for f in flags]
    assert_same_trajectory(scales, expected, flags)


# --------------------------------------------------------------------------------------------
# A dead scale (0 or inf, as in the library mirrored) never corrupts the parameters.
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "scale",
    [
        jdls.presets.keras(2.0**127, 1).adjust(True),  # inf
        jdls.presets.keras(2.0**-126).adjust(False),  # 0
        jdls.presets.pytorch(init_scale=2.0**-126).adjust(False),  # flushed to 0
        jdls.presets.megatron(initial_scale=2.0**127, growth_interval=1).adjust(True),  # inf
    ],
    ids=["keras-inf", "keras-zero", "pytorch-zero", "megatron-inf"],
)
@pytest.mark.full(keep=1)
def test_dead_scale_skips_every_step_and_never_corrupts(scale):
    assert float(scale.loss_scale) in (0.0, np.inf)
    tx = jdls.wrap(optax.adam(1e-2), scale)
    params = {"w": jnp.linspace(-1.0, 1.0, 4)}
    state = tx.init(params)

    @jax.jit
    def step(params, state):
        s = jdls.get_scale(state)
        _, grads = s.value_and_grad(lambda p: jnp.sum(p["w"] ** 2))(params)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    p, s = params, state
    for _ in range(20):
        p, s = step(p, s)
    assert np.asarray(p["w"]).tobytes() == np.asarray(params["w"]).tobytes()
    assert int(jdls.stats(s).skipped_steps) == 20 and int(jdls.stats(s).consecutive_skips) == 20
    assert float(jdls.get_scale(s).loss_scale) == float(scale.loss_scale)
    assert int(s.inner_state[0].count) == 0


def test_skip_counters_saturate_instead_of_wrapping():
    tx = jdls.wrap(optax.sgd(0.1), jdls.DynamicScale())
    params = {"w": jnp.zeros(2)}
    state = tx.init(params)
    big = jnp.int32(np.iinfo(np.int32).max - 1)
    state = state._replace(stats=state.stats._replace(skipped_steps=big, consecutive_skips=big))
    for _ in range(3):
        _, state = tx.update({"w": jnp.array([jnp.nan, 0.0])}, state, params)
    assert int(jdls.stats(state).skipped_steps) == np.iinfo(np.int32).max
    assert int(jdls.stats(state).consecutive_skips) == np.iinfo(np.int32).max
