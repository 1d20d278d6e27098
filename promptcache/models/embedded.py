"""Embedded models: random-weight Llama-shaped models built from shipped configs, no download.

They are for demos, tests and benchmarks: their output is noise, but their shapes and speed are
those of real models. Name them as ``embedded`` (= ``embedded:demo``), ``embedded:bench``,
``embedded:1b`` or ``embedded:8b`` (the shapes of Llama-3.2-1B and Llama-3.1-8B, for GPU
benchmarks) wherever a model id is taken.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

log = logging.getLogger(__name__)

ASSETS = Path(__file__).resolve().parent.parent / "assets" / "embedded"

CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

CONFIGS = {
    # small enough for a demo on two CPU cores
    "demo": dict(hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=8,
                 num_key_value_heads=4, vocab_size=4096),
    # the engine benchmark's model: realistic width (8 layers, hidden 1024, vocab 32000)
    "bench": dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=8, num_attention_heads=16,
                  num_key_value_heads=16, vocab_size=32000),
    # GPU benchmarks: the shape of Llama-3.2-1B (16 layers, hidden 2048, 32 query / 8 KV heads of 64),
    # with this tokenizer's vocabulary
    "1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
               num_key_value_heads=8, vocab_size=32000),
    # the shape of Llama-3.1-8B (32 layers, hidden 4096, 32 query / 8 KV heads): GPU only in practice
    "8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
               num_key_value_heads=8, vocab_size=32000),
}


def is_embedded(name) -> bool:
    return isinstance(name, str) and (name == "embedded" or name.startswith("embedded:"))


def embedded_tokenizer():
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(tokenizer_file=str(ASSETS / "tokenizer.json"), unk_token="<unk>",
                                  pad_token="<pad>", bos_token="<s>", eos_token="</s>")
    tok.chat_template = CHAT_TEMPLATE
    return tok


def embedded_config(name: str = "demo"):
    """The ``LlamaConfig`` of ``embedded[:demo|bench|1b|8b]`` (no weights)."""
    from transformers import LlamaConfig

    key = name.split(":", 1)[1] if ":" in name else "demo"
    if key not in CONFIGS:
        raise ValueError(f"unknown embedded model '{name}' (known: {', '.join('embedded:' + k for k in CONFIGS)})")
    config = LlamaConfig(**CONFIGS[key], max_position_embeddings=16384, bos_token_id=2, eos_token_id=3,
                         pad_token_id=1, tie_word_embeddings=False)
    config.name_or_path = "embedded" if key == "demo" else f"embedded:{key}"  # the --model artifacts record
    return config


def embedded_model(name: str = "demo", seed: int = 0, dtype: torch.dtype = torch.float32, device="cpu"):
    """(model, tokenizer) for ``embedded[:demo|bench|1b|8b]``, weights drawn from ``seed``."""
    from transformers import LlamaForCausalLM

    config = embedded_config(name)
    torch.manual_seed(seed)
    if torch.device(device).type == "cuda":  # built in place: an 8B model is not drawn on the CPU first
        old = torch.get_default_dtype()
        torch.set_default_dtype(dtype)
        try:
            with torch.device(device):
                model = LlamaForCausalLM(config).eval()
        finally:
            torch.set_default_dtype(old)
    else:
        model = LlamaForCausalLM(config).to(dtype=dtype, device=device).eval()
    log.info("built embedded model '%s' with RANDOM weights (seed %d): its text is noise", name, seed)
    return model, embedded_tokenizer()
