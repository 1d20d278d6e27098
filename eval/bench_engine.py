"""Engine benchmark: TTFT of Prompt Cache vs full prefill vs the limit, and stored bytes/token.

    python -m eval.bench_engine [--model embedded:bench] [--schema-tokens 2000] [--new-tokens 32]
                                [--threads 1] [--fresh-processes N]

The same benchmark as ``promptcache bench`` (``promptcache/bench.py``; methods timed round-robin);
this script also writes eval/results/engine.csv. ``--fresh-processes N`` adds the first prompt of
N fresh processes: each loads the model, encodes the schema, serves its first prompt, then times
the limit and the same prompt again, alternating (``bench.fresh_first_prompt``); written to
engine_fresh.csv with the ratio first prompt / limit per process.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import subprocess
from pathlib import Path

import torch

from .common import RESULTS, add_model_args, child_command, write_csv

from promptcache import PromptCache, bench
from promptcache.models.loading import load_model

build_schema = bench.build_schema  # used by bench_store.py


def fresh_processes(args) -> list[dict]:
    """``args.fresh_processes`` children of this script in ``--child`` mode, one after another."""
    cmd, env = child_command("eval.bench_engine", "--child", "--model", args.model, "--device", args.device, "--dtype",
                     args.dtype, "--schema-tokens", str(args.schema_tokens), "--new-tokens", str(args.new_tokens),
                     "--threads", str(args.threads))
    rows = []
    for i in range(args.fresh_processes):
        out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env).stdout
        r = json.loads(out.strip().splitlines()[-1])
        r["first_vs_limit"] = round(r["first_s"] / r["limit_s"], 3)
        r["inplace_vs_limit"] = round(r["inplace_s"] / r["limit_s"], 3)
        rows.append(dict(process=i, **r))
        print(f"fresh process {i}: {r['cached_tokens']} cached tokens, first prompt {r['first_s'] * 1e3:.1f} ms "
              f"({r['first_bytes_copied']} bytes copied), limit {r['limit_s'] * 1e3:.1f} ms: "
              f"{r['first_vs_limit']:.2f}x the limit; again in place {r['inplace_vs_limit']:.2f}x (load {r['load']})",
              flush=True)
    return rows


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_args(ap, "embedded:bench")
    ap.add_argument("--schema-tokens", type=int, default=2000)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default); 1 is steadier "
                                                           "on a shared machine")
    ap.add_argument("--fresh-engines", type=int, default=1, help="first prompts of a fresh engine (each re-encodes)")
    ap.add_argument("--fresh-processes", type=int, default=0, help="also time the first prompt of N fresh processes")
    ap.add_argument("--skip-bench", action="store_true", help="only the fresh processes")
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    model, tok = load_model(args.model, device=args.device, dtype=args.dtype)
    if args.child:  # one fresh process's first prompt: JSON on the last line
        r = bench.fresh_first_prompt(PromptCache(model, tok), args.schema_tokens, args.new_tokens)
        print(json.dumps(dict(r, load=bench.load_avg())))
        return
    if not args.skip_bench:
        res = bench.run(PromptCache(model, tok), args.schema_tokens, args.new_tokens, args.repeats,
                        fresh_engines=args.fresh_engines)
        print(f"model {args.model} on {args.device} ({args.dtype}), {torch.get_num_threads()} threads")
        print("\n".join(res.lines()))
        row = {"model": args.model, "device": args.device, "dtype": args.dtype, "threads": torch.get_num_threads(),
               **dataclasses.asdict(res)}
        print(f"wrote {write_csv('engine.csv', [row], args.out)}")
    if args.fresh_processes:
        rows = fresh_processes(args)
        print(f"fresh processes: first prompt / limit median {statistics.median(r['first_vs_limit'] for r in rows):.2f}")
        print(f"wrote {write_csv('engine_fresh.csv', rows, args.out)}")
        return rows
    return []


if __name__ == "__main__":
    main()
