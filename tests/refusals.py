"""Refusals of bad input checked in a child process.

The native CPU kernels refuse bad input with a C++ exception (``TORCH_CHECK``) that torch turns into
a ``RuntimeError``. On the lent GPU machine's image (torch 2.11) that path crashed the process with a
segmentation fault instead (eval/results/cuda_checks_2026-11-27.md), taking the pytest worker and its
other tests with it. ``refused_in_child`` runs the refusals in a fresh Python, so a crash is this
test's failure, naming the signal and the statement that raised it.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys

import pytest

# The child reads {"setup": code, "cases": [statement, ...]} on stdin, runs the set-up, then each
# statement, writing one JSON line before it ("start") and one after it (the exception it raised).
_CHILD = r"""
import json, sys
job = json.loads(sys.stdin.read())
scope = {}
exec(job["setup"], scope)
for i, statement in enumerate(job["cases"]):
    print(json.dumps({"start": i}), flush=True)
    try:
        exec(statement, scope)
    except Exception as e:
        print(json.dumps({"case": i, "error": type(e).__name__, "message": str(e)}), flush=True)
    else:
        print(json.dumps({"case": i, "error": None, "message": ""}), flush=True)
"""


def _cause(returncode: int) -> str:
    if returncode < 0:
        try:
            return f"was killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"was killed by signal {-returncode}"
    return f"exited with status {returncode}"


def refused_in_child(setup: str, cases: list[tuple[str, str]], error: str = "RuntimeError",
                     timeout: float = 300) -> None:
    """Run ``setup`` (Python source) and then each ``(statement, pattern)`` of ``cases`` in one child
    Python; each statement must raise ``error`` with a message matching ``pattern`` (re.search).
    A child that dies (a signal, a non-zero exit) fails the test naming the statement it was at."""
    job = json.dumps({"setup": setup, "cases": [statement for statement, _ in cases]})
    proc = subprocess.run([sys.executable, "-X", "faulthandler", "-c", _CHILD], input=job, capture_output=True,
                          text=True, timeout=timeout, env=os.environ.copy())
    events = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    done = {e["case"]: e for e in events if "case" in e}
    if proc.returncode != 0:
        started = [e["start"] for e in events if "start" in e]
        where = repr(cases[started[-1]][0]) if started and started[-1] not in done else "its set-up"
        pytest.fail(f"the child process {_cause(proc.returncode)} at {where}:\n{proc.stderr[-3000:]}", pytrace=False)
    for i, (statement, pattern) in enumerate(cases):
        got = done[i]
        assert got["error"] == error, f"{statement}: raised {got['error']} ({got['message']!r}), expected {error}"
        assert re.search(pattern, got["message"]), f"{statement}: {got['message']!r} does not match {pattern!r}"
