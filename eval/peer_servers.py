"""The servers under test of ``eval/serve_peer.py``: how each is started (promptcache serve, vLLM's
CPU build, ``transformers serve --continuous-batching``), awaited, stopped with its whole process
tree, how much memory that tree holds, and one streamed chat through the official ``openai`` client
with the arrival time of every token. Nothing here knows any server's internals: HTTP only.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import shlex
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

MODEL_NAME = "m"  # the id every server is told to answer to


# ---- the servers under test -------------------------------------------------------------------

def dtype(args) -> str:
    """The dtype every server is started in (``serve_peer --dtype``: one at a time)."""
    return getattr(args, "dtype", "float32")


def _promptcache_cmd(args, model_dir: str, port: int) -> list[str]:
    return [sys.executable, "-m", "promptcache.server", "--model", model_dir, "--dtype", dtype(args),
            "--device", "cpu", "--port", str(port), "--model-name", MODEL_NAME,
            "--max-queue", str(max(args.concurrency + [args.stall_streams]) + 8),
            *shlex.split(getattr(args, "promptcache_args", "") or "")]


def _vllm_cmd(args, model_dir: str, port: int) -> list[str]:
    return [str(Path(args.vllm_venv) / "bin" / "python"), "-m", "vllm.entrypoints.openai.api_server",
            "--model", model_dir, "--served-model-name", MODEL_NAME, "--dtype", dtype(args),
            "--enable-prefix-caching", "--enable-prompt-tokens-details", "--max-model-len", "8192",
            "--max-num-seqs", str(max(args.concurrency + [args.stall_streams + 1])),
            "--host", "127.0.0.1", "--port", str(port)]


def _vllm_env(args) -> dict:
    cache = Path(args.vllm_venv) / "cache"
    (cache / "tmp").mkdir(parents=True, exist_ok=True)
    return {"VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_KVCACHE_SPACE": "4",
            "VLLM_CPU_OMP_THREADS_BIND": f"0-{args.threads - 1}", "VLLM_CACHE_ROOT": str(cache / "vllm"),
            "TORCHINDUCTOR_CACHE_DIR": str(cache / "inductor"), "TMPDIR": str(cache / "tmp"),
            "VLLM_NO_USAGE_STATS": "1", "VLLM_DO_NOT_TRACK": "1"}


def _tf_cmd(args, model_dir: str, port: int) -> list[str]:
    return [str(Path(args.tf_venv) / "bin" / "transformers"), "serve", "--continuous-batching", model_dir,
            "--dtype", dtype(args), "--device", "cpu",
            "--host", "127.0.0.1", "--port", str(port)]


def _ignore_eos(n: int) -> dict:
    """vLLM's fields, which promptcache serve takes too (what came is counted all the same)."""
    return {"ignore_eos": True, "min_tokens": n}


def _tf_min_tokens(n: int) -> dict:
    """transformers serve refuses unknown fields (422) but takes a GenerationConfig as JSON."""
    return {"generation_config": json.dumps({"min_new_tokens": n, "max_new_tokens": n, "do_sample": False})}


@dataclass(frozen=True)
class Server:
    name: str
    cmd: object  # (args, model_dir, port) -> argv
    env: object = lambda args: {}  # noqa: E731  (args) -> extra environment
    venv_flag: str | None = None  # the option that must name the server's venv
    ready_s: float = 300.0  # startup timeout
    model: object = lambda args: MODEL_NAME  # noqa: E731  the "model" field requests carry
    exact_length: object = _ignore_eos  # (n) -> extra body fields asking for exactly n tokens


SERVERS = {s.name: s for s in (
    Server("promptcache", _promptcache_cmd),
    Server("vllm", _vllm_cmd, _vllm_env, "vllm_venv", ready_s=900.0),
    Server("tf", _tf_cmd, venv_flag="tf_venv", ready_s=600.0, model=lambda args: args.model_dir,
           exact_length=_tf_min_tokens),
)}


# ---- processes and their memory ---------------------------------------------------------------

def tree_rss(pid: int) -> int:
    """Resident bytes of ``pid`` and all its descendants (Linux /proc), 0 once it is gone."""
    children: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                ppid = int(Path(f"/proc/{d}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(d))
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        todo += children.get(p, [])
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) * 1024
        except OSError:
            pass
    return total


class RssPeak:
    """Samples ``tree_rss(pid)`` every ``every`` s in a thread while in the ``with`` block."""

    def __init__(self, pid: int, every: float = 0.1):
        self.pid, self.every, self.peak, self._stop = pid, every, 0, threading.Event()

    def __enter__(self):
        self.before = self.peak = tree_rss(self.pid)
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _run(self):
        while not self._stop.wait(self.every):
            self.peak = max(self.peak, tree_rss(self.pid))

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join(timeout=10)
        self.peak = max(self.peak, tree_rss(self.pid))

    @property
    def growth_mb(self) -> float:
        return round((self.peak - self.before) / 2**20, 1)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Running:
    """One server subprocess in its own session (its whole tree is killed on exit), its output in
    ``log``; entering waits until ``/v1/models`` answers, the process dies, or the timeout."""

    def __init__(self, server: Server, args, log: Path):
        self.server, self.args, self.log, self.port = server, args, log, free_port()
        self.url = f"http://127.0.0.1:{self.port}/v1"

    def __enter__(self):
        threads = str(self.args.threads)
        env = {**os.environ, "OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads, "HF_HUB_OFFLINE": "1",
               "TRANSFORMERS_OFFLINE": "1", **self.server.env(self.args)}
        argv = self.server.cmd(self.args, self.args.model_dir, self.port)
        print(f"[{self.server.name}] starting: {' '.join(argv)} (log: {self.log})", flush=True)
        self._logf = self.log.open("w")
        self.proc = subprocess.Popen(argv, stdout=self._logf, stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True)
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_ready(self):
        t0 = time.monotonic()
        while time.monotonic() - t0 < self.server.ready_s:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.server.name} exited with {self.proc.returncode} before it was ready; "
                                   f"the end of {self.log}:\n{self._tail()}")
            try:
                with urllib.request.urlopen(self.url + "/models", timeout=5) as r:
                    if r.status == 200:
                        print(f"[{self.server.name}] ready after {time.monotonic() - t0:.0f} s", flush=True)
                        return
            except OSError:
                pass
            time.sleep(1.0)
        raise TimeoutError(f"{self.server.name} not ready after {self.server.ready_s:.0f} s; "
                           f"the end of {self.log}:\n{self._tail()}")

    def _tail(self, n: int = 20) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])

    def stop(self):
        """SIGTERM to the server's process group, SIGKILL after 5 s (a benchmark needs no graceful drain)."""
        if self.proc.poll() is None:
            for sig, wait in ((signal.SIGTERM, 5), (signal.SIGKILL, 10)):
                try:
                    os.killpg(self.proc.pid, sig)
                    self.proc.wait(timeout=wait)
                    break
                except ProcessLookupError:
                    break
                except subprocess.TimeoutExpired:
                    continue
        self._logf.close()

    def __exit__(self, *exc):
        self.stop()


# ---- one streamed request ---------------------------------------------------------------------

@dataclass
class Stream:
    sent: float  # perf_counter when the request left
    token_times: list[float] = field(default_factory=list)  # arrival of each non-empty content chunk
    text: str = ""
    completion_tokens: int = 0
    prompt_tokens: int | None = None
    cached_tokens: int | None = None

    @property
    def ttft(self) -> float:
        return self.token_times[0] - self.sent

    def gaps(self) -> list[tuple[float, float]]:
        """(arrival, seconds since the previous token) for every token after the first."""
        return [(b, b - a) for a, b in zip(self.token_times, self.token_times[1:])]


@dataclass
class Target:
    """A ready server as the measurements see it: its client, the model id requests carry, how to
    ask it for an exact answer length, the root of its process tree."""
    name: str
    oai: object
    model: str
    exact_length: object
    pid: int

    def chat(self, messages: list[dict], max_tokens: int, exact: bool = True,
             at_4th: threading.Barrier | None = None) -> Stream:
        """One greedy streamed chat; usage from the final chunk when the server sends one, else
        the number of content chunks counted as tokens. ``at_4th`` is waited on once, at the 4th
        token (or at the end of a shorter answer)."""
        s, parts = Stream(sent=time.perf_counter()), []
        try:
            for chunk in self.oai.chat.completions.create(
                    model=self.model, messages=messages, max_tokens=max_tokens, temperature=0, stream=True,
                    stream_options={"include_usage": True},
                    extra_body=self.exact_length(max_tokens) if exact else {}):
                if chunk.choices and chunk.choices[0].delta.content:
                    s.token_times.append(time.perf_counter())
                    parts.append(chunk.choices[0].delta.content)
                    if at_4th is not None and len(s.token_times) == 4:
                        at_4th.wait()
                        at_4th = None
                if chunk.usage is not None:
                    s.completion_tokens, s.prompt_tokens = chunk.usage.completion_tokens, chunk.usage.prompt_tokens
                    details = chunk.usage.prompt_tokens_details
                    s.cached_tokens = details.cached_tokens if details is not None else None
        finally:
            if at_4th is not None:
                at_4th.abort()  # nobody waits for a stream that ended early or failed
        if not s.token_times:
            raise RuntimeError(f"{self.name}: no content came for a request of {max_tokens} tokens")
        s.text, s.completion_tokens = "".join(parts), s.completion_tokens or len(s.token_times)
        return s
