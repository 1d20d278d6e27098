"""Storage benchmark: loading a compiled schema vs encoding it again; bytes copied per prompt
with and without in-place reuse; TTFT with modules in host vs device memory (GPU only).

    python -m eval.bench_store [--model embedded:bench] [--schema-tokens 4000]

Prints ratios measured in this one run and writes eval/results/store.csv.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path


from .common import add_model_args, write_csv

from promptcache import PromptCache
from promptcache.bench import build_schema, median_time, sentences
from promptcache.engine import EngineConfig, RunnerConfig, StoreConfig
from promptcache.models.loading import load_model


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_args(ap, "embedded:bench")
    ap.add_argument("--schema-tokens", type=int, default=4000)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args(argv)
    model, tok = load_model(args.model, device=args.device, dtype=args.dtype)
    schema = build_schema(tok, args.schema_tokens)
    with tempfile.TemporaryDirectory() as tmp:
        art = Path(tmp) / "bench"
        t0 = time.perf_counter()
        PromptCache(model, tok).compile(schema, art)
        compile_s = time.perf_counter() - t0
        encode = median_time(lambda: PromptCache(model, tok).add_schema(schema), args.repeats, warmup=0)
        load_lazy = median_time(lambda: PromptCache(model, tok).load_compiled(art), args.repeats, warmup=0)
        load_full = median_time(lambda: PromptCache(model, tok).load_compiled(art, verify=True), args.repeats,
                                warmup=0)
        disk_bytes = sum(p.stat().st_size for p in art.iterdir())

    pc = PromptCache(model, tok)
    entry = pc.add_schema(schema)
    prompts = [f'<prompt schema="bench">{"".join(f"<doc{i}/>" for i in range(8))} {sentences(20, seed=k)}</prompt>'
               for k in range(args.prompts)]
    prompts += [p.replace("<doc7/>", "") for p in prompts[:2]]  # a prompt that drops one module
    reuse = [pc.prefill(p).bytes_copied for p in prompts]
    no_reuse = []
    for p in prompts:
        pc.clear_buffers()
        no_reuse.append(pc.prefill(p).bytes_copied)

    rows = {"model": args.model, "device": args.device, "schema_tokens": entry.stored_tokens,
            "compile_s": round(compile_s, 3), "encode_s": round(encode, 3), "load_lazy_s": round(load_lazy, 4),
            "load_verified_s": round(load_full, 4), "load_speedup_lazy": round(encode / load_lazy, 1),
            "load_speedup_verified": round(encode / load_full, 1), "artifact_bytes": disk_bytes,
            "bytes_copied_with_reuse": sum(reuse), "bytes_copied_without_reuse": sum(no_reuse)}
    print(f"model {args.model} on {args.device}; schema of {entry.stored_tokens} stored tokens "
          f"({entry.stored_bytes / 2**20:.0f} MiB of states, artifact {disk_bytes / 2**20:.0f} MiB on disk)")
    print(f"compile (encode + write):           {compile_s:8.2f} s")
    print(f"encode again:                       {encode:8.2f} s")
    print(f"load compiled, states read lazily:  {load_lazy:8.3f} s   ({encode / load_lazy:.0f}x faster than encoding)")
    print(f"load compiled, all states verified: {load_full:8.3f} s   ({encode / load_full:.1f}x faster than encoding)")
    print(f"bytes copied over {len(prompts)} prompts sharing modules: {sum(reuse) / 2**20:.0f} MiB with reuse, "
          f"{sum(no_reuse) / 2**20:.0f} MiB without (per prompt with reuse: "
          f"{', '.join(f'{b / 2**20:.0f}' for b in reuse)} MiB)")
    if args.device.startswith("cuda"):
        prompt = prompts[0]
        dev = PromptCache(model, tok)
        dev.add_schema(schema)
        host = PromptCache(model, tok, EngineConfig(store=StoreConfig(device_budget=0)))
        host.add_schema(schema)
        serial = PromptCache(model, tok, EngineConfig(runner=RunnerConfig(overlap_copies=False), store=StoreConfig(device_budget=0)))
        serial.add_schema(schema)

        def cold(engine):
            engine.clear_buffers()
            return engine.prefill(prompt)

        t = {}
        for _ in range(3):  # rounds alternate the engines, so drift falls on all of them alike
            for name, fn in (("device", lambda: cold(dev)), ("host", lambda: cold(host)),
                             ("host_serial", lambda: cold(serial)), ("in_place", lambda: dev.prefill(prompt)),
                             ("full", lambda: dev.prefill_baseline(prompt))):
                t.setdefault(name, []).append(median_time(fn, repeats=10))
        t = {name: sorted(v)[1] for name, v in t.items()}
        host.clear_buffers()
        copied = host.prefill(prompt).bytes_copied
        rows.update({f"ttft_{name}_s": round(v, 5) for name, v in t.items()}, host_bytes_copied=copied)
        full = t["full"]
        print(f"TTFT full prefill:                                {full * 1e3:7.1f} ms")
        print(f"TTFT modules in device memory, copied:            {t['device'] * 1e3:7.1f} ms "
              f"({full / t['device']:.1f}x faster than full prefill)")
        print(f"TTFT modules in device memory, already in place:  {t['in_place'] * 1e3:7.1f} ms "
              f"({full / t['in_place']:.1f}x)")
        print(f"TTFT modules in host memory, overlapped copies:   {t['host'] * 1e3:7.1f} ms "
              f"({full / t['host']:.1f}x; {copied / 2**20:.0f} MiB host->device)")
        print(f"TTFT modules in host memory, copies before compute: {t['host_serial'] * 1e3:5.1f} ms "
              f"({full / t['host_serial']:.1f}x; overlap gains {t['host_serial'] / t['host']:.2f}x)")
    else:
        print("TTFT host vs device tier: needs a GPU (on CPU the device tier is host memory)")
    print(f"wrote {write_csv('store.csv', [rows])}")


if __name__ == "__main__":
    main()
