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
import jax.numpy as jnp
from flax import nnx

from jdls._frameworks.nnx_sites import SiteVariable
from jdls._sites.site import Site
from jdls.fp8._delayed import DelayedScaling
from jdls.fp8._dot import dot_general
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
    """An ``einsum_op`` for ``nnx.Einsum``: the two-operand einsum as one FP8 dot.

    Args:
      recipe: the FP8 recipe.
      rngs: as for :class:`DotGeneral`.
    """

    def __init__(self, recipe: Recipe | None = None, *, rngs: nnx.Rngs | None = None) -> None:
        self.site = SiteVariable(_new_site(recipe, rngs))

    def __call__(self, equation: str, *operands: Any, **kwargs: Any) -> jax.Array:
        site = self.site.get_value()

        def dot(a: Any, b: Any, dims: Any, precision: Any = None, **kw: Any) -> jax.Array:
            pet, sharding = kw.get("preferred_element_type"), kw.get("out_sharding")
            return dot_general(a, b, dims, precision, pet, site=site, out_sharding=sharding)

        kwargs.pop("out_sharding", None)
        return jnp.einsum(equation, *operands, _dot_general=dot, **kwargs)
