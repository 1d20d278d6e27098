"""``promptcache.progress``: a tqdm bar on a terminal, INFO log lines elsewhere; the facade's
``add_schema`` uses it when no callback is given."""

from __future__ import annotations

import io
import logging

from promptcache import PromptCache
from promptcache.progress import progress_for


class FakeTerminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_bar_on_a_terminal_log_lines_elsewhere(caplog):
    term = FakeTerminal()
    bar = progress_for("encoding x", stream=term)
    for done in range(0, 101, 25):
        bar(done, 100)
    assert "encoding x: 100%|" in term.getvalue() and "100/100" in term.getvalue()
    caplog.set_level(logging.INFO, logger="promptcache.progress")
    pipe = io.StringIO()
    lines = progress_for("encoding x", stream=pipe)
    for done in range(0, 101, 5):
        lines(done, 100)
    assert pipe.getvalue() == ""  # nothing drawn
    messages = [r.getMessage() for r in caplog.records if r.name == "promptcache.progress"]
    assert messages[0] == "encoding x: 0/100 tokens (0%)" and messages[-1] == "encoding x: 100/100 tokens (100%)"
    assert len(messages) == 11  # one per 10 % step, not one per call


def test_add_schema_without_a_callback_reports_progress(caplog, tmp_path):
    caplog.set_level(logging.INFO, logger="promptcache.progress")
    pc = PromptCache.from_pretrained("embedded")
    schema = tmp_path / "s.xml"
    schema.write_text('<schema name="s"><module name="a">' + "word " * 300 + "</module></schema>")
    pc.add_schema(schema)
    done = [r.getMessage() for r in caplog.records if r.name == "promptcache.progress"]
    assert done and done[-1].startswith("encoding s: ") and done[-1].endswith("(100%)")
