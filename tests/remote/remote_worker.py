"""Worker processes for the cross-process tests (run as ``python remote_worker.py ROLE URL OUT``).

    lock URL OUT      wait for the go signal, then single-flight encode key "shared" with encode_lock
    consume URL OUT   a fresh engine with the remote tier appended: add the travel schema, prefill;
                      reports how often it encoded (the test's process published every state)
Each writes a JSON report to OUT (and the prompt's logits to OUT.pt for consume).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import redis
import torch

from promptcache.store.remote import RedisTier

ROOT = Path(__file__).resolve().parents[2]
SCHEMA, PROMPT = ROOT / "schemas" / "travel.xml", ROOT / "examples" / "travel_tokyo.xml"


def expected_state() -> torch.Tensor:
    return torch.arange(2 * 2 * 4 * 300 * 16, dtype=torch.float32).reshape(2, 2, 4, 300, 16) / 7


def lock(url: str) -> dict:
    r, tier = redis.Redis.from_url(url), RedisTier(url, chunk_bytes=64 << 10)
    r.incr("test:ready")
    while not r.exists("test:go"):
        time.sleep(0.005)
    with tier.encode_lock("shared", ttl=30) as mine:
        if mine:
            r.incr("test:encodes")
            time.sleep(0.5)  # encoding takes a while: the other process must wait, not encode
            tier.put("shared", expected_state())
    got = tier.get("shared")
    return {"mine": mine, "equal": got is not None and torch.equal(got, expected_state())}


def consume(url: str, out: Path) -> dict:
    from promptcache import PromptCache
    from promptcache.engine.encoder import SchemaEncoder
    from promptcache.models.loading import load_model

    encodes = []
    original = SchemaEncoder.encode

    def counting(self, layout, *args, **kwargs):
        encodes.append(layout.name)
        return original(self, layout, *args, **kwargs)

    SchemaEncoder.encode = counting  # count encoder calls in this process only
    model, tok = load_model("embedded")
    pc, tier = PromptCache(model, tok), RedisTier(url)
    pc.store.tiers.append(tier)  # the coordinator wires this through EngineConfig(remote=...)
    entry = pc.add_schema(SCHEMA)
    res = pc.prefill(PROMPT)
    torch.save(res.logits, str(out) + ".pt")
    return {"encodes": len(encodes), "states": len(entry.keys), "hit_tiers": res.hit_tiers, "stats": tier.stats}


if __name__ == "__main__":
    role, url, out = sys.argv[1], sys.argv[2], Path(sys.argv[3])
    if role not in ("lock", "consume"):
        sys.exit(f"unknown role '{role}' (known: lock, consume)")
    report = lock(url) if role == "lock" else consume(url, out)
    out.write_text(json.dumps(report))
