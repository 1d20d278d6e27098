"""The server on the serving core, through real sockets: a chat's next turn reuses the last one,
a client that disconnects while queued or prefilling is dropped before it costs more, and
SIGTERM with a reader that stopped reading exits within the drain timeout."""

from __future__ import annotations

import json
import signal
import socket
import threading
import time

import openai
import pytest

from promptcache.server import create_app
from promptcache.engine import ServingConfig
from serverkit import MODEL, client, free_port, metric, running, start_until

LONG_USER = " ".join(f"Item {i} is a bicycle part with a name and a price." for i in range(40))


def raw_post(url: str, body: dict, path: str = "/v1/chat/completions") -> socket.socket:
    """Send a request on a raw socket and return it unread (the caller closes it)."""
    host, port = url.removeprefix("http://").split(":")
    data = json.dumps(body).encode()
    s = socket.create_connection((host, int(port)))
    s.sendall(f"POST {path} HTTP/1.1\r\n".encode() + b"Host: 127.0.0.1\r\ncontent-type: application/json\r\n"
              + f"content-length: {len(data)}\r\n\r\n".encode() + data)
    return s


def wait_for(cond, timeout=20.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.02)
    return False


def test_each_turn_of_a_chat_reuses_the_previous_turns(pc):
    app = create_app(pc, model_name=MODEL)  # the defaults: 16-token blocks in the pool
    with running(app) as url:
        oai = client(url)
        msgs = [{"role": "system", "content": "You help with bicycles. " * 8}]
        last_prompt = 0
        for i, q in enumerate(["Brakes squeak.", "And the chain?", "Tyres?", "Thanks."]):
            msgs.append({"role": "user", "content": q})
            r = oai.chat.completions.create(model=MODEL, messages=msgs, max_tokens=12, temperature=0)
            cached = r.usage.prompt_tokens_details.cached_tokens
            if i:  # everything the last turn's prompt held, but the last partial block
                assert cached >= last_prompt // 16 * 16 > 0
            last_prompt = r.usage.prompt_tokens
            msgs.append({"role": "assistant", "content": r.choices[0].message.content})
        assert app.state.backend.published_blocks > 0


@pytest.mark.parametrize("route", ["/v1/chat/completions", "/v1/messages"])
def test_a_client_that_disconnects_while_queued_is_dropped(pc, route):
    """Every API runs the one lifecycle: a queued request whose client left is cancelled at once."""
    app = create_app(pc, model_name=MODEL, serving=ServingConfig(max_num_seqs=1))  # one runs, others queue
    with running(app) as url:
        stream = client(url).chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Tell me a long story."}], max_tokens=2000,
            temperature=0, stream=True)
        next(iter(stream))  # the long request runs
        s = raw_post(url, {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 5}, route)
        assert wait_for(lambda: len(app.state.backend.scheduler.waiting) == 1)
        s.close()
        assert wait_for(lambda: metric(url, "promptcache_requests_finished_total", outcome="cancelled") == 1)
        assert not app.state.backend.scheduler.waiting
        assert len(app.state.backend.scheduler.running) == 1  # the long one goes on
        stream.close()
        assert wait_for(lambda: app.state.backend.in_flight == 0)


def test_a_client_that_disconnects_while_prefilling_frees_its_blocks(pc):
    serving = ServingConfig(max_num_batched_tokens=4)  # a long prompt prefills over many steps
    app = create_app(pc, model_name=MODEL, serving=serving)
    backend = app.state.backend
    with running(app) as url:
        s = raw_post(url, {"model": MODEL, "messages": [{"role": "user", "content": LONG_USER}], "max_tokens": 5})
        assert wait_for(lambda: backend.scheduler.running and backend.scheduler.prefill_tokens > 8)
        s.close()
        assert wait_for(lambda: metric(url, "promptcache_requests_finished_total", outcome="cancelled") == 1)
        assert backend.scheduler.prefill_tokens < 500  # it stopped long before its prompt's end
        assert metric(url, "promptcache_ttft_seconds_count") == 0  # never prefilled
        # nothing held: every block is free or an idle shared block (the prompt blocks it completed
        # stay for the next request that starts with them)
        assert backend.pool.available_blocks == backend.pool.num_blocks


@pytest.mark.slow  # a subprocess loads torch and the model
def test_sigterm_with_a_stalled_reader_exits_within_the_drain_timeout(tmp_path):
    port = free_port()
    proc, _ = start_until(["-m", "promptcache.server", "--model", MODEL, "--port", str(port), "--drain-timeout", "2"],
                          "Ready", cwd=tmp_path)
    try:
        threading.Thread(target=proc.stderr.read, daemon=True).start()  # keep the pipe drained
        url = f"http://127.0.0.1:{port}"
        assert wait_for(lambda: _listening(port))
        s = raw_post(url, {"model": MODEL, "messages": [{"role": "user", "content": "Go on forever."}],
                           "max_tokens": 8000, "stream": True})  # and never read
        time.sleep(1.0)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
        took = time.monotonic() - t0
        s.close()
        assert took < 2 + 3, f"exit took {took:.1f} s with a 2 s drain timeout"
    finally:
        if proc.poll() is None:
            proc.kill()


def _listening(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
        return True
    except OSError:
        return False


def test_min_tokens_and_ignore_eos_make_answers_their_full_length(oai, pc):
    """vLLM's fields, which benchmarks send so every server generates the same number of tokens."""
    eos = sorted(pc.runner.eos_ids)[0]
    prompt = [1, 2, 3, eos]  # any ids; the answer may end early on its own
    r = oai.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0,
                               extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 24 and r.choices[0].finish_reason == "length"
    r = oai.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0,
                               extra_body={"min_tokens": 10})
    assert r.usage.completion_tokens >= 10
    with pytest.raises(openai.BadRequestError, match="min_tokens"):  # past max_tokens: refused, naming it
        oai.completions.create(model=MODEL, prompt=prompt, max_tokens=4, extra_body={"min_tokens": 10})
