"""vLLM's conveniences: --max-model-len, one access-log line per request, /tokenize, /detokenize."""

from __future__ import annotations

import json
import logging
import time

import pytest

from promptcache.server import create_app
from serverkit import BLOCK, MODEL, client, http, running


def test_tokenize_counts_what_a_chat_request_uses_and_detokenize_inverts(server, oai):
    url = server[0]
    msgs = [{"role": "user", "content": "Plan a day in Rome."}]
    status, _, text = http("POST", url + "/tokenize", {"messages": msgs})
    out = json.loads(text)
    r = oai.chat.completions.create(model=MODEL, messages=msgs, max_tokens=1)
    assert status == 200 and out["count"] == len(out["tokens"]) == r.usage.prompt_tokens
    status, _, text = http("POST", url + "/tokenize", {"prompt": "Once upon a time", "add_special_tokens": False})
    ids = json.loads(text)["tokens"]
    status, _, text = http("POST", url + "/detokenize", {"tokens": ids})
    assert status == 200 and json.loads(text)["prompt"] == "Once upon a time"
    status, _, text = http("POST", url + "/detokenize", {"tokens": [10**9]})
    assert status == 400 and json.loads(text)["error"]["param"] == "tokens"


def test_max_model_len_bounds_requests(pc):
    with pytest.raises(ValueError, match="max_model_len"):
        create_app(pc, model_name=MODEL, max_model_len=10**9)
    app = create_app(pc, model_name=MODEL, block_size=BLOCK, max_model_len=64)
    with running(app) as url:
        oai = client(url)
        ok = oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4)
        assert ok.usage.completion_tokens == 4
        status, _, text = http("POST", url + "/v1/chat/completions", {
            "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 64})
        assert status == 400 and "64" in json.loads(text)["error"]["message"]
        assert json.loads(http("POST", url + "/tokenize", {"prompt": "x"})[2])["max_model_len"] == 64


def test_one_access_line_per_request(server, oai, caplog):
    caplog.set_level(logging.INFO, logger="promptcache.access")
    oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hello there"}], max_tokens=3)
    list(oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hello there"}],
                                     max_tokens=3, stream=True))
    http("POST", server[0] + "/v1/chat/completions", {"model": "nope", "messages": []})
    deadline = time.monotonic() + 10  # the line is written after the last byte is sent: the client may be first
    while len(lines := [r.getMessage() for r in caplog.records if r.name == "promptcache.access"]) < 3:
        assert time.monotonic() < deadline, lines
        time.sleep(0.05)
    assert len(lines) == 3
    for line in lines[:2]:
        assert line.startswith("POST /v1/chat/completions 200 prompt=") and "generated=3" in line
        assert "cached=" in line and "ttft=" in line and "duration=" in line
    assert lines[2].startswith("POST /v1/chat/completions 404 ") and "prompt=" not in lines[2]
