"""Scaled ropes on vLLM: the connector's rotation against vLLM's own rotary embedding, and small
random Llamas with ``rope_type: llama3`` and ``yarn`` served by vLLM's CPU build (the llama3 one
also at tensor parallel size 2: two ranks, each writing its KV heads).

* ``rope_check.py`` (run by vLLM's Python): keys vLLM's ``get_rope`` computes at p + d equal the
  connector's rotation of vLLM's keys at p by d (YaRN's attention scaling kept, not applied twice),
  within vLLM's own float32 rounding of its angles; the default rope's frequencies do not.
* end to end: for gapped imports, late modules alone (rotated) and documents in a new order,
  vLLM's greedy tokens through the connector equal the engine's at ``recompute=0``, the first
  token's logprob within 1e-3, and ``cached_tokens`` counts the supplied tokens. TP=2 answering
  as the engine (and so as one rank) is the "more than one rank" check.

One vLLM server per model (minutes each on 2 cores): the fixture is module-scoped and
parametrized, so pytest starts them one after the other.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import types
from pathlib import Path

import pytest
import torch

from eval.peer_servers import MODEL_NAME, Running
from eval.vllm_connector import pythonpath, server, tiny_llama, vllm_venv
from promptcache import EngineConfig, PromptCache, RecomputeConfig
from promptcache.integrations.vllm import kv_transfer_config, plan_request
from promptcache.models.smollm2 import ensure_smollm2
from promptcache.rag import DocumentStore

openai = pytest.importorskip("openai")

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 2048}
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024}
ROPES = {"llama3": LLAMA3, "yarn": YARN, "linear": {"rope_type": "linear", "factor": 2.0},
         "yarn mscale": {**YARN, "mscale": 0.707, "mscale_all_dim": 1.0, "beta_fast": 16, "beta_slow": 2}}
SERVED = {"llama3": (LLAMA3, 1, "fail"), "yarn": (YARN, 1, "recompute"), "llama3 tp2": (LLAMA3, 2, "fail")}

SCHEMA = """<schema name="facts">Answer the question from the notes.
<module name="paris"> Note: the museum in Paris opens at nine in the morning and closes at six.</module>
<module name="tokyo"> Note: the train from Tokyo to Kyoto leaves every twenty minutes from platform four.</module>
<module name="rome"> Note: the bakery in Rome sells bread with olives and closes at noon on Sundays.</module>
<module name="oslo"> Note: the ferry from Oslo to Kiel departs at two in the afternoon every day.</module>
</schema>"""
PROMPTS = {
    "gapped imports": '<prompt schema="facts"><paris/><rome/> Question: what does the bakery sell? Answer:</prompt>',
    "late modules": '<prompt schema="facts"><rome/><oslo/> Question: when does the ferry depart? Answer:</prompt>',
}
DOCS = {
    "museum": "The city museum opens at nine in the morning and closes at six in the evening.",
    "train": "The train to the coast leaves every twenty minutes from platform four.",
    "bakery": "The bakery on the square sells bread with olives and closes at noon on Sundays.",
    "ferry": "The ferry to the island departs at two in the afternoon from the north pier.",  # damaged below
}
QUESTION = ("Where does the train leave from?", ["bakery", "train", "museum"])
SYSTEM = "Answer from the notes."
TOKENS = 8


def test_the_rotation_is_vllms_own_rope():
    venv = vllm_venv()
    env = {**os.environ, "PYTHONPATH": pythonpath(venv), "VLLM_TARGET_DEVICE": "cpu", "OMP_NUM_THREADS": "1"}
    script = Path(__file__).with_name("rope_check.py")
    done = subprocess.run([str(venv / "bin" / "python"), str(script), json.dumps(ROPES)], env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    for name, r in got.items():
        # vLLM keeps angles in a float32 cache: at position ~900 one ulp is 6e-5 rad (keys of size ~4)
        assert r["rotation"] <= 2e-4, (name, r)
        assert r["unscaled"] > 1e-2, (name, r)  # the control: another rope's frequencies are visibly wrong
        assert r["frequencies"] <= 1e-6, (name, r)
        assert r["our_scale"] == pytest.approx(r["vllm_scale"], rel=1e-12), (name, r)
    assert got["yarn"]["vllm_scale"] > 1.1  # YaRN does scale: what the rotation must not apply again


@pytest.fixture(scope="module", params=list(SERVED))
def served(request, tmp_path_factory):
    rope, tp, policy = SERVED[request.param]
    work = tmp_path_factory.mktemp(request.param.replace(" ", "-"))
    model = tiny_llama(work / "model", rope, ensure_smollm2())
    pc = PromptCache.from_pretrained(model, config=EngineConfig(recompute=RecomputeConfig(fraction=0)))
    compiled = pc.compile(SCHEMA, work / "facts")
    store = DocumentStore(pc, work / "docs", independent=True, attach_separator=True)
    for k, v in DOCS.items():
        store.add(k, v)
    args = types.SimpleNamespace(threads=2, model_dir=str(model))
    log = work / "vllm.log"
    config = kv_transfer_config([compiled], [store.path], failure_policy=policy)
    with Running(server(config, vllm_venv(), tp=tp), args, log) as running:
        client = openai.OpenAI(base_url=running.url, api_key="none", max_retries=0, timeout=600)
        yield types.SimpleNamespace(name=request.param, pc=pc, store=store, client=client, log=log, policy=policy)
        running.stop()


def ask(client, request: dict):
    """(token ids, first token's logprob, cached prompt tokens) of a greedy completion."""
    body = {**request["extra_body"], "return_token_ids": True}
    r = client.completions.create(model=MODEL_NAME, prompt=request["prompt"], max_tokens=TOKENS, temperature=0,
                                  logprobs=1, extra_body=body)
    choice = r.choices[0]
    ids = getattr(choice, "token_ids", None) or (choice.model_extra or {}).get("token_ids")
    return list(ids), choice.logprobs.token_logprobs[0], r.usage.prompt_tokens_details.cached_tokens


def expect(served, request, want, logits):
    ids, logprob, cached = ask(served.client, request.kwargs)
    first = torch.log_softmax(logits.float(), -1)[want.token_ids[0]].item()
    assert ids == list(want.token_ids), f"{served.name}: vLLM {ids}, promptcache {want.token_ids} (log {served.log})"
    assert math.isclose(logprob, first, abs_tol=1e-3), f"{served.name}: first-token logprob {logprob} vs {first}"
    assert cached == request.supply.tokens


@pytest.mark.parametrize("name", list(PROMPTS))
def test_scaled_rope_modules_answer_as_the_engine(served, name):
    pc, text = served.pc, PROMPTS[name]
    request = plan_request(pc, text)
    assert request.supply is not None and request.supply.offset != 0, request.reason
    expect(served, request, pc.generate(text, max_new_tokens=TOKENS, recompute=0), pc.prefill(text, recompute=0).logits)


def test_scaled_rope_documents_in_a_new_order_answer_as_the_engine(served):
    store, (question, order) = served.store, QUESTION
    request = plan_request(store, (question, order), system=SYSTEM)
    assert request.supply is not None, request.reason
    expect(served, request, store.generate(question, order, SYSTEM, max_new_tokens=TOKENS, recompute=0),
           store.prefill(question, order, SYSTEM, recompute=0).logits)


def test_a_load_that_fails_on_the_worker_follows_kv_load_failure_policy(served):
    """A state damaged after the scheduler checked it fails on the worker: the connector reports
    the request's blocks as a load failure. With "fail" vLLM fails the request; with "recompute"
    it computes the prompt as a plain prefill (equal to the engine's plain prefill of the same
    tokens), and the salt stays refused after.

    The scheduler reads a state once; to have it checked but not written, a request with the
    same salt but no states runs first (vLLM computes it in full and caches its blocks under that
    salt), so the connector's request finds every supplied token in vLLM's prefix cache and loads
    nothing (its question is longer than one of vLLM's 128-token CPU blocks)."""
    store, client = served.store, served.client
    long_question = " ".join(["Read every note with care before you answer the question that follows."] * 12)
    poison = plan_request(store, (long_question + " Which pier?", ["ferry", "museum"]), system=SYSTEM)
    assert poison.supply is not None and len(poison.token_ids) - poison.supply.tokens > 129, poison.reason
    plain_same_salt = {"prompt": poison.kwargs["prompt"], "extra_body": {"cache_salt": poison.supply.salt}}
    ask(client, plain_same_salt)
    ask(client, poison.kwargs)  # checked by the scheduler (ferry's state read), nothing to write
    index = json.loads((store.path / "index.json").read_text())
    unit = store.path / "docs" / next(d["file"] for d in index["documents"] if d["id"] == "ferry")
    data = bytearray(unit.read_bytes())
    data[-16:] = bytes(b ^ 0xFF for b in data[-16:])  # the last bytes of the state: its checksum fails
    unit.write_bytes(bytes(data))

    damaged = plan_request(store, ("Which pier does the ferry leave from?", ["museum", "ferry"]), system=SYSTEM)
    assert damaged.supply is not None, damaged.reason
    if served.policy == "fail":
        with pytest.raises(openai.APIError):
            ask(client, damaged.kwargs)
        assert "Failing 1 request(s) due to KV load failure" in served.log.read_text()
    else:
        plain = served.pc.generate(list(damaged.token_ids), max_new_tokens=TOKENS)  # a plain prefill
        ids, _, _ = ask(client, damaged.kwargs)
        assert ids == list(plain.token_ids)
        assert "Recovered from KV load failure" in served.log.read_text()
        ids, _, cached = ask(client, damaged.kwargs)  # the same salt again: refused, vLLM's own blocks
        assert ids == list(plain.token_ids)
        assert "an earlier request with this cache_salt was computed in full" in served.log.read_text()
    assert "reported to vLLM as a load failure" in served.log.read_text()
