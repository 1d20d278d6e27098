"""OpenMP settings for a machine that others share, applied before torch starts.

torch's CPU kernels run their parallel regions on an OpenMP team (GNU libgomp in PyPI's builds),
whose threads meet at a barrier after every operation. By default a waiting thread spins, and
libgomp reads its wait policy once, when torch loads it. On a machine where another process
holds a core, the thread that lost its core is the one the others spin for: four
``DocumentStore.add()`` on SmolLM2 took 9.8 s beside one busy-looping thread instead of 1.4 s
alone (7x for half the CPU); with waiting threads that sleep, 2.8 s (figures:
eval/results/wait_policy.md, ``python -m eval.bench_wait_policy``).

So ``prefer_shared_machine()`` (run by ``import promptcache``, before anything imports torch)
sets ``OMP_WAIT_POLICY=PASSIVE`` unless the environment already sets it: set
``OMP_WAIT_POLICY=ACTIVE`` for a machine whose cores are yours alone (spinning is faster
there). The thread count stays torch's (one per physical core); ``OMP_NUM_THREADS`` or
``torch.set_num_threads`` change it. Once torch is imported the policy can no longer change:
then nothing is set, and a debug line says so.
"""

from __future__ import annotations

import logging
import os
import sys

__all__ = ["SHARED_MACHINE", "prefer_shared_machine"]

log = logging.getLogger(__name__)

SHARED_MACHINE = {"OMP_WAIT_POLICY": "PASSIVE"}  # what a process that shares its cores wants


def prefer_shared_machine(environ=os.environ) -> dict[str, str]:
    """Set each of ``SHARED_MACHINE`` the environment does not set; returns what was set (empty
    when torch is loaded already: libgomp has read its settings)."""
    if "torch" in sys.modules:
        log.debug("torch is already imported: OpenMP's wait policy stays %s",
                  environ.get("OMP_WAIT_POLICY", "libgomp's default"))
        return {}
    chosen = {k: v for k, v in SHARED_MACHINE.items() if k not in environ}
    environ.update(chosen)
    return chosen
