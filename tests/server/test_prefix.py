"""Automatic prefix reuse is exact: logits equal a plain prefill (DESIGN.md section 4)."""

from __future__ import annotations

import torch

from promptcache.engine.prefix import PrefixCache

TEXT = " ".join(["The quick brown fox jumps over the lazy dog while the cat watches from the warm window sill."] * 6)


def test_prefix_blocks_give_the_logits_of_a_plain_prefill(pc):
    prefix = PrefixCache(pc, block_size=16)
    base = pc.prefill_baseline(TEXT)
    ids = pc.tokenizer(TEXT).input_ids
    assert list(base.layout.token_ids) == ids  # the same tokens as the server's completions path
    cold = prefix.prefill(ids, "exact-test")
    pc.release(cold)
    assert cold.cached_tokens == 0
    warm = prefix.prefill(ids, "exact-test")
    pc.release(warm)
    assert warm.cached_tokens == (len(ids) - 1) // 16 * 16 > 0
    assert torch.allclose(warm.logits, base.logits, atol=1e-4)
    assert torch.allclose(cold.logits, base.logits, atol=1e-4)


def test_longer_prompt_reuses_a_shorter_ones_blocks(pc):
    prefix = PrefixCache(pc, block_size=16)
    ids = pc.tokenizer(TEXT).input_ids
    pc.release(prefix.prefill(ids[:50], "grow-test"))
    res = prefix.prefill(ids, "grow-test")
    pc.release(res)
    assert res.cached_tokens == 48
    assert torch.allclose(res.logits, pc.prefill_baseline(TEXT).logits, atol=1e-4)


def test_namespaces_and_models_salt_the_keys(pc):
    prefix = PrefixCache(pc, block_size=16)
    ids = pc.tokenizer(TEXT).input_ids
    assert prefix.keys(ids, "a") != prefix.keys(ids, "b")
    pc.release(prefix.prefill(ids, "a"))
    assert prefix.match(ids, "a") > 0 and prefix.match(ids, "b") == 0
    # a chain: changing one early token changes every later key
    changed = [ids[0], ids[1] + 1] + ids[2:]
    assert not set(prefix.keys(changed, "a")) & set(prefix.keys(ids, "a"))
