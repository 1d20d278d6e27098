"""Concurrent requests, cancellation, tenant isolation and metrics, on real servers."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

from serverkit import MODEL, client, metric, running

from promptcache.server import create_app

LONG_SYSTEM = "You are the support desk of a bicycle shop that repairs wheels and gears. " * 8


def wait_for(cond, seconds: float = 30.0) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.05)
    return False


def test_greedy_outputs_under_8_concurrent_requests_equal_one_by_one(pc):
    app = create_app(pc, model_name=MODEL)
    prompts = [f"Question {i}: tell me about the number {i * 7}." for i in range(8)]
    with running(app) as url:
        oai = client(url)

        def one(p):
            r = oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": p}],
                                            max_tokens=12, temperature=0)
            return r.choices[0].message.content

        alone = [one(p) for p in prompts]
        assert metric(url, "promptcache_decode_tokens") == metric(url, "promptcache_decode_forwards")  # one by one
        forwards, tokens = metric(url, "promptcache_decode_forwards"), metric(url, "promptcache_decode_tokens")
        with ThreadPoolExecutor(8) as ex:
            together = list(ex.map(one, prompts))
        forwards = metric(url, "promptcache_decode_forwards") - forwards
        tokens = metric(url, "promptcache_decode_tokens") - tokens
    assert together == alone
    assert tokens > 2 * forwards, (tokens, forwards)  # concurrent decode steps shared forwards (batched)
    assert len(set(alone)) > 1  # distinct prompts, distinct answers: the comparison can fail


def test_interleaving_no_request_waits_for_a_whole_generation(pc):
    """A short request sent while a long one streams finishes before the long one does."""
    app = create_app(pc, model_name=MODEL)
    with running(app) as url:
        oai = client(url)
        long = oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "long"}],
                                           max_tokens=200, temperature=0, stream=True)
        it = iter(long)
        next(it)
        short = oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "short"}],
                                            max_tokens=2, temperature=0)
        assert short.usage.completion_tokens <= 2
        # answered while the long one is still decoding (served one after another, it would have waited)
        assert metric(url, "promptcache_requests_finished_total", outcome="done") == 1
        assert metric(url, "promptcache_requests_in_flight") == 1
        finished = [c.choices[0].finish_reason for c in it if c.choices and c.choices[0].finish_reason]
        assert finished == ["length"]


def test_client_that_closes_a_stream_cancels_it(pc):
    app = create_app(pc, model_name=MODEL)
    with running(app) as url:
        oai = client(url)
        stream = oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "go on"}],
                                             max_tokens=2000, temperature=0, stream=True)
        it = iter(stream)
        next(it), next(it)
        assert metric(url, "promptcache_requests_in_flight") == 1
        stream.close()
        assert wait_for(lambda: metric(url, "promptcache_requests_finished_total", outcome="cancelled") == 1)
        assert metric(url, "promptcache_requests_in_flight") == 0
        assert metric(url, "promptcache_generated_tokens_total") == 0  # it never finished


def test_two_keys_never_share_a_cached_prefix(pc):
    app = create_app(pc, api_keys={"alice-key": "alice", "bob-key": "bob", "alice-2": "alice"},
                     model_name=MODEL, block_size=16)
    msgs = [{"role": "system", "content": LONG_SYSTEM}, {"role": "user", "content": "My chain slips."}]
    with running(app) as url:
        def cached(key):
            r = client(url, key).chat.completions.create(model=MODEL, messages=msgs, max_tokens=2, temperature=0)
            return r.usage.prompt_tokens_details.cached_tokens

        assert cached("alice-key") == 0
        assert cached("alice-key") > 0
        assert cached("bob-key") == 0  # same text, other tenant: computed afresh
        assert cached("alice-2") > 0  # another key of the same namespace shares


def test_metrics_counters_move(pc):
    app = create_app(pc, model_name=MODEL, block_size=16)
    with running(app) as url:
        before = metric(url, "promptcache_requests_total", endpoint="/v1/chat/completions", status="200")
        oai = client(url)
        msgs = [{"role": "system", "content": LONG_SYSTEM}, {"role": "user", "content": "Brakes squeak."}]
        for _ in range(2):
            oai.chat.completions.create(model=MODEL, messages=msgs, max_tokens=3, temperature=0)
        assert metric(url, "promptcache_requests_total", endpoint="/v1/chat/completions", status="200") == before + 2
        assert metric(url, "promptcache_generated_tokens_total") >= 2
        assert metric(url, "promptcache_cached_tokens_total") > 0
        assert metric(url, "promptcache_prompt_tokens_total") > metric(url, "promptcache_cached_tokens_total")
        assert metric(url, "promptcache_prefix_blocks_stored") > 0
        assert metric(url, "promptcache_ttft_seconds_count") == 2
        assert metric(url, "promptcache_requests_finished_total", outcome="done") == 2


def test_client_that_drops_a_plain_request_cancels_it(pc):
    import json
    import socket

    app = create_app(pc, model_name=MODEL)
    with running(app) as url:
        body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "go"}], "max_tokens": 3000,
                           "temperature": 0}).encode()
        host, port = url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port))) as s:
            s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"
                      + f"content-length: {len(body)}\r\n\r\n".encode() + body)
            assert wait_for(lambda: metric(url, "promptcache_requests_in_flight") == 1)
        assert wait_for(lambda: metric(url, "promptcache_requests_finished_total", outcome="cancelled") == 1)
        assert metric(url, "promptcache_requests_in_flight") == 0
