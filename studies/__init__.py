"""Studies whose output is a page of the documentation (not speed or memory measurements; those
are in ``benchmarks/``). Each is one command that rewrites its page and its plot:

* ``python -m studies.underflow``: gradient underflow in float16, cbfloat16 and bfloat16 at
  several loss scales; writes ``docs/underflow.md`` and ``docs/img/underflow.png`` (needs
  scikit-learn for the digits data set and matplotlib).
"""
