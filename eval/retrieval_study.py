"""Retrieval study on a real model: promptcache against full prefill, per prompt shape (issue 11).

Called by ``eval/accuracy.py --model smollm2`` (``--task retrieval``). Task: 8 short notes with
one 4-digit access code each (``make_synthetic.retrieval_samples``); "What is the access code for
the red door?". A sample is correct when the greedy answer holds the code. Modes:

* ``prefix_subset``: plain modules (each encoded after the ones before it); the prompt imports
  the first 4 of 8, then the question.
* ``subset_gaps``: the same schema; the prompt imports notes 1, 3, 5, 7 (gaps between them).
* ``independent``: each note in its own union (encoded after the shared header only); all 8 imported.
* ``docstore_default``: ``DocumentStore(pc)``, the default document mode (docs/rag.md): each note
  encoded at ``add``, reused in any order, its drift recomputed at ``auto`` (``qmatch``). Beside
  it, on the same prompts, the anchors (``ANCHORS``, at ``AUTO_FRACTION``): ``anchored`` (every
  document's boundary, then ``qmatch``), EPIC-style boundaries (``epic``) and CacheBlend-style
  layer-1 deviation (``eval/selections.py``'s
  ``cacheblend`` through ``recompute_reference``, whose reused state is every note encoded after
  the prompt's prefix: its own, not the store's).
* ``docstore_exact`` / ``docstore_independent``: ``DocumentStore`` with the 8 notes as documents:
  chains (``exact=True``, exact) and ``independent=True`` (position-independent, recompute applies).
* ``docstore_attached``: ``docstore_independent`` with ``attach_separator=True`` (each note stored
  with its "\n\n" separator as one unit: the layout vLLM's connector serves, docs/vllm.md).
* ``docstore_hybrid``: ``DocumentStore(hybrid=True)`` after a chain request for the first 4 of the
  8 documents (as in a stream where earlier requests shared them): those come from the exact
  chain, the other 4 from independent states.

``shuffled`` variants present the notes in a random order per sample. Every mode runs at the
engine's default (``recompute="auto"``, the row ``auto``); where recompute applies (``RECOMPUTE_MODES``:
the prompt's states drift) also at every given fraction (0 included: the paper's splice), through
``recompute`` (a
function ``(pc, how, r, max_new_tokens) -> Answer``: the engine's ``prefill(recompute=r)`` via
``engine_recompute``, or ``reference_recompute`` outside the engine). Per row: full-prefill correct,
promptcache correct, first-token KL(full || cached), recomputed fraction, TTFT ratio.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass
from typing import Callable

import torch

from . import kept_share
from .metrics import kl_divergence
from .recompute_reference import blend, from_layout, greedy, independent_kv
from .selections import SELECTIONS
from . import engine_selections  # noqa: F401  (registers the studies' engine selections: ape_sharp)

SYSTEM = "You answer questions about the notes the user gives. Answer briefly, using the notes only."
MODES = ("prefix_subset", "subset_gaps", "independent", "docstore_exact", "docstore_independent", "docstore_attached",
         "docstore_hybrid", "docstore_default")
RECOMPUTE_MODES = ("subset_gaps", "independent", "docstore_independent", "docstore_attached", "docstore_hybrid")
HYBRID_CHAINED = 4  # docstore_hybrid: leading documents a previous request stored as a chain


@dataclass
class Answer:
    logits: torch.Tensor  # [V] first-token logits
    text: str
    ttft: float  # seconds
    recomputed: float  # fraction of the cached module tokens computed afresh (0..1)


@dataclass
class Request:
    """One prompt in the two forms the engine takes: PML (schema modes) or a DocumentStore call."""
    prompt: str | None = None
    store: object = None
    question: str = ""
    doc_ids: list | None = None

    def prefill(self, pc, **kw):
        if self.store is not None:
            return self.store.prefill(self.question, self.doc_ids, system=SYSTEM, **kw)
        return pc.prefill(self.prompt, **kw)

    def generate(self, pc, max_new_tokens: int, **kw) -> str:
        if self.store is not None:
            return self.store.generate(self.question, self.doc_ids, system=SYSTEM, max_new_tokens=max_new_tokens,
                                       **kw).text
        return pc.generate(self.prompt, max_new_tokens=max_new_tokens, **kw).text

    def layout(self, pc):
        return self.store.layout(self.question, self.doc_ids, system=SYSTEM) if self.store else pc.layout(self.prompt)


def engine_answer(pc, req: Request, max_new_tokens: int, **kw) -> Answer:
    """The prefill's first-token logits (``prefill``), then the answer on the serving path
    (``generate``: the same plan, its chosen tokens rows of the step; TTFT is the prefill's)."""
    res = req.prefill(pc, **kw)
    logits, ttft = res.logits.clone(), res.ttft
    n_cached = max(res.cached_tokens, 1)
    rec = getattr(res, "recomputed_tokens", 0) / n_cached
    text = req.generate(pc, max_new_tokens, **kw)
    return Answer(logits, text, ttft, rec)


def full_answer(pc, req: Request, max_new_tokens: int) -> Answer:
    """Full prefill of the prompt's tokens at positions 0..n-1 (no cache; timed), then greedy
    decoding on its KV cache (the same tokens as ``model.generate(do_sample=False)``)."""
    ids = req.layout(pc).token_ids
    eos = pc.runner.eos_ids
    with torch.inference_mode():
        t0 = time.perf_counter()
        out = pc.model(input_ids=torch.tensor([ids]), use_cache=True, logits_to_keep=1)
        ttft = time.perf_counter() - t0
        first, past, gen = out.logits[0, -1].clone(), out.past_key_values, []
        tok = int(first.argmax())
        while True:
            gen.append(tok)
            if tok in eos or len(gen) >= max_new_tokens:
                break
            out = pc.model(input_ids=torch.tensor([[tok]]), past_key_values=past, use_cache=True)
            past, tok = out.past_key_values, int(out.logits[0, -1].argmax())
    return Answer(first, pc.tokenizer.decode(gen, skip_special_tokens=True), ttft, 1.0)


def reference_recompute(selection: str = "qattn") -> Callable:
    """Selective recompute through ``recompute_reference`` on the prompt's layout: module spans
    (``source == "module"``) encoded independently, everything before the first a shared prefix,
    the rest new; contiguous positions. ``selection`` names an entry of ``selections.SELECTIONS``."""
    def run(pc, req: Request, r: float, max_new_tokens: int) -> Answer:
        p = from_layout(req.layout(pc))
        t0 = time.perf_counter()
        base = independent_kv(pc.model, p)  # what the cache holds (not timed as prompt work below)
        t0 = time.perf_counter()
        budget = round(r * p.candidates.numel())
        sel, narrow, _ = SELECTIONS[selection](pc.model, p, base, budget)
        logits, kv = blend(pc.model, p, base, sel, narrow)
        ttft = time.perf_counter() - t0
        eos = {pc.tokenizer.eos_token_id}
        out = greedy(pc.model, logits, kv, p.n, max_new_tokens, eos)
        return Answer(logits[-1], pc.tokenizer.decode(out, skip_special_tokens=True), ttft,
                      budget / max(p.candidates.numel(), 1))
    return run


def engine_recompute(pc, req: Request, r: float, max_new_tokens: int) -> Answer:
    """The engine's own selective recompute (``prefill(..., recompute=r)``)."""
    return engine_answer(pc, req, max_new_tokens, recompute=r)


def engine_anchor(selection: str, r: float | None = None, prefixed: bool = False) -> Callable:
    """An anchor through the engine: the request's documents reused independently, ``selection``
    (an engine selection) choosing ``r`` (default ``AUTO_FRACTION``) of their tokens (the same
    notes' states: a store on the same namespace encodes nothing again)."""
    from promptcache.engine.prefill.recompute import AUTO_FRACTION
    from promptcache.rag import DocumentStore

    r = AUTO_FRACTION if r is None else r

    def run(pc, req: Request, max_new_tokens: int) -> Answer:
        other = DocumentStore(pc, namespace=req.store.namespace, independent=True, selection=selection,
                              prefixed=prefixed)
        for d in req.doc_ids:
            other.add(d, req.store.get(d).text)
        return engine_answer(pc, Request(store=other, question=req.question, doc_ids=req.doc_ids), max_new_tokens,
                             recompute=r)
    return run


def reference_anchor(selection: str, r: float = 0.15) -> Callable:
    run = reference_recompute(selection)
    return lambda pc, req, max_new_tokens: run(pc, req, r, max_new_tokens)


# anchors run beside docstore_default on the same prompts: label -> (pc, request, max_new_tokens) -> Answer.
# ``ape``: the default's selection plus APE's temperature on the reused documents' keys (the engine's
# ``APE_KEY_SCALE``); ``ape_sharp``: a sharper temperature, ``ape_named``: the named documents unscaled
# (eval/engine_selections.py)
ANCHORS = {"anchored@0.15": engine_anchor("anchored"), "epic@0.15": engine_anchor("epic"),
           "cacheblend@0.15": reference_anchor("cacheblend"), "ape@0.15": engine_anchor("ape"),
           "qmatch@0.15": engine_anchor("qmatch"), "ape_sharp@0.15": engine_anchor("ape_sharp"),
           "ape_named@0.15": engine_anchor("ape_named"),
           "qattn@0.15": engine_anchor("qattn"),
           # issue 36: the reference's reuse state (each note encoded after the prompt's prefix, not alone
           # from position 0) with the default's selection, with none, and with the question's attention
           "ref_qmatch@0.15": reference_anchor("qmatch"), "ref_none@0": reference_anchor("none", 0.0),
           "ref_qattn@0.15": reference_anchor("qattn"),
           # the documents encoded after a system-less request's prefix (DocumentStore(prefixed=True)), not alone
           "prefixed:qmatch@0.15": engine_anchor("qmatch", prefixed=True),
           "prefixed:ape@0.15": engine_anchor("ape", prefixed=True)}


def anchor(label: str) -> Callable:
    """An anchor by label: one of ``ANCHORS``, or ``SELECTION@R`` for any engine selection at the
    fraction ``R`` (``qmatch@0.12``: the default's selection at another budget; ``prefixed:qmatch@0.15``:
    the documents encoded after a system-less request's prefix, ``DocumentStore(prefixed=True)``)."""
    if label in ANCHORS:
        return ANCHORS[label]
    from promptcache.engine.prefill.recompute import SELECTIONS as ENGINE_SELECTIONS

    name, _, r = label.partition("@")
    prefixed = name.startswith("prefixed:")  # "prefixed:SELECTION@R": DocumentStore(prefixed=True)
    name = name.removeprefix("prefixed:")
    try:
        fraction = float(r)
    except ValueError:
        fraction = -1.0
    if name not in ENGINE_SELECTIONS or not 0.0 <= fraction <= 1.0:
        raise ValueError(f"unknown anchor {label!r} (known: {', '.join(ANCHORS)}, or SELECTION@FRACTION with an "
                         f"engine selection: {', '.join(ENGINE_SELECTIONS)})")
    return engine_anchor(name, fraction, prefixed=prefixed)


def correct(sample: dict, text: str) -> int:
    """Every answer (a code; two for the pairs task) in the output."""
    return int(all(a in text.replace(" ", "") for a in sample["answers"]))


def _schema(notes: list[str], independent: bool, name: str) -> str:
    mods = [f'<module name="n{i}">{t}\n</module>' for i, t in enumerate(notes)]
    if independent:
        mods = [f"<union>{m}</union>" for m in mods]
    return f'<schema name="{name}"><system>{SYSTEM}</system><user>Notes:\n{"".join(mods)}</user></schema>'


def _prompt(name: str, refs: list[int], question: str) -> str:
    return f'<prompt schema="{name}">{"".join(f"<n{i}/>" for i in refs)}<user>Question: {question}</user></prompt>'


def build(pc, mode: str, sample: dict, index: int, shuffled: bool, rng: random.Random) -> Request | None:
    """The request for one sample in one mode (None: the engine lacks the mode)."""
    notes = list(sample["notes"])
    if shuffled:
        rng.shuffle(notes)
    q = sample["input"]
    name = f"s{index}_{mode}_{int(shuffled)}"
    if mode.startswith("docstore"):
        from promptcache.rag import DocumentStore

        store = DocumentStore(pc, namespace=name, exact=mode == "docstore_exact",
                              independent=mode in ("docstore_independent", "docstore_attached"),
                              hybrid=mode == "docstore_hybrid", attach_separator=mode == "docstore_attached")  # its own namespace: no chain of another mode
        ids = [f"{name}_{i}" for i in range(len(notes))]
        for d, t in zip(ids, notes):
            store.add(d, t)  # the store separates documents with "\n\n"
        if mode == "docstore_hybrid":  # an earlier request stored the chain of the first documents
            chains = DocumentStore(pc, namespace=name, exact=True)
            for d, t in zip(ids[:HYBRID_CHAINED], notes):
                chains.add(d, t)
            chains.prefill("Question: (earlier)", ids[:HYBRID_CHAINED], system=SYSTEM)
        return Request(store=store, question=f"Question: {q}", doc_ids=ids)
    pc.add_schema(_schema(notes, mode == "independent", name))
    if mode == "prefix_subset":  # the target note is kept among the first 4
        keep = list(range(4))
    elif mode == "subset_gaps":
        keep = [0, 2, 4, 6]
    else:
        keep = list(range(len(notes)))
    target = notes.index(sample["notes"][sample["target"]])
    if target not in keep:  # keep the question answerable: swap the target note in
        notes[keep[-1]], notes[target] = notes[target], notes[keep[-1]]
        pc.add_schema(_schema(notes, mode == "independent", name + "b"))
        name += "b"
    return Request(prompt=_prompt(name, keep, q))


def evaluate(pc, samples, modes, fractions, max_new_tokens: int, recompute: Callable, log=print,
             save: Callable | None = None, anchors: dict | None = None) -> list[dict]:
    """Every sample in every mode; ``save(rows)`` after each sample (a run stopped early keeps them);
    ``anchors`` (default ``ANCHORS``) run beside ``docstore_default``."""
    anchors = ANCHORS if anchors is None else anchors
    rows = []
    for i, sample in enumerate(samples):
        rng = random.Random(sample["_id"])  # the same shuffles however a run is split
        for mode in modes:
            for shuffled in (False, True):
                req = build(pc, mode, sample, i, shuffled, rng)
                if req is None:
                    continue
                full = full_answer(pc, req, max_new_tokens)
                runs = [("auto", engine_answer(pc, req, max_new_tokens))]  # the engine's default
                if mode in RECOMPUTE_MODES:
                    runs += [(r, recompute(pc, req, r, max_new_tokens)) for r in fractions]
                if mode == "docstore_default":
                    runs += [(label, run(pc, req, max_new_tokens)) for label, run in anchors.items()]
                for r, ans in runs:
                    rows.append(dict(sample=sample["_id"], mode=mode, shuffled=int(shuffled), recompute=r,
                                     full_correct=correct(sample, full.text), pc_correct=correct(sample, ans.text),
                                     first_token_kl=kl_divergence(full.logits, ans.logits),
                                     recomputed=round(ans.recomputed, 4),
                                     ttft_ratio=round(ans.ttft / full.ttft, 4), answer="+".join(sample["answers"]),
                                     output_full=full.text[:90], output_pc=ans.text[:90]))
        log(f"[{i}] " + " ".join(f"{r['mode'][:8]}{'~' if r['shuffled'] else ''}@{r['recompute']}:"
                                 f"{r['full_correct']}{r['pc_correct']}" for r in rows if r["sample"] == sample["_id"]))
        if save is not None:
            save(rows)
    return rows


def read_rows(paths) -> list[dict]:
    """Per-sample rows from accuracy_retrieval.csv files (runs split by sample), typed back."""
    import csv

    ints = ("shuffled", "full_correct", "pc_correct")
    floats = ("first_token_kl", "recomputed", "ttft_ratio")
    rows = []
    for path in paths:
        with open(path) as f:
            for r in csv.DictReader(f):
                rows.append({**r, **{k: int(r[k]) for k in ints}, **{k: float(r[k]) for k in floats},
                             "recompute": _fraction(r["recompute"])})
    return rows


def _fraction(v: str):
    try:
        return float(v)
    except ValueError:  # "auto" or an anchor's label
        return v


def summarize(rows: list[dict]) -> list[dict]:
    out = []
    for key in sorted({(r["mode"], r["shuffled"], r["recompute"]) for r in rows}, key=str):
        rs = [r for r in rows if (r["mode"], r["shuffled"], r["recompute"]) == key]
        mean = lambda k: round(sum(r[k] for r in rs) / len(rs), 4)  # noqa: E731
        full, pcs = mean("full_correct"), mean("pc_correct")
        out.append(dict(mode=key[0], shuffled=key[1], recompute=key[2], samples=len(rs), full_score=full,
                        pc_score=pcs, kept=round(pcs / full, 3) if full else None, **_paired(rs),
                        first_token_kl=mean("first_token_kl"), recomputed=mean("recomputed"),
                        ttft_ratio=mean("ttft_ratio")))
    return out


def _paired(rs: list[dict]) -> dict:
    """How sure the kept share is (``kept_share.py``): its 95% paired bootstrap interval, the
    answers full prefill got and the method lost (and the reverse), McNemar's exact p. Empty
    where a score is not 0 or 1."""
    pairs = [(r["full_correct"], r["pc_correct"]) for r in rs]
    if any(v not in (0, 1) for pair in pairs for v in pair) or not any(f for f, _ in pairs):
        return dict(kept_ci_low=None, kept_ci_high=None, lost=None, won=None, mcnemar_p=None)
    pairs = [(int(f), int(p)) for f, p in pairs]
    lo, hi = kept_share.bootstrap_ci(pairs)
    lost, won = sum(f > p for f, p in pairs), sum(p > f for f, p in pairs)
    return dict(kept_ci_low=round(lo, 3), kept_ci_high=round(hi, 3), lost=lost, won=won,
                mcnemar_p=round(kept_share.mcnemar_p(lost, won), 4))


def plot(summary: list[dict], path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4))
    for mode in sorted({s["mode"] for s in summary}):
        for sh in (0, 1):
            pts = sorted((s["recompute"], s["pc_score"], s["full_score"]) for s in summary
                         if s["mode"] == mode and s["shuffled"] == sh and not isinstance(s["recompute"], str))
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", ls="-" if not sh else ":",
                        label=f"{mode}{' shuffled' if sh else ''} (full {pts[0][2]:.2f})")
    ax.set(xlabel="recompute (fraction of cached note tokens)", ylabel="promptcache correct", ylim=(0, 1),
           title="SmolLM2-135M-Instruct, retrieval: promptcache vs full prefill")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
