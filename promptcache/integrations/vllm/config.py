"""The ``--kv-transfer-config`` JSON that loads the connector into vLLM (``promptcache vllm-config``)."""

from __future__ import annotations

from pathlib import Path

from ...artifact import ArtifactError, read_manifest
from ...rag import INDEX
from ...store.config import REMOTE_SCHEMES

__all__ = ["CONNECTOR_MODULE", "CONNECTOR_NAME", "kv_transfer_config"]

CONNECTOR_NAME = "PromptCacheConnector"
CONNECTOR_MODULE = "promptcache.integrations.vllm.connector"


FAILURE_POLICIES = ("fail", "recompute")


def kv_transfer_config(compiled=(), documents=(), remote: str | None = None, spill_dir=None,
                       failure_policy: str = "fail") -> dict:
    """vLLM's kv-transfer config for the compiled schema folders ``compiled`` and the document store
    folders ``documents`` (``DocumentStore(pc, path, attach_separator=True)``), as absolute paths
    (vLLM may run elsewhere). Each compiled folder must be a readable artifact (``ArtifactError``
    otherwise), each document folder must hold a store's index. ``remote`` (a Redis URL) and
    ``spill_dir`` (a folder): the tiers of a promptcache engine whose states requests name by
    content key (``to_vllm_request(..., by_key=True)``).
    ``failure_policy``: vLLM's ``kv_load_failure_policy`` for a load that fails on a worker after
    the scheduler's checks (a state damaged in between): "fail" (the default) fails the request;
    "recompute" has vLLM compute the request's tokens from the first unwritten block as a plain
    prefill (the whole prompt when no earlier request with its salt left blocks in vLLM's prefix
    cache), and the connector refuses its salt from then on."""
    if failure_policy not in FAILURE_POLICIES:
        raise ArtifactError(f"failure_policy must be one of {', '.join(FAILURE_POLICIES)}, got {failure_policy!r}")
    folders = []
    for folder in compiled:
        path = Path(folder).resolve()
        read_manifest(path)  # raises ArtifactError naming what is wrong
        folders.append(str(path))
    stores = []
    for folder in documents:
        path = Path(folder).resolve()
        if not (path / INDEX).is_file():
            raise ArtifactError(f"{path} is not a document store folder (no {INDEX})")
        stores.append(str(path))
    extra = {"compiled": folders, "documents": stores}
    if remote:
        if not str(remote).startswith(REMOTE_SCHEMES):
            raise ArtifactError(f"--remote must be a redis:// (or redis+cluster://) URL, got {remote!r}")
        extra["remote"] = str(remote)
    if spill_dir:
        extra["spill_dir"] = str(Path(spill_dir).resolve())
    if not folders and not stores and not remote and not spill_dir:
        raise ArtifactError("give at least one compiled schema folder (--compiled DIR), document store folder "
                            "(--documents DIR), Redis (--remote URL) or spill folder (--spill-dir DIR)")
    return {"kv_connector": CONNECTOR_NAME, "kv_connector_module_path": CONNECTOR_MODULE, "kv_role": "kv_consumer",
            "kv_load_failure_policy": failure_policy, "kv_connector_extra_config": extra}
