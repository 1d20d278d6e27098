"""An ALiBi model behind the server, on the KV pool like the rotary families: concurrent chats
behind one system prompt share its blocks (read in place, not copied per request), eagerly and
with compiled steps, and every answer equals the same prompt served alone."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from promptcache import EngineConfig, PromptCache, RunnerConfig
from promptcache.server import create_app
from serverkit import client, running
from tiny import make_model, make_tokenizer

SYSTEM = " ".join(f"Rule {i}: answer about bicycles only, briefly and politely." for i in range(12))
QUESTIONS = [f"Question {i}: which part of a bicycle is number {i}?" for i in range(16)]


def ask_all(url: str, model: str) -> list:
    oai = client(url)

    def ask(q):
        return oai.chat.completions.create(model=model, messages=[{"role": "system", "content": SYSTEM},
                                                                  {"role": "user", "content": q}],
                                           max_tokens=6, temperature=0)

    first = ask(QUESTIONS[0])  # the system prompt's blocks are computed once
    with ThreadPoolExecutor(16) as pool:
        return [first, *pool.map(ask, QUESTIONS[1:])]


@pytest.mark.parametrize("compile_steps", [False, True], ids=["eager", "compiled"])
def test_sixteen_concurrent_chats_share_an_alibi_models_blocks(compile_steps):
    pc = PromptCache(make_model("bloom"), make_tokenizer(), EngineConfig(runner=RunnerConfig(compile=compile_steps)))
    app = create_app(pc, model_name="bloom")
    with running(app) as url:
        answers = ask_all(url, "bloom")
        backend = app.state.backend
        assert backend.published_blocks > 0 and (backend.engine.compiled is not None) == compile_steps
    prompt = len(pc.chat_ids([{"role": "system", "content": SYSTEM}]))
    for r in answers[1:]:
        # the shared system prompt came from the pool: at least its full blocks, for every request
        assert r.usage.prompt_tokens_details.cached_tokens >= prompt // 16 * 16 - 16 > 0
    alone = PromptCache(make_model("bloom"), make_tokenizer())
    for q, r in zip(QUESTIONS[:4], answers[:4]):
        msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}]
        assert r.choices[0].message.content == alone.generate(msgs, max_new_tokens=6, temperature=0.0).text
