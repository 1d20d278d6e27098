"""Tiny random-weight models of every supported family, and a tokenizer built offline.

Nothing is downloaded: configs come from ``transformers`` classes, the tokenizer is a byte-level
BPE trained here on a few sentences.
"""

from __future__ import annotations

import functools
import os

import torch

# The device tiny models are built on. ``PROMPTCACHE_TEST_DEVICE=cuda`` runs the same tests on a GPU
# (eval/results/cuda.md); CI has none and leaves it at the CPU.
DEVICE = os.environ.get("PROMPTCACHE_TEST_DEVICE", "cpu")
ON_CPU = torch.device(DEVICE).type == "cpu"
# The tier an engine on DEVICE keeps states in first (store/tiered.py, build_store): device memory,
# which on the CPU is host memory.
FIRST_TIER = "host" if ON_CPU else "device"


def packed_refused():
    """Off the CPU, the refusal ``@pytest.mark.cpu_only`` tests of packed linears check instead:
    an engine asked for them refuses a model on DEVICE with a ConfigError naming the option and why."""
    import pytest

    from promptcache import EngineConfig, PromptCache, RunnerConfig
    from promptcache.errors import ConfigError

    with pytest.raises(ConfigError, match=rf"packed_linear.*model is on {torch.device(DEVICE).type}; "
                                          "packed linears are a CPU path"):
        PromptCache(fresh_model("llama"), make_tokenizer(), EngineConfig(runner=RunnerConfig(packed_linear=True)))


def native_kernels_stand_aside():
    """Off the CPU, the check ``@pytest.mark.cpu_only`` tests of the native CPU kernels inside a
    model or an engine run instead: no kernel is offered for tensors on DEVICE and no layer of a model
    there is swapped, so the model's own (torch) forward runs."""
    from promptcache.kernels import attention, fuse_mlps_and_rotary, fuse_rms_norms, ordered_attention

    q = torch.zeros(2, 3, 1, 16, device=DEVICE)
    assert attention.kernel_for(q[0]) is None and attention.limits_kernel_for(q[0], q[0]) is None
    assert attention.gather_kernel_for(q, torch.zeros(1, device=DEVICE)) is None
    assert not ordered_attention.covers(q.device)
    model = fresh_model("llama")
    assert fuse_mlps_and_rotary(model) == 0 and fuse_rms_norms(model) == 0

CORPUS = [
    "You are a travel planner. Plan a trip of three days to Paris, Tokyo or Rome.",
    "Paris is the capital of France, famous for museums, cafes and the Eiffel Tower.",
    "Tokyo is a huge city in Japan with temples, food markets and fast trains.",
    "Keep it cheap. Highlight the food. Answer in one short paragraph.",
    "def add(a, b):\n    return a + b\n\nclass Greeter:\n    pass\n",
    "The quick brown fox jumps over the lazy dog 0 1 2 3 4 5 6 7 8 9.",
]

CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


@functools.lru_cache(maxsize=None)
def make_tokenizer(chat: bool = True, bos: bool = True):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<unk>", "<pad>", "<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
    tk = Tokenizer(models.BPE(unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tk.train_from_iterator(CORPUS * 4, trainer)
    if bos:
        from tokenizers import processors

        tk.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", tk.token_to_id("<s>"))])
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="<unk>", pad_token="<pad>", bos_token="<s>",
                                  eos_token="</s>")
    if chat:
        tok.chat_template = CHAT_TEMPLATE
    return tok


VOCAB = 400


def _configs():
    from transformers import (BloomConfig, FalconConfig, GPT2Config, GPTNeoXConfig, LlamaConfig, MistralConfig,
                              MptConfig, OPTConfig, Phi3Config, Qwen2Config, Qwen3Config)

    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, max_position_embeddings=1024)
    return {
        "llama": lambda: LlamaConfig(**common, num_key_value_heads=2),
        "mistral": lambda: MistralConfig(**common, num_key_value_heads=2, sliding_window=None),
        "qwen2": lambda: Qwen2Config(**common, num_key_value_heads=2, use_sliding_window=False),
        "qwen3": lambda: Qwen3Config(**common, num_key_value_heads=2, head_dim=16, use_sliding_window=False),
        "phi3": lambda: Phi3Config(**common, num_key_value_heads=2, pad_token_id=1),
        # a local layer (window, rope base 10K) and a global one (base 1M); the window past every
        # prompt of the family-wide tests (their oracle is the stock forward, windowed by cache
        # index): windows shorter than prompts are tested against a by-position oracle
        # (tests/engine/test_gemma3.py, ``gemma3_config``)
        "gemma3_text": lambda: gemma3_config(1024),
        "gpt_neox": lambda: GPTNeoXConfig(**common, rotary_pct=0.25),
        "falcon_rotary": lambda: FalconConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2,
                                              num_attention_heads=4, alibi=False, new_decoder_architecture=True,
                                              num_kv_heads=2, max_position_embeddings=1024),
        "falcon_alibi": lambda: FalconConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2,
                                             num_attention_heads=4, alibi=True, multi_query=False,
                                             new_decoder_architecture=False, parallel_attn=False, bias=True),
        "bloom": lambda: BloomConfig(vocab_size=VOCAB, hidden_size=64, n_layer=2, n_head=4),
        "mpt": lambda: MptConfig(vocab_size=VOCAB, d_model=64, n_heads=4, n_layers=2, max_seq_len=1024,
                                 expansion_ratio=2),
        "gpt2": lambda: GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=1024),
        "opt": lambda: OPTConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                 ffn_dim=128, max_position_embeddings=1024, word_embed_proj_dim=64),
    }


def gemma3_config(window: int, layer_types=("sliding_attention", "full_attention")):
    """A tiny Gemma 3 (text) config: sliding layers with ``window`` positions, RMS-normed queries
    and keys, the query scaled by ``query_pre_attn_scalar`` (not head_dim)."""
    from transformers import Gemma3TextConfig

    return Gemma3TextConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=len(layer_types),
                            num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=1024,
                            sliding_window=window, layer_types=list(layer_types), query_pre_attn_scalar=24)


def gemma3_model(window: int, layer_types=("sliding_attention", "full_attention", "sliding_attention"), seed: int = 0):
    """A tiny float32 Gemma 3 with ``window``-position sliding layers (weights widened as ``fresh_model``)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    config = gemma3_config(window, layer_types)
    config.bos_token_id, config.eos_token_id, config.pad_token_id = 2, 3, 1
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.2)
    return model.to(DEVICE).eval()


FAMILIES = sorted(_configs())


@functools.lru_cache(maxsize=None)
def make_model(family: str, seed: int = 0, attn: str | None = None):
    """A tiny float32 model; ``attn`` picks the attention implementation ("eager", "sdpa"; None:
    transformers' default for the family). Cached: callers must not modify it (``fresh_model``)."""
    return fresh_model(family, seed, attn)


def fresh_model(family: str, seed: int = 0, attn: str | None = None):
    """Like ``make_model`` but a new instance on every call (for tests that modify the model)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    config = _configs()[family]()
    config.bos_token_id, config.eos_token_id, config.pad_token_id = 2, 3, 1
    extra = {"attn_implementation": attn} if attn else {}
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, **extra)
    with torch.no_grad():  # random init is tiny; widen it so logits differ visibly between tokens
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.2)
    return model.to(DEVICE).eval()
