"""``ServerConfig``: the server's own settings, one frozen dataclass validated on construction.

Decisions: a *setting* of the server (where it binds, how many requests it admits, how it drains,
what browsers and request sizes it accepts, the serving core's pool and budgets) is a field here
or in a section below it (``serving``: ``engine.ServingConfig``; ``limits``: ``limits.Limits``),
so ``serve``'s options, its ``PROMPTCACHE_*`` variables and the config file's ``[server]``,
``[server.serving]``, ``[server.limits]`` tables are generated from it like the engine's. What
``serve`` is asked to serve (the model, schemas, compiled schemas, documents, the served model
name) and its keys (``--api-key``, ``--api-key-file``: credentials, never in a variable or a
shared file by accident) stay hand-written options of the command. Budgets of stored states are
the store's (``StoreConfig``: ``--host-budget``, ``--device-budget``, ``--pin-budget``), never the
server's.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import ConfigError
from ..settings import nested, setting
from ..engine import ServingConfig
from .core.limits import Limits

__all__ = ["ServerConfig"]


@dataclass(frozen=True)
class ServerConfig:
    """Binding, admission, shutdown and browser rules; ``serving`` and ``limits`` nest."""

    TITLE = "Server (ServerConfig)"  # the --help heading of its own fields (settings.sections)

    host: str = setting("127.0.0.1", "Address to bind: 127.0.0.1 serves this machine only, 0.0.0.0 every network.")
    port: int = setting(8000, "TCP port to listen on.")
    max_queue: int = setting(256, "Requests admitted at once (503 beyond).")
    drain_timeout: float = setting(
        10.0, "Seconds running requests may finish at shutdown (SIGTERM, Ctrl-C) before they are cancelled.")
    max_model_len: int | None = setting(
        None, "Prompt plus answer tokens a request may use (default: the model's context, or its sliding window "
              "if smaller).")
    allowed_hosts: tuple[str, ...] = setting(
        (), "Host header names answered, comma-separated or repeated; '*' any (default: localhost names when bound "
            "to loopback, else any).")
    cors_origins: tuple[str, ...] = setting(
        (), "An origin (https://app.example) whose browser pages may call the API (repeatable; default none).",
        flat="cors_origin")
    open_metrics: bool = setting(
        False, "Answer GET /metrics without an API key when keys are set (for a Prometheus scraper that sends none; "
               "without keys /metrics is always open).")
    serving: ServingConfig = nested(ServingConfig, "Serving core (ServerConfig.serving)")
    limits: Limits = nested(Limits, "Request limits (ServerConfig.limits)")

    def __post_init__(self):
        if not isinstance(self.host, str) or not self.host.strip():
            raise ConfigError(f"ServerConfig.host must be an address, got {self.host!r}")
        if isinstance(self.port, bool) or not isinstance(self.port, int) or not 1 <= self.port <= 65535:
            raise ConfigError(f"ServerConfig.port must be in [1, 65535], got {self.port!r}")
        if isinstance(self.max_queue, bool) or not isinstance(self.max_queue, int) or self.max_queue < 1:
            raise ConfigError(f"ServerConfig.max_queue must be an integer >= 1, got {self.max_queue!r}")
        if isinstance(self.drain_timeout, bool) or not isinstance(self.drain_timeout, (int, float)) \
                or self.drain_timeout < 0:
            raise ConfigError(f"ServerConfig.drain_timeout must be >= 0 seconds, got {self.drain_timeout!r}")
        if self.max_model_len is not None and (isinstance(self.max_model_len, bool)
                                               or not isinstance(self.max_model_len, int) or self.max_model_len < 1):
            raise ConfigError(f"ServerConfig.max_model_len must be None or an integer >= 1, got {self.max_model_len!r}")
        if not isinstance(self.open_metrics, bool):
            raise ConfigError(f"ServerConfig.open_metrics must be true or false, got {self.open_metrics!r}")
        for name in ("allowed_hosts", "cors_origins"):
            v = getattr(self, name)
            if not isinstance(v, tuple) or not all(isinstance(x, str) for x in v):
                raise ConfigError(f"ServerConfig.{name} must be a tuple of strings, got {v!r}")
