"""A real redis-server on 127.0.0.1 and a free port, for the tests that need one (tests/remote's
fixtures, tests/on_vllm's connector reading an engine's Redis): ``RedisServer`` starts Debian's
``redis-server`` (``.ci/run`` installs it) without persistence, waits until it answers PING, and
can be killed and started again on the same port (a Redis outage mid-run)."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time

import redis

REDIS_SERVER = shutil.which("redis-server") or "/usr/bin/redis-server"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    """One redis-server process. ``extra``: more command-line settings, e.g. ("--maxmemory", "2mb")."""

    def __init__(self, password: str | None = None, extra: tuple[str, ...] = ()):
        self.port, self.password, self.extra = free_port(), password, tuple(extra)
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    def client(self) -> redis.Redis:
        return redis.Redis.from_url(self.url)

    def start(self, timeout: float = 10.0) -> "RedisServer":
        """Start and wait for PING; RuntimeError naming the binary, port and server output otherwise."""
        cmd = [REDIS_SERVER, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
               *(("--requirepass", self.password) if self.password else ()), *self.extra]
        try:
            self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        except OSError as e:
            raise RuntimeError(f"cannot start {REDIS_SERVER} ({e}); install Debian's redis-server package") from None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                out = self.proc.stdout.read().decode(errors="replace")[-2000:]
                raise RuntimeError(f"{REDIS_SERVER} on port {self.port} exited with {self.proc.returncode}:\n{out}")
            try:
                if self.client().ping():
                    return self
            except redis.exceptions.RedisError:
                time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"{REDIS_SERVER} on port {self.port} did not answer PING within {timeout}s")

    def stop(self) -> None:
        """Kill the server (SIGKILL: an outage, not a clean shutdown) and wait for it."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)
        if self.proc is not None and self.proc.stdout is not None:
            self.proc.stdout.close()
        self.proc = None
