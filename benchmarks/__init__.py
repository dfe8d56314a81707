"""jdls benchmarks: ``python -m benchmarks <suite> [--quick]``; ``python -m benchmarks --help``
lists the suites and tools, all read from :data:`benchmarks._registry.SUITES` and
:data:`benchmarks._registry.TOOLS`.

Results go to ``benchmarks/results/`` (not in git: the benchmark command regenerates them);
their discussion is ``docs/performance.md``, and the target summary it reports is kept in
``benchmarks/summary-2026-11-21.md``.
"""

from benchmarks._registry import SUITES, TOOLS, Suite

__all__ = ["SUITES", "TOOLS", "Suite"]
