"""jdls for Flax linen: every linen entry point in one place.

``jdls.wrap`` is an optax transformation, so a plain ``flax.training.train_state.TrainState``
already works with it. This module adds what is specific to linen:

* :class:`TrainState`: the Flax ``TrainState`` with the loss scale at hand, carrying the
  model's sites (its ``"jdls"`` collection) and updating them;
* :func:`from_train_state`: migrate a Flax-example ``TrainState`` that holds a
  ``dynamic_scale`` field;
* :func:`layer_scales`: a per-layer scale site after every top-level submodule;
* :func:`probes`: a probe site after every submodule;
* :func:`value_and_grad` and :func:`apply_gradients`: ``TrainState``'s two steps for a train
  state of your own (a dict of variables and optimizer state);
* :data:`SITES`: the name of the sites' variable collection, ``"jdls"``.

Example:
  >>> import jax, jax.numpy as jnp, optax, jdls
  >>> import flax.linen as nn
  >>> model = nn.Dense(1)
  >>> x = jnp.ones((4, 3))
  >>> state = jdls.linen.TrainState.create(
  ...     apply_fn=model.apply,
  ...     params=model.init(jax.random.key(0), x)["params"],
  ...     tx=jdls.wrap(optax.sgd(0.1), jdls.DynamicScale()),
  ... )
  >>> float(state.loss_scale)
  32768.0
"""

from jdls._frameworks import flax_serialization  # noqa: F401 (registers the scales and sites)
from jdls._frameworks.linen_scope import SITES
from jdls._frameworks.linen_sites import layer_scales_linen as layer_scales
from jdls._frameworks.linen_sites import probes_linen as probes
from jdls._frameworks.linen_state import TrainState
from jdls._frameworks.linen_state import from_flax_train_state as from_train_state
from jdls._frameworks.linen_step import apply_gradients, split_gradients, value_and_grad

__all__ = [
    "SITES",
    "TrainState",
    "apply_gradients",
    "from_train_state",
    "layer_scales",
    "probes",
    "split_gradients",
    "value_and_grad",
]
