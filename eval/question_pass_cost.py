"""What the question pass costs (issue 51): the eager reference against passes that stop early.

    python -m eval.question_pass_cost --model smollm2 [--prompts 4] [--repeats 5] [--out eval/figures] [--tag _smollm2]

On the fidelity study's prompts (``eval/fidelity.py``, ``fact1`` and ``fact2``, documents encoded after the
prompt's prefix, ``system:``), the new tokens over the assembled cache, timed round-robin
(``interleaved_medians``, one thread): ``eager_all`` (``question_attention``: every layer in eager
attention, hooks capturing the probabilities: the pass before issue 51's part b), ``pass_all``
(``qattn``'s pass: every layer, q.k over the reused keys), ``pass_half`` / ``pass_third`` /
``pass_eighth`` (the first half, third (``qattn_fast``) or eighth of the layers, the forward
stopped there), and ``splice`` (the r=0 forward of the same new tokens: what a pass is measured
in). ``overlap``: of the ``--budget`` (15%) of the drifted document tokens each pass ranks first,
the share ``pass_all`` (every layer) also ranks first. Writes ``question_pass_cost{tag}.csv`` (a
row per prompt and pass: median seconds, the ratio to ``splice``, the overlap) and ``.png`` (the
ratio per pass).
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import torch

from . import fidelity, fidelity_tasks
from .common import RESULTS, interleaved_medians, pyplot, save_figure, write_csv

PASSES = {"pass_all": 1.0, "pass_half": 1 / 2, "pass_third": 1 / 3, "pass_eighth": 1 / 8}


def timings(pc, p: "fidelity.Prompt", repeats: int, budget: float) -> tuple[dict[str, float], dict[str, float], int]:
    """(median seconds of each pass and of the splice, each pass's overlap with ``pass_all``, new
    tokens) on ``p`` (its ``system:`` store's plan)."""
    from promptcache.engine.prefill.question_pass import QuestionPass, question_attention, question_scores
    from promptcache.engine.prefill.recompute import top

    store = p.store(None, "system")
    plan = store.plan(p.question, p.ids, system=p.system, recompute=0.0)
    runner, n = pc.runner, plan.cached_tokens
    ids, pos = torch.tensor([plan.new_ids]), torch.tensor([plan.new_pos])
    cache = runner.pool.acquire(n + len(plan.new_ids), [(seg.placed, seg.n) for seg in plan.segments])
    try:
        cache.place(plan.segments)

        def splice():
            runner.adapter.forward(ids, pos, cache)
            cache.set_length(n)

        def eager():
            question_attention(runner.adapter, lambda: runner.adapter.forward(ids, pos, cache), n)
            cache.set_length(n)

        fns = {"splice": splice, "eager_all": eager}
        for name, stop in PASSES.items():
            fns[name] = (lambda s: lambda: question_scores(runner.adapter, cache, ids, pos, QuestionPass(stop=s)))(stop)
        # the drifted slots: every document after the first (encoded after this prefix, exact)
        spans = [len(s.token_ids) for s in plan.layout.spans if s.kind == "cached"]
        cand = list(range(sum(spans[:2]), n))
        k = round(budget * len(cand))
        chosen = {name: set(top(question_scores(runner.adapter, cache, ids, pos, QuestionPass(stop=s)), cand, k))
                  for name, s in PASSES.items()}
        overlap = {name: len(c & chosen["pass_all"]) / max(k, 1) for name, c in chosen.items()}
        return interleaved_medians(fns, repeats), overlap, len(plan.new_ids)
    finally:
        runner.pool.release(cache)


def plot(rows: list[dict], path: Path) -> None:
    """The median time / splice ratio per pass (a bar each)."""
    plt = pyplot()
    if plt is None:
        return
    names = list(dict.fromkeys(r["what"] for r in rows))
    prompts = len({(r["task"], r["sample"]) for r in rows})
    fig, ax = plt.subplots(figsize=(6, 3))
    ax.bar(names, [statistics.median(float(r["vs_splice"]) for r in rows if r["what"] == w) for w in names])
    ax.set_ylabel("time / r=0 forward of the new tokens")
    ax.set_title(f"question pass cost ({rows[0]['model']}, median of {prompts} prompts)")
    save_figure(fig, path)


def main(argv=None) -> list[dict]:
    from promptcache import PromptCache

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--prompts", type=int, default=4, help="samples a task (fact1, fact2), listed order")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--budget", type=float, default=0.15, help="the share of drifted tokens whose overlap is counted")
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--tag", default="")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    pc = PromptCache.from_pretrained(args.model)
    fmt = fidelity.default_format(pc.tokenizer)
    fidelity.use_format(pc, fmt)
    rows = []
    for sample in (s for task in ("fact1", "fact2") for s in fidelity_tasks.samples(task, args.prompts)):
        p = fidelity.Prompt(pc, sample, False, fmt)
        med, overlap, n_new = timings(pc, p, args.repeats, args.budget)
        for name, s in med.items():
            rows.append(dict(model=args.model, task=sample["dataset"], sample=sample["_id"], new_tokens=n_new,
                             layers=pc.runner.spec.layers, what=name, seconds=round(s, 5),
                             vs_splice=round(s / med["splice"], 3), overlap=overlap.get(name, "")))
        p.forget()
    path = write_csv(f"question_pass_cost{args.tag}.csv", rows, args.out)
    names = list(dict.fromkeys(r["what"] for r in rows))
    ratio = {w: statistics.median(r["vs_splice"] for r in rows if r["what"] == w) for w in names}
    for w in names:
        lap = [r["overlap"] for r in rows if r["what"] == w and r["overlap"] != ""]
        print(f"{w:12s} median {statistics.median(r['seconds'] for r in rows if r['what'] == w):.3f} s, "
              f"{ratio[w]:.2f}x the splice's forward of the new tokens"
              + (f", overlap with every layer's choice {statistics.mean(lap):.2f}" if lap else ""))
    plot(rows, path.with_suffix(".png"))
    return rows


if __name__ == "__main__":
    main()
