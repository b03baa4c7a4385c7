"""A raw HTTP/1.1 engine scripted byte by byte, parsing requests as uvicorn does (llhttp).

It records every request it parsed, on which connection, and answers with whatever the test's
`respond` returns for it: the pieces to write (one write each; `CLOSE` among them closes the
connection there), `CLOSE` alone to drop the connection without a word, or None to say nothing
yet. `respond` is asked once when a request's head is
complete (`request.complete` False: answering then is an early answer, before the body, as
FastAPI's 404 or an API-key middleware's 401 do) and, if it said nothing, once more when the
body is complete. A body it answered early is discarded by its length, as uvicorn and aiohttp
do, and the connection stays open for the next request: exactly the behaviour a proxy must not
smuggle a request into.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field

import httptools
from multidict import CIMultiDict

from proxy.engines.identify import PROBE_PATHS


@dataclass
class SeenRequest:
    """One request as the engine parsed it."""

    connection: int
    method: str
    path: str
    headers: CIMultiDict[str]
    body: bytes = b""
    complete: bool = False


class _Close:
    """Drop the connection without answering."""


CLOSE = _Close()
Response = list[bytes | _Close] | _Close | None
Responder = Callable[[SeenRequest], Response]


def http_response(
    status: int = 200,
    body: bytes = b"{}",
    *,
    headers: tuple[tuple[str, str], ...] = (("Content-Type", "application/json"),),
) -> bytes:
    """A complete response with a Content-Length."""
    lines = [f"HTTP/1.1 {status} X", *(f"{n}: {v}" for n, v in headers)]
    lines.append(f"Content-Length: {len(body)}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


class _EngineConnection(asyncio.Protocol):
    def __init__(self, engine: ScriptedEngine, number: int) -> None:
        self._engine = engine
        self._number = number
        self._parser = httptools.HttpRequestParser(self)
        self._transport: asyncio.Transport | None = None
        self._request: SeenRequest | None = None
        self._answered = False
        self._url = b""
        self._headers: list[tuple[str, str]] = []

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]
        self._engine.transports[self._number] = self._transport

    def data_received(self, data: bytes) -> None:
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError:
            self._engine.unparseable += 1
            if self._transport is not None:
                self._transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self._transport = None
        self._engine.transports[self._number] = None

    def on_message_begin(self) -> None:
        self._url = b""
        self._headers = []
        self._answered = False

    def on_url(self, url: bytes) -> None:
        self._url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        self._headers.append((name.decode("latin-1"), value.decode("latin-1")))

    def on_headers_complete(self) -> None:
        method, path = self._parser.get_method().decode(), self._url.decode("latin-1")
        own_call = dict(self._headers).get("User-Agent", "").startswith("tether/")
        if own_call and method == "GET" and path in PROBE_PATHS and self._transport is not None:
            # tether asking which engine this is: none it knows (nothing a script sees).
            self._transport.write(http_response(404, b"", headers=(("Connection", "close"),)))
            self._transport.close()
            return
        self._request = SeenRequest(self._number, method, path, CIMultiDict(self._headers))
        self._engine.requests.append(self._request)
        self._answer()

    def on_body(self, body: bytes) -> None:
        if self._request is not None and not self._answered:
            self._request.body += body

    def on_message_complete(self) -> None:
        if self._request is None:
            return
        self._request.complete = True
        if not self._answered:
            self._answer()

    def _answer(self) -> None:
        assert self._request is not None
        response = self._engine.respond(self._request)
        if response is None or self._transport is None:
            return
        self._answered = True
        if isinstance(response, _Close):
            self._transport.close()
            return
        for piece in response:
            if isinstance(piece, _Close):
                self._transport.close()
                return
            self._transport.write(piece)


@dataclass(eq=False)
class ScriptedEngine:
    respond: Responder
    requests: list[SeenRequest] = field(default_factory=list)
    connections: int = 0
    unparseable: int = 0  # connections closed on bytes that were not a valid request
    transports: list[asyncio.Transport | None] = field(default_factory=list)
    _server: asyncio.Server | None = None

    @property
    def url(self) -> str:
        assert self._server is not None
        return f"http://127.0.0.1:{self._server.sockets[0].getsockname()[1]}"

    @property
    def port(self) -> int:
        assert self._server is not None
        return int(self._server.sockets[0].getsockname()[1])

    async def start(self) -> ScriptedEngine:
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(self._connection, "127.0.0.1", 0)
        return self

    def _connection(self) -> _EngineConnection:
        """A new connection, numbered as it was accepted (before any of it is read: two
        accepted together get numbers of their own)."""
        self.transports.append(None)
        self.connections += 1
        return _EngineConnection(self, self.connections - 1)

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    def write_unasked(self, connection: int, data: bytes) -> None:
        """Write `data` on connection number `connection`, outside any exchange."""
        transport = self.transports[connection]
        assert transport is not None and not transport.is_closing()
        transport.write(data)

    def seen(self, method: str | None = None) -> list[tuple[str, str]]:
        """(method, path) of every request parsed, in order (only `method`'s if given)."""
        return [(r.method, r.path) for r in self.requests if method in (None, r.method)]
