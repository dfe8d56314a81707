"""State at a site: a value inside a model that carries state measured by the backward pass.

What flows through: a site's state into the forward pass as an argument of a ``custom_vjp``,
and its measurement out of the backward pass as that argument's cotangent (``site``:
``SiteKind``, ``Site``; ``apply``: ``apply_site``; ``update``:
``split_sites``, ``merge_sites``, ``update_sites``; ``apart``: ``sites_apart``, sites kept
from an optimizer); the first kind of site, the probe, measures what a format would lose
(``probe``: ``Probe``, ``Telemetry``, ``plot_headroom``). Per-layer scales, a site kind that
is a scale, live with the scales; FP8 dots, a site kind of their own, in ``jdls.fp8``.

Imports ``jdls._numerics`` and ``jdls._floats``. Private: what users need is exported by
``jdls``.
"""
