"""The engine: encode schemas once, serve prompts from spliced attention states.

``PromptCache`` (``facade.py``) is the public class; the rest are its rooms: ``runner``
(model, forwards, buffers), ``registry`` (encoded schemas, fingerprints, keys), ``encoder``,
``assemble`` (prompt plans), ``sampling``, ``constrained`` (JSON output), ``request``,
``scheduler``, ``stream``, ``results``, ``config``.

The names below are imported on first use (PEP 562): ``promptcache.engine.config`` (the settings
the command line's options are built from) needs no torch, so ``promptcache --help`` loads none.
"""

_HOMES = {"StoreConfig": "config", "EngineConfig": "config", "RecomputeConfig": "config", "RunnerConfig": "config",
          "PromptCache": "facade", "EncodedSchema": "registry", "Request": "request", "Generation": "results",
          "PrefillResult": "results", "Usage": "results", "ModelRunner": "runner", "SamplingParams": "sampling",
          "Scheduler": "scheduler", "StepOutput": "scheduler", "GenerationStream": "stream"}

__all__ = sorted(_HOMES)


def __getattr__(name: str):
    if name not in _HOMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from . import config, facade, registry, request, results, runner, sampling, scheduler, stream

    homes = {"config": config, "facade": facade, "registry": registry, "request": request, "results": results,
             "runner": runner, "sampling": sampling, "scheduler": scheduler, "stream": stream}
    return getattr(homes[_HOMES[name]], name)
