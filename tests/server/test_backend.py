"""The worker over one shared Scheduler, without HTTP: events per job, a failing request does not
take the others down, cancellation frees what the request held."""

from __future__ import annotations

import asyncio
import functools

import pytest

from promptcache.server.backend import Backend, Sampling

PROMPT = "<prompt><user>Tell me about bicycles and their wheels.</user></prompt>"


async def drain(job) -> list[tuple[str, object]]:
    events = []
    while True:
        kind, value = await asyncio.wait_for(job.events.get(), 60)
        events.append((kind, value))
        if kind in ("done", "error"):
            return events


def idle(backend) -> bool:
    """Nothing running, nothing held: every pool block free (paged) or no batch row (older path)."""
    if backend.paged:
        return not backend.scheduler.running and backend.pool.free_blocks == backend.pool.num_blocks
    return not backend.scheduler.batch.members


@pytest.mark.parametrize("paged", [True, False], ids=["pool", "private"])
def test_a_failing_request_gets_an_error_and_the_others_finish(pc, paged):
    outcomes = []
    backend = Backend(pc, max_queue=8, on_finish=lambda job, how: outcomes.append(how), paged=paged)
    assert backend.paged == paged

    def broken(reserve):
        raise RuntimeError("no such prompt")

    async def main():
        good = [backend.submit(functools.partial(pc.prefill, PROMPT, keep_cache=True), Sampling(6, 0.0))
                for _ in range(3)]
        bad = backend.submit(broken, Sampling(6, 0.0))
        return await asyncio.gather(*(drain(j) for j in [*good, bad]))

    try:
        *good, bad = asyncio.run(main())
    finally:
        backend.close()
    assert bad[-1][0] == "error" and "no such prompt" in str(bad[-1][1])
    expected = pc.generate(PROMPT, max_new_tokens=6)
    for events in good:
        assert [k for k, _ in events][0] == "prefilled" and events[-1][0] == "done"
        assert "".join(v for k, v in events if k == "text") == expected.text
        assert events[-1][1].token_ids == expected.token_ids
    assert sorted(outcomes) == ["done"] * 3 + ["error"] and backend.in_flight == 0
    assert not backend.scheduler.has_work and idle(backend)


def test_cancel_frees_the_batch_row(pc):
    backend = Backend(pc, max_queue=8, paged=False)  # the older path's decode batch

    async def main():
        long = [backend.submit(functools.partial(pc.prefill, PROMPT, keep_cache=True), Sampling(400, 0.0))
                for _ in range(2)]
        for job in long:
            assert (await job.events.get())[0] == "prefilled"
        while len(backend.scheduler.batch.members) < 2:
            await asyncio.sleep(0.01)
        backend.cancel(long[0])
        kind, value = (await drain(long[0]))[-1]
        assert kind == "error" and isinstance(value, asyncio.CancelledError)
        assert long[0].request.finish_reason == "cancelled" and long[0].request not in backend.scheduler.batch
        backend.cancel(long[1])
        await drain(long[1])

    try:
        asyncio.run(main())
    finally:
        backend.close()
    assert backend.in_flight == 0 and not backend.scheduler.batch.members


def test_a_reader_that_stops_reading_is_paused_then_cancelled(pc):
    from promptcache.server.backend import ServingConfig

    outcomes = []
    config = ServingConfig(max_unread=4, pause_timeout=0.5)
    backend = Backend(pc, max_queue=8, on_finish=lambda job, how: outcomes.append(how), config=config)

    async def main():
        stalled = backend.submit(functools.partial(pc.prefill, PROMPT, keep_cache=True), Sampling(400, 0.0),
                                 lambda pool: pc.plan(PROMPT))
        reading = backend.submit(functools.partial(pc.prefill, PROMPT, keep_cache=True), Sampling(30, 0.0),
                                 lambda pool: pc.plan(PROMPT))
        events = await drain(reading)  # the other request is not held up by the stalled one
        assert events[-1][0] == "done" and len(events[-1][1].token_ids) == 30
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
