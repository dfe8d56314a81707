"""Framework glue behind the public faces ``jdls.linen``, ``jdls.nnx`` and ``jdls.equinox``.

What flows through: a Flax or Equinox model or train state in, jdls's scales and sites out:
the linen ``TrainState`` (``linen_state``), NNX ``value_and_grad`` and ``set_scale``
(``nnx_scale``), ``flax.serialization`` of the scales and sites (``flax_serialization``), and
sites placed in linen, NNX and Equinox models (``linen_sites``: the ``"jdls"`` collection;
``nnx_sites``: ``SiteVariable``; ``nnx_step``: ``Optimizer``, ``SiteMeasurement``;
``equinox_sites``: the ``Sited`` wrapper,
imported by ``jdls.equinox`` only).

Imports the floors below (``_numerics``, ``_sites``, ``_scales``, ``_transforms``), and
``jdls.presets`` lazily. Private: users import ``jdls.linen``, ``jdls.nnx`` and ``jdls.equinox``.
"""
