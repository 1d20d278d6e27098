"""Engine benchmark: TTFT of Prompt Cache vs full prefill vs the limit, and stored bytes/token.

    python eval/bench_engine.py [--model embedded:bench] [--schema-tokens 2000] [--new-tokens 32]

The same benchmark as ``promptcache bench`` (``promptcache/bench.py``); this script also writes
eval/results/engine.csv.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path


sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import add_model_args, write_csv  # noqa: E402

from promptcache import PromptCache, bench  # noqa: E402
from promptcache.models.loading import load_model  # noqa: E402

build_schema = bench.build_schema  # used by bench_store.py


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_args(ap, "embedded:bench")
    ap.add_argument("--schema-tokens", type=int, default=2000)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=10)
    args = ap.parse_args(argv)
    model, tok = load_model(args.model, device=args.device, dtype=args.dtype)
    res = bench.run(PromptCache(model, tok), args.schema_tokens, args.new_tokens, args.repeats)
    print(f"model {args.model} on {args.device} ({args.dtype})")
    print("\n".join(res.lines()))
    row = {"model": args.model, "device": args.device, "dtype": args.dtype, **dataclasses.asdict(res)}
    print(f"wrote {write_csv('engine.csv', [row])}")


if __name__ == "__main__":
    main()
