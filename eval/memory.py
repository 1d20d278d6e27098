"""Memory study: bytes per cached token per model config, host/device peaks, artifact size on disk.

    python -m eval.memory [--model embedded:bench] [--tokens 2048] [--out eval/results]

1. Bytes per cached token, theory from the config (2 * layers * kv_heads * head_dim * dtype size)
   and measured from the states the engine stored, for tiny random models of several attention
   layouts (MHA, GQA, MQA) and dtypes; theory only for a few well-known configs (no weights).
2. On ``--model``: peak host memory (VmHWM from /proc/self/status, reset before each phase
   through /proc/self/clear_refs) and peak device memory (torch.cuda.max_memory_allocated) while
   encoding a schema of ``--tokens`` tokens, serving a prompt with Prompt Cache, and serving it
   with full prefill; and the size on disk of the compiled artifact (``PromptCache.compile``, or
   the stored tensors saved with safetensors where the engine has no compile).

3. Resident memory against theory (``--resident 2048 8192``, off by default; one fresh subprocess per schema size
   and stored dtype): the process's resident set before the model (torch imported), after
   loading it, after encoding a schema (with the engine's prewarmed first-prompt buffer, and
   without it: ``clear_buffers``), and the peak of a prompt. Theory: model parameters + stored
   states (+15% allowed) after encoding; a prompt's peak may add its assembled cache and one
   forward's activations (measured alone: the forward of the new tokens on a ready cache).

Writes memory_bytes_per_token.csv, memory_peaks.csv and memory_resident.csv to ``--out``.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import re
import subprocess
import tempfile
from pathlib import Path

import torch

from .common import RESULTS, add_model_args, child_command, text_of_tokens, write_csv

from promptcache import PromptCache
from promptcache.models.embedded import embedded_tokenizer
from promptcache.models.loading import load_model

MIB = 2**20
TINY = dict(vocab_size=4096, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=8,
            max_position_embeddings=4096, bos_token_id=2, eos_token_id=3, pad_token_id=1)


def _tiny_configs():
    """(name, attention layout, dtype, config) of tiny models measured through the engine."""
    from transformers import FalconConfig, GPT2Config, LlamaConfig

    falcon = dict(vocab_size=4096, hidden_size=128, num_hidden_layers=2, num_attention_heads=8,
                  new_decoder_architecture=False, parallel_attn=True, alibi=False, bias=False,
                  bos_token_id=2, eos_token_id=3, pad_token_id=1)
    return [
        ("llama", "MHA", "float32", LlamaConfig(**TINY, num_key_value_heads=8)),
        ("llama", "MHA", "float16", LlamaConfig(**TINY, num_key_value_heads=8)),
        ("llama", "MHA", "bfloat16", LlamaConfig(**TINY, num_key_value_heads=8)),
        ("llama", "GQA", "float32", LlamaConfig(**TINY, num_key_value_heads=2)),
        ("llama", "GQA", "bfloat16", LlamaConfig(**TINY, num_key_value_heads=2)),
        ("llama", "MQA", "float32", LlamaConfig(**TINY, num_key_value_heads=1)),
        ("falcon", "MQA", "float32", FalconConfig(**falcon, multi_query=True)),
        ("gpt2", "MHA", "float32", GPT2Config(vocab_size=4096, n_embd=128, n_layer=2, n_head=8, n_positions=4096,
                                             bos_token_id=2, eos_token_id=3, pad_token_id=1)),
    ]


def _known_configs():
    """Published shapes of a few models (config objects only: nothing is downloaded or allocated)."""
    from transformers import FalconConfig, LlamaConfig, Qwen2Config

    return [
        ("Llama-2-7B", "MHA", "float16", LlamaConfig(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32,
                                                     num_key_value_heads=32)),
        ("Llama-3-8B", "GQA", "bfloat16", LlamaConfig(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32,
                                                      num_key_value_heads=8)),
        ("Qwen2.5-0.5B", "GQA", "bfloat16", Qwen2Config(hidden_size=896, num_hidden_layers=24, num_attention_heads=14,
                                                        num_key_value_heads=2)),
        ("SmolLM2-135M", "GQA", "bfloat16", LlamaConfig(hidden_size=576, num_hidden_layers=30, num_attention_heads=9,
                                                        num_key_value_heads=3)),
        ("Falcon-7B", "MQA", "bfloat16", FalconConfig(hidden_size=4544, num_hidden_layers=32, num_attention_heads=71,
                                                      multi_query=True, new_decoder_architecture=False)),
    ]


def kv_shape(config) -> tuple[int, int, int]:
    """(layers, kv_heads, head_dim) read from a transformers config, independent of the engine."""
    get = lambda *names: next(getattr(config, n) for n in names if getattr(config, n, None) is not None)  # noqa: E731
    layers = get("num_hidden_layers", "n_layer", "num_layers")
    heads = get("num_attention_heads", "n_head")
    if config.model_type == "falcon":
        kv = config.num_kv_heads if config.new_decoder_architecture else 1 if config.multi_query else heads
    else:
        kv = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or get("hidden_size", "n_embd") // heads
    return layers, kv, head_dim


def theory_bytes_per_token(config, dtype: str) -> int:
    layers, kv, head_dim = kv_shape(config)
    return 2 * layers * kv * head_dim * torch.empty((), dtype=getattr(torch, dtype)).element_size()


def stored_states(pc: PromptCache, entry) -> dict[int, torch.Tensor]:
    """The engine's stored tensors of a schema, span index -> [L, 2, H, n, D]."""
    if hasattr(entry, "keys") and hasattr(pc, "store"):
        return {i: pc.store.get(k)[0] for i, k in entry.keys.items()}
    return dict(entry.kv)  # engines before the tiered store


def measured_bytes_per_token(pc: PromptCache, entry) -> float:
    states = stored_states(pc, entry)
    return sum(t.numel() * t.element_size() for t in states.values()) / sum(t.shape[3] for t in states.values())


def bytes_per_token_rows(tokens: int) -> list[dict]:
    from transformers import AutoModelForCausalLM

    tok, rows = embedded_tokenizer(), []
    schema = f'<schema name="m"><module name="a">{text_of_tokens(tok, tokens, 3)}</module></schema>'
    for name, kind, dtype, config in _tiny_configs():
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config).to(getattr(torch, dtype)).eval()
        pc = PromptCache(model, tok)
        entry = pc.add_schema(schema)
        rows.append(_row(name, kind, dtype, config, measured_bytes_per_token(pc, entry)))
    rows += [_row(name, kind, dtype, config, None) for name, kind, dtype, config in _known_configs()]
    return rows


def _row(name, kind, dtype, config, measured) -> dict:
    layers, kv, head_dim = kv_shape(config)
    theory = theory_bytes_per_token(config, dtype)
    return dict(model=name, attention=kind, dtype=dtype, layers=layers, kv_heads=kv, head_dim=head_dim,
                theory_bytes_per_token=theory, measured_bytes_per_token="" if measured is None else measured,
                kib_per_token=round(theory / 1024, 2),
                mib_per_1k_tokens=round(theory * 1000 / MIB, 2))


# -- peaks ---------------------------------------------------------------------------------------
def _status_kib(field: str) -> int | None:
    try:
        m = re.search(rf"^{field}:\s+(\d+) kB", Path("/proc/self/status").read_text(), re.M)
    except OSError:
        return None
    return int(m.group(1)) if m else None


def _malloc_trim() -> None:
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


class Peak:
    """Peak host (resident set) and device memory over a block, above what was in use at its start."""

    reset_ok = True

    def __enter__(self):
        gc.collect()
        _malloc_trim()  # hand freed heap back to the OS, so reuse of it shows as growth again
        try:
            Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current VmRSS
        except OSError:
            Peak.reset_ok = False
        self.rss0 = _status_kib("VmRSS")
        if torch.cuda.is_available():
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.dev0 = torch.cuda.memory_allocated()
        return self

    def __exit__(self, *exc):
        hwm = _status_kib("VmHWM")
        self.host = None if hwm is None or self.rss0 is None else (hwm - self.rss0) * 1024
        self.device = None
        if torch.cuda.is_available():
            torch.cuda.synchronize()
            self.device = torch.cuda.max_memory_allocated() - self.dev0
        return False


def build_study(tok, tokens: int, new_tokens: int, module_tokens: int = 256) -> tuple[str, str]:
    mods, n = [], 0
    while n < tokens:
        k = min(module_tokens, tokens - n)
        mods.append(f'<module name="d{len(mods)}">{text_of_tokens(tok, k, 50 + len(mods))}</module>')
        n += k
    schema = f'<schema name="mem">{" ".join(mods)}</schema>'
    refs = "".join(f"<d{i}/>" for i in range(len(mods)))
    return schema, f'<prompt schema="mem">{refs} {text_of_tokens(tok, new_tokens, 9)}</prompt>'


def artifact_bytes(pc: PromptCache, schema: str, entry, folder: Path) -> tuple[int, str]:
    """Bytes on disk of the schema's artifact, and how it was made."""
    if hasattr(pc, "compile"):
        pc.compile(schema, folder / "artifact")
        how = "PromptCache.compile"
    else:
        from safetensors.torch import save_file

        (folder / "artifact").mkdir()
        states = {f"span_{i}": t.contiguous().cpu() for i, t in stored_states(pc, entry).items()}
        save_file(states, str(folder / "artifact" / "states.safetensors"))
        how = "safetensors of the stored tensors (no compile API)"
    return sum(p.stat().st_size for p in (folder / "artifact").rglob("*") if p.is_file()), how


def peak_rows(args) -> list[dict]:
    model, tok = load_model(args.model, device=args.device, dtype=args.dtype)
    pc = PromptCache(model, tok)
    schema, prompt = build_study(tok, args.tokens, args.new_tokens)
    base = dict(model=args.model, device=args.device, dtype=args.dtype)
    rows = []

    def row(phase, peak, kv=None, disk=None, note=""):
        mib = lambda b: "" if b is None else round(b / MIB, 2)  # noqa: E731
        rows.append(dict(base, phase=phase, host_peak_mib=mib(peak.host) if peak else "",
                         device_peak_mib=mib(peak.device) if peak else "", kv_mib=mib(kv),
                         disk_mib=mib(disk), note=note))

    with Peak() as p:
        entry = pc.add_schema(schema)
    stored = sum(t.numel() * t.element_size() for t in stored_states(pc, entry).values())
    row(f"encode schema ({entry.stored_tokens} tokens)", p, stored, note="kv: the stored module states")
    with Peak() as p:
        res = pc.prefill(prompt, keep_cache=True)
    buf = res.cache.buf.numel() * res.cache.buf.element_size()
    pc.release(res)
    row(f"serve, Prompt Cache ({res.cached_tokens} cached + {res.new_tokens} new)", p, buf,
        note="first prompt; kv: the assembled cache buffer")
    with Peak() as p:
        pc.prefill(prompt)
    row("serve again, Prompt Cache (buffer reused)", p, 0)
    with Peak() as p:
        full = pc.prefill_baseline(prompt)
    kv = sum(t.numel() * t.element_size() for layer in full.cache.layers for t in (layer.keys, layer.values))
    row(f"serve, full prefill ({full.new_tokens} tokens)", p, kv, note="kv: the DynamicCache it returns")
    del full
    with tempfile.TemporaryDirectory() as tmp:
        disk, how = artifact_bytes(pc, schema, entry, Path(tmp))
    row("artifact on disk", None, stored, disk, note=how)
    return rows


# -- resident memory vs theory ---------------------------------------------------------------------
def _rss() -> int:
    gc.collect()
    _malloc_trim()
    return (_status_kib("VmRSS") or 0) * 1024


def resident_one(model_name: str, tokens: int, kv_dtype: str | None, new_tokens: int = 32) -> dict:
    """In this (fresh) process: resident bytes at each step, and the theory they are held to."""
    from promptcache.engine import EngineConfig, RunnerConfig

    base = _rss()
    model, tok = load_model(model_name, device="cpu", dtype="float32")
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    loaded = _rss()
    pc = PromptCache(model, tok, EngineConfig(runner=RunnerConfig(kv_dtype=kv_dtype)))
    schema, prompt = build_study(tok, tokens, new_tokens)
    entry = pc.add_schema(schema)
    states = sum(t.numel() * t.element_size() for t in stored_states(pc, entry).values())
    encoded = _rss()
    pc.clear_buffers()
    states_only = _rss()
    with Peak() as p:
        res = pc.prefill(prompt, keep_cache=True)
    cache = res.cache.buf.numel() * res.cache.buf.element_size()
    new = res.layout.new
    ids = torch.tensor([[t for s in new for t in s.token_ids]])
    pos = torch.tensor([[q for s in new for q in s.position_ids]])
    with Peak() as f:  # one forward's activations alone, on the ready cache
        res.cache.set_length(res.cached_tokens)
        pc.adapter.forward(ids, pos, res.cache)
    pc.release(res)
    return dict(model=model_name, tokens=entry.stored_tokens, kv_dtype=kv_dtype or "model", base=base,
                model_bytes=model_bytes, states=states, after_load=loaded - base, after_encode=encoded - base,
                after_encode_no_buffer=states_only - base, prompt_peak=states_only - base + (p.host or 0),
                cache=cache, forward=f.host or 0)


def resident_rows(args) -> list[dict]:
    rows = []
    for tokens in args.resident:
        for kv in ("", "bfloat16"):
            cmd, env = child_command("eval.memory", "--resident-one", str(tokens), kv, "--model", args.model)
            out = subprocess.run(cmd, capture_output=True, text=True, check=True, env=env).stdout
            r = json.loads(out.strip().splitlines()[-1])
            theory = r["model_bytes"] + r["states"]
            engine = r["after_encode_no_buffer"] - r["after_load"]  # what encoding left resident
            r.update(theory=theory, engine_over_states=round(engine / r["states"], 3),
                     encode_vs_theory=round(r["after_encode_no_buffer"] / theory, 3),
                     encode_with_buffer_vs_theory=round(r["after_encode"] / theory, 3),
                     prompt_vs_theory=round(r["prompt_peak"] / (theory + r["cache"] + r["forward"]), 3))
            rows.append(r)
    return rows


def print_resident(rows: list[dict]) -> None:
    mib = lambda b: f"{b / MIB:8.1f}"  # noqa: E731
    print("\nresident MiB above the process's start (torch imported), fresh process per row:")
    print(f"  {'tokens':>6s} {'stored':>9s} {'model':>8s} {'loaded':>8s} {'states':>8s} {'encoded':>8s} "
          f"{'+buffer':>8s} {'x theory':>8s} {'prompt':>8s} {'cache':>8s} {'fwd':>8s} {'x theory':>8s}")
    for r in rows:
        print(f"  {r['tokens']:6d} {r['kv_dtype']:>9s} {mib(r['model_bytes'])} {mib(r['after_load'])} "
              f"{mib(r['states'])} {mib(r['after_encode_no_buffer'])} {mib(r['after_encode'])} "
              f"{r['encode_vs_theory']:8.3f} "
              f"{mib(r['prompt_peak'])} {mib(r['cache'])} {mib(r['forward'])} {r['prompt_vs_theory']:8.3f}")
    print("  theory after encoding: model + states (target <= 1.15x, without the prewarmed first-prompt buffer);"
          " a prompt: + its cache + one forward; 'loaded': resident after loading the model (imports included)")


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_args(ap, "embedded:bench")
    ap.add_argument("--tokens", type=int, default=2048, help="schema tokens for the peak study")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--config-tokens", type=int, default=64, help="schema tokens for the per-config study")
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--resident", type=int, nargs="*", default=[],
                    help="schema sizes for the resident-vs-theory study, e.g. 2048 8192 (default: skipped)")
    ap.add_argument("--resident-one", nargs=2, metavar=("TOKENS", "KV_DTYPE"), help=argparse.SUPPRESS)
    ap.add_argument("--skip-peaks", action="store_true", help="only the resident study")
    return ap.parse_args(argv)


def main(argv=None) -> tuple[list[dict], list[dict]]:
    args = parse_args(argv)
    if args.resident_one:
        print(json.dumps(resident_one(args.model, int(args.resident_one[0]), args.resident_one[1] or None)))
        return [], []
    if args.skip_peaks:
        rows = resident_rows(args)
        print_resident(rows)
        print(f"wrote {write_csv('memory_resident.csv', rows, args.out)}")
        return [], rows
    per_token = bytes_per_token_rows(args.config_tokens)
    print(f"{'model':14s} {'attn':4s} {'dtype':9s} {'L':>3s} {'kvH':>3s} {'hd':>4s} {'theory B/tok':>13s} "
          f"{'measured':>10s} {'MiB/1k tok':>10s}")
    for r in per_token:
        print(f"{r['model']:14s} {r['attention']:4s} {r['dtype']:9s} {r['layers']:3d} {r['kv_heads']:3d} "
              f"{r['head_dim']:4d} {r['theory_bytes_per_token']:13d} {str(r['measured_bytes_per_token']):>10s} "
              f"{r['mib_per_1k_tokens']:10.2f}")
    peaks = peak_rows(args)
    print(f"\npeaks on {args.model} ({args.device}, {args.dtype}); MiB above the phase's start:")
    for r in peaks:
        print(f"  {r['phase']:55s} host {str(r['host_peak_mib']):>8s}  device {str(r['device_peak_mib']):>8s}  "
              f"kv {str(r['kv_mib']):>8s}  disk {str(r['disk_mib']):>8s}  {r['note']}")
    if not Peak.reset_ok:
        print("note: /proc/self/clear_refs is not writable here: host peaks are since process start")
    a = write_csv("memory_bytes_per_token.csv", per_token, args.out)
    b = write_csv("memory_peaks.csv", peaks, args.out)
    print(f"wrote {a} and {b}")
    if args.resident:
        rows = resident_rows(args)
        print_resident(rows)
        print(f"wrote {write_csv('memory_resident.csv', rows, args.out)}")
    return per_token, peaks


if __name__ == "__main__":
    main()
