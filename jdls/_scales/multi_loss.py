"""Per-loss scales: several losses, each differentiated at its own scale, combined exactly.

``backward="one"`` (the default): ``fun`` is traced to a jaxpr, every value gets the set of
losses that depend on it (``loss_sets.py``), and one backward pass keeps each value's
cotangent at its set's scale: the region of the backward pass that only loss ``i`` reaches (its
head) runs at ``s_i``, a region shared by several losses at the smallest of their scales. Each
parameter's gradient is unscaled by its region's scale: the gradients equal ``jax.grad`` of the
weighted sum (bit for bit in float32 with power-of-two scales and weights), at about the cost
of one global scale's step. ``backward="per_loss"``: one forward pass (``jax.vjp``), one
backward pass per loss at its own scale, unscaled, weighted and summed in float32 (apex's
``num_losses`` / ``loss_id``): every parameter, shared ones included, gets each loss's share at
that loss's scale, for one backward pass per loss. The two passes are in
``multi_loss_passes.py``; this module checks the arguments and puts the result together.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from jdls._scales.filter import Split, is_jax_type, split_arguments
from jdls._scales.loss_adjust import keyed_items, rebuilt
from jdls._scales.multi_loss_passes import one_pass, per_loss
from jdls._scales.scale import LossScale, check_scale
from jdls._sites.measured import measured as measured_sites
from jdls._sites.site import is_site

__all__ = ["multi_loss_value_and_grad"]

_BACKWARDS = ("one", "per_loss")


def multi_loss_value_and_grad(
    fun: Callable[..., Any],
    scales: Mapping[Any, LossScale] | Sequence[LossScale],
    weights: Mapping[Any, float] | Sequence[float] | None = None,
    argnums: int | Sequence[int] = 0,
    has_aux: bool = False,
    *,
    backward: str = "one",
    with_amax: bool = False,
) -> Callable[..., tuple[Any, ...]]:
    """Gradients of several losses, each scaled by its own scale, combined after unscaling.

    ``fun`` returns its losses as a dict, tuple or list shaped like ``scales`` (one scalar
    per loss). The gradients equal ``jax.grad`` of ``sum(weights[i] * loss[i])`` wherever
    nothing underflows or overflows; how each loss's scale is applied depends on ``backward``:

    * ``"one"`` (default): one forward and one backward pass. ``fun`` is traced to a jaxpr (as
      ``jax.jit`` traces it: no Python control flow on traced values) and each value's backward
      cotangent is kept at the scale of the losses that depend on it: where only loss ``i``
      reaches (its head, its own parameters) at ``scales[i]``, in a region shared by several
      losses (a common trunk) at the smallest of their scales, as with one global scale there.
      A parameter used by one loss only is unscaled by that loss's scale and multiplied by its
      weight in float32, exactly as with ``"per_loss"``; a shared one is unscaled by the
      smallest scale of its losses (the weights entered where the losses' cotangents met).
      Functions inside ``jax.jit`` are looked into; other higher-order primitives (``scan``,
      ``cond``, ``remat``, ``custom_jvp``...) are one region each. Exact: in float32 with
      power-of-two scales and weights, the gradients are ``jax.grad``'s bit for bit (eager;
      under ``jax.jit`` to float32 rounding, XLA fusing the two programs differently); other
      scales or weights round once more where they are applied.
    * ``"per_loss"``: one forward pass, one backward pass per loss: loss ``i``'s cotangent is
      ``scales[i]``, its gradients are unscaled by it, multiplied by ``weights[i]`` in float32
      and added to the others'. Every parameter, shared ones included, gets each loss's share
      at that loss's own scale, for one backward pass per loss (about 1.7x one global scale's
      step for two losses).

    As on the global path (:meth:`jdls.LossScale.value_and_grad`), a 16-bit loss is multiplied
    by at most its format's largest power of two (``2**15`` for float16), and a site among the
    differentiated arguments (a :class:`jdls.Probe`, FP8 state) gets its measurement coded as
    that path returns it, never unscaled, weighted or summed like a gradient: with ``"one"``
    the one backward pass's, with ``"per_loss"`` that of one more backward pass of the
    weighted sum of the losses, each at its own scale. An FP8 dot's site is told the scale of
    its cotangent with ``"one"`` (its region's; over the loss's weight in one loss's head), so
    that it records the amax of the weighted sum's gradient unscaled; ``"per_loss"`` refuses
    an FP8 site (a ``ValueError`` naming ``"one"``): its one forward pass serves backward
    passes at several scales, and no pass could tell the dot its scale.

    Args:
      fun: the loss function; returns the losses (``{"a": la, "b": lb}`` or ``(la, lb)``),
        or ``(losses, aux)`` with ``has_aux``.
      scales: one jdls loss scale per loss, in the same container (dict keys or positions).
      weights: one float per loss (default 1 each). Applied in float32 to the unscaled
        gradients of the parameters used by that loss alone (all of them with ``"per_loss"``),
        so that a tiny weight does not enter the compute format there; with ``"one"`` it
        multiplies the loss's cotangent where it enters a region shared with other losses.
      argnums: positional argument(s) to differentiate, as in ``jax.value_and_grad``.
      has_aux: whether ``fun`` returns ``(losses, aux)``.
      backward: ``"one"`` or ``"per_loss"``, see above.
      with_amax: also return, per loss, the largest magnitude of its unscaled gradients (the
        measurement an observing rule such as :func:`jdls.AdaptiveScale` needs; give both to
        :func:`jdls.adjust_loss_scales`).

    Returns:
      A function of ``fun``'s arguments returning ``(losses, grads, finite)`` (or
      ``((losses, aux), grads, finite)``; with ``with_amax`` a fourth entry, ``grad_amax``):
      the losses as ``fun`` computed them, the combined unscaled gradients, and per loss a
      boolean scalar, whether that loss's gradients were finite (adjust the scales with it:
      ``jdls.adjust_loss_scales(scales, finite, grad_amax)``; under ``shard_map`` combine it
      over the devices first, ``jax.lax.pmin``, and ``grad_amax`` with ``jax.lax.pmax``, see
      ``docs/per-layer.md``). With ``"per_loss"``, loss ``i``'s flag and ``grad_amax`` are
      those of its own unscaled gradients (before its weight). With ``"one"``, loss ``i`` is
      non-finite when a region of the backward pass running at its scale made a non-finite
      value: its own region (measured where its cotangent leaves it), or a shared region whose
      smallest scale is its own (of several losses with that scale, those whose cotangents
      entered it largest). A non-finite cotangent leaving a region flags that region's losses
      and is replaced by zeros where it enters the next region, so that the next region's own
      overflows, and only they, flag its losses (an overflow in the small loss's head flags
      the small loss only, as ``"per_loss"`` does); the gradients that cotangent reaches (the
      parameters of every region it would have entered) come back NaN, so that the step is
      skipped as with ``"per_loss"``. Its ``grad_amax`` is the largest unscaled value computed
      at its scale: the gradients of its own parameters (before its weight), the cotangents
      leaving its own region (with several exits, their sum bounds it), and the combined
      gradients of the shared regions whose smallest scale is its own (of several losses
      with that scale, the one whose cotangent entered largest: tied scales part).

    Example:
      >>> import jax.numpy as jnp, jdls
      >>> def losses(p):
      ...     return {"big": jnp.sum(p["a"] ** 2), "small": 1e-4 * jnp.sum(p["b"] * p["a"])}
      >>> scales = {"big": jdls.StaticScale(8.0), "small": jdls.StaticScale(2.0**20)}
      >>> fn = jdls.multi_loss_value_and_grad(losses, scales)  # one backward pass
      >>> values, grads, finite = fn({"a": jnp.ones(2), "b": jnp.ones(2)})
      >>> [round(g, 4) for g in grads["a"].tolist()], [round(g, 6) for g in grads["b"].tolist()]
      ([2.0001, 2.0001], [0.0001, 0.0001])
      >>> bool(finite["big"]), bool(finite["small"])
      (True, True)
      >>> _, per_loss, _ = jdls.multi_loss_value_and_grad(losses, scales, backward="per_loss")(
      ...     {"a": jnp.ones(2), "b": jnp.ones(2)})
      >>> bool(jnp.all(per_loss["a"] == grads["a"]))
      True
    """
    if not isinstance(with_amax, bool):
        raise TypeError(f"with_amax must be True or False, got {with_amax!r}")
    if backward not in _BACKWARDS:
        raise ValueError(
            f"backward must be 'one' (one backward pass, each loss's own region at its scale) "
            f"or 'per_loss' (one backward pass per loss), got {backward!r}"
        )
    keys, scale_list = keyed_items(scales, "scales")
    if not keys:
        raise ValueError("scales must hold one loss scale per loss, got none")
    for key, scale in zip(keys, scale_list, strict=True):
        check_scale(scale, f"scales[{key!r}]")
    weight_list: list[Any]
    if weights is None:
        weight_list = [None] * len(keys)
    else:
        weight_keys, weight_list = keyed_items(weights, "weights")
        if isinstance(weights, Mapping) and set(weight_keys) == set(keys):
            weight_list = [weights[k] for k in keys]
        elif weight_keys != keys:
            raise ValueError(
                f"weights must have the keys of scales, {keys}, got {weight_keys}: pass one "
                "weight per loss, or None"
            )
    nums = (argnums,) if isinstance(argnums, int) else tuple(argnums)
    run = one_pass if backward == "one" else per_loss

    def value_and_grad_fn(*args: Any, **kwargs: Any) -> tuple[Any, ...]:
        if any(not -len(args) <= n < len(args) for n in nums):
            raise TypeError(
                f"differentiating with respect to argnums={argnums} requires at least "
                f"{max(n + 1 if n >= 0 else -n for n in nums)} positional arguments to be "
                f"passed by the caller, got {len(args)}: pass them positionally, or change "
                "argnums"
            )

        def forward(*diff: Any) -> Any:
            full = list(args)
            for n, value in zip(nums, diff, strict=True):
                full[n] = value
            return fun(*full, **kwargs)

        primals = [args[n] for n in nums]
        # non-array leaves (an Equinox model): held fixed, None gradients; the sites kept
        # whole, so that their cotangents are known as measurements and an FP8 dot is told
        # its region's scale
        split = split_arguments(primals, nums, "multi_loss_value_and_grad", is_jax_type, is_site)
        if split is not None:
            forward, primals = _combined(forward, split), list(split.diff)
        losses, aux, total, finite, measured = run(
            forward, primals, keys, scale_list, weight_list, has_aux, with_amax
        )
        total = measured_sites(total)  # as the global path returns a site's measurement
        grads = total[0] if isinstance(argnums, int) else tuple(total)
        value = (losses, aux) if has_aux else losses
        if with_amax:
            return value, grads, rebuilt(scales, finite), rebuilt(scales, measured)
        return value, grads, rebuilt(scales, finite)

    return value_and_grad_fn


def _combined(forward: Callable[..., Any], split: Split) -> Callable[..., Any]:
    return lambda *diffs: forward(*split.combine(diffs))
