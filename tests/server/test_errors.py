"""OpenAI error objects with honest status codes; nothing is served after an error."""

from __future__ import annotations

import json

import openai
import pytest

from serverkit import MODEL, client, http, running

from promptcache.server import create_app

MSGS = [{"role": "user", "content": "hello"}]


def error_of(status_text):
    return json.loads(status_text)["error"]


def test_unknown_model_is_404(oai):
    with pytest.raises(openai.NotFoundError) as e:
        oai.chat.completions.create(model="gpt-9", messages=MSGS)
    assert e.value.body["code"] == "model_not_found" and "gpt-9" in e.value.body["message"]


def test_bad_field_is_400_naming_it(server):
    for body, field in [({"model": MODEL, "messages": MSGS, "temperature": 7}, "temperature"),
                        ({"model": MODEL, "messages": MSGS, "max_tokens": 0}, "max_tokens"),
                        ({"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]}, "messages.0.role"),
                        ({"model": MODEL, "messages": MSGS, "n": 2}, "n"),
                        ({"model": MODEL, "messages": []}, "messages"),
                        ({"messages": MSGS}, "model")]:
        status, _, text = http("POST", server[0] + "/v1/chat/completions", body)
        assert status == 400, body
        err = error_of(text)
        assert err["param"] == field and err["type"] == "invalid_request_error", err


def test_non_text_content_part_is_400(server):
    msgs = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]
    status, _, text = http("POST", server[0] + "/v1/chat/completions", {"model": MODEL, "messages": msgs})
    assert status == 400 and error_of(text)["param"] == "messages[0].content[0]"


def test_prompt_past_the_context_is_400(oai, pc):
    context = pc.model.config.max_position_embeddings
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=context)
    assert e.value.body["code"] == "context_length_exceeded" and e.value.body["param"] == "max_tokens"
    with pytest.raises(openai.BadRequestError) as e:
        oai.completions.create(model=MODEL, prompt=[5] * context, max_tokens=1)
    assert e.value.body["param"] == "prompt" and str(context) in e.value.body["message"]


def test_unknown_schema_is_404_and_bad_pml_is_400(oai):
    with pytest.raises(openai.NotFoundError) as e:
        oai.chat.completions.create(model=MODEL, messages=[], extra_body={"pml": '<prompt schema="nope"/>'})
    assert e.value.body["param"] == "pml" and "nope" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model=MODEL, messages=[], extra_body={"pml": '<prompt schema="travel"><x/>'})
    assert e.value.body["param"] == "pml"
    with pytest.raises(openai.BadRequestError):
        oai.chat.completions.create(model=MODEL, messages=MSGS, extra_body={"pml": '<prompt schema="travel"/>'})


def test_documents_errors(oai):
    with pytest.raises(openai.NotFoundError) as e:
        oai.chat.completions.create(model=MODEL, messages=MSGS, extra_body={"documents": ["atlantis"]})
    assert "atlantis" in e.value.body["message"]
    two_turns = MSGS + [{"role": "assistant", "content": "hi"}, {"role": "user", "content": "and?"}]
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model=MODEL, messages=two_turns, extra_body={"documents": ["kyoto"]})
    assert e.value.body["param"] == "documents"


def test_recompute_is_validated_then_passed_to_the_engine(oai, pc, monkeypatch):
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model=MODEL, messages=MSGS, extra_body={"recompute": 1.5})
    assert e.value.body["param"] == "recompute"
    seen = []
    planner = pc.core.planner  # a served PML prompt is planned into the pool (recompute runs as rows of the step)
    real = planner.pml_plan

    def spy(*args, **kwargs):
        seen.append(kwargs.get("recompute"))
        return real(*args, **kwargs)

    monkeypatch.setattr(planner, "pml_plan", spy)
    pml = '<prompt schema="travel"><trip days="3" travelers="two"/><tokyo/><user>Food?</user></prompt>'
    ok = oai.chat.completions.create(model=MODEL, messages=[], max_tokens=2, extra_body={"pml": pml, "recompute": 0.3})
    assert ok.usage.completion_tokens == 2 and seen and set(seen) == {0.3}
    ok = oai.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=2, extra_body={"recompute": 0.0})
    assert ok.usage.completion_tokens == 2


def test_bad_key_is_401(pc):
    app = create_app(pc, api_keys={"k1": "ns1"}, model_name=MODEL)
    with running(app) as url:
        for key in ("wrong", None):
            status, _, text = http("POST", url + "/v1/chat/completions", {"model": MODEL, "messages": MSGS}, key)
            assert status == 401 and error_of(text)["code"] == "invalid_api_key"
        with pytest.raises(openai.AuthenticationError):
            client(url, "wrong").models.list()
        assert [m.id for m in client(url, "k1").models.list()] == [MODEL]


def test_full_queue_is_503(pc):
    app = create_app(pc, model_name=MODEL, max_queue=1)
    with running(app) as url:
        oai = client(url)
        stream = oai.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=200, temperature=0, stream=True)
        next(iter(stream))  # admitted: the one place in the queue is taken
        with pytest.raises(openai.InternalServerError) as e:
            oai.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=2)
        assert e.value.status_code == 503 and "busy" in e.value.body["message"]
        stream.close()
