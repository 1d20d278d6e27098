"""Build the embedded tokenizer shipped in promptcache/assets/embedded/tokenizer.json.

A byte-level BPE (4,096 tokens) trained on the project's own text (README, schemas, this
repository's Python sources), so it needs no download. Run from the repository root:

    python scripts/build_embedded_tokenizer.py
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

SPECIALS = ["<unk>", "<pad>", "<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]


def corpus(root: Path):
    for pattern in ("README.md", "schemas/**/*", "examples/**/*", "promptcache/**/*.py", "docs/*.md"):
        for p in sorted(root.glob(pattern)):
            if p.is_file() and p.suffix in (".md", ".xml", ".py", ".txt"):
                yield p.read_text(encoding="utf-8", errors="ignore")


def main() -> None:
    root = Path(__file__).resolve().parent.parent
    tk = Tokenizer(models.BPE(unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=4096, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tk.train_from_iterator(list(corpus(root)), trainer)
    tk.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", tk.token_to_id("<s>"))])
    out = root / "promptcache/assets/embedded/tokenizer.json"
    tk.save(str(out))
    print(f"wrote {out} ({tk.get_vocab_size()} tokens, {out.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
