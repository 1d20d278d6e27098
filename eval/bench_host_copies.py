"""GPU: TTFT with module states in device memory vs host memory, host copies overlapped with the
forward (``EngineConfig.runner.overlap_copies``, the default) or enqueued before it.

    python -m eval.bench_host_copies --device cuda --dtype bfloat16 [--model embedded:1b]
                                     [--schema-tokens 8000] [--new-tokens 16 256 1024 2048]

One run: three engines on one model (device tier; host tier overlapped; host tier serial), every
prompt copies every module (placement forgotten before each call); rounds alternate the engines
and report medians. Writes host_copies.csv to ``--out``. Needs a GPU (on a CPU host and device
memory are one tier).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

from .common import RESULTS, add_model_args, text_of_tokens, write_csv

from promptcache import PromptCache
from promptcache.engine import EngineConfig, RunnerConfig, StoreConfig
from promptcache.models.loading import load_model

ENGINES = {"device": EngineConfig(), "host_overlap": EngineConfig(store=StoreConfig(device_budget=0)),
           "host_serial": EngineConfig(runner=RunnerConfig(overlap_copies=False), store=StoreConfig(device_budget=0))}


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_args(ap, "embedded:1b")
    ap.add_argument("--schema-tokens", type=int, default=8000)
    ap.add_argument("--new-tokens", type=int, nargs="+", default=[16, 256, 1024, 2048])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args(argv)
    if not args.device.startswith("cuda"):
        sys.exit("bench_host_copies needs --device cuda (on a CPU host and device memory are one tier)")
    model, tok = load_model(args.model, device=args.device, dtype=args.dtype)
    docs = [text_of_tokens(tok, args.schema_tokens // 8, seed=i) for i in range(8)]
    schema = '<schema name="p">' + "".join(f'<module name="d{i}">{d}</module>' for i, d in enumerate(docs)) + "</schema>"
    engines = {name: PromptCache(model, tok, cfg) for name, cfg in ENGINES.items()}
    for e in engines.values():
        e.add_schema(schema)

    def timed(e, prompt):
        e.forget_placement()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        res = e.prefill(prompt)
        torch.cuda.synchronize()
        return time.perf_counter() - t0, res

    rows = []
    for new in args.new_tokens:
        prompt = '<prompt schema="p">' + "".join(f"<d{i}/>" for i in range(8)) + f" {text_of_tokens(tok, new, 99)}</prompt>"
        for e in engines.values():
            timed(e, prompt)  # warm-up: this shape's attention plans
        times = {name: [] for name in engines}
        for _ in range(args.repeats):
            for name, e in engines.items():
                times[name].append(timed(e, prompt)[0])
        res = timed(engines["host_overlap"], prompt)[1]
        med = {name: statistics.median(t) for name, t in times.items()}
        row = dict(model=args.model, dtype=args.dtype, cached_tokens=res.cached_tokens, new_tokens=res.new_tokens,
                   host_bytes=res.bytes_copied, **{f"{k}_ms": round(v * 1e3, 2) for k, v in med.items()},
                   serial_over_overlap=round(med["host_serial"] / med["host_overlap"], 3),
                   host_overlap_over_device=round(med["host_overlap"] / med["device"], 3))
        rows.append(row)
        print(f"{res.cached_tokens} cached + {res.new_tokens} new ({res.bytes_copied / 2**20:.0f} MiB from host): "
              f"device {med['device'] * 1e3:.1f} ms, host overlapped {med['host_overlap'] * 1e3:.1f} ms, "
              f"host serial {med['host_serial'] * 1e3:.1f} ms; serial / overlapped {row['serial_over_overlap']:.2f}, "
              f"overlapped / device {row['host_overlap_over_device']:.2f}")
    print(f"wrote {write_csv('host_copies.csv', rows, args.out)}")
    return rows


if __name__ == "__main__":
    main()
