"""The shared-tier tests run against a real redis-server on 127.0.0.1 and a free port (no mocks).

``RedisServer`` starts Debian's ``redis-server`` (``.ci/run`` installs it) without persistence,
waits until it answers PING, and can be killed and started again on the same port (a Redis
outage mid-run). A server that cannot start FAILS the test with the reason: these tests are
never skipped.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import time

import pytest
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


@pytest.fixture
def start_redis():
    """start_redis(password=None, extra=()) -> a started RedisServer, killed at teardown."""
    servers: list[RedisServer] = []

    def start(password: str | None = None, extra: tuple[str, ...] = ()) -> RedisServer:
        server = RedisServer(password, extra)
        servers.append(server)
        try:
            return server.start()
        except RuntimeError as e:
            pytest.fail(f"the shared-tier tests need a real redis-server: {e}", pytrace=False)

    yield start
    for server in servers:
        server.stop()


@pytest.fixture
def redis_server(start_redis) -> RedisServer:
    return start_redis()


class Cluster:
    """A Redis Cluster of ``n`` masters on 127.0.0.1 (``redis-server --cluster-enabled yes`` each,
    joined with ``redis-cli --cluster create``), no replicas. ``cluster-require-full-coverage no``:
    the others go on answering while a node is down (what the remote tier's README asks for)."""

    def __init__(self, folder, n: int = 3):
        self.nodes = []
        for i in range(n):
            d = folder / f"node{i}"
            d.mkdir(parents=True)
            self.nodes.append(RedisServer(extra=("--cluster-enabled", "yes", "--dir", str(d),
                                                 "--cluster-config-file", "nodes.conf", "--cluster-node-timeout", "1000",
                                                 "--cluster-require-full-coverage", "no",
                                                 "--cluster-port", str(free_port()))))  # the bus port (else port + 10000)

    @property
    def url(self) -> str:
        return f"redis+cluster://127.0.0.1:{self.nodes[0].port}"

    def start(self, timeout: float = 30.0) -> "Cluster":
        for node in self.nodes:
            node.start()
        cli = shutil.which("redis-cli") or "/usr/bin/redis-cli"
        out = subprocess.run([cli, "--cluster", "create", *(f"127.0.0.1:{n.port}" for n in self.nodes),
                              "--cluster-replicas", "0", "--cluster-yes"], capture_output=True, text=True, timeout=60)
        if out.returncode != 0:
            raise RuntimeError(f"redis-cli --cluster create failed:\n{out.stdout[-2000:]}{out.stderr[-2000:]}")
        deadline = time.monotonic() + timeout
        while not all(n.client().cluster("info").get("cluster_state") == "ok" for n in self.nodes):
            if time.monotonic() > deadline:
                raise RuntimeError("the cluster did not reach cluster_state:ok")
            time.sleep(0.1)
        return self

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()


@pytest.fixture
def redis_cluster(tmp_path):
    cluster = Cluster(tmp_path / "cluster")
    try:
        cluster.start()
    except RuntimeError as e:
        cluster.stop()
        pytest.fail(f"the cluster tests need redis-server and redis-cli: {e}", pytrace=False)
    yield cluster
    cluster.stop()
