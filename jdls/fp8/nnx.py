"""FP8 dots for Flax NNX: a ``dot_general`` for ``nnx.Linear`` / ``nnx.LinearGeneral`` and an
``einsum_op`` for ``nnx.Einsum``.

Each holds its FP8 site in a :class:`jdls.nnx.SiteVariable`, so the site is the model's
state: ``jdls.nnx.value_and_grad`` returns its measurement with the parameters' gradients,
and ``jdls.nnx.Optimizer(model, jdls.wrap(tx), wrt=nnx.Param)`` updates it (skip-aware)
while only the parameters reach ``tx``.

Example:
  >>> import jax.numpy as jnp, optax, jdls
  >>> from flax import nnx
  >>> dot = jdls.fp8.nnx.DotGeneral(jdls.fp8.DelayedScaling(16))
  >>> model = nnx.Linear(4, 2, dot_general=dot, rngs=nnx.Rngs(0))
  >>> optimizer = jdls.nnx.Optimizer(model, jdls.wrap(optax.adam(1e-3)), wrt=nnx.Param)
  >>> loss_fn = lambda m: jnp.mean(m(jnp.full((3, 4), 2.0)) ** 2)
  >>> loss, grads = jdls.nnx.value_and_grad(loss_fn, jdls.get_scale(optimizer))(model)
  >>> _ = optimizer.update(model, grads)
  >>> model.dot_general.site.get_value().value.lhs.history[:2].tolist()
  [2.0, 0.0]
"""

from __future__ import annotations

from typing import Any

import jax
from flax import nnx

from jdls._frameworks.nnx_model import SiteVariable
from jdls._sites.site import Site
from jdls.fp8._delayed import DelayedScaling
from jdls.fp8._dot import dot_general
from jdls.fp8._einsum import einsum
from jdls.fp8._recipe import Recipe
from jdls.fp8._state import init, needs_key

__all__ = ["DotGeneral", "Einsum"]


def _new_site(recipe: Recipe | None, rngs: nnx.Rngs | None) -> Site:
    recipe = DelayedScaling() if recipe is None else recipe
    key = rngs.params() if rngs is not None and needs_key(recipe) else None
    return init(recipe, key)


class DotGeneral(nnx.Module):
    """A ``dot_general`` computed in FP8, for ``nnx.Linear(..., dot_general=DotGeneral())``.

    Args:
      recipe: the FP8 recipe (default: delayed scaling, history 1024, e4m3 / e5m2).
      rngs: where a recipe that rounds stochastically (NVFP4) draws the site's seed
        (``rngs.params()``); without it, the recipe's ``seed``.

    Attributes:
      site: a :class:`jdls.nnx.SiteVariable` holding the dot's FP8 site.
    """

    def __init__(self, recipe: Recipe | None = None, *, rngs: nnx.Rngs | None = None) -> None:
        self.site = SiteVariable(_new_site(recipe, rngs))

    def __call__(
        self,
        lhs: jax.Array,
        rhs: jax.Array,
        dimension_numbers: Any,
        precision: Any = None,
        preferred_element_type: Any = None,
        **kwargs: Any,
    ) -> jax.Array:
        return dot_general(
            lhs,
            rhs,
            dimension_numbers,
            precision,
            preferred_element_type,
            site=self.site.get_value(),
            out_sharding=kwargs.get("out_sharding"),
        )


class Einsum(nnx.Module):
    """A two-operand einsum as one FP8 dot: ``x`` (the activation) in the site's ``lhs``
    role, ``kernel`` in its ``rhs`` role, whatever order ``jnp.einsum`` would contract them in
    (:func:`jdls.fp8.einsum`).

    An ``einsum_op`` for ``nnx.Einsum``, or, for a hand-written projection (an ``nnx.Param``
    and ``jnp.einsum``), an attribute of the module called in place of ``jnp.einsum``:
    ``self.qkv_fp8("BSD,3KDH->3BSKH", x, self.qkv[...])``.

    Args:
      recipe: the FP8 recipe.
      rngs: as for :class:`DotGeneral`.

    Attributes:
      site: a :class:`jdls.nnx.SiteVariable` holding the dot's FP8 site.

    Example:
      >>> import jax.numpy as jnp, jdls
      >>> op = jdls.fp8.nnx.Einsum(jdls.fp8.CurrentScaling())
      >>> x, w = jnp.ones((2, 5, 4)), jnp.full((3, 6, 4, 7), 0.5)
      >>> op("BSD,3KDH->3BSKH", x, w).shape
      (3, 2, 5, 6, 7)
    """

    def __init__(self, recipe: Recipe | None = None, *, rngs: nnx.Rngs | None = None) -> None:
        self.site = SiteVariable(_new_site(recipe, rngs))

    def __call__(
        self,
        equation: str,
        x: jax.Array,
        kernel: jax.Array,
        *,
        precision: Any = None,
        preferred_element_type: Any = None,
        out_sharding: Any = None,
    ) -> jax.Array:
        return einsum(
            equation,
            x,
            kernel,
            site=self.site.get_value(),
            precision=precision,
            preferred_element_type=preferred_element_type,
            out_sharding=out_sharding,
        )
