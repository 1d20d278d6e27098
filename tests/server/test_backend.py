"""The worker over the serving core, without HTTP: events per job, a failing request does not
take the others down, cancellation frees what the request held."""

from __future__ import annotations

import asyncio

from promptcache.engine import PmlPrompt, SamplingParams, SourcePrompt
from promptcache.pml import parse_prompt
from promptcache.server.core.backend import Backend
from promptcache.server.core.events import Cancelled, Done, Event, Failed, Prefilled, Text

PROMPT = "<prompt><user>Tell me about bicycles and their wheels.</user></prompt>"


def prompt(pc) -> PmlPrompt:
    return PmlPrompt(parse_prompt(PROMPT))


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, temperature=0.0)


def broken() -> SourcePrompt:
    """A prompt whose planning fails (its source, a store, is gone)."""
    return SourcePrompt("no such prompt")


async def drain(job) -> list[Event]:
    events = []
    while not events or not events[-1].last:
        events.append(await asyncio.wait_for(job.events.get(), 60))
    return events


def idle(backend) -> bool:
    """Nothing running, nothing held: every pool block free (a PML prompt shares no blocks)."""
    return not backend.scheduler.running and backend.pool.free_blocks == backend.pool.num_blocks


def test_a_failing_request_gets_an_error_and_the_others_finish(pc):
    outcomes = []
    backend = Backend(pc, max_queue=8, on_finish=lambda job, how: outcomes.append(how))

    async def main():
        good = [backend.submit(prompt(pc), greedy(6)) for _ in range(3)]
        bad = backend.submit(broken(), greedy(6))
        return await asyncio.gather(*(drain(j) for j in [*good, bad]))

    try:
        *good, bad = asyncio.run(main())
    finally:
        backend.close()
    assert isinstance(bad[-1], Failed) and "'no such prompt' is gone" in str(bad[-1].error)
    expected = pc.generate(PROMPT, max_new_tokens=6, temperature=0.0)
    for events in good:
        assert isinstance(events[0], Prefilled) and isinstance(events[-1], Done)
        assert "".join(e.piece for e in events if isinstance(e, Text)) == expected.text
        assert events[-1].generation.token_ids == expected.token_ids
    assert sorted(outcomes) == ["done"] * 3 + ["error"] and backend.in_flight == 0
    assert not backend.scheduler.has_work and idle(backend)


def test_cancel_frees_the_requests_blocks(pc):
    backend = Backend(pc, max_queue=8)

    async def main():
        long = [backend.submit(prompt(pc), greedy(400)) for _ in range(2)]
        for job in long:
            assert isinstance(await job.events.get(), Prefilled)
        held = backend.pool.free_blocks
        backend.cancel(long[0])
        assert isinstance((await drain(long[0]))[-1], Cancelled)
        assert long[0].request.finish_reason == "cancelled" and long[0].request not in backend.scheduler.running
        assert backend.pool.free_blocks > held  # its own blocks (400 tokens reserved) are free again
        backend.cancel(long[1])
        await drain(long[1])

    try:
        asyncio.run(main())
    finally:
        backend.close()
    assert backend.in_flight == 0 and idle(backend)


def test_a_reader_that_stops_reading_is_paused_then_cancelled(pc):
    from promptcache.engine import ServingConfig

    outcomes = []
    config = ServingConfig(max_unread=4, pause_timeout=0.5)
    backend = Backend(pc, max_queue=8, on_finish=lambda job, how: outcomes.append(how), config=config)

    async def main():
        stalled = backend.submit(prompt(pc), greedy(400))
        reading = backend.submit(prompt(pc), greedy(30))
        events = await drain(reading)  # the other request is not held up by the stalled one
        assert isinstance(events[-1], Done) and len(events[-1].generation.token_ids) == 30
        for _ in range(200):
            if stalled.request.finished:
                break
            await asyncio.sleep(0.05)
        assert stalled.request.finish_reason == "cancelled"
        assert len(stalled.request.token_ids) < 4 + 8  # paused after a few unread events, then dropped
        return stalled

    try:
        asyncio.run(main())
    finally:
        backend.close()
    assert sorted(outcomes) == ["cancelled", "done"] and idle(backend)
