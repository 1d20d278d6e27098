"""What several commands need: the device check, loading an engine or a tokenizer, reading a prompt."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from .errors import EnvironmentProblem

__all__ = ["check_device", "dtype_line", "load_engine", "load_tokenizer", "read_prompt", "setup_logging"]


def setup_logging() -> None:
    """Library log lines on stderr: warnings, plus INFO progress lines (``promptcache.progress``)."""
    import logging

    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.WARNING, format="%(message)s", stream=sys.stderr)
    logging.getLogger("promptcache.progress").setLevel(logging.INFO)


def check_device(device: str | None) -> str:
    """The device to use; ``cuda`` without a usable GPU is refused here, before anything loads."""
    import torch

    if device is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise EnvironmentProblem(f"--device {device}: CUDA is not available here (torch {torch.__version__}, "
                                 f"{'built without CUDA' if torch.version.cuda is None else 'no GPU visible'}); "
                                 "use --device cpu")
    if device.startswith("cuda:") and device[5:].isdigit() and int(device[5:]) >= torch.cuda.device_count():
        raise EnvironmentProblem(f"--device {device}: only {torch.cuda.device_count()} CUDA device(s) here; "
                                 "use --device cuda:0")
    if device.split(":")[0] not in ("cpu", "cuda", "mps", "xpu"):
        raise click.BadParameter(f"unknown device {device!r} (cpu, cuda, cuda:N)", param_hint="--device")
    return device


def load_engine(model: str, device: str | None, dtype: str, config=None):
    """A PromptCache for ``model`` (messages on stderr say what loads, and that embedded text is noise)."""
    from ..engine import EngineConfig, PromptCache
    from ..models.loading import load_model

    device = check_device(device)
    _resolve_alias(model)  # fetched here with progress lines; load_model loads it under the alias's name
    # dtype "auto": resolved against the checkpoint's config as it loads (models.native_dtype.auto_dtype)
    click.echo(f"Loading model {model} on {device} ({dtype}) ...", err=True)
    if str(model).startswith("embedded"):
        click.echo("  note: embedded models have RANDOM weights: their text is noise, their speed is real "
                   "(--model smollm2 for real text).", err=True)
    m, tok = load_model(model, device=device, dtype=dtype)
    click.echo(f"  dtype: {dtype_line(dtype, next(m.parameters()).dtype, device)}", err=True)
    return PromptCache(m, tok, config or EngineConfig())


def dtype_line(asked: str, got, device: str) -> str:
    """What the model computes in, and why (said at start): 'bfloat16 (auto; this CPU computes
    bfloat16 natively)'."""
    from ..models.native_dtype import bf16_refusal

    name = str(got).removeprefix("torch.")
    why = bf16_refusal(device)
    native = "bfloat16 natively" if why is None else f"no native bfloat16: {why}"
    return f"{name} ({asked}; {device} computes {native})"


def _resolve_alias(model: str) -> str:
    """A model alias (``smollm2``, ``gemma3-270m``) -> its converted folder (fetched and converted on
    first use, saying so); any other name as it is."""
    from ..models.loading import ALIASES, alias_dir

    if model not in ALIASES:
        return model
    path = alias_dir(model, progress=lambda line: click.echo(line, err=True))
    click.echo(f"{model}: from {path} (converted once; loads offline)", err=True)
    return str(path)


def load_tokenizer(model: str):
    """The tokenizer alone (validate, inspect); a hub id without network is an OSError saying so."""
    from ..models.embedded import embedded_tokenizer, is_embedded

    if is_embedded(model):
        return embedded_tokenizer()
    model = _resolve_alias(model)
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(model)
    except OSError as e:
        raise OSError(f"could not load the tokenizer of '{model}' ({' '.join(str(e).split())[:200]}); without "
                      "network, pass a local directory or use the embedded tokenizer (--model embedded)") from e


def read_prompt(path: str | None, text: str | None):
    """The prompt to pass to the library: ``pathlib.Path`` for a file, ``str`` for ``-p TEXT`` or
    ``-`` (stdin). Exactly one of the two must be given."""
    if (path is None) == (text is None):
        raise click.UsageError("give a prompt file, '-' for stdin, or -p/--prompt TEXT (exactly one)")
    if text is not None:
        return text
    if path == "-":
        return sys.stdin.read()
    p = Path(path)
    if not p.is_file():
        raise click.BadParameter(f"no such file: {path}", param_hint="PROMPT")
    text = p.read_text(encoding="utf-8")
    return p if text.lstrip("\ufeff \t\r\n").startswith("<") else text  # a plain-text prompt file: its text
