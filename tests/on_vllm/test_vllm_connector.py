"""PML on vLLM, end to end: vLLM's CPU build serves SmolLM2 with promptcache's connector loaded,
and the official ``openai`` client sends PML prompts made by ``to_vllm_request``.

For prefix subsets, gapped imports, union members, late modules alone and RAG documents in new
orders (a ``DocumentStore`` with ``attach_separator``), from compiled and document folders and
by key from an engine's Redis (a real redis-server): vLLM's greedy text equals promptcache's
own engine at recompute=0 (documents: the independent mode), the first token's logprob is within 1e-3 of the
engine's (float32, different kernels), and vLLM's ``cached_tokens`` counts exactly the supplied
tokens. A request whose states cannot be supplied (here: a forged salt) is computed in full:
its text is a plain prefill's of the same tokens and nothing counts as cached.

vLLM is installed in its own venv (``eval/vllm_connector.py``: ``$PROMPTCACHE_VLLM_VENV`` or one
made once) and started once for this module (minutes on 2 cores); requests are few.
"""

from __future__ import annotations

import math
import types

import pytest
import torch

from eval.peer_servers import MODEL_NAME, Running
from eval.vllm_connector import server, vllm_venv
from promptcache import EngineConfig, PromptCache, RecomputeConfig
from promptcache.store import StoreConfig
from redis_server import RedisServer
from promptcache.integrations.vllm import kv_transfer_config, plan_request
from promptcache.models.smollm2 import ensure_smollm2
from promptcache.rag import DocumentStore

openai = pytest.importorskip("openai")

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

SCHEMA = """<schema name="facts">Answer the question from the notes.
<module name="paris"> Note: the museum in Paris opens at nine in the morning and closes at six.</module>
<module name="tokyo"> Note: the train from Tokyo to Kyoto leaves every twenty minutes from platform four.</module>
<module name="rome"> Note: the bakery in Rome sells bread with olives and closes at noon on Sundays.</module>
<union scaffold="cheap">
  <module name="cheap"> Note: the budget for the trip is two hundred euros.</module>
  <module name="rich"> Note: the budget for the trip is five thousand euros and a private guide.</module>
</union>
<module name="oslo"> Note: the ferry from Oslo to Kiel departs at two in the afternoon every day.</module>
</schema>"""

PROMPTS = {
    "prefix subset": '<prompt schema="facts"><paris/><tokyo/> Question: when does the museum open? Answer:</prompt>',
    "gapped imports": '<prompt schema="facts"><paris/><rome/> Question: what does the bakery sell? Answer:</prompt>',
    "union member": '<prompt schema="facts"><tokyo/><rich/> Question: what is the budget? Answer:</prompt>',
    "late modules": '<prompt schema="facts"><rome/><oslo/> Question: when does the ferry depart? Answer:</prompt>',
}
DOCS = {
    "museum": "The city museum opens at nine in the morning and closes at six in the evening.",
    "train": "The train to the coast leaves every twenty minutes from platform four.",
    "bakery": "The bakery on the square sells bread with olives and closes at noon on Sundays.",
}
DOC_QUESTIONS = {  # documents in orders no earlier request used
    "three documents": ("When does the museum close?", ["train", "bakery", "museum"]),
    "a new order": ("Where does the train leave from?", ["museum", "train", "bakery"]),
    "two of three": ("What does the bakery sell?", ["bakery", "museum"]),
}
SYSTEM = "Answer from the notes."
TOKENS = 8


@pytest.fixture(scope="module")
def pc():
    return PromptCache.from_pretrained(ensure_smollm2(), config=EngineConfig(recompute=RecomputeConfig(fraction=0)))


@pytest.fixture(scope="module")
def store(pc, tmp_path_factory):
    s = DocumentStore(pc, tmp_path_factory.mktemp("vllm-docs") / "docs", independent=True, attach_separator=True)
    for k, v in DOCS.items():
        s.add(k, v)
    return s


@pytest.fixture(scope="module")
def redis_url():
    server = RedisServer().start()
    yield server.url
    server.stop()


@pytest.fixture(scope="module")
def shared(redis_url):
    """An engine that publishes its states to Redis (no compile step), and a document store on it."""
    config = EngineConfig(recompute=RecomputeConfig(fraction=0), store=StoreConfig(remote=redis_url))
    pc = PromptCache.from_pretrained(ensure_smollm2(), config=config)
    pc.add_schema(SCHEMA)
    s = DocumentStore(pc, independent=True, attach_separator=True)
    for k, v in DOCS.items():
        s.add(k, v)
    return pc, s


@pytest.fixture(scope="module")
def client(pc, store, redis_url, tmp_path_factory):
    folder = pc.compile(SCHEMA, tmp_path_factory.mktemp("vllm") / "facts")
    venv = vllm_venv()
    args = types.SimpleNamespace(threads=2, model_dir=str(ensure_smollm2()))
    log = tmp_path_factory.mktemp("vllm-log") / "vllm.log"
    with Running(server(kv_transfer_config([folder], [store.path], remote=redis_url), venv), args, log) as running:
        yield openai.OpenAI(base_url=running.url, api_key="none", max_retries=0, timeout=600), log
        running.stop()


def ask(client, request: dict):
    r = client.completions.create(model=MODEL_NAME, max_tokens=TOKENS, temperature=0, logprobs=1, **request)
    choice = r.choices[0]
    return choice.text, choice.logprobs.token_logprobs[0], r.usage.prompt_tokens_details.cached_tokens


@pytest.mark.parametrize("name", list(PROMPTS))
def test_vllm_with_the_connector_answers_as_the_engine(pc, client, name):
    client, log = client
    request = plan_request(pc, PROMPTS[name])
    assert request.supply is not None, request.reason
    text, logprob, cached = ask(client, request.kwargs)
    want = pc.generate(PROMPTS[name], max_new_tokens=TOKENS, recompute=0)
    first = torch.log_softmax(pc.prefill(PROMPTS[name], recompute=0).logits.float(), -1)[want.token_ids[0]].item()
    assert text == want.text, f"{name}: vLLM {text!r}, promptcache {want.text!r} (log: {log})"
    assert math.isclose(logprob, first, abs_tol=1e-3), f"{name}: first-token logprob {logprob} vs {first}"
    assert cached == request.supply.tokens


@pytest.mark.parametrize("name", list(DOC_QUESTIONS))
def test_documents_in_new_orders_answer_as_the_engine(store, client, name):
    client, log = client
    question, order = DOC_QUESTIONS[name]
    request = plan_request(store, (question, order), system=SYSTEM)
    assert request.supply is not None, request.reason
    text, logprob, cached = ask(client, request.kwargs)
    want = store.generate(question, order, SYSTEM, max_new_tokens=TOKENS, recompute=0)
    logits = store.prefill(question, order, SYSTEM, recompute=0).logits.float()
    first = torch.log_softmax(logits, -1)[want.token_ids[0]].item()
    assert text == want.text, f"{name}: vLLM {text!r}, promptcache {want.text!r} (log: {log})"
    assert math.isclose(logprob, first, abs_tol=1e-3), f"{name}: first-token logprob {logprob} vs {first}"
    assert cached == request.supply.tokens


def test_states_by_key_from_the_engines_redis(shared, client):
    pc, store = shared
    client, log = client
    question, order = DOC_QUESTIONS["a new order"]
    cases = [(plan_request(pc, PROMPTS["gapped imports"], by_key=True),
              lambda: pc.generate(PROMPTS["gapped imports"], max_new_tokens=TOKENS, recompute=0),
              lambda: pc.prefill(PROMPTS["gapped imports"], recompute=0).logits),
             (plan_request(store, (question, order), system=SYSTEM, by_key=True),
              lambda: store.generate(question, order, SYSTEM, max_new_tokens=TOKENS, recompute=0),
              lambda: store.prefill(question, order, SYSTEM, recompute=0).logits)]
    for request, generate, logits in cases:
        assert request.supply is not None and "states" in request.supply.params, request.reason
        text, logprob, cached = ask(client, request.kwargs)
        want = generate()
        first = torch.log_softmax(logits().float(), -1)[want.token_ids[0]].item()
        assert text == want.text, f"vLLM {text!r}, promptcache {want.text!r} (log: {log})"
        assert math.isclose(logprob, first, abs_tol=1e-3), f"first-token logprob {logprob} vs {first}"
        assert cached == request.supply.tokens


def test_a_request_the_connector_refuses_is_computed_in_full(pc, client):
    client, log = client
    request = plan_request(pc, PROMPTS["gapped imports"])
    kwargs = request.kwargs
    kwargs["extra_body"]["cache_salt"] = "promptcache-forged-for-this-test"
    text, logprob, cached = ask(client, kwargs)
    plain = pc.generate(list(request.token_ids), max_new_tokens=TOKENS)  # a plain prefill of the same tokens
    assert cached == 0
    assert text == plain.text
    assert "computed in full by vLLM" in log.read_text()


def test_a_salt_refused_once_stays_refused(pc, client):
    """A request refused under another request's salt leaves plain blocks under that salt in vLLM's
    prefix cache: the good request that follows must not be read as rotated (computed in full too)."""
    client, log = client
    text = '<prompt schema="facts"><tokyo/><oslo/> Question: where does the train leave from? Answer:</prompt>'
    good = plan_request(pc, text).kwargs
    bad = {"prompt": good["prompt"], "extra_body": {**good["extra_body"], "kv_transfer_params": {
        "promptcache": {**good["extra_body"]["kv_transfer_params"]["promptcache"], "start": 10_000}}}}
    plain = pc.generate(list(good["prompt"]), max_new_tokens=TOKENS)
    assert ask(client, bad)[0] == plain.text
    assert ask(client, good)[0] == plain.text
    assert "an earlier request with this cache_salt was computed in full" in log.read_text()
