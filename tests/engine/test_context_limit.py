"""``Adapter.context_limit``: the request limit the server reads comes from the adapter, which knows
MPT's ``max_seq_len`` (``max_position_embeddings`` does not); a sliding window does not bound it
(the pool applies windows by position, tests/engine/test_paged_positions.py), but a prompt
assembled in a private buffer must still fit in the window."""

from __future__ import annotations

import pytest

from promptcache.models.base import UnsupportedModelError
from promptcache.models.families import adapter_class
from tiny import fresh_model


def _limit(model):
    adapter = adapter_class(model.config)(model)
    try:
        return adapter.max_entries(), adapter.context_limit
    finally:
        adapter.close()


def test_context_limit_is_the_context_even_with_a_smaller_sliding_window():
    model = fresh_model("mistral")
    assert _limit(model) == (None, 1024)  # no window: the context
    model.config.sliding_window = 128
    assert _limit(model) == (128, 1024)  # the window bounds entries in a private buffer, not the sequence


def test_a_private_buffer_past_the_sliding_window_is_refused_naming_it():
    model = fresh_model("mistral")
    model.config.sliding_window = 128
    adapter = adapter_class(model.config)(model)
    try:
        adapter.check_limits(100, 128)  # inside the window
        with pytest.raises(UnsupportedModelError, match="sliding attention window \\(128\\)"):
            adapter.check_limits(200, 129)
    finally:
        adapter.close()


def test_mpt_context_is_max_seq_len():
    model = fresh_model("mpt")
    assert getattr(model.config, "max_position_embeddings", None) is None  # what the server used to read
    assert _limit(model) == (None, 1024)
