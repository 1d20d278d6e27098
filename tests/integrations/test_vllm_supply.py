"""PML on vLLM without vLLM: the supply rule, the rotation against our own engine, the salt, the
connector's checks of a request and of compiled folders, and ``promptcache vllm-config``.

The rotation test plays vLLM's part with the stock model: the supplied states, rotated by the
one offset, sit at positions 0..T-1 and the new tokens run at T..; the next-token logits must be
the engine's at recompute=0 (DESIGN.md §4: 1e-4 at float32).
"""

from __future__ import annotations

import json
import logging

import pytest
import torch
from click.testing import CliRunner
from transformers import DynamicCache

from promptcache import EngineConfig, PromptCache, RecomputeConfig
from promptcache.cli import main
from promptcache.integrations.vllm import (CONNECTOR_MODULE, SupplyError, cache_salt, plan_request, supply,
                                           to_vllm_request)
from promptcache.integrations.vllm.rope import rope_inv_freq
from promptcache.integrations.vllm.states import CompiledStates, rotated
from promptcache.integrations.vllm.supply import PARAMS_KEY, check
from promptcache.keys import model_digest
from tiny import make_model, make_tokenizer

SCHEMA = """<schema name="trip">You are a travel planner.
  <module name="paris">Paris is the capital of France, famous for museums.</module>
  <module name="tokyo">Tokyo is a huge city in Japan with temples.</module>
  <module name="food">Highlight the food. Keep it cheap.</module>
  <union scaffold="short">
    <module name="short">Answer in one short paragraph.</module>
    <module name="long">Answer in three long paragraphs with a plan.</module>
  </union>
  <module name="plan">Plan a trip of <parameter name="days" length="3"/> days.</module>
</schema>"""


def prompt(*imports: str, question: str = " Plan the trip.") -> str:
    return f'<prompt schema="trip">{"".join(f"<{m}/>" for m in imports)}{question}</prompt>'


SUPPLIED = {  # name -> (prompt, offset is zero)
    "prefix": (prompt("paris", "tokyo"), True),
    "gapped": (prompt("paris", "food"), False),
    "union member": (prompt("tokyo", "long"), False),
    "late modules": (prompt("food", "short"), False),
}


@pytest.fixture(scope="module")
def pc():
    engine = PromptCache(make_model("llama"), make_tokenizer(), EngineConfig(recompute=RecomputeConfig(fraction=0)))
    engine.add_schema(SCHEMA)
    return engine


@pytest.fixture(scope="module")
def compiled(pc, tmp_path_factory):
    return pc.compile(SCHEMA, tmp_path_factory.mktemp("vllm") / "trip")


@pytest.fixture(scope="module")
def states(compiled):
    return CompiledStates([compiled])


def vllm_logits(model, states, request, token_ids):
    """Next-token logits as vLLM computes them: rotated supplied states at 0..T-1, new tokens at T.."""
    params = request.supply.params
    kv = states.kv(params["schema"], params["digest"], params["spans"])  # [L, 2, H, T, D]
    kv = rotated(kv, rope_inv_freq(model.config), request.supply.offset)
    cache = DynamicCache()
    for layer in range(kv.shape[0]):
        cache.update(kv[layer, 0][None], kv[layer, 1][None], layer)
    t = request.supply.tokens
    new = torch.tensor([token_ids[t:]])
    with torch.no_grad():
        out = model(input_ids=new, position_ids=torch.arange(t, len(token_ids))[None], past_key_values=cache)
    return out.logits[0, -1]


@pytest.mark.parametrize("name", list(SUPPLIED))
def test_rotated_states_give_the_engines_logits(pc, states, name):
    text, unrotated = SUPPLIED[name]
    request = plan_request(pc, text)
    assert request.supply is not None, request.reason
    assert (request.supply.offset == 0) == unrotated
    want = pc.prefill(text, recompute=0).logits
    got = vllm_logits(pc.model, states, request, request.token_ids)
    assert (got - want).abs().max().item() <= 1e-4


def test_an_unrotated_gapped_prompt_differs(pc, states):
    """The rotation is what makes it exact: without it the gapped prompt's logits move."""
    text, _ = SUPPLIED["gapped"]
    request = plan_request(pc, text)
    params = request.supply.params
    kv = states.kv(params["schema"], params["digest"], params["spans"])
    cache = DynamicCache()
    for layer in range(kv.shape[0]):
        cache.update(kv[layer, 0][None], kv[layer, 1][None], layer)
    t = request.supply.tokens
    with torch.no_grad():
        out = pc.model(input_ids=torch.tensor([request.token_ids[t:]]),
                       position_ids=torch.arange(t, len(request.token_ids))[None], past_key_values=cache)
    assert (out.logits[0, -1] - pc.prefill(text, recompute=0).logits).abs().max().item() > 1e-2


def test_request_carries_tokens_params_and_salt(pc):
    request = to_vllm_request(pc, prompt("paris", "food"))
    layout = pc.layout(prompt("paris", "food"))
    assert request["prompt"] == layout.token_ids
    params = request["extra_body"]["kv_transfer_params"][PARAMS_KEY]
    assert params["schema"] == "trip" and params["model"] == model_digest(pc.model_key)
    assert request["extra_body"]["cache_salt"] == cache_salt(params)
    n = sum(len(s) for s in layout.cached)
    assert params["start"] == layout.new[0].position_ids[0] and params["start"] > n  # a gap: rotated


def test_salt_separates_imports_and_offsets(pc):
    salts = {to_vllm_request(pc, p)["extra_body"]["cache_salt"] for p, _ in SUPPLIED.values()}
    assert len(salts) == len(SUPPLIED)
    again = to_vllm_request(pc, prompt("paris", "food", question=" Another question."))
    assert again["extra_body"]["cache_salt"] == to_vllm_request(pc, prompt("paris", "food"))["extra_body"]["cache_salt"]


@pytest.mark.parametrize("text, why", [
    (prompt("paris", question=" Then:") .replace("<paris/>", "Before. <paris/>"), "follows new text"),
    ('<prompt schema="trip"><paris/> and <food/> now.</prompt>', "follows new text"),
    ('<prompt schema="trip"><paris/><plan days="4"/> Go.</prompt>', "follows new text"),
    (prompt("paris", "tokyo", question=""), "ends in a cached span"),
])
def test_layouts_one_offset_cannot_place_are_computed_in_full(pc, caplog, text, why):
    with caplog.at_level(logging.WARNING, logger="promptcache.integrations.vllm.request"):
        request = to_vllm_request(pc, text)
    assert request == {"prompt": pc.layout(text).token_ids, "extra_body": {}}
    assert why in caplog.text and "computes this prompt in full" in caplog.text
    with pytest.raises(SupplyError, match=why):
        supply(pc.layout(text), model_digest(pc.model_key))


def test_a_plain_prompt_is_not_supplied(pc):
    with pytest.raises(SupplyError, match="plain prompt"):
        supply(pc.layout("just text"), model_digest(pc.model_key))


# -- the connector's checks (scheduler side) -------------------------------------------------------------
def checked_request(pc, text=None):
    request = plan_request(pc, text or prompt("paris", "food"))
    return request, dict(request.supply.params), request.supply.salt


def test_check_accepts_what_to_vllm_request_sends(pc, states):
    request, params, salt = checked_request(pc)
    ok = check(params, states.schema(params["schema"], params["digest"]), request.token_ids, salt)
    assert ok.tokens == request.supply.tokens and ok.offset == request.supply.offset < 0
    assert list(ok.spans) == params["spans"]


@pytest.mark.parametrize("change, message", [
    (lambda p, ids, salt: ({**p, "model": "0" * 64}, ids, cache_salt({**p, "model": "0" * 64})), "laid out for model"),
    (lambda p, ids, salt: (p, [ids[0] + 1] + ids[1:], salt), "prompt token 0 is"),
    (lambda p, ids, salt: (p, ids, "promptcache-forged"), "cache_salt"),
    (lambda p, ids, salt: (p, ids[: sum(1 for _ in ids) // 4], salt), "must extend"),
    (lambda p, ids, salt: ({**p, "spans": [999]}, ids, salt), "no stored span 999"),
    (lambda p, ids, salt: ({**p, "spans": p["spans"][::-1]}, ids, salt), "increasing"),
    (lambda p, ids, salt: ({**p, "start": 3}, ids, salt), "not past the last supplied position"),
    (lambda p, ids, salt: ({**p, "v": 99}, ids, salt), "version-1"),
    (lambda p, ids, salt: ({**p, "spans": "1"}, ids, salt), "non-empty list"),
])
def test_check_refuses_what_is_not_the_schemas(pc, states, change, message):
    request, params, salt = checked_request(pc)
    p, ids, s = change(params, list(request.token_ids), salt)
    with pytest.raises(SupplyError, match=message):
        check(p, states.schema(params["schema"], params["digest"]), ids, s)


def test_union_members_overlapping_are_refused(pc, states):
    layout = pc.schema("trip").layout
    members = [s.index for s in layout.spans if s.module in (("short",), ("long",)) and s.stored]
    request, params, _ = checked_request(pc)
    bad = {**params, "spans": members, "start": 10_000}
    ids = [t for i in members for t in layout.spans[i].token_ids] + [5]
    with pytest.raises(SupplyError, match="overlap"):
        check(bad, states.schema(params["schema"], params["digest"]), ids, cache_salt(bad))


def test_unknown_schema_names_the_known_ones(states):
    with pytest.raises(SupplyError, match=r"schema 'nope' .* not among the compiled folders .*known: trip"):
        states.schema("nope", "x" * 64)


def test_damaged_or_foreign_folders_are_left_out(compiled, tmp_path, caplog):
    import shutil

    edited = tmp_path / "edited"
    shutil.copytree(compiled, edited)
    manifest = json.loads((edited / "manifest.json").read_text())
    manifest["layout"]["spans"][1]["token_ids"][0] += 1  # another token claimed for a stored state
    (edited / "manifest.json").write_text(json.dumps(manifest))
    with caplog.at_level(logging.ERROR, logger="promptcache.integrations.vllm.states"):
        assert CompiledStates([edited]).schemas == {}
        assert "manifest_sha256" in caplog.text
        assert CompiledStates([compiled], {"model_type": "llama", "layers": 30, "kv_heads": 3,
                                           "head_dim": 64}).schemas == {}
        assert "vLLM's model has" in caplog.text
        spec = json.loads((compiled / "manifest.json").read_text())["kv_spec"]
        same = {k: spec[k] for k in ("layers", "kv_heads", "head_dim")}
        assert CompiledStates([compiled], {"model_type": "llama", **same}).schemas != {}
        assert CompiledStates([compiled], {"model_type": "qwen2", **same}).schemas == {}


def test_a_corrupted_state_is_refused_at_check(pc, compiled, tmp_path):
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(compiled, bad)
    states_file = next(bad.glob("modules-*.safetensors"))
    data = bytearray(states_file.read_bytes())
    data[-5] ^= 0xFF  # the last state's data
    states_file.write_bytes(bytes(data))
    states = CompiledStates([bad])
    request, params, _ = checked_request(pc)
    with pytest.raises(SupplyError, match="cannot be used"):
        states.verify(params["schema"], params["digest"], sorted(states.schema(params["schema"],
                                                                               params["digest"]).token_ids))


SCALED = {  # rope_parameters of the kinds vLLM and the connector share
    "linear": {"rope_type": "linear", "factor": 2.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256},
    "yarn mscale": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256, "mscale": 0.707,
                    "mscale_all_dim": 0.707, "beta_fast": 16, "beta_slow": 2},
    "yarn attention_factor": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256,
                              "attention_factor": 1.25, "truncate": False},
}


def scaled_config(rope: dict):
    from transformers import LlamaConfig

    return LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                       rope_parameters={"rope_theta": 10000.0, **rope})


@pytest.mark.parametrize("kind", list(SCALED))
def test_scaled_rope_frequencies_and_scaling_are_transformers(kind):
    """vLLM's formulas (rope.py) against transformers' for the same config: the engine stored its
    keys with transformers' frequencies and attention scaling, vLLM queries with its own."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from promptcache.integrations.vllm.rope import attention_scaling

    config = scaled_config(SCALED[kind])
    want, scaling = ROPE_INIT_FUNCTIONS[SCALED[kind]["rope_type"]](config, "cpu")
    assert torch.allclose(rope_inv_freq(config), want, rtol=1e-6, atol=0)
    assert attention_scaling(config) == pytest.approx(scaling, rel=1e-12)


@pytest.mark.parametrize("kind,match", [
    ({"rope_type": "dynamic", "factor": 2.0}, "'dynamic' .* NTK base"),
    ({"rope_type": "longrope", "short_factor": [1.0] * 8, "long_factor": [2.0] * 8,
      "original_max_position_embeddings": 256}, "'longrope' switches"),
])
def test_ropes_neither_side_reproduces_are_refused_by_name(kind, match):
    with pytest.raises(SupplyError, match=match):
        rope_inv_freq(scaled_config(kind))


def test_per_layer_type_ropes_are_refused_by_name():
    from transformers import Gemma3TextConfig

    config = Gemma3TextConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=1, head_dim=16,
                              num_hidden_layers=2, layer_types=["sliding_attention", "full_attention"])
    with pytest.raises(SupplyError, match="rope per layer type .*sliding_attention"):
        rope_inv_freq(config)


@pytest.mark.parametrize("kind", ["llama3", "yarn"])
def test_scaled_rope_rotated_states_give_the_engines_logits(kind, tmp_path):
    """The rotation with a scaled rope, played as vLLM plays it (as for the default rope above):
    every supplied layout's next-token logits equal the engine's at recompute=0 within 1e-4."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    config = scaled_config(SCALED[kind])
    config.vocab_size, config.intermediate_size, config.num_hidden_layers = 400, 128, 2
    config.bos_token_id, config.eos_token_id, config.pad_token_id = 2, 3, 1
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.2)
    engine = PromptCache(model, make_tokenizer(), EngineConfig(recompute=RecomputeConfig(fraction=0)))
    states = CompiledStates([engine.compile(SCHEMA, tmp_path / "trip")])
    for text, unrotated in SUPPLIED.values():
        request = plan_request(engine, text)
        assert request.supply is not None and (request.supply.offset == 0) == unrotated, request.reason
        got = vllm_logits(model, states, request, request.token_ids)
        assert (got - engine.prefill(text, recompute=0).logits).abs().max().item() <= 1e-4, text


def test_inv_freq_is_the_models(pc):
    want = pc.model.model.rotary_emb.inv_freq
    assert torch.equal(rope_inv_freq(pc.model.config), want)


# -- promptcache vllm-config ---------------------------------------------------------------------------------
def test_vllm_config_prints_the_kv_transfer_config_last(compiled):
    out = CliRunner().invoke(main, ["vllm-config", "--compiled", str(compiled)])
    assert out.exit_code == 0, out.output
    config = json.loads(out.output.strip().splitlines()[-1])
    assert config["kv_connector_module_path"] == CONNECTOR_MODULE and config["kv_role"] == "kv_consumer"
    assert config["kv_connector_extra_config"]["compiled"] == [str(compiled.resolve())]
    assert config["kv_load_failure_policy"] == "fail"


def test_vllm_config_load_failure_policy(compiled):
    out = CliRunner().invoke(main, ["vllm-config", "--compiled", str(compiled), "--load-failure-policy", "recompute"])
    assert out.exit_code == 0, out.output
    assert json.loads(out.output.strip().splitlines()[-1])["kv_load_failure_policy"] == "recompute"
    out = CliRunner().invoke(main, ["vllm-config", "--compiled", str(compiled), "--load-failure-policy", "retry"])
    assert out.exit_code != 0 and "retry" in out.output


def test_vllm_config_refuses_a_folder_that_is_no_artifact(tmp_path):
    out = CliRunner().invoke(main, ["vllm-config", "--compiled", str(tmp_path)])
    assert out.exit_code == 1 and "is not a compiled schema" in out.output
