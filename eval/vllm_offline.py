"""vLLM's offline ``LLM.generate`` over given prompt token ids: run with a vLLM environment's python.

    VENV/bin/python eval/vllm_offline.py SPEC.json

SPEC: {"model": dir, "prompts": [[ids]], "max_tokens": n, "dtype": "float32"}. Prefix caching on,
greedy, EOS ignored (every prompt generates ``max_tokens``). The model load and a one-prompt warm-up
are not timed; the one ``generate`` call over every prompt is. Prints one JSON line last:
{"seconds", "generated", "cached"}. Imports nothing of promptcache (it runs in vLLM's environment).
"""

import json
import os
import sys
import time

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0-1")
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def main() -> None:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    spec = json.loads(open(sys.argv[1]).read())
    llm = LLM(model=spec["model"], dtype=spec.get("dtype", "float32"), enable_prefix_caching=True,
              max_model_len=4096)
    params = SamplingParams(max_tokens=spec["max_tokens"], temperature=0.0, ignore_eos=True)
    prompts = [TokensPrompt(prompt_token_ids=ids) for ids in spec["prompts"]]
    llm.generate([TokensPrompt(prompt_token_ids=spec["prompts"][0][:8])], SamplingParams(max_tokens=2))
    t = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - t
    generated = sum(len(o.outputs[0].token_ids) for o in outs)
    cached = sum(o.num_cached_tokens or 0 for o in outs)
    print(json.dumps({"seconds": seconds, "generated": generated, "cached": cached}))


if __name__ == "__main__":
    main()
