"""What a router in front of several replicas reads from a worker, beside ``/health`` and ``/v1/models``.

The cache-aware routers on PyPI (``sglang-router``, ``vllm-router``; docs/scaling.md) register
a worker by asking it for ``/model_info`` and ``/server_info`` (sglang's names; both are
answered here so the router learns the served model instead of registering it as "unknown") and
watch ``/health``. The load a router may balance on is the number of requests admitted and not
finished (``in_flight``, also in ``/health`` and as the Prometheus gauge
``promptcache_requests_in_flight``).
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

from fastapi import FastAPI


def _version() -> str:
    try:
        return version("promptcache")
    except PackageNotFoundError:  # run from a source tree
        return "unknown"


def add_worker_routes(app: FastAPI, backend, model_name: str, block_size: int) -> None:
    """GET /model_info and /server_info on ``app`` (no key: they say nothing about any tenant)."""

    @app.get("/model_info")
    async def model_info():
        return {"model_path": model_name, "tokenizer_path": model_name, "is_generation": True,
                "served_model_name": model_name}

    @app.get("/server_info")
    async def server_info():
        return {"model_path": model_name, "served_model_name": model_name, "engine": "promptcache",
                "version": _version(), "block_size": block_size, "max_queue": backend.max_queue,
                "in_flight": backend.in_flight}
