"""PML on vLLM: promptcache's stored module states served by vLLM through its KV connector API.

* ``connector.PromptCacheConnector``: the connector vLLM loads (``--kv-transfer-config``, printed
  by ``promptcache vllm-config``); the one module here that imports vllm.
* ``to_vllm_request(pc, prompt)``: a PML prompt as the official client's ``completions.create``
  keyword arguments (token ids, the states to supply, the cache salt).
* ``supply``: which states a prompt is given and at which rotation (both sides apply it).

docs/vllm.md says what is exact and how to serve.
"""

from .config import CONNECTOR_MODULE, CONNECTOR_NAME, kv_transfer_config
from .request import VllmRequest, plan_request, to_vllm_request
from .supply import Supply, SupplyError, cache_salt, supply

__all__ = ["CONNECTOR_MODULE", "CONNECTOR_NAME", "Supply", "SupplyError", "VllmRequest", "cache_salt",
           "kv_transfer_config", "plan_request", "supply", "to_vllm_request"]
