"""TTFT study: full prefill vs prefix reuse vs Prompt Cache vs the limit, over prompt length and cached fraction.

    python -m eval.ttft [--model embedded:bench] [--lengths 512 1024 2048 4096 8192]
                        [--fractions 0.5 0.9 0.99] [--threads 1] [--quick] [--out eval/results]

Scenario (one schema per length L): anonymous preamble text (``--change-at`` of L), a union of
two variants (``v0`` scaffold, ``v1``), then document modules. The previous request imported
``v0`` and every document; the measured prompt imports ``v1`` and the documents that make up the
cached fraction ``f`` of L, plus ``(1 - f) L`` tokens of new text. Methods, all in one process on
one model:

  full      full prefill of the prompt's tokens (``pc.prefill_baseline``)
  prefix    vLLM/SGLang-style prefix caching: the previous request's KV is kept; the prompt
            reuses its longest common token prefix (the preamble: it stops at the changed
            variant) and runs the rest through the stock model with a DynamicCache
  pc_device Prompt Cache, module states in device memory, every module copied into the buffer
  pc_device_inplace  the same prompt again: modules already in place in the reused buffer
            (at the engine's default ``recompute="auto"``: the prompt drifts, so a budget of its
            drifted tokens is recomputed)
  pc_r0_inplace      the same at ``recompute=0`` (the paper's splice, nothing recomputed)
  pc_host   Prompt Cache with ``EngineConfig(store=StoreConfig(device_budget=0))`` (states in host memory), if the
            engine has that option
  limit     the true limit: the forward of the new tokens alone on an already assembled,
            preallocated cache computing logits for the last token only (no concatenation, no
            copy, no store lookup); pc/limit is what assembling a prompt costs on top

Writes ttft.csv, ttft_exponents.csv and ttft.png to ``--out``; prints medians and ratios.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from .common import RESULTS, add_model_args, forget_placement, interleaved_medians, text_of_tokens, write_csv, pyplot
from .metrics import loglog_slope

from promptcache import PromptCache
from promptcache.models.loading import load_model

METHODS = ("full", "prefix", "pc_device", "pc_device_inplace", "pc_r0_inplace", "pc_host", "limit")
QUICK = dict(lengths=[64, 128], fractions=[0.5, 0.9], repeats=2, module_tokens=32)


@dataclass
class Case:
    """One prompt length: the schema, the measured prompt per cached fraction, the previous request."""

    length: int
    schema: str
    prompts: dict[float, str]
    previous: str


def build_case(tok, length: int, fractions: list[float], change_at: float, module_tokens: int) -> Case:
    """Schema and prompts whose cached part is ``f * length`` tokens (see the module docstring)."""
    pre, var = max(1, round(change_at * length)), max(4, length // 64)
    head = 1 + pre + var  # BOS, preamble, variant
    docs, refs, at, seed = [], {}, head, 1000
    for f in sorted(fractions):
        cached = round(f * length)
        if cached <= head or cached >= length:
            raise ValueError(f"cached fraction {f} of {length} tokens is {cached} tokens; it must exceed the "
                             f"{head} tokens before the documents and leave at least one new token")
        while at < cached:
            n = min(module_tokens, cached - at)
            docs.append(f'<module name="d{len(docs)}">{text_of_tokens(tok, n, seed)}</module>')
            at, seed = at + n, seed + 1
        refs[f] = "".join(f"<d{i}/>" for i in range(len(docs)))
    variants = "".join(f'<module name="v{i}">{text_of_tokens(tok, var, 10 + i)}</module>' for i in (0, 1))
    schema = (f'<schema name="ttft">{text_of_tokens(tok, pre, 1)} <union scaffold="v0">{variants}</union> '
              f'{" ".join(docs)}</schema>')
    prompts = {f: f'<prompt schema="ttft"><v1/>{refs[f]} {text_of_tokens(tok, length - round(f * length), 7)}'
                  f'</prompt>' for f in fractions}
    previous = f'<prompt schema="ttft"><v0/>{refs[max(fractions)]} {text_of_tokens(tok, 16, 8)}</prompt>'
    return Case(length, schema, prompts, previous)


class PrefixStore:
    """Automatic prefix caching as vLLM/SGLang give it, for one stored request: keep the KV of a
    previous prompt's tokens; a new prompt reuses the longest common token prefix (at least one
    token is always run) and runs the rest through the stock model on a DynamicCache."""

    def __init__(self, model):
        self.model = model
        self.ids: list[int] = []
        self.kv: list[tuple[torch.Tensor, torch.Tensor]] = []  # per layer: K, V [1, H, n, D]

    @torch.inference_mode()
    def store(self, ids: list[int]) -> None:
        dev = next(self.model.parameters()).device
        out = self.model(input_ids=torch.tensor([ids], device=dev), past_key_values=_full_cache(self.model),
                         use_cache=True, logits_to_keep=1)
        self.ids, self.kv = list(ids), [(layer.keys, layer.values) for layer in out.past_key_values.layers]

    def match(self, ids: list[int]) -> int:
        n = 0
        for a, b in zip(ids[: len(ids) - 1], self.ids):
            if a != b:
                break
            n += 1
        return n

    @torch.inference_mode()
    def prefill(self, ids: list[int]) -> tuple[torch.Tensor, int]:
        """Next-token logits [V] after ``ids`` and the number of tokens reused."""
        n = self.match(ids)
        cache = _full_cache(self.model)
        for layer, (k, v) in zip(cache.layers, self.kv):  # views of the stored prefix: no copy here
            layer.lazy_initialization(k, v)
            layer.keys, layer.values = k[:, :, :n], v[:, :, :n]
        dev = self.kv[0][0].device if self.kv else next(self.model.parameters()).device
        out = self.model(input_ids=torch.tensor([ids[n:]], device=dev), past_key_values=cache, use_cache=True,
                         logits_to_keep=1)
        return out.logits[0, -1], n


def _full_cache(model):
    """A DynamicCache whose every layer keeps every token (a sliding-window layer would keep only
    its window, and a prefix of it would not be the prompt's prefix): the stock model applies its
    windows through the mask, by index, which at contiguous positions is exact."""
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer

    cache = DynamicCache(config=model.config)
    cache.layers = [DynamicLayer() for _ in cache.layers]
    return cache


def host_engine(model, tok) -> PromptCache | None:
    """An engine keeping module states in host memory only, or None when the option does not exist."""
    from promptcache import engine

    if hasattr(engine, "StoreConfig"):  # settings by concern
        return PromptCache(model, tok, engine.EngineConfig(store=engine.StoreConfig(device_budget=0)))
    if "device_budget" not in {f.name for f in dataclasses.fields(engine.EngineConfig)}:
        print("note: EngineConfig has no 'device_budget' field in this checkout: pc_host (d) skipped")
        return None
    return PromptCache(model, tok, engine.EngineConfig(device_budget=0))  # the flat config of older checkouts


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def synced(result, device: torch.device):
    """``result`` once the GPU has finished computing it (the stock model returns before that)."""
    _sync(device)
    return result


def limit_fn(pc: PromptCache, prompt: str):
    """The forward of the prompt's new tokens alone on its assembled cache (and a cleanup)."""
    kept = pc.prefill(prompt, keep_cache=True)
    cache, n_cached = kept.cache, kept.cached_tokens
    ids = torch.tensor([[t for s in kept.layout.new for t in s.token_ids]], device=pc.device)
    pos = torch.tensor([[p for s in kept.layout.new for p in s.position_ids]], device=pc.device)

    def run():
        cache.set_length(n_cached)
        pc.adapter.forward(ids, pos, cache)
        _sync(pc.device)

    return run, lambda: pc.release(kept)


class Sweep:
    """Times every method on every prompt of one case, round-robin (see ``interleaved_medians``);
    keeps per-method estimates so later fractions of a length skip the warm-up."""

    def __init__(self, pc, host, args):
        self.pc, self.host, self.args = pc, host, args
        self.estimate: dict[tuple[str, int], float] = {}
        self.last: dict[str, object] = {}

    def methods(self, prompt: str, prefix: PrefixStore) -> dict:
        pc, host = self.pc, self.host

        def keep(name, fn):
            def run():
                self.last[name] = fn()
            return run

        def copy_all(engine):
            forget_placement(engine)
            return engine.prefill(prompt)

        out = {"full": keep("full", lambda: pc.prefill_baseline(prompt)),
               "prefix": keep("prefix", lambda: synced(prefix.prefill(pc.layout(prompt).token_ids), pc.device)),
               "pc_device": keep("pc_device", lambda: copy_all(pc)),
               "pc_device_inplace": keep("pc_device_inplace", lambda: pc.prefill(prompt)),
               "pc_r0_inplace": keep("pc_r0_inplace", lambda: pc.prefill(prompt, recompute=0))}
        if host is not None:
            out["pc_host"] = keep("pc_host", lambda: copy_all(host))
        return out

    def run_point(self, length: int, f: float, prompt: str, prefix: PrefixStore) -> list[dict]:
        res = self.pc.prefill(prompt)
        fns = self.methods(prompt, prefix)
        fns["limit"], done = limit_fn(self.pc, prompt)
        known = {m: self.estimate[(m, length)] for m in fns if (m, length) in self.estimate}
        if self.pc.device.type == "cuda":  # a new shape's first forward builds attention plans: warm up every point
            known = {}
        times = interleaved_medians(fns, self.args.repeats, warmup=set(fns) - set(known),
                                    budget_s=self.args.budget_s, expected=known)
        done()
        self.estimate.update({(m, length): t for m, t in times.items()})
        reused = self.last["prefix"][1]
        drift = float((self.last["prefix"][0] - self.last["full"].logits).abs().max())
        load = round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else ""
        rows = []
        for m, t in times.items():
            tiers = getattr(self.last.get(m), "hit_tiers", None) or {}
            rows.append(dict(model=self.args.model, device=self.args.device, dtype=self.args.dtype,
                             length=length, fraction=f, tokens=res.cached_tokens + res.new_tokens,
                             cached_tokens=res.cached_tokens, new_tokens=res.new_tokens,
                             recomputed_tokens=getattr(self.last.get(m), "recomputed_tokens", 0),
                             prefix_reused_tokens=reused, method=m, ttft_s=round(t, 6),
                             speedup_vs_full=round(times["full"] / t, 3),
                             served_from=" ".join(f"{k}:{v}" for k, v in sorted(tiers.items())),
                             prefix_logits_maxdiff=drift, load1=load))
        print_point(length, f, res, reused, times, drift)
        return rows


def print_point(length, f, res, reused, t, drift) -> None:
    ms = lambda k: f"{t[k] * 1e3:9.1f}"  # noqa: E731
    host = f" host {ms('pc_host')}" if "pc_host" in t else ""
    print(f"L={length:5d} f={f:.2f} ({res.cached_tokens} cached + {res.new_tokens} new, prefix reuses {reused}) "
          f"ms: full {ms('full')} prefix {ms('prefix')} pc {ms('pc_device')} in-place {ms('pc_device_inplace')}"
          f" r=0 {ms('pc_r0_inplace')} ({res.recomputed_tokens} recomputed by default)"
          f"{host} limit {ms('limit')} | full/pc {t['full'] / t['pc_device']:6.1f}x "
          f"prefix/pc {t['prefix'] / t['pc_device']:6.1f}x pc/limit {t['pc_device'] / t['limit']:5.2f} "
          f"(prefix vs full logits max diff {drift:.1e}; load {os.getloadavg()[0]:.1f})", flush=True)


def exponents(rows: list[dict], fit_from: int) -> list[dict]:
    """Log-log slope of TTFT vs tokens per (method, fraction) over lengths >= fit_from."""
    out = []
    for m in METHODS:
        for f in sorted({r["fraction"] for r in rows}):
            pts = sorted((r["tokens"], r["ttft_s"]) for r in rows
                         if r["method"] == m and r["fraction"] == f and r["length"] >= fit_from)
            if len(pts) >= 2:
                slope = loglog_slope([p[0] for p in pts], [p[1] for p in pts])
                out.append(dict(method=m, fraction=f, from_tokens=pts[0][0], to_tokens=pts[-1][0],
                                points=len(pts), exponent=round(slope, 3)))
    return out


def plot(rows: list[dict], path: Path) -> bool:
    plt = pyplot()
    if plt is None:
        return False
    fractions = sorted({r["fraction"] for r in rows})
    fig, axes = plt.subplots(1, len(fractions), figsize=(5 * len(fractions), 4.2), squeeze=False)
    for ax, f in zip(axes[0], fractions):
        for m in METHODS:
            pts = sorted((r["tokens"], r["ttft_s"] * 1e3) for r in rows if r["method"] == m and r["fraction"] == f)
            if pts:
                ax.plot(*zip(*pts), marker="o", label=m)
        ax.set(xscale="log", yscale="log", xlabel="prompt tokens", ylabel="TTFT (ms)",
               title=f"cached fraction {f:g}")
        ticks = sorted({r["length"] for r in rows})
        ax.set_xticks(ticks, [str(t) for t in ticks])
        ax.minorticks_off()
        ax.grid(True, which="both", alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.suptitle(f"TTFT vs prompt length: {rows[0]['model']} on {rows[0]['device']} ({rows[0]['dtype']})")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_args(ap, "embedded:bench")
    ap.add_argument("--lengths", type=int, nargs="+", default=[512, 1024, 2048, 4096, 8192])
    ap.add_argument("--fractions", type=float, nargs="+", default=[0.5, 0.9, 0.99])
    ap.add_argument("--change-at", type=float, default=0.05,
                    help="share of the prompt before the changed variant (all that prefix reuse gets)")
    ap.add_argument("--module-tokens", type=int, default=512, help="largest document module")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--budget-s", type=float, default=15.0,
                    help="seconds of timed rounds per point (at least one round)")
    ap.add_argument("--fit-from", type=int, default=None, help="fit exponents over lengths >= this "
                    "(default: the longer half of --lengths)")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch CPU threads (default: torch's choice); 1 is steadier on a shared machine")
    ap.add_argument("--quick", action="store_true", help="tiny lengths and repeats (for tests)")
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args(argv)
    if args.quick:  # quick values become the defaults; flags given explicitly still win
        ap.set_defaults(**QUICK)
        args = ap.parse_args(argv)
    if args.fit_from is None:
        ls = sorted(args.lengths)
        args.fit_from = ls[(len(ls) - 1) // 2] if len(ls) > 2 else ls[0]
    return args


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model, tok = load_model(args.model, device=args.device, dtype=args.dtype)
    pc, host = PromptCache(model, tok), host_engine(model, tok)
    if host is not None and pc.device.type == "cpu":
        print("note: on a CPU-only machine device and host memory are the same: pc_device and pc_host coincide")
    rows, sweep = [], Sweep(pc, host, args)
    for length in args.lengths:
        case = build_case(tok, length, args.fractions, args.change_at, args.module_tokens)
        for engine in filter(None, (pc, host)):
            engine.add_schema(case.schema)
        prefix = PrefixStore(model)
        prefix.store(pc.layout(case.previous).token_ids)
        rows += [r for f in args.fractions for r in sweep.run_point(length, f, case.prompts[f], prefix)]
    args.out.mkdir(parents=True, exist_ok=True)
    path = write_csv("ttft.csv", rows, args.out)
    fits = exponents(rows, args.fit_from)
    if fits:
        write_csv("ttft_exponents.csv", fits, args.out)
    print(f"\ngrowth exponents of TTFT vs tokens (log-log slope over lengths >= {args.fit_from}):")
    for e in fits:
        print(f"  {e['method']:18s} f={e['fraction']:.2f}  {e['exponent']:5.2f}  "
              f"({e['points']} points, {e['from_tokens']}..{e['to_tokens']} tokens)")
    png = args.out / "ttft.png"
    print(f"wrote {path}" + (f" and {png}" if plot(rows, png) else ""))
    return rows


if __name__ == "__main__":
    main()
