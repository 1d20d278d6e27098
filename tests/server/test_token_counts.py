"""One count of "cached" (server/core/counts.py): for one default-mode RAG request and one drifted
PML request, the API's usage, the access log, /metrics and the studio's totals report the same
cached, recomputed and new tokens, and they are the engine's own (cached = laid out from stored
states and not recomputed)."""

from __future__ import annotations

import json
import logging
import re
import time

from serverkit import MODEL, http, metric

DRIFTED = '<prompt schema="travel"><trip days="3" travelers="two"/><tokyo/><user>Food?</user></prompt>'
KINDS = ("prompt", "cached", "recomputed", "new")


def _metrics(url: str) -> dict[str, float]:
    return {k: metric(url, f"promptcache_{k}_tokens_total") for k in KINDS}


def _studio(url: str) -> dict[str, int]:
    totals = json.loads(http("GET", url + "/studio/api/cache")[2])["totals"]
    return {"requests": totals["requests"], "prompt": totals["prompt_tokens"], "cached": totals["cached_tokens"],
            "recomputed": totals["recomputed_tokens"]}


def _settled(read, before, timeout=10.0):
    """``read()`` once it differs from ``before`` (the log line and the studio's record are written
    after the response has been sent)."""
    deadline = time.monotonic() + timeout
    while (now := read()) == before and time.monotonic() < deadline:
        time.sleep(0.05)
    return now


def _ask(url: str, caplog, body: dict) -> dict:
    """One chat request: its usage, the access log's counts, and the /metrics and studio deltas."""
    m0, s0 = _metrics(url), _studio(url)
    caplog.clear()
    status, _, text = http("POST", url + "/v1/chat/completions",
                           {"model": MODEL, "max_tokens": 2, "temperature": 0, **body})
    assert status == 200, text
    usage = json.loads(text)["usage"]
    lines = _settled(lambda: [r.getMessage() for r in caplog.records if r.name == "promptcache.access"
                              and "/v1/chat/completions 200" in r.getMessage()], [])
    assert len(lines) == 1, lines
    logged = {k: int(re.search(rf"\b{k}=(\d+)", lines[0]).group(1)) for k in KINDS}
    m1 = _metrics(url)
    s1 = _settled(lambda: _studio(url), s0)
    assert s1["requests"] == s0["requests"] + 1
    return {"usage": {"prompt": usage["prompt_tokens"], "cached": usage["prompt_tokens_details"]["cached_tokens"],
                      "recomputed": usage["recomputed_tokens"]},
            "log": logged, "metrics": {k: int(m1[k] - m0[k]) for k in KINDS},
            "studio": {k: s1[k] - s0[k] for k in ("prompt", "cached", "recomputed")}}


def _agree(seen: dict, want) -> None:
    expected = {"prompt": want.cached_tokens + want.new_tokens, "cached": want.cached_tokens - want.recomputed_tokens,
                "recomputed": want.recomputed_tokens, "new": want.new_tokens}
    assert expected["recomputed"] > 0 and expected["cached"] > 0  # approximate: all three kinds are there
    for where, counts in seen.items():
        for kind, value in counts.items():
            assert value == expected[kind], (where, kind, seen, expected)


def test_a_default_mode_rag_request_is_counted_the_same_everywhere(server, docs, caplog):
    url = server[0]
    caplog.set_level(logging.INFO, logger="promptcache.access")
    want = docs.generate("Which city has red gates?", ["kyoto", "lisbon"], system="Answer from the documents.",
                         max_new_tokens=2)
    assert docs.mode == "reuse" and not want.exact  # the store's default mode
    msgs = [{"role": "system", "content": "Answer from the documents."},
            {"role": "user", "content": "Which city has red gates?"}]
    _agree(_ask(url, caplog, {"messages": msgs, "documents": ["kyoto", "lisbon"]}), want)


def test_a_drifted_pml_request_is_counted_the_same_everywhere(server, pc, caplog):
    url = server[0]
    caplog.set_level(logging.INFO, logger="promptcache.access")
    want = pc.prefill(DRIFTED)  # a union member encoded after its siblings: drifted, part recomputed
    _agree(_ask(url, caplog, {"messages": [], "pml": DRIFTED}), want)
