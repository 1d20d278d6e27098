"""The engine: encode schemas once, serve prompts from spliced attention states.

``PromptCache`` (``facade.py``) is the public class; the rest are its rooms: ``runner``
(model, forwards, buffers), ``registry`` (encoded schemas, fingerprints, keys), ``encoder``,
``assemble`` (prompt plans), ``prompts`` (what a request asks for), ``core`` (the serving core:
pool, step loop, prefix chains), ``serving`` (the step loop), ``sampling``, ``constrained`` (JSON
output), ``request``, ``stream``, ``results``, ``config``.
"""

from ..store import StoreConfig
from .config import EngineConfig, RecomputeConfig, RunnerConfig, ServingConfig
from .core import Engine
from .facade import PromptCache
from .prompts import PmlPrompt, PrefilledPrompt, PromptSpec, TokenPrompt
from .registry import EncodedSchema
from .request import Request, StepOutput
from .results import Generation, PrefillResult, Usage
from .runner import ModelRunner
from .sampling import SamplingParams
from .stream import GenerationStream

__all__ = ["EncodedSchema", "Engine", "EngineConfig", "Generation", "GenerationStream", "ModelRunner", "PmlPrompt",
           "PrefilledPrompt", "PrefillResult", "PromptCache", "PromptSpec", "RecomputeConfig", "Request", "RunnerConfig",
           "SamplingParams", "ServingConfig", "StepOutput", "StoreConfig", "TokenPrompt", "Usage"]
