"""FP8 dots for Flax linen: a ``dot_general_cls`` for ``nn.Dense`` / ``nn.DenseGeneral`` and an
FP8 einsum module.

Each FP8 dot keeps its site (scales, amax histories, the last measurement) as the variable
``"fp8"`` in the collection ``"jdls"``, next to ``"params"``. Under ``nn.scan`` add
``"jdls": 0`` to ``variable_axes`` (one site per layer, as the parameters); ``nn.remat``
needs nothing (a site neither given nor makeable raises an error naming which of these
was left out). Differentiate the loss with respect to ``{"params": ..., "jdls": ...}``:
the gradient's ``"jdls"`` part is the step's measurement, which ``jdls.update_sites`` (or
``jdls.linen.TrainState``) turns into the next step's scales. Nothing is overwritten with a
gradient, so no optimizer, clipping or weight decay ever sees the FP8 state.

Example:
  >>> import functools, jax, jax.numpy as jnp, flax.linen as nn, jdls
  >>> dot = functools.partial(jdls.fp8.linen.DotGeneral, recipe=jdls.fp8.DelayedScaling(16))
  >>> model = nn.Dense(4, dot_general_cls=dot)
  >>> variables = model.init(jax.random.key(0), jnp.ones((2, 8)))
  >>> sorted(variables), variables["jdls"]["DotGeneral_0"]["fp8"].value.lhs.history.shape
  (['jdls', 'params'], (16,))
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax

from jdls._frameworks.linen_scope import require_site
from jdls._sites.site import Site
from jdls.fp8._delayed import DelayedScaling
from jdls.fp8._dot import dot_general
from jdls.fp8._einsum import einsum
from jdls.fp8._recipe import Recipe
from jdls.fp8._state import init, needs_key

__all__ = ["COLLECTION", "DotGeneral", "Einsum"]

#: The linen collection that holds jdls's sites (FP8 dots among them).
COLLECTION = "jdls"


def _new_site(module: nn.Module, recipe: Recipe) -> Site:
    """A new site; a recipe that rounds stochastically draws its seed from the ``"params"``
    stream, so that each layer of ``nn.scan`` (``split_rngs={"params": True}``) has its own."""
    key = module.make_rng("params") if needs_key(recipe) and module.has_rng("params") else None
    return init(recipe, key)


class DotGeneral(nn.Module):
    """A ``dot_general`` computed in FP8, with its site in the ``"jdls"`` collection.

    Pass it (or a ``functools.partial`` of it with a recipe) as ``dot_general_cls`` of
    ``nn.Dense`` or ``nn.DenseGeneral``.

    Attributes:
      recipe: the FP8 recipe (default: delayed scaling, history 1024, e4m3 / e5m2).
    """

    recipe: Recipe = DelayedScaling()

    @nn.compact
    def __call__(
        self,
        lhs: jax.Array,
        rhs: jax.Array,
        dimension_numbers: Any,
        precision: Any = None,
        preferred_element_type: Any = None,
        **kwargs: Any,
    ) -> jax.Array:
        assert self.scope is not None
        require_site(self.scope, "fp8")  # a missing "jdls" collection: the error names the fix
        site = self.variable(COLLECTION, "fp8", _new_site, self, self.recipe)
        return dot_general(
            lhs,
            rhs,
            dimension_numbers,
            precision,
            preferred_element_type,
            site=site.value,
            out_sharding=kwargs.get("out_sharding"),
        )


class Einsum(nn.Module):
    """A two-operand einsum computed as one FP8 dot, with its site in the ``"jdls"``
    collection: ``x`` (the activation) in the site's ``lhs`` role, ``kernel`` in its ``rhs``
    role, whatever order ``jnp.einsum`` would contract them in (:func:`jdls.fp8.einsum`).

    Called as ``Einsum(recipe)(equation, x, kernel)``, like Flax's ``Fp8Einsum``. For a
    hand-written projection (a ``self.param`` and ``jnp.einsum`` or ``jnp.dot``), make it
    inline in the ``@nn.compact`` method with a name; its site is the variable
    ``"jdls"/<name>/"fp8"`` of the calling module:
    ``jdls.fp8.linen.Einsum(recipe, name="qkv_fp8")("BSD,3KDH->3BSKH", x, w)``.

    Attributes:
      recipe: the FP8 recipe.

    Example:
      >>> import jax, jax.numpy as jnp, jdls
      >>> op = jdls.fp8.linen.Einsum(jdls.fp8.CurrentScaling(power_of_two=True))
      >>> x, w = jnp.ones((2, 3, 4)), jnp.full((4, 5), 0.5)
      >>> variables = op.init(jax.random.key(0), "btd,df->btf", x, w)
      >>> op.apply(variables, "btd,df->btf", x, w)[0, 0].tolist()
      [2.0, 2.0, 2.0, 2.0, 2.0]
    """

    recipe: Recipe = DelayedScaling()

    @nn.compact
    def __call__(
        self,
        equation: str,
        x: jax.Array,
        kernel: jax.Array,
        precision: Any = None,
        preferred_element_type: Any = None,
    ) -> jax.Array:
        assert self.scope is not None
        require_site(self.scope, "fp8")  # a missing "jdls" collection: the error names the fix
        site = self.variable(COLLECTION, "fp8", _new_site, self, self.recipe)
        return einsum(
            equation,
            x,
            kernel,
            site=site.value,
            precision=precision,
            preferred_element_type=preferred_element_type,
        )
