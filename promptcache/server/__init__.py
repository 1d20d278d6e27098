"""``promptcache serve``: an OpenAI-compatible (and Anthropic Messages) HTTP server over one PromptCache engine.

    app.py      FastAPI routes, keys -> namespaces, SSE streaming      (create_app)
    protocol.py OpenAI request/response shapes and error objects
    openai_fields.py  logprobs, response_format, prompt_cache_key, refusals
    prompts.py  request -> Plan (start callable, token count, sampling); validation
    anthropic.py          POST /v1/messages (Anthropic's Messages API), cache_control pins
    anthropic_protocol.py its request/response/event shapes and errors
    anthropic_prompt.py   a Messages request -> token IDs and breakpoint token offsets
    backend.py  the worker thread stepping the serving core: bounded queue, backpressure, drain
    metrics.py  Prometheus counters
    access.py   one access-log line per request (ASGI middleware)
    tokenize.py POST /tokenize and /detokenize
    workerinfo.py  /model_info and /server_info: what a router reads from a replica
    cli.py      the click command ``serve`` (options, errors and engine loading: ``promptcache.frontend``)

Layering: ``promptcache.cli`` sits above ``server`` (the ``promptcache`` group resolves ``serve``
from here); nothing here imports ``cli``. Prefix reuse for plain token prompts is
``promptcache.engine.prefix`` (the terminal ``chat`` uses it too).

Needs the ``serve`` extra: ``pip install -e ".[serve]"``.
"""

__all__ = ["create_app"]


def __getattr__(name: str):
    # Lazy: ``promptcache --help`` imports the serve command without FastAPI installed.
    if name == "create_app":
        from .app import create_app

        return create_app
    raise AttributeError(name)
