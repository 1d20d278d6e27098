"""Fidelity study (issue 51): does a reused prompt's answer stay full prefill's answer?

    python -m eval.fidelity --model smollm2 [--n 60] [--tasks fact1 fact2 single twohop] [--margin 0.5]
        [--methods default cacheblend epic ape prophet tail] [--budgets 0 0.05 0.1 0.15 0.2 0.3 1]
        [--default-budgets 0.5 0.8] [--format chat|completion] [--calibrate 20] [--first 0] [--out eval/figures]
        [--tag _smollm2]
    python -m eval.fidelity --combine A.csv B.csv ... --out eval/figures --tag _smollm2   # summary + PNG only
        [--against system:default]   # and every method paired with that one

Prompts: ``eval/fidelity_tasks.py`` (single-hop and two-hop questions over 4-8 documents, ~1K
tokens of documents), each asked with its documents in the listed order and in a shuffled one.
The default tasks are ``fact1`` / ``fact2`` (a city a person lives in, distinct people and cities,
"Answer with the city name only."), which full prefill answers more often and more surely than
the earlier ``single`` / ``twohop`` (access codes of near-identical doors; still runnable by name).
The documents go into a ``DocumentStore(pc)`` (the default mode: each document encoded at ``add()``,
reused in any subset and order; since issue 51 encoded after the prefix of a request without a
system text, the store having none, while the prompts carry one); each method answers the same
prompt from those states.

**Format.** ``--format chat`` (the default where the tokenizer has a chat template: SmolLM2) wraps
the prompt in the template with ``SYSTEM``; ``--format completion`` (the default without one: Gemma
3 270M, a base model, which answered nothing in the chat fallback's "System: / User: /
Assistant:") is plain text a base model continues with the city: ``COMPLETION_SYSTEM`` (an
instruction and two solved examples, the same for every prompt, so a shared prefix), the
documents, "Question: In which city does Kofi live?" and "Answer:".

**The answer.** Greedy decoding after the prompt, at most ``--answer-tokens`` (16) tokens, stopped
at the first newline, sentence end or EOS; the answer is the decoded text's first line up to its
first sentence end, stripped. **Agreement**: the method's answer gives the same code as full
prefill's (float32, the same tokens at positions 0..n-1, nothing reused): the first number of 4 or
more digits in each, or where one gives none, the same text (``answer_key``); ``agree_text``, the
stricter column beside it, asks for the same sentence character for character. Whether a method's
greedy tokens are full prefill's is checked by one teacher-forced forward on the method's kept
cache (``follows``); where they depart the method decodes its own answer on that cache
(``cache_greedy``): one prefill a run. **Correct**: the answer holds the code. Per method and
budget: agreement (with a 95% Wilson interval), accuracy of both, the kept share (method
correct / full prefill correct) with a 95% paired bootstrap interval, the answers
lost and won against full prefill and McNemar's exact p (``eval/kept_share.py``), first-token
KL(full || method), and TTFT: full prefill's over the method's, both timed in this process on the
same prompt one after the other (the load average is written beside them). ``late_flips``: the
disagreements whose first generated token is still full prefill's (the answer moved at a later
step, the only ones a refresh during decoding, KVShare-style, could reach).

**Confidence.** Each prompt records ``full_margin``: full prefill's probability of its greedy
token less the runner-up's at the step that starts the answer's key ("The city is Lisbon" is
decided at "Lisbon"). The summary's order ``confident`` is both orders where that margin is above
``--margin`` (0.5): "where full prefill is sure, the method agrees on y%".

Methods (``METHODS``; any other engine selection name is accepted as itself):

* ``default``: the store's own default selection (``DEFAULT_SELECTION``) at each budget;
* ``cacheblend``: CacheBlend-style (``eval/selections.py``: every document token through layer 1,
  then the budget's tokens with the largest K+V deviation), on the reference path
  (``eval/recompute_reference.py``: its reused state is every document encoded after the prompt's
  prefix, not alone; its TTFT is a Python reference's, not the engine's);
* ``epic``: EPIC-style: the budget spread over every document's first tokens;
* ``ape``: APE-style: the default's tokens recomputed, the other reused keys at temperature 1.25;
* ``prophet``: query-aware (ProphetKV-style): the question's attention over the reused states
  from a pass of the new tokens through every layer picks the tokens (the engine's ``qattn``);
  ``qattn_fast`` (by its engine name) reads the first third of the layers and stops there, and the
  layer study's ``qattn_eighth`` / ``qattn_half`` (``eval/engine_selections.py``) the first eighth
  and half;
* ``tail``: the last tokens before the question (the documents nearest it) recomputed;
* ``kvshare``: KVShare-style, recompute that continues into decoding (``eval/fidelity_kvshare.py``):
  the default's prefill at the budget, then, after the first answer token, another budget's share
  of the document tokens that token attends to most recomputed in the prompt's context; TTFT is
  the prefill's (``recomputed`` counts the prefill's tokens).

A method's name may carry how the documents were encoded at ``add()`` (``ENCODINGS``); a name
without one (``default``, ``prophet``) runs on the store's default encoding, ``DocumentStore(pc)``'s
(which changed in issue 51: results before it ran on documents encoded alone, now ``alone:M``):
``alone:M`` (alone from position 0, ``DocumentStore(prefixed=False)``, the default before issue 51),
``prefixed:M`` (after the prefix of a request without a system text, ``DocumentStore(prefixed=True)``:
today's default encoding, asked for by name) or ``system:M`` (after the prompts' own prefix, system
text included: ``DocumentStore(prefixed=SYSTEM)``, as ``DocumentStore(system=SYSTEM)`` encodes; the
first document then sits where it was encoded and its states are full prefill's). Such a method's
budget 0 is its encoding's own splice: run once as ``enc:default`` at 0 where that is among the
methods and drawn for every ``enc:M`` without a key scale, else run by the method itself.

Budget ``b``: ``round(b * C)`` of the prompt's ``C`` reused document tokens are recomputed. At
``0`` every selection without a key scale is the same splice, and at ``1`` every engine selection
is a plain prefill in prompt order: those are run once a prompt (methods ``splice`` and
``full_recompute``) and drawn at the ends of every line. ``--calibrate N``: full prefill in
bfloat16 against float32 on the first N samples (method ``bf16_full``): how many answers a change
that is not reuse moves. ``--full-only``: full prefill's answers alone (method ``full_prefill``), a
model's accuracy on the tasks (``eval/results/gemma3.md``: Gemma 3 270M beside SmolLM2).

Writes ``fidelity{tag}.csv`` (a row per prompt, order, method, budget), ``fidelity{tag}_summary.csv``,
``fidelity{tag}_margin.csv`` (agreement where full prefill's margin is at least 0, 0.2, ... 0.8),
``fidelity{tag}_summary.png`` (agreement against budget, one line per method, per task and order)
and ``fidelity{tag}_ttft.png`` (the agreement-vs-TTFT plane); with ``--against M``,
``fidelity{tag}_paired.csv``: every method against ``M`` at the same budget on the same prompts
(agreed by both, by ``M`` only, by the method only, McNemar's p; both TTFT ratios).
"""

from __future__ import annotations

import argparse
import csv
import math
import random
import re
import statistics
import time
from pathlib import Path

import torch

from . import fidelity_tasks, kept_share
from .common import RESULTS, pyplot, save_figure, write_csv
from .metrics import kl_divergence

SYSTEM = "You answer questions about the documents the user gives. Answer briefly, using the documents only."
METHODS = {"default": None, "epic": "epic", "ape": "ape", "prophet": "qattn", "tail": "tail", "cacheblend": "reference",
           "kvshare": "kvshare"}
BUDGETS = (0.0, 0.05, 0.1, 0.15, 0.2, 0.3, 1.0)
ANSWER_TOKENS = 16
ORDERS = ("listed", "shuffled")
# method prefix -> DocumentStore(prefixed=...); DEFAULT_ENCODING (no prefix): ``prefixed`` left out
DEFAULT_ENCODING = "store"
ENCODINGS = {DEFAULT_ENCODING: None, "alone": False, "prefixed": True, "system": SYSTEM}

# -- prompt formats ---------------------------------------------------------------------------------
# ``chat``: the tokenizer's chat template (SmolLM2's), the system text ``SYSTEM``, the question with
# its instruction ("... Answer with the city name only."). ``completion``, for a base model (Gemma 3
# 270M's package has no chat template): plain text a base model continues with the answer,
#   COMPLETION_SYSTEM (an instruction and two solved examples)\n\n documents \n\n Question: ...?\nAnswer:
# the shared part (instruction and examples) a prefix every prompt starts with, so it is a store's
# ``system`` text. The examples' people and cities are in no task's lists.
FORMATS = ("chat", "completion")
COMPLETION_SYSTEM = ("Each question is answered from the documents before it, with one city name.\n\n"
                     "About Mirela. Mirela lives in Tallinn.\nQuestion: In which city does Mirela live?\n"
                     "Answer: Tallinn\n\n"
                     "About Tomas. Tomas lives in Dublin. Delivery memo. The parcel is for Tomas.\n"
                     "Question: In which city does the person named in the delivery memo live?\nAnswer: Dublin")
# a "chat template" that renders the completion format: system text, a blank line, the user's text
# (documents and question), then "\nAnswer:" as the generation prompt; roles get no headers
COMPLETION_TEMPLATE = ("{%- for m in messages -%}{{ m['content'] }}{% if m['role'] == 'system' %}\n\n{% endif %}"
                       "{%- endfor -%}{% if add_generation_prompt %}\nAnswer:{% endif %}")


def default_format(tokenizer) -> str:
    """``chat`` where the tokenizer has a chat template, else ``completion`` (a base model)."""
    return "chat" if getattr(tokenizer, "chat_template", None) else "completion"


def use_format(pc, fmt: str) -> str:
    """Make ``pc``'s prompts ``fmt`` (``FORMATS``) and return their system text. ``completion``
    sets ``COMPLETION_TEMPLATE`` as the tokenizer's chat template (before any prompt is laid out:
    the span tokenizer keeps what it rendered)."""
    if fmt not in FORMATS:
        raise ValueError(f"--format: unknown {fmt!r} (known: {', '.join(FORMATS)})")
    if fmt == "chat":
        return SYSTEM
    if getattr(pc.tok, "tok", None) is not pc.tokenizer:
        raise ValueError(f"--format completion: the model's span tokenizer ({type(pc.tok).__name__}) does not render "
                         "through its Hugging Face tokenizer's chat template")
    pc.tokenizer.chat_template = COMPLETION_TEMPLATE
    return COMPLETION_SYSTEM


def question_of(sample: dict, fmt: str) -> str:
    """The new text after the documents: ``Question: ...`` (in ``completion`` without the answer
    instruction, which the examples carry: "In which city does Kofi live?")."""
    q = sample["input"]
    if fmt == "completion":
        q = q.split("? ", 1)[0] + "?" if "? " in q else q
    return f"Question: {q}"


def split_method(method: str) -> tuple[str, str]:
    """(encoding, method): ``system:default`` -> (``system``, ``default``); no prefix: the store's
    default encoding (``DEFAULT_ENCODING``)."""
    enc, sep, rest = method.partition(":")
    return (enc, rest) if sep and enc in ENCODINGS else (DEFAULT_ENCODING, method)


def selection_of(method: str) -> str | None:
    """The engine selection (or ``reference``) a method runs, its encoding prefix kept:
    ``system:prophet`` -> ``system:qattn``; ``default`` -> None (the store's default)."""
    enc, m = split_method(method)
    sel = METHODS.get(m, m)
    return sel if enc == DEFAULT_ENCODING else f"{enc}:{sel or ''}"


# -- answers --------------------------------------------------------------------------------------
SENTENCE_END = re.compile(r"[.!?](?=\s|$)")  # an end mark before a space or the end of the text
STOPS = ("\n", ". ", "! ", "? ")  # the engine's stop strings: the answer is complete once one appears


def answer_text(text: str) -> str:
    """The answer in a greedy continuation's text: its first line up to its first sentence end
    (the end mark itself left out), stripped. "The code is 6729. The" and "The code is 6729" give
    the same answer."""
    line = text.split("\n", 1)[0]
    m = SENTENCE_END.search(line)
    return (line[: m.start()] if m else line).strip()


CODE = re.compile(r"\d{4,}")  # the code tasks' answers (single, twohop) are 4-digit codes


WORD = re.compile(r"[A-Za-z]+")


def answer_key(answer: str) -> str:
    """What two answers must share to agree: the first code (4 or more digits) the answer gives,
    else the first answer word of the fact tasks (``fidelity_tasks.ANSWER_WORDS``, a city) it
    names, else the last capitalized word after its first (a name the model gave instead: "The
    city is Paris"), else its text in lower case. "The code is 4677" and "The locker code of the
    person is 4677" agree, as do "Lisbon" and "Kofi lives in Lisbon", and "The city is Paris" and
    "The city name is Paris"; "The parcel is for the person who works at the library" gives none."""
    m = CODE.search(answer.replace(" ", ""))
    if m:
        return m.group(0)
    words = WORD.findall(answer)
    known = next((w.lower() for w in words if w.lower() in fidelity_tasks.ANSWER_WORDS), None)
    named = [w for w in words[1:] if w[0].isupper()]
    return known or (named[-1].lower() if named else answer.lower())


def margin(logits: torch.Tensor) -> float:
    """A greedy step's confidence: the probability of its token less that of the runner-up (0: a
    tie; near 1: no doubt)."""
    p = torch.softmax(logits.float(), -1).topk(2).values
    return float(p[0] - p[1])


def answer_margin(tok, gen: list[int], margins: list[float]) -> float:
    """Full prefill's confidence in its answer: the margin (``margin``) of the greedy step that
    starts the answer's key (``answer_key``: the code or the city; "The city is Lisbon" is decided
    at "Lisbon", not at "The"). An answer without a key: its first step's."""
    text = tok.decode(gen, skip_special_tokens=True)
    key = answer_key(answer_text(text))
    at = text.lower().find(key) if key and key != answer_text(text).lower() else -1
    if at < 0:
        return margins[0]
    for i in range(len(gen)):
        if len(tok.decode(gen[: i + 1], skip_special_tokens=True)) > at:
            return margins[i]
    return margins[0]


def score(row: dict) -> dict:
    """``row`` with ``agree`` (the answers' keys equal, ``answer_key``) and ``agree_text`` (the
    answers equal character for character) worked out from its two answers."""
    full, got = row["full_answer"], row["method_answer"]
    return {**row, "agree": int(answer_key(full) == answer_key(got)), "agree_text": int(full == got)}


def answer_done(text: str) -> bool:
    """Whether greedy decoding can stop: one of ``STOPS`` appeared (the answer is complete)."""
    return any(s in text for s in STOPS)


def full_greedy(model, tok, ids: list[int], eos: frozenset[int], max_new: int
                ) -> tuple[torch.Tensor, list[int], str, float, float]:
    """Full prefill of ``ids`` at positions 0..n-1 (nothing reused; timed), then greedy decoding on
    its own KV cache until EOS, a completed answer (``answer_done``) or ``max_new`` tokens:
    (first-token logits [V] float32, the generated ids, their text, TTFT s, the answer's margin
    (``answer_margin``))."""
    with torch.inference_mode():
        t0 = time.perf_counter()
        out = model(input_ids=torch.tensor([ids]), use_cache=True, logits_to_keep=1)
        ttft = time.perf_counter() - t0
        first, past, gen = out.logits[0, -1].float().clone(), out.past_key_values, []
        t, margins = int(first.argmax()), [margin(first)]
        while True:
            gen.append(t)
            if t in eos or len(gen) >= max_new or answer_done(tok.decode(gen, skip_special_tokens=True)):
                break
            out = model(input_ids=torch.tensor([[t]]), past_key_values=past, use_cache=True)
            past, t = out.past_key_values, int(out.logits[0, -1].argmax())
            margins.append(margin(out.logits[0, -1]))
    return first, gen, tok.decode(gen, skip_special_tokens=True), ttft, answer_margin(tok, gen, margins)


class Prompt:
    """One sample in one document order over a ``DocumentStore`` namespace holding its documents."""

    def __init__(self, pc, sample: dict, shuffled: bool, fmt: str = "chat"):
        self.pc, self.sample, self.shuffled = pc, sample, shuffled
        self.format, self.system = fmt, COMPLETION_SYSTEM if fmt == "completion" else SYSTEM  # ``use_format``'s
        self.namespace = f"fidelity:{sample['_id']}"
        self.ids = [f"{sample['_id']}:{k}" for k in range(len(sample["notes"]))]
        self.stores: dict[tuple[str | None, str], object] = {}
        self.store(None)  # the default store encodes and holds every document
        if shuffled:
            random.Random(f"{sample['_id']}:order").shuffle(self.ids)
        self.question = question_of(sample, fmt)

    def store(self, selection: str | None, encoding: str = DEFAULT_ENCODING):
        """A ``DocumentStore(pc)`` in the default mode on this prompt's namespace with ``selection``
        (None: the store's default), its documents encoded as ``encoding`` says (``ENCODINGS``); a
        second store of an encoding finds the documents' states already stored."""
        from promptcache.rag import DocumentStore

        if (selection, encoding) not in self.stores:
            prefixed = self.system if encoding == "system" else ENCODINGS[encoding]
            kw = {} if prefixed is None else {"prefixed": prefixed}  # None: the store's default encoding
            s = DocumentStore(self.pc, namespace=self.namespace, selection=selection, **kw)
            for k, text in enumerate(self.sample["notes"]):
                s.add(f"{self.sample['_id']}:{k}", text)
            self.stores[(selection, encoding)] = s
        return self.stores[(selection, encoding)]

    def forget(self) -> None:
        """Evict the documents' states of every encoding (a run holds one sample's at a time)."""
        for s in self.stores.values():
            for d in list(s.ids()):
                self.pc.store.discard(s.state_key(s.unit_ids(s.get(d))))

    def token_ids(self) -> list[int]:
        return list(self.store(None).layout(self.question, self.ids, system=self.system).token_ids)

    def doc_tokens(self) -> int:
        """The prompt's document tokens (a budget's share is of these)."""
        layout = self.store(None).layout(self.question, self.ids, system=self.system)
        return sum(len(s) for s in layout.spans if s.kind == "cached" and s.source == "module")


def follows(pc, res, tokens: list[int]) -> bool:
    """Whether greedy decoding on ``res``'s kept cache would produce ``tokens`` (full prefill's
    generated ids): one teacher-forced forward of ``tokens[:-1]`` after the prompt, every step's
    argmax compared with the next token. The decoder's last hidden states are caught by a hook (the
    engine's forward returns the last token's logits only) and read through the output embedding."""
    if int(res.logits.argmax()) != tokens[0]:
        return False
    if len(tokens) == 1:
        return True
    got: list[torch.Tensor] = []
    hook = pc.model.get_decoder().register_forward_hook(lambda _m, _a, out: got.append(out[0]))
    length = res.cache.length
    try:
        n = len(tokens) - 1
        pos = torch.arange(res.next_position, res.next_position + n)[None]
        pc.adapter.forward(torch.tensor([tokens[:-1]]), pos, res.cache)
    finally:
        hook.remove()
        res.cache.set_length(length)  # the prompt's cache again: ``cache_greedy`` may decode on it
    with torch.inference_mode():
        logits = pc.model.get_output_embeddings()(got[-1][0, -n:])  # [n, V]
    return logits.argmax(-1).tolist() == tokens[1:]


def cache_greedy(pc, res, eos: frozenset[int], max_new: int) -> str:
    """Greedy decoding on ``res``'s kept cache (the prompt's states as the method left them), one
    token a forward, until EOS, a completed answer (``answer_done``) or ``max_new`` tokens: the text."""
    gen, pos, t = [], res.next_position, int(res.logits.argmax())
    with torch.inference_mode():
        while True:
            gen.append(t)
            if t in eos or len(gen) >= max_new or answer_done(pc.tokenizer.decode(gen, skip_special_tokens=True)):
                break
            t = int(pc.adapter.forward(torch.tensor([[t]]), torch.tensor([[pos]]), res.cache)[0].argmax())
            pos += 1
    return pc.tokenizer.decode(gen, skip_special_tokens=True)


def engine_answer(p: Prompt, selection: str | None, budget: float, max_new: int, full: tuple[list[int], str],
                  eos: frozenset[int]) -> dict:
    """The engine's answer from the store's reused states, ``budget`` of them recomputed: one
    prefill. Where its greedy tokens are full prefill's (``full``: ids, answer; checked by
    ``follows``) the answer is full prefill's; else the method decodes its own on the same cache
    (``cache_greedy``)."""
    enc, sel = split_method(selection or "")
    res = p.store(sel or None, enc).prefill(p.question, p.ids, system=p.system, recompute=budget,
                                            reserve=max_new + 1, keep_cache=True)
    logits, ttft = res.logits.float().clone(), res.ttft
    text = full[1] if follows(p.pc, res, full[0]) else answer_text(cache_greedy(p.pc, res, eos, max_new))
    p.pc.release(res)
    return dict(logits=logits, text=text, ttft=ttft, exact=bool(res.exact),
                recomputed=res.recomputed_tokens / p.doc_tokens(), cached=res.cached_tokens)


def kvshare_answer(p: Prompt, budget: float, max_new: int, eos: frozenset[int]) -> dict:
    """KVShare-style (``eval/fidelity_kvshare.py``): the store's default prefill at ``budget``, then
    greedy decoding that refreshes another ``budget`` of the document tokens, the ones the first
    answer token attends to most; TTFT is the prefill's."""
    from .fidelity_kvshare import greedy_with_refresh

    res = p.store(None).prefill(p.question, p.ids, system=p.system, recompute=budget, reserve=max_new + 1,
                                keep_cache=True)
    logits, ttft = res.logits.float().clone(), res.ttft
    try:
        gen = greedy_with_refresh(p.pc, res, budget, max_new, lambda ids: ids[-1] in eos or answer_done(
            p.pc.tokenizer.decode(ids, skip_special_tokens=True)))
    finally:
        p.pc.release(res)
    return dict(logits=logits, text=answer_text(p.pc.tokenizer.decode(gen, skip_special_tokens=True)), ttft=ttft,
                exact=False, recomputed=res.recomputed_tokens / p.doc_tokens(), cached=res.cached_tokens)


class Reference:
    """CacheBlend-style recompute on the reference path; the documents' base state computed once a prompt."""

    def __init__(self, p: Prompt, eos: frozenset[int]):
        from .recompute_reference import from_layout, independent_kv

        self.pc, self.eos = p.pc, eos
        self.p = from_layout(p.store(None).layout(p.question, p.ids, system=p.system))
        self.base = independent_kv(p.pc.model, self.p)

    def answer(self, budget: float, max_new: int) -> dict:
        from .recompute_reference import blend, greedy
        from .selections import SELECTIONS

        k = round(budget * self.p.candidates.numel())
        with torch.inference_mode():
            t0 = time.perf_counter()
            sel, narrow, _ = SELECTIONS["cacheblend"](self.pc.model, self.p, self.base, k)
            logits, kv = blend(self.pc.model, self.p, self.base, sel, narrow)
            ttft = time.perf_counter() - t0
            out = greedy(self.pc.model, logits, kv, self.p.n, max_new, set(self.eos))
        text = answer_text(self.pc.tokenizer.decode(out, skip_special_tokens=True))
        return dict(logits=logits[-1].float(), text=text, ttft=ttft, exact=False,
                    recomputed=k / max(self.p.candidates.numel(), 1), cached=int(self.p.candidates.numel()))


def correct(sample: dict, text: str) -> int:
    return int(all(a in text.replace(" ", "") for a in sample["answers"]))


def runs_for(methods: list[str], budgets: list[float], default_budgets: list[float] = ()
             ) -> list[tuple[str, float, str | None]]:
    """(row label, budget, engine selection or ``reference``) of every run a prompt needs: the
    shared splice (budget 0) and plain prefill (budget 1) once, each method at the rest, and the
    default selection of any encoding (``default``, ``system:default``, ...) also at
    ``default_budgets`` (its line to where it would meet a target)."""
    out, shared0 = [], False
    for m in methods:
        sel = selection_of(m)
        mine = budgets if split_method(m)[1] != "default" else sorted(set(budgets) | set(default_budgets))
        for b in mine:
            if b >= 1.0:  # every selection recomputes everything: one plain prefill in prompt order
                continue
            if b == 0.0 and splice_of(m) == "splice":  # the default encoding's shared splice stands for it
                shared0 = True
                continue
            if b == 0.0 and splice_of(m) in methods and splice_of(m) != m:  # its encoding's splice stands for it
                continue
            out.append((m, b, sel))
    if shared0:
        out.insert(0, ("splice", 0.0, None))
    if any(b >= 1.0 for b in budgets):
        out.append(("full_recompute", 1.0, None))
    return out


def evaluate_prompt(p: Prompt, runs, eos, max_new: int, bf16=None) -> list[dict]:
    """Full prefill, then every run, on one prompt: its rows."""
    tok, s = p.pc.tokenizer, p.sample
    ids = p.token_ids()
    full_logits, full_ids, text, full_ttft, full_margin = full_greedy(p.pc.model, tok, ids, eos, max_new)
    full = answer_text(text)
    ref = Reference(p, eos) if any(sel == "reference" for _, _, sel in runs) else None
    answers = [] if runs else [("full_prefill", 1.0, dict(logits=full_logits, text=full, ttft=full_ttft, exact=True,
                                                          recomputed=0.0, cached=0))]  # --full-only: its own row
    for label, b, sel in runs:
        if sel == "reference":
            a = ref.answer(b, max_new)
        elif sel == "kvshare":
            a = kvshare_answer(p, b, max_new, eos)
        else:
            a = engine_answer(p, sel, b, max_new, (full_ids, full), eos)
        answers.append((label, b, a))
    if bf16 is not None:
        logits, _, text, ttft, _ = full_greedy(bf16, tok, ids, eos, max_new)
        answers.append(("bf16_full", 1.0, dict(logits=logits, text=answer_text(text), ttft=ttft, exact=False,
                                              recomputed=0.0, cached=0)))
    from promptcache.bench import load_avg

    load = load_avg()
    return [score(dict(task=s["dataset"], sample=s["_id"], documents=len(s["notes"]), order=ORDERS[p.shuffled],
                       format=p.format,
                 method=label, budget=b, prompt_tokens=len(ids), document_tokens=p.doc_tokens(),
                 cached_tokens=a["cached"],
                 recomputed=round(a["recomputed"], 4), exact=int(a["exact"]),
                 full_correct=correct(s, full), method_correct=correct(s, a["text"]),
                 first_token_kl=round(kl_divergence(full_logits, a["logits"]), 6),
                 first_token_same=int(int(full_logits.argmax()) == int(a["logits"].argmax())),
                 full_margin=round(full_margin, 4),
                 ttft_full_ms=round(full_ttft * 1e3, 2), ttft_ms=round(a["ttft"] * 1e3, 2),
                 speedup=round(full_ttft / a["ttft"], 3) if a["ttft"] > 0 else None, load=load,
                 answer=s["answers"][0], full_answer=full, method_answer=a["text"]))
            for label, b, a in answers]


# -- statistics -----------------------------------------------------------------------------------
def wilson(k: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """95% Wilson score interval of a proportion ``k / n``."""
    if n == 0:
        return (float("nan"), float("nan"))
    p, d = k / n, 1 + z * z / n
    c, h = (p + z * z / (2 * n)) / d, z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / d
    return max(0.0, c - h), min(1.0, c + h)


def splice_of(method: str) -> str | None:
    """The method whose budget-0 row stands for ``method``'s at budget 0: ``splice`` (the default
    encoding's shared splice) or ``enc:default`` (an encoding's own: ``system:prophet`` ->
    ``system:default``); None where the method's budget 0 is its own (a key scale, the CacheBlend
    reference)."""
    from promptcache.engine.prefill.recompute import KEY_SCALES

    enc, base = split_method(method)
    sel = selection_of(method)
    if METHODS.get(base, base) == "reference" or (sel or "").split(":")[-1] in KEY_SCALES:
        return None
    return "splice" if enc == DEFAULT_ENCODING else f"{enc}:default"


def expand_shared(rows: list[dict], methods: list[str]) -> list[dict]:
    """The shared splice and plain-prefill rows repeated under every method they stand for (its
    line's ends): ``splice`` for the default encoding's methods, an encoding's ``enc:default`` at 0
    for that encoding's other methods (``splice_of``), ``full_recompute`` for every method; the rows
    a method ran itself stay as they are and win."""
    key = lambda r, m: (r["task"], r["sample"], r["order"], m, float(r["budget"]))
    out = [r for r in rows if r["method"] not in ("splice", "full_recompute")]
    have = {key(r, r["method"]) for r in out}
    for r in rows:
        for m in methods:
            shared = r["method"] == "full_recompute" or (float(r["budget"]) == 0.0 and r["method"] == splice_of(m) != m)
            if shared and key(r, m) not in have:
                out.append({**r, "method": m})
                have.add(key(r, m))
    return out


CONFIDENT = 0.5  # full prefill's answer margin above which a prompt is in the ``confident`` stratum


def in_stratum(row: dict, order: str, min_margin: float) -> bool:
    """Whether ``row`` counts in the summary's ``order``: ``listed``, ``shuffled``, ``both``, or
    ``confident`` (both orders, full prefill's answer margin (``answer_margin``) above
    ``min_margin``; a row of an older run without the margin is in no such stratum)."""
    if order == "confident":
        return row.get("full_margin") not in (None, "") and float(row["full_margin"]) > min_margin
    return order in (row["order"], "both")


def summarize(rows: list[dict], min_margin: float = CONFIDENT) -> list[dict]:
    """Per task, order (``listed``, ``shuffled``, ``both``, and ``confident``: both orders where full
    prefill's answer margin is above ``min_margin``), method and budget: agreement and the paired
    statistics against full prefill."""
    out = []
    keys = sorted({(r["task"], r["method"], float(r["budget"])) for r in rows})
    for task, method, budget in keys:
        for order in (*ORDERS, "both", "confident"):
            rs = [r for r in rows if (r["task"], r["method"], float(r["budget"])) == (task, method, budget)
                  and in_stratum(r, order, min_margin)]
            if not rs:
                continue
            n, agree = len(rs), sum(int(r["agree"]) for r in rs)
            # disagreements whose first generated token is full prefill's: the answer moved later, where
            # a refresh during decoding (KVShare) could still reach it; the others are decided at prefill
            late = sum(not int(r["agree"]) and int(r.get("first_token_same") or 0) for r in rs)
            same_text = sum(int(r["agree_text"]) for r in rs)
            pairs = [(int(r["full_correct"]), int(r["method_correct"])) for r in rs]
            full, got = sum(f for f, _ in pairs), sum(m for _, m in pairs)
            lost, won = sum(f > m for f, m in pairs), sum(m > f for f, m in pairs)
            lo, hi = kept_share.bootstrap_ci(pairs) if full else (None, None)
            alo, ahi = wilson(agree, n)
            speed = [float(r["speedup"]) for r in rs if r["speedup"] not in (None, "")]
            out.append(dict(task=task, order=order, method=method, budget=budget, prompts=n,
                            agreement=round(agree / n, 4), agreement_low=round(alo, 4), agreement_high=round(ahi, 4),
                            agreement_text=round(same_text / n, 4), late_flips=late,
                            full_accuracy=round(full / n, 4), method_accuracy=round(got / n, 4),
                            kept=round(got / full, 4) if full else None, kept_low=lo and round(lo, 4),
                            kept_high=hi and round(hi, 4), lost=lost, won=won,
                            mcnemar_p=round(kept_share.mcnemar_p(lost, won), 4),
                            first_token_kl=round(statistics.mean(float(r["first_token_kl"]) for r in rs), 5),
                            recomputed=round(statistics.mean(float(r["recomputed"]) for r in rs), 4),
                            speedup_median=round(statistics.median(speed), 3) if speed else None,
                            load_median=round(statistics.median(float(r["load"]) for r in rs), 2),
                            min_margin=min_margin if order == "confident" else None))
    return out


MARGINS = (0.0, 0.2, 0.4, 0.6, 0.8)


def by_margin(rows: list[dict], margins=MARGINS) -> list[dict]:
    """Per task, method, budget and margin ``x``: the prompts (both orders) where full prefill's
    answer margin is at least ``x``, and on how many of them the method agrees (rows without the
    margin are left out)."""
    out, rows = [], [r for r in rows if r.get("full_margin") not in (None, "") and r["method"] != "bf16_full"]
    for task, method, budget in sorted({(r["task"], r["method"], float(r["budget"])) for r in rows}):
        rs = [r for r in rows if (r["task"], r["method"], float(r["budget"])) == (task, method, budget)]
        for x in margins:
            sure = [r for r in rs if float(r["full_margin"]) >= x]
            if sure:
                k = sum(int(r["agree"]) for r in sure)
                lo, hi = wilson(k, len(sure))
                out.append(dict(task=task, method=method, budget=budget, min_margin=x, prompts=len(sure),
                                share=round(len(sure) / len(rs), 4), agreement=round(k / len(sure), 4),
                                agreement_low=round(lo, 4), agreement_high=round(hi, 4)))
    return out


def margin_markdown(table: list[dict]) -> str:
    """``by_margin``'s table: a row per task, method and budget, a column per margin (agreement, n)."""
    margins = sorted({t["min_margin"] for t in table})
    cells = {(t["task"], t["method"], t["budget"], t["min_margin"]): t for t in table}
    out = ["| task | method | budget | " + " | ".join(f"margin >= {x}" for x in margins) + " |",
           "|" + " --- |" * (3 + len(margins))]
    for task, method, budget in sorted({(t["task"], t["method"], t["budget"]) for t in table}):
        row = [f"{c['agreement']:.2f} ({c['prompts']})" if (c := cells.get((task, method, budget, x))) else ""
               for x in margins]
        out.append(f"| {task} | {method} | {budget:.2f} | " + " | ".join(row) + " |")
    return "\n".join(out)


def plot(summary: list[dict], path: Path) -> None:
    """Agreement against budget, one line per method; a row of panels per task, a panel per order
    (and the confident stratum); bfloat16's agreement drawn as a dashed line."""
    plt = pyplot()
    if plt is None:
        return
    tasks = sorted({s["task"] for s in summary})
    orders = [o for o in (*ORDERS, "confident") if any(s["order"] == o for s in summary)]
    fig, axes = plt.subplots(len(tasks), len(orders), figsize=(4.2 * len(orders), 3.6 * len(tasks)), squeeze=False)
    budgets = sorted({s["budget"] for s in summary if s["method"] != "bf16_full"})
    x = {b: i for i, b in enumerate(budgets)}
    for ax, (task, order) in zip(axes.flat, [(t, o) for t in tasks for o in orders]):
        here = [s for s in summary if (s["task"], s["order"]) == (task, order)]
        if not here:
            ax.set_visible(False)
            continue
        for i, m in enumerate(sorted({s["method"] for s in here} - {"bf16_full"})):
            pts = sorted((s["budget"], s["agreement"]) for s in here if s["method"] == m)
            ax.plot([x[b] for b, _ in pts], [a for _, a in pts], marker="o", label=m, color=f"C{i}")
        for s in here:
            if s["method"] == "bf16_full":
                ax.axhline(s["agreement"], color="k", ls="--", lw=1, label=f"bf16 vs fp32 ({s['prompts']})")
        ax.axhline(0.9, color="C3", ls=":", lw=1)
        ax.set_xticks(range(len(budgets)), ["full" if b >= 1 else f"{b:.0%}" for b in budgets])
        n = max((s["prompts"] for s in here), default=0)
        label = f"margin > {here[0]['min_margin']}" if order == "confident" else order
        ax.set(title=f"{task}, {label} (n={n})", xlabel="recomputed share of document tokens", ylim=(0, 1.02))
    for row in axes:
        row[0].set_ylabel("agreement with full prefill's answer")
    axes[0][-1].legend(fontsize=7, loc="lower right")
    save_figure(fig, path)


def plot_plane(summary: list[dict], path: Path) -> None:
    """The agreement-vs-TTFT plane: each method's budgets as a line of (median TTFT speedup over
    full prefill, agreement), both orders pooled, a panel per task."""
    plt = pyplot()
    if plt is None:
        return
    tasks = sorted({s["task"] for s in summary})
    fig, axes = plt.subplots(1, len(tasks), figsize=(5 * len(tasks), 4), squeeze=False)
    for ax, task in zip(axes[0], tasks):
        here = [s for s in summary if s["task"] == task and s["order"] == "both" and s["speedup_median"]]
        for i, m in enumerate(sorted({s["method"] for s in here} - {"bf16_full"})):
            pts = sorted((s["budget"], s["speedup_median"], s["agreement"]) for s in here if s["method"] == m)
            ax.plot([p[1] for p in pts], [p[2] for p in pts], marker="o", label=m, color=f"C{i}")
            for b, x, y in pts:
                ax.annotate("full" if b >= 1 else f"{b:.0%}", (x, y), fontsize=6, xytext=(2, 2),
                            textcoords="offset points")
        ax.set_xscale("log")
        ax.set(title=f"{task}, both orders", xlabel="TTFT speedup over full prefill (median, same run)",
               ylabel="agreement with full prefill's answer", ylim=(0, 1.02))
    axes[0][-1].legend(fontsize=7, loc="lower left")
    save_figure(fig, path)


def markdown(summary: list[dict]) -> str:
    """Agreement tables (a row per method, a column per budget), one per task and order, then the
    summary rows of both orders pooled at budgets up to 0.2 with their paired statistics: the
    results file's tables."""
    out = []
    budgets = sorted({s["budget"] for s in summary if s["method"] != "bf16_full"})
    for task in sorted({s["task"] for s in summary}):
        for order in (*ORDERS, "both", "confident"):
            here = {(s["method"], s["budget"]): s for s in summary if (s["task"], s["order"]) == (task, order)}
            if not here:
                continue
            n = max(s["prompts"] for s in here.values())
            what = (f"both orders where full prefill's answer margin > {next(iter(here.values()))['min_margin']}"
                    if order == "confident" else order)
            out += [f"\n**{task}, {what}** (n = {n} prompts; agreement with full prefill's answer)\n",
                    "| method | " + " | ".join("full" if b >= 1 else f"{b:.0%}" for b in budgets) + " |",
                    "| --- |" + " --- |" * len(budgets)]
            for m in sorted({k[0] for k in here} - {"bf16_full"}):
                cells = [f"{here[(m, b)]['agreement']:.2f}" if (m, b) in here else "" for b in budgets]
                out.append(f"| {m} | " + " | ".join(cells) + " |")
            if ("bf16_full", 1.0) in here and 1.0 in budgets:
                out.append("| bfloat16 full prefill |" + " |" * (len(budgets) - 1)
                           + f" {here[('bf16_full', 1.0)]['agreement']:.2f} |")
            elif ("bf16_full", 1.0) in here:  # no full column: the calibration under the table
                c = here[("bf16_full", 1.0)]
                out.append(f"\nbfloat16 full prefill against float32: {c['agreement']:.2f} (n = {c['prompts']})")
    out += ["\n| task | order | method | budget | n | agreement (95% CI) | same sentence | full / method correct | "
            "kept (95% CI) | lost / won | McNemar p | first-token KL | TTFT vs full |", "|" + " --- |" * 13]
    for s in summary:
        if s["order"] in ("both", "confident") and (s["budget"] <= 0.2 or s["method"] == "bf16_full"):
            kept = f"{s['kept']:.2f} ({s['kept_low']:.2f}-{s['kept_high']:.2f})" if s["kept"] is not None else "-"
            out.append(f"| {s['task']} | {s['order']} | {s['method']} | {s['budget']:.2f} | {s['prompts']} | "
                       f"{s['agreement']:.2f} ({s['agreement_low']:.2f}-{s['agreement_high']:.2f}) | "
                       f"{s['agreement_text']:.2f} | {s['full_accuracy']:.2f} / {s['method_accuracy']:.2f} | {kept} | "
                       f"{s['lost']} / {s['won']} | {s['mcnemar_p']:.3f} | {s['first_token_kl']:.3f} | "
                       f"{s['speedup_median']}x |")
    return "\n".join(out)


def paired(rows: list[dict], base: str) -> list[dict]:
    """Each method against ``base`` at the same budget on the same prompts (task, sample, order),
    both orders: prompts where both agree with full prefill, ``base`` only, the method only, and
    McNemar's exact p on those two; the TTFT ratio of both (median)."""
    key = lambda r: (r["task"], r["sample"], r["order"])
    got = {(r["method"], float(r["budget"]), key(r)): r for r in rows}
    out = []
    for task, method, budget in sorted({(r["task"], r["method"], float(r["budget"])) for r in rows if r["method"] != base}):
        pairs = [(int(got[(base, budget, k)]["agree"]), int(r["agree"]), float(got[(base, budget, k)]["speedup"]),
                  float(r["speedup"]))
                 for k, r in ((key(r), r) for r in rows if (r["task"], r["method"], float(r["budget"])) == (task, method, budget))
                 if (base, budget, k) in got]
        if not pairs:
            continue
        only_base, only = sum(a > b for a, b, _, _ in pairs), sum(b > a for a, b, _, _ in pairs)
        out.append(dict(task=task, method=method, against=base, budget=budget, prompts=len(pairs),
                        both=sum(a and b for a, b, _, _ in pairs), against_only=only_base, method_only=only,
                        mcnemar_p=round(kept_share.mcnemar_p(only_base, only), 4),
                        method_agreement=round(sum(b for _, b, _, _ in pairs) / len(pairs), 4),
                        against_agreement=round(sum(a for a, _, _, _ in pairs) / len(pairs), 4),
                        method_ttft_x=round(statistics.median(m for *_, m in pairs), 3),
                        against_ttft_x=round(statistics.median(a for _, _, a, _ in pairs), 3)))
    return out


# -- the run --------------------------------------------------------------------------------------
def read_rows(paths: list[Path]) -> list[dict]:
    """Per-prompt rows of earlier runs (split with ``--first``); a later file's row wins."""
    rows: dict[tuple, dict] = {}
    for path in paths:
        with open(path, newline="") as f:
            for r in csv.DictReader(f):
                rows[(r["task"], r["sample"], r["order"], r["method"], float(r["budget"]))] = score(r)
    fields = list(dict.fromkeys(k for r in rows.values() for k in r))  # an older run's file may lack a column
    return [{k: r.get(k, "") for k in fields} for r in rows.values()]


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2", help="alias (smollm2), Hugging Face id or local directory")
    ap.add_argument("--n", type=int, default=60, help="prompts per task (each asked in both orders)")
    ap.add_argument("--first", type=int, default=0, help="skip the first N samples of each task (split a run)")
    ap.add_argument("--tasks", nargs="+", default=["fact1", "fact2"], choices=fidelity_tasks.TASKS,
                    help="fact1, fact2 (distinct facts, the default); single, twohop (the earlier codes)")
    ap.add_argument("--methods", nargs="+", default=list(METHODS),
                    help=f"{', '.join(METHODS)}, or any engine selection name")
    ap.add_argument("--budgets", nargs="+", type=float, default=list(BUDGETS), help="fractions; 1 = full recompute")
    ap.add_argument("--default-budgets", nargs="+", type=float, default=[],
                    help="more budgets for the default selection alone (default, system:default, ...; "
                    "0.5 0.8: where it would meet 0.90)")
    ap.add_argument("--orders", nargs="+", default=list(ORDERS), choices=ORDERS)
    ap.add_argument("--doc-tokens", type=int, default=1000, help="about this many document tokens a prompt")
    ap.add_argument("--answer-tokens", type=int, default=ANSWER_TOKENS)
    ap.add_argument("--format", choices=FORMATS, help="chat (the tokenizer's chat template) or completion (a base "
                    "model: 'Question: ...?\\nAnswer:' after two solved examples); default: chat where the tokenizer "
                    "has a chat template")
    ap.add_argument("--calibrate", type=int, default=0, help="bfloat16 full prefill on the first N samples a task")
    ap.add_argument("--full-only", action="store_true",
                    help="full prefill's answers alone (a row per prompt, method full_prefill): a model's accuracy")
    ap.add_argument("--margin", type=float, default=CONFIDENT,
                    help="the confident stratum: full prefill's answer margin above this (summary order 'confident')")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--combine", nargs="+", type=Path,
                    help="summarize these per-prompt CSVs only (the rows of --methods and the ends they share)")
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--tag", default="")
    ap.add_argument("--markdown", action="store_true", help="also print the summary as Markdown tables")
    ap.add_argument("--against", help="also pair every method with this one at the same budget on the same prompts "
                    "(fidelity{tag}_paired.csv: agreed by both / this one only / the method only, McNemar p)")
    args = ap.parse_args(argv)
    for b in (*args.budgets, *args.default_budgets):
        if not 0.0 <= b <= 1.0:
            ap.error(f"--budgets: {b} is not a fraction in [0, 1]")
    return args


def check_methods(methods: list[str]) -> None:
    from promptcache.engine.prefill.recompute import SELECTIONS

    from . import engine_selections  # noqa: F401 (registers the studies' selections)

    def known(m: str) -> bool:  # an encoding prefix goes with an engine selection only
        enc, base = split_method(m)
        return (base in METHODS or base in SELECTIONS) and (enc == DEFAULT_ENCODING or METHODS.get(base) not in ("reference",
                                                                                                   "kvshare"))

    bad = [m for m in methods if not known(m)]
    if bad:
        raise SystemExit(f"--methods: unknown {', '.join(bad)} (known: {', '.join(METHODS)}, or an engine selection: "
                         f"{', '.join(SELECTIONS)})")


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    stem = f"fidelity{args.tag}"
    if args.combine:
        keep = {*args.methods, "splice", "full_recompute", "bf16_full", "full_prefill"}  # and the rows they share
        rows = [r for r in read_rows(args.combine) if r["method"] in keep]
        write_csv(f"{stem}.csv", rows, args.out)  # the pooled per-prompt rows, rescored
    else:
        check_methods(args.methods)
        rows = run(args, lambda rows: write_csv(f"{stem}.csv", rows, args.out))
        write_csv(f"{stem}.csv", rows, args.out)
    expanded = expand_shared(rows, args.methods)
    summary = summarize(expanded, args.margin)
    path = write_csv(f"{stem}_summary.csv", summary, args.out)
    margins = by_margin(expanded)
    if margins:
        write_csv(f"{stem}_margin.csv", margins, args.out)
    plot(summary, path.with_suffix(".png"))
    plot_plane(summary, path.with_name(f"{stem}_ttft.png"))
    for s in summary:
        if s["order"] in ("both", "confident"):
            print(f"{s['task']:7s} {s['order'][:4]} {s['method']:>14s} @{s['budget']:<5} n={s['prompts']:3d} agree {s['agreement']:.3f} "
                  f"[{s['agreement_low']:.2f}, {s['agreement_high']:.2f}]  acc {s['full_accuracy']:.2f}->"
                  f"{s['method_accuracy']:.2f}  lost {s['lost']:2d} won {s['won']:2d} p {s['mcnemar_p']:.3f}  "
                  f"KL {s['first_token_kl']:.3f}  TTFT x{s['speedup_median']}")
    if args.against:
        pairs = paired(expanded, args.against)
        if pairs:
            write_csv(f"{stem}_paired.csv", pairs, args.out)
        for q in pairs:
            print(f"{q['task']:7s} {q['method']:>20s} @{q['budget']:<5} vs {q['against']}: n={q['prompts']} agree "
                  f"{q['method_agreement']:.2f} vs {q['against_agreement']:.2f} (both {q['both']}, {q['against']} only "
                  f"{q['against_only']}, method only {q['method_only']}, p {q['mcnemar_p']:.3f})  TTFT x{q['method_ttft_x']} "
                  f"vs x{q['against_ttft_x']}")
    if args.markdown:
        print(markdown(summary))
        print("\nAgreement (prompts) where full prefill's answer margin is at least x, both orders:\n")
        print(margin_markdown(margins))
    print(f"wrote {path} and {path.with_suffix('.png').name}")
    return summary


def run(args, save) -> list[dict]:
    from promptcache import PromptCache
    from promptcache.models.loading import load_model

    torch.manual_seed(0)
    torch.set_num_threads(max(1, args.threads))
    pc = PromptCache.from_pretrained(args.model)
    eos = frozenset(pc.runner.eos_ids)
    fmt = args.format or default_format(pc.tokenizer)
    use_format(pc, fmt)
    bf16 = load_model(args.model, dtype="bfloat16")[0] if args.calibrate else None
    runs, rows = ([] if args.full_only else runs_for(args.methods, args.budgets, args.default_budgets)), []
    tasks = {t: fidelity_tasks.samples(t, args.first + args.n, doc_tokens=args.doc_tokens) for t in args.tasks}
    for k in range(args.first, args.first + args.n):  # task by task within a sample: a run stopped early has both
        for task in args.tasks:
            sample = tasks[task][k]
            for order in args.orders:
                p = Prompt(pc, sample, order == "shuffled", fmt)
                got = evaluate_prompt(p, runs, eos, args.answer_tokens, bf16 if k < args.calibrate else None)
                rows += got
                print(f"[{task} {k} {order}] full {got[0]['full_answer']!r}: " + " ".join(
                    f"{r['method']}@{r['budget']}:{r['agree']}" for r in got), flush=True)
            p.forget()
            save(rows)
    return rows


if __name__ == "__main__":
    main()
