"""The HTTP surface under a seeded fuzzer (cases: ``fuzzkit.py``): every answer is a 200 or a 4xx
OpenAI error object, never a 5xx, never a hang, and the server answers a fixed request the same
way afterwards. One server, one tiny model, thousands of requests."""

from __future__ import annotations

import http.client
import json

import pytest

from fuzzkit import cases
from serverkit import MODEL, running

from promptcache.server import create_app

CASES = 2400
FIXED = {"model": MODEL, "messages": [{"role": "user", "content": "Plan two days in Kyoto."}], "max_tokens": 8,
         "temperature": 0}


def send(port: int, case) -> tuple[int, str, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)  # a hang fails the test
    try:
        conn.putrequest(case.method, case.path, skip_host=True, skip_accept_encoding=True)
        for k, v in case.headers.items():
            conn.putheader(k, v)
        if case.body is not None:
            conn.putheader("content-length", str(len(case.body)))
        conn.endheaders(case.body)
        r = conn.getresponse()
        return r.status, r.getheader("content-type", ""), r.read()
    finally:
        conn.close()


def fixed_answer(port: int) -> dict:
    status, _, body = send(port, type("C", (), {"method": "POST", "path": "/v1/chat/completions",
                                                 "headers": {"content-type": "application/json", "host": "127.0.0.1"},
                                                 "body": json.dumps(FIXED).encode()})())
    assert status == 200, body
    out = json.loads(body)
    return {"text": out["choices"][0]["message"]["content"], "usage": out["usage"]["prompt_tokens"]}


@pytest.mark.slow  # about 30 s on a loaded 2-core machine
def test_fuzzed_requests_get_only_answers_or_4xx_error_objects(pc, docs):
    app = create_app(pc, documents=docs, model_name=MODEL, block_size=16)
    with running(app) as url:
        port = int(url.rsplit(":", 1)[1])
        before = fixed_answer(port)
        statuses = {}
        for i, case in enumerate(cases(23, CASES, MODEL)):
            status, ctype, body = send(port, case)
            statuses[status] = statuses.get(status, 0) + 1
            where = f"case {i}: {case.method} {case.path} {case.headers} {case.body[:300] if case.body else None!r}"
            assert status < 500, f"{where} -> {status} {body[:500]!r}"
            if status >= 400 and case.method != "HEAD":
                assert ctype == "application/json", f"{where} -> {status} {ctype} {body[:300]!r}"
                err = json.loads(body)["error"]
                assert isinstance(err["message"], str) and err["message"] and isinstance(err["type"], str), where
                assert set(err) == {"message", "type", "param", "code"}, where
        assert fixed_answer(port) == before
        assert statuses.get(200, 0) > CASES // 50 and {400, 404, 405, 415} <= set(statuses), statuses
