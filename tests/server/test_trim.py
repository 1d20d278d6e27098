"""After a request with a large body is answered, freed heap pages go back to the OS
(``promptcache/server/trim.py``): the trim gives a freed transient back, the ``Trimmer`` coalesces
asks, and ``TrimAfterLarge`` asks after large bodies only, once they are answered."""

from __future__ import annotations

import asyncio
import ctypes.util
import json
import subprocess
import sys
import time

import pytest

from promptcache.server.trim import TrimAfterLarge, Trimmer

GLIBC = "libc.so" in (ctypes.util.find_library("c") or "")

# A thread allocates ~200 MB in pieces of 1-3 KB (the sizes a tokenizer's and a JSON parser's
# objects take), keeps every 50th and frees the rest: the kept ones pin the freed pages in the
# thread's arena, so glibc keeps them resident until a trim.
SCRIPT = """
import json, random, threading, time
from promptcache.server.trim import Trimmer

def rss():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024

kept = []
def transient():
    rng = random.Random(0)
    pieces = [bytearray(rng.randint(1000, 3000)) for _ in range(100_000)]
    kept.extend(pieces[::50])

t = threading.Thread(target=transient)
t.start()
t.join()
before = rss()
trimmer = Trimmer(gap=0)
if {trim}:
    trimmer.after_large()
    deadline = time.monotonic() + 30
    while trimmer.trims < 1 and time.monotonic() < deadline:
        time.sleep(0.01)
time.sleep(0.2)
print(json.dumps({{"before": before, "after": rss(), "trims": trimmer.trims}}))
"""


def _run(trim: bool) -> dict:
    out = subprocess.run([sys.executable, "-c", SCRIPT.format(trim=trim)], capture_output=True, text=True,
                         timeout=300, check=True)
    return json.loads(out.stdout)


@pytest.mark.skipif(not GLIBC, reason="malloc_trim is glibc's; elsewhere a trim gives nothing back, by design")
def test_a_trim_gives_a_freed_transient_back():
    without, with_trim = _run(False), _run(True)
    mb = 2**20
    # without a trim the freed ~200 MB stay resident; with one, most of it leaves
    assert without["after"] - without["before"] > -50 * mb, without
    assert with_trim["trims"] == 1
    assert with_trim["before"] - with_trim["after"] > 100 * mb, with_trim


def test_asks_during_a_gap_are_served_by_one_more_trim():
    trimmer = Trimmer(gap=0.5)
    trimmer.after_large()
    deadline = time.monotonic() + 10
    while trimmer.trims < 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    for _ in range(5):  # a burst inside the gap after the first trim
        trimmer.after_large()
    time.sleep(0.1)
    assert trimmer.trims == 1
    deadline = time.monotonic() + 10
    while trimmer.trims < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.7)  # nothing more was asked: no third trim
    assert trimmer.trims == 2


def test_a_negative_gap_is_refused():
    with pytest.raises(ValueError, match="Trimmer.gap"):
        Trimmer(gap=-1)


class Asks:
    def __init__(self):
        self.n = 0

    def after_large(self):
        self.n += 1


def _serve(middleware, chunks: list[bytes], fail: bool = False) -> list[str]:
    """One HTTP request through ``middleware``; the app reads the whole body, then answers."""
    events = []

    async def app(scope, receive, send):
        more = True
        while more:
            message = await receive()
            more = message.get("more_body", False)
        events.append(f"answered, asks so far {middleware.trimmer.n}")
        if fail:
            raise RuntimeError("the route failed")

    middleware.app = app
    queue = [{"type": "http.request", "body": c, "more_body": i < len(chunks) - 1} for i, c in enumerate(chunks)]

    async def receive():
        return queue.pop(0)

    async def send(message):
        pass

    try:
        asyncio.run(middleware({"type": "http", "method": "POST"}, receive, send))
    except RuntimeError:
        events.append("raised")
    return events


def test_a_large_body_asks_for_one_trim_after_its_answer():
    m = TrimAfterLarge(None, Asks(), large=1000)
    assert _serve(m, [b"x" * 600, b"x" * 600]) == ["answered, asks so far 0"]  # counted over chunks
    assert m.trimmer.n == 1


def test_a_small_body_asks_for_none():
    m = TrimAfterLarge(None, Asks(), large=1000)
    _serve(m, [b"x" * 999])
    assert m.trimmer.n == 0


def test_a_failed_large_request_still_asks():
    m = TrimAfterLarge(None, Asks(), large=1000)
    assert _serve(m, [b"x" * 2000], fail=True)[-1] == "raised"
    assert m.trimmer.n == 1


def test_other_scopes_pass_through():
    seen = []

    async def app(scope, receive, send):
        seen.append(scope["type"])

    m = TrimAfterLarge(app, Asks(), large=1)
    asyncio.run(m({"type": "lifespan"}, None, None))
    assert seen == ["lifespan"] and m.trimmer.n == 0
