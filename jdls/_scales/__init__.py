"""Loss scales: scale the loss, differentiate, unscale the gradients, adjust the scale.

What flows through: a loss on its way into differentiation, multiplied by the scale, and the
gradients on their way out, divided by it (``scale_interface``: the ``LossScale`` interface;
``grad``: the scaled ``value_and_grad``; ``filter``: the arguments that are not
differentiated pass through as themselves); the scale itself, adjusted by its rule from
whether a step was finite (``scale``: ``NoOpScale``, ``StaticScale``, ``DynamicScale``,
``AdaptiveScale``; the rules are the public ``jdls.rules``). Finer grains of the same idea:
one scale per loss (``multi_loss``, with ``loss_sets`` for the one backward pass) and one
per layer (``layer_scales``, a site kind).

Imports ``jdls._numerics``, ``jdls._floats``, ``jdls._sites`` and ``jdls.rules``. Private:
what users need is exported by ``jdls``.
"""
