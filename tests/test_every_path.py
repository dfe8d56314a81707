"""Every scale on every path that adjusts a scale: the same scale as ``jdls.wrap``, or an error.

Scale kinds: ``NoOpScale``, ``StaticScale``, ``DynamicScale`` with each rule of
``jdls.rules``, every scale preset of ``jdls.presets``, ``AdaptiveScale``. Paths: ``jdls.wrap``
(jitted and eager), ``jdls.retrying``, ``jdls.wrap_groups``, ``jdls.accumulate``,
``jdls.linen.TrainState.apply_gradients``, an ``nnx.Optimizer`` (with ``jdls.nnx.set_scale`` and
``jdls.nnx.value_and_grad``), per-layer scales (``jdls.update_sites``), per-loss scales (``jdls.adjust_loss_scales``), and
``presets.cerebras_wrap``. After a few steps mixing finite and overflowing gradients, each
path's scale must equal (value equality: same rule, bit-identical arrays) what ``jdls.wrap``
gives for the same gradients, in the sense the path documents (a dropped micro-batch, a
failed retry attempt are one overflowing step each), or the path must refuse with an error
that says what to do. An observing rule (``rule.observes``, ``AdaptiveScale``) left
without its measurement used to stay at its start: the equality catches that.
"""

from __future__ import annotations

import functools
import inspect
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import optax
import pytest
from _helpers import exported_rules, maybe_jit

import jdls

ROOT = Path(__file__).resolve().parents[1]
INF, NAN = float("inf"), float("nan")

# --------------------------------------------------------------------------------------------
# The scale kinds.
# --------------------------------------------------------------------------------------------

RULES: dict[str, Callable[[], jdls.rules.Rule]] = {
    "GrowBackoff": lambda: jdls.rules.GrowBackoff(growth_interval=2, hysteresis=2),
    "OverflowTolerance": lambda: jdls.rules.OverflowTolerance(growth_interval=2, tolerance=0.3),
    "Adaptive": lambda: jdls.rules.Adaptive(margin=4),
}
PRESETS: dict[str, Callable[[], jdls.LossScale]] = {
    "pytorch": lambda: jdls.presets.pytorch(init_scale=2.0**10, growth_interval=2),
    "flax": lambda: jdls.presets.flax(scale=2.0**10, growth_interval=1),
    "jmp": lambda: jdls.presets.jmp(2.0**10, period=2),
    "keras": lambda: jdls.presets.keras(initial_scale=2.0**10, dynamic_growth_steps=2),
    "deepspeed": lambda: jdls.presets.deepspeed(init_scale=2.0**10, scale_window=1),
    "deepspeed_fp16": lambda: jdls.presets.deepspeed_fp16(init_scale=2.0**10, scale_window=1),
    "megatron": lambda: jdls.presets.megatron(initial_scale=2.0**10, growth_interval=2),
    "cerebras": lambda: jdls.presets.cerebras(init_scale=2.0**10, steps_per_increase=1),
}
# Presets that convert a library's saved state or object into one of the scales above.
CONVERTERS = {"from_jmp", "from_pytorch_state_dict", "from_cerebras_state_dict"}
KINDS: dict[str, Callable[[], jdls.LossScale]] = {
    "NoOpScale": jdls.NoOpScale,
    "StaticScale": lambda: jdls.StaticScale(2.0**10),
    **{
        f"DynamicScale-{name}": (lambda r=r: jdls.DynamicScale(2.0**10, r()))
        for name, r in RULES.items()
    },
    **{f"preset-{name}": p for name, p in PRESETS.items()},
    "AdaptiveScale": jdls.AdaptiveScale,
}
OBSERVING = {"DynamicScale-Adaptive", "AdaptiveScale"}


def test_every_rule_and_scale_preset_is_walked():
    """A rule or preset added later must join the walk."""
    assert exported_rules() == set(RULES)
    presets = {n for n in jdls.presets.__all__ if callable(getattr(jdls.presets, n))}
    scale_presets = {n for n in presets if not n.startswith("to_") and not n.endswith("_wrap")}
    assert scale_presets - CONVERTERS == set(PRESETS)
    assert {k for k, f in KINDS.items() if getattr(f(), "rule", None) and f().rule.observes} == (
        OBSERVING
    )


# --------------------------------------------------------------------------------------------
# The gradients, and the reference: jdls.wrap.
# --------------------------------------------------------------------------------------------

PARAMS = {"a": {"w": jnp.zeros(3)}, "b": {"w": jnp.zeros(2)}}
# Finite and overflowing steps mixed; the magnitudes differ so that an observing rule moves.
STEPS = [
    {"a": {"w": jnp.array([2.0**-20, 0.0, 1e-7])}, "b": {"w": jnp.array([3e-9, 0.0])}},
    {"a": {"w": jnp.array([1e-3, INF, 0.0])}, "b": {"w": jnp.array([1.0, 2.0])}},
    {"a": {"w": jnp.array([1e-3, 1e-5, 0.0])}, "b": {"w": jnp.array([2.0**-14, 0.0])}},
    {"a": {"w": jnp.array([1e-3, 1e-5, 0.0])}, "b": {"w": jnp.array([NAN, 0.0])}},
    {"a": {"w": jnp.array([0.5, 1e-5, 0.0])}, "b": {"w": jnp.array([2.0**-30, 0.0])}},
    {"a": {"w": jnp.array([3e-6, 1e-5, 0.0])}, "b": {"w": jnp.array([2.0**-10, 1.0])}},
]


@functools.cache
def _wrap_of(kind: str) -> tuple[Any, Any]:
    """``jdls.wrap(optax.sgd(0.1), scale)`` for a kind, and its jitted update (one per kind)."""
    tx = jdls.wrap(optax.sgd(0.1), KINDS[kind]())
    return tx, jax.jit(tx.update)


def reference(kind: str, grads_seq: list[Any], params: Any = PARAMS) -> list[Any]:
    """The scale after each step of ``jdls.wrap(optax.sgd(0.1), scale)`` fed ``grads_seq``
    (jitted; ``test_wrap_jitted_and_eager_agree`` checks it against the eager wrap)."""
    tx, update = _wrap_of(kind)
    state = tx.init(params)
    out = []
    for g in grads_seq:
        _, state = update(g, state, params)
        out.append(jdls.get_scale(state))
    return out


def bad_like(tree: Any) -> Any:
    """Gradients shaped like ``tree`` holding a NaN: one overflowing step for the rule."""
    return jax.tree_util.tree_map(lambda x: jnp.full_like(x, NAN), tree)


def assert_same_scales(got: list[Any], want: list[Any]) -> None:
    assert len(got) == len(want)
    for k, (g, w) in enumerate(zip(got, want, strict=True)):
        assert g == w, (k, g, w)


def moved(scales: list[Any]) -> bool:
    """Whether the scale ever left its start (an observing rule always does on STEPS)."""
    return any(float(s.loss_scale) != float(scales[0].loss_scale) for s in scales[1:])


kinds = pytest.mark.parametrize("kind", sorted(KINDS))
# Jitted for every kind; eager too for an observing rule and a rule with hysteresis (the
# eager path runs the same code; this keeps the walk fast).
kinds_jit_and_some_eager = pytest.mark.parametrize(
    "kind, jit",
    [(k, True) for k in sorted(KINDS)]
    + [(k, False) for k in ("AdaptiveScale", "preset-deepspeed")],
)


# --------------------------------------------------------------------------------------------
# The paths.
# --------------------------------------------------------------------------------------------


@kinds
@pytest.mark.full(keep=2)  # quick run: the Adaptive rule and the default
def test_wrap_jitted_and_eager_agree(kind):
    tx = jdls.wrap(optax.sgd(0.1), KINDS[kind]())
    state, eager = tx.init(PARAMS), []
    for g in STEPS:
        _, state = tx.update(g, state, PARAMS)
        eager.append(jdls.get_scale(state))
    jitted = reference(kind, STEPS)
    assert_same_scales(jitted, eager)
    assert moved(eager) == isinstance(KINDS[kind](), jdls.DynamicScale)  # STEPS move them all
    if kind in OBSERVING:
        assert float(eager[0].loss_scale) != 1.0  # it measured the first step


@kinds_jit_and_some_eager
@pytest.mark.full(keep=2)  # quick run: the Adaptive rule and the default
def test_wrap_groups(kind, jit):
    tx = jdls.wrap_groups({"a": optax.sgd(0.1), "b": optax.sgd(0.1)}, KINDS[kind]())
    update, state, got = maybe_jit(tx.update, jit), tx.init(PARAMS), []
    for g in STEPS:
        _, state = update(g, state, PARAMS)
        got.append(jdls.get_scale(state))
    assert_same_scales(got, reference(kind, STEPS))


@kinds
@pytest.mark.full(keep=2)  # quick run: the Adaptive rule and the default
def test_train_state_apply_gradients(kind):
    state = jdls.linen.TrainState.create(
        apply_fn=None, params=PARAMS, tx=jdls.wrap(optax.sgd(0.1), KINDS[kind]())
    )
    apply, got = jax.jit(lambda s, g: s.apply_gradients(grads=g)), []
    for g in STEPS:
        state = apply(state, g)
        got.append(state.scale)
    assert_same_scales(got, reference(kind, STEPS))


def _loss(p: Any, x: Any) -> jax.Array:
    """Linear in the parameters: the unscaled gradient is ``x`` (at a power-of-two scale)."""
    return sum(jnp.sum(p[k]["w"] * x[k]["w"]) for k in p)


@kinds_jit_and_some_eager
@pytest.mark.full(keep=2)  # quick run: the Adaptive rule and the default
def test_accumulate(kind, jit):
    """Two micro-batches per step, one of them overflowing on some steps: the dropped one is
    one overflow for the rule, then the step adjusts with the mean of the kept ones (a step
    whose drops exceed ``max_dropped`` is skipped, and the skip is its last drop's overflow:
    each overflow counts once)."""
    tx = jdls.wrap(optax.sgd(0.1), KINDS[kind]())
    finite = [s for s in STEPS if bool(jdls.all_finite(s))]
    # One dropped (the step goes on), none, two (more than max_dropped: skipped), one.
    pairs = [
        (finite[0], STEPS[1]),
        (finite[1], finite[2]),
        (STEPS[3], STEPS[1]),
        (finite[3], STEPS[3]),
    ]

    def step(state, xs):
        scale = jdls.get_scale(state)
        _, grads, info = jdls.accumulate(_loss, scale, PARAMS, xs, max_dropped=1)
        _, state = tx.update(grads, jdls.set_scale(state, info.scale), PARAMS)
        return state, grads, info

    step = maybe_jit(step, jit)
    state, got, fed, ends = tx.init(PARAMS), [], [], []
    for x0, x1 in pairs:
        xs = jax.tree_util.tree_map(lambda a, b: jnp.stack([a, b]), x0, x1)
        state, grads, info = step(state, xs)
        skipped = bool(info.skip) or int(info.kept) == 0  # the wrap skips: the last drop
        fed += [bad_like(grads)] * (int(info.dropped) - skipped) + [grads]
        ends.append(len(fed) - 1)
        got.append(jdls.get_scale(state))
    want = reference(kind, fed)
    assert_same_scales(got, [want[i] for i in ends])
    assert len(fed) == len(pairs) + 3  # four micro-batches were dropped, one skipped a step
    assert bool(jdls.stats(state).finite)  # the last step was taken, the third skipped


@kinds
@pytest.mark.full(keep=2)  # quick run: the Adaptive rule and the default
def test_retrying(kind):
    """A float16 backward that overflows at scale 2**10 and not at 2**9: each failed attempt
    that is retried counts as the overflows that make the rule back off (``back_off()``: one,
    or with hysteresis those it would forgive too), the attempt that succeeds is one finite
    step and a failed last attempt one overflowing step, as feeding ``jdls.wrap`` the
    attempts one by one. A scale that cannot back off is refused."""
    params = {"w": jnp.zeros(2)}
    xs = [jnp.array([1e-3, 2.0**-20]), jnp.array([100.0, 1.0]), jnp.array([3e-5, 0.0])]

    def value(p, x):
        return jnp.sum((p["w"].astype(jnp.float16) * x.astype(jnp.float16)).astype(jnp.float32))

    scale = KINDS[kind]()
    tx = jdls.wrap(optax.sgd(0.1), scale)
    retrying = jdls.retrying(value, tx, retries=2)
    if not isinstance(scale, jdls.DynamicScale):
        with pytest.raises(ValueError, match="needs a scale that backs off"):
            retrying(params, tx.init(params), xs[0])
        return

    @jax.jit
    def step(state, x):
        return retrying(params, state, x)[1]

    state, got = tx.init(params), []
    for x in xs * 2:
        state = step(state, x)
        got.append(jdls.get_scale(state))
    # The reference: each attempt fed to jdls.wrap, at the scale the previous one left.
    ref_tx, ref_update = _wrap_of(kind)
    ref, want = ref_tx.init(params), []
    for x in xs * 2:
        for attempt in range(3):
            before = jdls.get_scale(ref)
            _, grads = before.value_and_grad(value)(params, x)
            _, ref = ref_update(grads, ref, params)
            if bool(jdls.stats(ref).finite):
                break
            if attempt < 2:  # retried: at the scale the rule backs off to
                ref = jdls.set_scale(ref, before.back_off())
        want.append(jdls.get_scale(ref))
    assert_same_scales(got, want)
    assert int(jdls.stats(state).retried_steps) > 0


@kinds_jit_and_some_eager
@pytest.mark.full(keep=2)  # quick run: the Adaptive rule and the default
def test_update_sites_of_per_layer_scales(kind, jit):
    """Per layer: when every layer is finite each scale moves with its own layer's gradients;
    when one is not, its scale backs off and the others stay. Each layer's scale is then
    ``jdls.wrap`` fed that layer's gradients on the steps where it moves."""

    def adjust(sites, g):
        measured = {
            k: jdls.Site(
                s.kind,
                {
                    "scale": None,
                    "ratio": jnp.zeros(()),
                    "amax": jnp.max(
                        jnp.abs(
                            jnp.concatenate([jnp.ravel(v) for v in jax.tree_util.tree_leaves(g[k])])
                        )
                    ),
                    "finite": jdls.all_finite(g[k]).astype(jnp.float32),
                },
            )
            for k, s in sites.items()
        }
        return jdls.update_sites(sites, measured, jdls.all_finite(g))

    adjust = maybe_jit(adjust, jit)
    sites = {"a": jdls.layer_site(KINDS[kind](), 0), "b": jdls.layer_site(KINDS[kind](), 1)}
    got: dict[str, list[Any]] = {"a": [], "b": []}
    fed: dict[str, list[Any]] = {"a": [], "b": []}
    for g in STEPS:
        sites = adjust(sites, g)
        everything = bool(jdls.all_finite(g))
        for k in sites:
            if everything or not bool(jdls.all_finite(g[k])):
                fed[k].append(g[k])
                got[k].append(sites[k].value["scale"])
    for k in sites:
        assert_same_scales(got[k], reference(kind, fed[k], PARAMS[k]))


nnx = pytest.importorskip("flax.nnx")


class _Model(nnx.Module):
    def __init__(self) -> None:
        self.a = nnx.Param(jnp.zeros(3))
        self.b = nnx.Param(jnp.zeros(2))


@kinds_jit_and_some_eager
@pytest.mark.full(keep=2)  # quick run: the Adaptive rule and the default
def test_nnx_optimizer(kind, jit):
    """``jdls.nnx.set_scale``, then ``jdls.nnx.value_and_grad`` and ``optimizer.update`` each step."""
    model = _Model()
    optimizer = nnx.Optimizer(model, jdls.wrap(optax.sgd(0.1), jdls.DynamicScale()), wrt=nnx.Param)
    jdls.nnx.set_scale(optimizer, KINDS[kind]())

    def train(model, optimizer, x):
        loss = lambda m: jnp.sum(m.a * x["a"]["w"]) + jnp.sum(m.b * x["b"]["w"])  # noqa: E731
        _, grads = jdls.nnx.value_and_grad(loss, jdls.get_scale(optimizer))(model)
        optimizer.update(model, grads)
        return grads

    train = nnx.jit(train) if jit else train
    got, fed = [], []
    for x in STEPS:
        grads = nnx.to_pure_dict(train(model, optimizer, x))
        fed.append({"a": {"w": grads["a"]}, "b": {"w": grads["b"]}})
        got.append(jdls.get_scale(optimizer))
    assert_same_scales(got, reference(kind, fed))


def test_cerebras_wrap_is_wrap_with_the_cerebras_scale():
    options = {"init_scale": 2.0**10, "steps_per_increase": 1}
    tx = jdls.presets.cerebras_wrap(optax.sgd(0.1), **options)
    state, got = tx.init(PARAMS), []
    for g in STEPS:
        _, state = tx.update(g, state, PARAMS)
        got.append(jdls.get_scale(state))
    assert_same_scales(got, reference("preset-cerebras", STEPS))


# --- Per-loss scales. ------------------------------------------------------------------------
# ``jdls.multi_loss_value_and_grad`` returns per-loss finite flags (and, with ``with_amax``,
# each loss's measurement); ``jdls.adjust_loss_scales`` adjusts a scale per loss with them.
# Adjusting an observing rule by hand with the flag alone is a clear error. Each entry of
# PER_LOSS_PATHS is ``(name, fn)`` with ``fn(scales, losses, params, x) -> new_scales``:
# ``test_per_loss_adjustment`` walks it for every kind against ``jdls.wrap`` fed each loss's
# own gradients (no global skip: each loss's scale follows its own gradients).
def _losses(p, x):
    return {"a": jnp.sum(p["a"]["w"] * x["a"]["w"]), "b": jnp.sum(p["b"]["w"] * x["b"]["w"])}


def _adjust_loss_scales(backward: str, jit: bool) -> Callable[..., dict[str, Any]]:
    """``jdls.adjust_loss_scales`` fed ``multi_loss_value_and_grad(..., with_amax=True)``."""

    def step(scales, losses, params, x):
        fn = jdls.multi_loss_value_and_grad(losses, scales, backward=backward, with_amax=True)
        _, _, finite, amax = fn(params, x)
        return jdls.adjust_loss_scales(scales, finite, amax)

    if not jit:
        return step
    jitted = jax.jit(step, static_argnums=1)
    return lambda scales, losses, params, x: jitted(scales, losses, params, x)


PER_LOSS_PATHS: list[tuple[str, Callable[..., dict[str, Any]]]] = [
    (
        f"adjust_loss_scales-{backward}-{'jit' if jit else 'eager'}",
        _adjust_loss_scales(backward, jit),
    )
    for backward in ("one", "per_loss")
    for jit in (True, False)
]


@kinds
@pytest.mark.full(keep=2)  # quick run: the Adaptive rule and the default
def test_per_loss_by_hand(kind):
    """Each loss's scale adjusted by its own finite flag: ``jdls.wrap`` fed that flag's kind of
    step (the rule sees finite or not); an observing rule refuses without a measurement."""
    scales = {"a": KINDS[kind](), "b": KINDS[kind]()}
    fn = jdls.multi_loss_value_and_grad(_losses, scales)
    _, _, finite = fn(PARAMS, STEPS[1])
    if kind in OBSERVING:
        with pytest.raises(ValueError, match=r"grad_amax=.*jdls.update_sites"):
            scales["a"].adjust(finite["a"])
        return
    got: dict[str, list[Any]] = {"a": [], "b": []}
    fed: dict[str, list[Any]] = {"a": [], "b": []}
    for x in STEPS:
        fn = jdls.multi_loss_value_and_grad(_losses, scales)
        _, _, finite = fn(PARAMS, x)
        scales = {k: s.adjust(finite[k]) for k, s in scales.items()}
        for k in scales:
            fed[k].append(x[k] if bool(finite[k]) else bad_like(x[k]))
            got[k].append(scales[k])
    for k in scales:
        assert_same_scales(got[k], reference(kind, fed[k], PARAMS[k]))


def test_per_loss_adjustment_joins_the_walk():
    """Once the per-loss adjustment is public, it must be in PER_LOSS_PATHS."""
    if hasattr(jdls, "adjust_loss_scales"):
        assert PER_LOSS_PATHS, "add jdls.adjust_loss_scales to PER_LOSS_PATHS"


def reference_per_loss(kind: str, losses: Any, x: Any) -> dict[str, list[Any]]:
    """Per loss, ``jdls.wrap`` fed that loss's own gradients, step after step."""
    keys = losses(PARAMS, x[0]).keys()
    return {
        k: reference(kind, [jax.grad(lambda p, s=s, k=k: losses(p, s)[k])(PARAMS) for s in x])
        for k in keys
    }


@kinds
@pytest.mark.parametrize("path", PER_LOSS_PATHS, ids=[name for name, _ in PER_LOSS_PATHS])
def test_per_loss_adjustment(kind, path):
    _, adjust = path
    scales = {"a": KINDS[kind](), "b": KINDS[kind]()}
    got: dict[str, list[Any]] = {"a": [], "b": []}
    for x in STEPS:
        scales = adjust(scales, _losses, PARAMS, x)
        for k in scales:
            got[k].append(scales[k])
    want = reference_per_loss(kind, _losses, STEPS)
    for k in scales:
        assert_same_scales(got[k], want[k])


# --------------------------------------------------------------------------------------------
# The error for an observing rule without its measurement.
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", sorted(OBSERVING))
def test_observing_rule_without_measurement_is_an_error_that_says_how(kind):
    scale = KINDS[kind]()
    with pytest.raises(ValueError) as info:
        scale.adjust(jnp.bool_(True))
    message = str(info.value)
    for hint in (
        "scale.adjust(finite, grad_amax=optax.tree_utils.tree_norm(grads, ord=jnp.inf))",
        "jdls.wrap",
        "jdls.update_sites(sites, measurements, finite)",
        "jdls.adjust_loss_scales",
    ):
        assert hint in message, hint
    with pytest.raises(ValueError, match="grad_amax"):
        jax.jit(lambda s, f: s.adjust(f))(scale, True)
    # An overflow needs no measurement; the measurement it is given is the rule's.
    assert scale.adjust(False) == scale.adjust(jnp.bool_(False), 1.0)
    grads = STEPS[0]
    amax = optax.tree_utils.tree_norm(grads, ord=jnp.inf)
    assert scale.adjust(True, amax) == reference(kind, [grads])[0]


def test_the_error_names_only_functions_that_exist():
    """Every ``jdls.name`` the error suggests is public (the lead merges the per-loss one)."""
    with pytest.raises(ValueError) as info:
        jdls.AdaptiveScale().adjust(True)
    message = str(info.value)
    for name in re.findall(r"jdls\.(\w+)", message):
        assert hasattr(jdls, name), name


# --------------------------------------------------------------------------------------------
# Public text speaks of the product only.
# --------------------------------------------------------------------------------------------


def test_public_text_names_no_issue_numbers():
    pattern = re.compile(r"issue[ -]?#?[0-9]", re.IGNORECASE)
    found = []
    for top in ("docs", "jdls", "tests", "benchmarks", "examples", "README.md"):
        path = ROOT / top
        files = [path] if path.is_file() else sorted(path.rglob("*"))
        for f in files:
            if f.suffix not in (".md", ".py") or not f.is_file():
                continue
            for n, line in enumerate(f.read_text(encoding="utf-8").splitlines(), 1):
                if pattern.search(line) and f.name != Path(__file__).name:
                    found.append(f"{f.relative_to(ROOT)}:{n}")
    assert not found, found


def test_signature_of_update_sites_is_kept():
    assert list(inspect.signature(jdls.update_sites).parameters) == [
        "sites",
        "measurements",
        "finite",
        "axis_name",
    ]
