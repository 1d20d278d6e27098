"""Tools on the real SmolLM2 given a Hermes-style template in its own ChatML roles (its shipped
template has no tools): a required call validates against the tool's schema, and the round trip
with the tool's answer ends in a text answer."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("fastapi", reason="the 'serve' extra is not installed")
pytest.importorskip("xgrammar", reason="the 'structured' extra is not installed")

import jsonschema  # noqa: E402
import openai  # noqa: E402

from promptcache import PromptCache  # noqa: E402
from promptcache.models.smollm2 import ensure_smollm2  # noqa: E402
from promptcache.server import create_app  # noqa: E402
from serverkit import HERMES_TEMPLATE, running  # noqa: E402

pytestmark = pytest.mark.slow

CHATML = {"{{ bos_token }}": "", "<|{{ m.role }}|>": "<|im_start|>{{ m.role }}", "<|end|>": "<|im_end|>",
          "<|system|>": "<|im_start|>system", "<|user|>": "<|im_start|>user", "<|assistant|>": "<|im_start|>assistant"}
WEATHER = {"type": "object", "additionalProperties": False, "required": ["city", "days"],
           "properties": {"city": {"type": "string", "maxLength": 24},
                          "days": {"type": "integer", "minimum": 1, "maximum": 14}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather forecast for a city.",
                                           "parameters": WEATHER}}]


def test_a_required_call_and_the_round_trip_on_smollm2():
    pc = PromptCache.from_pretrained(ensure_smollm2())
    template = HERMES_TEMPLATE
    for old, new in CHATML.items():
        template = template.replace(old, new)
    pc.tokenizer.chat_template = template
    msgs = [{"role": "user", "content": "What will the weather be in Paris for the next 3 days?"}]
    with running(create_app(pc, model_name="smollm2")) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=300)
        r = client.chat.completions.create(model="smollm2", temperature=0, max_tokens=60, messages=msgs, tools=TOOLS,
                                           tool_choice="required", parallel_tool_calls=False)
        [call] = r.choices[0].message.tool_calls
        jsonschema.validate(json.loads(call.function.arguments), WEATHER)
        assert call.function.name == "get_weather" and r.choices[0].finish_reason == "tool_calls"
        history = msgs + [r.choices[0].message.model_dump(exclude_none=True),
                          {"role": "tool", "tool_call_id": call.id, "content": '{"forecast": "sunny, 24 C"}'}]
        answer = client.chat.completions.create(model="smollm2", temperature=0, max_tokens=16, messages=history,
                                                tools=TOOLS, tool_choice="none")
    assert answer.choices[0].message.content and answer.choices[0].message.tool_calls is None
