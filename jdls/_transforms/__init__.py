"""The optax transformations: one train step's gradients in, an update or a skip out.

What flows through: the unscaled gradients into ``jdls.wrap`` (``wrap``: measure, decide,
update or skip, record, adjust the scale), what a skipped step returns (``skip``), the
wrap's state and statistics in the optimizer state (``stats``); ``jdls.clip`` in front of
it (``clip``: its norm reaches the wrap through ``jdls._numerics.handoff``); recomputing an
overflow at a lower scale (``retry``, ``retrying``); micro-batches of one step
(``accumulate``); several optimizers under one scale (``groups``).

Imports ``jdls._numerics``, ``jdls._sites`` and ``jdls._scales``. Private: what users need
is exported by ``jdls``.
"""
