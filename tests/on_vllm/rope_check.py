"""Run by vLLM's Python (tests/on_vllm/test_vllm_scaled_ropes.py): for each rope of argv[1] (JSON
``{name: rope_parameters}``), the keys vLLM's own rotary embedding (``get_rope``, as vLLM's Llama
builds it) gives at positions p and p + d, and the connector's rotation (``rope.rope_inv_freq``,
``models.relocate.rotate_keys``) of the first by d. Prints one JSON line: per rope, the largest
difference of the rotation from vLLM's keys at p + d (and of a rotation at the default rope's
frequencies, the control), the largest relative difference of the
frequencies from vLLM's, vLLM's cos/sin scaling and ours."""

import json
import sys

import torch
from transformers import LlamaConfig
from vllm.config import VllmConfig, set_current_vllm_config
from vllm.model_executor.layers.rotary_embedding import get_rope

from promptcache.integrations.vllm.rope import attention_scaling, rope_inv_freq
from promptcache.models.relocate import rotate_keys

HEAD, HEADS, KV_HEADS, N, START, DELTA = 64, 4, 2, 48, 100, 777


def check(rope: dict) -> dict:
    params = {"rope_theta": 10000.0, **rope}
    config = LlamaConfig(hidden_size=HEAD * HEADS, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
                         head_dim=HEAD, max_position_embeddings=4096, rope_parameters=dict(params))
    theirs = get_rope(HEAD, 4096, True, dict(params), torch.float32)
    k = torch.randn(N, KV_HEADS * HEAD)

    def keys(positions):  # vLLM's keys [H, N, D] at positions
        _, out = theirs.forward_native(positions, torch.randn(N, HEADS * HEAD), k.clone())
        return out.view(N, KV_HEADS, HEAD).transpose(0, 1)

    p = torch.arange(START, START + N)
    at_p, at_pd = keys(p), keys(p + DELTA)
    moved = rotate_keys(torch.stack([at_p, at_p])[None], rope_inv_freq(config), DELTA)[0, 0]
    # vLLM's frequencies: its cos/sin cache at position 1 holds cos(f) * scale, sin(f) * scale
    cos, sin = theirs.cos_sin_cache[1].double().chunk(2)
    scale = float(getattr(theirs, "mscale", 1.0))
    freqs = torch.atan2(sin, cos)
    ours = rope_inv_freq(config).double()
    plain = 1.0 / (10000.0 ** (torch.arange(0, HEAD, 2, dtype=torch.float) / HEAD))  # the default rope's
    unscaled = rotate_keys(torch.stack([at_p, at_p])[None], plain, DELTA)[0, 0]
    return {"rotation": (moved - at_pd).abs().max().item(), "unscaled": (unscaled - at_pd).abs().max().item(),
            "frequencies": ((ours - freqs).abs() / freqs).max().item(),
            "vllm_scale": scale, "our_scale": attention_scaling(config), "key_max": at_pd.abs().max().item()}


if __name__ == "__main__":
    torch.manual_seed(0)
    with set_current_vllm_config(VllmConfig()):
        print(json.dumps({name: check(rope) for name, rope in json.loads(sys.argv[1]).items()}))
