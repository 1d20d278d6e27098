"""The studies and benchmarks, a package: run each as ``python -m eval.<study>`` from the
repository root (``eval/README.md`` lists them). Shared helpers: ``common.py`` (deterministic text,
CSV, plots; timing is ``promptcache.bench``'s round-robin), ``metrics.py``; the reference
implementation of selective recompute and its study selections: ``recompute_reference.py``,
``selections.py``; study-only engine selections registered with the engine: ``engine_selections.py``.
"""
