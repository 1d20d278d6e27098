"""One prompt's prefill: the engine's settings (``config``, ``budget``), the plan a prefill reads
(``plan.PrefillPlan``: stored segments and new tokens), selective recompute (``recompute``), the
model runner that assembles a plan in a private splice buffer (``runner``, over
``models.splice``), and what a prefill and a generation return (``results``).

No serving state here: the serving core (``engine.serving_core``) reads the same plans from its pool.
Nothing here imports torch at package import (``config`` is read by ``promptcache --help``).
"""
