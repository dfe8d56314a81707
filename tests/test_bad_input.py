"""Every invalid configuration and call gives an error that names the problem and the fix.

One table, :data:`CASES`: an id, the bad call, the exception type, and a regular expression
that the message must match (it names the problem, and the fix where the fix is not obvious
from the problem). ``docs/reliability.md`` lists the same ids in its bad-input table; a test
below checks that the two agree.

Some mistakes cannot be detected at run time (unscaling twice, passing scaled gradients to
``jdls.wrap``): the tests at the end pin down their exact symptom, which the documentation
describes with the fix.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _helpers import INF, NAN, ROOT, assert_bitwise_equal

import jdls

PARAMS = {"w": jnp.ones(3)}


class Case(NamedTuple):
    id: str
    call: Callable[[], Any]
    error: type[BaseException]
    message: str  # a regular expression, searched in str(exception)


def _wrap_state():
    return jdls.wrap(optax.sgd(0.1), jdls.DynamicScale()).init(PARAMS)


def _two_wraps():
    return optax.chain(
        jdls.wrap(optax.sgd(0.1), jdls.DynamicScale()),
        jdls.wrap(optax.sgd(0.1), jdls.DynamicScale()),
    ).init(PARAMS)


def _update(tx, grads, state=None, params=PARAMS):
    return tx.update(grads, tx.init(params) if state is None else state, params)


_sd_torch = {
    "scale": 1024.0,
    "growth_factor": 2.0,
    "backoff_factor": 0.5,
    "growth_interval": 2000,
    "_growth_tracker": 0,
}
_sd_cerebras = {
    "loss_scale": 1024.0,
    "steps_since_rescale": 0,
    "overflows_since_rescale": 0,
    "num_skipped_steps": 0,
}

_SITED = {"w": jnp.ones(3), "probe": jdls.Site(jdls.Probe())}


def _sited_loss(p):
    return jnp.sum(jdls.apply_site(p["w"] * 2.0, p["probe"]) ** 2)


def _sited_step(tx, apply=optax.apply_updates):
    """One step of ``tx`` on parameters holding a probe, applied by ``apply``."""
    state = tx.init(_SITED)
    _, grads = jdls.get_scale(state).value_and_grad(_sited_loss)(_SITED)
    updates, state = tx.update(grads, state, _SITED)
    return apply(_SITED, updates)


CASES = [
    # -- the scales: wrong types --------------------------------------------------------------
    Case(
        "scale-str",
        lambda: jdls.DynamicScale("1024"),
        TypeError,
        r"loss_scale must be a real number, got '1024'",
    ),
    Case(
        "scale-none",
        lambda: jdls.DynamicScale(None),
        TypeError,
        r"loss_scale must be a real number, got None",
    ),
    Case(
        "static-str", lambda: jdls.StaticScale("8"), TypeError, r"loss_scale must be a real number"
    ),
    Case(
        "interval-float",
        lambda: jdls.DynamicScale(growth_interval=2.5),
        TypeError,
        r"growth_interval must be an int, got 2.5",
    ),
    Case(
        "interval-bool",
        lambda: jdls.DynamicScale(growth_interval=True),
        TypeError,
        r"growth_interval must be an int",
    ),
    Case(
        "hysteresis-float",
        lambda: jdls.DynamicScale(hysteresis=2.0),
        TypeError,
        r"hysteresis must be an int",
    ),
    Case(
        "noop-with-value",
        lambda: jdls.NoOpScale(2.0),
        TypeError,
        r"NoOpScale\(\) takes no arguments",
    ),
    Case(
        "rule-not-a-rule",
        lambda: jdls.DynamicScale(1.0, {"growth_interval": 3}),
        TypeError,
        r"rule must be a jdls.rules.Rule, got dict",
    ),
    Case(
        "rule-and-options",
        lambda: jdls.DynamicScale(1.0, jdls.rules.GrowBackoff(), growth_interval=3),
        TypeError,
        r"give a rule or the options of the default rule, not both: got "
        r"rule=GrowBackoff\(growth_factor=2.0, .*\) and \['growth_interval'\]; set them on the rule",
    ),
    Case(
        "unknown-option",
        lambda: jdls.DynamicScale(initial_scale=1.0, growth_interval=1),
        TypeError,
        r"DynamicScale got unknown options \['initial_scale'\]: the default rule takes "
        r"\['growth_factor', .*'growth_interval'.*\], and the first argument is the starting "
        r"scale, jdls.DynamicScale\(loss_scale, \.\.\.\) \(jdls's names: initial_scale -> "
        r"loss_scale\)",
    ),
    Case(
        "state-not-of-rule",
        lambda: jdls.DynamicScale(1.0, state={"counter": 3}),
        TypeError,
        r"state must be the counters of GrowBackoff, made by rule.initial_state\(\.\.\.\), "
        r"got \{'counter': 3\}",
    ),
    Case(
        "replace-unknown-field",
        lambda: jdls.DynamicScale().replace(scale=jnp.float32(1)),
        TypeError,
        r"unknown fields \['scale'\]; fields are .*'loss_scale'",
    ),
    # -- the scales: wrong ranges -------------------------------------------------------------
    Case(
        "scale-zero",
        lambda: jdls.DynamicScale(0.0),
        ValueError,
        r"loss_scale must be a finite number > 0, got 0.0",
    ),
    Case(
        "scale-negative",
        lambda: jdls.DynamicScale(-1.0),
        ValueError,
        r"loss_scale must be a finite number > 0",
    ),
    Case(
        "scale-inf",
        lambda: jdls.DynamicScale(INF),
        ValueError,
        r"loss_scale must be a finite number > 0, got inf",
    ),
    Case(
        "scale-nan",
        lambda: jdls.DynamicScale(NAN),
        ValueError,
        r"loss_scale must be a number, got nan",
    ),
    Case(
        "scale-over-float32",
        lambda: jdls.StaticScale(1e39),
        ValueError,
        r"loss_scale must fit in float32",
    ),
    Case(
        "scale-outside-bounds",
        lambda: jdls.DynamicScale(2.0**30),
        ValueError,
        r"loss_scale must be within \[min_loss_scale, max_loss_scale\] = \[1.0, 16777216.0\], got 1073741824.0: start inside the bounds, or widen them",
    ),
    Case(
        "scale-below-minimum",
        lambda: jdls.DynamicScale(0.5),
        ValueError,
        r"must be within \[min_loss_scale, max_loss_scale\]",
    ),
    Case(
        "growth-factor-1",
        lambda: jdls.DynamicScale(growth_factor=1.0),
        ValueError,
        r"growth_factor must be > 1, got 1.0",
    ),
    Case(
        "backoff-factor-1",
        lambda: jdls.DynamicScale(backoff_factor=1.0),
        ValueError,
        r"backoff_factor must be in the open interval \(0, 1\), got 1.0",
    ),
    Case(
        "backoff-factor-0",
        lambda: jdls.DynamicScale(backoff_factor=0.0),
        ValueError,
        r"backoff_factor must be in the open interval \(0, 1\)",
    ),
    Case(
        "interval-0",
        lambda: jdls.DynamicScale(growth_interval=0),
        ValueError,
        r"growth_interval must be >= 1, got 0",
    ),
    Case(
        "interval-over-int32",
        lambda: jdls.DynamicScale(growth_interval=2**31),
        ValueError,
        r"growth_interval must fit in int32",
    ),
    Case(
        "hysteresis-0",
        lambda: jdls.DynamicScale(hysteresis=0),
        ValueError,
        r"hysteresis must be >= 1, got 0",
    ),
    Case(
        "min-above-max",
        lambda: jdls.DynamicScale(4.0, min_loss_scale=8.0, max_loss_scale=2.0),
        ValueError,
        r"min_loss_scale must be <= max_loss_scale",
    ),
    Case(
        "min-zero",
        lambda: jdls.DynamicScale(min_loss_scale=0.0),
        ValueError,
        r"min_loss_scale must be a finite number > 0",
    ),
    Case(
        "static-zero",
        lambda: jdls.StaticScale(0),
        ValueError,
        r"loss_scale must be a finite number > 0",
    ),
    Case(
        "static-subnormal",
        lambda: jdls.StaticScale(1e-40),
        ValueError,
        r"loss_scale must be a normal float32 number \(>= 1.17549e-38\), got 1e-40: XLA flushes",
    ),
    Case(
        "min-subnormal",
        lambda: jdls.DynamicScale(min_loss_scale=1e-40),
        ValueError,
        r"min_loss_scale must be a normal float32 number \(>= 1.17549e-38\), got 1e-40",
    ),
    Case(
        "wrap-max-norm-over-float32",
        lambda: jdls.wrap(optax.sgd(0.1), jdls.DynamicScale(), max_norm=1e39),
        ValueError,
        r"max_norm must fit in float32 \(<= 3.40282e\+38\), got 1e\+39: it would be inf",
    ),
    Case(
        "rule-counter-after-growth",
        lambda: jdls.rules.GrowBackoff(counter_after_growth=2),
        ValueError,
        r"counter_after_growth must be 0 or 1, got 2",
    ),
    Case(
        "rule-tolerance-negative",
        lambda: jdls.rules.OverflowTolerance(tolerance=-0.1),
        ValueError,
        r"^tolerance must be >= 0, got -0.1",
    ),
    Case(
        "rule-error-at-min-without-min",
        lambda: jdls.rules.GrowBackoff(min_loss_scale=None, error_at_min_scale=True),
        ValueError,
        r"error_at_min_scale=True needs a min_loss_scale",
    ),
    Case(
        "initial-state-counter",
        lambda: jdls.rules.GrowBackoff(growth_interval=5).initial_state(counter=5),
        ValueError,
        r"counter must be < growth_interval \(5\), got 5",
    ),
    Case(
        "initial-state-hysteresis",
        lambda: jdls.rules.GrowBackoff(hysteresis=2).initial_state(hysteresis=3),
        ValueError,
        r"hysteresis must be in \[1, 2\] \(the rule's hysteresis\), got 3",
    ),
    # -- the scales: wrong calls --------------------------------------------------------------
    Case(
        "adjust-given-gradients",
        lambda: jdls.DynamicScale().adjust({"w": jnp.ones(3)}),
        TypeError,
        r"adjust expects a boolean scalar, got dict: pass jdls.all_finite\(grads\)",
    ),
    Case(
        "adjust-given-array",
        lambda: jdls.DynamicScale().adjust(jnp.isfinite(jnp.ones(3))),
        ValueError,
        r"got an array of shape \(3,\): pass jdls.all_finite\(grads\)",
    ),
    Case(
        "adjust-given-loss",
        lambda: jdls.StaticScale(2.0).adjust(jnp.float32(0.3)),
        TypeError,
        r"got a float32 value \(the loss\?\): pass jdls.all_finite\(grads\)",
    ),
    Case(
        "adjust-observing-without-measurement",
        lambda: jdls.AdaptiveScale().adjust(jnp.bool_(True)),
        ValueError,
        r"the rule Adaptive sets the scale from the largest magnitude of the unscaled gradients, "
        r"and none was given: pass it, scale.adjust\(finite, grad_amax=",
    ),
    Case(
        "value-and-grad-aux-not-pair",
        lambda: jdls.DynamicScale().value_and_grad(lambda p: jnp.sum(p["w"]), has_aux=True)(PARAMS),
        TypeError,
        r"with has_aux=True, fun must return a pair \(loss, aux\), got an array of shape \(\): return \(loss, aux\), or drop has_aux",
    ),
    Case(
        "value-and-grad-vector-loss",
        lambda: jdls.DynamicScale().value_and_grad(lambda p: p["w"])(PARAMS),
        TypeError,
        r"Gradient only defined for scalar-output functions",
    ),
    Case(
        "value-and-grad-int-params",
        lambda: jdls.DynamicScale().value_and_grad(lambda p: jnp.sum(p))(jnp.arange(3)),
        TypeError,
        r"differentiates argument 0 \(argnums\), which holds no floating-point array \(its leaves: int32 arrays\). Pass the parameters to differentiate as floating-point arrays",
    ),
    Case(
        "check-at-minimum",
        lambda: jdls.presets.deepspeed(init_scale=1.0, delayed_shift=1).adjust(False).check(),
        jdls.MinimumScaleError,
        r"already at its minimum .* Look for the source of the inf/NaN",
    ),
    # -- a scale where a transformation is expected, and the reverse ----------------------------
    Case(
        "chain-with-scale",
        lambda: optax.chain(jdls.DynamicScale(), optax.adam(1e-3)),
        AttributeError,
        r"jdls.DynamicScale\(\.\.\.\) is a loss scale, not an optax transformation .*jdls.wrap\(optax.adam\(1e-3\), jdls.DynamicScale\(\.\.\.\)\)",
    ),
    Case(
        "chain-with-scale-class",
        lambda: optax.chain(jdls.DynamicScale, optax.adam(1e-3)),
        AttributeError,
        r"jdls.DynamicScale is a loss scale, not an optax transformation",
    ),
    Case(
        "chain-with-static-scale",
        lambda: optax.chain(optax.adam(1e-3), jdls.StaticScale(128.0)),
        AttributeError,
        r"jdls.StaticScale\(\.\.\.\) is a loss scale, not an optax transformation",
    ),
    Case(
        "wrap-of-scale",
        lambda: jdls.wrap(jdls.DynamicScale()),
        TypeError,
        r"inner must be an optax transformation and comes first: jdls.wrap\(optax.adam\(1e-3\), jdls.DynamicScale\(\)\)",
    ),
    Case(
        "wrap-of-scale-class",
        lambda: jdls.wrap(jdls.DynamicScale),
        TypeError,
        r"inner must be an optax transformation and comes first",
    ),
    Case(
        "wrap-of-uncalled-factory",
        lambda: jdls.wrap(optax.adam),
        TypeError,
        r"got the function 'adam': call it to build the transformation",
    ),
    Case(
        "wrap-of-number",
        lambda: jdls.wrap(0.1),
        TypeError,
        r"inner must be an optax transformation such as optax.adam\(1e-3\), got float",
    ),
    Case(
        "wrap-scale-is-transformation",
        lambda: jdls.wrap(optax.adam(1e-3), optax.sgd(0.1)),
        TypeError,
        r"scale must be a jdls loss scale, got an optax transformation; the optimizer is the first argument",
    ),
    Case(
        "wrap-scale-is-wrap",
        lambda: jdls.wrap(optax.adam(1e-3), jdls.wrap(optax.sgd(0.1), jdls.DynamicScale())),
        TypeError,
        r"scale must be a jdls loss scale, got an optax transformation",
    ),
    Case(
        "wrap-scale-is-class",
        lambda: jdls.wrap(optax.adam(1e-3), jdls.DynamicScale),
        TypeError,
        r"pass jdls.DynamicScale\(\.\.\.\), not the class jdls.DynamicScale",
    ),
    Case(
        "wrap-scale-is-number",
        lambda: jdls.wrap(optax.adam(1e-3), 1024.0),
        TypeError,
        r"got the number 1024.0: for a fixed scale pass jdls.StaticScale\(1024.0\)",
    ),
    Case(
        "wrap-scale-is-string",
        lambda: jdls.wrap(optax.adam(1e-3), "dynamic"),
        TypeError,
        r"scale must be a jdls loss scale: jdls.DynamicScale\(\.\.\.\)",
    ),
    Case(
        "set-scale-transformation",
        lambda: jdls.set_scale(_wrap_state(), optax.adam(1e-3)),
        TypeError,
        r"scale must be a jdls loss scale, got an optax transformation; pass a loss scale such "
        r"as jdls.DynamicScale\(\.\.\.\)",
    ),
    Case(
        "set-scale-class",
        lambda: jdls.set_scale(_wrap_state(), jdls.DynamicScale),
        TypeError,
        r"pass jdls.DynamicScale\(\.\.\.\), not the class",
    ),
    Case(
        "set-scale-state-dict",
        lambda: jdls.set_scale(_wrap_state(), _sd_torch),
        TypeError,
        r"scale must be a jdls loss scale: jdls.DynamicScale\(\.\.\.\), .*; got dict",
    ),
    # -- jdls.wrap: arguments ---------------------------------------------------------------------
    Case(
        "wrap-max-norm-0",
        lambda: jdls.wrap(optax.sgd(0.1), jdls.DynamicScale(), max_norm=0.0),
        ValueError,
        r"max_norm must be a finite number > 0, got 0.0",
    ),
    Case(
        "wrap-max-norm-negative",
        lambda: jdls.wrap(optax.sgd(0.1), jdls.DynamicScale(), max_norm=-1.0),
        ValueError,
        r"max_norm must be a finite number > 0",
    ),
    Case(
        "wrap-max-norm-inf",
        lambda: jdls.wrap(optax.sgd(0.1), jdls.DynamicScale(), max_norm=INF),
        ValueError,
        r"max_norm must be a finite number > 0, got inf",
    ),
    Case(
        "wrap-max-norm-str",
        lambda: jdls.wrap(optax.sgd(0.1), jdls.DynamicScale(), max_norm="1.0"),
        TypeError,
        r"max_norm must be a number, got str",
    ),
    Case(
        "wrap-max-norm-vector",
        lambda: jdls.wrap(optax.sgd(0.1), jdls.DynamicScale(), max_norm=jnp.ones(2)),
        ValueError,
        r"max_norm must be a scalar",
    ),
    Case(
        "wrap-skip-with-unknown",
        lambda: jdls.wrap(optax.sgd(0.1), jdls.DynamicScale(), skip_with="where"),
        ValueError,
        r"skip_with must be one of \('cond', 'select'\), got 'where'",
    ),
    Case(
        "wrap-track-nonfinite-str",
        lambda: jdls.wrap(optax.sgd(0.1), jdls.DynamicScale(), track_nonfinite="yes"),
        TypeError,
        r"track_nonfinite must be a bool",
    ),
    Case(
        "wrap-skip-norm-overflow-str",
        lambda: jdls.wrap(optax.sgd(0.1), jdls.DynamicScale(), skip_norm_overflow="yes"),
        TypeError,
        r"skip_norm_overflow must be a bool, got 'yes'",
    ),
    Case(
        "wrap-axis-name-clip-no-sharded",
        lambda: jdls.wrap(optax.sgd(0.1), jdls.DynamicScale(), max_norm=1.0, axis_name="data"),
        ValueError,
        r"say how the gradients are laid out across that axis: sharded=True .* sharded=False",
    ),
    Case(
        "wrap-sharded-without-axis-name",
        lambda: jdls.wrap(optax.sgd(0.1), jdls.DynamicScale(), sharded=True),
        ValueError,
        r"sharded=True needs an axis_name",
    ),
    # -- jdls.wrap: calls -----------------------------------------------------------------------
    Case(
        "update-with-inner-state",
        lambda: _update(
            jdls.wrap(optax.adam(0.1), jdls.DynamicScale()), PARAMS, optax.adam(0.1).init(PARAMS)
        ),
        TypeError,
        r"expects its own WrapState, got tuple: pass the state returned by this transformation's init",
    ),
    Case(
        "update-tree-mismatch",
        lambda: _update(jdls.wrap(optax.sgd(0.1), jdls.DynamicScale()), {"v": jnp.ones(3)}),
        ValueError,
        r"gradients do not have the tree structure of the params .*only in gradients: \['v'\].*only in params: \['w'\]",
    ),
    Case(
        "update-none-at-an-integer-parameter",
        lambda: _update(
            jdls.wrap(optax.adam(0.1), jdls.DynamicScale()),
            {"n": None, "w": jnp.ones(3)},
            params={"n": jnp.array(2, jnp.int32), "w": jnp.ones(3)},
        ),
        ValueError,
        r"the gradients are None at arrays that are not floating-point, \['n'\] \(int32\), which "
        r"differentiation holds fixed: give the optimizer the floating-point arrays only \(with "
        r"Equinox, eqx.filter\(model, eqx.is_inexact_array\)",
    ),
    Case(
        "update-shape-mismatch",
        lambda: _update(jdls.wrap(optax.sgd(0.1), jdls.DynamicScale()), {"w": jnp.ones(1)}),
        ValueError,
        r"the gradient at \['w'\] has shape \(1,\) but its parameter has shape \(3,\); pass the gradients of the params",
    ),
    Case(
        "update-float0-gradients",
        lambda: _update(
            jdls.wrap(optax.adam(0.1), jdls.DynamicScale()),
            jax.grad(lambda p: jnp.sum(p["w"] * 1.0), allow_int=True)({"w": jnp.arange(3)}),
            params={"w": jnp.arange(3)},
        ),
        TypeError,
        r"float0",
    ),
    Case(
        "clip-neither-limit",
        lambda: jdls.clip(),
        ValueError,
        r"give max_norm .* or max_value .*; for no clipping leave jdls.clip out of the chain",
    ),
    Case(
        "clip-both-limits",
        lambda: jdls.clip(1.0, 1.0),
        ValueError,
        r"give max_norm or max_value, not both",
    ),
    Case(
        "clip-negative",
        lambda: jdls.clip(max_value=-1.0),
        ValueError,
        r"max_value must be a finite number > 0",
    ),
    # -- finding the wrap state -----------------------------------------------------------------
    Case(
        "get-scale-no-wrap",
        lambda: jdls.get_scale(optax.adam(0.1).init(PARAMS)),
        ValueError,
        r"found no jdls.wrap state in this tuple; build the optimizer with jdls.wrap",
    ),
    Case(
        "get-scale-of-params",
        lambda: jdls.get_scale(PARAMS),
        ValueError,
        r"found no jdls.wrap state in this dict",
    ),
    Case(
        "get-scale-two-wraps",
        lambda: jdls.get_scale(_two_wraps()),
        ValueError,
        r"found 2 jdls.wrap states \(at \[0\], \[1\]\); a train step needs exactly one",
    ),
    Case(
        "stats-no-wrap",
        lambda: jdls.stats(optax.sgd(0.1).init(PARAMS)),
        ValueError,
        r"stats: found no jdls.wrap state",
    ),
    Case(
        "nonfinite-paths-untracked",
        lambda: jdls.nonfinite_paths(_wrap_state()),
        ValueError,
        r"build the optimizer with jdls.wrap\(\.\.\., track_nonfinite=True\)",
    ),
    # -- presets ----------------------------------------------------------------------------------
    Case(
        "pytorch-interval-0",
        lambda: jdls.presets.pytorch(growth_interval=0),
        ValueError,
        r"growth_interval must be >= 1",
    ),
    Case(
        "pytorch-backoff-above-1",
        lambda: jdls.presets.pytorch(backoff_factor=1.5),
        ValueError,
        r"backoff_factor must be in the open interval \(0, 1\)",
    ),
    Case(
        "pytorch-init-negative",
        lambda: jdls.presets.pytorch(init_scale=-1.0),
        ValueError,
        r"init_scale must be a finite number > 0",
    ),
    Case(
        "flax-fin-steps-too-many",
        lambda: jdls.presets.flax(growth_interval=3, fin_steps=4),
        ValueError,
        r"fin_steps must be in \[0, growth_interval\] = \[0, 3\], got 4",
    ),
    Case(
        "jmp-counter-too-big",
        lambda: jdls.presets.jmp(2.0**15, counter=3, period=3),
        ValueError,
        r"counter must be in \[0, period\) = \[0, 3\), got 3",
    ),
    Case(
        "jmp-no-scale",
        lambda: jdls.presets.jmp(),
        TypeError,
        r"missing 1 required positional argument: 'loss_scale'",
    ),
    Case(
        "keras-growth-steps-0",
        lambda: jdls.presets.keras(dynamic_growth_steps=0),
        ValueError,
        r"dynamic_growth_steps must be >= 1",
    ),
    Case(
        "deepspeed-delayed-shift-0",
        lambda: jdls.presets.deepspeed(delayed_shift=0),
        ValueError,
        r"delayed_shift must be >= 1",
    ),
    Case(
        "deepspeed-window-0",
        lambda: jdls.presets.deepspeed(scale_window=0),
        ValueError,
        r"scale_window must be >= 1",
    ),
    Case(
        "megatron-hysteresis-0",
        lambda: jdls.presets.megatron(hysteresis=0),
        ValueError,
        r"hysteresis must be >= 1",
    ),
    Case(
        "cerebras-unknown-mode",
        lambda: jdls.presets.cerebras(loss_scale="auto"),
        ValueError,
        r'loss_scale must be "dynamic", a number > 0 or None, got \'auto\'',
    ),
    Case(
        "cerebras-unknown-half-dtype",
        lambda: jdls.presets.cerebras(half_dtype="fp16"),
        ValueError,
        r"half_dtype must be one of \['bfloat16', 'cbfloat16', 'float16'\], got 'fp16'",
    ),
    Case(
        "cerebras-min-too-small",
        lambda: jdls.presets.cerebras(min_loss_scale=1e-6),
        ValueError,
        r"min_loss_scale must be >= 2\*\*-14",
    ),
    Case(
        "cerebras-tolerance-negative",
        lambda: jdls.presets.cerebras(overflow_tolerance=-0.1),
        ValueError,
        r"^overflow_tolerance must be >= 0, got -0.1 \(in jdls.presets.cerebras\)",
    ),
    Case(
        "cerebras-max-gradient-norm",
        lambda: jdls.presets.cerebras(max_gradient_norm=1.0),
        TypeError,
        r"presets.cerebras builds the scale; clipping belongs to the wrap: "
        r"jdls.presets.cerebras_wrap\(optimizer, max_gradient_norm=1.0, \.\.\.\)",
    ),
    Case(
        "cerebras-wrap-max-gradient-norm-0",
        lambda: jdls.presets.cerebras_wrap(optax.sgd(0.1), max_gradient_norm=0.0),
        ValueError,
        r"max_gradient_norm must be a finite number > 0, got 0.0",
    ),
    Case(
        "cerebras-steps-0",
        lambda: jdls.presets.cerebras(steps_per_increase=0),
        ValueError,
        r"steps_per_increase must be >= 1",
    ),
    # -- state dicts ------------------------------------------------------------------------------
    Case(
        "torch-state-dict-missing-key",
        lambda: jdls.presets.from_pytorch_state_dict({"scale": 1024.0}),
        ValueError,
        r"torch.amp.GradScaler state_dict is missing keys \['growth_factor', .*\]",
    ),
    Case(
        "torch-state-dict-not-dict",
        lambda: jdls.presets.from_pytorch_state_dict([("scale", 1.0)]),
        TypeError,
        r"state_dict must be a dict, got list",
    ),
    Case(
        "torch-state-dict-zero-scale",
        lambda: jdls.presets.from_pytorch_state_dict({**_sd_torch, "scale": 0.0}),
        ValueError,
        r"init_scale must be a finite number > 0, got 0.0",
    ),
    Case(
        "to-torch-from-other-preset",
        lambda: jdls.presets.to_pytorch_state_dict(jdls.DynamicScale()),
        ValueError,
        r"expected a scale made by jdls.presets.pytorch\(\.\.\.\), got DynamicScale with rule "
        r"GrowBackoff; a GradScaler state dict holds only PyTorch's rule: convert with "
        r"jdls.presets.pytorch first",
    ),
    Case(
        "cerebras-state-dict-missing-key",
        lambda: jdls.presets.from_cerebras_state_dict({"loss_scale": 1.0}),
        ValueError,
        r"Cerebras GradScaler state_dict is missing keys",
    ),
    Case(
        "cerebras-state-dict-static",
        lambda: jdls.presets.from_cerebras_state_dict(_sd_cerebras, loss_scale=8.0),
        ValueError,
        r"from_cerebras_state_dict restores a dynamic scale: drop loss_scale",
    ),
    Case(
        "cerebras-state-dict-negative-skips",
        lambda: jdls.presets.from_cerebras_state_dict({**_sd_cerebras, "num_skipped_steps": -1}),
        ValueError,
        r"num_skipped_steps must be >= 0, got -1",
    ),
    Case(
        "to-cerebras-from-other-preset",
        lambda: jdls.presets.to_cerebras_state_dict(jdls.presets.pytorch()),
        ValueError,
        r"expected a dynamic scale made by jdls.presets.cerebras\(\.\.\.\), got DynamicScale "
        r"with rule GrowBackoff; convert with jdls.presets.cerebras first",
    ),
    # -- precision policies -------------------------------------------------------------------------
    Case(
        "policy-unknown-dtype",
        lambda: jdls.get_policy("params=float32,compute=fp17"),
        ValueError,
        r"Unknown dtype 'fp17' in policy 'params=float32,compute=fp17'; accepted names are: half, .*float16",
    ),
    Case(
        "policy-unknown-single-dtype",
        lambda: jdls.get_policy("float17"),
        ValueError,
        r"Unknown dtype 'float17'.*accepted names are",
    ),
    Case(
        "policy-unknown-key",
        lambda: jdls.get_policy("weights=float32"),
        ValueError,
        r"Unknown key 'weights' in policy 'weights=float32': should be 'params', 'compute' or 'output'",
    ),
    Case(
        "policy-malformed-part",
        lambda: jdls.get_policy("params=float32,compute"),
        ValueError,
        r"Malformed part 'compute' .*expected key=dtype",
    ),
    Case(
        "policy-not-a-string",
        lambda: jdls.get_policy(None),
        TypeError,
        r"policy_name must be a str, got None",
    ),
    Case(
        "policy-integer-dtype",
        lambda: jdls.Policy(jnp.float32, jnp.int8, jnp.float32),
        ValueError,
        r"compute_dtype must be a floating dtype, got int8",
    ),
    Case(
        "policy-not-a-dtype",
        lambda: jdls.Policy(jnp.float32, object(), jnp.float32),
        TypeError,
        r"compute_dtype must be a floating dtype, a dtype name or a jdls.FloatFormat",
    ),
    # -- float formats ----------------------------------------------------------------------------
    Case(
        "format-exponent-bits-1",
        lambda: jdls.FloatFormat(1, 10),
        ValueError,
        r"exponent_bits must be >= 2 .*got 1",
    ),
    Case(
        "format-exponent-bits-9",
        lambda: jdls.FloatFormat(9, 10),
        ValueError,
        r"exponent_bits must be <= 8: float32, which holds the emulated values, has 8 exponent bits",
    ),
    Case(
        "format-mantissa-bits-0",
        lambda: jdls.FloatFormat(5, 0),
        ValueError,
        r"mantissa_bits must be >= 1",
    ),
    Case(
        "format-mantissa-bits-24",
        lambda: jdls.FloatFormat(5, 24),
        ValueError,
        r"mantissa_bits must be <= 23",
    ),
    Case(
        "format-bias-out-of-range",
        lambda: jdls.FloatFormat(8, 7, bias=200),
        ValueError,
        r"bias must be in \[127, 127\] for exponent_bits=8",
    ),
    Case(
        "format-float-bits",
        lambda: jdls.FloatFormat(5.0, 10),
        TypeError,
        r"exponent_bits must be an int, got 5.0",
    ),
    Case(
        "format-empty-name",
        lambda: jdls.FloatFormat(5, 10, name=""),
        TypeError,
        r"name must be a non-empty str or None",
    ),
    Case(
        "format-round-integers",
        lambda: jdls.cbfloat16.round(jnp.arange(3)),
        TypeError,
        r"expects floating-point values .*got int32",
    ),
    Case(
        "format-round-float64",
        lambda: jdls.cbfloat16.round(np.ones(2, np.float64)),
        TypeError,
        r"expects float32 values, got float64: convert to float32 first",
    ),
    Case(
        "compress-format-name",
        lambda: jdls.compress(PARAMS, "cbfloat16"),
        TypeError,
        r"fmt must be a jdls.FloatFormat \(e.g. jdls.cbfloat16\), got 'cbfloat16'",
    ),
    Case(
        "finfo-unknown",
        lambda: jdls.finfo("cbfloat17"),
        TypeError,
        r"finfo expects a floating-point dtype, a jdls.FloatFormat or one of \['cbfloat16'\], got 'cbfloat17'",
    ),
    Case(
        "sites-optax-apply-updates",
        lambda: _sited_step(jdls.wrap(optax.sgd(0.1))),
        ValueError,
        r"a jdls site.*Apply updates with jdls.apply_updates\(params, updates, opt_state\)",
    ),
    Case(
        "sites-multisteps-around-wrap",
        lambda: _sited_step(optax.MultiSteps(jdls.wrap(optax.sgd(0.1)), 2)),
        ValueError,
        r"a jdls site.*jdls.wrap\(optax.MultiSteps\(...\)\)",
    ),
    Case(
        "sites-params-reader-in-front",
        lambda: _sited_step(optax.chain(optax.adaptive_grad_clip(0.1), jdls.wrap(optax.sgd(0.1)))),
        ValueError,
        r"a jdls site.*jdls.wrap\(optax.chain\(optax.adaptive_grad_clip",
    ),
    Case(
        "sites-eqx-apply-updates",
        lambda: _sited_step(jdls.wrap(optax.sgd(0.1)), _eqx_apply_updates),
        ValueError,
        r"SiteUpdate.*jdls.equinox.apply_updates\(model, updates, opt_state\) in place of "
        r"eqx.apply_updates",
    ),
    Case(
        "sites-plain-nnx-optimizer",
        lambda: _plain_nnx_optimizer_step(),
        ValueError,
        r"the gradients hold 1 sites' measurements and the params 0 sites.*use "
        r"jdls.nnx.Optimizer\(model, tx, wrt=nnx.Param\)",
    ),
    Case(
        "sites-decay-after-wrap",
        lambda: _sited_step(
            optax.chain(jdls.wrap(optax.scale_by_adam()), optax.add_decayed_weights(1e-4))
        ),
        ValueError,
        r"SiteUpdate.*jdls.wrap\(optax.chain\(..., optax.add_decayed_weights\(wd\)",
    ),
    Case(
        "fp8-per-loss-backward",
        lambda: _fp8_per_loss(),
        ValueError,
        r"backward='per_loss'\) cannot measure the Fp8 site.*Use backward='one'",
    ),
]


def _fp8_per_loss() -> None:
    w, x = jnp.ones((2, 2)), jnp.ones((3, 2))
    dims = (((1,), (0,)), ((), ()))

    def losses(p):
        y = jdls.fp8.dot_general(x, p["w"], dims, site=p["fp8"])
        return {"a": jnp.sum(y[:, 0] ** 2), "b": jnp.sum(y[:, 1] ** 2)}

    scales = {"a": jdls.StaticScale(4.0), "b": jdls.StaticScale(2.0**10)}
    params = {"w": w, "fp8": jdls.fp8.init(jdls.fp8.DelayedScaling(4))}
    jdls.multi_loss_value_and_grad(losses, scales, backward="per_loss")(params)


def _plain_nnx_optimizer_step() -> None:
    from flax import nnx

    import jdls.nnx

    model = jdls.nnx.probes(nnx.Linear(2, 1, rngs=nnx.Rngs(0)))
    optimizer = nnx.Optimizer(model, jdls.wrap(optax.sgd(0.1)), wrt=nnx.Param)
    loss = lambda m: jnp.mean(m(jnp.ones((4, 2))) ** 2)  # noqa: E731
    _, grads = jdls.nnx.value_and_grad(loss, jdls.get_scale(optimizer))(model)
    optimizer.update(model, grads)


def _eqx_apply_updates(model: Any, updates: Any) -> Any:
    import equinox as eqx  # a test extra, as the Equinox tests' own

    return eqx.apply_updates(model, updates)


@pytest.mark.parametrize("case", [pytest.param(c, id=c.id) for c in CASES])
def test_rejected(case: Case) -> None:
    with pytest.raises(case.error) as info:
        case.call()
    assert re.search(case.message, str(info.value)), (
        f"{case.id}: message {str(info.value)!r} does not match {case.message!r}"
    )


def test_case_ids_are_unique() -> None:
    ids = [c.id for c in CASES]
    assert len(ids) == len(set(ids))


def test_docs_table_lists_every_case() -> None:
    """docs/reliability.md's table of bad inputs has one row per case, by id, and no other."""
    text = (ROOT / "docs" / "reliability.md").read_text(encoding="utf-8")
    start = text.index("<!-- bad-input-table -->")
    rows = re.findall(r"^\| `([a-z0-9-]+)` \|", text[start:], flags=re.MULTILINE)
    assert sorted(rows) == sorted(c.id for c in CASES)


# --------------------------------------------------------------------------------------------
# Mistakes jdls cannot detect at run time: their exact symptoms (see docs/reliability.md).
# --------------------------------------------------------------------------------------------


def _loss(p):
    return jnp.sum(jnp.sin(p["w"]) * 3.0)


def _grad_norm(scale_value: float, grads_of: Callable[[jdls.LossScale], Any]) -> float:
    """grad_norm that jdls.wrap records for one step at a given (static) loss scale."""
    scale = jdls.StaticScale(scale_value)
    tx = jdls.wrap(optax.sgd(0.1), scale)
    _, state = tx.update(grads_of(scale), tx.init(PARAMS), PARAMS)
    return float(jdls.stats(state).grad_norm)


def test_limitation_unscale_twice_divides_twice():
    """``scale.value_and_grad`` already unscales: unscaling its gradients again divides them by
    the scale a second time. Nothing is non-finite, so nothing is skipped: the run just gets
    gradients ``loss_scale`` times too small."""
    scale = jdls.StaticScale(2.0**15)
    true = jax.grad(_loss)(PARAMS)
    _, grads = scale.value_and_grad(_loss)(PARAMS)
    assert_bitwise_equal(grads, true)
    twice = scale.unscale(grads)
    assert_bitwise_equal(twice, jax.tree.map(lambda g: g / 2.0**15, true))


def test_limitation_scaled_gradients_given_to_wrap():
    """Gradients of the scaled loss passed to ``jdls.wrap`` without unscaling are
    ``loss_scale`` times too large; an overflow is still detected and skipped."""
    scale = jdls.StaticScale(2.0**15)
    scaled = jax.grad(lambda p: scale.scale(_loss(p)))(PARAMS)
    assert_bitwise_equal(scaled, jax.tree.map(lambda g: g * 2.0**15, jax.grad(_loss)(PARAMS)))


def test_debug_check_grad_norm_does_not_depend_on_the_scale():
    """The debug check of docs/reliability.md: one step at two loss scales. Correctly unscaled
    gradients give the same ``grad_norm`` bit for bit; unscaled twice, it halves when the scale
    doubles; not unscaled (or the loss scaled twice), it doubles."""

    def right(s):
        return s.value_and_grad(_loss)(PARAMS)[1]

    def unscaled_twice(s):
        return s.unscale(s.value_and_grad(_loss)(PARAMS)[1])

    def not_unscaled(s):
        return jax.grad(lambda p: s.scale(_loss(p)))(PARAMS)

    def scaled_twice(s):
        return s.value_and_grad(lambda p: s.scale(_loss(p)))(PARAMS)[1]

    low, high = 2.0**10, 2.0**11
    assert _grad_norm(high, right) == _grad_norm(low, right)
    assert _grad_norm(high, unscaled_twice) == _grad_norm(low, unscaled_twice) / 2
    assert _grad_norm(high, not_unscaled) == _grad_norm(low, not_unscaled) * 2
    assert _grad_norm(high, scaled_twice) == _grad_norm(low, scaled_twice) * 2
