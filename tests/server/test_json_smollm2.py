"""response_format json_schema on the real SmolLM2 through the server and the official client:
the answer parses and validates against the schema."""

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
from serverkit import running  # noqa: E402

pytestmark = pytest.mark.slow

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["city", "days", "sights"],
          "properties": {"city": {"type": "string", "maxLength": 24},
                         "days": {"type": "integer", "minimum": 1, "maximum": 14},
                         "sights": {"type": "array", "maxItems": 3, "items": {"type": "string", "maxLength": 32}}}}


def test_json_schema_answer_validates_on_smollm2():
    pc = PromptCache.from_pretrained(ensure_smollm2())
    with running(create_app(pc, model_name="smollm2")) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=300)
        r = client.chat.completions.create(
            model="smollm2", temperature=0, max_tokens=120,
            messages=[{"role": "user", "content": "Plan a short trip to Rome as JSON: city, days, sights."}],
            response_format={"type": "json_schema", "json_schema": {"name": "trip", "schema": SCHEMA}})
    answer = json.loads(r.choices[0].message.content)
    jsonschema.validate(answer, SCHEMA)
    assert r.choices[0].finish_reason == "stop"
