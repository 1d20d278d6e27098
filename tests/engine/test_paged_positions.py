"""Attention that reads key positions, on the KV pool: ALiBi biases and sliding windows.

ALiBi families (Bloom, MPT, Falcon-ALiBi) add a bias from each key's position; sliding-window
models (Mistral, Qwen2) hide keys more than a window of positions behind the query. The paged
attention computes both from the position IDs the pool keeps for shared segments and own tokens
(``paged.KeyRule``). The serving oracle tests (test_serving.py) run every family through the
scheduler with Prompt Cache's gaps, unions and parameters; here: windows smaller than the prompt
(their reference is the stock forward with the window applied by position ID), whole segments
hidden by the window, ALiBi with several query heads per key head, both of Falcon's attention
implementations, and self-checks that catch a bias or a window that is off.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, FalconConfig, MistralConfig, Qwen2Config

from oracle import assembled_cache, plain_logits
from promptcache import PromptCache
from promptcache.engine.serving_core import paged
from promptcache.engine import PmlPrompt, TokenPrompt
from promptcache.engine.serving_core.prefix import PrefixCache
from promptcache.engine.serving_core.kvpool import KVPool
from promptcache.engine.serving_core.request import Request
from promptcache.engine.decoding.sampling import SamplingParams
from promptcache.engine.serving_core.scheduler import ServingScheduler
from promptcache.models import get_adapter
from promptcache.pml import parse_prompt
from tiny import DEVICE, VOCAB, fresh_model, make_tokenizer

TOL = 1e-4
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              max_position_embeddings=1024)


@pytest.fixture(scope="module")
def tokenizer():
    return make_tokenizer()


def tiny(config, attn: str | None = None):
    """A tiny float32 model of ``config`` (weights widened as tests/tiny.py does)."""
    torch.manual_seed(0)
    config.bos_token_id, config.eos_token_id, config.pad_token_id = 2, 3, 1
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32,
                                             **({"attn_implementation": attn} if attn else {}))
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.2)
    return model.to(DEVICE).eval()  # on the test device, as tests/tiny.py's models


def mistral(window: int):
    return tiny(MistralConfig(**COMMON, num_key_value_heads=2, sliding_window=window))


def run(pc, plans, budget, max_new, sched=None, chains=None):
    """Serve prompt specs together (chunks of ``budget`` tokens, greedy) on ``sched`` (default: a
    new scheduler over a pool of 8-token blocks, token prompts reusing ``chains``); the finished
    requests and the scheduler."""
    sched = sched or ServingScheduler(pc.runner, KVPool(pc.runner.spec, pc.device, 1024, 8), token_budget=budget,
                                      planner=pc.core.planner, chains=chains)
    reqs = [Request(p, SamplingParams(max_new_tokens=max_new, temperature=0.0), pc.tokenizer) for p in plans]
    for r in reqs:
        sched.add(r)
    while sched.has_work:
        sched.step()
    for r in reqs:
        assert r.error is None, r.error
    return reqs, sched


def windowed_greedy(model, cache, n_cached, ids, pos, window, n_tokens, eos=3):
    """The definition under a sliding window measured in position IDs: ``ids`` at ``pos`` on top
    of the assembled cache, each query seeing the cached and earlier new keys whose position is
    above its own minus ``window``, then greedy tokens the same way. (first logits [V], tokens)."""
    adapter, device = get_adapter(model), model.device

    def step(new_ids, new_pos):
        length = cache.length
        q = torch.tensor(new_pos, device=device)
        keys = torch.cat([cache.positions[0, :length], q])  # after this forward
        seen = keys[None, :] > q[:, None] - window
        seen[:, length:] &= torch.ones((len(new_ids), len(new_ids)), dtype=torch.bool, device=device).tril()
        return adapter.forward(torch.tensor([new_ids], device=device), torch.tensor([new_pos], device=device), cache,
                               attention_mask=seen[None, None])[0]

    first = logits = step(ids, pos)
    out, at = [], max(pos) + 1
    for i in range(n_tokens):
        tok = int(torch.argmax(logits))
        out.append(tok)
        if tok == eos or i == n_tokens - 1:
            break
        logits = step([tok], [at])
        at += 1
    return first, out


WINDOW_SCHEMA = """<schema name="w">You plan trips.
  <module name="paris">Paris has museums.</module>
  <module name="tokyo">Tokyo has temples.</module></schema>"""
WINDOW_PROMPTS = ['<prompt schema="w"><tokyo/> Plan three cheap days with food and museums, please.</prompt>',
                  '<prompt schema="w"><paris/><tokyo/> Keep it short and cheap, with good food.</prompt>']


def test_a_sliding_window_smaller_than_the_prompt_is_measured_in_position_ids(tokenizer):
    """Mistral with a 26-position window: the schema fits in it (its encoding is a plain forward),
    prompts with a module gap run past it. Served together (chunks of 5 tokens,
    decode rows beside chunks), each equals the definition with the window applied by position:
    first logits within 1e-4, greedy tokens equal."""
    pc = PromptCache(mistral(26), tokenizer)
    pc.add_schema(WINDOW_SCHEMA)
    schema = pc.schema("w").layout
    assert max(s.end for s in schema.spans) <= 26
    reqs, sched = run(pc, [PmlPrompt(parse_prompt(p), recompute=0) for p in WINDOW_PROMPTS], budget=5, max_new=10)
    for prompt, req in zip(WINDOW_PROMPTS, reqs):
        layout = pc.layout(prompt)
        assert max(layout.position_ids) - min(layout.position_ids) >= 26  # the window hides the first keys
        new = [(t, p) for s in layout.new for t, p in zip(s.token_ids, s.position_ids)]
        cache, n_cached = assembled_cache(pc.model, schema, layout)
        want, tokens = windowed_greedy(pc.model, cache, n_cached, [t for t, _ in new], [p for _, p in new], 26, 10)
        assert torch.max(torch.abs(req.prefill.logits - want)).item() <= TOL, prompt
        assert req.token_ids == tokens, prompt
        assert req.prefill.cached_tokens > 0 and req.prefill.bytes_copied == 0
    assert sched.decode_tokens > sched.decode_forwards  # decode rows shared steps


@pytest.mark.parametrize("window", [4, 9])
def test_a_window_hides_whole_shared_blocks_of_a_token_chain(window, tokenizer):
    """Contiguous positions: the window by position is the stock model's own (by index). A chat's
    second turn reads the first turn's blocks (8 tokens each) from the pool, most of them wholly
    behind the window (skipped), and equals a plain forward of its tokens."""
    pc = PromptCache(mistral(window), tokenizer)
    chains = PrefixCache(pc.store, pc.model_key, 8)
    ids = pc.tokenizer("You are a travel planner. Plan a trip of three days to Paris, Tokyo or Rome.").input_ids
    (first,), sched = run(pc, [TokenPrompt(tuple(ids), "ns", reuse=True)], budget=6, max_new=6, chains=chains)
    assert torch.max(torch.abs(first.prefill.logits - plain_logits(pc.model, ids))).item() <= TOL
    second = ids + first.token_ids[:-1] + pc.tokenizer("Keep it cheap.").input_ids
    (again, other), _ = run(pc, [TokenPrompt(tuple(second), "ns", reuse=True),
                                 TokenPrompt(tuple(ids[:9]), "ns", reuse=True)], budget=7, max_new=6, sched=sched)
    assert again.prefill.cached_tokens >= 16
    assert torch.max(torch.abs(again.prefill.logits - plain_logits(pc.model, second))).item() <= TOL
    tokens = pc.generate(second, max_new_tokens=6, temperature=0.0, use_cache=False)
    assert again.token_ids == tokens.token_ids
    assert torch.max(torch.abs(other.prefill.logits - plain_logits(pc.model, ids[:9]))).item() <= TOL


def test_qwen2_windows_only_the_layers_its_config_names(tokenizer):
    model = tiny(Qwen2Config(**COMMON, num_key_value_heads=2, use_sliding_window=True, sliding_window=5,
                             max_window_layers=1))
    pc = PromptCache(model, tokenizer)
    assert paged.key_rule(pc.adapter).windows == (None, 5)
    assert paged.paged_refusal(pc.runner) is None
    ids = pc.tokenizer("Tokyo is a huge city in Japan with temples, food markets and fast trains.").input_ids
    chains = PrefixCache(pc.store, pc.model_key, 8)
    (req,), _ = run(pc, [TokenPrompt(tuple(ids), "ns", reuse=True)], budget=6, max_new=1, chains=chains)
    assert torch.max(torch.abs(req.prefill.logits - plain_logits(pc.model, ids))).item() <= TOL


@pytest.mark.parametrize("config", [
    dict(multi_query=True, new_decoder_architecture=False, parallel_attn=False),  # one key head for all heads
    dict(multi_query=False, new_decoder_architecture=True, num_kv_heads=2),  # keys expanded to every head
])
@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_falcon_alibi_layouts_and_attention_implementations(config, attn, tokenizer):
    """Falcon-ALiBi's eager attention adds its bias twice (to the scores and in the merged mask),
    its SDPA attention once; its query/key/value layouts differ by config. Each is served from
    the pool and equals the prefix oracle (a plain forward)."""
    model = tiny(FalconConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                              alibi=True, bias=True, **config), attn)
    pc = PromptCache(model, tokenizer)
    assert pc.adapter.attn_implementation() == attn
    assert paged.paged_refusal(pc.runner) is None
    chains = PrefixCache(pc.store, pc.model_key, 8)
    ids = pc.tokenizer("Paris is the capital of France, famous for museums, cafes and the Eiffel Tower.").input_ids
    (req,), _ = run(pc, [TokenPrompt(tuple(ids), "ns", reuse=True)], budget=6, max_new=4, chains=chains)
    assert torch.max(torch.abs(req.prefill.logits - plain_logits(pc.model, ids))).item() <= TOL
    want = pc.generate(ids, max_new_tokens=4, temperature=0.0, use_cache=False)
    assert req.token_ids == want.token_ids


def test_the_self_check_catches_a_window_one_position_off(tokenizer, monkeypatch):
    pc = PromptCache(mistral(6), tokenizer)
    assert paged.paged_refusal(pc.runner) is None
    monkeypatch.setattr(type(pc.adapter), "sliding_windows", lambda self: [7] * self.config.num_hidden_layers)
    assert "self-check" in paged.paged_refusal(pc.runner)


def test_the_paged_forward_leaves_the_stock_forward_alone(tokenizer):
    """The instance forwards of inline attention exist only during a paged forward: the stock
    forward gives the same logits, bit for bit, before and after paged forwards ran."""
    pc = PromptCache(fresh_model("bloom"), tokenizer)
    ids = torch.tensor([pc.tokenizer("Keep it cheap. Highlight the food.").input_ids], device=pc.device)
    with torch.inference_mode():
        before = pc.model(input_ids=ids).logits
        assert paged.paged_refusal(pc.runner) is None  # paged forwards
        after = pc.model(input_ids=ids).logits
    assert all("forward" not in vars(m) for m in pc.adapter.attention_modules())
    assert torch.equal(before, after)


def test_rows_without_key_positions_are_refused_clearly(tokenizer):
    pc = PromptCache(fresh_model("mpt"), tokenizer)
    pool = KVPool(pc.runner.spec, pc.device, 64, 4)
    blocks = pool.allocate(2)
    seg = [("s", pool.views(blocks[:1], 4)[0])]
    with pytest.raises(ValueError, match="shared_pos"):
        paged.paged_forward(pc.runner, pool, [paged.PagedRow([5], [4], seg, pool.slots(blocks[1:], 0, 1))])
    with pytest.raises(ValueError, match="own_pos"):
        paged.paged_forward(pc.runner, pool, [paged.PagedRow([5], [4], [], pool.slots(blocks[1:], 0, 2))])


@pytest.mark.slow
def test_compiled_steps_apply_the_window_as_eager_ones_do(tokenizer):
    """Compiled steps (symbolic sizes, CPU) of the windowed Mistral serving the gapped prompts
    past their window: the same first logits (within 1e-4) and greedy tokens as eager steps.
    (ALiBi families: tests/engine/test_graphs.py runs every pooled family compiled.)"""
    from promptcache.engine.serving_core.graphs import CompiledSteps
    from trip import serve_together

    pc = PromptCache(mistral(26), tokenizer)
    pc.add_schema(WINDOW_SCHEMA)
    want = serve_together(pc, WINDOW_PROMPTS, max_new=8, budget=5)
    steps = CompiledSteps(pc.runner, buckets=(1, 2, 4, 8))
    got = serve_together(pc, WINDOW_PROMPTS, max_new=8, budget=5, forward=steps.forward)
    assert steps.compiled_steps > 0
    for prompt, a, b in zip(WINDOW_PROMPTS, want, got):
        assert a.error is None and b.error is None, (prompt, b.error)
        assert torch.max(torch.abs(a.prefill.logits - b.prefill.logits)).item() <= TOL, prompt
        assert a.token_ids == b.token_ids, prompt


def test_a_segment_wholly_behind_the_window_is_not_read(tokenizer):
    """A decode row at position 40 with a 4-position window over a shared segment at positions
    0..7: the plan skips the segment (it is never read: its keys here are NaN) and the row's
    attention equals attention over its own keys inside the window alone."""
    pc = PromptCache(mistral(4), tokenizer)
    spec = pc.runner.spec
    pool = KVPool(spec, pc.device, 64, 8)
    seg_blocks, own_blocks = pool.allocate(1), pool.allocate(1)
    torch.manual_seed(1)
    pool.buf.normal_()
    pool.buf[:, :, :, seg_blocks[0] * 8 : seg_blocks[0] * 8 + 8] = float("nan")  # read it and the answer is NaN
    own = pool.slots(own_blocks, 0, 6)
    row = paged.PagedRow([5], [40], [("s", pool.views(seg_blocks, 8)[0])], own, shared_pos=[torch.arange(8, device=pc.device)],
                         own_pos=[30, 31, 37, 38, 39, 40])
    plan = paged.build_plan(pool, [row], keys=paged.key_rule(pc.adapter))
    hq, d = 4, spec.head_dim
    query = torch.randn(1, hq, 1, d, device=pc.device)
    got = paged.attend(plan, 0, query)  # [1, 1, Hq, D]
    assert plan.memo[(-1, 0, 4)] == (False, None)  # the segment: skipped
    keys, values = pool.buf[0, 0][:, own[2:]], pool.buf[0, 1][:, own[2:]]  # positions 37..40: inside the window
    q = query[0].view(spec.kv_heads, hq // spec.kv_heads, d)
    want = torch.softmax(q @ keys.transpose(1, 2) / d ** 0.5, dim=-1) @ values  # [Hk, G, D]
    assert torch.max(torch.abs(got[0, 0] - want.reshape(hq, d))).item() <= 1e-5


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_a_paged_forward_swaps_one_configs_attention_and_restores_it(attn, tokenizer, monkeypatch):
    """A model whose submodels all read one config has that config's attention field swapped for
    the paged forward (no walk over every module a step), and restored after it: the same answer
    as a plain forward, and every other forward keeps the model's own attention."""
    model = tiny(MistralConfig(**COMMON, num_key_value_heads=2), attn)
    pc = PromptCache(model, tokenizer)
    walks = []
    monkeypatch.setattr(type(model), "set_attn_implementation", lambda self, name: walks.append(name))
    seen = []
    real = paged.ALL_ATTENTION_FUNCTIONS[paged.ATTENTION_NAME]
    monkeypatch.setitem(paged.ALL_ATTENTION_FUNCTIONS, paged.ATTENTION_NAME,
                        lambda *a, **k: (seen.append(model.config._attn_implementation), real(*a, **k))[1])
    ids = pc.tokenizer("Oslo sits at the head of a fjord, with ferries, museums and forests around it.").input_ids
    chains = PrefixCache(pc.store, pc.model_key, 8)
    (req,), _ = run(pc, [TokenPrompt(tuple(ids), "ns", reuse=True)], budget=6, max_new=3, chains=chains)
    assert torch.max(torch.abs(req.prefill.logits - plain_logits(pc.model, ids))).item() <= TOL
    assert seen and set(seen) == {paged.ATTENTION_NAME} and walks == []
    assert pc.adapter.attn_implementation() == attn
