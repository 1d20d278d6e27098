"""``import promptcache`` asks OpenMP for sleeping waits before torch starts, unless told otherwise."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROBE = ("import os, sys\n{first}import promptcache, torch\n"
         "print(os.environ.get('OMP_WAIT_POLICY'), torch.get_num_threads() > 0)")


def _run(first: str = "", **env) -> str:
    base = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    out = subprocess.run([sys.executable, "-c", PROBE.format(first=first)], capture_output=True, text=True,
                         check=True, env={**base, "PYTHONPATH": str(ROOT), **env})
    return out.stdout.strip()


def test_passive_waits_are_set_before_torch_starts():
    assert _run() == "PASSIVE True"


def test_the_users_policy_is_kept():
    assert _run(OMP_WAIT_POLICY="ACTIVE") == "ACTIVE True"


def test_nothing_is_set_once_torch_is_loaded():
    assert _run(first="import torch\n") == "None True"  # libgomp has read its settings: changing them would lie
