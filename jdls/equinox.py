"""Equinox entry points of jdls (``import jdls.equinox``; needs ``equinox``).

Nothing here is required to train an Equinox model with jdls: ``scale.value_and_grad(loss)``
already differentiates an ``eqx.Module`` the way ``eqx.filter_value_and_grad`` does
(gradients for the floating-point arrays, ``None`` for every other leaf), and ``jdls.wrap``,
``jdls.clip``, ``jdls.stats`` and ``jdls.nonfinite_paths`` take the ``None`` leaves of
Equinox's gradients. A train step::

    scale = jdls.get_scale(opt_state)
    loss, grads = scale.value_and_grad(loss_fn)(model, x, y)
    updates, opt_state = tx.update(grads, opt_state, eqx.filter(model, eqx.is_array))
    model = eqx.apply_updates(model, updates)

:func:`apply_updates` is ``eqx.apply_updates`` that keeps each parameter's dtype, as
``optax.apply_updates`` does: with bfloat16 or float16 parameters, ``eqx.apply_updates``
adds jdls's float32 updates and so turns the parameters into float32.

:func:`value_and_grad` is for code that wants Equinox's own differentiation, exactly: it is
``eqx.filter_value_and_grad`` with the loss scaled and the gradients unscaled.

:func:`probes` and :func:`layer_scales` return the model with sites on the outputs of its
submodules (each wrapped in a :class:`Sited`; a stack made by ``eqx.filter_vmap`` one site per
layer): :func:`layer_scaled_value_and_grad` differentiates it with a scale per layer,
``jdls.Telemetry.of`` reads the probes, :func:`get_layer_scales` and :func:`set_layer_scales`
read and set the scales, :func:`unwrap` gives the bare model back, and :func:`checkpointed` is
``eqx.filter(model, eqx.is_inexact_array)`` keeping the sites whole.

``import jdls`` does not import Equinox; this module does.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import equinox as eqx

from jdls._frameworks.equinox_layer_state import (
    checkpointed,
    get_layer_scales,
    set_layer_scales,
)
from jdls._frameworks.equinox_sites import FIX_ORDER, Sited, unwrap
from jdls._frameworks.equinox_sites import layer_scales_equinox as layer_scales
from jdls._frameworks.equinox_sites import probes_equinox as probes
from jdls._scales.grad import scaled_value_and_grad
from jdls._scales.layer_scales import scale_layers
from jdls._scales.layer_site import applied_in_order
from jdls._scales.scale import LossScale, check_scale
from jdls._transforms import apply as site_apply

__all__ = [
    "Sited",
    "apply_updates",
    "checkpointed",
    "get_layer_scales",
    "layer_scaled_value_and_grad",
    "layer_scales",
    "probes",
    "set_layer_scales",
    "unwrap",
    "value_and_grad",
]


def value_and_grad(
    fun: Callable[..., Any], scale: LossScale, *, has_aux: bool = False
) -> Callable[..., Any]:
    """``eqx.filter_value_and_grad(fun, has_aux=has_aux)`` with ``scale`` applied: the loss
    is scaled before differentiating and the gradients are unscaled after.

    Equinox's conventions hold: the first argument is differentiated, its floating-point
    arrays get gradients and every other leaf ``None``; the other arguments are held fixed.
    ``scale.value_and_grad(fun, has_aux=has_aux)`` gives the same gradients for an Equinox
    model (its Python ``float`` fields included: ``None``); this function differs only on
    other pytrees, where jdls follows ``jax.value_and_grad`` and Equinox does not (a plain
    dict of arrays and Python floats: the floats are held fixed here).

    Args:
      fun: the loss function of the model (first argument) and anything else; returns a
        scalar, or ``(scalar, aux)`` with ``has_aux``.
      scale: the loss scale, e.g. ``jdls.get_scale(opt_state)``.
      has_aux: whether ``fun`` returns ``(loss, aux)``.

    Returns:
      A function with ``fun``'s arguments returning ``(loss, grads)``, or
      ``((loss, aux), grads)`` with ``has_aux``; ``loss`` is the unscaled loss.

    Example:
      >>> import equinox as eqx, jax, jax.numpy as jnp, jdls, jdls.equinox
      >>> model = eqx.nn.MLP(2, 1, 4, 1, key=jax.random.key(0))
      >>> loss_fn = lambda m, x: jnp.mean(jax.vmap(m)(x) ** 2)
      >>> loss, grads = jdls.equinox.value_and_grad(loss_fn, jdls.DynamicScale())(
      ...     model, jnp.ones((3, 2))
      ... )
      >>> grads.layers[0].weight.shape, grads.activation
      ((4, 2), None)
    """
    scale = check_scale(scale)
    return scaled_value_and_grad(
        scale, fun, has_aux, lambda scaled: eqx.filter_value_and_grad(scaled, has_aux=True)
    )


def apply_updates(model: Any, updates: Any, opt_state: Any = None) -> Any:
    """``eqx.apply_updates(model, updates)`` with every parameter kept in its own dtype, and
    the model's sites put in place.

    Leaves whose update is ``None`` (the non-array leaves of an Equinox model, and the arrays
    that were not differentiated) are kept as they are; a :class:`jdls.Site` field takes its
    new state from ``opt_state``, where ``jdls.wrap`` left it (the site updated from its
    measurement, or kept on a skipped step as its kind says; the update at a site is a
    ``SiteUpdate`` without leaves, which ``eqx.apply_updates`` refuses, naming this function);
    every other parameter becomes
    ``(p + u).astype(p.dtype)``, as in ``optax.apply_updates``. ``eqx.apply_updates`` computes
    ``p + u``, so float32 updates (what ``jdls.wrap`` returns for 16-bit gradients) would turn
    bfloat16 or float16 parameters into float32, and ``eqx.filter_jit`` would compile the step
    again for the new dtype. With float32 parameters both functions give the same model.

    Args:
      model: the model (any pytree, non-array leaves included).
      updates: the updates from ``tx.update``, ``None`` where ``model`` has no update.
      opt_state: the optimizer state ``tx.update`` returned with ``updates``; needed when
        the model holds sites (see :func:`jdls.apply_updates`).

    Returns:
      The updated model, each array in its dtype before the update.

    Example:
      >>> import equinox as eqx, jax, jax.numpy as jnp, jdls.equinox
      >>> model = eqx.nn.Linear(2, 1, key=jax.random.key(0), dtype=jnp.float16)
      >>> updates = jax.tree_util.tree_map(lambda p: jnp.ones(p.shape, jnp.float32), model)
      >>> jdls.equinox.apply_updates(model, updates).weight.dtype
      dtype('float16')
      >>> eqx.apply_updates(model, updates).weight.dtype
      dtype('float32')
    """

    return site_apply.apply_updates(model, updates, opt_state)


def layer_scaled_value_and_grad(
    fun: Callable[..., Any], *, has_aux: bool = False
) -> Callable[..., Any]:
    """Per-layer scales for an Equinox model: ``fun(model, *args)`` where each layer module
    holds a :func:`jdls.layer_site` field (stacked with the layer, e.g. by ``eqx.filter_vmap``)
    and passes its output through it with :func:`jdls.apply_site`.

    The loss is scaled by the last layer's scale, each site multiplies the backward cotangent
    by the ratio of its layer's scale to the next one's, and the gradients of every array of
    a layer module (the site's parent) are unscaled by that layer's scale; the gradients at
    the sites are their measurements. ``jdls.wrap`` (with ``jdls.NoOpScale()``) updates the
    sites and :func:`apply_updates` puts them in place: the ordinary Equinox step.

    Args:
      fun: the loss, ``fun(model, *args)``; returns a scalar, or ``(loss, aux)``.
      has_aux: whether ``fun`` returns ``(loss, aux)``.

    Returns:
      A function ``(model, *args) -> (value, grads)``, as ``eqx.filter_value_and_grad``.

    Example:
      >>> import equinox as eqx, jax, jax.numpy as jnp, jdls, jdls.equinox
      >>> class Layer(eqx.Module):
      ...     linear: eqx.nn.Linear
      ...     site: jdls.Site
      ...     def __call__(self, x):
      ...         return jdls.apply_site(jnp.tanh(self.linear(x)), self.site)
      >>> keys = jax.random.split(jax.random.key(0), 2)
      >>> model = [Layer(eqx.nn.Linear(2, 2, key=k), jdls.layer_site(jdls.StaticScale(2.0**s), i))
      ...          for i, (k, s) in enumerate(zip(keys, (10, 3)))]
      >>> def loss(m, x):
      ...     for layer in m:
      ...         x = layer(x)
      ...     return jnp.sum(x)
      >>> _, grads = jdls.equinox.layer_scaled_value_and_grad(loss)(model, jnp.ones(2))
      >>> ref = eqx.filter_grad(loss)(model, jnp.ones(2))
      >>> bool(jnp.allclose(grads[0].linear.weight, ref[0].linear.weight, rtol=1e-6))
      True
    """

    who = "jdls.equinox.layer_scaled_value_and_grad"

    def checked(*args: Any, **kwargs: Any) -> Any:
        with applied_in_order(who, FIX_ORDER):  # jdls.equinox.layer_scales's wrappers
            return fun(*args, **kwargs)

    def value_and_grad_fn(model: Any, *args: Any, **kwargs: Any) -> Any:
        value, (grads,) = scale_layers(
            checked,
            (model, *args),
            kwargs,
            (0,),
            layer_of=lambda path: path[:-1],  # the module holding the site
            param_path=lambda path: path,
            has_aux=has_aux,
            who=who,
        )
        return value, grads

    return value_and_grad_fn
