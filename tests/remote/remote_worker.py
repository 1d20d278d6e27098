"""A replica for the cross-process tests: ``python remote_worker.py ROLE URL OUT``.

A fresh process with an engine built from ``EngineConfig(store=StoreConfig(remote=URL))`` (nothing else shared with
the test's process) that adds the travel schema and answers the travel prompt. Roles:

    consume   at once (the test's process published every state before)
    race      after the go signal (Redis key ``test:go``), so two replicas miss the schema together

Writes a JSON report to OUT (how often this process encoded, hit tiers, the tier's counters) and
the prompt's logits to OUT.pt.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import redis
import torch

ROOT = Path(__file__).resolve().parents[2]
SCHEMA, PROMPT = ROOT / "schemas" / "travel.xml", ROOT / "examples" / "travel_tokyo.xml"


def replica(url: str, out: Path, wait_for_go: bool) -> dict:
    from promptcache import PromptCache
    from promptcache.engine import EngineConfig, StoreConfig
    from promptcache.models.loading import load_model

    model, tok = load_model("embedded")
    pc = PromptCache(model, tok, EngineConfig(store=StoreConfig(remote=url)))
    encodes = []
    encode = pc.encoder.encode
    pc.encoder.encode = lambda *a, **k: encodes.append(1) or encode(*a, **k)  # count this process's encodes
    _ = pc.model_key  # fingerprints: part of loading, before the race starts
    if wait_for_go:
        client = redis.Redis.from_url(url)
        client.incr("test:ready")
        while not client.exists("test:go"):
            time.sleep(0.005)
    entry = pc.add_schema(SCHEMA)
    res = pc.prefill(PROMPT, recompute=0)  # the stored states alone decide the logits
    torch.save(res.logits, str(out) + ".pt")
    return {"encodes": len(encodes), "states": len(entry.keys), "hit_tiers": res.hit_tiers,
            "stats": pc.store.shared_stats()}


if __name__ == "__main__":
    role, url, out = sys.argv[1], sys.argv[2], Path(sys.argv[3])
    if role not in ("consume", "race"):
        sys.exit(f"unknown role '{role}' (known: consume, race)")
    out.write_text(json.dumps(replica(url, out, wait_for_go=role == "race")))
