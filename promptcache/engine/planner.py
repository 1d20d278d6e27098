"""``Planner``: the one place a request's ``PrefillPlan`` comes from.

    plan = planner.plan(spec, pool, chains)      # the scheduler, at admission, on the step thread

A prompt spec (``serving_core/prompts.py``; ``rag.DocumentPrompt``) is frozen data: tokens or a
parsed PML tree, a namespace, a recompute setting, document ids. It holds no engine, store or
``PromptCache``. The planner holds what planning reads: the registry of encoded schemas, the
store, the runner (for a plan in prompt order, ``ModelRunner.recompute_plan``) and the engine's
settings. It asks, as vLLM's scheduler asks its cache manager what is reusable:

* ``PmlPrompt``: lay the prompt over its schema and assemble the stored modules
  (``schemas.assemble``); a drifted layout recomputes part of them as rows of the step
  (``prefill/recompute.py`` chooses which, ``prefill/ordered.py`` orders them);
* ``TokenPrompt``: the prefix chains of the engine that runs it (``chains``), or nothing;
* ``SourcePrompt``: a source registered here by name (a ``DocumentStore``) plans it, and may hand
  back a simpler spec planned in its place. Sources are held weakly: a store that is gone
  plans nothing (its queued prompts fail with a clear error).

A stored state that vanished (a shared tier down, evicted) or fails verification is re-encoded
with the schema's other missing states and the assembly retried once (``assemble``).
"""

from __future__ import annotations

import itertools
import logging
import weakref
from typing import Protocol

import torch

from ..layout import PromptLayout, SchemaLayout, layout_prompt
from ..pml import parse_prompt
from ..pml.nodes import Prompt
from ..store import StoreError
from .prefill.config import EngineConfig
from .prefill.plan import PrefillPlan, PromptSpec, Segment
from .prefill.recompute import RecomputeRequest, check_recompute, fraction_of, recompute_request
from .prefill.runner import ModelRunner
from .prefill.window_reads import WholeStates, whole_segment, with_whole_states
from .schemas.assemble import assemble, leading_exact, moves_last
from .schemas.encoder import Progress, SchemaEncoder
from .schemas.registry import EncodedSchema, SchemaRegistry
from .serving_core.prefix import PrefixCache
from .serving_core.prompts import PmlPrompt, SourcePrompt, TokenPrompt

__all__ = ["Planner", "PromptSource"]

log = logging.getLogger(__name__)

_sources = itertools.count()


class PromptSource(Protocol):
    """What plans a ``SourcePrompt`` (``rag.DocumentStore``): its plan, or a spec planned in its place."""

    def plan_prompt(self, spec: SourcePrompt) -> PrefillPlan | PromptSpec: ...


class Planner:
    def __init__(self, config: EngineConfig, runner: ModelRunner, store, registry: SchemaRegistry,
                 encoder: SchemaEncoder, tok):
        self.config, self.runner, self.store, self.registry, self.encoder, self.tok = \
            config, runner, store, registry, encoder, tok
        self._sources: weakref.WeakValueDictionary[str, PromptSource] = weakref.WeakValueDictionary()
        self.whole = WholeStates()  # window-aware storage: spans encoded again, kept for the next reader

    # -- the scheduler's question ----------------------------------------------------------------
    def plan(self, spec: PromptSpec, pool=None, chains: PrefixCache | None = None) -> PrefillPlan:
        """``spec`` as the ``PrefillPlan`` the scheduler reads from ``pool`` and the store. ``chains``:
        the prefix chains of the engine that runs it (a ``TokenPrompt`` that reuses needs them)."""
        if isinstance(spec, PmlPrompt):
            return self.pml_plan(spec.tree, spec.namespace, recompute=spec.recompute, layout=spec.layout)
        if isinstance(spec, TokenPrompt):
            return self.token_plan(spec, pool, chains)
        if isinstance(spec, SourcePrompt):
            source = self._sources.get(spec.source)
            if source is None:
                raise LookupError(f"prompt source {spec.source!r} is gone (its DocumentStore was closed or "
                                  f"garbage-collected before the request was admitted)")
            out = source.plan_prompt(spec)
            return self.plan(out, pool, chains) if isinstance(out, PromptSpec) else out
        raise TypeError(f"a request's prompt is a PromptSpec the planner knows (PmlPrompt, TokenPrompt, "
                        f"SourcePrompt), got {type(spec).__name__}")

    def add_source(self, source: PromptSource) -> str:
        """Register ``source`` (held weakly) and return the name its prompts carry."""
        name = f"{type(source).__name__}:{next(_sources)}"
        self._sources[name] = source
        return name

    # -- token prompts ---------------------------------------------------------------------------
    @staticmethod
    def token_plan(spec: TokenPrompt, pool, chains: PrefixCache | None) -> PrefillPlan:
        ids = list(spec.ids)
        if spec.reuse:
            if chains is None:
                raise ValueError("a TokenPrompt with reuse=True runs on an engine with prefix chains "
                                 "(Engine, or a ServingScheduler given chains=)")
            plan = chains.chains.plan(ids, spec.namespace, pool)
            plan.layout = spec.layout
            return plan
        return PrefillPlan(segments=[], new_ids=ids, new_pos=list(range(len(ids))), max_position=len(ids) - 1,
                           exact=True, layout=spec.layout)

    # -- PML prompts -----------------------------------------------------------------------------
    def layout(self, prompt: str | Prompt, namespace: str | None = None) -> PromptLayout:
        """The prompt's ordered spans over its schema loaded in ``namespace``."""
        tree = prompt if isinstance(prompt, Prompt) else parse_prompt(prompt)
        ns = self.config.namespace_for(namespace)
        schema = self.schema(tree.schema, ns).layout if tree.schema is not None else None
        return layout_prompt(tree, schema, self.tok, max_positions=self.runner.adapter.max_positions)

    def schema(self, name: str, namespace: str | None = None) -> EncodedSchema:
        return self.registry.get(name, self.config.namespace_for(namespace))

    def recompute_fraction(self, recompute: float | str | None) -> float:
        """The fraction a call uses: ``None`` means ``config.recompute.fraction``; else checked to be
        ``"auto"`` (``AUTO_FRACTION`` of the drifted tokens) or a fraction in [0, 1]."""
        return fraction_of(self.config.recompute.fraction if recompute is None else check_recompute(recompute))

    def pml_plan(self, prompt: str | Prompt, namespace: str | None = None, *, recompute: float | str | None = None,
                 layout: PromptLayout | None = None) -> PrefillPlan:
        """A PML prompt's plan: its stored modules read in place; a prompt that recomputes part of
        them (a drifted layout under ``"auto"``, or ``recompute`` > 0 on a layout that is not
        exact) runs the chosen tokens as rows of the step in prompt order."""
        r = self.recompute_fraction(recompute)
        plan, req = self.pml_parts(prompt, namespace, r, layout)
        return plan if req is None else self.runner.recompute_plan(plan, req)

    def pml_parts(self, prompt, namespace: str | None, r: float, layout: PromptLayout | None = None):
        """(the assembled plan, the recompute request or None) of a PML prompt at fraction ``r``."""
        layout = self.layout(prompt, namespace) if layout is None else layout
        entry = self.schema(layout.schema.name, namespace) if layout.schema is not None else None
        plan = self.assemble(layout, entry)
        if r <= 0 or plan.exact:  # exact plans (and r = 0) skip the walk over the layout
            return self.readable(plan, entry), None
        req = recompute_request(layout, leading_exact(layout, entry), r, self.config.recompute.selection,
                                moves_last(layout))
        return self.readable(plan, entry, req), req

    def readable(self, plan: PrefillPlan, entry: EncodedSchema | None, req: RecomputeRequest | None = None
                 ) -> PrefillPlan:
        """``plan`` with the stored states its readers need more of than a trimming tier kept
        (window-aware storage: a reader before a module, a recomputed token inside one) encoded
        again, so the prompt reads what whole states give (``prefill/window_reads.py``)."""
        if entry is None or self.store.windows is None:
            return plan
        fresh: dict[int, torch.Tensor] = {}
        index = {k: i for i, k in entry.keys.items()}

        def whole(seg: Segment) -> Segment:
            key = seg.key.removesuffix("[:-1]")

            def encode() -> torch.Tensor:
                if not fresh:  # one encode of the schema gives every span
                    fresh.update(self.encoder.encode(entry.layout))
                return fresh[index[key]]

            return whole_segment(seg, self.whole.get(key, encode)[:, :, :, :seg.n])

        return with_whole_states(plan, self.store.windows, whole, req)

    def assemble(self, layout: PromptLayout, entry: EncodedSchema | None) -> PrefillPlan:
        """``assemble.assemble``; a stored state that vanished or failed verification is re-encoded
        with the schema's other missing states, once."""
        try:
            return assemble(layout, entry, self.store)
        except StoreError as e:
            if entry is None:
                raise
            log.warning("schema '%s': a stored state cannot be used (%s); re-encoding what is missing", entry.name, e)
            self.ensure_states(entry.layout, entry.keys, fetch=True)
            return assemble(layout, entry, self.store)

    def ensure_states(self, layout: SchemaLayout, keys: dict[int, str], progress: Progress | None = None,
                      fetch: bool = False) -> list[str]:
        """Encode the states no tier holds (local, or shared: fetched on first use, or now with
        ``fetch``); with a shared tier, two processes missing the same states encode them once
        (``TieredStore.ensure``)."""
        dtype = self.runner.stored_spec.dtype  # kv_dtype (the encoder already gives it; .to is then a no-op)

        def encode():
            return {keys[i]: kv.to(dtype) for i, kv in self.encoder.encode(layout, progress).items()}

        return self.store.ensure(keys.values(), encode, fetch)
