"""Masked forwards on the native kernel (kernels/ordered_attention.py): a mask that is causal in some
order of the keys (selective recompute's, by prompt order) is recognised, the keys are put in that
order and each query reads its prefix; the forward equals transformers' sdpa over the same mask."""

from __future__ import annotations

import pytest
import torch

from promptcache import PromptCache
from promptcache.kernels import ordered_attention
from promptcache.rag import DocumentStore
from programs import COMPILER, needs
from tiny import CORPUS, make_model, make_tokenizer, native_kernels_stand_aside

# the kernel is the CPU's: its own tests build CPU tensors on any test device; the engine's use of it
# is ``cpu_only`` (on another device, the kernel stands aside and transformers' sdpa runs)
pytestmark = needs(*COMPILER)


def causal_by(order: torch.Tensor, queries: torch.Tensor) -> torch.Tensor:
    """Bool [1, 1, Q, K]: query i sees key j where order[j] <= queries[i] (prompt indices)."""
    return (order[None, :] <= queries[:, None])[None, None]


def test_a_mask_causal_in_prompt_order_is_a_prefix_in_that_order():
    gen = torch.Generator().manual_seed(0)
    order = torch.randperm(50, generator=gen)  # slot j holds the prompt's token order[j]
    queries = torch.tensor([3, 10, 11, 30, 49])
    mask = causal_by(order, queries)
    found = ordered_attention.key_order(mask)
    assert found is not None
    perm, limits = found
    assert limits.tolist() == [4, 11, 12, 31, 50]
    for q, lim in zip(queries.tolist(), limits.tolist()):  # each query's prefix: its keys, in any order
        assert sorted(order[perm[:lim]].tolist()) == list(range(q + 1))
    # slot order already prompt order: no reordering, the same limits
    same = ordered_attention.key_order(causal_by(torch.arange(50), queries))
    assert same[0] is None and same[1].tolist() == [4, 11, 12, 31, 50]


def test_other_masks_are_not_taken():
    full = torch.ones(1, 1, 3, 8, dtype=torch.bool)
    assert ordered_attention.key_order(full)[1].tolist() == [8, 8, 8]
    crossed = torch.zeros(1, 1, 2, 4, dtype=torch.bool)
    crossed[0, 0, 0, :2] = True  # query 0 sees keys 0, 1; query 1 sees keys 2, 3: no order nests them
    crossed[0, 0, 1, 2:] = True
    assert ordered_attention.key_order(crossed) is None
    empty = torch.ones(1, 1, 2, 4, dtype=torch.bool)
    empty[0, 0, 1] = False  # a query that sees nothing
    assert ordered_attention.key_order(empty) is None


@pytest.mark.parametrize("shape", [(4, 2, 7, 40, 16), (6, 3, 25, 300, 64), (2, 2, 1, 9, 32)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_registered_attention_equals_sdpa_over_the_mask(shape, dtype, monkeypatch):
    hq, hk, t, n, d = shape
    gen = torch.Generator().manual_seed(t * n)
    q = torch.randn(1, t, hq, d, generator=gen).transpose(1, 2).to(dtype)  # strided, as a model's
    buf = torch.randn(2, 1, hk, n + 3, d, generator=gen).to(dtype)
    k, v = buf[0, :, :, :n], buf[1, :, :, :n]
    mask = causal_by(torch.randperm(n, generator=gen), torch.sort(torch.randperm(n, generator=gen)[:t]).values)
    calls = []
    kernel = ordered_attention.native.limits_kernel_for

    def counted(*a):
        op = kernel(*a)
        calls.append(op is not None)
        return op

    module = torch.nn.Module()
    module.num_key_value_groups, module.is_causal = hq // hk, False
    monkeypatch.setattr(ordered_attention.native, "limits_kernel_for", counted)
    got, _ = ordered_attention.ordered_attention(module, q, k, v, mask, scaling=0.2)
    assert calls == [True]
    kk, vv = (x.float().repeat_interleave(hq // hk, 1).double() for x in (k, v))
    s = (q.double() @ kk.transpose(-1, -2)) * 0.2
    want = (torch.softmax(s.masked_fill(~mask, float("-inf")), -1) @ vv).transpose(1, 2)
    assert got.shape == (1, t, hq, d) and got.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 2 ** -7 * v.float().abs().max().item()
    assert (got.double() - want).abs().max().item() < tol


@pytest.mark.cpu_only(refusal=native_kernels_stand_aside)
@pytest.mark.parametrize("family", ["llama", "qwen3", "gpt_neox", "phi3"])
def test_recompute_forwards_take_the_kernel_and_equal_sdpa(family, monkeypatch):
    """The default document mode's recompute forward (separators and the question are new tokens
    among the cached documents: the mask is ragged in slot order) runs on the kernel; the logits
    equal the same forward through transformers' sdpa within float32 rounding."""
    pc = PromptCache(make_model(family), make_tokenizer())
    store = DocumentStore(pc)
    for i, text in enumerate(CORPUS[:4]):
        store.add(f"d{i}", text * 3)
    used = []
    real = ordered_attention.native.limits_kernel_for
    monkeypatch.setattr(ordered_attention.native, "limits_kernel_for",
                        lambda q, kv: used.append(1) or real(q, kv))
    got = store.prefill("Plan a trip of three days.", ["d2", "d0", "d3"])
    assert got.recomputed_tokens > 0 and used
    monkeypatch.setattr(ordered_attention, "covers", lambda device: False)  # transformers' sdpa
    want = store.prefill("Plan a trip of three days.", ["d2", "d0", "d3"])
    assert want.recomputed_tokens == got.recomputed_tokens
    assert torch.max(torch.abs(got.logits - want.logits)).item() <= 1e-4
