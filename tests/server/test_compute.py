"""The compute thread: every torch forward of a served engine runs on the one thread that loaded
it (``server/compute.py`` says why: a second OpenMP team makes each parallel region pay a
wake-up), errors come back with their type, and a call made on the thread itself runs inline."""

from __future__ import annotations

import asyncio
import threading

import pytest

from promptcache.engine import PmlPrompt, SamplingParams
from promptcache.pml import parse_prompt
from promptcache.server.core.backend import Backend
from promptcache.server.core.compute import ComputeThread
from promptcache.server.core.events import Done

PROMPT = "<prompt><user>Tell me about bicycles and their wheels.</user></prompt>"


def test_calls_run_in_order_on_one_thread_and_errors_keep_their_type():
    compute = ComputeThread()
    seen = [compute.call(threading.get_ident) for _ in range(3)]
    assert set(seen) == {compute.ident} and compute.ident != threading.get_ident()
    order = []
    futures = [compute.start(order.append, i) for i in range(5)]
    assert [f.result(10) for f in futures] == [None] * 5 and order == [0, 1, 2, 3, 4]
    with pytest.raises(KeyError, match="missing"):
        compute.call(lambda: {}["missing"])
    assert compute.call(lambda: compute.call(lambda: 7)) == 7  # on the thread: inline, no deadlock
    compute.shutdown()


def test_the_engine_of_a_backend_runs_on_the_compute_thread_it_was_given(pc):
    compute = ComputeThread()
    threads = set()
    hook = pc.model.register_forward_pre_hook(lambda module, args: threads.add(threading.get_ident()))
    try:
        backend = Backend(pc, max_queue=4, compute=compute)
        assert backend.compute is compute

        async def main():
            job = backend.submit(PmlPrompt(parse_prompt(PROMPT)), SamplingParams(max_new_tokens=5))
            events = []
            while not events or not events[-1].last:
                events.append(await asyncio.wait_for(job.events.get(), 60))
            return events

        events = asyncio.run(main())
        backend.close(5.0)
    finally:
        hook.remove()
    assert isinstance(events[-1], Done) and len(events[-1].generation.token_ids) == 5
    assert threads == {compute.ident}  # the self-check and every step: never the caller's thread
