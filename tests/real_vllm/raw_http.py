"""A raw-socket HTTP/1.1 client: the only way to close a connection exactly when a test wants.

httpx does not close the socket of a cancelled non-streaming call promptly, so disconnect
tests talk to tether through a plain socket and close it themselves.
"""

from __future__ import annotations

import json
import socket
import struct
import time
from collections.abc import Iterator
from typing import Any


class RawExchange:
    """One request on its own connection; read as much of the answer as wanted, then close."""

    def __init__(
        self,
        port: int,
        path: str,
        payload: Any,
        headers: dict[str, str],
        timeout: float = 60.0,
        content_type: str | None = "application/json",
    ) -> None:
        body = json.dumps(payload).encode()
        lines = [f"POST {path} HTTP/1.1", "Host: 127.0.0.1"]
        if content_type is not None:  # None: a body without any Content-Type header
            lines.append(f"Content-Type: {content_type}")
        lines += [f"Content-Length: {len(body)}", "Connection: close"]
        lines += [f"{name}: {value}" for name, value in headers.items()]
        self._sock = socket.create_connection(("127.0.0.1", port), timeout=timeout)
        self._sock.sendall(("\r\n".join(lines) + "\r\n\r\n").encode() + body)
        self._buffer = b""
        self._body = bytearray()
        self._chunked = False
        self._eof = False
        self.status: int | None = None
        self.headers: dict[str, str] = {}
        self.closed_at: float | None = None

    def _recv(self) -> bool:
        data = self._sock.recv(65536)
        if not data:
            self._eof = True
            return False
        self._buffer += data
        return True

    def read_head(self) -> int:
        """Read the status line and headers; return the status."""
        while b"\r\n\r\n" not in self._buffer:
            if not self._recv():
                raise ConnectionError("connection closed before the response head")
        head, self._buffer = self._buffer.split(b"\r\n\r\n", 1)
        status_line, *header_lines = head.decode("latin-1").split("\r\n")
        self.status = int(status_line.split()[1])
        for line in header_lines:
            name, _, value = line.partition(":")
            self.headers[name.strip().lower()] = value.strip()
        self._chunked = "chunked" in self.headers.get("transfer-encoding", "").lower()
        return self.status

    def _pump(self) -> bool:
        """Move decoded body bytes from the socket into `_body`; False at the end of the body."""
        if not self._chunked:
            if self._buffer:
                self._body += self._buffer
                self._buffer = b""
                return True
            if self._eof:
                return False
            if not self._recv():
                return False
            return True
        while True:
            if b"\r\n" in self._buffer:
                size_line, rest = self._buffer.split(b"\r\n", 1)
                size = int(size_line.split(b";")[0], 16)
                if size == 0:
                    self._eof = True
                    return False
                if len(rest) >= size + 2:
                    self._body += rest[:size]
                    self._buffer = rest[size + 2 :]
                    return True
            if self._eof or not self._recv():
                return False

    def events(self) -> Iterator[str]:
        """Server-sent event payloads (the text after `data: `) as they arrive."""
        if self.status is None:
            self.read_head()
        while True:
            while b"\n\n" in self._body:
                raw, _, rest = bytes(self._body).partition(b"\n\n")
                self._body = bytearray(rest)
                for line in raw.decode().splitlines():
                    if line.startswith("data:"):
                        yield line[5:].strip()
            if not self._pump():
                return

    def events_ready(self) -> list[str]:
        """The events that already arrived (in the socket's receive buffer), without waiting:
        what a client that closes now has received."""
        timeout = self._sock.gettimeout()
        self._sock.setblocking(False)
        ready: list[str] = []
        try:
            for event in self.events():
                ready.append(event)
        except BlockingIOError:
            pass  # nothing more has arrived
        finally:
            self._sock.settimeout(timeout)
        return ready

    def chunks(self, count: int) -> list[dict[str, Any]]:
        """The next `count` JSON chunks of an SSE stream."""
        taken: list[dict[str, Any]] = []
        for event in self.events():
            if event == "[DONE]":
                break
            taken.append(json.loads(event))
            if len(taken) == count:
                break
        return taken

    def body(self) -> bytes:
        """The whole (remaining) response body."""
        if self.status is None:
            self.read_head()
        while self._pump():
            pass
        return bytes(self._body)

    def set_timeout(self, seconds: float) -> None:
        """Fail reads that wait longer than `seconds` (socket.timeout)."""
        self._sock.settimeout(seconds)

    def close(self) -> float:
        """Close the connection now; return the monotonic time of the close."""
        self.closed_at = time.monotonic()
        self._sock.close()
        return self.closed_at

    def reset(self) -> float:
        """Abort the connection with a TCP RST instead of a FIN; return the monotonic time."""
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        return self.close()

    def __enter__(self) -> RawExchange:
        return self

    def __exit__(self, *exc: object) -> None:
        self._sock.close()


def streams_side_by_side(
    port: int, path: str, payload: Any, headers: dict[str, str], opening: int
) -> list[list[str]]:
    """Two streams of `payload` at once (each has sent `opening` chunks before either is read
    on), read to `[DONE]`: for each, the X-Request-Id it was answered with, then every
    chunk's `id`."""
    exchanges = [RawExchange(port, path, payload, headers) for _ in range(2)]
    answers = []
    try:
        assert [exchange.read_head() for exchange in exchanges] == [200, 200]
        first = [exchange.chunks(opening) for exchange in exchanges]  # both running at once
        for exchange, opened in zip(exchanges, first, strict=True):
            rest = list(exchange.events())
            assert rest[-1] == "[DONE]"
            ids = [chunk["id"] for chunk in opened] + [json.loads(e)["id"] for e in rest[:-1]]
            answers.append([exchange.headers["x-request-id"], *ids])
    finally:
        for exchange in exchanges:
            exchange.close()
    return answers
