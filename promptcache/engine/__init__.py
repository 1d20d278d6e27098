"""The engine: encode schemas once, serve prompts from spliced attention states.

``PromptCache`` (``facade.py``) is the public class; the rest are its rooms: ``runner``
(model, forwards, buffers), ``registry`` (encoded schemas, fingerprints, keys), ``encoder``,
``assemble`` (prompt plans), ``sampling``, ``constrained`` (JSON output), ``request``,
``scheduler``, ``stream``, ``results``, ``config``.
"""

from ..store import StoreConfig
from .config import EngineConfig, RecomputeConfig, RunnerConfig
from .facade import PromptCache
from .registry import EncodedSchema
from .request import Request
from .results import Generation, PrefillResult, Usage
from .runner import ModelRunner
from .sampling import SamplingParams
from .scheduler import Scheduler, StepOutput
from .stream import GenerationStream

__all__ = ["EncodedSchema", "EngineConfig", "Generation", "GenerationStream", "ModelRunner", "PrefillResult",
           "PromptCache", "RecomputeConfig", "Request", "RunnerConfig", "SamplingParams", "Scheduler", "StepOutput",
           "StoreConfig", "Usage"]
