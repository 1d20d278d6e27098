"""Anthropic's Messages API: POST /v1/messages and /v1/messages/count_tokens, ``cache_control`` pins.

    protocol.py   request shapes, response and event shapes, ``AnthropicError``
    prompt.py     a Messages request -> token IDs and breakpoint token offsets
    tools.py      the ``tools`` fields (onto ``openai.tools``) and ``tool_use`` blocks, whole or streamed
    routes.py     the routes: parse, render, pin, ``Lifecycle.serve`` with this API's rendering

Stands on ``core/`` and ``openai/`` (the tool machinery and the tool-call parser).
"""
