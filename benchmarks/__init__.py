"""jdls benchmarks: ``python -m benchmarks <suite> [--quick]`` (see ``benchmarks/__main__.py``).

Suites: ``update``, ``update-large``, ``step``, ``transformer``, ``compile``, ``roofline``,
``all``; ``python -m benchmarks.profile_ops`` for per-kernel times. Results and their
discussion: ``docs/performance.md``.
"""
