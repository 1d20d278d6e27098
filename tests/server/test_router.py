"""Replicas behind the router docs/scaling.md picks (sglang-router, a PyPI package in the dev extras): it registers real `promptcache serve` processes (/health, /model_info, /server_info), its
cache-aware policy keeps a conversation on the replica holding its blocks, a routing key
(a client's prompt_cache_key sent as ``x-smg-routing-key``) pins one under the manual policy, and
a killed replica's requests fail over. All through the official openai client."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from serverkit import ROOT, client, free_port, http, metric

# on the PATH, or beside this interpreter (the dev extras put it in the venv's bin even when the venv is
# not activated)
ROUTER = shutil.which("sglang-router") or shutil.which("sglang-router", path=str(Path(sys.executable).parent))
FAILOVER = ["--cb-failure-threshold", "1", "--health-check-interval-secs", "2", "--health-failure-threshold", "1"]
SYSTEM = "You are a careful travel planner for the cities of northern Europe. " * 3


def wait(url: str, proc: subprocess.Popen, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"{proc.args[:3]} exited with {proc.returncode}"
        try:
            with urllib.request.urlopen(url, timeout=2):
                return
        except OSError:
            time.sleep(0.2)
    raise AssertionError(f"{url} did not answer within {timeout}s")


@pytest.fixture
def cluster(tmp_path):
    """start(policy) -> (router URL, replica URLs, replica processes); all stopped at teardown."""
    if ROUTER is None:
        pytest.fail("the routing tests need sglang-router: pip install -e '.[dev]' installs it "
                    "(or pip install sglang-router==0.3.2 and put it on the PATH)", pytrace=False)
    procs, routers = [], []

    def start(policy: str, n: int = 2):
        urls = []
        for i in range(n):
            port = free_port()
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "promptcache.server", "--model", "embedded", "--port", str(port),
                 "--block-size", "16"], stdout=subprocess.DEVNULL, stderr=(tmp_path / f"r{i}.log").open("w"),
                env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}))
            urls.append(f"http://127.0.0.1:{port}")
        for p, u in zip(procs, urls):
            wait(u + "/health", p)
        port = free_port()
        router = subprocess.Popen([ROUTER, "launch", "--host", "127.0.0.1", "--port", str(port), "--policy", policy,
                                   "--worker-urls", *urls, "--prometheus-port", str(free_port()),
                                   *FAILOVER],
                                  stdout=(tmp_path / "router.log").open("w"), stderr=subprocess.STDOUT,
                                  start_new_session=True)  # its group: the launcher leaves a server process
        routers.append(router)
        wait(f"http://127.0.0.1:{port}/health", router)
        return f"http://127.0.0.1:{port}", urls, procs[:n] + [router]

    yield start
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGINT)
    for p in procs:
        try:
            p.wait(20)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
    for p in routers:
        try:
            os.killpg(p.pid, signal.SIGKILL)  # the router's server process, whatever its launcher did
        except ProcessLookupError:
            pass


def served(urls: list[str]) -> list[float]:
    return [metric(u, "promptcache_prompt_tokens_total") for u in urls]


def converse(base: str, system: str, turns: int, key: str | None = None) -> list:
    """A conversation; ``key``: its prompt_cache_key, sent in the body (OpenAI's field, which the
    server accepts) and as the router's routing key header."""
    oai, msgs, out = client(base), [{"role": "system", "content": system}], []
    extra = {"prompt_cache_key": key, "extra_headers": {"x-smg-routing-key": key}} if key else {}
    for t in range(turns):
        msgs.append({"role": "user", "content": f"Turn {t}: what should I see next, and where do I eat?"})
        r = oai.chat.completions.create(model="embedded", messages=msgs, max_tokens=3, temperature=0, **extra)
        msgs.append({"role": "assistant", "content": r.choices[0].message.content})
        out.append(r)
    return out


@pytest.mark.slow  # two replicas and a router as subprocesses
def test_cache_aware_routing_keeps_a_conversation_on_one_replica_and_fails_over(cluster):
    base, urls, procs = cluster("cache_aware")
    status, _, body = http("GET", urls[0] + "/model_info")
    assert status == 200 and '"model_path":"embedded"' in body.replace(" ", "")
    before = served(urls)
    answers = converse(base, SYSTEM, 3)
    grew = [a - b for a, b in zip(served(urls), before)]
    assert sorted(g > 0 for g in grew) == [False, True]  # every turn on one replica
    assert all(r.usage.prompt_tokens_details.cached_tokens > 0 for r in answers[1:])
    holder = grew.index(max(grew))
    procs[holder].kill()  # the replica holding the conversation dies
    procs[holder].wait()
    again = converse(base, SYSTEM, 2)  # served by the other one (recomputed there), no error reaches the client
    assert len(again) == 2 and all(r.choices[0].message.content is not None for r in again)


@pytest.mark.slow
def test_a_routing_key_pins_conversations_to_one_replica(cluster):
    base, urls, _ = cluster("manual")
    before = served(urls)
    for i in range(3):  # three different conversations of one client key
        converse(base, f"Tenant {i}: " + SYSTEM, 1, "cache-key-42")
    grew = [a - b for a, b in zip(served(urls), before)]
    assert sorted(g > 0 for g in grew) == [False, True]
