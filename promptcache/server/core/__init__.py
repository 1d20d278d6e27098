"""What every API of the server shares: the worker that steps the engine, the one request
lifecycle, and the HTTP edges around it.

    backend.py    ``Backend``: the compute thread stepping the serving core; bounded queue, backpressure, drain
    compute.py    ``ComputeThread``: the one thread of the process that runs torch work
    events.py     the typed events a job sends its route (``Prefilled``, ``Text``, ``Done``, ...) and ``EventSink``
    lifecycle.py  ``Lifecycle``: submit, await the prefill, map errors, count, stream or collect (every API)
    errors.py     ``APIError``: an error answered with its HTTP status
    limits.py     ``RequestGuard``: host allow-list, JSON content type, body size and depth, before any route
    access.py     one access-log line per request (ASGI middleware) and ``note`` for its counts
    metrics.py    Prometheus counters
    tenancy.py    ``Tenancy``: API key -> namespace
    workerinfo.py /model_info and /server_info: what a router reads from a replica

Parses and renders no API's requests (``APIError`` answers in OpenAI's error shape, the server's
default; the Anthropic routes convert it): ``openai/``, ``anthropic/`` and ``studio/`` parse and
render around it, and nothing here imports them.
"""
