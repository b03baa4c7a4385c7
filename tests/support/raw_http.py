"""An HTTP/1.1 client on a bare socket: the test decides exactly what is sent, when, and how
the client leaves (FIN, RST, half-close). Every read is bounded by a timeout."""

from __future__ import annotations

import asyncio
import json
import socket
import struct
from collections.abc import Sequence
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
) -> bytes:
    """A request head, byte for byte: request line, `Host`, `headers` in order, blank line."""
    lines = [f"{method} {path} {version}", "Host: tether", *(f"{n}: {v}" for n, v in headers)]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


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
        status_line, *lines = head[:-4].decode("latin-1").split("\r\n")
        version, status, *_ = status_line.split(" ", 2)
        headers: CIMultiDict[str] = CIMultiDict()
        for line in lines:
            name, _, value = line.partition(":")
            headers.add(name, value.strip())
        code = int(status)
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
