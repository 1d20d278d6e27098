"""Every route's CPU work runs off the event loop: its largest allowed request is sent while
/health is polled, and /health keeps answering.

Each case sends a body near the default limits (2M characters of text, or an 8 MB body of token
ids) whose validation, tokenizing, templating or rendering takes about a second or more here.
A route that did that work on the event loop would hold /health for the whole request; so the
test asserts that /health answered while the big request was in flight, and that its slowest
answer took less than half the big request's time (a generous bound on a loaded 2-core machine
that still fails when the loop is blocked for the request's duration).
"""

from __future__ import annotations

import json
import threading
import time
import urllib.request

import pytest

from serverkit import MODEL

CHARS = 1_999_000  # text of a request at the default max_chars (2M) with room for its keys
TEXT = ("Kyoto has thousands of shrines. " * (CHARS // 32 + 1))[:CHARS]
IDS = [i % 4000 for i in range(1_200_000)]  # ~7 MB of JSON: just under the 8 MB body limit

CASES = {
    "tokenize": ("/tokenize", {"prompt": TEXT}),
    "tokenize messages": ("/tokenize", {"messages": [{"role": "user", "content": TEXT}]}),
    "detokenize": ("/detokenize", {"tokens": IDS}),
    "chat": ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": TEXT}],
                                      "max_tokens": 1}),
    "completion": ("/v1/completions", {"model": MODEL, "prompt": TEXT, "max_tokens": 1}),
    "messages": ("/v1/messages", {"model": MODEL, "max_tokens": 1, "messages": [
        {"role": "user", "content": [{"type": "text", "text": TEXT, "cache_control": {"type": "ephemeral"}}]}]}),
    "count_tokens": ("/v1/messages/count_tokens", {"model": MODEL,
                                                   "messages": [{"role": "user", "content": TEXT}]}),
    "studio prompt": ("/studio/api/prompt", {"messages": [{"role": "user", "content": TEXT}]}),
    "studio full": ("/studio/api/full", {"messages": [{"role": "user", "content": TEXT}]}),
    "studio schema": ("/studio/api/schema", {"pml": '<schema name="big"><module name="m">'
                                                     + TEXT[:CHARS - 100] + "</module></schema>"}),
}


def _post(url: str, body: bytes) -> int:
    req = urllib.request.Request(url, data=body, method="POST", headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=300) as r:
            r.read()
            return r.status
    except urllib.error.HTTPError as e:
        e.read()
        return e.code


def _health(url: str) -> float:
    t = time.perf_counter()
    with urllib.request.urlopen(url + "/health", timeout=300) as r:
        assert r.status == 200
        r.read()
    return time.perf_counter() - t


@pytest.mark.parametrize("case", list(CASES))
def test_health_answers_while_the_largest_request_is_served(server, case):
    url = server[0]
    path, body = CASES[case]
    data = json.dumps(body).encode()
    assert len(data) < 8 * 2**20
    done: dict = {}

    def big():
        t = time.perf_counter()
        done["status"] = _post(url + path, data)
        done["seconds"] = time.perf_counter() - t

    thread = threading.Thread(target=big, daemon=True)
    thread.start()
    during, latencies, deadline = 0, [], time.monotonic() + 300
    while thread.is_alive() and len(latencies) < 5000 and time.monotonic() < deadline:
        latencies.append(_health(url))
        during += thread.is_alive()
        time.sleep(0.01)
    thread.join(300)
    assert not thread.is_alive(), f"{case}: the request did not finish in 300 s"
    assert done["status"] < 500, f"{case}: answered {done['status']}"
    assert during >= 1, f"{case}: /health never answered while the request ({done['seconds']:.2f} s) was served"
    assert max(latencies) < done["seconds"] / 2, \
        f"{case}: /health took up to {max(latencies):.2f} s beside a request of {done['seconds']:.2f} s"
