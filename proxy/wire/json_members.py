"""Pure: a JSON request body's top-level members, found in its bytes and set one by one, with
every other byte as the client sent it. No I/O.

tether reads a few members of a body (`model`, `stream`, its ID field, how many prompts a
list holds) and sets one or two. Decoding the whole document for that costs what the client
chooses: 30 MiB of `{},` decodes into about 800 MiB of Python objects and holds the event
loop for a second or more. So a body larger than `DECODED_WHOLE` is scanned instead: member
names compared as written, values skipped without being built (strings by `find`, arrays
and objects by the depth of their brackets), and only the members tether reads decoded,
each from its own bytes. The scan's work is bounded too: a body of more than `MAX_TOKENS`
strings, arrays and objects is refused (`JsonBodyTooComplex`) before it can hold the loop
for long. A smaller body is decoded whole, which costs little whatever it holds.

The scan reads every document `json.loads` (FastAPI's parser) reads as `json.loads` reads
it: the encodings it detects (UTF-8, -16, -32, a BOM), names spelled with `\\u` escapes,
a name written twice counting as its last occurrence, NaN and Infinity, whitespace anywhere.
It checks the body's encoding, the object's own structure, every byte outside strings and
each member it decodes; inside a member it skips it checks only that strings end and
brackets balance, and leaves the rest to the engine's parser, which rejects what is not JSON.

One module, longer than most: the scanner, the member reader and the member setter share one
grammar and one notion of where a member starts and ends; split, they could drift apart, and
a body read one way and rewritten another is a smuggling bug.
"""

from __future__ import annotations

import codecs
import json
import json.encoder
import json.scanner
import re
import string
from collections.abc import Collection
from typing import Any, Final

from mypy_extensions import mypyc_attr

# The most strings, arrays and objects tether walks in one body. Real requests hold far fewer
# (a long agent conversation with its tool schemas: tens of thousands; a batch of 10,000
# prompts: 10,000): only a body built to cost reaches it, such as 3 MiB of `{},`.
MAX_TOKENS: Final = 1_000_000
# The most members of an object whose members tether locates (a scanned body, its
# `stream_options`): a request has a few dozen; each costs more to read than a token to skip.
MAX_MEMBERS: Final = 16_384


class InvalidJsonBody(ValueError):
    """The body must be a JSON object for tether to write its ID into it."""


class JsonBodyTooComplex(ValueError):
    """The body holds more strings, arrays and objects than tether walks (`MAX_TOKENS`), or
    an object tether reads has more members than `MAX_MEMBERS`."""


_QUOTE: Final = 0x22
_BACKSLASH: Final = 0x5C
_COMMA: Final = 0x2C
_COLON: Final = 0x3A
_OPEN_OBJECT: Final = 0x7B
_CLOSE_OBJECT: Final = 0x7D
_OPEN_ARRAY: Final = 0x5B

# What a byte outside a string is. The first three are the bytes between tokens.
_SCALAR: Final = 0  # a byte of a number or of true, false, null, NaN, Infinity
_SPACE: Final = 1
_SEPARATOR: Final = 2  # comma or colon
_STRING: Final = 3
_OPENING: Final = 4
_CLOSING: Final = 5
_INVALID: Final = 6

_SCALAR_BYTES: Final = ("+-." + string.digits + string.ascii_letters).encode()
_SPACE_BYTES: Final = b" \t\n\r"


def _byte_classes() -> bytes:
    classes = bytearray([_INVALID]) * 256
    for byte in _SCALAR_BYTES:
        classes[byte] = _SCALAR
    for byte in _SPACE_BYTES:
        classes[byte] = _SPACE
    classes[_COMMA] = classes[_COLON] = _SEPARATOR
    classes[_QUOTE] = _STRING
    classes[_OPEN_OBJECT] = classes[_OPEN_ARRAY] = _OPENING
    classes[_CLOSE_OBJECT] = classes[ord("]")] = _CLOSING
    return bytes(classes)


_CLASSES: Final = _byte_classes()


def _run_of(members: bytes) -> re.Pattern[bytes]:
    return re.compile(b"[" + re.escape(members) + b"]*")


# Runs longer than `_SHORT` bytes go to the C code of `re` and `bytes.find`; shorter ones (a
# comma, a short number, a member's name) are stepped through byte by byte, which is faster
# compiled than calling out.
_SHORT: Final = 8
_FLAT_RUN: Final = _run_of(_SCALAR_BYTES + _SPACE_BYTES + b",:")
_SCALAR_RUN: Final = _run_of(_SCALAR_BYTES)
_SPACE_RUN: Final = _run_of(_SPACE_BYTES)
# Strings with escaped quotes are searched for their end a window at a time.
_FIRST_WINDOW: Final = 4096
_LARGEST_WINDOW: Final = 1 << 20
# The body's UTF-8 is checked a piece at a time (decoded, never kept).
_UTF8_PIECE: Final = 1 << 20

_DECODER: Final = json.JSONDecoder()
# json's C scanner, called straight for a value (its decoder wraps it in Python calls).
_SCAN: Final = json.scanner.make_scanner(_DECODER)  # type: ignore[arg-type]
_ENCODER: Final = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"))
_QUOTED: Final = json.encoder.encode_basestring
# Bodies up to this size are decoded whole by json's C decoder, as fast as scanning them
# compiled and several times faster in pure Python; whatever they hold, that costs at most
# about 7 MiB for a moment and 10 ms (256 KiB of `[]`). Larger ones are scanned.
DECODED_WHOLE: Final = 256 * 1024


def _invalid(problem: str) -> InvalidJsonBody:
    return InvalidJsonBody(f"the request body is not valid JSON: {problem}")


class _Tokens:
    """What is left of one walk through a body: each string, array and object spends one."""

    def __init__(self) -> None:
        self.left = MAX_TOKENS

    def spend(self) -> None:
        self.left -= 1
        if self.left < 0:
            raise JsonBodyTooComplex(
                f"the JSON body holds more than {MAX_TOKENS} strings, arrays and objects"
            )


def _space_end(text: bytes, at: int) -> int:
    """Past the JSON whitespace that starts at `at`."""
    size = len(text)
    stop = min(at + _SHORT, size)
    i = at
    while i < stop and _CLASSES[text[i]] == _SPACE:
        i += 1
    if i == stop and i < size and _CLASSES[text[i]] == _SPACE:
        return _SPACE_RUN.match(text, i).end()  # type: ignore[union-attr]
    return i


def _scalar_end(text: bytes, at: int) -> int:
    """Past the number or literal (`true`, `NaN`, ...) that starts at `at`."""
    size = len(text)
    stop = min(at + _SHORT, size)
    i = at
    while i < stop and _CLASSES[text[i]] == _SCALAR:
        i += 1
    if i == stop and i < size and _CLASSES[text[i]] == _SCALAR:
        return _SCALAR_RUN.match(text, i).end()  # type: ignore[union-attr]
    return i


def _string_end(text: bytes, at: int) -> int:
    """Past the closing quote of the string whose first character is at `at`."""
    size = len(text)
    stop = min(at + _SHORT, size)
    i = at
    while i < stop:
        byte = text[i]
        if byte == _QUOTE:
            return i + 1
        i += 2 if byte == _BACKSLASH else 1
    if i >= size:
        raise _invalid("a string does not end")
    # A longer string: its first quote ends it, unless a backslash escapes that quote.
    quote = text.find(b'"', i)
    if quote < 0:
        raise _invalid("a string does not end")
    if text[quote - 1] != _BACKSLASH:
        return quote + 1
    return _escaped_string_end(text, i)


def _escaped_string_end(text: bytes, at: int) -> int:
    """Past the closing quote of a string with backslashes in it, from `at`, a position
    between two of its characters (never inside an escape): a window at a time, with each
    escaped backslash and then each escaped quote blanked out (pairs taken from the left, as
    the parser takes them), so that the first quote left ends the string."""
    size = len(text)
    width = _FIRST_WINDOW
    while at < size:
        end = min(at + width, size)
        window = text[at:end].replace(b"\\\\", b"__").replace(b'\\"', b"__")
        quote = window.find(b'"')
        if quote >= 0:
            return at + quote + 1
        # A backslash left at the window's end escapes the first character of the next.
        at = end - 1 if window.endswith(b"\\") and end < size else end
        width = min(width * 2, _LARGEST_WINDOW)
    raise _invalid("a string does not end")


def _container_end(text: bytes, at: int, tokens: _Tokens) -> tuple[int, int]:
    """Past the array or object that opens at `at`, and how many items (or members) it holds
    itself, not counting those of arrays and objects inside it. Nothing in it is built: its
    brackets are matched by depth alone, its strings skipped."""
    tokens.spend()
    size = len(text)
    inside = _space_end(text, at + 1)
    if inside < size and _CLASSES[text[inside]] == _CLOSING:
        return inside + 1, 0
    depth = 1
    commas = 0
    run = 0
    i = inside
    while i < size:
        byte = text[i]
        kind = _CLASSES[byte]
        if kind <= _SEPARATOR:
            if run < _SHORT:
                if byte == _COMMA and depth == 1:
                    commas += 1
                run += 1
                i += 1
                continue
            end = _FLAT_RUN.match(text, i).end()  # type: ignore[union-attr]
            if depth == 1:
                commas += text.count(b",", i, end)
            i = end
        elif kind == _STRING:
            tokens.spend()
            i = _string_end(text, i + 1)
        elif kind == _OPENING:
            tokens.spend()
            depth += 1
            i += 1
        elif kind == _CLOSING:
            depth -= 1
            i += 1
            if depth == 0:
                return i, commas + 1
        else:
            raise _invalid(f"byte {byte:#04x} outside a string")
        run = 0
    raise _invalid("an array or object does not end")


def _value_end(text: bytes, at: int, tokens: _Tokens) -> int:
    """Past the value that starts at `at`."""
    kind = _CLASSES[text[at]] if at < len(text) else _INVALID
    if kind == _STRING:
        tokens.spend()
        return _string_end(text, at + 1)
    if kind == _OPENING:
        end, _ = _container_end(text, at, tokens)
        return end
    end = _scalar_end(text, at) if kind == _SCALAR else at
    if end == at:
        raise _invalid("a member has no value")
    return end


def _decoded(text: bytes, start: int, end: int) -> Any:
    """The value written at `text[start:end]` (a string, number or literal), decoded by
    `json.loads`' own scanner: only as many bytes as the value has."""
    written = text[start:end].decode("utf-8", "surrogatepass")
    try:
        value, stop = _SCAN(written, 0)
    except StopIteration:  # not a value at all (`tru`)
        raise _invalid("a member's value is not a JSON value") from None
    except ValueError as exc:  # a bad escape, a number too long to read
        raise _invalid(str(exc)) from None
    if stop != len(written):  # `01`, `1.`: the scanner read less than the scan found
        raise _invalid("a member's value is not a JSON value")
    return value


class _MemberWalk:
    """The members of the object that opens at `start`, one per `next()`: where each value
    is written (and how many items it holds, where it is an array or object), and its name
    where it is one of `names` (as `json.loads` decodes names). With `small`, the same text
    as a str (ASCII, so that its indices are the bytes'), whose values json's C scanner
    skips: faster than the walk, and bounded, since the whole body is small."""

    def __init__(
        self, text: bytes, start: int, names: Collection[str], small: str | None = None
    ) -> None:
        self._text = text
        self._small = small
        self._spelled = {name.encode("utf-8", "surrogatepass"): name for name in names}
        self.names = frozenset(names)
        self._tokens = _Tokens()
        self._tokens.spend()  # the object itself
        self.name: str | None = None
        self.value_start = 0
        self.value_end = 0
        self.items = 0
        self.count = 0
        self._at = _space_end(text, start + 1)
        self._done = self._at < len(text) and text[self._at] == _CLOSE_OBJECT
        self.end = self._at + 1  # past the closing brace, once `next()` has said False

    def next(self) -> bool:
        """Move on to the next member; False past the last one."""
        if self._done:
            return False
        text = self._text
        size = len(text)
        at = self._at
        if at >= size or text[at] != _QUOTE:
            raise _invalid("expected a member's name")
        self._tokens.spend()
        name_end = _string_end(text, at + 1)
        self.name = self._known_name(at, name_end)
        at = _space_end(text, name_end)
        if at >= size or text[at] != _COLON:
            raise _invalid("expected a colon after a member's name")
        self.value_start = at = _space_end(text, at + 1)
        small = self._small
        if small is not None:
            _, at = _SCAN(small, at)  # the value was decoded before: it is JSON
            self.items = 0  # not counted
        elif at < size and _CLASSES[text[at]] == _OPENING:
            at, self.items = _container_end(text, at, self._tokens)
        else:
            at, self.items = _value_end(text, at, self._tokens), 0
        self.value_end = at
        self.count += 1
        if self.count > MAX_MEMBERS:
            raise JsonBodyTooComplex(f"an object in the JSON body has over {MAX_MEMBERS} members")
        at = _space_end(text, at)
        byte = text[at] if at < size else -1
        if byte == _COMMA:
            self._at = _space_end(text, at + 1)
        elif byte == _CLOSE_OBJECT:
            self._done = True
            self.end = at + 1
        else:
            raise _invalid("expected a comma or the end of an object after a member")
        return True

    def _known_name(self, start: int, end: int) -> str | None:
        spelled = self._text[start + 1 : end - 1]
        name = self._spelled.get(spelled)
        if name is not None or b"\\" not in spelled:
            return name
        # Written with escapes (`"\u0072id"`): decoded as the parser decodes it.
        decoded = _decoded(self._text, start, end)
        return decoded if decoded in self.names else None


def _utf8(body: bytes, check: bool) -> bytes:
    """The body as UTF-8, decoded as `json.loads` decodes bytes: in the encoding its first
    bytes say, surrogates let through; with `check`, its UTF-8 checked here."""
    # A body that opens with its brace is UTF-8 (UTF-16 and -32 would put a NUL next to it, a
    # BOM before it): the common case, read without asking which encoding it is.
    utf8 = body[:1] == b"{" and body[1:2] != b"\x00"
    encoding = "utf-8" if utf8 else json.detect_encoding(body)
    try:
        if encoding == "utf-8" or encoding == "utf-8-sig":
            text = body if encoding == "utf-8" else body[3:]
            if check and not text.isascii():
                _check_utf8(text)
            return text
        return body.decode(encoding, "surrogatepass").encode("utf-8", "surrogatepass")
    except UnicodeError as exc:
        raise _invalid(str(exc)) from None


def _check_utf8(text: bytes) -> None:
    """Raise UnicodeDecodeError where `text` is not UTF-8, holding one piece decoded at most."""
    decoder = codecs.getincrementaldecoder("utf-8")("surrogatepass")
    view = memoryview(text)
    for start in range(0, len(text), _UTF8_PIECE):
        decoder.decode(view[start : start + _UTF8_PIECE])
    decoder.decode(b"", True)


def _text(text: bytes) -> str:
    try:
        return text.decode("utf-8", "surrogatepass")
    except UnicodeDecodeError as exc:
        raise _invalid(str(exc)) from None


def _decoded_whole(text: str) -> dict[str, Any] | None:
    """The object `text` holds, decoded whole by `json.loads`' decoder; None where it nests
    deeper than that decoder can follow (its members are then located instead)."""
    try:
        document = _DECODER.decode(text)
    except RecursionError:
        return None
    except ValueError as exc:  # not JSON
        raise _invalid(str(exc)) from None
    assert isinstance(document, dict)  # it opens with a brace
    return document


_KIND_BY_FIRST_BYTE: Final = {_OPEN_OBJECT: "object", _OPEN_ARRAY: "array", _QUOTE: "string"}


def _kind(value: Any) -> str:
    """The JSON type of a value as `json.loads` gives it."""
    if isinstance(value, dict):
        return "object"
    if isinstance(value, list):
        return "array"
    if isinstance(value, str):
        return "string"
    if value is None:
        return "null"
    return "boolean" if isinstance(value, bool) else "number"


class JsonArray:
    """An array member, counted without being built: how many items it holds, and its first
    item decoded where that is a number, true, false or null (else None)."""

    def __init__(self, length: int, first: Any) -> None:
        self.length = length
        self.first = first


class JsonMembers:
    """An object's members, those named when it is read, each read as `json.loads` reads it: a
    name written twice counts as its last occurrence. Either the object was decoded whole (a
    small body: cheap whatever it holds), or its members were located in its text and only
    those read are decoded, each from its own bytes."""

    _names: Collection[str]  # as given: a few names, looked through for each read
    _document: dict[str, Any] | None  # decoded whole, or None: located in `_text`
    _text: bytes
    _small: str | None  # decoded whole and ASCII: `_text` as a str, for `_MemberWalk`
    _start: int  # the opening brace in `_text`
    _end: int  # past the closing brace (located)
    _empty: bool
    # Located: where each name's last occurrence's value is written, and how many items it
    # holds (an array or object).
    _last: dict[str, tuple[int, int, int]]

    def __init__(
        self,
        names: Collection[str],
        document: dict[str, Any] | None = None,
        text: bytes = b"",
        start: int = 0,
        small: str | None = None,
    ) -> None:
        self._names = names
        self._document = document
        self._text = text
        self._small = small
        self._start = self._end = start
        self._empty = not document
        self._last = {}
        if document is None:
            self._locate()

    def _locate(self) -> None:
        walk = _MemberWalk(self._text, self._start, self._names)
        last: dict[str, tuple[int, int, int]] = {}
        while walk.next():
            if walk.name is not None:
                last[walk.name] = (walk.value_start, walk.value_end, walk.items)
        self._last, self._end, self._empty = last, walk.end, walk.count == 0

    def __contains__(self, name: str) -> bool:
        return self._has(name)

    def _has(self, name: str) -> bool:
        if name not in self._names:
            raise KeyError(f"{name!r} is not among the members read")
        document = self._document
        return name in (document if document is not None else self._last)

    def kind(self, name: str) -> str | None:
        """The member's JSON type: object, array, string, number, boolean or null; None
        where it is absent."""
        if not self._has(name):
            return None
        document = self._document
        if document is not None:
            return _kind(document[name])
        start, end, _ = self._last[name]
        kind = _KIND_BY_FIRST_BYTE.get(self._text[start])  # objects, arrays, strings: not decoded
        return kind if kind is not None else _kind(_decoded(self._text, start, end))

    def scalar(self, name: str) -> Any:
        """The member's value decoded, where it is a string, number, true, false or null;
        None where it is absent, an array or an object (never decoded)."""
        if not self._has(name):
            return None
        document = self._document
        if document is not None:
            value = document[name]
            return None if isinstance(value, dict) or isinstance(value, list) else value
        start, end, _ = self._last[name]
        if _CLASSES[self._text[start]] == _OPENING:
            return None
        return _decoded(self._text, start, end)

    def truthy(self, name: str) -> bool:
        """Whether the member's value, as `json.loads` gives it, is true to Python: a
        non-empty string, array or object, a number other than zero, true."""
        if not self._has(name):
            return False
        document = self._document
        if document is not None:
            return bool(document[name])
        start, end, items = self._last[name]
        first = self._text[start]
        if _CLASSES[first] == _OPENING:
            return items > 0
        if first == _QUOTE:
            return end - start > 2
        return bool(_decoded(self._text, start, end))

    def object(self, name: str, names: Collection[str]) -> JsonMembers | None:
        """The member's value where it is an object, with its members `names` read; None
        where it is absent or not an object."""
        if not self._has(name):
            return None
        document = self._document
        if document is not None:
            value = document[name]
            return JsonMembers(names, value) if isinstance(value, dict) else None
        start = self._last[name][0]
        if self._text[start] != _OPEN_OBJECT:
            return None
        return JsonMembers(names, None, self._text, start)

    def array(self, name: str) -> JsonArray | None:
        """The member's value where it is an array, counted; None where it is absent or not
        an array."""
        if not self._has(name):
            return None
        document = self._document
        if document is not None:
            value = document[name]
            if not isinstance(value, list):
                return None
            first = value[0] if value else None
            scalar = not isinstance(first, dict | list | str)
            return JsonArray(len(value), first if scalar else None)
        text = self._text
        start, _, items = self._last[name]
        if text[start] != _OPEN_ARRAY:
            return None
        first = _space_end(text, start + 1)
        item = None
        if _CLASSES[text[first]] == _SCALAR:
            item = _decoded(text, first, _scalar_end(text, first))
        return JsonArray(items, item)


class JsonObject(JsonMembers):
    """A JSON request body's members: those named when it is read, each read as
    `json.loads` would read it, or set, with every other byte as the client (or a router
    before it) sent it: a field tether does not own, a router's `kv_transfer_params` among
    them, passes through unchanged.

    The body may be in any encoding `json.loads` detects (UTF-8, -16, -32, a BOM); an edited
    body goes out as UTF-8. A name that appears twice counts as its last occurrence, as
    `json.loads` reads it; setting it sets every occurrence. A body up to `DECODED_WHOLE`
    bytes is decoded whole (and so checked whole); a larger one is scanned."""

    def __init__(self, body: bytes, names: Collection[str]) -> None:
        """Read `body`, with its members `names` (the only ones it can then read or set).
        Raises InvalidJsonBody, or JsonBodyTooComplex."""
        whole = len(body) <= DECODED_WHOLE
        text = _utf8(body, check=not whole)
        start = _space_end(text, 0)
        if start >= len(text) or text[start] != _OPEN_OBJECT:
            raise InvalidJsonBody("the request body must be a JSON object")
        document, small = None, None
        if whole:
            decoded = _text(text)
            document = _decoded_whole(decoded)
            if document is not None and len(decoded) == len(text):
                small = decoded  # ASCII: its indices are the bytes', `_MemberWalk` can use it
        super().__init__(names, document, text, start, small)
        if document is None and _space_end(text, self._end) != len(text):
            raise _invalid("data after the object")

    def with_members(self, values: dict[str, Any]) -> bytes:
        """The body with these members set (a dotted name sets a member of an object member,
        which becomes an object if it is not one), every other byte as it was. Members that
        are missing go in right after the opening brace."""
        return _with_members(self, values, 0, len(self._text))


def _with_members(members: JsonMembers, values: dict[str, Any], start: int, end: int) -> bytes:
    """`members`' text from `start` to `end`, with `values` set in the object it holds."""
    # What each member becomes: its value written (a name set itself), or the members to
    # set in it (a dotted name; these win over the member itself).
    written: dict[str, str] = {}
    nested: dict[str, dict[str, Any]] = {}
    for name, value in values.items():
        outer, dot, inner = name.partition(".")
        if dot:
            nested.setdefault(outer, {})[inner] = value
        else:
            written[name] = _written(value)
    for outer in nested:
        written.pop(outer, None)
    inserted: list[str] = []
    present: list[str] = []
    for name in [*written, *nested]:
        if members._has(name):
            present.append(name)
            continue
        inserted.append(_QUOTED(name))
        inserted.append(":")
        inserted.append(written[name] if name in written else _written(_unflattened(nested[name])))
        inserted.append(",")
    if inserted and members._empty:
        inserted.pop()  # no member follows
    added = "".join(inserted).encode("utf-8", "surrogatepass")
    text = members._text
    opening = members._start + 1
    if not present:  # nothing to replace (the common case)
        if end - start <= DECODED_WHOLE:
            return text[start:opening] + added + text[opening:end]
        return b"".join((text[start:opening], added, memoryview(text)[opening:end]))  # one copy
    view = memoryview(text)
    edited = bytearray(view[start:opening])
    edited += added
    at = opening
    walk = _MemberWalk(text, members._start, present, members._small)
    while walk.next():
        member = walk.name
        if member is None:
            continue
        edited += view[at : walk.value_start]
        if member in written:
            edited += written[member].encode("utf-8", "surrogatepass")
        elif text[walk.value_start] == _OPEN_OBJECT:
            held = [name.partition(".")[0] for name in nested[member]]
            value = JsonMembers(held, None, text, walk.value_start, members._small)
            edited += _with_members(value, nested[member], walk.value_start, walk.value_end)
        else:
            edited += _written(_unflattened(nested[member])).encode("utf-8", "surrogatepass")
        at = walk.value_end
    edited += view[at:end]
    return bytes(edited)


# A subclass of str: a Python class even where this module is compiled (mypyc's own classes
# cannot derive from str).
@mypyc_attr(native_class=False)
class RawJson(str):
    """A member's value already written as JSON (a constant tether sets on many requests)."""


def _written(value: Any) -> str:
    """`value` written as JSON."""
    if isinstance(value, RawJson):
        return value
    if isinstance(value, str):
        return _QUOTED(value)  # json's C encoder for strings, with no Python call around it
    return _ENCODER.encode(value)


def _unflattened(values: dict[str, Any]) -> dict[str, Any]:
    result: dict[str, Any] = {}
    for name, value in values.items():
        *outer, last = name.split(".")
        holder = result
        for key in outer:
            holder = holder.setdefault(key, {})
        holder[last] = value
    return result
