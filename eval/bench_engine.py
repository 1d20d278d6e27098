"""Engine benchmark: TTFT of Prompt Cache vs full prefill vs the limit, and stored bytes/token.

    python eval/bench_engine.py [--model embedded:bench] [--schema-tokens 2000] [--new-tokens 32]

The limit is the forward of the new tokens alone on a ready, already assembled cache. Prints
ratios measured in this one run (medians after warm-up) and writes eval/results/engine.csv.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import median_time, sentences, write_csv  # noqa: E402

from promptcache import PromptCache  # noqa: E402
from promptcache.models.loading import load_model  # noqa: E402


def build_schema(tok, target_tokens: int, modules: int = 8) -> str:
    system = sentences(40, seed=1)
    per = max(1, target_tokens // modules)
    docs = []
    for i in range(modules):
        words = per
        text = sentences(words, seed=100 + i)
        while len(tok.encode(text, add_special_tokens=False)) > per:  # trim to ~per tokens
            words = int(words * 0.9)
            text = sentences(words, seed=100 + i)
        docs.append(f'<module name="doc{i}">{text}</module>')
    return f'<schema name="bench"><system>{system}</system><user>{"".join(docs)}</user></schema>'


def build_prompt(tok, modules: int, new_tokens: int) -> str:
    words = new_tokens
    while True:
        q = sentences(words, seed=7)
        if len(tok.encode(" " + q, add_special_tokens=False)) <= new_tokens - 8 or words <= 1:
            break
        words -= 1
    refs = "".join(f"<doc{i}/>" for i in range(modules))
    return f'<prompt schema="bench">{refs} {q}</prompt>'


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="embedded:bench")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--schema-tokens", type=int, default=2000)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=10)
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    model, tok = load_model(args.model, device=args.device, dtype=args.dtype)
    pc = PromptCache(model, tok)
    schema = build_schema(tok, args.schema_tokens)
    t0 = time.perf_counter()
    entry = pc.add_schema(schema)
    encode_s = time.perf_counter() - t0
    prompt = build_prompt(tok, 8, args.new_tokens)
    res = pc.prefill(prompt)
    n_cached, n_new = res.cached_tokens, res.new_tokens
    assert res.new_tokens <= args.new_tokens + 8, res.new_tokens

    full = median_time(lambda: pc.prefill_baseline(prompt), repeats=max(3, args.repeats // 3))

    def cold():  # nothing reusable: a fresh buffer, every module copied
        pc._pool.clear()
        return pc.prefill(prompt)

    def copy_all():  # a reused buffer, every module copied (e.g. a prompt with other modules before)
        for c in pc._pool._free:
            c.resident = {}
        return pc.prefill(prompt)

    t_cold = median_time(cold, repeats=args.repeats)
    t_copy = median_time(copy_all, repeats=args.repeats)
    t_warm = median_time(lambda: pc.prefill(prompt), repeats=args.repeats)
    copied_warm = pc.prefill(prompt).bytes_copied
    copied_copy = copy_all().bytes_copied

    kept = pc.prefill(prompt, keep_cache=True)
    cache, layout = kept.cache, kept.layout
    ids = torch.tensor([[t for s in layout.new for t in s.token_ids]], device=pc.device)
    pos = torch.tensor([[p for s in layout.new for p in s.position_ids]], device=pc.device)

    def limit_once():
        cache.set_length(n_cached)
        pc.adapter.forward(ids, pos, cache)
        if pc.device.type == "cuda":
            torch.cuda.synchronize()

    limit = median_time(limit_once, repeats=args.repeats)
    layout_s = median_time(lambda: pc.layout(prompt), repeats=args.repeats)
    per_token = entry.stored_bytes / entry.stored_tokens
    theory = pc.spec.bytes_per_token
    rows = [{
        "model": args.model, "device": args.device, "dtype": args.dtype, "cached_tokens": n_cached,
        "new_tokens": n_new, "encode_s": round(encode_s, 4), "ttft_full_s": round(full, 5),
        "ttft_cold_s": round(t_cold, 5), "ttft_copy_s": round(t_copy, 5), "ttft_inplace_s": round(t_warm, 5),
        "ttft_limit_s": round(limit, 5), "layout_s": round(layout_s, 5),
        "speedup_cold": round(full / t_cold, 2), "speedup_copy": round(full / t_copy, 2),
        "speedup_inplace": round(full / t_warm, 2), "limit_ratio_cold": round(t_cold / limit, 3),
        "limit_ratio_copy": round(t_copy / limit, 3), "limit_ratio_inplace": round(t_warm / limit, 3),
        "bytes_copied_copy": copied_copy, "bytes_copied_inplace": copied_warm,
        "bytes_per_token": per_token, "theory_bytes_per_token": theory,
    }]
    path = write_csv("engine.csv", rows)
    print(f"model {args.model} on {args.device} ({args.dtype}); {n_cached} cached + {n_new} new tokens")
    print(f"encode schema once:              {encode_s:8.3f} s")
    print(f"TTFT full prefill:               {full * 1e3:8.1f} ms")
    for label, t in (("cold (fresh buffer, copy all)", t_cold), ("copy all into reused buffer", t_copy),
                     ("modules already in place", t_warm)):
        print(f"TTFT Prompt Cache, {label:30s} {t * 1e3:8.1f} ms  {full / t:6.1f}x faster than full, "
              f"{t / limit:.2f}x the limit")
    print(f"TTFT limit (new tokens only):    {limit * 1e3:8.1f} ms")
    print(f"  layout/parse per prompt:       {layout_s * 1e3:8.2f} ms")
    print(f"  bytes copied: {copied_copy / 2**20:.1f} MiB when copying all, {copied_warm} when in place")
    print(f"stored bytes per token:  {per_token:.0f} (theory {theory}, {100 * (per_token / theory - 1):+.2f}%)")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
