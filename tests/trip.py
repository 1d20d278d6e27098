"""The travel schema and prompts the serving tests share: a module gap, a union, parameters, an
uncached module, and a prompt with no new tokens; ``POOLED``: the families the KV pool serves."""

POOLED = ["gpt2", "gpt_neox", "llama", "mistral", "opt", "phi3", "qwen2", "qwen3"]

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
