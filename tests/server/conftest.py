"""Fixtures of the server tests: one embedded engine (with the travel schema and two documents)
and the default server. Helpers live in ``serverkit.py``."""

from __future__ import annotations

import pytest

pytest.importorskip("fastapi", reason="the 'serve' extra is not installed")

from promptcache import PromptCache  # noqa: E402
from promptcache.models.embedded import embedded_model  # noqa: E402
from promptcache.rag import DocumentStore  # noqa: E402
from promptcache.server import create_app  # noqa: E402
from serverkit import BLOCK, HERMES_TEMPLATE, MODEL, ROOT, client, running  # noqa: E402


@pytest.fixture(scope="session")
def pc():
    engine = PromptCache(*embedded_model(MODEL))
    engine.add_schema(ROOT / "schemas" / "travel.xml")
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


@pytest.fixture(scope="session")
def tenants(pc):
    """A server of ``pc`` with two keys in two namespaces (acme, globex), the travel schema in each:
    the studio's tests of what one namespace may see. Its base URL."""
    for ns in ("acme", "globex"):
        pc.add_schema(ROOT / "schemas" / "travel.xml", namespace=ns)
    app = create_app(pc, api_keys={"key-a": "acme", "key-g": "globex"}, model_name=MODEL, block_size=BLOCK)
    with running(app) as url:
        yield url


@pytest.fixture
def oai(server):
    return client(server[0])



@pytest.fixture(scope="session")
def tool_pc():
    """An engine on the embedded model whose chat template supports tools (Hermes <tool_call>)."""
    model, tok = embedded_model(MODEL)
    tok.chat_template = HERMES_TEMPLATE
    return PromptCache(model, tok)


@pytest.fixture(scope="session")
def tool_server(tool_pc):
    """A server of ``tool_pc``: its base URL."""
    with running(create_app(tool_pc, model_name=MODEL, block_size=BLOCK)) as url:
        yield url
