"""TextStream decodes only the ids after its last whole character where the tokenizer's decoding
concatenates (byte-level): the same pieces, text and stops as decoding every id at each token."""

from __future__ import annotations

import random

import pytest

from promptcache.engine.decoding.text import TextStream, concatenates
from promptcache.models.embedded import embedded_model


class FullDecode:
    """A tokenizer that only decodes (no backend to read): TextStream decodes every id each push,
    as it always did."""

    def __init__(self, tok):
        self.tok = tok

    def decode(self, ids, skip_special_tokens=False):
        return self.tok.decode(ids, skip_special_tokens=skip_special_tokens)


@pytest.fixture(scope="module")
def tok():
    return embedded_model("embedded")[1]


def streamed(tok, ids, stop):
    ts = TextStream(tok, stop)
    pieces = []
    for t in ids:
        pieces.append(ts.push(t))
        if ts.stopped:
            break
    pieces.append(ts.flush())
    return pieces, ts.text, ts.stopped


def test_which_tokenizers_concatenate(tok):
    assert concatenates(tok)  # byte-level decoder, no clean-up of spaces
    assert not concatenates(FullDecode(tok))
    assert TextStream(FullDecode(tok)).settled is None


def test_pieces_text_and_stops_equal_decoding_every_id(tok):
    rng = random.Random(0)
    vocab = len(tok)
    # split multi-byte characters (an emoji's, CJK's bytes over several tokens), a special token
    mixed = tok.encode("naïve 日本語 text 🙂🚀 ends here, 𝔘𝔫𝔦", add_special_tokens=False)
    specials = [i for i in tok.all_special_ids if i is not None][:1]
    checked = stops = 0
    for trial in range(60):
        ids = [rng.randrange(vocab) for _ in range(rng.randrange(1, 80))]
        at = rng.randrange(len(ids))
        ids[at:at] = mixed if trial % 2 else mixed[::-1]  # reversed: bytes that never make a character
        if specials and trial % 3 == 0:
            ids.insert(rng.randrange(len(ids)), specials[0])
        full_text = tok.decode(ids, skip_special_tokens=True)
        stop = []
        if trial % 4:  # a stop string cut from the text (maybe never reached), and one never found
            a = rng.randrange(max(1, len(full_text) - 3))
            stop = [full_text[a : a + rng.randrange(1, 5)], "\x00never"]
        got, want = streamed(tok, ids, stop), streamed(FullDecode(tok), ids, stop)
        assert got == want, (ids, stop)
        checked += 1
        stops += got[2]
    assert checked == 60 and stops > 10  # the stops were exercised


def test_a_push_decodes_only_the_ids_after_the_last_whole_character(tok):
    calls = []

    class CountingBackend:  # the backend tokenizer (a push calls its decode directly), its calls counted
        decoder = tok.backend_tokenizer.decoder

        def decode(self, ids, skip_special_tokens=True):
            calls.append(len(ids))
            return tok.backend_tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    class Counting(FullDecode):
        backend_tokenizer = CountingBackend()
        clean_up_tokenization_spaces = False

    emoji = tok.encode("🙂", add_special_tokens=False)
    assert len(emoji) > 1  # its bytes over several tokens
    word = tok.encode(" hello", add_special_tokens=False)
    ts = TextStream(Counting(tok))
    for t in word * 20 + emoji + word:
        ts.push(t)
    assert ts.text == tok.decode(word * 20 + emoji + word, skip_special_tokens=True)
    # one id a push, but while the emoji's bytes are incomplete (its ids decoded together)
    assert calls == [1] * (20 * len(word)) + list(range(1, len(emoji) + 1)) + [1] * len(word)
