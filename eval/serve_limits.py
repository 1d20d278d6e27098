"""Oversized requests against a running ``promptcache serve`` (issue 23's acceptance figures).

Starts ``promptcache serve --model embedded`` in a subprocess with the default limits, then for
each case sends one oversized chat request over a raw socket while a thread polls ``/health``
every 10 ms:
  * 15 MiB, Content-Length declared: refused (413) by its length before the body is read;
  * 15 MiB, chunked: refused (413) once 8 MiB (--max-request-bytes) have arrived;
  * 7.5 MiB JSON with one 7.5M-character message: read, parsed on a worker thread, refused (400)
    by --max-chars;
  * 2M characters, exactly --max-chars: templated and tokenized on the planning thread, then
    refused (400) as past the model's context.
Prints per case: time to the refusal, the slowest /health answer while it ran, the server's
resident memory (VmRSS) before, at its peak (VmHWM) and one second after. Ratios and
differences measured in one run; absolute times vary with load.
"""

from __future__ import annotations

import json
import os
import select
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MIB = 2**20


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss_mib(pid: int, field: str = "VmRSS") -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no {field} for {pid}")


def health_poller(port: int, stop: threading.Event, worst: list[float]) -> None:
    while not stop.is_set():
        t0 = time.perf_counter()
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=60) as r:
            r.read()
        worst[0] = max(worst[0], time.perf_counter() - t0)
        time.sleep(0.01)


def send(port: int, head: bytes, body: bytes) -> tuple[int, float]:
    """(status, seconds to the answer); stops sending once the server answers."""
    t0 = time.perf_counter()
    with socket.create_connection(("127.0.0.1", port), timeout=60) as s:
        s.sendall(head)
        sent = 0
        while sent < len(body) and not select.select([s], [], [], 0)[0]:
            try:
                sent += s.send(body[sent:sent + 256 * 1024])
            except (BrokenPipeError, ConnectionResetError):
                break
        answer = s.recv(65536)
    return int(answer.split()[1]), time.perf_counter() - t0


def chat_body(chars: int) -> bytes:
    text = ("Plan a day in Kyoto with temples, gardens and noodles. " * (chars // 55 + 1))[:chars]
    return json.dumps({"model": "embedded", "messages": [{"role": "user", "content": text}]}).encode()


def chunked(body: bytes, size: int = 64 * 1024) -> bytes:
    parts = [b"%x\r\n%s\r\n" % (len(body[i:i + size]), body[i:i + size]) for i in range(0, len(body), size)]
    return b"".join(parts) + b"0\r\n\r\n"


def head(port: int, length: int | None) -> bytes:
    size = f"content-length: {length}" if length is not None else "transfer-encoding: chunked"
    return (f"POST /v1/chat/completions HTTP/1.1\r\nhost: 127.0.0.1:{port}\r\n"
            f"content-type: application/json\r\n{size}\r\n\r\n").encode()


def main() -> None:
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    server = subprocess.Popen([sys.executable, "-m", "promptcache", "serve", "--model", "embedded", "--port", str(port)],
                              env=env, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 300
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5).read()
                break
            except OSError:
                assert time.monotonic() < deadline and server.poll() is None, "the server did not start"
                time.sleep(0.5)
        big = chat_body(15 * MIB)
        cases = [("15 MiB, Content-Length", head(port, len(big)), big),
                 ("15 MiB, chunked", head(port, None), chunked(big)),
                 ("7.5 MiB, 7.5M characters", head(port, len(chat_body(15 * MIB // 2))), chat_body(15 * MIB // 2)),
                 ("2M characters (the limit)", head(port, len(chat_body(1_999_900))), chat_body(1_999_900))]
        print(f"{'case':<26} {'status':>6} {'refused in':>11} {'worst /health':>14} "
              f"{'RSS before':>11} {'peak':>8} {'after':>8}")
        for name, h, body in cases:
            time.sleep(1)
            before = rss_mib(server.pid)
            stop, worst = threading.Event(), [0.0]
            poller = threading.Thread(target=health_poller, args=(port, stop, worst))
            poller.start()
            time.sleep(0.1)
            status, seconds = send(port, h, body)
            time.sleep(0.1)
            stop.set()
            poller.join()
            time.sleep(1)
            print(f"{name:<26} {status:>6} {seconds * 1e3:>9.0f}ms {worst[0] * 1e3:>12.1f}ms "
                  f"{before:>9.0f}MiB {rss_mib(server.pid, 'VmHWM'):>5.0f}MiB {rss_mib(server.pid):>5.0f}MiB")
    finally:
        server.terminate()
        server.wait(30)


if __name__ == "__main__":
    main()
