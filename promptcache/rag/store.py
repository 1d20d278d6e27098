"""``DocumentStore``: documents reused in any subset and order (default), or as exact chains.

The document API and its prompt plans; the folder a store persists to is ``folder.py``,
``Document`` and the errors ``documents.py``. Chains are keyed and looked up with the engine's
chain mechanism (``engine.serving_core.chains``: ``chained``, ``stored_run``), the one the server's prefix reuse
uses.

    store = DocumentStore(pc, "docs.pcache", system="Answer briefly.")   # persisted; reopened with its states
    store.add("paris", "Paris is the capital of France ...", {"source": "wiki"})
    out = store.generate("What is Paris famous for?", doc_ids=["paris"])  # the store's system text

The prompt is written as the text would be: a cached prefix (BOS, the chat template's header,
the system text, the user header), then each document followed by ``separator`` ("\n\n"),
then the question and the template's tail. Three modes (``DocumentStore.mode``; docs/rag.md;
the default is the last, reuse):

* **Exact chains** (``exact=True``). A request's documents are cached as a chain (RAGCache's knowledge
  tree): each document's states are computed after the prefix and the documents before it in that
  request, and stored under ``hash(parent key, document digest, start position, separator)``. A
  later request whose leading documents match reuses them; the rest (and the question) run in one
  forward and are added to the tree. The answer equals a plain prefill of the same tokens
  (``res.exact``). Chain states live in the engine's store under its budgets and LRU; they persist
  where the store does (a named ``StoreConfig.spill_dir``: indexed at start, written at
  ``pc.store.persist()``), otherwise a reopened store rebuilds them on first use. ``canonical_order=True`` sorts a
  request's documents by id first, so requests retrieving the same set in any order share a chain.
  Works with every supported family (nothing is relocated); a model whose states cannot be moved
  (learned absolute positions) gets this mode by default.
* **Independent** (``independent=True``, the paper's position-independent modules). Each document
  is encoded once (see *Where documents are encoded* below), stored and persisted; at prompt time
  it is moved to its position exactly (``models.relocate``); the separators and the question run
  through the model. Cheapest to reuse (any subset, any order), but a document never sees the documents before it, which costs answers (at ``recompute=0`` far fewer than full prefill's on
  the retrieval study). ``recompute=r`` (the engine's selective recompute; the default selection
  ``qmatch`` recomputes the documents the question names, then the others from the first) is the
  quality knob; small fractions kept the most answers (figures: eval/results/quality.md). The default, ``recompute="auto"``,
  recomputes 0.15 of the drifted documents' tokens (``engine.prefill.recompute.AUTO_FRACTION``).
  Rotary and ALiBi models only (learned absolute positions cannot be moved).
  ``attach_separator=True`` stores each document *with* its separator as one unit, encoded alone
  (the separator then sees only its own document, not the documents before it): a prompt is then
  its cached prefix, cached units and one run of new text (the question), the shape a server that
  can be handed only a prefix of stored states can place (``integrations.vllm``: vLLM's KV
  connector). Off by default: it changes what the separators attend to.
* **Reuse** (the default, ``reuse``; ``hybrid=True`` names it too): the longest stored chain of
  the request's leading documents (exact; chains are written by chain stores on the same engine),
  then the other documents as in ``independent``, their drift recomputed (``recompute``, default
  ``"auto"``). Exact when the whole request is a stored chain. It does not write chains: past the
  chain its states are approximate.

**Where documents are encoded** (``encode_prefix``; issue 51). By default each document is encoded
after the prefix of a request with the store's ``system`` text (BOS, the chat template's header,
that system text, the user header; no system text where ``system`` is None), only the document's
own states kept. Requests that pass no ``system`` use the store's, so their prefix is
``encode_prefix`` and their first document sits where it was encoded: a plain prefill's states,
exact and never recomputed; a request with another system text (``""``: none) reads every
document approximately, as the others. The prefix keeps the attention sink where the prompt has it,
not on a document's first token mid-prompt: on the fidelity study (60 prompts a task, 15%
recomputed) it agreed with full prefill as often as documents encoded alone on SmolLM2 and
significantly more often on Gemma 3 270M, with a lower first-token KL and a higher TTFT ratio on
both (docs/rag.md). ``prefixed=False`` encodes documents alone from position 0 (the default before);
``prefixed=True`` asks for the default's encoding explicitly; ``prefixed="..."`` after the prefix
of a request with that system text (it wins over ``system`` for the encoding).
``attach_separator=True`` units are encoded alone (``prefixed`` left out or False; True or a text
with it is a ValueError). A folder records its encoding: a store opening one with ``prefixed`` and
``system`` left out takes the folder's (logged); an explicit other one is refused
(``DocumentStoreError`` naming both) unless ``reencode=True``.

Works with any retriever: the caller passes document ids. Keys come from ``promptcache.keys``
(``alone_key``, salted by the namespace), so documents and the prefix live in the engine's store
beside schema modules.

Persistence (``path``; ``folder.py`` has the format). A store with a ``path`` encodes and persists
every document's independent states (in every mode, so a folder serves any); a reopened store
serves them from disk at once. An in-memory exact store encodes nothing at ``add``.
Reopening checks every field of the index (a wrong type, a null or a missing field is a
``DocumentStoreError`` naming the file, the document and the field; nothing is changed), the
model and tokenizer (refused naming the part unless ``reencode=True``), and registers each file
with what it must hold (key, dtype, shape, model, checksum); the data is verified on first read.
The folder heals (``_stored``): a state that fails verification is dropped from the store, logged,
encoded again from the document's text and its file rewritten atomically, whether a question
reads it or ``add`` of the same document finds it (``add`` verifies a known document's file); a
missing file is logged at opening and rebuilt the same way. A document whose text is known
never fails for its states.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from pathlib import Path

import torch

from ..engine import Generation, PrefillResult, PromptCache, PromptSpec, TokenPrompt
from ..engine.serving_core.chains import chained, stored_run
from ..engine.prefill.plan import PrefillPlan, Segment
from ..engine.prefill.recompute import check_recompute, check_selection, recompute_request
from ..engine.prefill.window_reads import WholeStates, whole_segment, with_whole_states
from ..keys import alone_key, chain_root, token_digest
from ..layout import PromptLayout, Span
from ..models.relocate import check_relocatable, relocate
from ..store import StoreError
from .documents import Document, DocumentStoreError, UnknownDocumentError
from .prompt import DocumentPrompt
from .folder import DocumentFolder

__all__ = ["EXACT", "INDEPENDENT", "REUSE", "DocumentStore"]

log = logging.getLogger(__name__)

EXACT, INDEPENDENT, REUSE = "exact", "independent", "reuse"  # DocumentStore.mode


class DocumentStore:
    """Documents for RAG prompts; see the module docstring. Default: every document reused in any
    subset and order (``mode == "reuse"``); ``exact``: chains only; ``independent``: no chain
    lookup; ``canonical_order``: chains order a request's documents by id; ``separator``: text
    after each document; ``selection``: which reused tokens ``recompute`` chooses (an engine
    selection, default the engine's ``config.recompute.selection``: ``qmatch``; ``ape`` adds APE's
    temperature, docs/rag.md has what each kept); ``system``: the system text of requests that
    pass none; ``prefixed``: what documents are encoded after (``encode_prefix``). Left out, the
    prefix of a request with ``system`` (on a folder: the encoding it records; with
    ``attach_separator``: nothing); ``True`` the same, asked explicitly; ``False`` nothing (alone
    from position 0); a string the prefix of a request with that system text."""

    def __init__(self, pc: PromptCache, path: str | Path | None = None, namespace: str | None = None,
                 reencode: bool = False, *, exact: bool = False, independent: bool = False, hybrid: bool = False,
                 canonical_order: bool = False, separator: str = "\n\n", selection: str | None = None,
                 attach_separator: bool = False, prefixed: bool | str | None = None, system: str | None = None):
        if sum(map(bool, (exact, independent, hybrid))) > 1:
            raise ValueError("DocumentStore: exact=True, independent=True and hybrid=True exclude each other "
                             "(pick one mode)")
        if not exact and not independent and not hybrid and not pc.adapter.can_relocate():
            exact = True  # learned absolute positions: documents cannot be moved, chains are the only reuse
            log.info("DocumentStore: %s states cannot be relocated; documents are exact chains",
                     pc.adapter.config.model_type)
        if not exact:
            check_relocatable(pc.adapter)
        self.pc, self.namespace = pc, pc.config.namespace_for(namespace)
        self.mode = EXACT if exact else INDEPENDENT if independent else REUSE
        self.selection = check_selection(selection or pc.config.recompute.selection)
        self.canonical_order = bool(canonical_order)
        self._sep = tuple(pc.tok.encode(separator)) if separator else ()
        self.attach_separator = bool(attach_separator) and bool(self._sep)
        if system is not None and not isinstance(system, str):
            raise TypeError(f"DocumentStore: system must be a text or None, got {type(system).__name__}")
        self.system = system or None  # the system text of requests that pass none
        self._warned_prefix = False  # a request with another prefix than the encoding's was logged
        self._encoding_system: str | None = None  # a request system text seen to match encode_prefix
        asked = self._asked_prefix(prefixed)
        self.path = Path(path) if path is not None else None
        self.folder = DocumentFolder(self.path, pc, self._suffix) if self.path is not None else None
        opened = self.folder is not None and self.folder.exists()
        recorded = self.folder.recorded_prefix() if opened else None  # None: its tokenizer is another
        if asked is None and recorded is not None:  # the default on a folder: the encoding it holds
            asked = recorded
            log.info("DocumentStore: %s holds documents encoded %s; opened with that encoding (the folder's setting)",
                     self.path, self.folder.describe(recorded))
        # what each document is encoded after: the prefix of a request with the store's system text, or nothing
        self.encode_prefix = asked if asked is not None else self._prefix(self.system)[0]
        # the namespace of documents' state keys: a prefixed encoding's tokens salt it (worked out once)
        self._state_namespace = (f"{self.namespace}|after:{token_digest(self.encode_prefix)}" if self.encode_prefix
                                 else self.namespace)
        if self.folder is not None:
            self.folder.encode_prefix = self.encode_prefix  # what its index records, and what it checks
        self._docs: dict[str, Document] = {}
        self.whole_states = WholeStates()  # window-aware storage: documents encoded again, kept
        self._lock = threading.RLock()
        if opened:
            self._open(reencode)
        self.source = pc.core.planner.add_source(self)  # the name its prompts carry (held weakly there)

    def _asked_prefix(self, prefixed) -> tuple[int, ...] | None:
        """The tokens ``prefixed`` and ``system`` ask documents to be encoded after, or None where
        neither asks (the default: a folder's own encoding, else after the store's ``system``)."""
        if prefixed is not None and not isinstance(prefixed, (bool, str)):
            raise TypeError(f"DocumentStore: prefixed must be True, False or a system text, got {type(prefixed).__name__}")
        if prefixed == "":
            raise ValueError("DocumentStore: prefixed='' names no system text; pass prefixed=True (after the prefix "
                             "of a request with the store's system text) or prefixed=False (alone)")
        if self.attach_separator and prefixed:
            raise ValueError("DocumentStore: attach_separator=True stores units encoded alone from position 0 (what "
                             "vLLM's connector serves); prefixed=True or a system text encodes documents after a "
                             "prefix: pick one (prefixed left out or False with attach_separator)")
        if self.attach_separator or prefixed is False:
            return ()
        if prefixed is None and self.system is None:
            return None
        return self._prefix(prefixed if isinstance(prefixed, str) else self.system)[0]

    @property
    def _suffix(self) -> tuple[int, ...]:
        """Token ids stored after each document in its unit: its separator with ``attach_separator``."""
        return self._sep if self.attach_separator else ()

    def unit_ids(self, doc: Document) -> tuple[int, ...]:
        """Token ids of ``doc``'s stored unit (encoded after ``encode_prefix``): the document, and its
        separator when the store has ``attach_separator`` (then encoded alone from position 0)."""
        return doc.token_ids + self._suffix

    @property
    def exact(self) -> bool:
        """Chains only: every answer equals a plain prefill's (``exact=True``)."""
        return self.mode == EXACT

    @property
    def independent(self) -> bool:
        """Documents from their independent states only, no chain lookup (``independent=True``)."""
        return self.mode == INDEPENDENT

    @property
    def hybrid(self) -> bool:
        """The default mode: a stored chain where one covers the leading documents, then each other
        document from its independent states (``hybrid=True`` names it)."""
        return self.mode == REUSE

    # -- documents -------------------------------------------------------------------------------
    def add(self, doc_id: str, text: str, metadata: dict | None = None) -> Document:
        """Register a document: encoded once (``_encode``), stored (and persisted where
        the store has a ``path``), except in an in-memory exact store, whose chains are built by
        requests. Re-adding an id replaces it; identical text is encoded once."""
        if not isinstance(doc_id, str) or not doc_id:
            raise ValueError(f"a document id must be a non-empty string, got {doc_id!r}")
        doc = self._document(doc_id, text, metadata)
        if not self.exact or self.path is not None:
            self._stored(doc, verify=True)
        with self._lock:
            self._docs[doc_id] = doc
            self._save_index()
        return doc

    def _document(self, doc_id: str, text: str, metadata: dict | None) -> Document:
        ids = self.pc.tok.encode(text)
        if not ids:
            raise ValueError(f"document '{doc_id}' is empty")
        return Document(doc_id, text, dict(metadata or {}), len(ids), token_digest(ids), tuple(ids))

    def remove(self, doc_id: str) -> None:
        with self._lock:
            self._get(doc_id)
            del self._docs[doc_id]
            self._save_index()

    def get(self, doc_id: str) -> Document:
        return self._get(doc_id)

    def ids(self) -> list[str]:
        return list(self._docs)

    def __contains__(self, doc_id: str) -> bool:
        return doc_id in self._docs

    def __len__(self) -> int:
        return len(self._docs)

    # -- prompts ---------------------------------------------------------------------------------
    def layout(self, question: str, doc_ids: list[str], system: str | None = None) -> PromptLayout:
        """Spans of the prompt in order: cached prefix, documents (and separators) at their
        positions, new question."""
        docs = self._order(doc_ids)
        return self._layout(question, docs, self._system(system), 0 if self.independent else len(docs))[0]

    def prefill(self, question: str, doc_ids: list[str], system: str | None = None, reserve: int = 0,
                keep_cache: bool = False, *, recompute: float | str | None = None) -> PrefillResult:
        """Next-token logits after the prompt. ``recompute`` (reuse and independent stores; None:
        the engine's ``config.recompute.fraction``, default ``"auto"``): ``"auto"`` or the fraction of the
        reused documents' tokens computed afresh in the prompt's context (1.0 equals a plain
        prefill). Chains are exact and have nothing to recompute."""
        t0 = time.perf_counter()
        r, system = self.pc.recompute_fraction(recompute), self._system(system)
        docs = self._order(doc_ids)
        if not self.exact:  # reuse: the longest stored chain first
            return self._prefill_independent(question, docs, system, reserve, keep_cache, t0, r)
        return self._prefill_chain(question, docs, system, reserve, keep_cache, t0)

    def served_layout(self, question: str, doc_ids: list[str], system: str | None = None) -> PromptLayout:
        """``layout(question, doc_ids, system)`` with every cached span's states stored (in the
        engine's store under ``state_key``, and persisted in the folder where the store has one):
        the prefix (encoded now if it is new) and each document's unit (its separator attached),
        then one run of new text. For a server that reads them (``integrations.vllm``); a store
        without ``attach_separator`` raises ``DocumentStoreError``."""
        if not self.attach_separator:
            raise DocumentStoreError("only a store whose documents carry their separator (DocumentStore(pc, ..., "
                                     "attach_separator=True)) can be served elsewhere")
        layout = self.layout(question, doc_ids, system)
        self._prefix_state(layout, [], {})
        return layout

    def prompt(self, question: str, doc_ids: list[str], system: str | None = None, *,
               recompute: float | str | None = None, layout: PromptLayout | None = None) -> PromptSpec:
        """The question over ``doc_ids`` as a request's prompt, frozen data (checked now: unknown
        ids fail here). A reuse store's is a ``DocumentPrompt``, planned at admission
        (``plan_prompt``); an exact store's is a ``TokenPrompt`` of its layout (laid out once, here;
        ``layout``: ``self.layout(question, doc_ids, system)`` when the caller has it) that reuses
        the prefix chains of the engine that runs it."""
        if recompute is not None:
            check_recompute(recompute)
        if not self.exact:  # planned at admission (``plan_prompt``)
            self._order(doc_ids)
            return DocumentPrompt(self.source, question, tuple(doc_ids), self._system(system), recompute)
        if layout is None:
            layout = self.layout(question, doc_ids, system)  # checks the ids too
        return TokenPrompt(tuple(layout.token_ids), self.namespace, reuse=True, layout=layout)

    def plan_prompt(self, spec: DocumentPrompt) -> PrefillPlan:
        """The planner's call for this store's ``DocumentPrompt`` (``engine/planner.py``)."""
        return self.plan(spec.question, list(spec.doc_ids), spec.system, recompute=spec.recompute)

    def generate(self, question: str | list[tuple[str, list[str]]], doc_ids: list[str] | None = None,
                 system: str | None = None, max_new_tokens: int = 64, *, recompute: float | str | None = None,
                 **sampling) -> Generation | list[Generation]:
        """Answer ``question`` with the documents ``doc_ids`` (any retriever's ids; in that order
        unless ``canonical_order``). A list of ``(question, doc_ids)`` pairs instead is a batch:
        continuously batched on the engine's serving core, a list of Generations in order."""
        if isinstance(question, str):
            if doc_ids is None:
                raise TypeError("DocumentStore.generate(question, doc_ids): doc_ids is missing")
            return self.pc.generate(self.prompt(question, doc_ids, system, recompute=recompute),
                                    max_new_tokens=max_new_tokens, **sampling)
        if doc_ids is not None:
            raise TypeError("DocumentStore.generate([(question, doc_ids), ...]): a batch carries its doc_ids")
        prompts = [self.prompt(q, ids, system, recompute=recompute) for q, ids in question]
        return self.pc.generate(prompts, max_new_tokens=max_new_tokens, **sampling)

    def stream(self, question: str, doc_ids: list[str], system: str | None = None, max_new_tokens: int = 64,
               *, recompute: float | str | None = None, **sampling):
        return self.pc.stream(self.prompt(question, doc_ids, system, recompute=recompute),
                              max_new_tokens=max_new_tokens, **sampling)

    # -- internals -------------------------------------------------------------------------------
    def _system(self, system: str | None) -> str | None:
        """A request's system text: its own, or the store's where it passes none ("": none at all).
        The first request whose prefix is not the one documents were encoded after is logged (a
        WARNING, once a store): its first document is then read approximately, and on the fidelity
        study such prompts agreed less often on SmolLM2's single-hop task (docs/rag.md)."""
        if system is None:
            return self.system
        if self._warned_prefix or not self.encode_prefix or self.exact or system == self._encoding_system:
            return system
        if self._prefix(system)[0] == self.encode_prefix:  # tokenized once, not on every request
            self._encoding_system = system
        else:
            self._warned_prefix = True
            log.warning("DocumentStore %s: a request carries the system text %r, but the store's documents are "
                        "encoded after another prefix (its first document is read approximately); give the store "
                        "the prompts' system text: DocumentStore(..., system=...)", self.path or self.namespace,
                        system[:60])
        return system

    def _get(self, doc_id: str) -> Document:
        doc = self._docs.get(doc_id)
        if doc is None:
            known = ", ".join(list(self._docs)[:10]) + (" ..." if len(self._docs) > 10 else "")
            raise UnknownDocumentError(
                f"unknown document id '{doc_id}' (the store has {len(self._docs)} documents: {known or 'none'})")
        return doc

    def _order(self, doc_ids: list[str]) -> list[Document]:
        docs = [self._get(d) for d in doc_ids]
        return sorted(docs, key=lambda d: d.id) if self.canonical_order and not self.independent else docs

    def _key(self, token_ids, namespace: str | None = None) -> str:
        """Store key of tokens encoded alone from position 0 (``namespace``: this store's)."""
        return alone_key(token_ids, self.pc.model_key, self.namespace if namespace is None else namespace)

    def state_key(self, token_ids) -> str:
        """The engine store's key of a document's unit (``unit_ids``) or of a prompt prefix: encoded
        alone from position 0, or, for a ``prefixed`` store's documents, after ``encode_prefix``
        (its tokens salt the key, so the two encodings never share one)."""
        return self._key(token_ids, self._state_namespace)

    def _encode(self, token_ids) -> torch.Tensor:
        """A document's independent states [L, 2, H, n, D]: after ``encode_prefix`` (a request's
        prefix: BOS, the chat template's header and system text, where the model puts its attention
        sink) at positions ``len(encode_prefix)``.., only the document's own states kept; alone from
        position 0 where it is empty."""
        n = len(self.encode_prefix)
        kv = self.pc.encode_span(list(self.encode_prefix) + list(token_ids))
        return kv[:, :, :, n:].contiguous() if n else kv

    def _prefix(self, system: str | None) -> tuple[tuple[int, ...], list[str]]:
        """A request's cached prefix (BOS, the chat template's header, the system text (if any), the
        user header) and the template's glue strings it was built from (its last one ends the prompt)."""
        tok = self.pc.tok
        glue = tok.render_roles(["system", "user"] if system else ["user"], add_generation_prompt=True)
        prefix = list(tok.bos_ids) + tok.encode(glue[0])
        if system:
            prefix += tok.encode(system) + tok.encode(glue[1])
        return tuple(prefix), glue

    def _layout(self, question: str, docs: list[Document], system: str | None,
                chained: int) -> tuple[PromptLayout, int]:
        """(layout, prefix tokens). The first ``chained`` documents are chain spans (the document
        and its separator); the others independent (the separator a new span after each). Token
        IDs and positions are the same either way."""
        tok = self.pc.tok
        prefix, glue = self._prefix(system)
        spans = [Span("cached", "(prefix)", tuple(prefix), tuple(range(len(prefix))), "glue")] if prefix else []
        pos = len(prefix)
        for n, d in enumerate(docs):
            alone = n >= chained and not self.attach_separator  # an attached separator is in the unit
            ids = d.token_ids if alone else d.token_ids + self._sep
            spans.append(Span("cached", f"doc:{d.id}", ids, tuple(range(pos, pos + len(ids))), "module"))
            pos += len(ids)
            if alone and self._sep:
                spans.append(Span("new", "(separator)", self._sep, tuple(range(pos, pos + len(self._sep))), "text"))
                pos += len(self._sep)
        q = tok.encode(question) + tok.encode(glue[-1])
        spans.append(Span("new", "(question)", tuple(q), tuple(range(pos, pos + len(q))), "text"))
        return PromptLayout(spans, None), len(prefix)

    def _prefix_state(self, layout: PromptLayout, cached: list, hits: dict) -> None:
        first = layout.spans[0]
        if first.name != "(prefix)":
            return
        key = self._key(first.token_ids)
        if key not in self.pc.store:
            self._put(key, self.pc.encode_span(list(first.token_ids)))
        kv, tier = self.pc.store.get(key)
        if self.folder is not None and self.attach_separator and not self.folder.has_prefix(first.token_ids):
            with self._lock:  # persisted for servers that read the folder (integrations.vllm)
                self.folder.write_prefix(first.token_ids, kv)
                self._save_index()
        hits[tier] = hits.get(tier, 0) + 1
        cached.append(Segment(key, kv, torch.arange(len(first.token_ids), device=self.pc.device)))

    def plan(self, question: str, doc_ids: list[str], system: str | None = None, *,
             recompute: float | str | None = None) -> PrefillPlan:
        """A reuse (independent or hybrid) store's prompt as the serving scheduler runs it: the
        prefix, the stored chain and the documents read from stored states, the drifted tokens
        ``recompute`` chooses and the new text as the request's prefill rows in prompt order
        (``engine/prefill/ordered.py``). An exact store's prompts are token chains (``TokenPrompt``)."""
        if self.exact:
            raise DocumentStoreError("an exact (chain) store's prompts are planned as token chains (TokenPrompt)")
        plan, req = self._independent_plan(question, self._order(doc_ids), self._system(system),
                                           self.pc.recompute_fraction(recompute))
        return plan if req is None else self.pc.runner.recompute_plan(plan, req)

    def _found(self, question: str, docs: list[Document], system: str | None) -> tuple:
        """(states, tier hits, documents) of the prefix and the longest stored chain of the leading
        documents (hybrid stores; the prefix alone otherwise)."""
        chain, _ = self._layout(question, docs, system, len(docs))
        cached, hits = self._chain_states(chain, docs if self.hybrid else [])
        return cached, hits, len(cached) - (chain.spans[0].name == "(prefix)")

    def _prefill_independent(self, question: str, docs: list[Document], system: str | None, reserve: int,
                             keep_cache: bool, t0: float, r: float) -> PrefillResult:
        plan, req = self._independent_plan(question, docs, system, r)
        return self.pc.run_spliced(plan, t0, reserve, keep_cache, recompute=req)

    def _independent_plan(self, question: str, docs: list[Document], system: str | None, r: float):
        """(plan, recompute request or None): the prefix and the leading documents' stored chain
        (exact; ``_chain_states``), the other documents from their independent states moved to
        their positions (drifted: ``r`` of their tokens to recompute); separators and the question
        run."""
        cached, hits, chained = self._found(question, docs, system)
        layout, _ = self._layout(question, docs, system, chained)
        n_exact = sum(seg.n for seg in cached)
        more, more_hits = self._independent_states(layout, chained)
        # a document encoded after exactly this prompt's prefix, first in it, holds a plain prefill's states
        first_exact = (chained == 0 and bool(docs) and bool(self.encode_prefix)
                       and layout.spans[0].token_ids == self.encode_prefix)
        n_exact += more[0].n if first_exact else 0
        cached += more
        for tier, n in more_hits.items():
            hits[tier] = hits.get(tier, 0) + n
        new = [s for s in layout.spans if s.kind == "new"]
        drifted = chained + first_exact < len(docs)
        req = recompute_request(layout, n_exact, r, self.selection, False) \
            if r > 0 and drifted else None  # r = 0: the paper's splice, whatever the selection
        plan = PrefillPlan(segments=cached, new_ids=[t for s in new for t in s.token_ids],
                           new_pos=[p for s in new for p in s.position_ids], max_position=max(layout.position_ids),
                           exact=not drifted, layout=layout, hit_tiers=hits)
        return with_whole_states(plan, self.pc.store.windows, functools.partial(self._whole, docs), req), req

    def _whole(self, docs: list[Document], seg: Segment) -> Segment:
        """A document's segment read from its states encoded again (window-aware storage kept less
        of them than a recomputed token inside it reads: ``prefill/window_reads.py``)."""
        at = len(self.encode_prefix)
        doc = next((d for d in docs if seg.key == f"{self.state_key(self.unit_ids(d))}@{at}"), None)
        if doc is None:  # the prefix and chained documents are read only after their last token
            raise DocumentStoreError(f"stored states {seg.key[:16]}... are read before their last token")
        kv = self.whole_states.get(seg.key, lambda: self._encode(self.unit_ids(doc))).to(
            device=seg.kv.device, dtype=seg.kv.dtype)
        return whole_segment(seg, kv, functools.partial(relocate, self.pc.adapter, kv, seg.shift) if seg.shift else None)

    def _independent_states(self, layout: PromptLayout, skip: int):
        """(stored segments, tier hits): each document after the first ``skip``
        moved to its start."""
        cached, hits, device = [], {}, self.pc.device
        for span in [s for s in layout.spans if s.name.startswith("doc:")][skip:]:
            key = self.state_key(span.token_ids)
            kv, tier = self._stored(self._docs[span.name.removeprefix("doc:")])
            hits[tier] = hits.get(tier, 0) + 1
            start = span.position_ids[0]
            positions = torch.arange(start, start + len(span), device=device)
            at = len(self.encode_prefix)  # where the stored states sit
            # read in place at any position (the pool rotates queries back by the shift); a private
            # buffer places the states moved to their place, only when it does not hold them there already
            move = functools.partial(relocate, self.pc.adapter, kv, start - at) if start != at else None
            cached.append(Segment(f"{key}@{at}", kv, positions, load=move, shift=start - at))
        return cached, hits

    def _chain_states(self, layout: PromptLayout, docs: list[Document]) -> tuple[list, dict]:
        """(stored segments, tier hits): the prefix, then the longest stored chain of the leading
        documents (chain spans of ``layout``: each document with its separator)."""
        cached, hits = [], {}
        self._prefix_state(layout, cached, hits)
        spans = [s for s in layout.spans if s.name.startswith("doc:")][:len(docs)]
        found, chain_hits = stored_run(self.pc.store, self._chain_keys(cached, spans))
        cached += [Segment(key, kv, torch.tensor(span.position_ids, device=self.pc.device))
                   for (key, kv), span in zip(found, spans)]
        for tier, n in chain_hits.items():
            hits[tier] = hits.get(tier, 0) + n
        return cached, hits

    def _chain_keys(self, cached: list, spans: list[Span]) -> list[str]:
        """Chain keys of ``spans`` after the last of ``cached`` (the prefix, or the chain's root)."""
        parent = cached[-1].key if cached else chain_root(self.pc.model_key, self.namespace)
        return chained(parent, [(s.token_ids, s.position_ids[0]) for s in spans])

    def _prefill_chain(self, question: str, docs: list[Document], system: str | None, reserve: int,
                       keep_cache: bool, t0: float) -> PrefillResult:
        """Reuse the longest stored chain of the request's leading documents; run the rest and the
        question in one forward (a plain prefill's continuation) and store the new links."""
        layout, _ = self._layout(question, docs, system, len(docs))
        cached, hits = self._chain_states(layout, docs)
        spans = [s for s in layout.spans if s.name.startswith("doc:")]
        matched = len(cached) - (layout.spans[0].name == "(prefix)")
        links = list(zip(self._chain_keys(cached, spans[matched:]), map(len, spans[matched:])))  # (key, tokens) to add
        run = spans[matched:] + [layout.spans[-1]]
        ran = PromptLayout([Span("new", s.name, s.token_ids, s.position_ids, s.source) if s in run else s
                            for s in layout.spans], None)  # what ran: the unmatched documents are new
        plan = PrefillPlan(segments=cached, new_ids=[t for s in run for t in s.token_ids],
                           new_pos=[p for s in run for p in s.position_ids], max_position=max(layout.position_ids),
                           exact=True, layout=ran, hit_tiers=hits)
        res = self.pc.run_spliced(plan, t0, reserve, keep_cache or bool(links))
        if links:
            off = sum(seg.n for seg in cached)
            for key, n in links:
                self._put(key, res.cache.read(off, n))
                off += n
            if not keep_cache:
                self.pc.release(res)
        return res

    def _stored(self, doc: Document, verify: bool = False) -> tuple[torch.Tensor, str]:
        """(``doc``'s unit states, the tier they came from), healed where they are not sound: a
        state the store lacks (added to a chain store, evicted, its file missing) or whose copy
        fails verification (a damaged file) is encoded again from the text and stored, and its
        file is rewritten atomically where the store has a folder. ``verify``: check the folder's
        file now (``add``), not only when it is read."""
        key, unit, damage = self.state_key(self.unit_ids(doc)), self.unit_ids(doc), None
        if verify and self.folder is not None and self.folder.has_states(doc):
            damage = self.folder.damage(doc)
            if damage is not None:
                log.warning("document '%s': its states file is damaged (%s); encoded again from its text", doc.id,
                            damage)
                self.pc.store.discard(key)
        kv = tier = None
        if key in self.pc.store:
            try:
                kv, tier = self.pc.store.get(key)
            except StoreError as e:  # the store dropped the bad copy from every tier
                log.warning("document '%s': its stored states failed verification (%s); encoded again from its "
                            "text", doc.id, e)
                damage = str(e)
        if kv is None:
            self._put(key, self._encode(unit))
            kv, tier = self.pc.store.get(key)
        if self.folder is not None and (damage is not None or not self.folder.has_states(doc)):
            with self._lock:
                self.folder.write_states(doc, kv)
        return kv, tier

    def _put(self, key: str, kv: torch.Tensor) -> torch.Tensor:
        """Store a document's states in the engine's stored dtype (``RunnerConfig.kv_dtype``, like
        schema modules; the splice buffer upcasts them); returns what was stored."""
        kv = kv.to(self.pc.runner.stored_spec.dtype)
        self.pc.store.put(key, kv)
        return kv

    def _save_index(self) -> None:
        if self.folder is None:
            return
        for d in self._docs.values():
            if not self.folder.has_states(d):  # stored in memory before (same text), or its file went missing
                self._stored(d)
        self.folder.save(self._docs.values())

    def _open(self, reencode: bool) -> None:
        records, problems = self.folder.read()
        if problems:
            if not reencode:
                raise DocumentStoreError(f"document store {self.path} was built with another model, tokenizer or "
                                         f"document encoding: {'; '.join(problems)}. Open it as it was built, or "
                                         "build a store in another folder; reencode=True re-encodes it in place, "
                                         "replacing the stored states.")
            log.warning("re-encoding %d documents in %s: %s", len(records), self.path, "; ".join(problems))
            docs = [self._document(d["id"], d["text"], d["metadata"]) for d in records]
            for doc in docs:
                self._stored(doc)  # its states file rewritten (atomically) in this store's encoding
            with self._lock:  # the index last, once: until then the folder's index is its old, whole one
                self._docs = {d.id: d for d in docs}
                self._save_index()
            return
        for doc, f, expect in self.folder.opened(records):
            if self.folder.has_states(doc):
                # read lazily on first use; the disk tier verifies it and never uses a bad file
                self.pc.store.register_file(f, {self.state_key(self.unit_ids(doc)): ("kv", expect, 0)})
            else:
                log.warning("document '%s': its states file %s is missing; it is encoded again from its text when "
                            "first used", doc.id, f)
            self._docs[doc.id] = doc
