"""Encoding cost: encoding a schema vs one plain prefill of the same number of tokens.

    python -m eval.bench_encode [--model embedded:bench] [--tokens 2048 8192] [--members 4] [--repeats 2] [--threads 1]

The schema: a system prompt, documents, and a union of ``--members`` alternatives (each about
5% of the schema) in the middle, so encoding runs the default pass in chunks and then the union's
other members batched on the shared prefix, plus the documents after the union once per member
(their context differs). The reference is one plain prefill (the stock model, ordinary KV cache,
last-token logits) of as many tokens as encoding runs through the model (progress reports that
total). Target: encoding <= 1.10x the plain prefill. Runs alternate (encode, prefill, ...) and
report medians; each encode runs in a new namespace of one engine (nothing stored yet; the
engine's one-time model fingerprint, a hash of the weights, is paid in the warm-up, not timed).

Writes encode.csv to ``--out``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

import torch

from .common import RESULTS, add_model_args, write_csv

from promptcache import PromptCache, bench
from promptcache.engine import EngineConfig, RunnerConfig
from promptcache.models.loading import load_model


def build_schema(tok, tokens: int, members: int) -> str:
    """About ``tokens`` tokens: documents, a union of ``members`` variants, more documents."""
    per_member = max(8, tokens // 20)
    variants = "".join(f'<module name="v{i}">{bench.sentences(per_member, seed=300 + i)}</module>'
                       for i in range(members))
    union = f'<union scaffold="v0">{variants}</union>' if members > 1 else ""
    rest = max(16, tokens - per_member)
    docs = [f'<module name="d{i}">{bench.sentences(rest // 8, seed=400 + i)}</module>' for i in range(8)]
    body = "".join(docs[:4]) + union + "".join(docs[4:])
    return f'<schema name="enc"><system>{bench.sentences(30, seed=2)}</system><user>{body}</user></schema>'


def measure(model, tok, tokens: int, members: int, repeats: int, kv_dtype: str | None) -> dict:
    schema = build_schema(tok, tokens, members)
    config = EngineConfig(runner=RunnerConfig(kv_dtype=kv_dtype))
    total = {}

    pc = PromptCache(model, tok, config)
    runs = iter(range(1 << 30))

    def encode():
        ns = f"run{next(runs)}"  # a new namespace: nothing of it is stored yet, so everything is encoded
        t0 = time.perf_counter()
        entry = pc.add_schema(schema, progress=lambda done, n: total.update(n=n), namespace=ns)
        dt = time.perf_counter() - t0
        total["stored"] = entry.stored_tokens
        pc.clear_buffers()
        return dt

    encode()  # warm-up (and the engine's one-time model fingerprint: a hash of the weights); the token total
    ids = bench_ids(pc, total["n"])
    enc, plain = [], []
    for _ in range(repeats):
        enc.append(encode())
        t0 = time.perf_counter()
        pc.runner.prefill_plain(ids)
        plain.append(time.perf_counter() - t0)
    e, p = statistics.median(enc), statistics.median(plain)
    load = round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else ""
    return dict(schema_tokens=tokens, union_members=members, kv_dtype=kv_dtype or "model",
                tokens_run=total["n"], stored_tokens=total["stored"], encode_s=round(e, 4),
                plain_prefill_s=round(p, 4), encode_vs_prefill=round(e / p, 3), load=load)


def bench_ids(pc: PromptCache, n: int) -> list[int]:
    """``n`` token ids of filler text (the plain prefill's input)."""
    ids = pc.tokenizer.encode(bench.sentences(n, seed=5), add_special_tokens=False)
    while len(ids) < n:
        ids = ids + ids
    return ids[:n]


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_args(ap, "embedded:bench")
    ap.add_argument("--tokens", type=int, nargs="+", default=[2048, 8192])
    ap.add_argument("--members", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--kv-dtype", default=None, choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    model, tok = load_model(args.model, device=args.device, dtype=args.dtype)
    rows = []
    for n in args.tokens:
        r = measure(model, tok, n, args.members, args.repeats, args.kv_dtype)
        rows.append(dict(model=args.model, device=args.device, dtype=args.dtype, **r))
        print(f"{r['schema_tokens']:6d} schema tokens ({r['tokens_run']} run, union of {args.members}): encode "
              f"{r['encode_s']:.2f} s, one plain prefill of {r['tokens_run']} tokens {r['plain_prefill_s']:.2f} s: "
              f"{r['encode_vs_prefill']:.2f}x (load {r['load']})")
    print(f"wrote {write_csv('encode.csv', rows, args.out)}")
    return rows


if __name__ == "__main__":
    main()
