"""The library on the serving core: ``generate`` of a list is continuously batched and equals the
same prompts one by one; streams, threads, documents and errors go through the one engine."""

from __future__ import annotations

import threading

import pytest
import torch

from oracle import plain_logits
from promptcache import PromptCache
from promptcache.engine import PmlPrompt
from promptcache.pml import PMLError, parse_prompt
from promptcache.progress import bar_for
from promptcache.rag import DocumentStore
from tiny import make_model, make_tokenizer
from trip import PROMPTS, SCHEMA

GREEDY = dict(max_new_tokens=6, temperature=0.0)


@pytest.fixture(scope="module")
def pc():
    engine = PromptCache(make_model("llama"), make_tokenizer())
    engine.add_schema(SCHEMA)
    return engine


def mixed(pc) -> list:
    ids = pc.tokenizer("Plan a trip of three days to Paris and keep it cheap.").input_ids
    chat = [{"role": "system", "content": "You are brief."}, {"role": "user", "content": "Name a city."}]
    return [PROMPTS[0], ids, PROMPTS[1], chat, "plain text, no schema", PROMPTS[3]]


def test_a_list_of_prompts_is_batched_and_equals_them_one_by_one(pc):
    prompts = mixed(pc)
    one_by_one = [pc.generate(p, **GREEDY) for p in prompts]
    engine = pc.engine()
    forwards = engine.scheduler.decode_forwards
    batched = pc.generate(prompts, **GREEDY)
    assert isinstance(batched, list) and len(batched) == len(prompts)
    for got, want in zip(batched, one_by_one):
        assert got.token_ids == want.token_ids and got.text == want.text
        assert (got.exact, got.recomputed_tokens) == (want.exact, want.recomputed_tokens)
        assert got.cached_tokens >= want.cached_tokens  # token prompts also find the blocks the first run shared
    # decoded together: far fewer decode forwards than tokens decoded
    assert engine.scheduler.decode_forwards - forwards < sum(len(g.token_ids) for g in batched) / 2
    assert pc.generate([], **GREEDY) == []


def test_a_token_prompt_matches_a_plain_forward_and_the_baseline(pc):
    ids = pc.tokenizer("You are a travel planner. Plan a trip of three days to Paris, Tokyo or Rome.").input_ids
    first = pc.generate(ids, max_new_tokens=0)
    assert first.cached_tokens == 0 and first.exact
    again = pc.generate(ids + ids[:5], **GREEDY)  # reuses the blocks the first one shared
    assert again.cached_tokens >= 16 and again.exact
    base = pc.generate(ids + ids[:5], use_cache=False, **GREEDY)
    assert base.cached_tokens == 0 and base.token_ids == again.token_ids
    ref = pc.model.generate(torch.tensor([ids + ids[:5]], device=pc.device), max_new_tokens=6, do_sample=False)[0, len(ids) + 5:]
    assert again.token_ids == ref.tolist()


def test_stream_runs_on_the_core_and_leaving_early_frees_the_blocks(pc):
    engine = pc.engine()
    stream = pc.stream(PROMPTS[1], max_new_tokens=12, temperature=0.0)
    pieces = list(stream)
    assert "".join(pieces) == stream.result.text == pc.generate(PROMPTS[1], max_new_tokens=12,
                                                                temperature=0.0).text
    free = engine.pool.free_blocks
    early = pc.stream(PROMPTS[1], max_new_tokens=200, temperature=0.0)
    for _ in early:
        break
    assert early.request.finished and early.request.finish_reason == "cancelled"
    assert engine.pool.free_blocks == free and not engine.has_work


def test_threads_share_the_engine_and_get_their_own_answers(pc):
    want = {p: pc.generate(p, **GREEDY).token_ids for p in PROMPTS[:3]}
    got: dict[str, list[int]] = {}
    errors = []

    def ask(p):
        try:
            got[p] = pc.generate(p, **GREEDY).token_ids
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=ask, args=(p,)) for p in PROMPTS[:3]]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors and got == want


def test_a_bad_prompt_fails_before_any_work_and_names_the_fault(pc):
    steps = pc.engine().scheduler.steps
    with pytest.raises(PMLError, match="nowhere"):
        pc.generate([PROMPTS[0], '<prompt schema="nowhere"><x/></prompt>'], **GREEDY)
    with pytest.raises(ValueError, match="token ids"):
        pc.generate([[1, 2, 10**9]], **GREEDY)
    assert pc.engine().scheduler.steps == steps  # nothing was queued


@pytest.mark.parametrize("exact", [True, False], ids=["exact", "reuse"])
def test_documents_are_batched_as_pairs(pc, exact):
    store = DocumentStore(pc, exact=exact)
    for i, text in enumerate(["Paris is the capital of France.", "Tokyo is a city in Japan.",
                              "Rome has the Colosseum.", "Oslo is in Norway."]):
        store.add(f"d{i}", text)
    pairs = [("Which city is in Japan?", ["d1", "d0"]), ("Where is Oslo?", ["d3", "d2", "d1"]),
             ("What does Rome have?", ["d2"])]
    one = [store.generate(q, ids, **GREEDY) for q, ids in pairs]
    many = store.generate(pairs, **GREEDY)
    assert [g.token_ids for g in many] == [g.token_ids for g in one]
    assert all(g.cached_tokens > 0 for g in many)  # exact: the first turn's blocks; reuse: the documents
    if exact:
        assert all(g.exact for g in many)
        for (q, ids), g in zip(pairs, many):
            layout = store.layout(q, ids)
            want = pc.model.generate(torch.tensor([list(layout.token_ids)], device=pc.device), max_new_tokens=6, do_sample=False)
            assert g.token_ids == want[0, len(layout.token_ids):].tolist()
    else:
        assert not many[1].exact and many[1].reused_tokens > 0
    with pytest.raises(TypeError, match="doc_ids"):
        store.generate(pairs, ["d0"])


def test_prefill_logits_are_the_first_token_generate_decodes(pc):
    """``prefill`` (a private buffer, the logits alone) and ``generate`` (the pool) plan the same
    prompt: the first generated token is the prefill's argmax (what the studies read from both)."""
    res = pc.prefill(PROMPTS[0])
    out = pc.generate(PROMPTS[0], **GREEDY)
    assert out.token_ids[0] == int(torch.argmax(res.logits))
    assert (out.cached_tokens, out.exact) == (res.cached_tokens, res.exact)


def test_shared_module_states_are_read_in_place_by_every_request(pc):
    """Eight requests importing the same modules copy nothing: the states are read where the store
    keeps them, and the pool holds only each request's own tokens (given back when they finish).
    Without the native kernel (a GPU) the first copies them into the pool for all eight, and the
    copy goes with the last of them."""
    engine = pc.engine()
    free = engine.pool.free_blocks
    outs = pc.generate([PmlPrompt(parse_prompt(PROMPTS[1]), recompute=0)] * 8, **GREEDY)
    copied = [o.bytes_copied > 0 for o in outs]
    assert copied == ([True] + [False] * 7 if engine.scheduler.pools_documents else [False] * 8)
    assert all(o.cached_tokens > 0 for o in outs)
    assert len({tuple(o.token_ids) for o in outs}) == 1 and engine.pool.free_blocks == free


def test_a_progress_bar_only_on_a_terminal(tmp_path):
    with open(tmp_path / "log.txt", "w") as f:
        assert bar_for("generating", "prompts", f) is None


def test_exact_logits_for_a_prefix_prompt_through_the_core(pc):
    ids = pc.tokenizer("Keep it cheap and short, please.").input_ids
    out = pc.generate(ids, max_new_tokens=1, temperature=0.0)
    assert out.token_ids == [int(torch.argmax(plain_logits(pc.model, ids)))]



def test_a_queued_requests_ttft_counts_from_submission():
    """With one request running at a time, the second request of a batch waits for the first to
    finish: its TTFT counts from its submission, so it includes that wait (not from admission)."""
    import time

    from promptcache import SamplingParams
    from promptcache.engine import Request, ServingConfig, TokenPrompt

    pc = PromptCache(make_model("llama"), make_tokenizer())
    engine = pc.engine(ServingConfig(max_num_seqs=1))
    params = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)
    reqs = [Request(TokenPrompt(tuple(pc.tokenizer(text).input_ids), pc.config.namespace), params, pc.tokenizer)
            for text in ("one plain prompt", "another plain prompt")]
    for r in reqs:
        engine.submit(r)
    submitted = time.perf_counter()
    while not reqs[0].finished:
        engine.step()
    first_done = time.perf_counter()
    assert reqs[1].prefill is None  # it waited: one running request at a time
    while not reqs[1].finished:
        engine.step()
    assert reqs[1].prefill.ttft >= first_done - submitted
