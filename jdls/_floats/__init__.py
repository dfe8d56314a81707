"""Float formats: bit-exact narrow formats, their limits, and precision policies.

What flows through: arrays rounded to a format and back (``bits``: the encoding and decoding
kernels; ``formats``: ``FloatFormat``, ``cbfloat16`` and a format's machine limits,
``FormatInfo``; ``lookup``: ``finfo`` and ``canonical_format``, a format by name or dtype;
``storage``: ``compress`` and ``decompress``), and the dtypes a model computes and keeps its
parameters in (``policy``: ``Policy``, ``get_policy``).

Imports ``jdls._numerics``. Loss scaling does not depend on formats except where a rule or a
probe measures against a format's range (``jdls.rules.Adaptive``, the probes, per-layer
scales). Private: what users need is exported by ``jdls``.
"""
