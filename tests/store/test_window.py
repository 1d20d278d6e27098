"""Window-aware storage (``StoreConfig.window_aware``, on by default): disk and Redis keep, in
sliding-window layers, only the last ``window`` tokens of a state (what a reader after it can see),
say so in the record, and read the state back whole with the dropped entries zero; a prompt whose
readers sit earlier (text before the first reference, a parameter argument before a module, a
recomputed token inside a module or document) gets those states encoded again, so every prompt
served from trimmed states equals one served from whole states."""

from __future__ import annotations

import pytest
import torch

from promptcache import EngineConfig, PromptCache
from promptcache.store import StoreConfig, build_store, codec
from promptcache.store.codec import Trim, kept_tokens, readable, trim, untrim

WINDOWS = (4, None, 4)


def states(n: int, seed: int = 0) -> torch.Tensor:
    torch.manual_seed(seed)
    return torch.randn(3, 2, 2, n, 8)  # [L, 2, H, n, D]


def test_a_trim_keeps_each_sliding_layers_last_window_tokens_and_global_layers_whole():
    assert kept_tokens(WINDOWS, 3) is None  # shorter than the window: nothing to drop
    assert kept_tokens((None, None), 50) is None and kept_tokens(None, 50) is None
    t = kept_tokens(WINDOWS, 10)
    assert t == Trim(10, (4, 10, 4)) and t.dropped == 12
    kv = states(10)
    packed = trim(kv, t)
    assert packed.shape == (2, 2, 18, 8)
    back = untrim(packed, t)
    assert torch.equal(back[1], kv[1])  # the global layer whole
    assert torch.equal(back[[0, 2], :, :, 6:], kv[[0, 2], :, :, 6:])  # the last 4 tokens of sliding layers
    assert not back[[0, 2], :, :, :6].any()  # dropped: zero, never read


def test_the_codec_stores_the_trim_proves_it_and_reads_the_state_back_whole(tmp_path):
    kv = states(10)
    whole, _ = codec.encode({"kv": ("k1", kv)})
    trimmed, _ = codec.encode({"kv": ("k1", kv)}, windows=WINDOWS)
    assert len(trimmed) < len(whole) - 12 * 2 * 2 * 8 * 4 + 200  # 12 token entries of 2 x 2 x 8 floats dropped
    expect = codec.StateInfo("k1", "float32", (3, 2, 2, 10, 8))
    got = codec.decode(trimmed, "kv", expect)
    assert got.shape == kv.shape
    assert torch.equal(got, untrim(trim(kv, kept_tokens(WINDOWS, 10)), kept_tokens(WINDOWS, 10)))
    path = tmp_path / "s.safetensors"
    codec.write_file(path, {"kv": ("k1", kv)}, windows=WINDOWS)
    assert torch.equal(codec.StatesFile(path).read("kv", expect), got)
    # the record's trim is covered by the checksum: a changed "kept" is corruption, not other states
    forged = bytearray(trimmed)
    at = bytes(forged).index(b'\\"kept\\": [4, 10, 4]')
    forged[at: at + len(b'\\"kept\\": [4, 10, 4]')] = b'\\"kept\\": [4, 10, 4]'.replace(b"[4, 10, 4]", b"[5, 10, 3]")
    with pytest.raises(codec.CodecError, match="checksum"):
        codec.decode(bytes(forged), "kv", expect)


def test_a_reader_finds_what_it_needs_only_where_the_trim_kept_it():
    """``readable``: a reader at or after the span's last token always; an earlier one only where
    the entries its window reaches were kept (the span sits at positions 20..29, window 4)."""
    kv = states(10)
    back = untrim(trim(kv, kept_tokens(WINDOWS, 10)), kept_tokens(WINDOWS, 10))
    for first in (29, 30, 100):  # the last cached token run again, the next tokens, decoding
        assert readable(back, WINDOWS, 20, first)
    for first in (28, 20, 3):  # sees 25.. (25 was dropped), a reader inside, a reader before the span
        assert not readable(back, WINDOWS, 20, first)
        assert readable(kv, WINDOWS, 20, first)  # whole states: every entry is there
    assert readable(back[:, :, :, 6:], WINDOWS, 26, 0)  # no longer than the window: never trimmed


def test_only_the_tiers_that_serialize_trim_and_only_when_asked(tmp_path):
    off = build_store("cpu", StoreConfig(spill_dir=str(tmp_path / "a"), window_aware=False), WINDOWS)
    on = build_store("cpu", StoreConfig(spill_dir=str(tmp_path / "b")), WINDOWS)  # on by default
    assert all(t.windows is None for t in off.tiers) and off.windows is None
    assert [t.windows for t in on.tiers] == [None, WINDOWS] and on.windows == WINDOWS  # host whole, disk trimmed
    assert build_store("cpu", StoreConfig(), (None, None)).windows is None  # a model without sliding layers
    kv = states(10)
    for store in (off, on):
        disk = store.tiers[-1]
        disk.put("k", kv)
        assert disk.get("k").shape == kv.shape
        disk.flush()  # the write-behind default queues the file; flush waits for it
    sizes = [next((tmp_path / d).glob("*.safetensors")).stat().st_size for d in ("a", "b")]
    assert sizes[0] - sizes[1] >= 12 * 2 * 2 * 8 * 4 - 200


READ_AFTER = ['<prompt schema="trip"><tokyo/><cheap/> Highlight the food and keep it short.</prompt>',
              '<prompt schema="trip"><paris/><cheap/><note/> Now.</prompt>',  # an uncached module between
              '<prompt schema="trip"><paris/><cheap/></prompt>']  # no new tokens: the last cached one runs
READ_BEFORE = ['<prompt schema="trip"><plan days="2"/><tokyo/><who name="Ann"/> Go.</prompt>',  # arguments before
               '<prompt schema="trip">Quick, please: <paris/><cheap/> Go.</prompt>',  # text before the first module
               '<prompt schema="trip"><plan days="5"/><cheap/> Now.</prompt>']  # a gap (no union member), an argument


def trimmed_engine(tmp_path, window_aware=True):
    """A tiny Gemma 3 (4-position windows) whose travel modules all went to disk (no memory
    budget), trimmed by default."""
    from tiny import gemma3_model as gemma3, make_tokenizer
    from trip import SCHEMA

    config = EngineConfig(store=StoreConfig(host_budget=0, spill_dir=str(tmp_path), window_aware=window_aware))
    pc = PromptCache(gemma3(4), make_tokenizer(), config)
    pc.add_schema(SCHEMA)
    pc.store.tiers[-1].flush()  # on disk, trimmed: until the writer has written them, reads get the queued whole copy
    return pc


def test_prompts_served_from_trimmed_states_on_disk_equal_the_definition(tmp_path):
    """Travel prompts at recompute=0 from trimmed states on disk equal the definition windowed by
    position, served together and prefilled alone: those read after every module from the trimmed
    states (union members of two lengths, an uncached module, no new token), those with a reader
    before a module (parameter arguments, text before the first reference, a gap) from the states
    they need encoded again."""
    from oracle import definition_greedy, definition_state
    from trip import serve_together

    pc = trimmed_engine(tmp_path / "states")
    schema = pc.schema("trip").layout
    disk = pc.store.tiers[-1]
    assert disk.windows == (4, None, 4) and disk.bytes_used > 0
    full = sum(pc.runner.stored_spec.bytes_per_token * len(s.token_ids) for s in schema.spans)
    assert disk.bytes_used < full  # what the modules of more than 4 tokens dropped
    for prompts, again in ((READ_AFTER, False), (READ_BEFORE, True)):
        for prompt in prompts:  # which plans read states encoded again: only those with an earlier reader
            assert any(s.key.endswith("[whole]") for s in pc.plan(prompt, recompute=0).segments) == again, prompt
        reqs = serve_together(pc, prompts, max_new=6, budget=5)
        for prompt, req in zip(prompts, reqs):
            assert req.error is None, (prompt, req.error)
            layout = pc.layout(prompt)
            ref, _, _ = definition_state(pc.model, schema, layout)
            assert torch.max(torch.abs(req.prefill.logits - ref)).item() <= 1e-4, prompt
            assert torch.max(torch.abs(pc.prefill(prompt, recompute=0).logits - ref)).item() <= 1e-4, prompt
            assert req.token_ids == definition_greedy(pc.model, schema, layout, 6, eos=3), prompt
            assert req.prefill.hit_tiers.get("disk", 0) > 0


@pytest.mark.parametrize("recompute", [0.5])
def test_recomputed_prompts_from_trimmed_states_equal_those_from_whole_states(tmp_path, recompute):
    """Recomputed tokens read the modules they sit in: a drifted prompt recomputing from trimmed
    states gives the logits it gives from whole states (the option off)."""
    trimmed, whole = trimmed_engine(tmp_path / "a"), trimmed_engine(tmp_path / "b", window_aware=False)
    assert whole.store.windows is None
    for prompt in READ_AFTER + READ_BEFORE:
        got = trimmed.prefill(prompt, recompute=recompute)
        want = whole.prefill(prompt, recompute=recompute)
        assert got.recomputed_tokens == want.recomputed_tokens
        assert torch.max(torch.abs(got.logits - want.logits)).item() <= 1e-4, prompt


def test_recomputed_documents_from_trimmed_states_equal_those_from_whole_states(tmp_path):
    """Independent RAG documents longer than the window, on disk trimmed: at recompute=0 the
    question (after them) reads the trimmed states and equals the documents' definition; recomputed
    tokens inside a document read it from its states encoded again and equal whole states."""
    import importlib.util
    import pathlib

    from promptcache.rag import DocumentStore
    from tiny import gemma3_model as gemma3, make_tokenizer

    spec = importlib.util.spec_from_file_location("rag_defs", pathlib.Path(__file__).parents[1] / "rag" / "test_rag.py")
    rag = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(rag)
    stores = []
    for name, on in (("trimmed", True), ("whole", False)):
        config = EngineConfig(store=StoreConfig(host_budget=0, spill_dir=str(tmp_path / name), window_aware=on))
        store = DocumentStore(PromptCache(gemma3(4), make_tokenizer(), config), None, independent=True)
        for k, v in rag.DOCS.items():
            store.add(k, v)
        stores.append(store)
    trimmed, whole = stores
    assert trimmed.pc.store.tiers[-1].bytes_used < whole.pc.store.tiers[-1].bytes_used
    question, system = "What is famous there?", "Answer briefly."
    for doc_ids, again in ((["rome"], False), (["tokyo", "paris"], True)):
        # one document: every reader comes after it; two: the separator after the first is new text
        # that reads the second from before it (the paper's splice), which is then encoded again
        plan = trimmed.plan(question, doc_ids, system, recompute=0)
        assert any(s.key.endswith("[whole]") for s in plan.segments) == again, doc_ids
        res = trimmed.prefill(question, doc_ids, system, recompute=0)
        ref = rag.definition_logits(trimmed, question, doc_ids, system)
        assert torch.max(torch.abs(res.logits - ref)).item() <= 1e-4, doc_ids
        got = trimmed.prefill(question, doc_ids, system, recompute=0.5)
        want = whole.prefill(question, doc_ids, system, recompute=0.5)
        assert got.recomputed_tokens == want.recomputed_tokens > 0
        assert torch.max(torch.abs(got.logits - want.logits)).item() <= 1e-4, doc_ids
        if again:  # the states encoded again are kept: the next prompt reading them encodes nothing
            kept = len(trimmed.whole_states)
            assert kept > 0
            assert torch.equal(trimmed.prefill(question, doc_ids, system, recompute=0).logits, res.logits)
            assert len(trimmed.whole_states) == kept


def test_spans_encoded_again_are_kept_for_the_next_reader(tmp_path):
    """A prompt reading a trimmed span before its end encodes the schema again once; the next
    prompts reading it take the kept states (no encode), with the same logits."""
    pc = trimmed_engine(tmp_path / "states")
    planner = pc.core.planner
    calls = []
    encode = planner.encoder.encode
    planner.encoder.encode = lambda *a, **k: calls.append(1) or encode(*a, **k)
    prompt = READ_BEFORE[0]
    first = pc.prefill(prompt, recompute=0).logits
    assert calls == [1] and len(planner.whole) > 0
    for _ in range(2):
        assert torch.equal(pc.prefill(prompt, recompute=0).logits, first)
    assert calls == [1]


def test_whole_states_drop_the_least_recently_used_past_their_bytes():
    from promptcache.engine.prefill.window_reads import WholeStates

    kept = WholeStates(limit=3 * 4 * 10)  # three tensors of 10 float32
    made = []

    def encode(name):
        return lambda: made.append(name) or torch.full((10,), float(len(made)))

    for name in "abc":
        kept.get(name, encode(name))
    kept.get("a", encode("a"))  # a is used again: b is now the oldest
    kept.get("d", encode("d"))
    assert made == ["a", "b", "c", "d"] and "b" not in kept and "a" in kept and kept.nbytes == 120
    big = kept.get("e", lambda: torch.zeros(100))  # larger than the limit: handed back, not kept
    assert big.numel() == 100 and "e" not in kept and len(kept) == 3
