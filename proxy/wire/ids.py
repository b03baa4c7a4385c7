"""Pure request-ID work: mint internal IDs, check client IDs and map IDs back in response
bytes. No I/O. (Writing IDs into request bodies: `json_members`.)"""

from __future__ import annotations

import json
import os

MAX_CLIENT_REQUEST_ID_LENGTH = 256
INTERNAL_REQUEST_ID_LENGTH = 32

_HEX_DIGITS = b"0123456789abcdef"
_HEX_BYTES = frozenset(_HEX_DIGITS)
# Visible ASCII only: no spaces, no control characters (CR/LF header and log injection).


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
    # Visible ASCII is printable ASCII but the space: three scans in C, not one step a character.
    if not (value.isascii() and value.isprintable()) or " " in value:
        raise InvalidClientRequestId(
            "may only contain visible ASCII characters (no spaces or control characters)"
        )
    return value


def json_escaped(value: str) -> bytes:
    """`value` as it must appear inside a JSON string (quotes and backslashes escaped)."""
    if value.isascii() and value.isprintable() and '"' not in value and "\\" not in value:
        # What json.dumps leaves as it is (printable ASCII but the two it escapes): the
        # common client ID, once per request, without the encoder's call.
        return value.encode()
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
        # tether's own IDs are hex: one shared set instead of one per stream (and the test
        # for it in C: nothing left once the hex digits are deleted).
        hex_only = not self._needle.translate(None, _HEX_DIGITS)
        self._needle_bytes = _HEX_BYTES if hex_only else frozenset(self._needle)
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


class MintedIdMapper(IdMapper):
    """Replaces an ID the engine minted itself (llama.cpp's `chatcmpl-<32 random
    alphanumerics>`, the same in every event of a response) with the client's, chunk by
    chunk: the engine's ID is learnt from the first `"id":"<prefix>` of the response, and
    the bytes up to its end are held until then (a stream's first event carries it).

    Inside a JSON string every quote is escaped, so `"id":"` followed by the prefix only
    appears as a member's name and value. A response with no such ID in its first event, or
    in its first 64 KiB (an error, another format), passes as it came."""

    __slots__ = ("_learning", "_marker", "_seen")

    _MAX_SEEN = 64 * 1024

    def __init__(self, prefix: str, replacement: bytes) -> None:
        # The prefix stands in as the needle until the engine's ID is known.
        super().__init__(prefix, replacement)
        self._marker = b'"id":"' + prefix.encode()
        self._learning = True
        self._seen = b""

    def feed(self, chunk: bytes) -> bytes:
        if not self._learning:
            return super().feed(chunk) if self._needle else chunk
        data = self._seen + chunk if self._seen else chunk
        at = data.find(self._marker)
        end = data.find(b'"', at + len(self._marker)) if at >= 0 else -1
        if end >= 0:
            self._learn(data[at + len(self._marker) : end])
        elif (at < 0 and data.find(b"\n\n") >= 0) or len(data) > self._MAX_SEEN:
            # A whole event without it (a stream's first carries it), or too much: none.
            self._learning = False
            self._needle = b""
        else:
            self._seen = data
            return b""
        self._seen = b""
        return super().feed(data) if self._needle else data

    def flush(self) -> bytes:
        if self._learning:
            held, self._seen = self._seen, b""
            return held
        return super().flush() if self._needle else b""

    def _learn(self, minted: bytes) -> None:
        """The engine's own characters after the prefix: replaced by the client's ID."""
        self._learning = False
        self._needle = minted
        self._needle_bytes = frozenset(minted) if minted else _HEX_BYTES
