"""OpenAI's API: POST /v1/chat/completions and /v1/completions, /tokenize and /detokenize.

    protocol.py   request and response shapes (pydantic models; chunks, usage)
    fields.py     logprobs, response_format, prompt_cache_key, refusals
    preparer.py    ``Preparer``: a request -> a ``Submission`` (the prompt spec, sampling, constraints); validation
    routes.py     the routes: parse, plan, ``Lifecycle.serve`` with this API's rendering
    tools.py      the ``tools`` fields: checked, shown to the chat template, constrained
    toolcalls.py  the model's tool-call blocks parsed out of its text (whole or streamed)
    tokenize.py   POST /tokenize and /detokenize

Stands on ``core/``; the Anthropic routes and the studio reuse its preparer, tools and tool-call
parser (they sit above it).
"""
