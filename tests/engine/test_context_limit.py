"""``Adapter.context_limit``: the request limit the server reads comes from the adapter, which knows
a sliding window and MPT's ``max_seq_len`` (``max_position_embeddings`` knows neither)."""

from __future__ import annotations

from promptcache.models.families import adapter_class
from tiny import fresh_model


def _limit(model):
    adapter = adapter_class(model.config)(model)
    try:
        return adapter.max_entries(), adapter.context_limit
    finally:
        adapter.close()


def test_context_limit_is_the_context_or_the_sliding_window_whichever_is_smaller():
    model = fresh_model("mistral")
    assert _limit(model) == (None, 1024)  # no window: the context
    model.config.sliding_window = 128
    assert _limit(model) == (128, 128)


def test_mpt_context_is_max_seq_len():
    model = fresh_model("mpt")
    assert getattr(model.config, "max_position_embeddings", None) is None  # what the server used to read
    assert _limit(model) == (None, 1024)
