"""``import promptcache`` bounds torch's oneDNN primitive caches (ideep's and oneDNN's own), which
otherwise keep growing a serving process for minutes: one compiled primitive per matrix shape met,
up to 1,024 each, some hundreds of KB apiece."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
CAPS = ("LRU_CACHE_CAPACITY", "ONEDNN_PRIMITIVE_CACHE_CAPACITY")

# SmolLM2's four linear shapes through the packed oneDNN linear (models/packed.py's op), at 300
# token counts: a new primitive per shape and count, as a server meets them.
PROBE = """
import ctypes, json, os
import promptcache, torch
torch.set_num_threads(1)

def rss():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024

weights = [torch.randn(o, i) for o, i in ((576, 576), (192, 576), (1536, 576), (576, 1536))]
packed = [torch.ops.mkldnn._reorder_linear_weight(w, None) for w in weights]
base = rss()
for m in range(1, 301):
    for w, p in zip(weights, packed):
        torch.ops.mkldnn._linear_pointwise(torch.randn(m, w.shape[1]), p, None, "none", [], "")
ctypes.CDLL("libc.so.6").malloc_trim(0)  # what is left is held, not freed and kept by the allocator
print(json.dumps({"growth": rss() - base, "caps": [os.environ.get(k) for k in %r]}))
""" % (CAPS,)


def _growth(**env) -> dict:
    base = {k: v for k, v in os.environ.items() if k not in CAPS}
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=600, check=True,
                         env={**base, "PYTHONPATH": str(ROOT), **env})
    return json.loads(out.stdout)


@pytest.mark.slow  # two fresh processes of 1,200 oneDNN primitives each (~100 s on a busy 2-core machine)
@pytest.mark.skipif(not sys.platform.startswith("linux") or not hasattr(torch.ops.mkldnn, "_linear_pointwise")
                    or not torch.backends.mkldnn.is_available(), reason="needs oneDNN's linear and glibc (Linux)")
def test_primitive_caches_are_bounded():
    mb = 2**20
    ours = _growth()
    assert ours["caps"] == ["256", "256"]
    assert ours["growth"] < 200 * mb, ours
    # torch's defaults (1,024 each), which the user may still choose: the growth the bound prevents
    theirs = _growth(LRU_CACHE_CAPACITY="1024", ONEDNN_PRIMITIVE_CACHE_CAPACITY="1024")
    assert theirs["caps"] == ["1024", "1024"]
    assert theirs["growth"] > ours["growth"] + 150 * mb, (ours, theirs)
