"""One decision per rule, on every path: per-layer and per-loss scales decide as the global path.

Each rule of ``jdls.rules`` (the default ``DynamicScale``'s ``GrowBackoff``,
``OverflowTolerance``, ``Adaptive`` through ``jdls.AdaptiveScale``) runs a few steps of one
float16 layer on each path: the global ``scale.value_and_grad`` with ``jdls.wrap``, per-layer
scales (``jdls.layer_scaled_value_and_grad`` and ``jdls.update_sites``), and per-loss scales
(``jdls.multi_loss_value_and_grad`` in both backward modes and ``jdls.adjust_loss_scales``).
With one layer, or one loss, the scale after every step, whether the step was skipped, and the
gradients equal the global path's bit for bit, in each case: all-zero gradients for the first
steps (a loss weight of 0), a float16 loss, an overflow. The two decisions the per-layer and
per-loss paths used to take apart: an all-zero measurement (the rule's own look, not a climb of
the whole usable range per step) and a 16-bit loss (multiplied by at most ``2**15``).

A site's measurement (a probe) comes out of ``jdls.multi_loss_value_and_grad`` as the global
path returns it for the sum of the losses: coded (``Measured``), never unscaled, weighted or
summed like a gradient.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _helpers import exported_rules

import jdls
from jdls._sites.measured import Measured

RULES: dict[str, Callable[[], jdls.LossScale]] = {
    "GrowBackoff": lambda: jdls.DynamicScale(growth_interval=2),  # the default, from 2**15
    "OverflowTolerance": lambda: jdls.DynamicScale(
        2.0**15, jdls.rules.OverflowTolerance(growth_interval=2, tolerance=0.3)
    ),
    "Adaptive": jdls.AdaptiveScale,
}
X = jnp.array([1.0, -2.0, 3.0, 0.5])
BIG = jnp.array([1.0, 3e4, 3.0, 0.5])  # its gradient, 30, times 2**15 overflows float16
# Per case: the loss's dtype, and per step its weight and input.
CASES: dict[str, tuple[Any, list[tuple[float, jax.Array]]]] = {
    "zeros_first": (jnp.float32, [(0.0, X)] * 4 + [(1.0, X)] * 4),
    "float16_loss": (jnp.float16, [(1.0, X)] * 6),
    "overflow": (jnp.float32, [(1.0, X), (1.0, X), (1.0, BIG), (1.0, X), (1.0, X)]),
}
PARAMS = {"w": jnp.ones(4)}
PATHS = ("layer", "loss-one", "loss-per_loss")


def _loss(dtype: Any, p: Any, weight: Any, x: jax.Array, site: Any = None) -> jax.Array:
    """One float16 layer; the loss in ``dtype``, times ``weight``. Its gradients (``1e-3 *
    x``) are the largest values of the backward pass, as an adaptive rule assumes."""
    h = p["w"].astype(jnp.float16) * x.astype(jnp.float16)
    if site is not None:
        h = jdls.apply_site(h, site)
    return weight.astype(dtype) * (jnp.sum(h.astype(dtype)) * jnp.asarray(1e-3, dtype))


@functools.cache
def _step(path: str, rule: str, dtype: Any) -> Callable[..., Any]:
    """``step(state, weight, x) -> (state, scale, skipped, grads)``, jitted, per path."""
    loss = functools.partial(_loss, dtype)
    if path == "global":
        tx = jdls.wrap(optax.sgd(0.0), RULES[rule]())

        def step(state, weight, x):
            scale = jdls.get_scale(state)
            _, grads = scale.value_and_grad(loss)(PARAMS, weight, x)
            _, state = tx.update(grads, state, PARAMS)
            return state, jdls.get_scale(state), jdls.stats(state).skipped, grads

    elif path == "layer":

        def step(state, weight, x):
            fn = jdls.layer_scaled_value_and_grad(lambda p, s, w, x: loss(p, w, x, s["w"]))
            _, (grads, measured) = fn(PARAMS, state, weight, x)
            finite = jdls.all_finite(grads)
            state = jdls.update_sites(state, measured, finite)
            return state, state["w"].value["scale"], ~finite, grads

    else:
        backward = path.split("-")[1]

        def step(state, weight, x):
            fn = jdls.multi_loss_value_and_grad(
                lambda p, w, x: {"only": loss(p, w, x)}, state, backward=backward, with_amax=True
            )
            _, grads, finite, amax = fn(PARAMS, weight, x)
            state = jdls.adjust_loss_scales(state, finite, amax)
            return state, state["only"], ~jdls.all_finite(grads), grads

    return jax.jit(step)


def _initial(path: str, rule: str) -> Any:
    if path == "global":
        return jdls.wrap(optax.sgd(0.0), RULES[rule]()).init(PARAMS)
    if path == "layer":
        return {"w": jdls.layer_site(RULES[rule](), 0)}
    return {"only": RULES[rule]()}


def _run(path: str, rule: str, case: str) -> list[tuple[Any, bool, Any]]:
    """Per step: the scale after it, whether it was skipped, the gradients."""
    dtype, steps = CASES[case]
    step, state, out = _step(path, rule, dtype), _initial(path, rule), []
    for weight, x in steps:
        state, scale, skipped, grads = step(state, jnp.float32(weight), x)
        out.append((scale, bool(skipped), np.asarray(grads["w"])))
    return out


CELLS = [(rule, case) for case in CASES for rule in RULES]
QUICK = {
    ("Adaptive", "zeros_first"),
    ("GrowBackoff", "float16_loss"),
    ("Adaptive", "float16_loss"),
    ("OverflowTolerance", "overflow"),
}


@pytest.mark.parametrize(
    "rule, case",
    [
        pytest.param(*cell, marks=() if cell in QUICK else pytest.mark.full, id="-".join(cell))
        for cell in CELLS
    ],
)
def test_every_path_decides_as_the_global_path(rule: str, case: str) -> None:
    want = _run("global", rule, case)
    if case != "overflow":  # the global path itself: nothing skipped, every gradient finite
        assert not any(skipped for _, skipped, _ in want), want
        assert all(np.isfinite(g).all() for _, _, g in want)
    for path in PATHS:
        got = _run(path, rule, case)
        for k, ((scale, skipped, grads), (w_scale, w_skipped, w_grads)) in enumerate(
            zip(got, want, strict=True)
        ):
            where = f"{path}, step {k}"
            assert scale == w_scale, (where, scale, w_scale)
            assert skipped == w_skipped, where
            np.testing.assert_array_equal(grads, w_grads, err_msg=where)


def test_the_cells_cover_every_rule() -> None:
    assert exported_rules() == set(RULES)
    assert {r for r, _ in QUICK} == set(RULES) and {c for _, c in QUICK} == set(CASES)


# --- A measurement over several losses: as the global path measures the sum. ----------------


def _losses(p: Any, sites: Any, x: jax.Array) -> dict[str, jax.Array]:
    """A shared trunk and two heads; a probe on the trunk and one on head ``a``."""
    h = jdls.apply_site(jnp.tanh(x @ p["trunk"]), sites["trunk"])
    a = jdls.apply_site(h @ p["a"], sites["a"])
    return {"a": jnp.sum(a**2), "b": jnp.sum(h @ p["b"])}


@pytest.mark.parametrize("backward", ["one", "per_loss"])
@pytest.mark.full  # about 8 s; the other paths deciding as the global path stay
def test_multi_loss_returns_measurements_as_the_global_path(backward: str) -> None:
    keys = jax.random.split(jax.random.key(0), 4)
    params = {
        "trunk": jax.random.normal(keys[0], (4, 8)),
        "a": jax.random.normal(keys[1], (8, 2)),
        "b": jax.random.normal(keys[2], (8, 1)),
    }
    x = jax.random.normal(keys[3], (3, 4))
    sites = {n: jdls.Site(jdls.Probe()) for n in ("trunk", "a")}
    total = lambda p, s, x: sum(_losses(p, s, x).values())  # noqa: E731
    _, (grads, measured) = jdls.StaticScale(8.0).value_and_grad(total, (0, 1))(params, sites, x)
    scales = {"a": jdls.StaticScale(8.0), "b": jdls.StaticScale(8.0)}
    fn = jdls.multi_loss_value_and_grad(_losses, scales, argnums=(0, 1), backward=backward)
    _, (got_grads, got), finite = fn(params, sites, x)
    assert all(bool(f) for f in finite.values())
    for name in sites:
        assert type(got[name]) is Measured  # coded, as the global path returns it
        np.testing.assert_array_equal(got[name].value, measured[name].value, err_msg=name)
    assert jdls.Telemetry.of(got).uses.tolist() == [1.0, 1.0]  # a, trunk: each passed once
    for name in params:
        np.testing.assert_allclose(got_grads[name], grads[name], rtol=1e-5)  # float32 rounding
