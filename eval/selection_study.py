"""Which cached tokens to recompute: accuracy and cost of each selection against the fraction recomputed.

    nice -n 10 python -m eval.selection_study [--samples 64] [--fractions 0.15 0.3 0.5 0.7] [--selections ...]

The retrieval task (``make_synthetic.retrieval_samples``: 8 short notes, one 4-digit code each) on
SmolLM2-135M-Instruct (``ensure_smollm2``). Per sample the notes are encoded independently
(``recompute_reference.independent_kv``) and every selection recomputes a fraction of the notes'
tokens (``recompute_reference.blend``); after an answer cue ("The access code for the red door is")
a sample is correct when greedy decoding starts with the code (teacher-forced argmax check). Reference rows: full prefill (``full``) and naive reuse (``none``).
Writes ``selection_study.csv`` (per sample) and ``selection_study_summary.csv`` to ``--out`` and
the curve ``selection_curve.png`` to ``--figures``.

``--impl engine`` measures the engine's own selections (``promptcache.engine.prefill.recompute``) instead:
``DocumentStore(independent=True)`` with the 8 notes as documents, ``generate(..., recompute=r)``
with each ``EngineConfig.recompute.selection``; a sample is correct when the greedy answer (14
tokens) holds the code; TTFT is the engine's (selection pass included). Rows ``full`` (the stock
model over the same tokens) and ``none`` (r = 0). Writes ``selection_engine*.csv`` / PNG.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
from .common import RESULTS, write_csv
from .data.make_synthetic import retrieval_samples
from .metrics import kl_divergence
from .recompute_reference import Prompt, blend, check_exact, independent_kv
from .selections import SELECTIONS

SYSTEM = "You answer questions about the notes the user gives. Answer briefly, using the notes only."


def build_prompt(tok, sample: dict, order: list[int] | None = None) -> tuple[Prompt, list[int]]:
    """Chat-formatted token IDs: prefix (system, user header), one module per note, the question and
    an answer cue in the assistant turn, then the answer's tokens but the last (teacher-forced).
    Pieces are tokenized separately and concatenated. Returns (prompt, answer token IDs)."""
    notes = [sample["notes"][i] for i in (order or range(len(sample["notes"])))]
    colour = sample["input"].split("for the ")[1].split(" door")[0]
    enc = lambda s: tok.encode(s, add_special_tokens=False)  # noqa: E731
    ids = enc(f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\nNotes:\n")
    mods = []
    for note in notes:
        piece = enc(note + "\n")
        mods.append((len(ids), len(ids) + len(piece)))
        ids += piece
    ids += enc(f"Question: {sample['input']}<|im_end|>\n<|im_start|>assistant\n"
               f"The access code for the {colour} door is")
    answer = enc(f" {sample['answer']}")  # ' ', then one token per digit
    order = list(order or range(len(sample["notes"])))
    return Prompt(torch.tensor(ids + answer[:-1]), mods, forced=len(answer) - 1,
                  target=order.index(sample["target"])), answer


def correct(logits: torch.Tensor, answer: list[int]) -> int:
    """1 when greedy decoding would start with the answer: argmax at every forced step [1 + forced, V]."""
    return int(logits.argmax(-1).tolist() == answer)


def run(model, tok, samples, fractions, names, shuffle: bool, save=None):
    rows, gen = [], torch.Generator().manual_seed(0)
    for si, sample in enumerate(samples):
        order = torch.randperm(len(sample["notes"]), generator=gen).tolist() if shuffle else None
        p, answer = build_prompt(tok, sample, order)
        t = time.perf_counter()
        base = independent_kv(model, p)
        full_logits, full_kv = blend(model, p, base, p.candidates)  # = a plain forward (check_exact)
        common = dict(sample=sample["_id"], cached=int(p.candidates.numel()), n=p.n)
        rows.append(dict(common, selection="full", fraction=1.0, recomputed=1.0, extra=0, kl=0.0,
                         correct=correct(full_logits, answer), seconds=time.perf_counter() - t))
        for name in names:
            for f in ([0.0] if name == "none" else fractions):
                budget = round(f * p.candidates.numel())
                t = time.perf_counter()
                sel, narrow, extra = SELECTIONS[name](model, p, base, budget)
                logits, kv = blend(model, p, base, sel, narrow)
                dt = time.perf_counter() - t
                rows.append(dict(common, selection=name, fraction=f, recomputed=round(budget / p.candidates.numel(), 4),
                                 extra=extra, kl=kl_divergence(full_logits[1], logits[1]),
                                 correct=correct(logits, answer), seconds=dt))
        done = [r for r in rows if r["sample"] == sample["_id"]]
        print(f"[{si}] full {done[0]['correct']} " + " ".join(
            f"{r['selection']}@{r['fraction']}:{r['correct']}" for r in done[1:]), flush=True)
        if save is not None:  # after every sample: a long run stopped early keeps what it measured
            save(rows)
    return rows


def run_engine(path, samples, fractions, names, save=None, max_new_tokens: int = 14):
    """The engine's selections on independent DocumentStore notes (see the module docstring)."""
    from promptcache import EngineConfig, PromptCache, RecomputeConfig
    from promptcache.rag import DocumentStore

    torch.set_num_threads(1)
    base = PromptCache.from_pretrained(path)
    engines = {n: PromptCache(base.model, base.tokenizer, EngineConfig(recompute=RecomputeConfig(selection=n))) for n in names}
    rows = []
    for si, sample in enumerate(samples):
        q = f"Question: {sample['input']}"
        ok = lambda text: int(sample["answer"] in text.replace(" ", ""))  # noqa: E731
        stores = {}
        for n, pc in engines.items():
            stores[n] = DocumentStore(pc, independent=True)
            for i, note in enumerate(sample["notes"]):
                stores[n].add(f"n{i}", note)
        ids = [f"n{i}" for i in range(len(sample["notes"]))]
        layout = stores[names[0]].layout(q, ids, SYSTEM)
        t = time.perf_counter()
        with torch.inference_mode():
            full_logits = base.model(input_ids=torch.tensor([layout.token_ids]), logits_to_keep=1).logits[0, -1]
        full_ttft = time.perf_counter() - t
        gen = base.model.generate(torch.tensor([layout.token_ids]), max_new_tokens=max_new_tokens, do_sample=False)
        full_text = base.tokenizer.decode(gen[0, len(layout.token_ids):], skip_special_tokens=True)
        common = dict(sample=sample["_id"], n=len(layout.token_ids))
        rows.append(dict(common, selection="full", fraction=1.0, recomputed=1.0, extra=0, kl=0.0,
                         correct=ok(full_text), seconds=full_ttft))
        for n in names:
            for f in ([0.0] if n == names[0] else []) + list(fractions):
                res = stores[n].prefill(q, ids, SYSTEM, recompute=f)
                logits = res.logits.clone()
                text = stores[n].generate(q, ids, SYSTEM, max_new_tokens, recompute=f).text
                cand = sum(len(stores[n].get(d).token_ids) for d in ids)
                rows.append(dict(common, selection="none" if f == 0 else n, fraction=f,
                                 recomputed=round(res.recomputed_tokens / cand, 4), extra=0,
                                 kl=kl_divergence(full_logits, logits), correct=ok(text), seconds=res.ttft))
        done = [r for r in rows if r["sample"] == sample["_id"]]
        print(f"[{si}] " + " ".join(f"{r['selection']}@{r['fraction']}:{r['correct']}" for r in done), flush=True)
        if save is not None:
            save(rows)
    return rows


def summarize(rows):
    keys = sorted({(r["selection"], r["fraction"]) for r in rows})
    full = statistics.mean(r["correct"] for r in rows if r["selection"] == "full")
    out = []
    for sel, f in keys:
        rs = [r for r in rows if r["selection"] == sel and r["fraction"] == f]
        acc = statistics.mean(r["correct"] for r in rs)
        out.append(dict(selection=sel, fraction=f, samples=len(rs), accuracy=round(acc, 4),
                        kept_of_full=round(acc / full, 4) if full else None,
                        mean_kl=round(statistics.mean(r["kl"] for r in rs), 5),
                        mean_extra_tokens=round(statistics.mean(r["extra"] for r in rs), 1),
                        mean_seconds=round(statistics.mean(r["seconds"] for r in rs), 4)))
    return out


def plot(summary, path: Path, title: str):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(1, 2, figsize=(11, 4))
    for sel in sorted({s["selection"] for s in summary} - {"full", "none"}):
        pts = sorted((s["fraction"], s["accuracy"], s["mean_seconds"]) for s in summary if s["selection"] == sel)
        ax[0].plot([x for x, _, _ in pts], [y for _, y, _ in pts], marker="o", label=sel)
        ax[1].plot([x for x, _, _ in pts], [z for _, _, z in pts], marker="o", label=sel)
    for s in summary:
        if s["selection"] in ("full", "none"):
            ax[0].axhline(s["accuracy"], ls="--", color="k" if s["selection"] == "full" else "r", lw=1,
                          label=f"{s['selection']} ({s['accuracy']:.2f})")
    ax[0].set(xlabel="fraction of note tokens recomputed", ylabel="correct", title=title, ylim=(0, 1))
    ax[1].set(xlabel="fraction of note tokens recomputed", ylabel="seconds (reference, CPU)",
              title="cost: selection + blended prefill")
    ax[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def combine(paths: list[Path], figures: Path, tag: str = ""):
    """Summary CSV and PNG over the per-sample CSVs of several runs."""
    import csv

    rows = []
    for path in paths:
        with path.open() as f:
            for r in csv.DictReader(f):
                rows.append(dict(r, fraction=float(r["fraction"]), correct=int(r["correct"]), kl=float(r["kl"]),
                                 extra=float(r["extra"]), seconds=float(r["seconds"])))
    summary = summarize(rows)
    n = len({r["sample"] for r in rows})
    write_csv(f"selection_study{tag}_summary.csv", summary, figures)
    print("wrote", plot(summary, figures / f"selection_study{tag}.png", f"SmolLM2-135M, {n} questions"))
    return rows, summary


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samples", type=int, default=64)
    ap.add_argument("--fractions", type=float, nargs="+", default=[0.15, 0.3, 0.5, 0.7])
    ap.add_argument("--selections", nargs="+", default=list(SELECTIONS))
    ap.add_argument("--first", type=int, default=0, help="skip the first N samples (to split a run)")
    ap.add_argument("--shuffle", action="store_true", help="notes in a random order per sample")
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--figures", type=Path, default=HERE / "figures")
    ap.add_argument("--tag", default="")
    ap.add_argument("--impl", choices=("reference", "engine"), default="reference",
                    help="reference: recompute_reference.py's selections; engine: the engine's (EngineConfig)")
    ap.add_argument("--combine", type=Path, nargs="+", default=None,
                    help="only summarize and plot these per-sample CSVs (runs split with --first)")
    args = ap.parse_args(argv)
    if args.combine:
        return combine(args.combine, args.figures, args.tag)
    torch.manual_seed(0)
    torch.set_num_threads(1)
    from promptcache.models.smollm2 import ensure_smollm2
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = ensure_smollm2()
    samples = retrieval_samples(args.first + args.samples, seed=11)[args.first:]
    if args.impl == "engine":
        from promptcache.engine.prefill.recompute import SELECTIONS as ENGINE_SELECTIONS

        names = [n for n in args.selections if n in ENGINE_SELECTIONS] or list(ENGINE_SELECTIONS)
        stem = f"selection_engine{args.tag}"
        rows = run_engine(path, samples, args.fractions, names, save=lambda rows: write_csv(f"{stem}.csv", rows, args.out))
        return rows, report(rows, args.figures, stem, f"SmolLM2-135M, engine, {len(samples)} questions")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(path)
    print(f"recompute=1.0 vs plain forward: max |dlogit| {check_exact(model, build_prompt(tok, samples[0])[0]):.2e}")
    stem = f"selection_study{args.tag}"
    rows = run(model, tok, samples, args.fractions, args.selections, args.shuffle,
               save=lambda rows: write_csv(f"{stem}.csv", rows, args.out))
    return rows, report(rows, args.figures, stem, f"SmolLM2-135M, {len(samples)} questions")


def report(rows: list[dict], figures: Path, stem: str, title: str) -> list[dict]:
    """Print the per-selection summary, write it as ``{stem}_summary.csv`` and its plot; return it."""
    summary = summarize(rows)
    for s in summary:
        print(s)
    write_csv(f"{stem}_summary.csv", summary, figures)
    print("wrote", plot(summary, figures / f"{stem}.png", title))
    return summary


if __name__ == "__main__":
    main()
