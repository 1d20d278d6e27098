"""The shared-tier tests run against a real redis-server on 127.0.0.1 and a free port (no mocks).

``RedisServer`` (tests/redis_server.py) starts Debian's ``redis-server`` (``.ci/run`` installs it) without persistence,
waits until it answers PING, and can be killed and started again on the same port (a Redis
outage mid-run). Where ``redis-server`` (or ``redis-cli``, for the cluster) is not installed the
tests are skipped, the package named (``tests/programs.py``, marked in ../conftest.py; failed
under ``CI=true``); a server
that is installed but cannot start FAILS the test with the reason.
"""

from __future__ import annotations

import shutil
import subprocess
import time

import pytest

from redis_server import RedisServer, free_port


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
