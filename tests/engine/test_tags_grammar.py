"""``engine.decoding.constrained.tags_processor``: tagged JSON (tool calls) as a logits processor, driven
token by token on the embedded tokenizer (no model): what it lets through and what it masks."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("xgrammar")

from promptcache.engine.decoding.constrained import Tag, tags_processor  # noqa: E402
from promptcache.models.embedded import embedded_tokenizer  # noqa: E402

VOCAB = 4096
DAYS = {"type": "object", "properties": {"days": {"enum": [1, 2]}}, "required": ["days"], "additionalProperties": False}
TAGS = [Tag('<tool_call>\n{"name": "plan", "arguments": ', DAYS, "}\n</tool_call>"),
        Tag('<tool_call>\n{"name": "stop", "arguments": ', {"type": "object"}, "}\n</tool_call>")]
CALL = '<tool_call>\n{"name": "plan", "arguments": {"days": 2}}\n</tool_call>'


def allowed(tok, text: str, **kw) -> list[bool]:
    """For each token of ``text``: whether the processor left it possible (fed as if sampled)."""
    proc = tags_processor(tok, VOCAB, TAGS, separator="\n", trigger="<tool_call>", **kw)
    ids, out = [tok.bos_token_id], []
    for t in tok(text, add_special_tokens=False).input_ids + [tok.eos_token_id]:
        scores = proc(torch.tensor([ids]), torch.zeros(1, VOCAB))
        out.append(bool(scores[0, t] > float("-inf")))
        if not out[-1]:
            return out
        ids.append(t)
    return out


@pytest.fixture(scope="module")
def tok():
    return embedded_tokenizer()


def test_auto_lets_text_and_a_valid_call_through(tok):
    assert all(allowed(tok, "Sure, let me plan. " + CALL, required=False, single=False))
    assert all(allowed(tok, "Just text, no call.", required=False, single=False))


def test_auto_masks_a_call_that_breaks_its_schema_or_names_no_tool(tok):
    assert not allowed(tok, CALL.replace('"days": 2', '"days": 7'), required=False, single=False)[-1]
    assert not allowed(tok, CALL.replace('"plan"', '"plot"'), required=False, single=False)[-1]


def test_required_allows_calls_only_and_single_ends_after_one(tok):
    assert not allowed(tok, "Sure. " + CALL, required=True, single=False)[-1]  # no text before
    assert all(allowed(tok, CALL + "\n" + CALL, required=True, single=False))
    assert not allowed(tok, CALL + "\n" + CALL, required=True, single=True)[-1]  # one call, then only EOS
    assert not allowed(tok, "", required=True, single=True)[-1]  # EOS before any call
