"""Pure request-ID work: mint internal IDs, check client IDs, write IDs into request bodies
and map them back in response bytes. No I/O."""

from __future__ import annotations

import json
import os
import re
from json.decoder import scanstring  # type: ignore[attr-defined]
from typing import Any

from mypy_extensions import mypyc_attr

MAX_CLIENT_REQUEST_ID_LENGTH = 256
INTERNAL_REQUEST_ID_LENGTH = 32

_HEX_BYTES = frozenset(b"0123456789abcdef")
# Visible ASCII only: no spaces, no control characters (CR/LF header and log injection).
_VISIBLE_ASCII = frozenset(range(0x21, 0x7F))


class InvalidClientRequestId(ValueError):
    """The client's request ID cannot be used; the message says why."""


class IdMinter:
    """Mints internal IDs: 32 random hex characters each.

    Fixed length makes the IDs prefix-free (SGLang aborts every rid that *starts with* the one
    named), and hex never ends in `_<digit>` (SGLang's suffix for n>1 children). The bytes
    come from the OS's CSPRNG (a Responses API handle built from one must not be guessable),
    fetched for many IDs at once: one getrandom call per 256 requests instead of per request.
    """

    __slots__ = ("_hex", "_next")

    _BATCH = 256

    def __init__(self) -> None:
        self._hex = ""
        self._next = 0

    def mint(self) -> str:
        start = self._next
        if start >= len(self._hex):
            self._hex = os.urandom(self._BATCH * INTERNAL_REQUEST_ID_LENGTH // 2).hex()
            start = 0
        self._next = start + INTERNAL_REQUEST_ID_LENGTH
        return self._hex[start : start + INTERNAL_REQUEST_ID_LENGTH]


def check_client_request_id(value: str) -> str:
    """Return the client's ID if it is safe to log, echo and write into JSON, else raise."""
    if not value:
        raise InvalidClientRequestId("must not be empty")
    if len(value) > MAX_CLIENT_REQUEST_ID_LENGTH:
        raise InvalidClientRequestId(
            f"is {len(value)} characters long; the limit is {MAX_CLIENT_REQUEST_ID_LENGTH}"
        )
    if not all(ord(char) in _VISIBLE_ASCII for char in value):
        raise InvalidClientRequestId(
            "may only contain visible ASCII characters (no spaces or control characters)"
        )
    return value


class InvalidJsonBody(ValueError):
    """The body must be a JSON object for tether to write its ID into it."""


_JSON_WHITESPACE = re.compile(r"[ \t\n\r]*")
_DECODER = json.JSONDecoder()


class JsonObject:
    """A request body's top-level members, located in its text: any of them read as
    `json.loads` (FastAPI's parser) would, or some of them set, with every other byte as
    the client (or a router before it) sent it: a field tether does not own, a router's
    `kv_transfer_params` among them, passes through unchanged.

    The body may be in any encoding `json.loads` detects (UTF-8, -16, -32, a BOM); an edited
    body goes out as UTF-8. A name that appears twice counts as its last occurrence, as
    `json.loads` reads it; setting it sets every occurrence."""

    __slots__ = ("_body", "_document", "_located", "_text")

    def __init__(self, body: bytes) -> None:
        # A body that opens with its brace is UTF-8 (UTF-16 and -32 would put a NUL next to
        # it, a BOM before it): the common case, read without asking which encoding it is.
        utf8 = body[:1] == b"{" and body[1:2] != b"\x00"
        try:
            text = body.decode("utf-8" if utf8 else json.detect_encoding(body))
        except UnicodeDecodeError as exc:
            raise InvalidJsonBody(f"the request body is not valid JSON: {exc}") from None
        self._text = text.removeprefix("\ufeff")
        # Members added in front of the others go straight into the bytes of such a body.
        self._body = body if utf8 else None
        # Read whole by the C parser (a dict keeps a name's last occurrence, as json.loads
        # does); where each member is written is found only when one that exists is edited.
        try:
            document = _DECODER.decode(self._text)
        except ValueError as exc:
            raise InvalidJsonBody(f"the request body is not valid JSON: {exc}") from None
        if not isinstance(document, dict):
            raise InvalidJsonBody("the request body must be a JSON object")
        self._document: dict[str, Any] = document
        self._located: list[tuple[str, int, int]] | None = None

    def __contains__(self, name: str) -> bool:
        return name in self._document

    def get(self, name: str, default: Any = None) -> Any:
        """The member's value (its last occurrence), decoded; `default` when absent."""
        return self._document.get(name, default)

    def raw(self, name: str) -> str | None:
        """The member's value as it is written (its last occurrence), or None."""
        if name not in self._document:
            return None
        for member, start, end in reversed(self._members()):
            if member == name:
                return self._text[start:end]
        return None  # unreachable: the parser and the scan agree on the names

    def _members(self) -> list[tuple[str, int, int]]:
        if self._located is None:
            self._located = _members(self._text)
        return self._located

    def with_members(self, values: dict[str, Any]) -> bytes:
        """The body with these members set (a dotted name sets a member of an object
        member, which becomes an object if it is not one), every other byte as it was."""
        nested: dict[str, dict[str, Any]] = {}
        direct: dict[str, str] = {}
        for name, value in values.items():
            outer, _, inner = name.partition(".")
            if inner:
                nested.setdefault(outer, {})[inner] = value
            else:
                direct[name] = _encoded(value)
        for outer, inner_values in nested.items():
            current = self.raw(outer)
            try:
                inner_object = JsonObject(current.encode()) if current is not None else None
            except InvalidJsonBody:
                inner_object = None
            direct[outer] = (
                inner_object.with_members(inner_values).decode()
                if inner_object is not None
                else _encoded(_unflattened(inner_values))
            )
        return self._edited(direct)

    def _edited(self, encoded: dict[str, str]) -> bytes:
        missing = [name for name in encoded if name not in self]
        inserted = ",".join(f"{_encoded(name)}:{encoded[name]}" for name in missing)
        separator = "," if self._document else ""
        if missing and self._body is not None and len(missing) == len(encoded):
            return b"{" + (inserted + separator).encode() + self._body[1:]
        text, pieces, at = self._text, [], 0
        opening = text.index("{") + 1
        if missing:
            pieces += [text[:opening], inserted, separator]
            at = opening
        if len(missing) < len(encoded):  # some are there already: set where they are written
            for name, start, end in self._members():
                if name in encoded and name not in missing:
                    pieces += [text[at:start], encoded[name]]
                    at = end
        pieces.append(text[at:])
        return "".join(pieces).encode()


def _members(text: str) -> list[tuple[str, int, int]]:
    """(name, value start, value end) of each member of `text`, a JSON object the parser
    has read already."""
    members: list[tuple[str, int, int]] = []
    at = _skip(text, text.index("{") + 1)
    while text[at] != "}":
        name, at = scanstring(text, _skip(text, at) + 1)
        start = _skip(text, _skip(text, at) + 1)  # past the colon
        _, end = _DECODER.raw_decode(text, start)
        members.append((name, start, end))
        at = _skip(text, end)
        if text[at] == ",":
            at = _skip(text, at + 1)
    return members


def _skip(text: str, at: int) -> int:
    return _JSON_WHITESPACE.match(text, at).end()  # type: ignore[union-attr]


# A subclass of str: a Python class even where this module is compiled (mypyc's own classes
# cannot derive from str).
@mypyc_attr(native_class=False)
class RawJson(str):
    """A member's value already written as JSON (a constant tether sets on many requests)."""


_ENCODER = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"))


def _encoded(value: Any) -> str:
    return value if isinstance(value, RawJson) else _ENCODER.encode(value)


def _unflattened(values: dict[str, Any]) -> dict[str, Any]:
    result: dict[str, Any] = {}
    for name, value in values.items():
        *outer, last = name.split(".")
        holder = result
        for key in outer:
            holder = holder.setdefault(key, {})
        holder[last] = value
    return result


def json_escaped(value: str) -> bytes:
    """`value` as it must appear inside a JSON string (quotes and backslashes escaped)."""
    return json.dumps(value, ensure_ascii=True)[1:-1].encode()


class IdMapper:
    """Replaces the internal ID with the client's ID in a byte stream, chunk by chunk.

    An occurrence split across two chunks is still replaced: the end of a chunk that could be
    the start of the internal ID is held back until the next chunk (or `flush`) shows whether
    it is. Nothing else is held back, so SSE events ending in a blank line pass at once.
    """

    __slots__ = ("_held", "_needle", "_needle_bytes", "_replacement")

    def __init__(self, internal_request_id: str, replacement: bytes) -> None:
        self._needle = internal_request_id.encode()
        # tether's own IDs are hex: one shared set instead of one per stream.
        needle_bytes = frozenset(self._needle)
        self._needle_bytes = _HEX_BYTES if needle_bytes <= _HEX_BYTES else needle_bytes
        self._replacement = replacement
        self._held = b""

    def feed(self, chunk: bytes) -> bytes:
        if not self._held and chunk and chunk[-1] not in self._needle_bytes:
            # The common chunk (an SSE event ends in a newline): nothing held, nothing to
            # hold back, one scan.
            return chunk.replace(self._needle, self._replacement)
        data = self._held + chunk if self._held else chunk
        if not data:
            return data
        needle = self._needle
        last = data.rfind(needle)
        tail_start = 0 if last < 0 else last + len(needle)
        # A held-back end must end in a byte of the ID.
        keep = (
            _partial_match_at_end(data, needle, tail_start) if data[-1] in self._needle_bytes else 0
        )
        if keep:
            self._held = data[-keep:]
            data = data[:-keep]
        else:
            self._held = b""
        if last < 0:
            return data
        return data.replace(needle, self._replacement)

    def flush(self) -> bytes:
        held, self._held = self._held, b""
        return held


def _partial_match_at_end(data: bytes, needle: bytes, start: int) -> int:
    """Length of the longest end of `data[start:]` that is a proper prefix of `needle`."""
    first = needle[0]
    begin = max(start, len(data) - len(needle) + 1)
    index = data.find(first, begin)
    while index >= 0:
        if needle.startswith(data[index:]):
            return len(data) - index
        index = data.find(first, index + 1)
    return 0
