"""The engine: encode schemas once, serve prompts from spliced attention states.

``PromptCache`` (``facade.py``) is the public class; the rest are its rooms: ``runner``
(model, forwards, buffers), ``registry`` (encoded schemas, fingerprints, keys), ``encoder``,
``assemble`` (prompt plans), ``prompts`` (what a request asks for), ``core`` (the serving core:
pool, step loop, prefix chains), ``serving`` (the step loop), ``sampling``, ``constrained`` (JSON
output), ``request``, ``stream``, ``results``, ``config``.

The names below are imported on first use (PEP 562): ``promptcache.engine.config`` (the settings
the command line's options are built from) needs no torch, so ``promptcache --help`` loads none.
"""

_HOMES = {"StoreConfig": "config", "EngineConfig": "config", "RecomputeConfig": "config", "RunnerConfig": "config",
          "ServingConfig": "config", "Engine": "core", "PromptCache": "facade", "PmlPrompt": "prompts",
          "PrefilledPrompt": "prompts", "PromptSpec": "prompts", "TokenPrompt": "prompts", "EncodedSchema": "registry",
          "Request": "request", "StepOutput": "request", "Generation": "results", "PrefillResult": "results",
          "Usage": "results", "ModelRunner": "runner", "SamplingParams": "sampling", "GenerationStream": "stream"}

__all__ = sorted(_HOMES)


def __getattr__(name: str):
    if name not in _HOMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from . import config, core, facade, prompts, registry, request, results, runner, sampling, stream

    homes = {"config": config, "core": core, "facade": facade, "prompts": prompts, "registry": registry,
             "request": request, "results": results, "runner": runner, "sampling": sampling, "stream": stream}
    return getattr(homes[_HOMES[name]], name)
