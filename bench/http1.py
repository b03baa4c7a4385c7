"""Just enough HTTP/1.1 for the fake engine and the load generator.

Both ends talk to nginx, tether and each other over keep-alive connections, so message
framing (Content-Length and chunked) must be exact; everything else is kept to the few
headers the benchmark reads.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


@dataclass(slots=True, frozen=True)
class Head:
    """A parsed request or status line and its headers (names lower-cased)."""

    start: tuple[bytes, ...]
    headers: dict[bytes, bytes]


def parse_head(raw: bytes) -> Head:
    """Parse the bytes before the blank line that ends a message head."""
    lines = raw.split(b"\r\n")
    headers: dict[bytes, bytes] = {}
    for line in lines[1:]:
        name, _, value = line.partition(b":")
        headers[name.strip().lower()] = value.strip()
    return Head(tuple(lines[0].split(b" ", 2)), headers)


class BodyDecoder(Protocol):
    """Incremental body framing: `feed` returns (payload, rest), rest is None until the end."""

    def feed(self, data: bytes) -> tuple[bytes, bytes | None]: ...


class LengthDecoder:
    """A body framed by Content-Length."""

    def __init__(self, length: int) -> None:
        self._remaining = length

    def feed(self, data: bytes) -> tuple[bytes, bytes | None]:
        if len(data) < self._remaining:
            self._remaining -= len(data)
            return data, None
        payload, rest = data[: self._remaining], data[self._remaining :]
        self._remaining = 0
        return payload, rest


class UntilCloseDecoder:
    """A response body with neither length nor chunking: it ends when the peer closes."""

    def feed(self, data: bytes) -> tuple[bytes, bytes | None]:
        return data, None


class ChunkedDecoder:
    """A chunked body; chunk boundaries chosen by a proxy may fall anywhere in an event."""

    def __init__(self) -> None:
        self._pending = b""
        self._remaining = 0
        self._need_crlf = False
        self._in_trailer = False

    def feed(self, data: bytes) -> tuple[bytes, bytes | None]:
        buf = self._pending + data if self._pending else data
        size = len(buf)
        parts: list[bytes] = []
        pos = 0
        while pos < size:
            if self._remaining:
                take = min(self._remaining, size - pos)
                parts.append(buf[pos : pos + take])
                pos += take
                self._remaining -= take
                self._need_crlf = not self._remaining
                continue
            if self._need_crlf:
                if size - pos < 2:
                    break
                pos += 2
                self._need_crlf = False
                continue
            eol = buf.find(b"\r\n", pos)
            if eol < 0:
                break
            if self._in_trailer:
                if eol == pos:
                    self._pending = b""
                    return b"".join(parts), buf[eol + 2 :]
                pos = eol + 2
                continue
            chunk_size = int(buf[pos:eol].split(b";", 1)[0], 16)
            pos = eol + 2
            if chunk_size:
                self._remaining = chunk_size
            else:
                self._in_trailer = True
        self._pending = buf[pos:]
        return b"".join(parts), None


def body_decoder(headers: dict[bytes, bytes], *, is_response: bool) -> BodyDecoder:
    """Choose the framing of the body that follows a head (RFC 9112, section 6.3)."""
    if b"chunked" in headers.get(b"transfer-encoding", b"").lower():
        return ChunkedDecoder()
    length = headers.get(b"content-length")
    if length is not None:
        return LengthDecoder(int(length))
    return UntilCloseDecoder() if is_response else LengthDecoder(0)


def chunk(payload: bytes) -> bytes:
    """Frame one chunk of a chunked body."""
    return b"%x\r\n%b\r\n" % (len(payload), payload)


LAST_CHUNK = b"0\r\n\r\n"
