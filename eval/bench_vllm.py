"""PML on vLLM: time to first token and throughput of vLLM with promptcache's connector against
plain vLLM (prefix caching on), on module reuse and on RAG documents in new orders.

One vLLM server (CPU build, SmolLM2-135M, float32) with the connector loaded serves both modes,
so they share the machine, the process and its load: *connector* requests come from
``to_vllm_request`` (the imported modules' stored states supplied, rotated), *plain* requests are
the same token ids with nothing supplied (vLLM's own prefix cache reuses what it can: the modules
up to the first one that differs from an earlier prompt). The schema has ``--modules`` modules of
``--module-tokens`` tokens; each prompt imports ``--imports`` of them (a seeded random subset, in
schema order) and asks a question no other prompt asks. The *documents* workload: a
``DocumentStore`` (``attach_separator=True``, persisted, its folder given to the connector) of
``--docs`` documents of ``--doc-tokens`` tokens; each prompt retrieves ``--retrieve`` of them in
a seeded random order (new orders: plain vLLM's prefix cache reuses only the leading documents an
earlier prompt had in the same order) under one system text, and asks its own question.

For each workload:

* TTFT: ``--requests`` prompts per mode, alternating modes, ``max_tokens=1``; p50 and p90.
* Throughput: ``--burst`` prompts per mode sent by ``--concurrency`` threads, ``--max-tokens``
  each (``ignore_eos``); requests and generated tokens per second.

Prints the ratios (measured in one run; a shared machine's load falls on both modes) and
writes ``bench_vllm.csv`` and ``.png`` (``--rope llama3``: SmolLM2's weights with Llama 3.1's
rope scaling, ``bench_vllm_llama3.csv``). vLLM comes from ``eval/vllm_connector.py``
(``$PROMPTCACHE_VLLM_VENV`` or a venv made once). Run it at ``nice -n 19`` on a shared machine.
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
import types
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from eval.common import RESULTS, save_table, text_of_tokens
from eval.peer_servers import MODEL_NAME, Running
from eval.vllm_connector import rope_variant, server, vllm_venv

MODES = ("connector", "plain")
WORKLOADS = ("modules", "documents")
SYSTEM = "Answer the question from the documents."
ROPES = {"default": None,  # SmolLM2 as published
         "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 2048}}


def make_schema(tok, modules: int, tokens: int) -> str:
    body = "".join(f'<module name="m{i}"> Note {i}: {text_of_tokens(tok, tokens, seed=100 + i)}</module>\n'
                   for i in range(modules))
    return f'<schema name="notes">Answer the question from the notes.\n{body}</schema>'


def make_prompts(n: int, modules: int, imports: int, seed: int, tag: str) -> list[str]:
    rng = random.Random(seed)
    out = []
    for k in range(n):
        chosen = sorted(rng.sample(range(modules), imports))
        refs = "".join(f"<m{i}/>" for i in chosen)
        question = f" Question {tag}{k}: what does note {chosen[-1]} say? Answer:"
        out.append(f'<prompt schema="notes">{refs}{question}</prompt>')
    return out


def make_store(pc, folder: Path, docs: int, tokens: int):
    from promptcache.rag import DocumentStore

    store = DocumentStore(pc, folder, independent=True, attach_separator=True)
    for i in range(docs):
        store.add(f"d{i}", f"Document {i}: {text_of_tokens(pc.tokenizer, tokens, seed=500 + i)}")
    return store


def make_questions(n: int, docs: int, retrieve: int, seed: int, tag: str) -> list[tuple[str, list[str]]]:
    rng = random.Random(seed)
    out = []
    for k in range(n):
        chosen = rng.sample(range(docs), retrieve)  # in retrieval order, not sorted
        out.append((f"Question {tag}{k}: what does document {chosen[0]} say?", [f"d{i}" for i in chosen]))
    return out


def requests_for(source, prompts: list) -> dict[str, list[dict]]:
    from promptcache.integrations.vllm import plan_request

    planned = [plan_request(source, p, system=SYSTEM if isinstance(p, tuple) else None) for p in prompts]
    missing = [r.reason for r in planned if r.supply is None]
    if missing:
        raise SystemExit(f"a prompt gets no states: {missing[0]}")
    return {"connector": [r.kwargs for r in planned],
            "plain": [{"prompt": list(r.token_ids), "extra_body": {}} for r in planned]}


def one(client, request: dict, max_tokens: int) -> tuple[float, int, int]:
    """(seconds, cached prompt tokens, generated tokens) of one completion."""
    body = {**request["extra_body"], "ignore_eos": True}
    t0 = time.perf_counter()
    r = client.completions.create(model=MODEL_NAME, prompt=request["prompt"], max_tokens=max_tokens, temperature=0,
                                  extra_body=body)
    return time.perf_counter() - t0, r.usage.prompt_tokens_details.cached_tokens, r.usage.completion_tokens


def ttft(client, reqs: dict[str, list[dict]]) -> dict[str, list[tuple]]:
    out = {m: [] for m in MODES}
    for k in range(len(reqs["plain"])):
        order = MODES if k % 2 == 0 else MODES[::-1]
        for mode in order:
            out[mode].append(one(client, reqs[mode][k], 1))
    return out


def throughput(client, reqs: list[dict], concurrency: int, max_tokens: int) -> tuple[float, float, float]:
    """(requests/s, generated tokens/s, seconds) of ``reqs`` sent by ``concurrency`` threads."""
    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        done = list(pool.map(lambda r: one(client, r, max_tokens), reqs))
    s = time.perf_counter() - t0
    return len(done) / s, sum(d[2] for d in done) / s, s


def plot(rows: list[dict], path: Path) -> bool:
    from eval.common import pyplot

    plt = pyplot()
    if plt is None:
        return False
    fig, (a, b) = plt.subplots(1, 2, figsize=(8, 3.4))
    names = [f"{r['workload']}\n{r['mode']}" for r in rows]
    colors = ["#48c" if r["mode"] == "connector" else "#c44" for r in rows]
    a.bar(names, [r["ttft_p50_s"] for r in rows], color=colors)
    a.set(ylabel="TTFT p50 (s)", title="time to first token")
    b.bar(names, [r["requests_per_s"] for r in rows], color=colors)
    b.set(ylabel="requests / s", title=f"throughput, {rows[0]['concurrency']} concurrent")
    for ax in (a, b):
        ax.tick_params(axis="x", labelsize=7)
    r = rows[0]
    rope = "" if r["rope"] == "default" else f" ({r['rope']} rope)"
    fig.suptitle(f"vLLM CPU, SmolLM2-135M{rope}: {r['imports']} of {r['modules']} modules x {r['module_tokens']} "
                 "tokens; "
                 f"{r['retrieve']} of {r['docs']} documents x {r['doc_tokens']} tokens, new orders", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--modules", type=int, default=8)
    ap.add_argument("--module-tokens", type=int, default=256)
    ap.add_argument("--imports", type=int, default=4)
    ap.add_argument("--docs", type=int, default=8)
    ap.add_argument("--doc-tokens", type=int, default=256)
    ap.add_argument("--retrieve", type=int, default=4, help="documents per RAG prompt")
    ap.add_argument("--requests", type=int, default=12, help="TTFT prompts per mode")
    ap.add_argument("--burst", type=int, default=32, help="throughput prompts per mode")
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=16, help="generated tokens per throughput request")
    ap.add_argument("--threads", type=int, default=2, help="vLLM's CPU threads")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rope", choices=sorted(ROPES), default="default",
                    help="SmolLM2's weights with this rope (llama3: Llama 3.1's scaling, factor 8)")
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args(argv)

    import openai

    from promptcache import PromptCache
    from promptcache.integrations.vllm import kv_transfer_config
    from promptcache.models.smollm2 import ensure_smollm2

    work = Path(tempfile.mkdtemp(prefix="bench_vllm-"))
    model_dir = ensure_smollm2()
    if ROPES[args.rope]:
        model_dir = rope_variant(model_dir, work / f"smollm2-{args.rope}", ROPES[args.rope])
    pc = PromptCache.from_pretrained(model_dir)
    folder = pc.compile(make_schema(pc.tokenizer, args.modules, args.module_tokens), work / "notes")
    store = make_store(pc, work / "docs", args.docs, args.doc_tokens)
    sets = {"modules": lambda n, seed, tag: requests_for(pc, make_prompts(n, args.modules, args.imports, seed, tag)),
            "documents": lambda n, seed, tag: requests_for(store, make_questions(n, args.docs, args.retrieve, seed,
                                                                                  tag))}
    timed = {w: sets[w](args.requests, args.seed, "t") for w in WORKLOADS}
    burst = {w: sets[w](args.burst, args.seed + 1, "b") for w in WORKLOADS}
    warm = {w: sets[w](1, args.seed + 2, "w") for w in WORKLOADS}
    venv = vllm_venv()
    run = types.SimpleNamespace(threads=args.threads, model_dir=str(model_dir))
    config = kv_transfer_config([folder], [store.path])
    with Running(server(config, venv, extra=("--max-num-seqs", str(args.concurrency))), run,
                 work / "vllm.log") as running:
        client = openai.OpenAI(base_url=running.url, api_key="none", max_retries=0, timeout=1800)
        times, rates = {}, {}
        for w in WORKLOADS:
            for mode in MODES:
                one(client, warm[w][mode][0], 1)
            times[w] = ttft(client, timed[w])
            rates[w] = {mode: throughput(client, burst[w][mode], args.concurrency, args.max_tokens) for mode in MODES}
        running.stop()
    rows = [row(args, w, mode, timed[w][mode], times[w][mode], rates[w][mode]) for w in WORKLOADS for mode in MODES]
    for w in WORKLOADS:
        c, p = (r for r in rows if r["workload"] == w)
        print(f"{w}: TTFT p50: connector {c['ttft_p50_s']:.3f} s, plain vLLM {p['ttft_p50_s']:.3f} s: "
              f"{p['ttft_p50_s'] / c['ttft_p50_s']:.1f}x faster with the connector (cached tokens per prompt "
              f"{c['cached_tokens_mean']} vs {p['cached_tokens_mean']} of {c['prompt_tokens']})")
        print(f"{w}: throughput at {args.concurrency} concurrent: connector {c['requests_per_s']:.2f} req/s, plain "
              f"{p['requests_per_s']:.2f} req/s: {c['requests_per_s'] / p['requests_per_s']:.1f}x")
    save_table("bench_vllm" if args.rope == "default" else f"bench_vllm_{args.rope}", rows, args.out, plot)
    return rows


def row(args, workload: str, mode: str, requests: list[dict], times: list[tuple], rate: tuple) -> dict:
    secs = sorted(t for t, _, _ in times)
    return {"workload": workload, "mode": mode, "rope": args.rope, "modules": args.modules,
            "module_tokens": args.module_tokens,
            "imports": args.imports, "docs": args.docs, "doc_tokens": args.doc_tokens, "retrieve": args.retrieve,
            "prompt_tokens": round(statistics.mean(len(r["prompt"]) for r in requests)),
            "cached_tokens_mean": round(statistics.mean(c for _, c, _ in times)),
            "ttft_p50_s": round(statistics.median(secs), 4),
            "ttft_p90_s": round(secs[min(len(secs) - 1, int(0.9 * len(secs)))], 4),
            "concurrency": args.concurrency, "requests_per_s": round(rate[0], 3), "tokens_per_s": round(rate[1], 2),
            "requests": args.requests, "burst": args.burst}


if __name__ == "__main__":
    main()
