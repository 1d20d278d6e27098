"""Replicas behind a cache-aware router: token hit rate, TTFT and throughput of a multi-tenant chat.

Workload: ``--conversations`` chats of ``--turns`` turns; each opens with one of ``--prompts``
system prompts drawn by Zipf (exponent ``--zipf``: a few tenants are hot, most are cold), then
user turns; each answer (greedy, ``--reply`` tokens) joins the next turn's prompt. ``--clients``
threads each run whole conversations, one turn after another, against one endpoint:

* ``single``     one replica with all the cache memory (``3 x --cache-mb``), no router: the hit
                 rate a single machine would reach (the reference);
* ``round_robin`` 3 replicas behind the router's round-robin policy;
* ``cache_aware`` 3 replicas behind the router's cache-aware policy (one run per router found);
* ``rr_redis``   round-robin with the replicas sharing states through a 3-node Redis Cluster.

Replicas are ``promptcache serve --model embedded`` subprocesses with one torch thread each
(OMP_NUM_THREADS=1), ``--cache-mb`` of memory for states and ``--disk-budget 0`` (evicted states
are gone, so memory is what a replica holds). Routers are the PyPI packages ``vllm-router`` and
``sglang-router`` (``--routers DIR``: the folder with their executables; default: the PATH).
Per request: TTFT (the first streamed chunk; the server sends it after the prompt ran), prompt
and cached tokens (``stream_options.include_usage``). Hit rate = cached / prompt tokens over the
run; throughput = requests per second of wall time.

``--failover``: one more cache-aware run (sglang-router, the one docs/scaling.md picks) in which replica 2 is killed after half the
conversations: requests must still succeed through the router (counted: ``errors``) and the hit
rate of the rest of the run is reported separately (``after_kill``).

``--configs`` picks runs (``single,round_robin,cache_aware,rr_redis``); ``--router-args`` passes
more options to the cache-aware routers (``'--balance-abs-threshold 1000'``).

Writes ``cluster.csv`` and ``cluster.png`` to ``--out`` (default eval/results/). Absolute times
on a shared 2-core machine are noise; the hit rates are the result. Needs redis-server and
redis-cli on the PATH.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
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
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from .common import RESULTS, pyplot, streamed_chat

ROOT = Path(__file__).resolve().parents[1]
# a worker's first failed request opens its circuit, so the router's retry goes to another worker at
# once; health checks every 2 s take it out of the rotation (both routers take these options)
FAILOVER = ["--cb-failure-threshold", "1", "--health-check-interval-secs", "2", "--health-failure-threshold", "1"]
WORDS = ("river mountain ticket museum harbor lantern garden market bridge castle valley orchard station "
         "island temple village meadow canyon forest desert glacier lagoon plateau summit cathedral").split()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_http(url: str, proc: subprocess.Popen, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args[0]} exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.2)
    raise RuntimeError(f"{url} did not answer within {timeout}s")


def start(cmd: list[str], log: Path, env: dict | None = None) -> subprocess.Popen:
    return subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, env=env, start_new_session=True)


def stop(procs: list[subprocess.Popen]) -> None:
    """SIGINT each process group (a router's launcher leaves its server process behind otherwise),
    then SIGKILL what is left after 20 s."""
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGINT)
    for p in procs:
        try:
            p.wait(20)
        except subprocess.TimeoutExpired:
            pass
        try:
            os.killpg(p.pid, signal.SIGKILL)  # the group: each was started in a session of its own
        except ProcessLookupError:
            pass
        p.wait()


def replicas(n: int, cache_mb: float, tmp: Path, remote: str | None = None) -> tuple[list[subprocess.Popen], list[str]]:
    procs, urls = [], []
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    for i in range(n):
        port = free_port()
        cmd = [sys.executable, "-m", "promptcache.server", "--model", "embedded", "--port", str(port),
               "--block-size", "16", "--host-budget", f"{cache_mb}MiB", "--device-budget", f"{cache_mb}MiB",
               "--disk-budget", "0", "--max-queue", "256"]
        cmd += ["--remote", remote] if remote else []
        procs.append(start(cmd, tmp / f"replica{i}-{port}.log", env))
        urls.append(f"http://127.0.0.1:{port}")
    for p, u in zip(procs, urls):
        wait_http(u + "/health", p)
    return procs, urls


def router(exe: str, policy: str, workers: list[str], tmp: Path, extra: tuple[str, ...] = ()) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [exe] + (["launch"] if Path(exe).name == "sglang-router" else [])
    cmd += ["--host", "127.0.0.1", "--port", str(port), "--policy", policy, "--worker-urls", *workers,
            "--prometheus-port", str(free_port()), *FAILOVER, *extra]
    proc = start(cmd, tmp / f"{Path(exe).name}-{policy}.log")
    wait_http(f"http://127.0.0.1:{port}/health", proc)
    return proc, f"http://127.0.0.1:{port}"


def redis_cluster(tmp: Path) -> tuple[list[subprocess.Popen], str]:
    """Three redis-server nodes joined by ``redis-cli --cluster create`` (loopback, no persistence)."""
    procs, ports = [], []
    for i in range(3):
        port, d = free_port(), tmp / f"redis{i}"
        d.mkdir(parents=True)
        procs.append(start(["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly",
                            "no", "--cluster-enabled", "yes", "--cluster-port", str(free_port()), "--dir", str(d),
                            "--cluster-require-full-coverage", "no"], d / "log"))
        ports.append(port)
    time.sleep(0.5)
    subprocess.run(["redis-cli", "--cluster", "create", *(f"127.0.0.1:{p}" for p in ports), "--cluster-replicas", "0",
                    "--cluster-yes"], check=True, capture_output=True, timeout=60)
    time.sleep(1.0)
    return procs, f"redis+cluster://127.0.0.1:{ports[0]}"


def workload(args) -> list[list[tuple[str, list[str]]]]:
    """Conversations: (system prompt, user turns), system prompts drawn by Zipf over ``--prompts``."""
    rng = random.Random(args.seed)
    prompts = [f"You are assistant {i} of tenant {i}. " + " ".join(rng.choice(WORDS) for _ in range(args.system_words))
               for i in range(args.prompts)]
    weights = [1 / (r + 1) ** args.zipf for r in range(args.prompts)]
    convs = []
    for c in range(args.conversations):
        system = rng.choices(prompts, weights)[0]
        turns = [f"Question {c}.{t}: " + " ".join(rng.choice(WORDS) for _ in range(12)) for t in range(args.turns)]
        convs.append((system, turns))
    return convs


def chat(base: str, messages: list[dict], reply: int) -> dict:
    """One streamed greedy request: TTFT, prompt and cached tokens, the answer."""
    import openai

    oai = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=2, timeout=120)
    ttft, answer, usage = streamed_chat(oai, "embedded", messages, reply)
    return {"ttft": ttft, "prompt": usage.prompt_tokens, "cached": usage.prompt_tokens_details.cached_tokens,
            "answer": answer}


def run(base: str, convs, args, on_half=None) -> list[dict]:
    """Every conversation through ``base``, ``--clients`` at a time; rows per request."""
    rows, lock, done = [], threading.Lock(), [0]

    def conversation(i: int, system: str, turns: list[str]) -> None:
        msgs = [{"role": "system", "content": system}]
        for t, user in enumerate(turns):
            msgs.append({"role": "user", "content": user})
            try:
                r = chat(base, msgs, args.reply)
                msgs.append({"role": "assistant", "content": r["answer"]})
                row = {"conv": i, "turn": t, "ttft": r["ttft"], "prompt": r["prompt"], "cached": r["cached"], "error": 0}
            except Exception as e:  # noqa: BLE001 - counted: a failover must not lose requests
                print(f"    request failed: {type(e).__name__}: {e}", flush=True)
                row = {"conv": i, "turn": t, "ttft": None, "prompt": 0, "cached": 0, "error": 1}
            with lock:
                row["phase"] = "after_kill" if on_half is not None and done[0] >= len(convs) // 2 else "before"
                rows.append(row)
        with lock:
            done[0] += 1
            if on_half is not None and done[0] == len(convs) // 2:
                on_half()

    with ThreadPoolExecutor(args.clients) as pool:
        for f in [pool.submit(conversation, i, s, t) for i, (s, t) in enumerate(convs)]:
            f.result()
    return rows


def summary(name: str, rows: list[dict], wall: float) -> dict:
    ok = [r for r in rows if not r["error"]]
    ttfts = sorted(r["ttft"] for r in ok)
    prompt, cached = sum(r["prompt"] for r in ok), sum(r["cached"] for r in ok)
    return {"config": name, "requests": len(rows), "errors": len(rows) - len(ok),
            "hit_rate": round(cached / max(prompt, 1), 4), "ttft_mean_ms": round(1000 * statistics.fmean(ttfts), 1),
            "ttft_p99_ms": round(1000 * ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))], 1),
            "throughput_rps": round(len(ok) / wall, 2), "load1": round(os.getloadavg()[0], 2)}


def measure(name: str, base: str, convs, args, on_half=None) -> list[dict]:
    print(f"  {name} ...", flush=True)
    t0 = time.perf_counter()
    rows = run(base, convs, args, on_half)
    out = [summary(name, rows, time.perf_counter() - t0)]
    if on_half is not None:
        after = [r for r in rows if r["phase"] == "after_kill"]
        out.append(summary(name + ":after_kill", after, time.perf_counter() - t0))
    for s in out:
        print(f"    {s}", flush=True)
    return out


def find_routers(folder: str | None) -> dict[str, str]:
    found = {}
    for name in ("vllm-router", "sglang-router"):
        exe = str(Path(folder) / name) if folder else shutil.which(name)
        if exe and Path(exe).exists():
            found[name] = exe
    if not found:
        raise SystemExit("no router found: pip install vllm-router sglang-router (a separate venv is fine) and pass "
                         "--routers VENV/bin")
    return found


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--routers", default=None, help="folder holding vllm-router / sglang-router (default: PATH)")
    ap.add_argument("--prompts", type=int, default=50)
    ap.add_argument("--zipf", type=float, default=1.0)
    ap.add_argument("--system-words", type=int, default=120)
    ap.add_argument("--conversations", type=int, default=60)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--reply", type=int, default=8)
    ap.add_argument("--clients", type=int, default=3)
    ap.add_argument("--cache-mb", type=float, default=4.0, help="memory for states per replica (single: 3x)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--failover", action="store_true")
    ap.add_argument("--configs", default="single,round_robin,cache_aware,rr_redis",
                    help="which runs, comma-separated (cache_aware: one per router found)")
    ap.add_argument("--router-args", default="", help="more options for the cache-aware routers, e.g. "
                    "'--balance-abs-threshold 1000' (split on spaces)")
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args(argv)
    routers, convs = find_routers(args.routers), workload(args)
    args.out.mkdir(parents=True, exist_ok=True)
    results = []
    with tempfile.TemporaryDirectory(prefix="bench-cluster-") as tmp:
        tmp = Path(tmp)
        wanted, extra = args.configs.split(","), tuple(args.router_args.split())
        if "single" in wanted:
            procs, urls = replicas(1, 3 * args.cache_mb, tmp)
            results += measure("single", urls[0], convs, args)
            stop(procs)
        first = next(iter(routers.values()))
        runs = [("round_robin", first, "round_robin", False),
                *((f"cache_aware:{r}", e, "cache_aware", False) for r, e in routers.items()),
                ("rr_redis", first, "round_robin", True)]
        for name, exe, policy, shared in (r for r in runs if r[0].split(":")[0] in wanted):
            cluster, remote = redis_cluster(tmp / name) if shared else ([], None)
            procs, urls = replicas(3, args.cache_mb, tmp, remote)
            rp, base = router(exe, policy, urls, tmp, extra if policy == "cache_aware" else ())
            try:
                results += measure(name, base, convs, args)
            finally:
                stop([rp, *procs, *cluster])
        if args.failover:
            procs, urls = replicas(3, args.cache_mb, tmp)
            rp, base = router(routers.get("sglang-router", first), "cache_aware", urls, tmp, extra)  # the one chosen (docs/scaling.md)
            try:
                results += measure("failover:cache_aware", base, convs, args, on_half=lambda: procs[2].kill())
            finally:
                stop([rp, *procs])
    write(results, args)
    return 0


def write(results: list[dict], args) -> None:
    with (args.out / "cluster.csv").open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(results[0]))
        w.writeheader()
        w.writerows(results)
    (args.out / "cluster.json").write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}}, indent=1))
    plt = pyplot()
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    names = [r["config"] for r in results]
    a.bar(names, [r["hit_rate"] for r in results], color="tab:blue")
    a.set_ylabel("token hit rate")
    a.set_ylim(0, 1)
    b.bar(names, [r["ttft_mean_ms"] for r in results], color="tab:orange", label="mean")
    b.scatter(names, [r["ttft_p99_ms"] for r in results], color="black", label="p99", zorder=3)
    b.set_ylabel("TTFT (ms)")
    b.legend()
    for ax in (a, b):
        ax.tick_params(axis="x", rotation=30, labelsize=8)
    fig.suptitle(f"{args.conversations} conversations x {args.turns} turns, Zipf({args.zipf}) over {args.prompts} "
                 "system prompts, 3 replicas")
    fig.tight_layout()
    fig.savefig(args.out / "cluster.png", dpi=120)
    print(f"wrote {args.out / 'cluster.csv'} and {args.out / 'cluster.png'}")


if __name__ == "__main__":
    sys.exit(main())
