"""Requests -> what the engine runs: a ``Submission(prompt, prompt_tokens, params, ...)``, or an APIError.

``prompt`` is the request's ``PromptSpec`` (data: a PML prompt, token ids, documents); the
engine's scheduler plans it at admission, reading stored states in place from the KV pool (or
assembling a prompt that recomputes part of its states in a private buffer first).

Three ways in, all validated before anything is queued (so nothing is half-served):
  * plain chat messages / completion prompts -> token IDs (the tokenizer's chat template with
    ``add_generation_prompt=True``; never XML) -> automatic prefix reuse (``prefix.PrefixCache``);
  * ``pml``: a PML prompt for a schema loaded in the caller's namespace (``pc.prefill``);
  * ``documents``: DocumentStore ids; the chat must be optional system messages and one user
    message (the DocumentStore's public API places documents between them); other shapes are
    refused with 400 naming ``documents``.

Decisions: ``messages`` content parts must be text (others: 400); ``developer`` is ``system``;
``tools`` and history tool calls are rendered by the chat template and their answers parsed
(``tools.py``; plain messages only, not ``pml`` or ``documents``);
``recompute`` is validated (``"auto"`` or [0, 1]; absent: the engine's setting, ``"auto"`` by
default) and passed to the engine for ``pml`` and ``documents`` prompts (selective recompute of
their drifted cached tokens); plain messages are served from exact prefix
blocks, which have nothing to recompute, so it changes nothing there. Without
``max_tokens``, chat generates up to 256 tokens (fewer if the context ends first) and completions
16 (OpenAI's default). A prompt plus ``max_tokens`` past the model's context is a 400.

Size: text is measured before the tokenizer or the chat template sees it; past ``max_chars``
characters (messages together, the prompt, the PML text) it is a 400, so a Preparer used without
the HTTP guard (``core/limits.py``) still never tokenizes an unbounded text. Token-id prompts are
checked against the context before their ids are.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import torch
from fastapi.responses import JSONResponse, Response

from ...engine import PmlPrompt, SamplingParams, TokenPrompt
from ...engine.schemas.encoder import release_free_memory
from ...pml import PMLError, parse_prompt
from . import fields
from . import tools
from ..core.errors import APIError
from ..core.lifecycle import Submission
from .protocol import ChatRequest, CompletionRequest, BaseRequest

CHAT_DEFAULT_MAX_TOKENS = 256
COMPLETION_DEFAULT_MAX_TOKENS = 16


class Preparer:
    """Builds Submissions for one engine; ``documents`` maps namespace -> DocumentStore."""

    def __init__(self, pc, prefix, documents: dict | None = None, max_chars: int = 2_000_000):
        """``prefix``: the engine's ``PrefixCache`` (token prompts reuse its chains)."""
        self.pc, self.prefix, self.documents, self.max_chars = pc, prefix, documents or {}, max_chars
        self.context = pc.adapter.context_limit  # the model's context, its sliding window if smaller

    def chat(self, req: ChatRequest, ns: str) -> Submission:
        _check_common(req)
        if req.pml is not None:
            if req.messages or req.documents:
                raise APIError(400, "send either 'messages' (and 'documents') or 'pml', not both", "pml")
            if req.tools:
                raise APIError(400, "tools need 'messages' (a PML prompt has no chat template to show them)", "tools")
            return self._pml(req, ns, req.max_completion_tokens or req.max_tokens, CHAT_DEFAULT_MAX_TOKENS)
        if not req.messages:
            raise APIError(400, "'messages' must hold at least one message", "messages")
        tools.check(req, self.pc.tokenizer)
        msgs = self.chat_messages(req.messages)
        self._check_size(sum(len(m["content"]) for m in msgs), "messages")
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        if req.documents is not None:
            if req.tools:
                raise APIError(400, "tools cannot be combined with documents", "tools")
            return self._documents(req, msgs, ns, max_tokens)
        return self._tokens(self.chat_ids(msgs, tools.template_tools(req)), req, ns, max_tokens,
                            CHAT_DEFAULT_MAX_TOKENS, "messages")

    def completion(self, req: CompletionRequest, ns: str) -> Submission:
        _check_common(req)
        if req.pml is not None:
            if req.prompt:
                raise APIError(400, "send either 'prompt' or 'pml', not both", "pml")
            return self._pml(req, ns, req.max_tokens, COMPLETION_DEFAULT_MAX_TOKENS)
        p = req.prompt
        if isinstance(p, list) and p and isinstance(p[0], str):
            if len(p) != 1:
                raise APIError(400, f"one prompt per request is supported, got {len(p)}", "prompt")
            p = p[0]
        if not p:
            raise APIError(400, "'prompt' must not be empty", "prompt")
        if isinstance(p, list) and self.context is not None and len(p) >= self.context:
            raise APIError(400, f"the prompt is {len(p)} tokens, the model's context is {self.context}",
                           "prompt", "context_length_exceeded")
        self._check_size(len(p), "prompt")
        ids = list(p) if isinstance(p, list) else self.pc.tokenizer(p).input_ids
        vocab = self.pc.model.config.vocab_size
        if any(not 0 <= t < vocab for t in ids):
            raise APIError(400, f"token ids must be in [0, {vocab})", "prompt")
        return self._tokens(ids, req, ns, req.max_tokens, COMPLETION_DEFAULT_MAX_TOKENS, "prompt")

    def chat_messages(self, messages) -> list[dict]:
        """Request messages -> the template's dicts (``developer`` is ``system``; text parts only;
        tool calls and tool answers as ``tools.history`` writes them)."""
        tools.check_history(messages, self.pc.tokenizer)
        return [tools.history(m, i, _text(m, i)) for i, m in enumerate(messages)]

    def chat_ids(self, msgs: list[dict], functions: list[dict] | None = None) -> list[int]:
        """Token IDs of a conversation rendered with the chat template plus the generation prompt
        (``functions``: OpenAI tool specs the template renders; None: none)."""
        tok = self.pc.tokenizer
        if getattr(tok, "chat_template", None):
            try:
                out = tok.apply_chat_template(msgs, tools=functions, add_generation_prompt=True, tokenize=True)
            except Exception as e:  # templates raise on role orders they refuse
                raise APIError(400, f"the model's chat template refused the messages: {e}", "messages") from None
            return list(out["input_ids"] if hasattr(out, "keys") else out)
        text = "".join(f"{m['role'].capitalize()}: {m['content']}\n" for m in msgs) + "Assistant:"
        return tok(text).input_ids

    # -- the three paths -------------------------------------------------------------------------
    def _tokens(self, ids, req: BaseRequest, ns: str, max_tokens, default: int, param: str) -> Submission:
        sub = self._sampling(req, len(ids), max_tokens, default, param)
        return replace(sub, prompt=TokenPrompt(self.pc, tuple(ids), ns, self.prefix))

    def _pml(self, req: BaseRequest, ns: str, max_tokens, default: int) -> Submission:
        self._check_size(len(req.pml), "pml")
        try:
            tree = parse_prompt(req.pml)
            if tree.schema is not None:
                try:
                    self.pc.schema(tree.schema, ns)
                except PMLError as e:
                    raise APIError(404, str(e), "pml", "schema_not_found") from None
            layout = self.pc.layout(tree, ns)
        except PMLError as e:
            raise APIError(400, f"bad PML prompt: {e}", "pml") from None
        sub = self._sampling(req, max(layout.position_ids) + 1, max_tokens, default, "pml")
        return replace(sub, prompt=PmlPrompt(self.pc, tree, ns, req.recompute, layout),
                       prompt_tokens=len(layout.token_ids))

    def _documents(self, req: ChatRequest, msgs: list[dict], ns: str, max_tokens) -> Submission:
        store = self.documents.get(ns)
        if store is None:
            raise APIError(400, "this server has no documents (start it with --documents DIR)", "documents")
        roles = [m["role"] for m in msgs]
        if roles[-1] != "user" or any(r != "system" for r in roles[:-1]):
            raise APIError(400, "with 'documents', messages must be system messages and one last user message "
                                f"(got roles {roles})", "documents")
        system = "\n".join(m["content"] for m in msgs[:-1]) or None
        question, ids = msgs[-1]["content"], list(req.documents)
        unknown = [d for d in ids if d not in store]
        if unknown:
            raise APIError(404, f"unknown document ids {unknown} (the store has {len(store)} documents)",
                           "documents", "document_not_found")
        layout = store.layout(question, ids, system)
        sub = self._sampling(req, max(layout.position_ids) + 1, max_tokens, CHAT_DEFAULT_MAX_TOKENS, "messages")
        return replace(sub, prompt=store.prompt(question, ids, system, recompute=req.recompute, prefix=self.prefix,
                                                layout=layout), prompt_tokens=len(layout.token_ids))

    def _check_size(self, chars: int, param: str) -> None:
        if chars > self.max_chars:
            raise APIError(400, f"{param} holds {chars} characters, the limit is {self.max_chars}", param)

    def _sampling(self, req: BaseRequest, length: int, max_tokens, default: int, param: str) -> Submission:
        """The request's sampling settings and logits processors, checked against the context; the
        caller sets the submission's prompt."""
        room = None if self.context is None else self.context - length
        if room is not None and room < 1:
            raise APIError(400, f"the prompt is {length} tokens, the model's context is {self.context} "
                                "(room for at least one generated token is needed)", param, "context_length_exceeded")
        if max_tokens is None:
            max_tokens = default if room is None else min(default, room)
        elif room is not None and max_tokens > room:
            raise APIError(400, f"the prompt is {length} tokens and max_tokens is {max_tokens}: "
                                f"{length + max_tokens} is past the model's context of {self.context}",
                           "max_tokens", "context_length_exceeded")
        if req.min_tokens > max_tokens:
            raise APIError(400, f"min_tokens is {req.min_tokens}, more than max_tokens ({max_tokens})", "min_tokens")
        constraints = tools.processors(req, self.pc) if isinstance(req, ChatRequest) and tools.active(req) \
            else fields.constraints(req, self.pc)
        try:
            params = SamplingParams(max_new_tokens=max_tokens, temperature=req.temperature, top_p=req.top_p,
                                    stop=tuple(req.stop_list() or ()), seed=req.seed, min_tokens=req.min_tokens,
                                    ignore_eos=req.ignore_eos)
        except ValueError as e:  # settings the engine refuses (SamplingParams names the field)
            raise APIError(400, str(e)) from None
        return Submission(None, length, params, constraints, fields.logprobs_k(req))


class PrepThread:
    """The one worker thread a route's CPU work runs on (validating a body into its request model,
    tokenizing, the chat template, PML layout, rendering a large answer), never the event loop:
    ``/health`` and running streams stay live while a large prompt is tokenized (the tokenizer
    releases the GIL). One thread keeps the preparer's calls into the tokenizer and the engine
    serial; what it holds at once is bounded by the request limits (``core/limits.py``) times
    the requests admitted."""

    def __init__(self):
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="promptcache-prep")

    async def run(self, fn, *args):
        """``fn(*args)`` on the prep thread."""
        return await asyncio.get_running_loop().run_in_executor(self.pool, fn, *args)

    async def prepare(self, how, req, ns: str) -> Submission:
        """``how(req, ns)`` (a Preparer method) on the prep thread."""
        return await self.run(_prepared, how, req, ns)

    async def respond(self, fn, *args) -> Response:
        """``fn(*args)`` and its answer rendered as JSON, both on the prep thread: FastAPI's encoder
        takes seconds over the 500K token ids of a 2 MB prompt, and on the loop it stalls /health."""
        return await self.run(_rendered, fn, *args)

    def shutdown(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)


def _prepared(how, req, ns: str) -> Submission:
    """``how(req, ns)``; a refused request gives the heap it grew back to the OS (tokenizing 2M
    characters leaves ~200 MB in glibc's arenas otherwise)."""
    try:
        return how(req, ns)
    except APIError:
        release_free_memory(torch.device("cpu"))
        raise


def _rendered(fn, *args) -> Response:
    out = fn(*args)
    return out if isinstance(out, Response) else JSONResponse(out)


def _check_common(req: BaseRequest) -> None:
    fields.check(req)
    if req.n != 1:
        raise APIError(400, f"n={req.n}: one choice per request is supported", "n")
    for name in ("max_tokens", "max_completion_tokens"):
        v = getattr(req, name, None)
        if v is not None and v < 1:
            raise APIError(400, f"{name} must be >= 1, got {v}", name)


def _text(m, i: int) -> str:
    if m.content is None:
        return ""
    if isinstance(m.content, str):
        return m.content
    parts = []
    for j, p in enumerate(m.content):
        if p.type != "text" or p.text is None:
            raise APIError(400, f"content part type '{p.type}' is not supported (text only)",
                           f"messages[{i}].content[{j}]")
        if p.model_extra:
            field = sorted(p.model_extra)[0]
            raise APIError(400, f"messages[{i}].content[{j}].{field} is not supported by this server",
                           f"messages[{i}].content[{j}].{field}")
        parts.append(p.text)
    return "".join(parts)
