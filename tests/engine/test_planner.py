"""The engine plans, prompts are data: every request's plan comes from the core's one planner,
specs are frozen, and what a spec cannot be planned without fails with a clear error."""

from __future__ import annotations

import dataclasses
import gc

import pytest

from promptcache import PromptCache
from promptcache.engine import PmlPrompt, Request, SamplingParams, SourcePrompt, TokenPrompt
from promptcache.engine.serving_core.kvpool import KVPool
from promptcache.engine.serving_core.scheduler import ServingScheduler
from promptcache.pml import parse_prompt
from promptcache.rag import DocumentStore
from promptcache.rag.prompt import DocumentPrompt
from tiny import make_model, make_tokenizer
from trip import PROMPTS, SCHEMA

GREEDY = dict(max_new_tokens=4, temperature=0.0)
DOCS = ["Paris is the capital of France.", "Tokyo is a city in Japan.", "Rome has the Colosseum."]


@pytest.fixture(scope="module")
def pc():
    engine = PromptCache(make_model("llama"), make_tokenizer())
    engine.add_schema(SCHEMA)
    return engine


def store_of(pc, **kw) -> DocumentStore:
    store = DocumentStore(pc, **kw)
    for i, text in enumerate(DOCS):
        store.add(f"d{i}", text)
    return store


def test_every_kind_of_prompt_is_planned_by_the_core_planner(pc, monkeypatch):
    planner, seen = pc.core.planner, []
    real = planner.plan

    def spy(spec, pool=None, chains=None):
        seen.append(type(spec).__name__)
        return real(spec, pool, chains)

    monkeypatch.setattr(planner, "plan", spy)
    reuse, exact = store_of(pc), store_of(pc, exact=True)
    ids = pc.tokenizer("Plan a trip of three days to Paris.").input_ids
    prompts = [PROMPTS[0], ids, reuse.prompt("Which city is in Japan?", ["d1", "d0"]),
               exact.prompt("Where is Rome?", ["d2"])]
    outs = pc.generate(prompts, **GREEDY)
    assert all(len(o.token_ids) == 4 for o in outs)
    # one call a request; the reuse store's DocumentPrompt is planned by the store it names (no second call)
    assert sorted(seen) == sorted(["PmlPrompt", "TokenPrompt", "DocumentPrompt", "TokenPrompt"])
    assert isinstance(prompts[2], SourcePrompt) and prompts[2].source == reuse.source


def test_prompt_specs_are_frozen_data(pc):
    pml = pc.prompt_spec(PROMPTS[0])
    tokens = pc.prompt_spec([1, 2, 3])
    doc = store_of(pc).prompt("Which city is in Japan?", ["d1"])
    for spec in (pml, tokens, doc):
        with pytest.raises(dataclasses.FrozenInstanceError):
            spec.namespace = "other"  # noqa: B010 - a frozen dataclass refuses any assignment
    assert isinstance(pml, PmlPrompt) and isinstance(tokens, TokenPrompt) and tokens.reuse
    assert isinstance(doc, DocumentPrompt) and doc.doc_ids == ("d1",)
    assert not pc.prompt_spec([1, 2, 3], use_cache=False).reuse


def test_a_document_prompt_whose_store_is_gone_fails_clearly(pc):
    store = store_of(pc)
    prompt = store.prompt("Which city is in Japan?", ["d1"])
    del store
    gc.collect()  # the planner holds stores weakly: a dropped store plans nothing
    with pytest.raises(LookupError, match=f"prompt source '{prompt.source}' is gone"):
        pc.generate(prompt, **GREEDY)


def test_a_token_prompt_that_reuses_needs_an_engine_with_chains(pc):
    sched = ServingScheduler(pc.runner, KVPool(pc.runner.spec, pc.device, 256, 16), planner=pc.core.planner)
    reuse = Request(TokenPrompt((1, 2, 3), "ns", reuse=True), SamplingParams(**GREEDY), pc.tokenizer)
    plain = Request(TokenPrompt((1, 2, 3), "ns"), SamplingParams(**GREEDY), pc.tokenizer)
    pml = Request(PmlPrompt(parse_prompt(PROMPTS[1]), recompute=0), SamplingParams(**GREEDY), pc.tokenizer)
    for r in (reuse, plain, pml):
        sched.add(r)
    while sched.has_work:
        sched.step()
    assert isinstance(reuse.error, ValueError) and "reuse=True" in str(reuse.error)
    assert plain.error is None and pml.error is None and len(plain.token_ids) == len(pml.token_ids) == 4
    with pytest.raises(TypeError, match="PromptSpec the planner knows"):
        pc.core.planner.plan(object())
