"""Reading PML sources: files or text, strict XML parsing, element content with exact lines.

Trust (docs/security.md): a ``str`` is always PML (or plain-text prompt) text and is
never opened, whatever file it happens to name; an ``os.PathLike`` is a file (``read_source``).
A PML source may name ``src`` files, but only regular files of at most ``MAX_FILE_BYTES`` inside
an allowed root (``confined_path``); a DOCTYPE (internal DTD, entities, attribute defaults) is
refused; text must be encodable UTF-8 (no lone surrogates). Every refusal is a ``PMLError``
naming the source and line (``SourceFileError`` when a file is missing or unreadable).

lxml reports one line per element: where its start tag *ends*. Errors must name the line a user
sees the problem on (where a tag starts, where a stray text is), so ``Lines`` re-reads the
already well-formed source with a small lexer and records, for every element, comment and
processing instruction, the line its start tag begins on, the line its own text begins on and
the line its tail begins on.
"""

from __future__ import annotations

import bisect
import os
import re
import stat
from pathlib import Path

from lxml import etree

from .errors import PMLError, SourceFileError


MAX_FILE_BYTES = 16 << 20  # a schema, prompt or src file larger than 16 MiB is refused
HINT = "use &lt;, &amp; or CDATA, or src="  # for the usual cause of malformed XML: '<' or '&' in text
_HINTED = ("entity", "starttag", "start tag", "invalid element name", "tag mismatch", "attvalue")


def read_text(path: Path, what: str, source: str, line: int | None = None) -> str:
    """A regular UTF-8 file's text (at most ``MAX_FILE_BYTES``); any failure is a PMLError naming
    ``source`` and ``line``. Opened non-blocking and checked with fstat, so a FIFO or a device
    (``/dev/zero``) is refused instead of hanging or filling memory."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except (OSError, ValueError) as e:  # ValueError: a NUL byte in the path
        raise SourceFileError(f"{what} '{path}' cannot be read ({getattr(e, 'strerror', None) or e})",
                              source, line) from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise PMLError(f"{what} '{path}' is not a regular file", source, line)
        if st.st_size > MAX_FILE_BYTES:
            raise PMLError(
                f"{what} '{path}' is {st.st_size} bytes, more than the limit of {MAX_FILE_BYTES}", source, line
            )
        with os.fdopen(fd, "rb", closefd=False) as f:
            data = f.read(MAX_FILE_BYTES + 1)
    except OSError as e:
        raise SourceFileError(f"{what} '{path}' cannot be read ({e.strerror or e})", source, line) from None
    finally:
        os.close(fd)
    if len(data) > MAX_FILE_BYTES:
        raise PMLError(f"{what} '{path}' is more than the limit of {MAX_FILE_BYTES} bytes", source, line)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise PMLError(f"{what} '{path}' is not UTF-8 text ({e.reason} at byte {e.start})", source, line) from None


def confined_path(rel: str, base: Path, root: Path, what: str, source: str, line: int | None) -> Path:
    """``base / rel`` with symlinks and ``..`` resolved; a PMLError unless it lies in ``root``
    (or below). Absolute ``rel`` values are judged the same way."""
    try:
        real_root = Path(os.path.realpath(root))
        path = Path(os.path.realpath(base / rel))
    except (OSError, ValueError) as e:
        raise PMLError(f"{what} '{rel}' is not a usable path ({e})", source, line) from None
    if path != real_root and real_root not in path.parents:
        raise PMLError(
            f"{what} '{rel}' is outside the allowed folder '{real_root}' (pass allow_src_root= to widen it)",
            source,
            line,
        )
    return path


def check_text(text: str, what: str, source: str, line: int | None = None) -> None:
    """A PMLError if ``text`` cannot be encoded as UTF-8 (a lone surrogate)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        line = (line or 1) + text.count("\n", 0, e.start)
        raise PMLError(
            f"{what} holds U+{ord(text[e.start]):04X}, a lone surrogate (not a character)", source, line
        ) from None


def is_markup(text: str) -> bool:
    """A string whose first character, after whitespace and a byte-order mark, is '<'."""
    return isinstance(text, str) and text.lstrip().lstrip("\ufeff").lstrip().startswith("<")


def read_source(text_or_path: str | os.PathLike, kind: str) -> tuple[str, str, Path | None]:
    """Return (text, source name, base directory).

    A ``str`` is always text (PML, or for a prompt plain text) and is never opened, whatever
    file it happens to name; an ``os.PathLike`` (``pathlib.Path``) is a file to read. A missing
    file is a ``SourceFileError`` naming it; an empty string a ``PMLError``.
    """
    if isinstance(text_or_path, str):
        if not text_or_path.strip():
            raise PMLError(f"empty {kind}: expected PML text (or a pathlib.Path to read a file)", "<string>", 1)
        return text_or_path, "<string>", None
    if not isinstance(text_or_path, os.PathLike):
        raise TypeError(f"a {kind} is PML text (str) or a file (pathlib.Path), got {type(text_or_path).__name__}")
    path = Path(text_or_path)
    return read_text(path, f"{kind} file", str(path)), str(path), path.parent


def parse_xml(text: str, source: str) -> tuple["etree.ElementBase", "Lines"]:
    """Parse strictly (no recovery, no entity expansion, no network) into (root, line tracker)."""
    parser = etree.XMLParser(
        resolve_entities=False, no_network=True, recover=False, encoding="utf-8",
        load_dtd=False, dtd_validation=False, attribute_defaults=False, huge_tree=False,
    )
    try:
        root = etree.fromstring(text.encode("utf-8"), parser)
    except etree.XMLSyntaxError as e:
        msg = (e.msg or str(e)).strip()
        if any(h in msg.lower() for h in _HINTED):
            msg += f" (a '<' or '&' in text? {HINT})"
        raise PMLError(f"malformed XML: {msg}", source, e.lineno or None) from None
    except UnicodeEncodeError as e:
        line = text.count("\n", 0, e.start) + 1
        raise PMLError(f"malformed XML: character {text[e.start]!r} cannot be encoded", source, line) from None
    except (ValueError, TypeError) as e:  # lxml refuses some inputs before parsing (NUL bytes, ...)
        raise PMLError(f"malformed XML: {e}", source, 1) from None
    docinfo = root.getroottree().docinfo
    if docinfo.doctype or docinfo.internalDTD is not None or docinfo.externalDTD is not None:
        at = text.find("<!DOCTYPE")
        line = text.count("\n", 0, at) + 1 if at >= 0 else 1
        raise PMLError("a DOCTYPE is not allowed in PML (no DTDs, entities or attribute defaults)", source, line)
    return root, Lines(root, text)


# Markup in a well-formed document: '<' never occurs inside attribute values or text.
_MARKUP = re.compile(
    r"<!--.*?-->|<!\[CDATA\[.*?\]\]>|<\?.*?\?>|<!DOCTYPE(?:[^\[>]|\[.*?\])*>|</[^>]*>"
    r"|<(?:[^>\"']|\"[^\"]*\"|'[^']*')*>",
    re.S,
)


class Lines:
    """Source lines of elements, comments and processing instructions inside the root.

    start(n): line of n's '<'; text(el): line where el's own text begins (end of its start tag);
    tail(n): line where n's tail begins (end of its end tag). Falls back to lxml's sourceline if
    the lexer and lxml ever disagree.
    """

    def __init__(self, root, text: str):
        self._newlines = [m.start() for m in re.finditer("\n", text)]
        self._start: dict = {}
        self._open: dict = {}
        self._after: dict = {}
        try:
            self._scan(root, text)
        except (StopIteration, ValueError):
            self._start, self._open, self._after = {}, {}, {}

    def _line(self, offset: int) -> int:
        return bisect.bisect_left(self._newlines, offset) + 1

    def _scan(self, root, text: str) -> None:
        nodes = iter([n for n in root.iter() if n.tag is not etree.Entity])
        stack: list = []
        started = False
        for m in _MARKUP.finditer(text):
            tok = m.group()
            if tok.startswith(("<!DOCTYPE", "<![CDATA[")):
                continue
            if tok.startswith("</"):
                if stack:
                    self._after[stack.pop()] = self._line(m.end() - 1)
                continue
            if started and not stack:
                break  # after the root element
            is_tag = not tok.startswith(("<!--", "<?"))
            if not (started or is_tag):
                continue  # before the root element (XML declaration, comments)
            node, started = next(nodes), True
            if is_tag != isinstance(node.tag, str):
                raise ValueError("lexer and parser disagree")
            self._start[node] = self._line(m.start())
            self._after[node] = self._open[node] = self._line(m.end() - 1)
            if is_tag and not tok.endswith("/>"):
                stack.append(node)

    def start(self, node) -> int:
        return self._start.get(node, node.sourceline)

    def text(self, el) -> int:
        return self._open.get(el, el.sourceline)

    def tail(self, node) -> int:
        return self._after.get(node, node.sourceline)


def _first_line(text: str, start: int) -> int:
    """Line of the first non-whitespace character of `text` (or of its start, if all blank)."""
    return start + text[: len(text) - len(text.lstrip())].count("\n")


def content(el, lines: Lines, source: str) -> list[tuple[str, object, int]]:
    """el's content in document order: ``("text", str, line)`` and ``("el", element, line)``.

    Comments and processing instructions are dropped and the text around them joined into one
    run; a text's line is that of its first non-whitespace character. Entity references (from a
    DTD; never expanded) are an error.
    """
    out: list[tuple[str, object, int]] = []

    def add_text(text: str | None, start) -> None:
        if not text:
            return
        if out and out[-1][0] == "text":
            _, prev, line = out[-1]
            if not prev.strip():
                line = _first_line(text, start())
            out[-1] = ("text", prev + text, line)
        else:
            out.append(("text", text, _first_line(text, start())))

    add_text(el.text, lambda: lines.text(el))
    for child in el:
        if child.tag is etree.Entity:
            raise PMLError(
                f"entity reference {child.text} is not supported (write the text itself)", source, child.sourceline
            )
        if isinstance(child.tag, str):
            out.append(("el", child, lines.start(child)))
        add_text(child.tail, lambda c=child: lines.tail(c))
    return out
