"""``promptcache serve``: an OpenAI-compatible (and Anthropic Messages) HTTP server over one PromptCache engine.

    core/       what every API shares: the worker stepping the engine, typed events, the one request
                lifecycle (submit, await the prefill, map errors, count, stream or collect), errors,
                limits, metrics, access log, tenancy
    openai/     chat and completions, /v1/models, /tokenize: parsing, preparing, rendering
    anthropic/  POST /v1/messages (Anthropic's Messages API) and cache_control pins
    studio/     GET /studio and its JSON API
    app.py      ``create_app``: the parts built once, each room's routes added
    cli.py      the click command ``serve`` (options, errors and engine loading: ``promptcache.frontend``)
    config.py   ``ServerConfig``: serve's settings; vllm_flags.py: vLLM's flags, accepted or refused
    studio_cli.py  the ``promptcache studio`` command

Layering (``tests/test_architecture.py``): core < openai < anthropic, studio < the app and its
commands; ``promptcache.cli`` sits above ``server`` (the ``promptcache`` group resolves ``serve``
from here); nothing here imports ``cli``. Prefix reuse for plain token prompts is
``promptcache.engine.serving_core.prefix`` (the terminal ``chat`` uses it too).

Needs the ``serve`` extra: ``pip install -e ".[serve]"``.
"""

__all__ = ["create_app"]


def __getattr__(name: str):
    # Lazy: ``promptcache --help`` imports the serve command without FastAPI installed.
    if name == "create_app":
        from .app import create_app

        return create_app
    raise AttributeError(name)
