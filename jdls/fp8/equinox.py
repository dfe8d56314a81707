"""FP8 layers for Equinox (``import jdls.fp8.equinox``; needs ``equinox``).

:class:`Linear` is ``eqx.nn.Linear`` whose dot is computed in FP8; its ``site`` field holds
the scales and amax histories (a :class:`jdls.Site`). A train step differentiates the model
as usual; the gradient's sites are the step's measurements::

    loss, grads = scale.value_and_grad(loss_fn)(model, x, y)
    grads, measured = jdls.split_sites(grads)              # the optimizer never sees the sites
    params, _ = jdls.split_sites(eqx.filter(model, eqx.is_array))
    updates, opt_state = tx.update(grads, opt_state, params)
    model = jdls.equinox.apply_updates(model, updates)
    model = jdls.update_sites(model, measured, jdls.fp8.step_applied(opt_state))

A hand-written projection needs no layer: keep a site (``jdls.fp8.init(recipe)``) as a field
beside the weight and call ``jdls.fp8.einsum(equation, x, self.weight, site=self.site)``
(or ``jdls.fp8.dot_general``); ``x`` is the site's ``lhs``, the weight its ``rhs``.
"""

from __future__ import annotations

import math

import equinox as eqx
import jax
import jax.numpy as jnp

from jdls._sites.site import Site
from jdls.fp8._delayed import DelayedScaling
from jdls.fp8._dot import dot_general
from jdls.fp8._recipe import Recipe
from jdls.fp8._state import init

__all__ = ["Linear"]


class Linear(eqx.Module):
    """``y = x @ weight.T + bias`` with the matrix product in FP8.

    Args:
      in_features: the input size, as ``eqx.nn.Linear`` (and its initialisation).
      out_features: the output size.
      use_bias: whether to add a bias.
      recipe: the FP8 recipe (default: delayed scaling, history 1024).
      key: a ``jax.random`` key.

    Example:
      >>> import jax, jax.numpy as jnp, jdls, jdls.fp8.equinox
      >>> layer = jdls.fp8.equinox.Linear(3, 2, key=jax.random.key(0))
      >>> layer(jnp.ones((5, 3))).shape, layer.site.value.lhs.history.shape
      ((5, 2), (1024,))
    """

    weight: jax.Array
    bias: jax.Array | None
    site: Site
    in_features: int = eqx.field(static=True)
    out_features: int = eqx.field(static=True)

    def __init__(
        self,
        in_features: int,
        out_features: int,
        use_bias: bool = True,
        *,
        recipe: Recipe | None = None,
        key: jax.Array,
    ) -> None:
        wkey, bkey, skey = jax.random.split(key, 3)
        lim = 1 / math.sqrt(in_features)
        self.weight = jax.random.uniform(wkey, (out_features, in_features), minval=-lim, maxval=lim)
        self.bias = (
            jax.random.uniform(bkey, (out_features,), minval=-lim, maxval=lim) if use_bias else None
        )
        self.site = init(DelayedScaling() if recipe is None else recipe, skey)
        self.in_features, self.out_features = in_features, out_features

    def __call__(self, x: jax.Array) -> jax.Array:
        """Applies the layer to ``x`` of shape ``(..., in_features)``."""
        x = jnp.asarray(x)
        y = dot_general(x, self.weight, (((x.ndim - 1,), (1,)), ((), ())), site=self.site)
        return y if self.bias is None else y + self.bias.astype(y.dtype)
