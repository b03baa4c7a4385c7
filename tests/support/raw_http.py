"""HTTP/1.1 on a bare socket: the test decides exactly what is sent, when, and how the client
leaves (FIN, RST, half-close). Client libraries do not close when told (httpx keeps the socket
of a cancelled non-streaming call open a while), so every test that times a client's leaving
talks through one of these two:

- `RawClient`: asyncio, for the in-process suite (tether, engine and client in one event loop);
  every read bounded by a timeout.
- `RawExchange`: blocking, one request on its own connection, for the real-engine suites
  (their clients run in threads); read as much of the answer as wanted, then close.

Both write heads with `request_head` and read them with `parse_head`.
"""

from __future__ import annotations

import asyncio
import json
import socket
import struct
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from multidict import CIMultiDict

READ_TIMEOUT = 5.0


@dataclass
class Reply:
    """One HTTP response as the client received it (body de-chunked)."""

    version: str
    status: int
    headers: CIMultiDict[str]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


def request_head(
    path: str = "/v1/chat/completions",
    *,
    method: str = "POST",
    version: str = "HTTP/1.1",
    headers: Sequence[tuple[str, str]] = (),
    host: str = "tether",
) -> bytes:
    """A request head, byte for byte: request line, `Host`, `headers` in order, blank line."""
    lines = [f"{method} {path} {version}", f"Host: {host}", *(f"{n}: {v}" for n, v in headers)]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def request_with_header_bytes(
    path: str, name: str, value: bytes, method: str = "POST", body: bytes = b""
) -> bytes:
    """A whole request whose header `name` carries exactly `value` (bytes that are not UTF-8
    too), with a `Content-Length` for `body`."""
    head = request_head(
        path, method=method, headers=[(name, "VALUE"), ("Content-Length", str(len(body)))]
    )
    return head.replace(b": VALUE\r\n", b": " + value + b"\r\n", 1) + body


def parse_head(head: bytes) -> tuple[str, int, CIMultiDict[str]]:
    """A response head (without its blank line): version, status, headers."""
    status_line, *lines = head.decode("latin-1").split("\r\n")
    version, status, *_ = status_line.split(" ", 2)
    headers: CIMultiDict[str] = CIMultiDict()
    for line in lines:
        name, _, value = line.partition(":")
        headers.add(name, value.strip())
    return version, int(status), headers


def json_request(
    body: dict[str, Any], request_id: str, path: str = "/v1/chat/completions"
) -> bytes:
    """A complete POST with a JSON body and an `X-Request-Id`."""
    payload = json.dumps(body).encode()
    headers = [
        ("Content-Type", "application/json"),
        ("Content-Length", str(len(payload))),
        ("X-Request-Id", request_id),
    ]
    return request_head(path, headers=headers) + payload


async def read_reply(reader: asyncio.StreamReader, timeout: float = READ_TIMEOUT) -> Reply:
    """Read one response: framed by Content-Length, chunked encoding or the connection's end."""
    async with asyncio.timeout(timeout):
        head = await reader.readuntil(b"\r\n\r\n")
        version, code, headers = parse_head(head[:-4])
        if 100 <= code < 200 or code in (204, 304):
            body = b""
        elif headers.get("Transfer-Encoding", "").lower() == "chunked":
            body = await _read_chunked(reader)
        elif "Content-Length" in headers:
            body = await reader.readexactly(int(headers["Content-Length"]))
        else:
            body = await reader.read()  # delimited by the connection's end
    return Reply(version, code, headers, body)


async def parse_reply(data: bytes) -> Reply:
    """The response in `data` (bytes a RawClient read in several steps), decoded as one."""
    reader = asyncio.StreamReader()
    reader.feed_data(data)
    reader.feed_eof()
    return await read_reply(reader)


async def _read_chunked(reader: asyncio.StreamReader) -> bytes:
    parts: list[bytes] = []
    while True:
        size = int((await reader.readuntil(b"\r\n")).split(b";")[0], 16)
        if size == 0:
            while await reader.readuntil(b"\r\n") != b"\r\n":
                pass  # trailers
            return b"".join(parts)
        parts.append(await reader.readexactly(size))
        await reader.readexactly(2)


class RawClient:
    """One client connection to a server on loopback."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer

    @classmethod
    async def connect(
        cls, port: int, *, host: str = "127.0.0.1", receive_buffer: int | None = None
    ) -> RawClient:
        """Connect to `host`:`port`; `receive_buffer` shrinks SO_RCVBUF (a slow link)."""
        if receive_buffer is None:
            reader, writer = await asyncio.open_connection(host, port)
            return cls(reader, writer)
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, receive_buffer)
        sock.setblocking(False)
        await asyncio.get_running_loop().sock_connect(sock, (host, port))
        reader, writer = await asyncio.open_connection(sock=sock)
        return cls(reader, writer)

    # --- sending ------------------------------------------------------------------------------

    async def send(self, data: bytes) -> None:
        """Send bytes exactly as given."""
        self.writer.write(data)
        await self.writer.drain()

    async def send_request(
        self,
        body: dict[str, Any] | bytes,
        *,
        path: str = "/v1/chat/completions",
        headers: dict[str, str] | None = None,
        body_bytes_now: int | None = None,
        content_type: str = "application/json",
    ) -> None:
        """POST with a Content-Length: the head and the body (or only its first
        `body_bytes_now` bytes, the rest never sent)."""
        payload = body if isinstance(body, bytes) else json.dumps(body).encode()
        head = request_head(
            path,
            headers=[
                ("Content-Type", content_type),
                ("Content-Length", str(len(payload))),
                *(headers or {}).items(),
            ],
        )
        await self.send(head + payload[:body_bytes_now])

    # --- receiving ----------------------------------------------------------------------------

    async def read_until(self, marker: bytes, timeout: float = READ_TIMEOUT) -> bytes:
        """Raw bytes (chunk framing included) up to and including `marker`."""
        return await asyncio.wait_for(self.reader.readuntil(marker), timeout)

    async def read_reply(self, timeout: float = READ_TIMEOUT) -> Reply:
        """The next whole response on this connection."""
        return await read_reply(self.reader, timeout)

    async def read_to_end(self, timeout: float = READ_TIMEOUT) -> bytes:
        """Everything the server still sends, until it closes the connection."""
        async with asyncio.timeout(timeout):
            return await self.reader.read()

    async def read_until_cut(self, timeout: float = READ_TIMEOUT) -> bytes:
        """What the server sends until it closes the connection; a reset (bytes the client was
        still sending arrived after the close) ends it as well as a FIN."""
        answer = b""
        async with asyncio.timeout(timeout):
            try:
                while chunk := await self.reader.read(65536):
                    answer += chunk
            except ConnectionResetError:
                pass
        return answer

    async def expect_closed(self, timeout: float = READ_TIMEOUT) -> None:
        """The server closed the connection with nothing more to say (FIN, or RST when it
        left unread bytes behind)."""
        try:
            rest = await self.read_to_end(timeout)
        except ConnectionResetError:
            return
        assert rest == b"", f"expected the connection closed, got {rest[:200]!r}"

    # --- leaving ------------------------------------------------------------------------------

    def close_fin(self) -> None:
        """Leave politely: FIN."""
        self.writer.close()

    def close_rst(self) -> None:
        """Leave abruptly: RST (SO_LINGER with a zero timeout)."""
        sock = self.writer.get_extra_info("socket")
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.writer.transport.abort()

    def close(self, how: str) -> None:
        """`close_fin()` for "fin", `close_rst()` for "rst"."""
        if how == "fin":
            self.close_fin()
        elif how == "rst":
            self.close_rst()
        else:
            raise ValueError(f"close how? {how!r} (fin or rst)")

    def half_close(self) -> None:
        """`shutdown(SHUT_WR)`: FIN on the sending side, still reading."""
        self.writer.write_eof()


# --- blocking: one exchange per connection, for the real-engine suites ----------------------


class RawExchange:
    """One request on its own connection (blocking); read as much of the answer as wanted,
    then close."""

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
        fields: list[tuple[str, str]] = []
        if content_type is not None:  # None: a body without any Content-Type header
            fields.append(("Content-Type", content_type))
        fields += [("Content-Length", str(len(body))), ("Connection", "close")]
        fields += headers.items()
        self._sock = socket.create_connection(("127.0.0.1", port), timeout=timeout)
        self._sock.sendall(request_head(path, headers=fields, host="127.0.0.1") + body)
        self._buffer = b""
        self._body = bytearray()
        self._chunked = False
        self._eof = False
        # The chunked body's last chunk arrived: the response ended, not just its connection.
        self.complete = False
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
        _, self.status, headers = parse_head(head)
        for name, value in headers.items():
            self.headers[name.strip().lower()] = value
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
                    self._eof = self.complete = True
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
