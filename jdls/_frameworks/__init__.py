"""Flax glue behind the public faces ``jdls.linen`` and ``jdls.nnx``.

What flows through: a Flax model or train state in, jdls's scales and sites out: the linen
``TrainState`` (``linen_state``), NNX ``value_and_grad`` and ``set_scale`` (``nnx_scale``),
``flax.serialization`` of the scales and sites (``flax_serialization``), and sites placed in
linen and NNX models (``linen_sites``: the ``"jdls"`` collection; ``nnx_sites``:
``SiteVariable``, ``Optimizer``).

Imports the floors below (``_numerics``, ``_sites``, ``_scales``, ``_transforms``), and
``jdls.presets`` lazily. Private: users import ``jdls.linen`` and ``jdls.nnx``.
"""
