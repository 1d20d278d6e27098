"""SamplingParams (validation, merging) and the sampler against transformers' ``model.generate``."""

from __future__ import annotations

import pytest
import torch

from promptcache import PromptCache, SamplingParams
from promptcache.engine.decoding.sampling import Sampler, sampling_params
from tiny import make_model, make_tokenizer

SCHEMA = """<schema name="s">
  <system>You are a travel planner.</system>
  <user>
    <module name="intro">Plan a trip of three days.</module>
    <module name="paris">Paris is the capital of France, famous for museums.</module>
  </user>
</schema>"""
PREFIX_PROMPT = '<prompt schema="s"><intro/><paris/> Highlight the food.</prompt>'
GAPPED_PROMPT = '<prompt schema="s"><paris/> Highlight the food.</prompt>'


@pytest.fixture(scope="module", params=["llama", "gpt2"])
def pc(request):
    engine = PromptCache(make_model(request.param), make_tokenizer())
    engine.add_schema(SCHEMA)
    return engine


@pytest.mark.parametrize("field, value", [
    ("max_new_tokens", -1), ("max_new_tokens", 2.5), ("temperature", -0.1), ("temperature", float("nan")),
    ("top_p", 0.0), ("top_p", 1.5), ("top_k", -1), ("repetition_penalty", 0.0), ("seed", "7"), ("stop", [1]),
])
def test_bad_settings_name_the_field_and_value(field, value):
    with pytest.raises(ValueError) as e:
        SamplingParams(**{field: value})
    assert f"SamplingParams.{field}" in str(e.value) and repr(value) in str(e.value)


def test_settings_merge_and_unknown_names_are_refused():
    assert SamplingParams(stop="END").stop == ("END",) and SamplingParams(stop=None).stop == ()
    base = SamplingParams(max_new_tokens=5, temperature=0.5, seed=1)
    merged = sampling_params(base, top_k=3)
    assert (merged.max_new_tokens, merged.temperature, merged.top_k, merged.seed) == (5, 0.5, 3, 1)
    assert sampling_params(base) is base and sampling_params(None) == SamplingParams()
    assert sampling_params(9).max_new_tokens == 9  # max_new_tokens passed positionally by older callers
    with pytest.raises(TypeError, match="unknown sampling setting.*tempreature.*known: max_new_tokens"):
        sampling_params(tempreature=1.0)
    with pytest.raises(TypeError, match="params must be a SamplingParams, got str"):
        sampling_params("greedy")


def test_processors_follow_the_settings():
    assert len(SamplingParams().processors()) == 0  # greedy: one argmax, no context needed
    assert not Sampler(SamplingParams()).needs_context
    names = [type(p).__name__ for p in SamplingParams(temperature=0.7, top_k=5, top_p=0.9,
                                                      repetition_penalty=1.2).processors()]
    assert names == ["RepetitionPenaltyLogitsProcessor", "TemperatureLogitsWarper", "TopKLogitsWarper",
                     "TopPLogitsWarper"]
    assert [type(p).__name__ for p in SamplingParams(top_k=5, repetition_penalty=1.2).processors()] == [
        "RepetitionPenaltyLogitsProcessor"]  # greedy: warpers are not applied, as in generate(do_sample=False)


def _reference(pc, ids, **kw):
    with torch.inference_mode():
        return pc.model.generate(torch.tensor([ids], device=pc.device), eos_token_id=3, pad_token_id=1, **kw)


@pytest.mark.parametrize("prompt", [PREFIX_PROMPT, GAPPED_PROMPT])
def test_greedy_with_repetition_penalty_equals_model_generate(pc, prompt):
    params = SamplingParams(max_new_tokens=16, repetition_penalty=1.8)
    ids = pc.layout(prompt).token_ids
    ref = _reference(pc, ids, max_new_tokens=16, do_sample=False, repetition_penalty=1.8)[0, len(ids):].tolist()
    assert pc.generate(prompt, params, use_cache=False).token_ids == ref  # the baseline path
    plain = _reference(pc, ids, max_new_tokens=16, do_sample=False)[0, len(ids):].tolist()
    assert plain != ref  # the penalty changes these tokens, so the comparison above means something
    if prompt == PREFIX_PROMPT:  # exact splice: the cached path gives the same tokens too
        assert pc.prefill(prompt).exact
        assert pc.generate(prompt, params).token_ids == ref
    gc = params.generation_config()
    with torch.inference_mode():
        via_config = pc.model.generate(torch.tensor([ids], device=pc.device), generation_config=gc, eos_token_id=3, pad_token_id=1)
    assert via_config[0, len(ids):].tolist() == ref


def test_sampled_step_draws_from_the_distribution_generate_draws_from(pc):
    """Our processed scores equal generate's at every step of a sampled run (same context)."""
    params = SamplingParams(max_new_tokens=6, temperature=0.7, top_k=20, top_p=0.9, repetition_penalty=1.3, seed=0)
    ids = pc.layout(PREFIX_PROMPT).token_ids
    torch.manual_seed(0)
    with torch.inference_mode():
        out = pc.model.generate(torch.tensor([ids], device=pc.device), max_new_tokens=6, do_sample=True, temperature=0.7, top_k=20,
                                top_p=0.9, repetition_penalty=1.3, eos_token_id=3, pad_token_id=1,
                                output_scores=True, output_logits=True, return_dict_in_generate=True)
    seq = out.sequences[0].tolist()
    sampler = Sampler(params)
    for step, (raw, processed) in enumerate(zip(out.logits, out.scores)):
        ours = sampler.scores(raw[0], seq[: len(ids) + step])
        assert torch.equal(torch.isinf(ours), torch.isinf(processed))
        finite = ~torch.isinf(processed)
        assert torch.allclose(ours[finite], processed[finite], atol=1e-5)
        assert int(finite.sum()) < processed.shape[-1]  # top-k / top-p removed something


def test_seeded_sampling_repeats_and_differs_across_seeds(pc):
    a = pc.generate(PREFIX_PROMPT, max_new_tokens=12, temperature=1.5, seed=1)
    assert pc.generate(PREFIX_PROMPT, SamplingParams(max_new_tokens=12, temperature=1.5, seed=1)).token_ids == a.token_ids
    others = {tuple(pc.generate(PREFIX_PROMPT, max_new_tokens=12, temperature=1.5, seed=s).token_ids) for s in (2, 3, 4)}
    assert others != {tuple(a.token_ids)}


def test_min_tokens_masks_eos_and_ignore_eos_keeps_going():
    """A request whose model prefers EOS: min_tokens holds it off, ignore_eos never stops on it."""
    import torch

    from promptcache.engine.serving_core.request import Request
    from promptcache.engine.decoding.sampling import SamplingParams
    from tiny import make_tokenizer

    tok = make_tokenizer()
    eos = frozenset([3])
    logits = torch.zeros(10)
    logits[3] = 5.0  # EOS is the greedy choice
    req = Request(None, SamplingParams(max_new_tokens=5, min_tokens=2), tok)
    for expect_stop in (False, False, True):
        token = req.sampler.sample(req.mask_eos(logits, eos), req.context)
        req.accept(token, eos)
        assert (req.finish_reason == "stop") == expect_stop
    assert logits[3] == 5.0  # the caller's logits are untouched
    keep = Request(None, SamplingParams(max_new_tokens=3, ignore_eos=True), tok)
    for _ in range(3):
        keep.accept(keep.sampler.sample(keep.mask_eos(logits, eos), keep.context), eos)
    assert keep.token_ids == [3, 3, 3] and keep.finish_reason == "length"


def test_a_steps_argmax_is_taken_only_where_sampling_would_pick_it():
    """The scheduler takes every row's argmax in one call and hands it to ``sample_next``: a plain
    greedy request takes it, unless it is an EOS still masked by min_tokens (then the next best);
    a request that samples, or whose processors read the context, samples as without it."""
    import torch

    from promptcache.engine.serving_core.request import Request
    from promptcache.engine.decoding.sampling import SamplingParams
    from tiny import make_tokenizer

    tok = make_tokenizer()
    eos = frozenset([3])
    logits = torch.zeros(10)
    logits[3], logits[7] = 5.0, 4.0  # EOS first, token 7 next
    held = Request(None, SamplingParams(max_new_tokens=5, min_tokens=2), tok)
    assert [held.sample_next(logits, eos, argmax=3)[0] for _ in range(3)] == [7, 7, 3]
    assert held.finish_reason == "stop"
    plain = Request(None, SamplingParams(max_new_tokens=2), tok)
    assert plain.sample_next(logits, eos, argmax=3)[0] == 3 and plain.finish_reason == "stop"
    # a wrong hint would show: a request with a repetition penalty reads its context, never the hint
    penalized = Request(None, SamplingParams(max_new_tokens=2, repetition_penalty=1.3), tok)
    assert penalized.sample_next(logits, frozenset(), argmax=1)[0] == 3
    sampled = Request(None, SamplingParams(max_new_tokens=2, temperature=0.7, seed=0), tok)
    sharp = torch.zeros(10)
    sharp[3] = 50.0  # sampling picks 3 (all but surely): the hint 1 is not taken
    assert sampled.sample_next(sharp, frozenset(), argmax=1)[0] == 3
