"""Ways to serve promptcache's stored states from other inference servers.

``vllm``: a KV connector vLLM loads (``--kv-transfer-config``), the client helper that turns a PML
prompt into a vLLM request, and the config the ``promptcache vllm-config`` command prints
(docs/vllm.md).
"""
