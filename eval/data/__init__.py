"""Data for the studies: ``python -m eval.data.make_synthetic`` (the synthetic retrieval set),
``python -m eval.data.gguf_model`` (a GGUF converted to a transformers folder)."""
