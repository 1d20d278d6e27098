"""The codec: module states <-> safetensors bytes that prove what they hold.

Format (a plain safetensors file or byte string)::

    u64 header length N (little endian) | N bytes JSON header | tensor data
    header = {"__metadata__": {"format": "promptcache-states-v2", "model": <model digest>,
                               "states": JSON {name: {"key": <content key>, "sha256": <checksum>}},
                               ...caller's extra string fields},
              <name>: {"dtype": "F32", "shape": [L, 2, H, n, D], "data_offsets": [a, b]}, ...}

Each state's checksum is sha256 over ``describe(name, dtype, shape, key, model)`` (canonical
JSON) + NUL + its data bytes: it covers the header entry (dtype, shape), the content key and the
model, not only the data. A flipped header byte either breaks the JSON, changes a described
field (checksum mismatch) or changes an offset (the data no longer matches). A reader states
what it needs (``StateInfo``: key, and where known dtype, shape, model, checksum) and is refused
(``CodecError``, a ``StoreError``) unless the stored state proves to be exactly that.

``StatesFile`` reads a file lazily (memory-mapped): ``check`` compares the header with the
expectation (no data read), ``read`` returns a tensor and verifies its checksum the first time
each state is read through this handle (``verified``); the handle is the unit of "verified once
per process". ``encode`` / ``decode`` are the same format as bytes (a remote tier's values):
``decode`` returns a view of the value's memory (no copy), and ``Digest`` computes a state's
checksum while the value arrives (``decode`` then compares it instead of hashing the data again).

Over 300 lines on purpose: the writer, the two readers (bytes, file) and the streaming checksum
must agree byte for byte on one format and read best side by side.
"""

from __future__ import annotations

import hashlib
import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save as st_save

from .. import jsonsafe
from ..fsutil import atomic_write
from .base import StoreError

FORMAT = "promptcache-states-v2"
MAX_HEADER = 64 << 20  # bytes; a longer header is corruption, not a states file
_DTYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.float64: "F64",
           torch.int64: "I64", torch.int32: "I32", torch.int8: "I8", torch.uint8: "U8"}
_BY_NAME = {str(k).removeprefix("torch."): v for k, v in _DTYPES.items()}
_BY_CODE = {v: k for k, v in _DTYPES.items()}


class CodecError(StoreError):
    """Stored bytes are not the state the reader needs (corrupted, truncated, or another state)."""


@dataclass(frozen=True)
class StateInfo:
    """What a reader needs a stored state to be. None fields are not checked."""

    key: str | None  # None: not checked (a manifest's header check before keys are computed)
    dtype: str | None = None  # torch dtype name, "float32"
    shape: tuple[int, ...] | None = None  # [L, 2, H, n, D]
    model: str | None = None  # model digest (keys.model_digest)
    checksum: str | None = None  # the codec checksum a manifest or index recorded


def st_dtype(t: torch.dtype | str) -> str:
    """safetensors' dtype code ("F32") of a torch dtype or its name ("float32")."""
    return _BY_NAME.get(t, t) if isinstance(t, str) else _DTYPES[t]


def describe(name: str, dtype: str, shape, key: str, model: str, window: dict | None = None) -> bytes:
    """What a checksum covers besides the data; ``window``: a trimmed state's ``Trim``
    (JSON), only then part of it (an untrimmed state's description is unchanged)."""
    d = {"format": FORMAT, "name": name, "dtype": dtype, "shape": list(shape), "key": key, "model": model}
    if window is not None:
        d["window"] = window
    return json.dumps(d, sort_keys=True).encode()


def checksum(name: str, kv: torch.Tensor, key: str, model: str, window: dict | None = None) -> str:
    h = hashlib.sha256(describe(name, st_dtype(kv.dtype), kv.shape, key, model, window) + b"\0")
    h.update(_data(kv))
    return h.hexdigest()


def _data(kv: torch.Tensor) -> memoryview | bytes:
    t = kv.detach().contiguous().cpu()
    return t.reshape(-1).view(torch.uint8).numpy().data if t.numel() else b""


def encode(states: dict[str, tuple[str, torch.Tensor]], model: str = "",
           extra: dict[str, str] | None = None, windows=None) -> tuple[bytes, dict[str, str]]:
    """(safetensors bytes, {name: checksum}) of ``states``: name -> (content key, kv).
    ``windows``: the model's sliding window per layer (None entries: global layers); states
    [L, 2, H, n, D] longer than a window are stored trimmed to what a later position can see
    (the window-aware storage section below; the record says what was kept) and read back whole."""
    tensors, records = {}, {}
    for name, (key, kv) in states.items():
        t = kept_tokens(windows, kv.shape[3]) if windows and kv.dim() == 5 else None
        tensors[name] = (trim(kv.detach(), t) if t else kv.detach()).contiguous().cpu()
        window = t.to_json() if t else None
        records[name] = {"key": key, "sha256": checksum(name, tensors[name], key, model, window)}
        if window is not None:
            records[name]["window"] = window
    meta = {**(extra or {}), "format": FORMAT, "model": model, "states": json.dumps(records, sort_keys=True)}
    return st_save(tensors, metadata=meta), {n: r["sha256"] for n, r in records.items()}


def decode(blob, name: str, expect: StateInfo, digest: "Digest | None" = None) -> torch.Tensor:
    """The state ``name`` of an encoded value, verified against its checksum and ``expect``.

    ``blob``: bytes-like, or a uint8 tensor. The state is a view into ``blob`` when that is a
    tensor or a writable buffer (no copy: it keeps ``blob`` alive), a copy of read-only bytes.
    ``digest``: a ``Digest`` fed the value as it arrived; when it covered exactly this state
    (same header fields, same data range) its checksum is compared and the data is not read again.
    """
    buf = _as_uint8(blob)
    first8 = _bytes(buf, 0, 8)
    header = parse_header(first8, lambda n: _bytes(buf, 8, 8 + n), buf.numel(), "value")
    recorded = _check(header, name, expect, "value")
    start = data_start(first8)
    kv = _tensor(buf, header[name], name, start)
    a, b = _offsets(header[name])
    span = (start + a, start + b)
    if digest is not None and digest.covers(_prefix(recorded), span):
        if digest.hexdigest() != recorded["checksum"]:
            raise CodecError(f"checksum mismatch for state '{name}' in value: the data is corrupted")
    else:
        _verify(kv, name, recorded, "value")
    return _whole(kv, recorded)


class Digest:
    """The checksum of state ``name`` of an encoded value, computed while the value's bytes land
    in order in ``buf`` (a memoryview): ``update(start, end)`` as each range arrives, so hashing
    overlaps the network wait. Its header is parsed as soon as it has arrived; anything unexpected
    (an unreadable header, bytes out of order) just leaves it unfinished, and ``decode`` then
    verifies the data itself (and reports what is wrong)."""

    def __init__(self, buf: memoryview, name: str):
        self.buf, self.name = buf, name
        self.seen = 0  # bytes [0, seen) of buf have arrived
        self.prefix: bytes | None = None  # what the checksum covers before the data
        self.span: tuple[int, int] | None = None  # the state's data in buf
        self.hashed = 0  # bytes of the data hashed so far
        self.failed = False
        self.sha = hashlib.sha256()

    def update(self, start: int, end: int) -> None:
        if self.failed or start != self.seen:
            self.failed = True
            return
        self.seen = end
        if self.span is None and not self.start():
            return
        a, b = self.span
        lo, hi = a + self.hashed, min(end, b)
        if hi > lo:
            self.sha.update(self.buf[lo:hi])
            self.hashed = hi - a

    def start(self) -> bool:
        """Parse the header once it has arrived; False while it has not (or cannot be parsed)."""
        if self.seen < 8:
            return False
        first8 = bytes(self.buf[:8])
        start = data_start(first8)
        if self.seen < start:
            return False
        try:
            header = parse_header(first8, lambda k: bytes(self.buf[8 : 8 + k]), len(self.buf), "value")
            rec = _check(header, self.name, StateInfo(None), "value")
            a, b = _offsets(header[self.name])
        except CodecError:
            self.failed = True
            return False
        self.prefix, self.span = _prefix(rec), (start + a, start + b)
        self.sha.update(self.prefix)
        return True

    def covers(self, prefix: bytes, span: tuple[int, int]) -> bool:
        """Whether the whole state with this checksum prefix and data range was hashed."""
        return (not self.failed and self.prefix == prefix and self.span == span
                and self.hashed == span[1] - span[0])

    def hexdigest(self) -> str:
        return self.sha.hexdigest()


def data_start(first8: bytes) -> int:
    """Where the tensor data begins in an encoded value whose first 8 bytes are ``first8`` (after the
    header's length and the header)."""
    return 8 + struct.unpack("<Q", first8)[0]


def _prefix(rec: dict) -> bytes:
    return describe(rec["name"], rec["dtype"], rec["stored_shape"], rec["key"], rec["model"], rec["window"]) + b"\0"


def _whole(kv: torch.Tensor, rec: dict) -> torch.Tensor:
    """A verified state as it was given to ``encode``: a trimmed one restored to [L, 2, H, n, D]."""
    return kv if rec["window"] is None else untrim(kv, Trim.from_json(rec["window"]))


def _trimmed_shape(stored, window) -> list | None:
    """The shape [L, 2, H, n, D] a trimmed state of stored shape [2, H, kept, D] reads back as."""
    try:
        t = Trim.from_json(window)
    except ValueError as e:
        raise CodecError(f"corrupted window record ({e})") from None
    if not (isinstance(stored, list) and len(stored) == 4 and stored[2] == sum(t.kept)):
        raise CodecError(f"corrupted window record: stored shape {stored!r} does not hold {sum(t.kept)} entries")
    return [len(t.kept), stored[0], stored[1], t.tokens, stored[3]]


def _as_uint8(blob) -> torch.Tensor:
    if isinstance(blob, torch.Tensor):
        if blob.dtype != torch.uint8 or blob.dim() != 1 or blob.device.type != "cpu":
            raise TypeError(f"codec.decode: a tensor value must be 1-D uint8 on the CPU, got {blob.dtype} "
                            f"{tuple(blob.shape)} on {blob.device}")
        return blob
    view = memoryview(blob).cast("B")
    if view.readonly:
        view = memoryview(bytearray(view))  # torch.frombuffer needs writable memory: one copy of a read-only buffer
    return torch.frombuffer(view, dtype=torch.uint8) if len(view) else torch.empty(0, dtype=torch.uint8)


def _bytes(buf: torch.Tensor, a: int, b: int) -> bytes:
    return buf[a:b].numpy().tobytes()


def _tensor(buf: torch.Tensor, entry: dict, name: str, start: int) -> torch.Tensor:
    """The state of header entry ``entry`` as a view of ``buf``, whose data begin at ``start`` (its
    dtype and shape checked against its byte range)."""
    a, b = _offsets(entry)
    dtype, shape = _BY_CODE.get(entry.get("dtype")), entry.get("shape")
    if dtype is None or not (isinstance(shape, list) and all(isinstance(d, int) and d >= 0 for d in shape)):
        raise CodecError(f"state '{name}' in value: unreadable (dtype {entry.get('dtype')!r}, shape {shape!r})")
    size = math.prod(shape) * dtype.itemsize
    start += a
    if b - a != size or a < 0 or start % dtype.itemsize:
        raise CodecError(f"state '{name}' in value: unreadable ({b - a} bytes at offset {a} for {entry['dtype']} "
                         f"{shape})")
    try:
        return buf[start : start + size].view(dtype).view(shape)
    except RuntimeError as e:
        raise CodecError(f"state '{name}' in value: unreadable ({e})") from None


def parse_header(first8: bytes, read, total: int, where: str) -> dict:
    """The JSON header of safetensors data of ``total`` bytes; ``read(n)`` returns bytes 8..8+n."""
    if len(first8) < 8:
        raise CodecError(f"{where}: truncated ({total} bytes, no safetensors header)")
    (n,) = struct.unpack("<Q", first8)
    if n > MAX_HEADER or 8 + n > total:
        raise CodecError(f"{where}: truncated or corrupted (header of {n} bytes in {total} bytes)")
    try:
        header = jsonsafe.loads(read(n).decode("utf-8"))
        meta = header.get("__metadata__") or {}
        states = jsonsafe.loads(meta.get("states", "null"))
    except (UnicodeDecodeError, ValueError, AttributeError, TypeError) as e:
        raise CodecError(f"{where}: corrupted header ({e})") from None
    if meta.get("format") != FORMAT or not isinstance(states, dict):
        raise CodecError(f"{where}: not a promptcache states file of format {FORMAT} "
                         f"(format {meta.get('format')!r}); re-create it with this version")
    end = 8 + n
    for k, v in header.items():
        if k != "__metadata__" and (not isinstance(v, dict) or end + _offsets(v)[1] > total):
            raise CodecError(f"{where}: truncated or corrupted (tensor '{k}' lies past the end)")
    header["__metadata__"]["states"] = states
    return header


def _offsets(entry: dict) -> tuple[int, int]:
    off = entry.get("data_offsets")
    if not (isinstance(off, list) and len(off) == 2 and all(isinstance(x, int) for x in off)):
        raise CodecError(f"corrupted tensor entry {entry!r}")
    return off[0], off[1]


def _check(header: dict, name: str, expect: StateInfo, where: str) -> dict:
    """Compare the header's record of ``name`` with ``expect``; returns the record."""
    meta, entry = header["__metadata__"], header.get(name)
    rec = meta["states"].get(name)
    if not isinstance(entry, dict) or not isinstance(rec, dict):
        raise CodecError(f"{where} holds no state '{name}'")
    window = rec.get("window")
    stored = entry.get("shape")
    got = {"key": rec.get("key"), "dtype": entry.get("dtype"),
           "shape": stored if window is None else _trimmed_shape(stored, window),
           "model": meta.get("model"), "checksum": rec.get("sha256")}
    want = {"key": expect.key, "dtype": expect.dtype and st_dtype(expect.dtype),
            "shape": list(expect.shape) if expect.shape is not None else None, "model": expect.model,
            "checksum": expect.checksum}
    wrong = [f"{k} is {_short(got[k])}, expected {_short(v)}" for k, v in want.items()
             if v is not None and got[k] != v]
    if wrong:
        raise CodecError(f"state '{name}' in {where} is not the state needed: {'; '.join(wrong)}")
    return {**got, "name": name, "stored_shape": stored, "window": window}


def _verify(kv: torch.Tensor, name: str, rec: dict, where: str) -> None:
    if (st_dtype(kv.dtype), list(kv.shape)) != (rec["dtype"], rec["stored_shape"]) or \
            checksum(name, kv, rec["key"], rec["model"], rec["window"]) != rec["checksum"]:
        raise CodecError(f"checksum mismatch for state '{name}' in {where}: the data is corrupted")


def _short(v) -> str:
    return str(v)[:16] if v is not None else "none"


def file_header(path: Path) -> dict:
    """The parsed header of a states file (no data read); CodecError when it is not one."""
    try:
        with open(path, "rb") as f:
            total = f.seek(0, 2)
            f.seek(0)
            return parse_header(f.read(8), f.read, total, str(path))
    except OSError as e:
        raise CodecError(f"cannot read states file {path}: {e}") from None


def state_record(header: dict, name: str) -> tuple[str, int] | None:
    """(content key, data bytes) of state ``name`` in a parsed header, None when it holds no such state."""
    rec, entry = header["__metadata__"]["states"].get(name), header.get(name)
    if not isinstance(rec, dict) or not isinstance(entry, dict) or not isinstance(rec.get("key"), str):
        return None
    a, b = _offsets(entry)
    return rec["key"], b - a


class StatesFile:
    """A states file opened for lazy reads (memory-mapped; the mapping outlives an unlink)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        where = str(self.path)
        self.header = file_header(self.path)
        try:
            self._handle = safe_open(where, framework="pt")
        except OSError as e:
            raise CodecError(f"cannot read states file {where}: {e}") from None
        except Exception as e:  # safetensors' own validation
            raise CodecError(f"{where}: truncated or corrupted ({e})") from None
        self.verified: set[str] = set()

    @property
    def names(self) -> list[str]:
        return [k for k in self.header if k != "__metadata__"]

    def nbytes(self, name: str) -> int:
        a, b = _offsets(self.header[name])
        return b - a

    def check(self, name: str, expect: StateInfo) -> None:
        _check(self.header, name, expect, str(self.path))

    def read(self, name: str, expect: StateInfo) -> torch.Tensor:
        rec = _check(self.header, name, expect, str(self.path))
        try:
            kv = self._handle.get_tensor(name)
        except Exception as e:
            raise CodecError(f"cannot read state '{name}' from {self.path}: {e}") from None
        if name not in self.verified:
            _verify(kv, name, rec, str(self.path))
            self.verified.add(name)
        return _whole(kv, rec)


def write_file(path: Path, states: dict[str, tuple[str, torch.Tensor]], model: str = "",
               extra: dict[str, str] | None = None, windows=None) -> dict[str, str]:
    """Encode ``states`` to ``path`` atomically (see ``fsutil``; ``windows``: as ``encode``);
    returns {name: checksum}."""
    blob, sums = encode(states, model, extra, windows)
    atomic_write(path, blob)
    return sums


# -- window-aware storage ----------------------------------------------------------------------------
# Window-aware storage: what a stored state keeps in sliding-window layers, and whether a reader
# finds what it needs in it.
#
# In a sliding-window layer (Gemma 3's local layers) a query at position q sees keys at positions
# p > q - window, wherever they sit (a prompt's new tokens attend to every state it imports, so a
# reader may sit before a state too: free text before the first module reference, a parameter's
# argument, a recomputed token inside or before the state). What any reader can see is a suffix of
# the state in each sliding layer: the part past ``first reader - window``.
#
# Storing (``codec.encode(..., windows=...)``, the disk and Redis tiers with
# ``StoreConfig.window_aware``) keeps, of a span of n tokens, the last ``min(n, window)`` in each
# sliding layer: what a reader at or after the span's last token sees (the prompt's next tokens,
# decoding, the last cached token run again when a prompt has no new tokens); global layers keep
# all n. ``trim`` packs what is kept ([2, H, sum(kept), D], layer after layer), ``untrim`` restores
# [L, 2, H, n, D] with the dropped entries zero; the record (``Trim``) is covered by the codec's
# checksum.
#
# Reading: a dropped entry is zero in every head and dimension of its key, which a computed key
# never is, so whether a reader finds what it needs is read off the state itself, wherever it has
# been since (promoted to memory, copied into a buffer): ``readable`` looks at the one entry per
# sliding layer that the earliest reader needs first. A state a reader cannot use is encoded again
# by the engine (``engine/prefill/window_reads.py``), so every prompt stays exact; a key that happens
# to be zero only costs that encode, never a wrong read.


@dataclass(frozen=True)
class Trim:
    """What a trimmed state keeps: ``tokens`` of the span, ``kept[l]`` (its last ones) in layer l."""

    tokens: int
    kept: tuple[int, ...]

    @property
    def dropped(self) -> int:
        """Token entries (per layer, summed) not stored."""
        return sum(self.tokens - k for k in self.kept)

    def to_json(self) -> dict:
        return {"tokens": self.tokens, "kept": list(self.kept)}

    @classmethod
    def from_json(cls, d) -> "Trim":
        if not isinstance(d, dict) or not isinstance(d.get("tokens"), int) or not isinstance(d.get("kept"), list) \
                or not all(isinstance(k, int) and 0 <= k <= d["tokens"] for k in d["kept"]):
            raise ValueError(f"a window trim must be {{'tokens': n, 'kept': [k <= n per layer]}}, got {d!r}")
        return cls(d["tokens"], tuple(d["kept"]))


def kept_tokens(windows, n: int) -> Trim | None:
    """The trim of an n-token span under per-layer ``windows`` (None entries: global layers), or
    None where nothing would be dropped."""
    if not windows:
        return None
    kept = tuple(n if w is None else min(n, int(w)) for w in windows)
    return Trim(n, kept) if any(k < n for k in kept) else None


def trim(kv: torch.Tensor, t: Trim) -> torch.Tensor:
    """kv [L, 2, H, n, D] -> packed [2, H, sum(kept), D] (each layer's last kept tokens)."""
    if kv.dim() != 5 or kv.shape[0] != len(t.kept) or kv.shape[3] != t.tokens:
        raise ValueError(f"states {list(kv.shape)} do not match a trim of {len(t.kept)} layers x {t.tokens} tokens")
    return torch.cat([kv[l, :, :, t.tokens - k:] for l, k in enumerate(t.kept)], dim=2).contiguous()


def untrim(packed: torch.Tensor, t: Trim) -> torch.Tensor:
    """packed [2, H, sum(kept), D] -> kv [L, 2, H, n, D], dropped entries zero."""
    if packed.dim() != 4 or packed.shape[2] != sum(t.kept):
        raise ValueError(f"packed states {list(packed.shape)} do not hold the {sum(t.kept)} entries of their trim")
    two, h, _, d = packed.shape
    kv = packed.new_zeros((len(t.kept), two, h, t.tokens, d))
    at = 0
    for l, k in enumerate(t.kept):
        kv[l, :, :, t.tokens - k:] = packed[:, :, at : at + k]
        at += k
    return kv


def readable(kv: torch.Tensor, windows, start: int, first_reader: int) -> bool:
    """Whether every entry of ``kv`` [L, 2, H, n, D] (a span at positions start..start+n-1) that a
    query at ``first_reader`` or later can see in a sliding layer was kept. Only entries a trim
    may have dropped are looked at (before the last ``window`` of a layer), in one read."""
    n = kv.shape[3]
    rows = []
    for layer, w in enumerate(windows or ()):
        if w is None or n <= w:
            continue  # a global layer, or a span no longer than the window: kept whole
        first = max(0, first_reader - w + 1 - start)  # the first entry a reader at first_reader sees
        if first < n - w:  # before the kept suffix: it may have been dropped
            rows.append(kv[layer, 0, :, first])
    return not rows or bool(torch.stack(rows).flatten(1).any(dim=1).all())
