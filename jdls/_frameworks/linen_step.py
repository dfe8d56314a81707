"""A linen step without a ``TrainState``: the model's variables in a dict of the user's own.

Codebases that keep ``{"params": ..., "opt_state": ..., "step": ...}`` (a dict train state)
need what :class:`jdls.linen.TrainState` does, as two functions: :func:`value_and_grad`
differentiates the loss with respect to the model's variables (its parameters and its
``"jdls"`` sites: probes, per-layer scales, FP8 state) at the loss scale, and
:func:`apply_gradients` gives the parameters' gradients to the optimizer and updates every
site from its measurement, knowing whether the step was taken. ``TrainState`` is built on
them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import jax
import optax

from jdls._frameworks.linen_scope import SITES
from jdls._scales.layer_scales import scale_layers
from jdls._scales.layer_site import layer_sites
from jdls._scales.scale import LossScale, check_scale
from jdls._sites.update import update_sites
from jdls._transforms import apply as site_apply
from jdls._transforms.stats import step_applied

__all__ = ["apply_gradients", "split_gradients", "value_and_grad"]


def value_and_grad(
    fun: Callable[..., Any],
    scale: LossScale,
    *,
    argnum: int = 0,
    has_aux: bool = False,
) -> Callable[..., Any]:
    """``jax.value_and_grad`` of ``fun`` with respect to a linen model's variables
    (``{"params": ..., "jdls": ...}``, argument ``argnum``), at the loss scale ``scale``.

    The loss is scaled before differentiating and the gradients are unscaled after; the
    gradients of ``"jdls"`` are the sites' measurements (a probe's amax, an FP8 dot's amaxes,
    a per-layer scale's layer measurement), for :func:`apply_gradients`. With per-layer scales
    (``jdls.linen.layer_scales``) each layer's parameters are differentiated at their own
    scale. Variables without sites (``{"params": ...}``) are differentiated as any pytree.
    Other collections of the variables (``"batch_stats"``, ``"cache"``) are held fixed:
    ``fun`` sees them, the gradients leave them out. ``jdls.linen.TrainState.value_and_grad``
    is this function with the state's scale.

    Args:
      fun: the loss function; returns a scalar, or ``(loss, aux)`` with ``has_aux``.
      scale: the loss scale, e.g. ``jdls.get_scale(opt_state)``.
      argnum: the positional argument of ``fun`` that holds the variables.
      has_aux: whether ``fun`` returns ``(loss, aux)``.

    Returns:
      A function with ``fun``'s arguments returning ``(loss, grads)`` (or
      ``((loss, aux), grads)``), ``grads`` shaped like the variables' ``"params"`` and
      ``"jdls"``; ``loss`` unscaled.

    Example:
      >>> import flax.linen as nn, jax, jax.numpy as jnp, optax, jdls
      >>> model = jdls.linen.probes(nn.Sequential([nn.Dense(4), nn.relu, nn.Dense(1)]))
      >>> variables = model.init(jax.random.key(0), jnp.ones((4, 3)))
      >>> loss_fn = lambda v, x: jnp.sum(model.apply(v, x) ** 2)
      >>> loss, grads = jdls.linen.value_and_grad(loss_fn, jdls.StaticScale(1024.0))(
      ...     variables, jnp.ones((4, 3)))
      >>> sorted(grads)
      ['jdls', 'params']
    """
    check_scale(scale, "jdls.linen.value_and_grad")
    if not isinstance(argnum, int):
        raise TypeError(
            "jdls.linen.value_and_grad differentiates one argument, the variables "
            f"({{'params': ..., 'jdls': ...}}); got argnum={argnum!r}: pass its position"
        )
    plain = scale.value_and_grad(fun, argnums=argnum, has_aux=has_aux)

    def value_and_grad_fn(*args: Any, **kwargs: Any) -> Any:
        if len(args) <= argnum:
            raise TypeError(
                f"jdls.linen.value_and_grad: the variables are argument {argnum} of the loss "
                f"function, but it was called with {len(args)} positional argument(s)"
            )
        variables = args[argnum]
        if isinstance(variables, Mapping) and set(variables) - {"params", SITES}:
            # other collections ("batch_stats", "cache") are held fixed, as apply_gradients
            # passes them through: differentiate {"params", "jdls"} only
            held = {k: v for k, v in variables.items() if k not in ("params", SITES)}
            trained = {k: v for k, v in variables.items() if k in ("params", SITES)}

            def with_held(*a: Any, **kw: Any) -> Any:
                a = (*a[:argnum], {**held, **a[argnum]}, *a[argnum + 1 :])
                return fun(*a, **kw)

            args = (*args[:argnum], trained, *args[argnum + 1 :])
            return value_and_grad(with_held, scale, argnum=argnum, has_aux=has_aux)(*args, **kwargs)
        sites = variables.get(SITES) if isinstance(variables, Mapping) else None
        if not layer_sites(sites):
            return plain(*args, **kwargs)
        # per-layer scales: the site at ("jdls", *path, "layer_scale") scales the parameters
        # under ("params", *path)
        value, (grads,) = scale_layers(
            fun,
            args,
            kwargs,
            (argnum,),
            layer_of=lambda path: ("params", *path[2:-1]),
            param_path=lambda path: path[1:],
            has_aux=has_aux,
            who="jdls.linen.value_and_grad",
        )
        return value, grads

    return value_and_grad_fn


def _same_structure(a: Any, b: Any) -> bool:
    """Whether two pytrees have one structure."""
    same: bool = jax.tree.structure(a) == jax.tree.structure(b)  # type: ignore[operator]
    return same


def split_gradients(grads: Any, params: Any, sites: Any) -> tuple[Any, Any]:
    """``(parameter gradients, site measurements)`` of the gradients of a linen model's
    variables; ``sites`` is the model's ``"jdls"`` collection (None without sites).

    Without sites ``grads`` may be the parameters' gradients themselves or
    ``{"params": ...}``; with sites it must be ``{"params": ..., "jdls": ...}``, what
    :func:`value_and_grad` returns (a ``ValueError`` says so otherwise).

    Example:
      >>> import jax.numpy as jnp, jdls
      >>> params = {"w": jnp.ones(2)}
      >>> jdls.linen.split_gradients({"params": params}, params, None)[1] is None
      True
    """
    if sites is not None:
        if not isinstance(grads, Mapping) or set(grads) != {"params", SITES}:
            got = sorted(grads) if isinstance(grads, Mapping) else type(grads).__name__
            raise ValueError(
                "the model has sites (its 'jdls' collection), so the gradients must be those "
                "of the variables, {'params': ..., 'jdls': ...}, as jdls.linen.value_and_grad "
                "of the variables (or state.value_and_grad(loss_fn)(state.variables) with a "
                f"TrainState) returns them; got {got}"
            )
        return grads["params"], grads[SITES]
    if (
        isinstance(grads, Mapping)
        and set(grads) == {"params"}
        and _same_structure(grads["params"], params)
    ):
        return grads["params"], None  # the gradients of {"params": ...}
    return grads, None


def _initialized_on(tx: Any, opt_state: Any, variables: Any, params: Any) -> Any:
    """The tree ``opt_state`` is ``tx.init`` of, when it is not the parameters: the
    variables' ``{"params", "jdls"}`` (a dict, or the variables' own mapping type); None for
    the parameters. Compared by tree structure, abstractly. Initialised on every collection
    (``batch_stats`` included), it is refused: the optimizer would train them."""
    if _same_structure(jax.eval_shape(tx.init, params), opt_state):
        return None
    trained = {k: variables[k] for k in ("params", SITES) if k in variables}
    kinds = (trained, type(variables)(trained)) if type(variables) is not dict else (trained,)  # type: ignore[call-arg]
    for candidate in kinds:
        if _same_structure(jax.eval_shape(tx.init, candidate), opt_state):
            return candidate
    others = sorted(set(variables) - {"params", SITES})
    if others and _same_structure(jax.eval_shape(tx.init, variables), opt_state):
        raise ValueError(
            f"the optimizer state was initialised on every collection of the variables, "
            f"{others} included, so the optimizer would train them: initialise it on the "
            "parameters, tx.init(variables['params']) (or on {'params': ..., 'jdls': ...})"
        )
    return None


def apply_gradients(
    tx: Any, variables: Any, grads: Any, opt_state: Any, *, value: Any = None
) -> tuple[Any, Any]:
    """One optimizer step on a linen model's variables: ``(new variables, new opt_state)``.

    The parameters' gradients ``grads["params"]`` go to ``tx`` (a chain with
    ``jdls.wrap``, which skips a non-finite step and adjusts the scale) and
    ``optax.apply_updates`` (each parameter keeps its dtype); every site in
    ``variables["jdls"]`` is updated by its kind from its measurement ``grads["jdls"]``,
    knowing whether the step was taken, and never given to the optimizer. Other collections
    of ``variables`` (``"batch_stats"``, ``"cache"``) are returned as they are:
    ``jdls.keep_if_skipped(opt_state, new, old)`` keeps their old value on a skipped step.
    ``jdls.linen.TrainState.apply_gradients`` is this function on the state's fields.

    Args:
      tx: the optimizer (``jdls.wrap(...)`` or a chain holding it).
      variables: ``{"params": ..., "jdls": ...}`` (``"jdls"`` only with sites), a dict or a
        ``FrozenDict``.
      grads: what :func:`value_and_grad` returned for ``variables``.
      opt_state: ``tx``'s state, ``tx.init(variables["params"])`` or ``tx.init(variables)``
        (the wrap keeps the sites apart; the two step alike).
      value: the step's loss, passed to ``tx.update(..., value=loss)``: the wrap then tells a
        non-finite loss (``jdls.SkipCause.FORWARD``: bad data, a forward overflow; not
        ``handled``) from an overflow of the scaled gradients (loss scaling at work), which
        ``jdls.skip_cause(opt_state)`` reports to a loop's own NaN guard.

    Returns:
      ``(variables, opt_state)`` after the step, ``variables`` of the type given.

    Example:
      >>> import flax.linen as nn, jax, jax.numpy as jnp, optax, jdls
      >>> model = jdls.linen.probes(nn.Sequential([nn.Dense(4), nn.relu, nn.Dense(1)]))
      >>> x = jnp.ones((4, 3))
      >>> variables = model.init(jax.random.key(0), x)
      >>> tx = jdls.wrap(optax.sgd(0.1))
      >>> opt_state = tx.init(variables["params"])
      >>> loss_fn = lambda v: jnp.sum(model.apply(v, x) ** 2)
      >>> loss, grads = jdls.linen.value_and_grad(loss_fn, jdls.get_scale(opt_state))(variables)
      >>> variables, opt_state = jdls.linen.apply_gradients(tx, variables, grads, opt_state)
      >>> bool(jdls.stats(opt_state).finite), sorted(variables)
      (True, ['jdls', 'params'])
    """
    if not isinstance(variables, Mapping) or "params" not in variables:
        raise TypeError(
            "jdls.linen.apply_gradients takes the model's variables, a dict with 'params' "
            "(and 'jdls' with sites), as model.init returns them; got "
            f"{type(variables).__name__}"
            + (f" with keys {sorted(variables)}" if isinstance(variables, Mapping) else "")
        )
    params, sites = variables["params"], variables.get(SITES)
    extra = {} if value is None else {"value": value}
    trained = _initialized_on(tx, opt_state, variables, params)
    if trained is not None:
        # tx.init(variables): the wrap keeps the sites apart and updates them itself
        if sites is None and not (isinstance(grads, Mapping) and set(grads) == {"params"}):
            grads = {"params": grads}  # the parameters' gradients, as without sites
        if not isinstance(grads, Mapping) or set(grads) != set(trained):
            split_gradients(grads, params, sites)  # the error that names what to pass
        grads = type(trained)({k: grads[k] for k in trained})  # type: ignore[call-arg]
        updates, opt_state = tx.update(grads, opt_state, trained, **extra)
        new = {**variables, **site_apply.apply_updates(trained, updates, opt_state)}
        return (new if type(variables) is dict else type(variables)(new)), opt_state  # type: ignore[call-arg]
    param_grads, measured = split_gradients(grads, params, sites)
    updates, opt_state = tx.update(param_grads, opt_state, params, **extra)
    new = {**variables, "params": optax.apply_updates(params, updates)}
    if measured is not None:
        new[SITES] = update_sites(sites, measured, step_applied(opt_state))
    return (new if type(variables) is dict else type(variables)(new)), opt_state  # type: ignore[call-arg]
