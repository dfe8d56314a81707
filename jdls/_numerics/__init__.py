"""Numbers checked and reduced: the floor every other part of jdls stands on.

What flows through: the arguments of the public functions on their way in (``checks``:
validators whose errors say what to pass instead, dtype predicates, ``all_finite``), and the
float leaves of a gradient tree on their way to a decision (``norm``: flattening, the exact
global norm and the largest magnitude from one pass of squares, clipping by the norm, and the
helpers that keep a value varying over the same mesh axes as another), and what a producer
measured handed to the wrap behind it by the identity of its arrays (``by_identity``, the
record; ``handoff``: from ``jdls.clip`` and from the scale's own ``value_and_grad``; ``norm``:
from ``jdls.retrying``'s loop), and the scalars a step decides
from them, compiled as one kernel (``scalars``), and the plain keys of pytree paths
(``paths``).

Imports nothing from jdls. Private, as every folder whose name starts with an underscore:
what users need is exported by ``jdls``.
"""
