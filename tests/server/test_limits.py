"""Request limits and browser rules (server/limits.py): refused before any work, as OpenAI errors."""

from __future__ import annotations

import json
import select
import socket
import time

import pytest

from serverkit import MODEL, http, running

from promptcache.server import create_app
from promptcache.server.core.limits import Limits, host_name

MSGS = [{"role": "user", "content": "hello"}]


def raw(url: str, head: bytes, body: bytes = b"", read_timeout: float = 30) -> tuple[int, dict, int]:
    """Send request head + body on a fresh socket; (status, error object (or the answer), body bytes sent before
    the answer came). Stops sending as soon as the server answers."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=read_timeout) as s:
        s.sendall(head)
        sent, answer = 0, b""
        while sent < len(body):
            if select.select([s], [], [], 0)[0]:
                break
            try:
                sent += s.send(body[sent:sent + 65536])
            except (BrokenPipeError, ConnectionResetError):
                break
        s.settimeout(read_timeout)
        while b"\r\n\r\n" not in answer or len(answer.split(b"\r\n\r\n", 1)[1]) < _length(answer):
            chunk = s.recv(65536)
            if not chunk:
                break
            answer += chunk
    head_text, _, payload = answer.partition(b"\r\n\r\n")
    doc = json.loads(payload)
    return int(head_text.split()[1]), doc.get("error", doc), sent


def _length(answer: bytes) -> int:
    for line in answer.split(b"\r\n\r\n", 1)[0].split(b"\r\n")[1:]:
        k, _, v = line.partition(b":")
        if k.strip().lower() == b"content-length":
            return int(v)
    return 1 << 30


def post_head(length: int | None, content_type: str = "application/json", host: str = "127.0.0.1") -> bytes:
    size = f"content-length: {length}\r\n" if length is not None else "transfer-encoding: chunked\r\n"
    return (f"POST /v1/chat/completions HTTP/1.1\r\nhost: {host}\r\ncontent-type: {content_type}\r\n{size}\r\n"
            .encode())


def test_limits_validate_their_fields():
    with pytest.raises(ValueError, match="max_chars"):
        Limits(max_chars=0)
    assert host_name("LocalHost:8000") == "localhost" and host_name("[::1]:80") == "::1"


def test_a_15_mb_body_is_refused_by_its_length_before_it_is_read(server):
    url = server[0]
    size = 15 * 2**20
    t0 = time.perf_counter()
    status, err, sent = raw(url, post_head(size), b"x" * 65536)  # 64 KiB sent of a declared 15 MiB
    assert status == 413 and err["code"] == "request_too_large" and err["param"] == "body"
    assert time.perf_counter() - t0 < 30  # not waiting for the 15 MiB that never come
    assert http("GET", url + "/health")[0] == 200


def test_a_chunked_body_is_refused_once_past_the_limit(pc):
    limits = Limits(max_request_bytes=2**20)
    app = create_app(pc, model_name=MODEL, limits=limits)
    body = b"".join(b"10000\r\n" + b"a" * 0x10000 + b"\r\n" for _ in range(240))  # 15 MiB in 64 KiB chunks
    with running(app) as url:
        status, err, sent = raw(url, post_head(None), body)
    assert status == 413 and "1048576 bytes" in err["message"]
    assert sent < len(body)  # answered while the client was still sending


def test_browser_rules(server):
    url = server[0]
    body = json.dumps({"model": MODEL, "messages": MSGS, "max_tokens": 1}).encode()
    # a cross-origin page's "simple" request: text/plain needs no preflight, so it is refused here
    status, err, _ = raw(url, post_head(len(body), "text/plain;charset=UTF-8"), body)
    assert status == 415 and err["param"] == "content-type"
    # DNS rebinding: the page's own name in Host
    status, err, _ = raw(url, post_head(len(body), host="evil.example:8000"), body)
    assert status == 400 and err["code"] == "host_not_allowed" and "evil.example" in err["message"]
    assert raw(url, post_head(len(body), host="localhost:1234"), body)[0] == 200
    # no CORS unless asked for: a preflight gets no allow-origin header
    import urllib.request

    req = urllib.request.Request(url + "/v1/chat/completions", method="OPTIONS",
                                 headers={"origin": "https://evil.example", "access-control-request-method": "POST"})
    try:
        headers = urllib.request.urlopen(req, timeout=30).headers
    except urllib.error.HTTPError as e:
        headers = e.headers
    assert "access-control-allow-origin" not in {k.lower() for k in headers}


def test_cors_origin_and_allowed_hosts_when_asked_for(pc):
    import urllib.request

    app = create_app(pc, model_name=MODEL, allowed_hosts=("api.example",), cors_origins=("https://app.example",))
    with running(app) as url:
        req = urllib.request.Request(url + "/v1/chat/completions", method="OPTIONS",
                                     headers={"origin": "https://app.example", "access-control-request-method": "POST",
                                              "host": "api.example"})
        with urllib.request.urlopen(req, timeout=30) as r:
            assert r.headers["access-control-allow-origin"] == "https://app.example"
        assert http("GET", url + "/health")[0] == 400  # 127.0.0.1 is not on this list


@pytest.mark.parametrize("body, param, words", [
    ("[" * 1000 + "]" * 1000, None, "nested deeper"),
    ('{"model": "embedded", "messages": ' + "[" * 40 + "]" * 40 + "}", "messages" + "[0]" * 31, "nested deeper"),
    ('{"model": "embedded", "messages": [{"role": "user", "content": "\\ud800"}]}', "messages[0].content", "surrogate"),
    ('{"model": "embedded", "messages": [], "temperature": NaN}', None, "NaN"),
])
def test_bad_json_is_400_naming_where(server, body, param, words):
    status, _, text = http_raw(server[0], body.encode())
    err = json.loads(text)["error"]
    # 1000 levels: json's C parser stops at the interpreter's recursion limit (no path then), or,
    # where something raised that limit (torch.compile does), parses and the walk names the path
    params = (param, "[0]" * 32) if body.startswith("[" * 1000) else (param,)
    assert status == 400 and err["param"] in params and words in err["message"], err


def test_message_and_character_limits(pc):
    app = create_app(pc, model_name=MODEL, limits=Limits(max_messages=3, max_chars=100))
    with running(app) as url:
        status, _, text = http("POST", url + "/v1/chat/completions", {"model": MODEL, "messages": MSGS * 4})
        assert status == 400 and json.loads(text)["error"]["param"] == "messages"
        status, _, text = http("POST", url + "/v1/chat/completions",
                               {"model": MODEL, "messages": [{"role": "user", "content": "y" * 101}]})
        assert status == 400 and json.loads(text)["error"]["param"] == "messages[0].content"


def test_seed_out_of_range_is_400_naming_it(server):
    status, _, text = http("POST", server[0] + "/v1/chat/completions",
                           {"model": MODEL, "messages": MSGS, "seed": 2**64, "max_tokens": 1})
    assert status == 400 and json.loads(text)["error"]["param"] == "seed"


def test_an_unexpected_failure_is_a_500_error_object(pc):
    app = create_app(pc, model_name=MODEL)

    @app.get("/fails")
    async def fails():
        raise KeyError("a bug")

    with running(app) as url:
        status, ctype, text = http("GET", url + "/fails")
    assert status == 500 and ctype == "application/json"
    assert json.loads(text)["error"]["type"] == "server_error" and "KeyError" in json.loads(text)["error"]["message"]


def http_raw(url: str, body: bytes):
    import urllib.error
    import urllib.request

    req = urllib.request.Request(url + "/v1/chat/completions", data=body, method="POST",
                                 headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, r.headers.get("content-type", ""), r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.headers.get("content-type", ""), e.read().decode()
