"""The travel schema and prompts the serving tests share: a module gap, a union, parameters, an
uncached module, and a prompt with no new tokens; ``POOLED``: the families the KV pool serves (all);
``serve_together``: prompts served at once through the serving core."""

POOLED = ["bloom", "falcon_alibi", "falcon_rotary", "gemma3_text", "gpt2", "gpt_neox", "llama", "mistral", "mpt", "opt",
          "phi3", "qwen2", "qwen3"]  # every family of tiny.FAMILIES

SCHEMA = """<schema name="trip">
  <system>You are a travel planner.</system>
  <user>
    <module name="plan">Plan a trip of <parameter name="days" length="4" scaffold="three"/> days.</module>
    <union scaffold="paris">
      <module name="paris">Paris is the capital of France, famous for museums and cafes.</module>
      <module name="tokyo">Tokyo is a huge city in Japan with temples and food markets.</module>
    </union>
    <module name="cheap">Keep it cheap.</module>
    <module name="note" cache="false">Answer in one short paragraph.</module>
    <module name="who">The traveller is <parameter name="name" length="6"/>.</module>
  </user>
</schema>"""

PROMPTS = [
    '<prompt schema="trip"><plan days="2"/><tokyo/><who name="Ann"/> Go.</prompt>',  # gap, union member, args
    '<prompt schema="trip"><plan days="5"/><paris/><cheap/> Highlight the food and keep it short.</prompt>',
    '<prompt schema="trip"><cheap/><note/> Now.</prompt>',  # an uncached module
    '<prompt schema="trip"><paris/><cheap/></prompt>',  # no new tokens: the last cached one runs
]


def serve_together(pc, prompts: list[str], max_new: int = 6, budget: int = 12, forward=None) -> list:
    """``prompts`` (PML) served together by one ``ServingScheduler`` over a fresh 1024-token KV pool
    (chunks of at most ``budget`` tokens, states read in place: recompute=0, greedy, ``max_new``
    tokens each; ``forward``: the step's forward, default the eager one). The finished requests."""
    from promptcache.engine import PmlPrompt
    from promptcache.engine.serving_core.kvpool import KVPool
    from promptcache.engine.serving_core.request import Request
    from promptcache.engine.decoding.sampling import SamplingParams
    from promptcache.engine.serving_core.scheduler import ServingScheduler
    from promptcache.pml import parse_prompt

    sched = ServingScheduler(pc.runner, KVPool(pc.runner.spec, pc.device, 1024, 16), token_budget=budget,
                             forward=forward, planner=pc.core.planner)
    reqs = [Request(PmlPrompt(parse_prompt(p), recompute=0), SamplingParams(max_new_tokens=max_new,
                                                                                temperature=0.0), pc.tokenizer)
            for p in prompts]
    for r in reqs:
        sched.add(r)
    while sched.has_work:
        sched.step()
    return reqs
