"""Soak: a mixed load against `promptcache serve` for N minutes, then a SIGKILL and a restart.

The load, from ``--clients`` threads until the time is up (all traffic to 127.0.0.1):
chats sharing a few long system prompts, several turns each; full streams, streams abandoned
after their first chunk, requests whose client times out; Anthropic ``/v1/messages`` with
``cache_control``; completions; 25 kinds of bad request (each must be a 4xx with an error
object); one 2M-character ``/tokenize`` every ``--big-every`` seconds; ``/health`` polled every
50 ms and ``/metrics`` every second beside it all.

Then: the server must go back to its pool baseline (no block in use by a request); a probe chat
on a shared system prompt is asked twice (its cached tokens: what a graceful restart would
serve); after ``--disk-lag`` the server is SIGKILLed and restarted on its spill folder; the time
to ``/health`` answering is the restart-to-ready, and the probe's cached tokens after it are
compared with the warm ones.

What it reports (``--out``/soak.json, and one line per figure): requests by kind and status,
unexpected answers (a 5xx, a reset or a hang on a good request, a bad request not answered 4xx
with an error object), ``/health`` latency (p50, p99, max; and its max while a big tokenize ran),
the server's resident memory beyond its caches (RSS less the host tier's bytes and the KV
pool's resident pages, from /metrics; its growth after warm-up, and RSS split minute by
minute in ``memory_by_minute``), the pool at the end, restart-to-ready and the restart's share
of cached tokens. ``soak_samples.json`` beside it holds every sample (once a second).

    python -m eval.soak --model smollm2 --minutes 10 --clients 24      # the full run (a quiet machine)
    python -m eval.soak --model embedded --minutes 1 --clients 4       # the test suite's version
"""

from __future__ import annotations

import argparse
import http.client
import json
import random
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

from .common import RESULTS

ROOT = Path(__file__).resolve().parents[1]
HOST = "127.0.0.1"
SYSTEMS = [f"You are the assistant of the {name} museum. " + ("It keeps tiles, maps, ships' instruments and "
           "paintings from five centuries; visits are guided and every room has a story. " * 12)
           for name in ("tile", "maritime", "coach", "design")]
QUESTIONS = ["When do you open?", "How much is a ticket?", "Is there a cafe?", "What should I see first?",
             "Can I bring a dog?", "Is it accessible?"]
TIMEOUT = 120.0  # a good request still unanswered after this is a hang


def _free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


class Server:
    """`promptcache serve` in a subprocess (its log in a file), started and killed by the soak."""

    def __init__(self, args, folder: Path, log: Path):
        self.args, self.folder, self.log, self.port, self.proc = args, folder, log, _free_port(), None

    def start(self) -> float:
        """Start it; seconds until /health answers."""
        cmd = [sys.executable, "-m", "promptcache.server", "--model", self.args.model, "--host", HOST,
               "--port", str(self.port), "--spill-dir", str(self.folder), "--block-size", "16",
               "--disk-lag", str(self.args.disk_lag), *self.args.serve_args]
        t0 = time.monotonic()
        with open(self.log, "a") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=log, cwd=ROOT)
        while time.monotonic() - t0 < self.args.start_timeout:
            if self.proc.poll() is not None:
                raise SystemExit(f"the server exited ({self.proc.returncode}); see {self.log}")
            try:
                if request(self.port, "GET", "/health", timeout=2)[0] == 200:
                    return time.monotonic() - t0
            except OSError:
                pass
            time.sleep(0.1)
        self.proc.kill()
        raise SystemExit(f"the server did not answer /health in {self.args.start_timeout} s; see {self.log}")

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(60)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.kill()

    def rss(self) -> int:
        """Resident bytes of the server process (0 where /proc has none)."""
        try:
            for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
        except OSError:
            pass
        return 0


def request(port: int, method: str, path: str, body=None, headers=None, timeout: float = TIMEOUT,
            raw: bytes | None = None) -> tuple[int, bytes]:
    """(status, body) of one request on a fresh connection."""
    conn = http.client.HTTPConnection(HOST, port, timeout=timeout)
    try:
        data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
        conn.request(method, path, body=data, headers={"content-type": "application/json", **(headers or {})})
        r = conn.getresponse()
        return r.status, r.read()
    finally:
        conn.close()


def _chat(model: str, system: str, turns: list[str], stream: bool = False, max_tokens: int = 12) -> dict:
    messages = [{"role": "system", "content": system}]
    for i, t in enumerate(turns):
        messages.append({"role": "user", "content": t})
        if i < len(turns) - 1:
            messages.append({"role": "assistant", "content": "Noted."})
    return {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": stream}


def bad_requests(model: str) -> list[tuple[str, str, str, bytes, dict]]:
    """(kind, method, path, raw body, extra headers): 25 kinds of bad request, each answered 4xx."""
    j = lambda d: json.dumps(d).encode()  # noqa: E731
    msgs = [{"role": "user", "content": "hi"}]
    deep: object = "x"
    for _ in range(100):
        deep = [deep]
    return [
        ("invalid json", "POST", "/v1/chat/completions", b'{"model": ', {}),
        ("text/plain", "POST", "/v1/chat/completions", j({"model": model, "messages": msgs}),
         {"content-type": "text/plain"}),
        ("empty body", "POST", "/v1/chat/completions", b"", {}),
        ("no messages", "POST", "/v1/chat/completions", j({"model": model}), {}),
        ("empty messages", "POST", "/v1/chat/completions", j({"model": model, "messages": []}), {}),
        ("unknown model", "POST", "/v1/chat/completions", j({"model": "nope", "messages": msgs}), {}),
        ("negative max_tokens", "POST", "/v1/chat/completions", j({"model": model, "messages": msgs, "max_tokens": -1}),
         {}),
        ("temperature text", "POST", "/v1/chat/completions",
         j({"model": model, "messages": msgs, "temperature": "hot"}), {}),
        ("unknown field", "POST", "/v1/chat/completions", j({"model": model, "messages": msgs, "foo": 1}), {}),
        ("bad role", "POST", "/v1/chat/completions", j({"model": model, "messages": [{"role": "wizard",
                                                                                      "content": "hi"}]}), {}),
        ("image part", "POST", "/v1/chat/completions", j({"model": model, "messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]}), {}),
        ("n=3", "POST", "/v1/chat/completions", j({"model": model, "messages": msgs, "n": 3}), {}),
        ("NaN", "POST", "/v1/chat/completions", b'{"model": "%s", "messages": [], "temperature": NaN}' % model.encode(),
         {}),
        ("too deep", "POST", "/v1/chat/completions", j({"model": model, "messages": msgs, "x": deep}), {}),
        ("too large", "POST", "/v1/chat/completions", b"{}", {"content-length": str(64 * 2**20)}),
        ("token id out of range", "POST", "/detokenize", j({"tokens": [10**9]}), {}),
        ("prompt and messages", "POST", "/tokenize", j({"prompt": "a", "messages": msgs}), {}),
        ("messages without max_tokens", "POST", "/v1/messages", j({"model": model, "messages": msgs}), {}),
        ("bad cache_control", "POST", "/v1/messages", j({"model": model, "max_tokens": 4, "messages": [
            {"role": "user", "content": [{"type": "text", "text": "hi", "cache_control": {"type": "forever"}}]}]}), {}),
        ("empty prompt", "POST", "/v1/completions", j({"model": model, "prompt": ""}), {}),
        ("seed out of range", "POST", "/v1/chat/completions", j({"model": model, "messages": msgs, "seed": 2**70}), {}),
        ("top_p 5", "POST", "/v1/chat/completions", j({"model": model, "messages": msgs, "top_p": 5}), {}),
        ("stop of the wrong type", "POST", "/v1/chat/completions", j({"model": model, "messages": msgs, "stop": 5}),
         {}),
        ("lone surrogate", "POST", "/v1/chat/completions",
         b'{"model": "%s", "messages": [{"role": "user", "content": "\\ud800"}]}' % model.encode(), {}),
        ("unknown route", "GET", "/v1/engines", b"", {}),
    ]


class Soak:
    def __init__(self, args, server: Server):
        self.args, self.server, self.port = args, server, server.port
        self.counts: Counter = Counter()  # (kind, outcome) -> n
        self.unexpected: list[str] = []
        self.health: list[tuple[float, float]] = []  # (at, seconds)
        self.big: list[tuple[float, float]] = []  # (start, end) of each big tokenize
        self.samples: list[dict] = []  # /metrics and memory, every second
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.bad_kinds = bad_requests(args.model)

    def note(self, kind: str, outcome: str, unexpected: str | None = None) -> None:
        with self.lock:
            self.counts[(kind, outcome)] += 1
            if unexpected is not None:
                self.unexpected.append(f"{kind}: {unexpected}")

    # -- the clients ------------------------------------------------------------------------------
    def client(self, i: int) -> None:
        rng, n, end = random.Random(i), 0, time.monotonic() + self.args.minutes * 60
        next_big = time.monotonic() + self.args.big_every / 2
        while time.monotonic() < end and n < 100_000 and not self.stop.is_set():
            n += 1
            big = i == 0 and time.monotonic() >= next_big
            if big:
                next_big = time.monotonic() + self.args.big_every
            kind = "big tokenize" if big else rng.choices(
                ["chat", "stream", "abandon", "timeout", "messages", "completion", "bad"], [30, 15, 8, 6, 15, 8, 18])[0]
            try:  # (a big tokenize that fails is counted like any request, not lost with the thread)
                self.big_tokenize() if big else getattr(self, kind)(rng)
            except (OSError, http.client.HTTPException) as e:
                if kind == "timeout" and isinstance(e, (socket.timeout, TimeoutError)):
                    self.note(kind, "timed out (as asked)")
                else:
                    self.note(kind, type(e).__name__, f"{type(e).__name__}: {e}")
            except Exception as e:  # noqa: BLE001 - a soak client's own failure is counted, not lost
                self.note(kind, "client error", f"the client failed: {type(e).__name__}: {e}")

    def _good(self, kind: str, status: int, body: bytes) -> None:
        if status == 200:
            self.note(kind, "200")
        else:
            self.note(kind, str(status), f"status {status}: {body[:200]!r}")

    def chat(self, rng) -> None:
        system, turns = rng.choice(SYSTEMS), rng.sample(QUESTIONS, rng.randint(1, 3))
        for t in range(1, len(turns) + 1):  # a conversation: each turn resends the history
            self._good("chat", *request(self.port, "POST", "/v1/chat/completions",
                                        _chat(self.args.model, system, turns[:t])))

    def completion(self, rng) -> None:
        self._good("completion", *request(self.port, "POST", "/v1/completions", {
            "model": self.args.model, "prompt": rng.choice(SYSTEMS) + rng.choice(QUESTIONS), "max_tokens": 8,
            "temperature": 0}))

    def messages(self, rng) -> None:
        body = {"model": self.args.model, "max_tokens": 8, "messages": [{"role": "user", "content": rng.choice(QUESTIONS)}],
                "system": [{"type": "text", "text": rng.choice(SYSTEMS), "cache_control": {"type": "ephemeral"}}]}
        self._good("messages", *request(self.port, "POST", "/v1/messages", body))

    def stream(self, rng, abandon: bool = False) -> None:
        kind = "abandon" if abandon else "stream"
        conn = http.client.HTTPConnection(HOST, self.port, timeout=TIMEOUT)
        try:
            conn.request("POST", "/v1/chat/completions", json.dumps(_chat(
                self.args.model, rng.choice(SYSTEMS), [rng.choice(QUESTIONS)], stream=True, max_tokens=48)),
                {"content-type": "application/json"})
            r = conn.getresponse()
            if r.status != 200:
                return self._good(kind, r.status, r.read())
            if abandon:
                r.readline()  # the first chunk, then the client goes away
                return self.note(kind, "abandoned")
            data = r.read()
            self.note(kind, "200") if b"[DONE]" in data else self.note(kind, "cut", "a stream ended without [DONE]")
        finally:
            conn.close()

    def abandon(self, rng) -> None:
        self.stream(rng, abandon=True)

    def timeout(self, rng) -> None:
        body = _chat(self.args.model, rng.choice(SYSTEMS), [rng.choice(QUESTIONS)], max_tokens=64)
        self._good("timeout", *request(self.port, "POST", "/v1/chat/completions", body, timeout=0.3))

    def bad(self, rng) -> None:
        kind, method, path, raw, headers = rng.choice(self.bad_kinds)
        status, body = request(self.port, method, path, raw=raw or None, headers=headers)
        try:
            has_error = "error" in json.loads(body)
        except ValueError:
            has_error = False
        if 400 <= status < 500 and has_error:
            self.note("bad", "4xx")
        else:
            self.note("bad", str(status), f"{kind} answered {status}: {body[:200]!r}")

    def big_tokenize(self) -> None:
        text = ("Lisbon has seven hills and many trams. " * 52000)[:1_999_000]
        t0 = time.monotonic()
        status, body = request(self.port, "POST", "/tokenize", {"prompt": text})
        with self.lock:
            self.big.append((t0, time.monotonic()))
        self._good("big tokenize", status, body)

    # -- the monitors -----------------------------------------------------------------------------
    def poll_health(self) -> None:
        while not self.stop.is_set():
            t0 = time.monotonic()
            try:
                status, _ = request(self.port, "GET", "/health", timeout=30)
                if status != 200:
                    self.note("health", str(status), f"/health answered {status}")
            except OSError as e:
                self.note("health", type(e).__name__, f"/health: {e}")
            with self.lock:
                self.health.append((t0, time.monotonic() - t0))
            self.stop.wait(0.05)

    def poll_metrics(self) -> None:
        while not self.stop.is_set():
            try:
                self.samples.append({"at": time.monotonic(), "rss": self.server.rss(), **metrics(self.port)})
            except OSError as e:
                self.note("metrics", type(e).__name__, f"/metrics: {e}")
            self.stop.wait(1.0)

    def run(self) -> float:
        monitors = [threading.Thread(target=f, daemon=True) for f in (self.poll_health, self.poll_metrics)]
        clients = [threading.Thread(target=self.client, args=(i,), daemon=True) for i in range(self.args.clients)]
        t0 = time.monotonic()
        for t in monitors + clients:
            t.start()
        for t in clients:
            t.join(self.args.minutes * 60 + 2 * TIMEOUT)
            if t.is_alive():
                self.note("client", "hung", "a client thread did not finish")
        self.stop.set()
        for t in monitors:
            t.join(35)
        return time.monotonic() - t0


def metrics(port: int) -> dict:
    """The gauges the soak follows, from /metrics."""
    status, body = request(port, "GET", "/metrics", timeout=30)
    out = {}
    for line in body.decode().splitlines():
        if line.startswith("#") or " " not in line:
            continue
        name, value = line.rsplit(" ", 1)
        for want, key in (("promptcache_requests_in_flight", "in_flight"), ('promptcache_store_bytes{tier="host"}', "host"),
                          ("promptcache_kv_pool_blocks", "blocks"), ("promptcache_kv_pool_bytes", "pool_bytes"),
                          ("promptcache_kv_pool_resident_bytes", "pool_rss")):
            if name == want and float(value) >= 0:  # (a resident size of -1: not known, a GPU pool)
                out[key] = float(value)
        if name.startswith("promptcache_kv_pool_blocks_by_state"):
            out["pool_" + name.split('"')[1]] = float(value)
    return out


def probe(port: int, model: str) -> int:
    """Cached prompt tokens of a chat on a shared system prompt."""
    status, body = request(port, "POST", "/v1/chat/completions", _chat(model, SYSTEMS[0], ["Where is the entrance?"]))
    assert status == 200, body
    return json.loads(body)["usage"]["prompt_tokens_details"]["cached_tokens"]


def percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else 0.0


def _beyond_caches(samples: list[dict], seconds: float) -> list[float]:
    """Resident bytes beyond the caches at each sample after warm-up (the first fifth of the run): RSS less the host tier's bytes and the KV pool's resident pages.

    The pool's resident pages are the server's ``promptcache_kv_pool_resident_bytes`` (mincore
    over the pool's buffer, page by page). A CPU pool is
    allocated untouched and its pages become resident as blocks are first written; blocks freed
    by finished requests are reused in place, but a request needing a longer contiguous run than
    the free pieces between idle cached entries offer takes blocks never written before, so the
    resident part of the pool grows toward its configured size over a long run, by design. An
    estimate from the pool's gauges (the most blocks in use at once, times a block's bytes)
    misses those pages, and counted them as growth beyond the caches. It is used only where the
    server does not know the resident size (a GPU pool)."""
    out, touched = [], 0.0
    for x in samples:
        block = x.get("pool_bytes", 0) / x["blocks"] if x.get("blocks") else 0
        touched = max(touched, (x.get("blocks", 0) - x.get("pool_free", 0)) * block)
        if x["rss"] and x["at"] >= samples[0]["at"] + 0.2 * seconds:
            out.append(x["rss"] - x.get("host", 0) - x.get("pool_rss", touched))
    return out


def _tenth(xs: list[float], end: int) -> float:
    """The median of the first (``end`` 0) or last (-1) tenth of ``xs`` (at least one value)."""
    k = max(1, len(xs) // 10)
    return statistics.median(xs[:k] if end == 0 else xs[-k:])


def memory_by_minute(samples: list[dict]) -> list[dict]:
    """The server's memory at the first sample of each minute of the run (MB): RSS, the KV pool's
    resident pages, the host tier's bytes, and what is left (beyond the caches)."""
    out, t0 = [], samples[0]["at"] if samples else 0.0
    for x in samples:
        if int((x["at"] - t0) // 60) == len(out) and x["rss"]:
            pool = x.get("pool_rss")
            out.append({"minute": len(out), "rss_mb": round(x["rss"] / 2**20),
                        "pool_resident_mb": round(pool / 2**20) if pool is not None else None,
                        "host_tier_mb": round(x.get("host", 0) / 2**20),
                        "beyond_caches_mb": round((x["rss"] - x.get("host", 0) - (pool or 0)) / 2**20)})
    return out


def report(args, soak: Soak, seconds: float, ready: tuple[float, float], end: dict, restart: dict) -> dict:
    lat = [s for _, s in soak.health]
    during_big = [s for at, s in soak.health if any(a <= at <= b for a, b in soak.big)]
    beyond = _beyond_caches(soak.samples, seconds)
    return {
        "model": args.model, "clients": args.clients, "minutes": args.minutes, "seconds": round(seconds, 1),
        "requests": {f"{k} {o}": n for (k, o), n in sorted(soak.counts.items())},
        "unexpected": len(soak.unexpected), "unexpected_first": soak.unexpected[:20],
        "health_reads": len(lat), "health_p50_ms": round(1000 * percentile(lat, 0.5), 1),
        "health_p99_ms": round(1000 * percentile(lat, 0.99), 1), "health_max_ms": round(1000 * max(lat, default=0), 1),
        "big_tokenizes": len(soak.big), "health_max_during_big_ms": round(1000 * max(during_big, default=0), 1),
        "big_tokenize_s": round(statistics.median([b - a for a, b in soak.big]), 2) if soak.big else None,
        # growth: the median of the last tenth of the samples after warm-up against the first tenth
        # (a 2M-character tokenize holds ~200 MB for a moment: the peak is reported apart)
        "rss_beyond_caches_mb_after_warmup": [round(_tenth(beyond, 0) / 2**20), round(_tenth(beyond, -1) / 2**20)]
        if beyond else None,
        "rss_beyond_caches_growth_mb": round((_tenth(beyond, -1) - _tenth(beyond, 0)) / 2**20) if beyond else None,
        "rss_beyond_caches_peak_mb": round(max(beyond) / 2**20) if beyond else None,
        "pool_resident_from": "mincore" if any("pool_rss" in x for x in soak.samples) else "estimate",
        "memory_by_minute": memory_by_minute(soak.samples),
        "pool_at_end": end, "pool_back_to_baseline": end.get("pool_request", 1) == 0 and end.get("pool_shared", 1) == 0
        and end.get("in_flight", 1) == 0,
        "start_to_ready_s": round(ready[0], 1), "restart_to_ready_s": round(ready[1], 1), **restart,
    }


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--clients", type=int, default=24)
    ap.add_argument("--big-every", type=float, default=60.0, help="seconds between 2M-character /tokenize calls")
    ap.add_argument("--disk-lag", type=float, default=2.0, help="the server's --disk-lag")
    ap.add_argument("--start-timeout", type=float, default=600.0)
    ap.add_argument("--serve-args", nargs=argparse.REMAINDER, default=[], help="more `promptcache serve` options")
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="promptcache-soak-"))
    server = Server(args, work / "spill", work / "server.log")
    try:
        started = server.start()
        soak = Soak(args, server)
        seconds = soak.run()
        deadline, end = time.monotonic() + 60, {}
        while time.monotonic() < deadline:  # every request answered or cancelled: the pool's baseline
            end = metrics(server.port)
            if end.get("in_flight") == 0 and end.get("pool_request") == 0 and end.get("pool_shared") == 0:
                break
            time.sleep(0.5)
        probe(server.port, args.model)
        warm = probe(server.port, args.model)  # what the running server (and a graceful restart) serves
        time.sleep(args.disk_lag + 1.0)  # written behind by now
        server.kill()
        restarted = server.start()
        after = probe(server.port, args.model)
        restart = {"cached_warm": warm, "cached_after_sigkill": after,
                   "cached_share_after_sigkill": round(after / warm, 3) if warm else None}
        result = report(args, soak, seconds, (started, restarted), end, restart)
    finally:
        server.stop()
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "soak.json"
    path.write_text(json.dumps(result, indent=1))
    (args.out / "soak_samples.json").write_text(json.dumps(soak.samples))
    for k, v in result.items():
        if k not in ("requests", "unexpected_first", "memory_by_minute"):
            print(f"{k}: {v}")
    for m in result["memory_by_minute"]:
        print(f"  minute {m['minute']}: RSS {m['rss_mb']} MB = pool {m['pool_resident_mb']} + host tier "
              f"{m['host_tier_mb']} + beyond the caches {m['beyond_caches_mb']}")
    print(f"wrote {path}; server log {work / 'server.log'}")
    if not result["unexpected"]:
        shutil.rmtree(work / "spill", ignore_errors=True)
    return result


if __name__ == "__main__":
    main()
