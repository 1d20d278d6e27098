"""One-pass RMSNorm (kernels/rms_norm.py, kernels/rms_norm.cpp) against transformers' own
layers: the same values (float32 to rounding, bfloat16 to the bit on these inputs), swapped only
where a family's forward is the Llama form, the stock forward where the kernel does not cover a
call, and the engine's CPU fast path (packed linears) using it."""

from __future__ import annotations

import pytest
import torch

from promptcache.kernels import FusedRMSNorm, fuse_rms_norms
from promptcache.kernels import rms_norm as fused_norm
from programs import COMPILER, require
from refusals import refused_in_child
from tiny import fresh_model, native_kernels_stand_aside, packed_refused


def stock(x, w, eps):
    """transformers' LlamaRMSNorm.forward."""
    dtype = x.dtype
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return w * h.to(dtype)


@pytest.fixture(scope="module")
def op():
    require(*COMPILER)  # skipped, the packages named, without a compiler (failed under CI=true)
    assert fused_norm.KERNELS.available(), fused_norm.KERNELS.unavailable_reason()
    return fused_norm.KERNELS.ops.rms_norm


@pytest.mark.parametrize("shape", [(1, 512, 576), (3, 7, 64), (2, 5, 40), (4, 16), (1, 1, 1)])
def test_kernel_equals_the_stock_forward(op, shape):
    g = torch.Generator().manual_seed(sum(shape))
    x = torch.randn(*shape, generator=g) * 3
    w = torch.randn(shape[-1], generator=g)
    got, want = op(x, w, 1e-5), stock(x, w, 1e-5)
    assert got.dtype == torch.float32 and got.shape == x.shape
    assert torch.allclose(got, want, rtol=2e-6, atol=2e-6)
    xb, wb = x.bfloat16(), w.bfloat16()
    got, want = op(xb, wb, 1e-5), stock(xb, wb, 1e-5)
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, want)


def test_reads_a_strided_input_and_refuses_mixed_dtypes(op):
    x = torch.randn(4, 10, 64)[:, ::2]  # not contiguous
    w = torch.randn(64)
    assert torch.allclose(op(x, w, 1e-6), stock(x, w, 1e-6), rtol=2e-6, atol=2e-6)
    # refusals in a child process (tests/refusals.py): a crash fails this test, not the worker
    refused_in_child("import torch\nfrom promptcache.kernels import rms_norm\n"
                     "assert rms_norm.KERNELS.available(), rms_norm.KERNELS.unavailable_reason()\n"
                     "op = rms_norm.KERNELS.ops.rms_norm\nx, w = torch.randn(4, 10, 64)[:, ::2], torch.randn(64)", [
        ("op(x.bfloat16(), w, 1e-6)", "both float32 or both bfloat16"),
        ("op(x, torch.randn(32), 1e-6)", "do not match")])


@pytest.mark.cpu_only(refusal=native_kernels_stand_aside)
@pytest.mark.parametrize("family,expected", [("llama", 5), ("qwen3", 9), ("mistral", 5), ("gpt_neox", 0),
                                             ("falcon_rotary", 0)])
def test_only_llama_form_norms_are_swapped_and_the_model_still_computes_the_same(family, expected):
    model = fresh_model(family).eval()
    ids = torch.randint(4, 100, (1, 23), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        want = model(input_ids=ids).logits
        assert fuse_rms_norms(model) == expected
        got = model(input_ids=ids).logits
    assert sum(isinstance(m.__dict__.get("forward"), FusedRMSNorm) for m in model.modules()) == expected
    assert (got - want).abs().max().item() <= 1e-5
    assert fuse_rms_norms(model) == 0  # already swapped: nothing to do twice


@pytest.mark.cpu_only(refusal=native_kernels_stand_aside)
def test_bfloat16_model_agrees_with_its_stock_forward():
    model = fresh_model("llama").to(torch.bfloat16).eval()
    ids = torch.randint(4, 100, (1, 31), generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        want = model(input_ids=ids).logits.float()
        assert fuse_rms_norms(model) == 5
        got = model(input_ids=ids).logits.float()
    # the norms round as the stock ones do; a float32 sum in another order may move a last bit
    assert (got - want).abs().max().item() <= 0.05


@pytest.mark.cpu_only(refusal=native_kernels_stand_aside)
def test_calls_the_kernel_does_not_cover_run_the_stock_forward():
    model = fresh_model("llama")
    fuse_rms_norms(model)
    norm = model.model.norm
    x = torch.randn(2, 5, 64, dtype=torch.float64)  # another dtype than the weight's
    assert torch.equal(norm(x), stock(x, norm.weight, norm.variance_epsilon))
    x = torch.randn(2, 5, 64, requires_grad=True)  # training: autograd through the stock ops
    norm(x).sum().backward()
    assert x.grad is not None and x.grad.abs().sum() > 0


@pytest.mark.cpu_only(refusal=packed_refused)
def test_the_cpu_fast_path_fuses_the_norms():
    from promptcache import EngineConfig, PromptCache, RunnerConfig
    from tiny import make_tokenizer

    pc = PromptCache(fresh_model("llama"), make_tokenizer(), EngineConfig(runner=RunnerConfig(packed_linear=True)))
    assert sum(isinstance(m.__dict__.get("forward"), FusedRMSNorm) for m in pc.model.modules()) == 5
