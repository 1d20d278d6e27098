"""Shared-tier benchmark: first-prompt TTFT of a FRESH process that encodes the schema, fetches its
states from Redis, or loads a local compiled artifact; and the bytes each moves.

    python -m eval.bench_remote [--model embedded:bench] [--schema-tokens 4000] [--repeats 3]
                                [--remote redis://host:port/db] [--out eval/results]

The parent compiles the schema once to a temporary artifact with ``EngineConfig(store=StoreConfig(remote=URL))``, which
publishes its states to Redis (a redis-server it starts on a free port unless ``--remote`` names
one). Then, per
repeat and mode, a new Python process loads the model and runs one plain warm-up prompt (not
timed: a server does both at start), then times schema -> first prompt's logits (``ttft_s``;
``states_s`` is the part before the prompt's prefill; ``local_prefill_s`` the same prompt again
with its states in host memory, placement forgotten; ``acquire_s`` = ttft_s - local_prefill_s,
the cost of getting the states):
  encode   PromptCache.add_schema (every module encoded) + prefill
  remote   add_schema on EngineConfig(store=StoreConfig(remote=URL)) (nothing encoded) + prefill (states fetched)
  disk     load_compiled(artifact) + prefill (states read from the memory-mapped file)
Modes run round-robin, so machine load falls on all of them alike; medians are reported.
Writes remote.csv and remote.png to ``--out``; prints the ratios (target: remote >= 10x faster
than encode on CPU) and the machine's load average before and after (``load_1m`` in the CSV).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from .common import RESULTS, add_model_args, child_command, forget_placement, write_csv, pyplot

MODES = ("encode", "remote", "disk")


def start_redis(port: int) -> subprocess.Popen:
    """A throwaway redis-server on 127.0.0.1:port (no persistence), ready when this returns."""
    import redis

    exe = shutil.which("redis-server") or "/usr/bin/redis-server"
    proc = subprocess.Popen([exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    for _ in range(200):
        try:
            if redis.Redis(port=port).ping():
                return proc
        except redis.exceptions.ConnectionError:
            time.sleep(0.05)
    proc.kill()
    raise SystemExit(f"{exe} did not start on port {port}; pass --remote URL or install redis-server")


def prepare(args, work: Path) -> dict:
    """Encode once, compile the artifact, publish every state; the prompt and sizes for the children."""
    from promptcache import PromptCache
    from promptcache.bench import build_prompt, build_schema
    from promptcache.engine import EngineConfig, StoreConfig
    from promptcache.models.loading import load_model

    model, tok = load_model(args.model, device=args.device, dtype=args.dtype)
    schema = build_schema(tok, args.schema_tokens)
    (work / "schema.xml").write_text(schema)
    pc = PromptCache(model, tok, EngineConfig(store=StoreConfig(remote=args.remote)))
    pc.compile(work / "schema.xml", work / "artifact")  # publishes every state (write-through)
    entry = pc.schema("bench")
    stats = pc.store.shared_stats()
    if stats["errors"] or not stats["bytes_out"]:
        raise SystemExit(f"publishing to {args.remote.split('@')[-1]} failed: {stats}")
    prompt = build_prompt(pc, 8, 32)
    (work / "prompt.xml").write_text(prompt)
    return {"schema_tokens": entry.stored_tokens, "state_bytes": entry.stored_bytes,
            "artifact_bytes": sum(p.stat().st_size for p in (work / "artifact").iterdir()),
            "redis_bytes": stats["bytes_out"]}


def child(args) -> None:
    """One fresh process, one mode: print {"ttft_s", "encoded", "bytes", "hit_tiers"} as JSON."""
    from promptcache import PromptCache
    from promptcache.engine import EngineConfig, StoreConfig
    from promptcache.models.loading import load_model

    work = Path(args.work)
    model, tok = load_model(args.model, device=args.device, dtype=args.dtype)
    pc = PromptCache(model, tok, EngineConfig(store=StoreConfig(remote=args.remote)) if args.child == "remote" else None)
    _ = pc.model_key  # fingerprints (a sampled weight hash) belong to model loading, in every mode
    pc.prefill("<prompt>warm up</prompt>")  # so does the process's first forward (a server does it at start)
    prompt = (work / "prompt.xml").read_text()
    t0 = time.perf_counter()
    if args.child == "disk":
        entry = pc.load_compiled(work / "artifact")
    else:
        entry = pc.add_schema(work / "schema.xml")
    t1 = time.perf_counter()
    res = pc.prefill(prompt)
    ttft = time.perf_counter() - t0
    forget_placement(pc)  # the same prompt again, its states now in host memory: copy + forward only
    t2 = time.perf_counter()
    pc.prefill(prompt)
    local = time.perf_counter() - t2
    stats = pc.store.shared_stats()  # empty unless this is the remote mode
    moved = stats["bytes_in"] if stats else entry.stored_bytes if args.child == "disk" else 0
    print(json.dumps({"ttft_s": ttft, "states_s": t1 - t0, "local_s": local, "bytes": moved, "hit_tiers": res.hit_tiers,
                      "errors": stats.get("errors", 0) + stats.get("corrupt", 0)}))


def run_child(args, mode: str, work: Path) -> dict:
    cmd, env = child_command("eval.bench_remote", "--child", mode, "--work", str(work), "--remote", args.remote,
                     "--model", args.model, "--device", args.device, "--dtype", args.dtype)
    out = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if out.returncode != 0:
        raise SystemExit(f"{mode} process failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def plot(rows: list[dict], path: Path) -> bool:
    plt = pyplot()
    if plt is None:
        return False
    fig, ax = plt.subplots(figsize=(6, 3.6))
    bars = ax.bar([r["mode"] for r in rows], [r["ttft_s"] for r in rows], color=["#c44", "#48c", "#4a4"])
    for bar, r in zip(bars, rows):
        ax.annotate(f"{r['ttft_s']:.2f} s\n{r['bytes_moved'] / 2**20:.0f} MiB", (bar.get_x() + bar.get_width() / 2,
                    bar.get_height()), ha="center", va="bottom", fontsize=8)
    ax.set(ylabel="first-prompt TTFT, fresh process (s)",
           title=f"{rows[0]['schema_tokens']}-token schema, {rows[0]['model']} on {rows[0]['device']}")
    ax.margins(y=0.25)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_args(ap, "embedded:bench")
    ap.add_argument("--schema-tokens", type=int, default=4000)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--remote", default=None, help="redis://[:password@]host:port/db (default: start one)")
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--child", choices=MODES, help=argparse.SUPPRESS)
    ap.add_argument("--work", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        return child(args)
    server = None
    if args.remote is None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        server, args.remote = start_redis(port), f"redis://127.0.0.1:{port}/0"
    load_before = os.getloadavg()[0]
    try:
        with tempfile.TemporaryDirectory(prefix="bench-remote-") as tmp:
            sizes = prepare(args, Path(tmp))
            runs = {m: [] for m in MODES}
            for _ in range(args.repeats):
                for m in MODES:
                    runs[m].append(run_child(args, m, Path(tmp)))
    finally:
        if server is not None:
            server.kill()
            server.wait()
    load = f"{load_before:.1f}-{os.getloadavg()[0]:.1f}"
    bad = [r for r in runs["remote"] if set(r["hit_tiers"]) != {"remote"} or r["errors"]]
    if bad:
        raise SystemExit(f"the remote runs did not take every state from Redis: {bad}")
    rows = [{"model": args.model, "device": args.device, "dtype": args.dtype, "schema_tokens": sizes["schema_tokens"],
             "mode": m, "ttft_s": round(statistics.median(r["ttft_s"] for r in runs[m]), 4),
             "states_s": round(statistics.median(r["states_s"] for r in runs[m]), 4),
             "local_prefill_s": round(statistics.median(r["local_s"] for r in runs[m]), 4),
             "acquire_s": round(statistics.median(r["ttft_s"] - r["local_s"] for r in runs[m]), 4),
             "bytes_moved": runs[m][0]["bytes"], "repeats": args.repeats, "load_1m": load} for m in MODES]
    path = write_csv("remote.csv", rows, args.out)
    plot(rows, Path(args.out) / "remote.png")
    t = {r["mode"]: r["ttft_s"] for r in rows}
    for r in rows:
        print(f"{r['mode']:>7}: first-prompt TTFT {r['ttft_s']:.3f} s, {r['bytes_moved'] / 2**20:.1f} MiB moved")
    a = {r["mode"]: r["acquire_s"] for r in rows}
    print(f"first-prompt TTFT: remote fetch is {t['encode'] / t['remote']:.1f}x faster than encoding "
          f"(target >= 10x); the local artifact {t['encode'] / t['disk']:.1f}x; remote / disk = "
          f"{t['remote'] / t['disk']:.1f}")
    print(f"getting the states (TTFT minus the same prefill with states in host memory, "
          f"{rows[0]['local_prefill_s']:.2f} s): encode {a['encode']:.2f} s, remote {a['remote']:.2f} s, "
          f"disk {a['disk']:.2f} s: remote {a['encode'] / max(a['remote'], 1e-6):.1f}x faster than encoding")
    print(f"state bytes {sizes['state_bytes'] / 2**20:.1f} MiB; in Redis {sizes['redis_bytes'] / 2**20:.1f} MiB; "
          f"artifact {sizes['artifact_bytes'] / 2**20:.1f} MiB; load average (1 min) {load}; written {path}")


if __name__ == "__main__":
    main()
