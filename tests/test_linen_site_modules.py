"""jdls.linen sites on modules without ``@compact`` (nn.Embed, setup-style modules), sites
with buffers of their own (a donating jitted step), and jdls.linen.TrainState's gradients
shaped like ``state.variables`` with and without sites."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _helpers import maybe_jit, with_and_without_jit

import jdls

TOKENS = jnp.array([[1, 2, 3], [4, 0, 2]])


class SetupStyle(nn.Module):
    """Submodules made in setup, a __call__ that is not @compact, an nn.Embed inside."""

    def setup(self) -> None:
        self.embed = nn.Embed(5, 4)
        self.dense = nn.Dense(2)

    def __call__(self, tokens):
        return self.dense(jnp.tanh(self.embed(tokens)))


class WithEmbed(nn.Module):
    @nn.compact
    def __call__(self, tokens):
        return nn.Dense(2, name="head")(nn.Embed(5, 4, name="embed")(tokens))


def _wrapped(kind: str, model: nn.Module) -> nn.Module:
    if kind == "probes":
        return jdls.linen.probes(model)
    return jdls.linen.layer_scales(model, jdls.StaticScale(8.0))


def _state(model: nn.Module) -> jdls.linen.TrainState:
    variables = model.init(jax.random.key(0), TOKENS)
    return jdls.linen.TrainState.create(
        apply_fn=model.apply,
        params=variables["params"],
        tx=jdls.wrap(optax.sgd(0.1), jdls.StaticScale(8.0)),
        sites=variables.get("jdls"),
    )


def _step(state: jdls.linen.TrainState) -> jdls.linen.TrainState:
    loss_fn = lambda v: jnp.mean(state.apply_fn(v, TOKENS) ** 2)  # noqa: E731
    _, grads = state.value_and_grad(loss_fn)(state.variables)
    return state.apply_gradients(grads=grads)


@pytest.mark.parametrize("kind", ["probes", "layer_scales"])
@pytest.mark.parametrize("module", [SetupStyle, WithEmbed])
@with_and_without_jit
@pytest.mark.full(keep=1)
def test_sites_on_modules_without_compact(kind: str, module: type, jit: bool) -> None:
    model = _wrapped(kind, module())
    state = _state(model)
    name = "probe" if kind == "probes" else "layer_scale"
    assert sorted(state.sites) == sorted(state.params)  # a site at the embedding too
    assert all(set(v) == {name} for v in state.sites.values())
    # the parameters are those of the model alone, at the same paths
    plain = module().init(jax.random.key(0), TOKENS)["params"]
    jax.tree.map(np.testing.assert_array_equal, state.params, plain)
    new = maybe_jit(_step, jit)(state)
    assert bool(new.stats.finite)
    if kind == "probes":
        t = jdls.Telemetry.of(new.sites)
        assert sorted(t.names) == sorted(state.params)
        assert np.asarray(t.uses).tolist() == [1.0] * len(t.names)


@pytest.mark.parametrize("kind", ["probes", "layer_scales"])
@pytest.mark.full(keep=1)
def test_sites_of_one_init_have_buffers_of_their_own(kind: str) -> None:
    net = nn.Sequential([lambda t: jax.nn.one_hot(t, 5), nn.Dense(4), nn.tanh, nn.Dense(2)])
    state = _state(_wrapped(kind, net))
    leaves = jax.tree.leaves(state.sites)
    pointers = [x.unsafe_buffer_pointer() for x in leaves]
    assert len(set(pointers)) == len(pointers)
    # a jitted step that donates the whole state
    step = jax.jit(_step, donate_argnums=0)
    expected = jax.jit(_step)(state)
    new = step(state)
    new = step(new)  # and again on its own output
    assert bool(new.stats.finite)
    jax.tree.map(np.testing.assert_array_equal, new.params, jax.jit(_step)(expected).params)


@with_and_without_jit
def test_train_state_takes_gradients_of_its_variables_without_sites(jit: bool) -> None:
    model = WithEmbed()
    state = _state(model)
    assert state.sites is None and list(state.variables) == ["params"]
    loss_fn = lambda v: jnp.mean(model.apply(v, TOKENS) ** 2)  # noqa: E731

    def of_variables(state):
        _, grads = state.value_and_grad(loss_fn)(state.variables)
        return state.apply_gradients(grads=grads)

    def of_params(state):
        _, grads = state.value_and_grad(lambda p: loss_fn({"params": p}))(state.params)
        return state.apply_gradients(grads=grads)

    a, b = maybe_jit(of_variables, jit)(state), maybe_jit(of_params, jit)(state)
    jax.tree.map(np.testing.assert_array_equal, a.params, b.params)
    assert not np.array_equal(a.params["head"]["kernel"], state.params["head"]["kernel"])


def test_train_state_params_named_params_take_bare_gradients() -> None:
    """Parameters whose only key is "params": bare gradients still go to the optimizer."""
    params = {"params": jnp.ones(3)}
    state = jdls.linen.TrainState.create(
        apply_fn=None, params=params, tx=jdls.wrap(optax.sgd(1.0), jdls.StaticScale(1.0))
    )
    new = state.apply_gradients(grads={"params": jnp.ones(3)})
    np.testing.assert_array_equal(new.params["params"], jnp.zeros(3))
    new = state.apply_gradients(grads={"params": {"params": jnp.ones(3)}})
    np.testing.assert_array_equal(new.params["params"], jnp.zeros(3))


def test_train_state_with_sites_takes_gradients_of_its_variables() -> None:
    state = _state(jdls.linen.probes(WithEmbed()))
    new = _step(state)
    assert bool(new.stats.finite)
    with pytest.raises(ValueError, match="state.variables"):
        state.apply_gradients(grads=state.params)


class _Base(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(2, name="dense")(x)


class _Sub(_Base):
    def __call__(self, x):  # one call of the module, through its parent class's __call__
        return super().__call__(x)


class _WithSub(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(2, name="last")(_Sub(name="sub")(x))


@with_and_without_jit
def test_a_module_calling_super_call_passes_its_site_once(jit: bool) -> None:
    """A subclass whose ``__call__`` calls ``super().__call__`` (``nn.SelfAttention``): one
    probe use, and one per-layer ratio, so the layer's gradients are ``jax.grad``'s."""
    x = jnp.array([[1.0, -2.0], [0.5, 3.0]])
    model = jdls.linen.probes(_WithSub())
    variables = model.init(jax.random.key(0), x)
    loss = lambda v: jnp.sum(model.apply(v, x) ** 2)  # noqa: E731
    _, grads = maybe_jit(jdls.StaticScale(1.0).value_and_grad(loss), jit)(variables)
    t = jdls.Telemetry.of(grads["jdls"])
    assert t.names == ("sub/dense", "sub", "last") and t.uses.tolist() == [1.0, 1.0, 1.0]

    scaled = jdls.linen.layer_scales(_WithSub(), jdls.StaticScale(1.0))
    v = scaled.init(jax.random.key(0), x)
    sites = jax.tree_util.tree_map(lambda s: s, v["jdls"], is_leaf=jdls.is_site)
    value = dict(sites["last"]["layer_scale"].value)
    value["scale"] = jdls.StaticScale(2.0**9)
    sites["last"]["layer_scale"] = jdls.Site(sites["last"]["layer_scale"].kind, value)
    state = jdls.linen.TrainState.create(
        apply_fn=scaled.apply,
        params=v["params"],
        sites=sites,
        tx=jdls.wrap(optax.sgd(0.1), jdls.NoOpScale()),
    )
    fn = state.value_and_grad(lambda w: jnp.sum(scaled.apply(w, x) ** 2))
    _, got = maybe_jit(fn, jit)(state.variables)
    bare = _WithSub().apply
    expected = maybe_jit(jax.grad(lambda p: jnp.sum(bare({"params": p}, x) ** 2)), jit)(v["params"])
    np.testing.assert_allclose(
        got["params"]["sub"]["dense"]["kernel"], expected["sub"]["dense"]["kernel"], rtol=1e-6
    )
