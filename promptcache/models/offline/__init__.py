"""Real models from PyPI packages, converted once into a cache folder and loaded offline after:
``gemma3_270m`` (Gemma 3 270M, alias ``gemma3-270m``). SmolLM2 (``smollm2``) lives in
``models/smollm2.py``, whose GGUF conversion both use."""
