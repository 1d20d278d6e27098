"""The batch progress bar (``PromptCache.generate`` of a list; serving_core/core.py ``Engine.run``):
reported at 0, after each step that finished prompts and at the end, drawn and closed on a
terminal."""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

from ptyrun import run_on_pty

from promptcache import PromptCache
from promptcache.engine.decoding.sampling import SamplingParams
from promptcache.engine.serving_core.request import Request

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}

BATCH = """from promptcache import PromptCache
pc = PromptCache.from_pretrained("embedded")
outs = pc.generate(["Hello there", "Hi", "What is up?", "A word"], max_new_tokens=3, temperature=0.0)
print("DONE", len(outs))
"""


def test_every_finished_prompt_is_reported_and_the_last_call_is_the_total():
    pc = PromptCache.from_pretrained("embedded")
    reqs = [Request(pc.prompt_spec(p), SamplingParams(max_new_tokens=n, temperature=0.0), pc.tokenizer)
            for p, n in (("Hello there", 4), ("Hi", 1), ("What is up?", 2))]  # they finish in different steps
    calls = []

    def progress(done, total):
        calls.append((done, total))
        assert done == sum(r.finished for r in reqs)  # reported as of the step just taken, never a step behind

    pc.engine().run(reqs, progress)
    assert calls[0] == (0, 3) and calls[-1] == (3, 3)
    assert [d for d, _ in calls] == sorted(set(d for d, _ in calls))  # each count once, rising


def test_the_bar_is_drawn_and_closed_on_a_terminal():
    """All four prompts finish in the same step (same length asked): the bar still reaches 4/4 and
    is closed (its line ended) before the script prints."""
    out = run_on_pty([sys.executable, "-c", BATCH], env=ENV, timeout=300)
    assert "DONE 4" in out, out
    assert re.search(r"generating: +0%\|[^\r\n]*\| 0/4", out), out
    assert re.search(r"generating: 100%\|[^\r\n]*\| 4/4[^\r\n]*\r?\n(?:[^\r\n]*\r?\n)*DONE 4", out), out
