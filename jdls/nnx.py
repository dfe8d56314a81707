"""jdls for Flax NNX: every NNX entry point in one place.

``jdls.wrap`` is an optax transformation, so ``nnx.Optimizer(model, jdls.wrap(tx),
wrt=nnx.Param)`` already checks the gradients, skips a non-finite step and adjusts the scale.
This module adds what is specific to NNX:

* :func:`value_and_grad`: ``nnx.value_and_grad`` with the loss scaled and the gradients
  unscaled;
* :func:`set_scale`: replace the loss scale of an ``nnx.Optimizer`` (its rule included);
* :class:`SiteVariable` and :class:`Optimizer`: the model's sites, updated with its
  parameters from their measurements (:class:`SiteMeasurement`s in the gradients);
* :func:`layer_scales`, :func:`layer_scale` and :func:`layer_scaled_value_and_grad`:
  per-layer scales;
* :func:`probes`: a probe site after every submodule, and with example inputs after every
  call of a module's ``__call__`` or public method (``embedder.decode``, ``dropout#2``).

Example:
  >>> import jax.numpy as jnp, optax, jdls
  >>> from flax import nnx
  >>> model = nnx.Linear(2, 1, rngs=nnx.Rngs(0))
  >>> optimizer = nnx.Optimizer(model, jdls.wrap(optax.sgd(0.1)), wrt=nnx.Param)
  >>> loss_fn = lambda m: jnp.mean(m(jnp.ones((4, 2))) ** 2)
  >>> loss, grads = jdls.nnx.value_and_grad(loss_fn, jdls.get_scale(optimizer))(model)
  >>> _ = optimizer.update(model, grads)
  >>> int(jdls.stats(optimizer).skipped_steps)
  0
"""

from jdls._frameworks import flax_serialization  # noqa: F401 (registers the scales and sites)
from jdls._frameworks.nnx_layer_scales import layer_scale_nnx as layer_scale
from jdls._frameworks.nnx_layer_scales import layer_scales_nnx as layer_scales
from jdls._frameworks.nnx_model import SiteVariable
from jdls._frameworks.nnx_scale import nnx_value_and_grad as value_and_grad
from jdls._frameworks.nnx_scale import set_nnx_scale as set_scale
from jdls._frameworks.nnx_sites import probes_nnx as probes
from jdls._frameworks.nnx_step import Optimizer, SiteMeasurement
from jdls._frameworks.nnx_step import (
    nnx_layer_scaled_value_and_grad as layer_scaled_value_and_grad,
)

__all__ = [
    "Optimizer",
    "SiteMeasurement",
    "SiteVariable",
    "layer_scale",
    "layer_scaled_value_and_grad",
    "layer_scales",
    "probes",
    "set_scale",
    "value_and_grad",
]
