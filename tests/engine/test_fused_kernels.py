"""Fused SiLU MLP and rotary kernels (kernels/fused.py, kernels/fused.cpp) against transformers'
own ops: float32 to rounding, bfloat16 rotary to the bit and SiLU within one bfloat16 step where
the exp's last bits differ; swapped only where a family's forward is the Llama form; the stock
forward where the kernels do not cover a call; the engine's CPU fast path using them."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from promptcache.kernels import FusedAttention, FusedMLP, fuse_mlps_and_rotary
from promptcache.kernels import fused
from programs import COMPILER, require
from refusals import refused_in_child
from tiny import fresh_model, native_kernels_stand_aside, packed_refused


@pytest.fixture(scope="module")
def ops():
    require(*COMPILER)  # skipped, the packages named, without a compiler (failed under CI=true)
    assert fused.KERNELS.available(), fused.KERNELS.unavailable_reason()
    return fused.KERNELS.ops


# the kernels' refusals run in a child process (tests/refusals.py): a crash fails the test, not the worker
SETUP = ("import torch\nfrom promptcache.kernels import fused\n"
         "assert fused.KERNELS.available(), fused.KERNELS.unavailable_reason()\nops = fused.KERNELS.ops\n")


def packed_gate_up(n, width, dtype, seed):
    """gate and up as the two halves of one packed product [1, n, 2 * width] (strided rows)."""
    y = (torch.randn(1, n, 2 * width, generator=torch.Generator().manual_seed(seed)) * 4).to(dtype)
    return y[..., :width], y[..., width:]


@pytest.mark.parametrize("n,width", [(512, 1536), (7, 40), (3, 17), (1, 1)])
def test_silu_mul_equals_the_stock_ops(ops, n, width):
    g, u = packed_gate_up(n, width, torch.float32, n + width)
    got = ops.silu_mul(g, u)
    assert got.shape == g.shape and got.is_contiguous()
    assert torch.allclose(got, F.silu(g) * u, rtol=1e-6, atol=1e-6)
    gb, ub = g.bfloat16(), u.bfloat16()
    got, want = ops.silu_mul(gb, ub), F.silu(gb) * ub
    assert got.dtype == torch.bfloat16
    step = want.float().abs() * 2.0 ** -7 + 1e-30  # one bfloat16 step at each value
    assert ((got.float() - want.float()).abs() <= step).all()
    assert (got == want).float().mean().item() >= 0.98  # most agree to the bit


def test_silu_mul_at_large_magnitudes_and_refusals(ops):
    g = torch.tensor([[-1e4, -100.0, -88.0, -20.0, 0.0, 20.0, 88.0, 100.0, 1e4, float("nan")] + [1.0] * 6])
    u = torch.ones_like(g) * 2
    got, want = ops.silu_mul(g, u), F.silu(g) * u
    assert torch.allclose(got, want, rtol=1e-6, atol=1e-6, equal_nan=True)
    refused_in_child(SETUP + "g, u = torch.randn(1, 16), torch.ones(1, 16)", [
        ("ops.silu_mul(g.bfloat16(), u)", "both float32 or both bfloat16"),
        ("ops.silu_mul(g, u[:, :8])", "differ")])


def qk_views(n, hq, hk, d, dtype, seed):
    """q [1, Hq, n, D] and k [1, Hk, n, D] as views of one packed q/k/v product, and cos/sin."""
    g = torch.Generator().manual_seed(seed)
    y = torch.randn(1, n, (hq + 2 * hk) * d, generator=g).to(dtype)
    q = y[..., : hq * d].view(1, n, hq, d).transpose(1, 2)
    k = y[..., hq * d: (hq + hk) * d].view(1, n, hk, d).transpose(1, 2)
    angles = torch.rand(1, n, d // 2, generator=g) * 100
    emb = torch.cat([angles, angles], dim=-1)
    return q, k, emb.cos().to(dtype), emb.sin().to(dtype)


def layout(x):
    """Strides of the dimensions that have more than one element (the others' do not matter)."""
    return [s for s, n in zip(x.stride(), x.shape) if n > 1]


@pytest.mark.parametrize("n,hq,hk,d", [(512, 9, 3, 64), (5, 4, 2, 16), (3, 2, 1, 36), (2, 2, 2, 256), (1, 1, 1, 2)])
def test_rotary_equals_the_stock_ops(ops, n, hq, hk, d):
    for dtype in (torch.float32, torch.bfloat16):
        q, k, cos, sin = qk_views(n, hq, hk, d, dtype, n * d)
        got_q, got_k = ops.rotary(q, k, cos, sin)
        want_q, want_k = apply_rotary_pos_emb(q, k, cos, sin)
        assert got_q.shape == want_q.shape and got_k.shape == want_k.shape and got_q.dtype == dtype
        assert layout(got_q) == layout(want_q) and layout(got_k) == layout(want_k)  # the stock layout
        if dtype == torch.float32:
            assert torch.allclose(got_q, want_q, rtol=1e-6, atol=1e-5)
            assert torch.allclose(got_k, want_k, rtol=1e-6, atol=1e-5)
        else:  # each product and the sum rounded where the stock ops round them: the same bits
            assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)


def test_rotary_broadcasts_cos_over_the_batch_and_refuses_mismatches(ops):
    q, k, cos, sin = qk_views(6, 4, 2, 32, torch.float32, 3)
    q2, k2 = torch.cat([q, q * 2]), torch.cat([k, -k])  # batch 2, cos/sin of batch 1
    got_q, got_k = ops.rotary(q2, k2, cos, sin)
    want_q, want_k = apply_rotary_pos_emb(q2, k2, cos, sin)
    assert torch.allclose(got_q, want_q, atol=1e-5) and torch.allclose(got_k, want_k, atol=1e-5)
    refused_in_child(SETUP + "q, k = torch.randn(1, 4, 6, 32), torch.randn(1, 2, 6, 32)\n"
                             "cos, sin = torch.randn(1, 6, 32), torch.randn(1, 6, 32)", [
        ("ops.rotary(q, k, cos.bfloat16(), sin)", "share one dtype"),
        ("ops.rotary(q, k, cos[..., :16], sin[..., :16])", "do not match")])


@pytest.mark.cpu_only(refusal=native_kernels_stand_aside)
@pytest.mark.parametrize("family,mlps,attentions", [("llama", 2, 2), ("mistral", 2, 0), ("qwen2", 2, 0),
                                                    ("gpt_neox", 0, 0)])
def test_only_llama_form_layers_are_swapped_and_the_model_still_computes_the_same(family, mlps, attentions):
    model = fresh_model(family).eval()
    ids = torch.randint(4, 100, (1, 23), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        want = model(input_ids=ids).logits
        assert fuse_mlps_and_rotary(model) == mlps + attentions
        got = model(input_ids=ids).logits
    assert sum(isinstance(m.__dict__.get("forward"), FusedMLP) for m in model.modules()) == mlps
    assert sum(isinstance(m.__dict__.get("forward"), FusedAttention) for m in model.modules()) == attentions
    assert (got - want).abs().max().item() <= 1e-5
    assert fuse_mlps_and_rotary(model) == 0  # already swapped: nothing to do twice


@pytest.mark.cpu_only(refusal=native_kernels_stand_aside)
def test_bfloat16_model_agrees_with_its_stock_forward():
    model = fresh_model("llama").to(torch.bfloat16).eval()
    ids = torch.randint(4, 100, (1, 31), generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        want = model(input_ids=ids).logits.float()
        assert fuse_mlps_and_rotary(model) == 4
        got = model(input_ids=ids).logits.float()
    assert (got - want).abs().max().item() <= 0.05  # SiLU's exp may move a last bit


@pytest.mark.cpu_only(refusal=native_kernels_stand_aside)
def test_calls_the_kernels_do_not_cover_run_the_stock_forward():
    model = fresh_model("llama")
    with torch.no_grad():
        want = model(input_ids=torch.tensor([[5, 6, 7]])).logits
    fuse_mlps_and_rotary(model)
    mlp = model.model.layers[0].mlp
    x = torch.randn(2, 5, mlp.gate_proj.in_features, dtype=torch.float64)  # another dtype than the weights'
    with pytest.raises(RuntimeError):  # the stock forward's own error: float64 input, float32 weights
        mlp(x)
    ids = torch.tensor([[5, 6, 7]])
    loss = model(input_ids=ids).logits.sum()  # training: autograd through the stock ops
    loss.backward()
    assert model.model.layers[0].mlp.gate_proj.weight.grad is not None
    assert torch.allclose(model(input_ids=ids).logits.detach(), want, atol=1e-5)


@pytest.mark.parametrize("module,fuse", [("fused", "fuse_mlps_and_rotary"), ("rms_norm", "fuse_rms_norms")])
def test_switched_off_by_the_environment(module, fuse):
    """Each kernel's environment switch: its layers keep the stock forward, and it says why."""
    switch = getattr(__import__(f"promptcache.kernels.{module}", fromlist=["ENV_SWITCH"]), "ENV_SWITCH")
    code = ("import sys; sys.path.insert(0, 'tests'); from tiny import fresh_model; "
            f"from promptcache.kernels import {module} as f; m = fresh_model('llama'); "
            f"print(f.{fuse}(m), f.KERNELS.unavailable_reason())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={**os.environ, switch: "0", "PROMPTCACHE_TEST_DEVICE": "cpu"})  # a CPU kernel's switch
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == f"0 turned off by {switch}"


@pytest.mark.cpu_only(refusal=packed_refused)
def test_the_cpu_fast_path_fuses_mlps_and_rotary():
    from promptcache import EngineConfig, PromptCache, RunnerConfig
    from tiny import make_tokenizer

    pc = PromptCache(fresh_model("llama"), make_tokenizer(), EngineConfig(runner=RunnerConfig(packed_linear=True)))
    forwards = [type(m.__dict__.get("forward")) for m in pc.model.modules()]
    assert forwards.count(FusedMLP) == 2 and forwards.count(FusedAttention) == 2
