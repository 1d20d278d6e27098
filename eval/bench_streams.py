"""Decoding streams while RAG questions are admitted: the streams' inter-token latency.

    nice -n 10 python -m eval.bench_streams --model smollm2 [--streams 16] [--questions 8]
                                            [--doc-tokens 250] [--k 4] [--budget 512]

``--streams`` requests decode greedily (EOS ignored) on one engine; once every one of them has
produced ``--settle`` tokens, ``--questions`` default-mode ``DocumentStore`` questions (documents
reused out of their context, ``recompute="auto"``) over ``--k`` documents of ~``--doc-tokens``
tokens each are submitted at once. The time between two consecutive tokens of a stream (read
when the step that produced them returns) is recorded from that moment until every question has
its first token; p50, p99 and max of those gaps, and the gaps of the same streams before the
questions came (the steady state), are the figures. A question whose recomputed tokens run as
prefill rows of the step is chunked (``--budget`` tokens a step, ``ServingConfig``); one that
is prefilled whole inside admission holds every stream for its whole prefill.

One row of ``bench_streams{--tag}.csv`` (and a ``.png`` of the gaps over time) in ``--out``
(default eval/results/). Time it with ``OMP_NUM_THREADS`` fixed and note the load: the machine
is shared.
"""

from __future__ import annotations

import argparse
import random
import time
from pathlib import Path

from .common import RESULTS, add_model_args, pyplot, save_figure, save_table

SYSTEM = "Answer the question from the documents only."


def percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def document_texts(tok, n: int, tokens: int, seed: int = 0) -> dict[str, str]:
    """``n`` documents of about ``tokens`` tokens each (deterministic words)."""
    from promptcache.bench import sentences

    out = {}
    for i in range(n):
        text = f"Document {i}. " + sentences(tokens, seed=seed + i)
        while len(tok.encode(text)) > tokens:
            text = text[: int(len(text) * 0.95)]
        out[f"d{i:02d}"] = text
    return out


def run(args) -> tuple[dict, list[tuple[float, float]]]:
    from promptcache import EngineConfig, PromptCache, RunnerConfig
    from promptcache.engine.decoding.sampling import SamplingParams
    from promptcache.engine.prefill.config import ServingConfig
    from promptcache.engine.serving_core.request import Request
    from promptcache.models.loading import load_model
    from promptcache.rag import DocumentStore

    model, tok = load_model(args.model, device=args.device, dtype=args.dtype)
    pc = PromptCache(model, tok, EngineConfig(runner=RunnerConfig(packed_linear=args.packed)))
    engine = pc.engine(ServingConfig(max_num_batched_tokens=args.budget))
    store = DocumentStore(pc, system=SYSTEM)  # documents encoded after the requests' prefix
    texts = document_texts(tok, args.docs, args.doc_tokens)
    for doc_id, text in texts.items():
        store.add(doc_id, text)
    rng = random.Random(0)
    store.generate("Warm up.", rng.sample(sorted(texts), args.k), SYSTEM, max_new_tokens=2, temperature=0.0)
    # a request's blocks are reserved for its whole generation at admission: long enough to
    # outlast the questions' admission, short enough that streams and questions fit the pool
    stream_params = SamplingParams(max_new_tokens=args.stream_tokens, temperature=0.0, ignore_eos=True)
    streams = [Request(pc.prompt_spec(pc.chat_ids([{"role": "user", "content": f"Tell a long story number {i}."}])),
                       stream_params, pc.tokenizer) for i in range(args.streams)]
    for r in streams:
        engine.submit(r)
    times: dict[int, list[float]] = {r.id: [] for r in streams}

    def step() -> None:
        outs = engine.step()
        now = time.perf_counter()
        for o in outs:
            if o.request_id in times and o.token_id is not None:
                times[o.request_id].append(now)

    while min(len(t) for t in times.values()) < args.settle:
        step()
        failed = [r.error for r in streams if r.error is not None]
        if failed:
            raise failed[0]
    arrived = time.perf_counter()
    questions = [Request(store.prompt(f"What does document {i} say?", rng.sample(sorted(texts), args.k), SYSTEM),
                         SamplingParams(max_new_tokens=args.answer_tokens, temperature=0.0), pc.tokenizer)
                 for i in range(args.questions)]
    for q in questions:
        engine.submit(q)
    while not all(q.prefill is not None or q.finished for q in questions):
        step()
    first_tokens = time.perf_counter()
    for q in questions:
        if q.error is not None:
            raise q.error
    while not all(q.finished for q in questions):
        step()
    for r in streams:
        r.cancel()
    while engine.has_work:
        engine.step()
    gaps, before, series = [], [], []
    for t in times.values():
        for a, b in zip(t, t[1:]):
            if b > arrived and a < first_tokens:
                gaps.append(b - a)
                series.append((b - arrived, b - a))
            elif b <= arrived and len(before) < 10_000:
                before.append(b - a)
    prompt_tokens = [q.prefill.prompt_tokens for q in questions]
    row = dict(model=args.model, dtype=args.dtype, streams=args.streams, questions=args.questions, k=args.k,
               question_tokens=round(sum(prompt_tokens) / len(prompt_tokens)),
               recomputed=round(sum(q.prefill.recomputed_tokens for q in questions) / len(questions)),
               budget=args.budget, gaps=len(gaps), before_p50_ms=round(1e3 * percentile(before, 0.5), 1),
               p50_ms=round(1e3 * percentile(gaps, 0.5), 1), p99_ms=round(1e3 * percentile(gaps, 0.99), 1),
               max_ms=round(1e3 * max(gaps), 1), p99_over_p50=round(percentile(gaps, 0.99) / percentile(gaps, 0.5), 2),
               admitted_s=round(first_tokens - arrived, 2))
    return row, series


def plot(series, path: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.scatter([t for t, _ in series], [1e3 * g for _, g in series], s=4)
    ax.set_xlabel("seconds since the questions arrived")
    ax.set_ylabel("inter-token gap of a stream (ms)")
    ax.set_title("Streams decoding while RAG questions are admitted")
    save_figure(fig, path)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_model_args(ap, "smollm2")
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--questions", type=int, default=8)
    ap.add_argument("--docs", type=int, default=16)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--doc-tokens", type=int, default=250)
    ap.add_argument("--answer-tokens", type=int, default=8)
    ap.add_argument("--stream-tokens", type=int, default=600, help="tokens each stream may decode (max_new_tokens)")
    ap.add_argument("--settle", type=int, default=8, help="tokens every stream decodes before the questions come")
    ap.add_argument("--budget", type=int, default=512, help="tokens an engine step may run (ServingConfig)")
    ap.add_argument("--packed", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--out", default=str(RESULTS))
    ap.add_argument("--tag", default="")
    args = ap.parse_args(argv)
    row, series = run(args)
    print(", ".join(f"{k}={v}" for k, v in row.items()))
    save_table(f"bench_streams{args.tag}", [row], args.out, lambda rows, path: plot(series, path))


if __name__ == "__main__":
    main()
