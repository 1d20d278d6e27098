"""Automatic prefix reuse is exact: logits equal a plain prefill (DESIGN.md section 4)."""

from __future__ import annotations

import torch

from promptcache.engine import Request, SamplingParams, TokenPrompt

TEXT = " ".join(["The quick brown fox jumps over the lazy dog while the cat watches from the warm window sill."] * 6)


def prefill(pc, ids: list[int], namespace: str):
    """The engine's prefill of token ids (prefix blocks reused and shared): its PrefillResult."""
    engine = pc.engine()
    req = Request(TokenPrompt(tuple(ids), namespace, reuse=True), SamplingParams(max_new_tokens=0),
                  pc.tokenizer)
    engine.run([req])
    assert req.error is None, req.error
    return req.prefill


def test_prefix_blocks_give_the_logits_of_a_plain_prefill(pc):
    base = pc.prefill_baseline(TEXT)
    ids = pc.tokenizer(TEXT).input_ids
    assert list(base.layout.token_ids) == ids  # the same tokens as the server's completions path
    cold = prefill(pc, ids, "exact-test")
    assert cold.cached_tokens == 0
    warm = prefill(pc, ids, "exact-test")
    assert warm.cached_tokens == (len(ids) - 1) // 16 * 16 > 0
    assert torch.allclose(warm.logits, base.logits, atol=1e-4)
    assert torch.allclose(cold.logits, base.logits, atol=1e-4)


def test_longer_prompt_reuses_a_shorter_ones_blocks(pc):
    ids = pc.tokenizer(TEXT).input_ids
    prefill(pc, ids[:50], "grow-test")
    res = prefill(pc, ids, "grow-test")
    assert res.cached_tokens == 48
    assert torch.allclose(res.logits, pc.prefill_baseline(TEXT).logits, atol=1e-4)


def test_namespaces_and_models_salt_the_keys(pc):
    engine = pc.engine()
    ids = pc.tokenizer(TEXT).input_ids
    assert engine.prefix.keys(ids, "a") != engine.prefix.keys(ids, "b")
    prefill(pc, ids, "a")
    assert engine.matched_tokens(ids, "a") > 0 and engine.matched_tokens(ids, "b") == 0
    assert prefill(pc, ids, "b").cached_tokens == 0
    # a chain: changing one early token changes every later key
    changed = [ids[0], ids[1] + 1] + ids[2:]
    assert not set(engine.prefix.keys(changed, "a")) & set(engine.prefix.keys(ids, "a"))
