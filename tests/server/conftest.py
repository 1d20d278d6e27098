"""Fixtures of the server tests: one embedded engine, real uvicorn servers on free ports.

Servers run in a thread of the test process (uvicorn on 127.0.0.1) so tests can reach the
engine they serve; ``test_cli.py`` starts the command in a subprocess.
"""

from __future__ import annotations

import socket
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import pytest

pytest.importorskip("fastapi", reason="the 'serve' extra is not installed")
import openai  # noqa: E402
import uvicorn  # noqa: E402

from promptcache import PromptCache  # noqa: E402
from promptcache.models.embedded import embedded_model  # noqa: E402
from promptcache.rag import DocumentStore  # noqa: E402
from promptcache.server import create_app  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
MODEL = "embedded"
BLOCK = 16  # tokens per prefix block in these tests (small prompts still span several blocks)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def running(app):
    """Serve ``app`` on a free port; yields its base URL ('http://127.0.0.1:PORT')."""
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(10)


def client(url: str, key: str = "none") -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=60)


@pytest.fixture(scope="session")
def pc():
    engine = PromptCache(*embedded_model(MODEL))
    engine.add_schema(str(ROOT / "schemas" / "travel.xml"))
    return engine


@pytest.fixture(scope="session")
def docs(pc):
    store = DocumentStore(pc)
    store.add("kyoto", "Kyoto has thousands of shrines; Fushimi Inari has thousands of red gates.")
    store.add("lisbon", "Lisbon is built on seven hills and its trams climb them all day.")
    return store


@pytest.fixture(scope="session")
def server(pc, docs):
    """The default server: no keys, the travel schema, two documents, 16-token blocks."""
    app = create_app(pc, documents=docs, model_name=MODEL, block_size=BLOCK)
    with running(app) as url:
        yield url, app


@pytest.fixture
def oai(server):
    return client(server[0])


def http(method: str, url: str, body: dict | None = None, key: str | None = None):
    """(status, content type, body text) of a raw request (stdlib only)."""
    import json
    import urllib.error
    import urllib.request

    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, method=method, headers={"content-type": "application/json"})
    if key:
        req.add_header("authorization", f"Bearer {key}")
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, r.headers.get("content-type", ""), r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.headers.get("content-type", ""), e.read().decode()


def metric(url: str, name: str, **labels) -> float:
    """A sample's value from the server's /metrics (0 when absent)."""
    from prometheus_client.parser import text_string_to_metric_families

    text = http("GET", url + "/metrics")[2]
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return s.value
    return 0.0
