"""The studio's JSON routes (server/studio.py) on a real server: the schema layout as bars, a bad
schema's error at its line, a prompt's spans and where their states are, the full-prefill stream,
the cache view changing with traffic, and namespaces kept apart. The page itself is tested in a
browser by test_studio_browser.py."""

from __future__ import annotations

import json
import urllib.request

import pytest

from serverkit import BLOCK, MODEL, ROOT, client, http

TRAVEL = (ROOT / "schemas" / "travel.xml").read_text()
TOKYO = '<prompt schema="travel"><user><trip days="four" travelers="two"/><tokyo/> What to eat?</user></prompt>'


def get(url, path, key=None):
    status, _, text = http("GET", url + path, key=key)
    return status, json.loads(text) if text.startswith("{") else text


def post(url, path, body, key=None):
    status, _, text = http("POST", url + path, body, key=key)
    return status, json.loads(text)


def test_page_and_redirect(server):
    url = server[0]
    req = urllib.request.Request(url + "/")
    with urllib.request.urlopen(req, timeout=30) as r:  # follows the redirect
        assert r.url.endswith("/studio") and "promptcache studio" in r.read().decode()
    for name, kind in (("studio.js", "javascript"), ("studio.css", "text/css")):
        status, ctype, body = http("GET", f"{url}/studio/static/{name}")
        assert status == 200 and kind in ctype and len(body) > 500
    assert http("GET", f"{url}/studio/static/..%2Fapp.py")[0] == 404
    assert http("GET", f"{url}/studio/static/nope.js")[0] == 404


def test_schema_bars_at_the_layout_positions(server, pc):
    status, view = post(server[0], "/studio/api/schema", {"name": "travel"})
    assert status == 200
    layout = pc.schema("travel").layout
    assert view["end"] == layout.end and view["stored_tokens"] == layout.stored_tokens
    bars = {m["name"]: m for m in view["modules"]}
    assert set(bars) == {"/".join(p) for p in layout.modules}
    for path, m in layout.modules.items():
        assert (bars["/".join(path)]["start"], bars["/".join(path)]["end"]) == (m.start, m.end)
    # union members share one range and are stacked in different lanes
    assert len(view["unions"]) == len(layout.unions) >= 1
    for union in view["unions"]:
        members = [bars[n] for n in union["members"]]
        assert {b["start"] for b in members} == {union["start"]}
        assert len({b["lane"] for b in members}) == len(members)
    params = [s for s in view["spans"] if s["kind"] == "param"]
    assert {s["param"]: s["tokens"] for s in params} == {"days": 4, "travelers": 12, "month": 6}
    assert any(s["kind"] == "glue" for s in view["spans"]) and any(s["module"] == "" and s["kind"] == "text"
                                                                   for s in view["spans"])
    text = next(s for s in view["spans"] if s["module"] == "tokyo")
    assert "".join(text["pieces"]) == text["text"] and "Tokyo" in text["text"]


def test_schema_text_errors_at_their_line(server):
    bad = TRAVEL.replace('<module name="rome">', '<module name="rome" colour="red">')
    line = bad.splitlines().index(next(x for x in bad.splitlines() if 'colour="red"' in x)) + 1
    status, body = post(server[0], "/studio/api/schema", {"pml": bad})
    assert status == 400 and body["error"]["line"] == line and "colour" in body["error"]["reason"]
    assert body["error"]["message"] == f"<string>:{line}: {body['error']['reason']}"  # as validate prints it
    ok, view = post(server[0], "/studio/api/schema", {"pml": TRAVEL})
    assert ok == 200 and view["name"] == "travel"


def _line_of(text: str, fragment: str) -> int:
    return next(i for i, x in enumerate(text.splitlines(), 1) if fragment in x)


def test_every_error_of_a_schema_and_of_a_prompt_is_returned(server):
    """As ``promptcache validate`` prints them: the editor gets each error's line and reason."""
    bad = TRAVEL.replace('<module name="rome">', '<module name="rome" colour="red">').replace(
        '<module name="kyoto">', '<module name="kyoto" cache="maybe">')
    status, body = post(server[0], "/studio/api/schema", {"pml": bad})
    lines = [e["line"] for e in body["error"]["errors"]]
    assert status == 400 and lines == sorted([_line_of(bad, 'colour="red"'), _line_of(bad, 'cache="maybe"')])
    assert body["error"]["line"] == lines[0] and body["error"]["more"] == 0
    prompt = '<prompt schema="travel">\n<trip days="3" travelers="two" color="red"/>\n<nosuch/>\n</prompt>'
    status, body = post(server[0], "/studio/api/prompt", {"pml": prompt})
    assert status == 400 and [e["line"] for e in body["error"]["errors"]] == [2, 3]
    assert "color" in body["error"]["errors"][0]["reason"] and "nosuch" in body["error"]["errors"][1]["reason"]


def test_posted_schema_reads_no_file(server):
    status, body = post(server[0], "/studio/api/schema",
                        {"pml": '<schema name="s"><module name="m" src="pyproject.toml"/></schema>'})
    assert status == 400 and body["error"]["line"] == 1 and "pyproject" in body["error"]["message"]


def test_prompt_spans_origins_and_exactness(server, pc):
    url = server[0]
    status, view = post(url, "/studio/api/prompt", {"pml": TOKYO})
    assert status == 200 and view["exact"] is False and "positions" in view["why"]
    origins = {s["name"]: s["origin"] for s in view["spans"]}
    assert origins["tokyo"] in ("pool", "host", "device") and origins["trip.days"] == "computed"
    assert view["gaps"], "paris is not imported: its range is a gap"
    for a, b in view["gaps"]:  # a gap is a range no span covers
        assert a < b and not any(s["start"] < b and a < s["end"] for s in view["spans"])
    assert next(s for s in view["spans"] if s["name"] == "tokyo")["drift"] == "drifted"
    full, view1 = post(url, "/studio/api/prompt", {"pml": TOKYO, "recompute": 1.0})
    assert next(s for s in view1["spans"] if s["name"] == "tokyo")["drift"] == "recomputed"
    for p in (TOKYO, '<prompt schema="travel"><user>Hi</user></prompt>',
              '<prompt schema="travel"><user><paris/> Hi</user></prompt>'):
        v = post(url, "/studio/api/prompt", {"pml": p})[1]
        assert v["exact"] is pc.prefill(p, recompute=0).exact  # the engine's own verdict
        assert (v["why"] is None) is v["exact"]
    bad = post(url, "/studio/api/prompt", {"pml": '<prompt schema="travel"><nowhere/></prompt>'})
    assert bad[0] == 400 and "nowhere" in bad[1]["error"]["message"]


def test_chat_prompt_blocks_cached_after_a_request(server):
    url = server[0]
    msgs = [{"role": "system", "content": "You are a travel planner for studio tests. " * 4},
            {"role": "user", "content": "Plan a day in Rome."}]
    before = post(url, "/studio/api/prompt", {"messages": msgs})[1]
    assert [s["origin"] for s in before["spans"]] == ["computed"] and before["exact"] is True
    client(url).chat.completions.create(model=MODEL, messages=msgs, max_tokens=2)
    after = post(url, "/studio/api/prompt", {"messages": msgs})[1]
    assert after["spans"][0]["origin"] == "pool" and after["cached_tokens"] >= BLOCK
    assert after["spans"][-1]["origin"] == "computed" and after["spans"][0]["start"] == 0


def test_full_prefill_stream(server):
    req = urllib.request.Request(server[0] + "/studio/api/full", method="POST",
                                 data=json.dumps({"pml": TOKYO, "max_tokens": 4}).encode(),
                                 headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        events = [json.loads(x[6:]) for x in r.read().decode().split("\n\n") if x.startswith("data: ")]
    assert events[0]["type"] == "prefilled" and events[0]["cached_tokens"] == 0 and events[0]["prompt_tokens"] > 20
    assert events[-1] == {"type": "done", "completion_tokens": 4}
    assert [e["type"] for e in events[1:-1]] and all(e["type"] == "text" for e in events[1:-1])


def test_cache_view_changes_after_requests(tenants):
    url = tenants
    before = get(url, "/studio/api/cache", "key-a")[1]
    msgs = [{"role": "user", "content": "Tell me about the cache view of the studio, please. " * 3}]
    for _ in range(2):
        client(url, "key-a").chat.completions.create(model=MODEL, messages=msgs, max_tokens=2)
    after = get(url, "/studio/api/cache", "key-a")[1]
    assert after["totals"]["requests"] == before["totals"]["requests"] + 2
    assert after["totals"]["cached_tokens"] > before["totals"]["cached_tokens"]  # the second was served from blocks
    assert after["series"] and after["series"][-1]["hit_rate"] > 0
    assert after["pool"]["counts"]["yours"] > before["pool"]["counts"]["yours"]
    assert any(e["label"].startswith("prefix tokens [0, 16)") for e in after["pool"]["entries"])
    assert {t["name"] for t in after["tiers"]} >= {"host", "disk"}
    assert {m["label"].split(":")[0] for m in after["modules"]} == {"travel"}


def test_namespaces_never_see_each_other(tenants):
    url = tenants
    secret = "Globex secret launch codes are in the third drawer. " * 3
    client(url, "key-g").chat.completions.create(model=MODEL, messages=[{"role": "user", "content": secret}],
                                                 max_tokens=2)
    g = get(url, "/studio/api/cache", "key-g")[1]
    a = get(url, "/studio/api/cache", "key-a")[1]
    assert g["namespace"] == "globex" and a["namespace"] == "acme"
    assert "Globex" in json.dumps(g) and "Globex" not in json.dumps(a)
    assert g["totals"]["requests"] >= 1
    # globex's blocks are in the pool, yet acme's view marks none of them as its own
    mine_g = {i for i, c in enumerate(g["pool"]["codes"]) if c.isupper()}
    mine_a = {i for i, c in enumerate(a["pool"]["codes"]) if c.isupper()}
    assert mine_g and not mine_g & mine_a
    # acme cannot lay out globex's prompt from globex's cache: the same messages are computed for acme
    view = post(url, "/studio/api/prompt", {"messages": [{"role": "user", "content": secret}]}, "key-a")[1]
    assert all(s["origin"] == "computed" for s in view["spans"])
    assert get(url, "/studio/api/cache")[0] == 401 and get(url, "/studio/api/cache", "nope")[0] == 401
    assert http("GET", url + "/studio")[0] == 200  # the page holds no data: no key needed


@pytest.mark.slow  # a subprocess loads torch and the model
def test_studio_command_serves_the_page_with_the_schema_text(tmp_path):
    import signal
    import time

    from serverkit import free_port, start_until

    port, schema = free_port(), ROOT / "schemas" / "travel.xml"
    proc, _ = start_until(["-m", "promptcache", "studio", str(schema), "--port", str(port)], "Studio: http://127.0.0.1",
                          timeout=300, cwd=tmp_path)
    try:
        url = f"http://127.0.0.1:{port}"
        for _ in range(100):  # uvicorn binds right after the message
            try:
                status, info = get(url, "/studio/api/info")
                break
            except OSError:
                time.sleep(0.1)
        assert status == 200 and info["schemas"] == ["travel"] and info["sources"]["travel"] == schema.read_text()
        assert post(url, "/studio/api/prompt", {"pml": TOKYO})[1]["spans"]
        proc.send_signal(signal.SIGINT)
        proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
