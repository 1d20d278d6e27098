"""The native CPU attention kernel (kernels/attention.py, kernels/attention.cpp) against
attention computed in float64, and the engine's use of it. Its refusals of bad input run in a child
process (tests/refusals.py): a crash there fails the test naming the signal, not the worker."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from programs import COMPILER, require
from promptcache.kernels import attention as cpu_attention
from refusals import refused_in_child
from tiny import native_kernels_stand_aside


@pytest.fixture(scope="module")
def op():
    require(*COMPILER)  # skipped, the packages named, without a compiler (failed under CI=true)
    assert cpu_attention.available(), cpu_attention.unavailable_reason()
    return cpu_attention.kernel_for(torch.zeros(1, 1, 16))


def reference(q, k, v, scale, causal_t=0):
    s = (q.double() @ k.double().transpose(-1, -2)) * scale  # [X, M, N]
    if causal_t:
        r = torch.arange(q.shape[1])[:, None] % causal_t
        s = s.masked_fill(torch.arange(k.shape[1])[None, :] > r, float("-inf"))
    return torch.softmax(s, -1) @ v.double(), torch.logsumexp(s, -1)


def close(got, want):
    (o, l), (ro, rl) = got, want
    assert o.dtype == torch.float32 and l.dtype == torch.float32
    # float32 rounding, relative to the output's size (summation order differs by CPU: a lent
    # machine's CPU gave 1.04e-5 on outputs of magnitude ~3)
    assert (o.double() - ro).abs().max().item() < 1e-5 * max(1.0, ro.abs().max().item())
    assert (l.double() - rl).abs().max().item() < 1e-5 * max(1.0, rl.abs().max().item())


@pytest.mark.parametrize("x,m,n,d", [(3, 192, 1024, 64), (3, 3, 300, 64), (2, 5, 70, 16), (4, 49, 129, 32),
                                     (1, 1, 1, 128), (2, 33, 65, 80), (1, 7, 64, 256), (2, 100, 2, 48),
                                     # few query rows over many keys: the keys are split, the parts merged
                                     (3, 3, 2048, 64), (1, 2, 1000, 32)])
def test_equals_float64_attention(op, x, m, n, d):
    g = torch.Generator().manual_seed(m * n + d)
    q, k, v = (torch.randn(x, r, d, generator=g) * 2 for r in (m, n, n))
    close(op(q, k, v, d ** -0.5, 0), reference(q, k, v, d ** -0.5))


@pytest.mark.parametrize("x,groups,t,d", [(3, 3, 130, 64), (2, 2, 7, 16), (1, 3, 1, 32), (2, 1, 64, 16)])
def test_causal_chunks(op, x, groups, t, d):
    """causal_t = t: query r of each group of t sees keys 0 .. r % t (a prefill chunk among itself)."""
    g = torch.Generator().manual_seed(t)
    q, k, v = torch.randn(x, groups * t, d, generator=g), torch.randn(x, t, d, generator=g), torch.randn(x, t, d, generator=g)
    close(op(q, k, v, 0.3, t), reference(q, k, v, 0.3, causal_t=t))


def test_reads_strided_pool_views(op):
    """Keys/values as the engine passes them: views into a [L, 2, H, S, D] buffer, not copies."""
    buf = torch.randn(3, 2, 3, 500, 64)
    k, v = buf[1, 0, :, 37:291], buf[1, 1, :, 37:291]
    assert not k.is_contiguous()
    q = torch.randn(3, 20, 64)
    close(op(q, k, v, 0.125, 0), reference(q, k, v, 0.125))


@pytest.mark.parametrize("b,g,d", [(1, 3, 64), (64, 3, 64), (5, 1, 16), (3, 7, 32), (2, 49, 16)])
def test_gather_reads_each_rows_slots(b, g, d):
    """attend_gather: decode rows over their own keys, read from a pool layer by slot."""
    gather = cpu_attention.gather_kernel_for(torch.zeros(1, 1, 1, d), torch.zeros(1))
    assert gather is not None
    gen = torch.Generator().manual_seed(b * g + d)
    buf = torch.randn(2, 2, 3, 700, d, generator=gen)  # [L, 2, Hk, S, D], as the pool holds it
    kbuf, vbuf = buf[1, 0], buf[1, 1]
    lengths = torch.randint(1, 150, (b,), generator=gen)
    width = int(lengths.max())
    slots = torch.zeros(b, width, dtype=torch.long)
    for i, n in enumerate(lengths.tolist()):
        slots[i, :n] = torch.randperm(700, generator=gen)[:n]  # scattered, in any order
    q = torch.randn(3, b, g, d, generator=gen)
    out, lse = gather(q, kbuf, vbuf, slots, lengths, 0.2)
    assert out.shape == (3, b, g, d) and lse.shape == (3, b, g)
    for i, n in enumerate(lengths.tolist()):
        idx = slots[i, :n]
        close((out[:, i], lse[:, i]), reference(q[:, i], kbuf[:, idx], vbuf[:, idx], 0.2))


def shared_slots(gen, b, plan):
    """Slots [b, W] and lengths [b]: rows grouped as ``plan`` says ((rows, shared keys) each), the
    rows of a group beginning with the same slots, then slots of their own (none for the first row
    of a group when ``own`` says so); the rest of the rows private."""
    perm = torch.randperm(2000, generator=gen).tolist()
    rows, taken = [], 0

    def fresh(n):
        nonlocal taken
        taken += n
        return perm[taken - n: taken]

    for count, shared, no_own in plan:
        common = fresh(shared)
        for i in range(count):
            rows.append(common + ([] if no_own and i == 0 else fresh(int(torch.randint(1, 90, (1,), generator=gen)))))
    while len(rows) < b:
        rows.append(fresh(int(torch.randint(1, 200, (1,), generator=gen))))
    lengths = torch.tensor([len(r) for r in rows])
    slots = torch.zeros(b, int(lengths.max()), dtype=torch.long)
    for i, r in enumerate(rows):
        slots[i, : len(r)] = torch.tensor(r)
    order = torch.randperm(b, generator=gen)  # groups interleaved, as a step's rows come
    return slots[order], lengths[order]


# decode rows over one shared prompt (its pool slots folded into each row's own): the shared keys
# are read once for all the rows that begin with them, each row's own keys after; the result is
# the attention over each row's whole slot list, as for rows that share nothing
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("b,g,d,plan", [(16, 3, 64, [(16, 1024, False)]),
                                        (12, 3, 64, [(5, 130, False), (4, 700, True), (2, 64, False)]),
                                        (7, 7, 16, [(3, 300, False), (2, 129, True)]),
                                        (20, 1, 80, [(20, 260, False)]),
                                        (4, 49, 32, [(4, 200, False)])])
def test_gather_rows_beginning_alike(dtype, b, g, d, plan):
    gen = torch.Generator().manual_seed(b * g + d)
    buf = torch.randn(2, 2, 3, 2000, d, generator=gen).to(dtype)
    kbuf, vbuf = buf[1, 0], buf[1, 1]
    gather = cpu_attention.gather_kernel_for(torch.zeros(1, 1, 1, d), kbuf)
    assert gather is not None
    slots, lengths = shared_slots(gen, b, plan)
    q = torch.randn(3, b, g, d, generator=gen) * 2
    out, lse = gather(q, kbuf, vbuf, slots, lengths, d ** -0.5)
    for i, n in enumerate(lengths.tolist()):
        idx = slots[i, :n]
        close((out[:, i], lse[:, i]), reference(q[:, i], kbuf[:, idx].float(), vbuf[:, idx].float(), d ** -0.5))


# a bfloat16 model's decode queries over its bfloat16 pool: the keys the rows share in bfloat16
# products (probabilities rounded to bfloat16 before P V, as attend's), each row's own keys widened;
# the log-sum-exp stays a float32 sum of exact products, the output within the probabilities' rounding
@pytest.mark.parametrize("b,g,d,plan", [(16, 3, 64, [(16, 1024, False)]),
                                        (9, 7, 32, [(4, 300, True), (3, 129, False)]),
                                        (4, 49, 16, [(4, 200, False)])])
def test_gather_bfloat16_queries_over_rows_beginning_alike(b, g, d, plan):
    gen = torch.Generator().manual_seed(b * g + d + 1)
    buf = (torch.randn(2, 2, 3, 2000, d, generator=gen) * 2).bfloat16()
    kbuf, vbuf = buf[1, 0], buf[1, 1]
    q = (torch.randn(3, b, g, d, generator=gen) * 2).bfloat16()
    gather = cpu_attention.gather_kernel_for(q, kbuf)
    assert gather is not None
    slots, lengths = shared_slots(gen, b, plan)
    out, lse = gather(q, kbuf, vbuf, slots, lengths, d ** -0.5)
    assert out.dtype == torch.float32 and lse.dtype == torch.float32
    wo, wl = gather(q.float(), kbuf, vbuf, slots, lengths, d ** -0.5)  # float32 queries: widened throughout
    for i, n in enumerate(lengths.tolist()):
        idx = slots[i, :n]
        ro, rl = reference(q[:, i].float(), kbuf[:, idx].float(), vbuf[:, idx].float(), d ** -0.5)
        assert (lse[:, i].double() - rl).abs().max().item() < 1e-5
        assert (out[:, i].double() - ro).abs().max().item() < 2 ** -8 * vbuf.float().abs().max().item()
        close((wo[:, i], wl[:, i]), (ro, rl))


# a bfloat16 pool is read as it is, each element widened to float32 (exact): the result equals the
# float64 attention over the same bfloat16 values, to float32 rounding as for a float32 pool
@pytest.mark.parametrize("x,m,n,d", [(3, 192, 1024, 64), (3, 3, 2048, 64), (2, 5, 70, 16), (2, 33, 65, 80)])
def test_bfloat16_keys_and_values_equal_float64_attention_over_their_values(op, x, m, n, d):
    g = torch.Generator().manual_seed(m * n + d)
    q = torch.randn(x, m, d, generator=g) * 2
    buf = (torch.randn(2, x, n + 9, d, generator=g) * 2).bfloat16()  # strided views, as from a pool
    k, v = buf[0, :, 9:], buf[1, :, 9:]
    assert cpu_attention.kernel_for(q, k) is op
    close(op(q, k, v, d ** -0.5, 0), reference(q, k.float(), v.float(), d ** -0.5))


@pytest.mark.parametrize("x,groups,t,d", [(3, 3, 130, 64), (2, 1, 64, 16)])
def test_bfloat16_causal_chunks(op, x, groups, t, d):
    g = torch.Generator().manual_seed(t)
    q = torch.randn(x, groups * t, d, generator=g)
    k, v = torch.randn(x, t, d, generator=g).bfloat16(), torch.randn(x, t, d, generator=g).bfloat16()
    close(op(q, k, v, 0.3, t), reference(q, k.float(), v.float(), 0.3, causal_t=t))


@pytest.mark.parametrize("b,g,d", [(64, 3, 64), (3, 7, 32)])
def test_bfloat16_gather_reads_each_rows_slots(b, g, d):
    gen = torch.Generator().manual_seed(b * g + d)
    buf = torch.randn(2, 2, 3, 700, d, generator=gen).bfloat16()
    kbuf, vbuf = buf[1, 0], buf[1, 1]
    gather = cpu_attention.gather_kernel_for(torch.zeros(1, 1, 1, d), kbuf)
    assert gather is not None
    lengths = torch.randint(1, 150, (b,), generator=gen)
    slots = torch.zeros(b, int(lengths.max()), dtype=torch.long)
    for i, n in enumerate(lengths.tolist()):
        slots[i, :n] = torch.randperm(700, generator=gen)[:n]
    q = torch.randn(3, b, g, d, generator=gen)
    out, lse = gather(q, kbuf, vbuf, slots, lengths, 0.2)
    for i, n in enumerate(lengths.tolist()):
        idx = slots[i, :n]
        close((out[:, i], lse[:, i]), reference(q[:, i], kbuf[:, idx].float(), vbuf[:, idx].float(), 0.2))


# a bfloat16 model's queries over its bfloat16 pool: bfloat16 products (AVX-512 BF16) summed in
# float32, so the scores, and with them the log-sum-exp, are float32 sums of exact products; the
# probabilities are rounded to bfloat16 before P V (half a unit in the 8th bit of each weight)
@pytest.mark.parametrize("x,m,n,d,causal", [(3, 192, 1024, 64, False), (3, 3, 2048, 64, False),
                                            (2, 5, 70, 16, False), (2, 33, 65, 80, False), (1, 7, 129, 256, False),
                                            (3, 3 * 130, 130, 64, True), (2, 64, 64, 16, True), (2, 2 * 33, 33, 128, True)])
def test_bfloat16_queries_over_a_bfloat16_pool(op, x, m, n, d, causal):
    g = torch.Generator().manual_seed(m * n + d)
    q = (torch.randn(x, m, d, generator=g) * 2).bfloat16()
    buf = (torch.randn(2, x, n + 9, d, generator=g) * 2).bfloat16()  # strided views, as from a pool
    k, v = buf[0, :, 9:], buf[1, :, 9:]
    assert cpu_attention.kernel_for(q, k) is op
    t = n if causal else 0
    out, lse = op(q, k, v, d ** -0.5, t)
    ro, rl = reference(q.float(), k.float(), v.float(), d ** -0.5, t)
    assert out.dtype == torch.float32 and lse.dtype == torch.float32
    assert (lse.double() - rl).abs().max().item() < 1e-5
    assert (out.double() - ro).abs().max().item() < 2 ** -8 * v.float().abs().max().item()
    # the same queries widened to float32 take the float32 path: the same attention
    wo, wl = op(q.float(), k, v, d ** -0.5, t)
    assert (wl - lse).abs().max().item() < 1e-5
    assert (wo - out).abs().max().item() < 2 ** -8 * v.float().abs().max().item()


def test_bfloat16_queries_over_float32_keys_are_widened(op):
    g = torch.Generator().manual_seed(5)
    q = torch.randn(2, 40, 64, generator=g).bfloat16()
    k, v = torch.randn(2, 90, 64, generator=g), torch.randn(2, 90, 64, generator=g)
    close(op(q, k, v, 0.125, 0), reference(q.float(), k, v, 0.125))


def limits_reference(q, k, v, scale, limits):
    s = (q.double() @ k.double().transpose(-1, -2)) * scale  # [X, M, N]
    s = s.masked_fill(torch.arange(k.shape[1])[None, :] >= limits[:, None], float("-inf"))
    return torch.softmax(s, -1) @ v.double(), torch.logsumexp(s, -1)


# each query row sees a prefix of the keys (selective recompute's mask with the keys in prompt
# order): rows in order and shuffled, prefixes from 1 key to all, few rows (keys split and merged)
@pytest.mark.parametrize("x,m,n,d,order", [(3, 169, 1000, 64, "sorted"), (2, 100, 300, 16, "shuffled"),
                                           (1, 3, 2048, 64, "sorted"), (2, 49, 129, 80, "shuffled"),
                                           (3, 7, 64, 256, "sorted"), (1, 1, 1, 32, "sorted")])
def test_limits_give_each_row_its_prefix(x, m, n, d, order):
    gen = torch.Generator().manual_seed(m + n + d)
    q = torch.randn(x, m, d, generator=gen) * 2
    buf = torch.randn(2, x, n + 5, d, generator=gen)  # strided views, as from a cache buffer
    k, v = buf[0, :, 5:], buf[1, :, 5:]
    limits = torch.randint(1, n + 1, (m,), generator=gen)
    limits[0] = 1
    limits[-1] = n
    limits = limits.sort().values if order == "sorted" else limits
    op = cpu_attention.limits_kernel_for(q, k)
    assert op is not None
    close(op(q, k, v, d ** -0.5, limits), limits_reference(q, k, v, d ** -0.5, limits))
    # bfloat16 queries over bfloat16 keys: bfloat16 products, float32 sums (as attend's)
    qb, kb, vb = q.bfloat16(), k.bfloat16(), v.bfloat16()
    out, lse = op(qb, kb, vb, d ** -0.5, limits)
    ro, rl = limits_reference(qb.float(), kb.float(), vb.float(), d ** -0.5, limits)
    assert (lse.double() - rl).abs().max().item() < 1e-5
    assert (out.double() - ro).abs().max().item() < 2 ** -8 * vb.float().abs().max().item()


SETUP = "import torch\nfrom promptcache.kernels import attention as c\n"


def test_limits_are_checked(op):
    refused_in_child(SETUP + "op = c.limits_kernel_for(torch.zeros(1, 1, 16), torch.zeros(1, 1, 16))\n"
                             "q, k = torch.randn(1, 3, 16), torch.randn(1, 10, 16)", [
        ("op(q, k, k, 1.0, torch.tensor([1, 0, 2]))", "row 1 sees 0 keys"),
        ("op(q, k, k, 1.0, torch.tensor([1, 2, 11]))", "row 2 sees 11 keys"),
        ("op(q, k, k, 1.0, torch.tensor([1, 2]))", r"limits must be int64 \[3\]"),
        ("op(q, k, k, 1.0, torch.tensor([1, 2, 3], dtype=torch.int32))", r"limits must be int64 \[3\]")])


def test_gather_refuses_slots_outside_the_pool(op):
    refused_in_child(SETUP + "gather = c.gather_kernel_for(torch.zeros(1, 1, 1, 16), torch.zeros(1))\n"
                             "q, k = torch.randn(1, 2, 1, 16), torch.randn(1, 10, 16)\n"
                             "slots, lengths = torch.tensor([[0, 1], [9, 10]]), torch.tensor([2, 2])", [
        ("gather(q, k, k, slots, lengths, 1.0)", "row 1 slot 10 is outside the 10 slots"),
        ("gather(q, k, k, slots, torch.tensor([3, 1]), 1.0)", "row 0 has length 3")])


def test_extreme_scores_stay_finite(op):
    """Scores far apart (exp underflows for all but the largest) and equal keys: a proper softmax."""
    q = torch.full((1, 4, 16), 30.0)
    k = torch.cat([torch.full((1, 1, 16), 1.0), torch.full((1, 99, 16), -1.0)], 1)
    v = torch.randn(1, 100, 16)
    got = op(q, k, v, 1.0, 0)
    assert torch.isfinite(got[0]).all() and torch.isfinite(got[1]).all()
    close(got, reference(q, k, v, 1.0))


def test_bad_input_is_refused_with_its_shapes(op):
    refused_in_child(SETUP + "op = c.kernel_for(torch.zeros(1, 1, 16))", [
        ("op(torch.randn(2, 4, 16), torch.randn(3, 5, 16), torch.randn(3, 5, 16), 1.0, 0)", "do not match"),
        ("op(torch.randn(1, 4, 16).double(), torch.randn(1, 5, 16), torch.randn(1, 5, 16), 1.0, 0)", "float32"),
        ("op(torch.randn(1, 4, 16), torch.randn(1, 5, 16).bfloat16(), torch.randn(1, 5, 16), 1.0, 0)",
         "both float32 or both bfloat16"),
        ("op(torch.randn(1, 4, 16), torch.randn(1, 5, 16), torch.randn(1, 5, 16), 1.0, 3)", "causal_t")])


def test_shapes_it_does_not_cover_go_to_torch():
    for q in (torch.zeros(1, 2, 8), torch.zeros(1, 2, 24), torch.zeros(1, 2, 272), torch.zeros(1, 2, 64).double()):
        assert cpu_attention.kernel_for(q) is None
        assert cpu_attention.gather_kernel_for(q, torch.zeros(1)) is None
    assert cpu_attention.gather_kernel_for(torch.zeros(1, 1, 1, 16), torch.zeros(1, dtype=torch.float16)) is None
    assert cpu_attention.kernel_for(torch.zeros(1, 2, 16), torch.zeros(1, dtype=torch.float16)) is None


def test_switched_off_by_the_environment():
    code = ("import torch; from promptcache.kernels import attention as c; "
            "print(c.kernel_for(torch.zeros(1, 1, 16)), c.unavailable_reason())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={**os.environ, cpu_attention.ENV_SWITCH: "0"})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == f"None turned off by {cpu_attention.ENV_SWITCH}"


@pytest.mark.cpu_only(refusal=native_kernels_stand_aside)
def test_the_serving_engine_attends_through_it_and_stays_exact(op, monkeypatch):
    """Requests served together (chunked prefill, batched decode) call the native kernel, and their
    logits and greedy tokens still equal the oracle's (test_serving holds every family to it)."""
    from oracle import definition_greedy, definition_state
    from promptcache import PromptCache
    from tiny import make_model, make_tokenizer
    from trip import PROMPTS, SCHEMA, serve_together

    calls = {"kernel_for": [], "gather_kernel_for": [], "gather_runs_kernel_for": [], "prefill_runs_kernel_for": []}

    def counted(name):
        real = getattr(cpu_attention, name)

        def wrapper(*args):
            kernel = real(*args)
            calls[name].append(kernel is not None)
            return kernel
        return wrapper

    for name in calls:
        monkeypatch.setattr(cpu_attention, name, counted(name))
    pc = PromptCache(make_model("llama"), make_tokenizer())
    pc.add_schema(SCHEMA)
    reqs = serve_together(pc, PROMPTS)
    for name, used in calls.items():  # head dim 16: every CPU attention call went native
        assert all(used), name
    # prefill rows and decode rows read by slot: over the schema's modules (store tensors) in runs,
    # or their own keys
    assert calls["prefill_runs_kernel_for"] and calls["gather_kernel_for"] + calls["gather_runs_kernel_for"]
    schema = pc.schema("trip").layout
    for prompt, req in zip(PROMPTS, reqs):
        ref, _, _ = definition_state(pc.model, schema, pc.layout(prompt))
        assert torch.max(torch.abs(req.prefill.logits - ref)).item() <= 1e-4, prompt
        assert req.token_ids == definition_greedy(pc.model, schema, pc.layout(prompt), 6, eos=3), prompt
