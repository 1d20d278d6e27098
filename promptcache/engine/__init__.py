"""The engine: encode schemas once, serve prompts from spliced attention states.

``PromptCache`` (``facade.py``) is the public class; the rest are its rooms, by concern:

* ``decoding/``: sampling, incremental text, constrained (JSON) output;
* ``prefill/``: settings, the ``PrefillPlan`` a prefill reads, selective recompute, the model
  runner (a plan assembled in a private splice buffer), results;
* ``schemas/``: schema encoding, the registry of encoded schemas, compiled schema artifacts, and
  laying a PML prompt over a schema into a plan (``assemble``);
* ``serving_core/``: KV pool, prefix chains, requests and prompt specs, the step loop
  (``scheduler``), paged attention and the native CPU kernel, step graphs, ``core.Engine``;
* ``planner.py`` (``Planner``: every request's ``PrefillPlan``, specs being data);
* ``core.py`` (``EngineCore``: runner, store, registry, encoder, planner, serving engine);
* ``facade.py`` (``PromptCache``, a thin shell over the core) and ``stream.py`` (``GenerationStream``) on top.

Each room imports only rooms listed before it (tests/test_architecture.py). The names below are
imported on first use (PEP 562): ``promptcache.engine.prefill.config`` (the settings the command
line's options are built from) needs no torch, so ``promptcache --help`` loads none.
"""

_HOMES = {"StoreConfig": "config", "EngineConfig": "config", "RecomputeConfig": "config", "RunnerConfig": "config",
          "ServingConfig": "config", "Engine": "core", "PromptCache": "facade", "PmlPrompt": "prompts",
          "PromptSpec": "prompts", "SourcePrompt": "prompts", "TokenPrompt": "prompts", "EncodedSchema": "registry",
          "EngineCore": "engine_core", "Planner": "planner",
          "Request": "request", "StepOutput": "request", "Generation": "results", "PrefillResult": "results",
          "Usage": "results", "ModelRunner": "runner", "SamplingParams": "sampling", "GenerationStream": "stream"}

__all__ = sorted(_HOMES)


def __getattr__(name: str):
    if name not in _HOMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from . import core as engine_core, facade, planner, stream
    from .decoding import sampling
    from .prefill import config, results, runner
    from .schemas import registry
    from .serving_core import core, prompts, request

    homes = {"config": config, "core": core, "engine_core": engine_core, "facade": facade, "planner": planner,
             "prompts": prompts, "registry": registry, "request": request, "results": results, "runner": runner, "sampling": sampling, "stream": stream}
    return getattr(homes[_HOMES[name]], name)
