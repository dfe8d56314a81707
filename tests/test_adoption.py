"""Traps met porting real scanned language models to jdls (Gemma in Flax linen, Llama 3 in
Equinox): a missing ``"jdls"`` collection named by its cause, a codebase's own NaN guard
beside jdls's skips, the model's own overflow named, and an Equinox model's static half
hashable for ``jax.jit(..., static_argnums=...)``."""

from __future__ import annotations

import functools

import flax.errors
import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest

import jdls

WIDTH, DEPTH = 4, 2

# --------------------------------------------------------------------------------------------
# A missing "jdls" collection: the error names the fix.
# --------------------------------------------------------------------------------------------

_FP8 = functools.partial(jdls.fp8.linen.DotGeneral, recipe=jdls.fp8.DelayedScaling(4))


class _Block(nn.Module):
    fp8: bool = False

    @nn.compact
    def __call__(self, h, _):
        dot = {"dot_general_cls": _FP8} if self.fp8 else {}
        return jnp.tanh(nn.Dense(WIDTH, **dot)(h)), None


class _LM(nn.Module):
    """A Gemma-like stack: an embedding, then the blocks under nn.scan."""

    axes: tuple[str, ...] = ("params", "jdls")
    fp8: bool = False

    @nn.compact
    def __call__(self, x):
        h = x if self.fp8 else nn.Dense(WIDTH, name="embed")(x)
        stack = nn.scan(
            _Block,
            variable_axes=dict.fromkeys(self.axes, 0),
            split_rngs={"params": True},
            length=DEPTH,
        )
        return stack(self.fp8, name="layers")(h, None)[0]


_X = jnp.ones((2, WIDTH))
_SCAN_LINE = 'variable_axes={"params": 0, "jdls": 0}'
_INIT_LINE = 'mutable=["params", "jdls"]'
_EVAL_LINE = 'model.apply({"params": params, "jdls": variables["jdls"]}'

_MODELS = {
    "probes": lambda axes: jdls.linen.probes(_LM(axes)),
    "layer_scales": lambda axes: jdls.linen.layer_scales(_LM(axes), jdls.StaticScale(8.0)),
    "fp8": lambda axes: _LM(axes, fp8=True),
}


def _raises(call, *lines):
    """The error is a Flax ScopeCollectionNotFound (and a ValueError) quoting ``lines``."""
    with pytest.raises(flax.errors.ScopeCollectionNotFound) as info:
        call()
    assert isinstance(info.value, ValueError)
    for line in lines:
        assert line in str(info.value), str(info.value)
    return str(info.value)


@pytest.mark.parametrize("sites", list(_MODELS))
def test_a_scan_without_jdls_in_variable_axes_is_named(sites):
    """``"jdls": 0`` missing from nn.scan's variable_axes: init and a jitted init say so, and
    name only that fix."""
    model = _MODELS[sites](("params",))
    message = _raises(lambda: model.init(jax.random.key(0), _X), _SCAN_LINE, "nn.scan")
    assert _INIT_LINE not in message and _EVAL_LINE not in message
    _raises(lambda: jax.jit(model.init)(jax.random.key(0), _X), _SCAN_LINE)


@pytest.mark.parametrize("sites", list(_MODELS))
def test_an_apply_used_as_init_without_jdls_in_mutable_is_named(sites):
    """The codebase's own init, ``model.apply(..., mutable=["params"])``: the error says to
    add "jdls" to mutable."""
    model = _MODELS[sites](("params", "jdls"))
    rngs = {"params": jax.random.key(0)}
    _raises(lambda: model.apply({}, _X, rngs=rngs, mutable=["params"]), _INIT_LINE)
    _, variables = model.apply({}, _X, rngs=rngs, mutable=["params", "jdls"])  # the fix
    assert sorted(variables) == ["jdls", "params"]


@pytest.mark.parametrize("sites", list(_MODELS))
def test_an_evaluation_with_params_only_is_named(sites):
    """An evaluator applying ``{"params": ...}`` only: the error shows the apply with the
    sites, eagerly and under jit; with them the model runs."""
    model = _MODELS[sites](("params", "jdls"))
    variables = model.init(jax.random.key(0), _X)
    params_only = {"params": variables["params"]}
    _raises(lambda: model.apply(params_only, _X), _EVAL_LINE)
    _raises(lambda: jax.jit(model.apply)(params_only, _X), _EVAL_LINE)
    assert model.apply(variables, _X).shape == _X.shape


def test_the_error_inside_a_scan_names_the_scan_and_the_path():
    """Where the first missing site is inside the scan (no module before it), the error
    points there: the scan's path and the site's."""
    model = _LM(("params",), fp8=True)
    message = _raises(lambda: model.init(jax.random.key(0), _X), "/scan(layers)")
    assert 'the FP8 dot site "fp8"' in message


def test_variables_of_another_model_are_named():
    """Sites of the probes given to a model whose sites are per-layer scales: the variables
    came from another model."""
    probed = jdls.linen.probes(_LM())
    scaled = jdls.linen.layer_scales(_LM(), jdls.StaticScale(8.0))
    variables = probed.init(jax.random.key(0), _X)
    _raises(lambda: scaled.apply(variables, _X), "made by another model")


def test_the_error_pickles():
    """The error survives a process boundary (a multi-host launcher re-raising it)."""
    import pickle

    model = _MODELS["probes"](("params",))
    with pytest.raises(flax.errors.ScopeCollectionNotFound) as info:
        model.init(jax.random.key(0), _X)
    again = pickle.loads(pickle.dumps(info.value))
    assert type(again) is type(info.value) and str(again) == str(info.value)
