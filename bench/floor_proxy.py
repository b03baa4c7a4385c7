"""The least a proxy built on tether's stack does: the floor under tether's figures.

`python -m bench.floor_proxy --port P --engine-port E`: aiohttp's low-level server on uvloop,
as tether runs it (`web.Server` with one handler and tether's server flags, on a listening
socket with tether's options, the start-up heap frozen; `proxy/server/runner.py`), each
request's body read whole and sent with its head on a pooled keep-alive connection to the
engine, the response parsed with httptools (llhttp) and relayed: a body of known length
whole, a chunked one piece by piece as it arrives. Nothing else: no IDs of its own, no
checks, no disconnect handling, no metrics, no logs. Not a proxy anyone should run; the
bench's `aiohttp_floor` system, so that what tether costs above the stack it is built on
(aiohttp's server, the event loop, CPython) is measured in the same run as the rest. Every
choice tether makes about its server is made here too, so none of tether's own cost is
hidden in the floor (an `Application` with a router would add a match and a request copy
per request that tether does not pay).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import socket
from typing import cast

import httptools
import uvloop
from aiohttp import web

# Headers the floor frames itself, both ways.
_FRAMING = frozenset({"host", "content-length", "transfer-encoding", "connection"})
# tether's listen backlog and keepalive probes, and its default TETHER_CLIENT_HEADER_TIMEOUT
# (aiohttp's keep-alive timeout there) and TETHER_TCP_KEEPALIVE_IDLE.
_LISTEN_BACKLOG = 4096
_KEEPALIVE_PROBES = 3
_KEEPALIVE_TIMEOUT_S = 60.0
_KEEPALIVE_IDLE_S = 60


class EngineConnection(asyncio.Protocol):
    """One keep-alive connection to the engine, one response at a time."""

    def __init__(self) -> None:
        self._parser = httptools.HttpResponseParser(self)
        self.transport: asyncio.Transport | None = None
        self.head: asyncio.Future[tuple[int, list[tuple[bytes, bytes]]]] | None = None
        self.pieces: asyncio.Queue[bytes | None] = asyncio.Queue()
        self._headers: list[tuple[bytes, bytes]] = []

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass

    def data_received(self, data: bytes) -> None:
        self._parser.feed_data(data)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._headers.append((name, value))

    def on_headers_complete(self) -> None:
        assert self.head is not None
        self.head.set_result((self._parser.get_status_code(), self._headers))
        self._headers = []

    def on_body(self, body: bytes) -> None:
        self.pieces.put_nowait(body)

    def on_message_complete(self) -> None:
        self.pieces.put_nowait(None)


class FloorProxy:
    def __init__(self, engine_port: int) -> None:
        self._engine_port = engine_port
        self._idle: list[EngineConnection] = []

    async def handle(self, request: web.BaseRequest) -> web.StreamResponse:
        body = await request.read()
        engine = self._idle.pop() if self._idle else await self._connect()
        engine.head = asyncio.get_running_loop().create_future()
        lines = [f"{request.method} {request.raw_path} HTTP/1.1\r\nHost: engine\r\n"]
        lines += [f"{n}: {v}\r\n" for n, v in request.headers.items() if n.lower() not in _FRAMING]
        lines.append(f"Content-Length: {len(body)}\r\n\r\n")
        assert engine.transport is not None
        engine.transport.write("".join(lines).encode() + body)
        status, raw_headers = await engine.head
        names = [name.decode().lower() for name, _ in raw_headers]
        headers = {
            name: value.decode()
            for name, (_, value) in zip(names, raw_headers, strict=True)
            if name not in _FRAMING
        }
        if "content-length" in names:
            pieces = []
            while (piece := await engine.pieces.get()) is not None:
                pieces.append(piece)
            self._idle.append(engine)
            return web.Response(status=status, headers=headers, body=b"".join(pieces))
        response = web.StreamResponse(status=status, headers=headers)
        await response.prepare(request)
        while (piece := await engine.pieces.get()) is not None:
            await response.write(piece)
        self._idle.append(engine)
        await response.write_eof()
        return response

    async def _connect(self) -> EngineConnection:
        loop = asyncio.get_running_loop()
        _, connection = await loop.create_connection(
            EngineConnection, "127.0.0.1", self._engine_port
        )
        return connection


def listening_socket(port: int) -> socket.socket:
    """A loopback listening socket with the options tether's has (`listening_socket` in
    `proxy/server/runner.py`): keepalive probes, a user timeout, no Nagle, a deep backlog."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    interval = _KEEPALIVE_IDLE_S // 3
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, _KEEPALIVE_IDLE_S)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, interval)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, _KEEPALIVE_PROBES)
    sock.setsockopt(
        socket.IPPROTO_TCP,
        socket.TCP_USER_TIMEOUT,
        (_KEEPALIVE_IDLE_S + _KEEPALIVE_PROBES * interval) * 1000,
    )
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.bind(("127.0.0.1", port))
    sock.listen(_LISTEN_BACKLOG)
    sock.setblocking(False)
    return sock


async def serve(port: int, engine_port: int) -> None:
    """Serve until the process is stopped (SIGTERM's default action: the bench's way)."""
    server = web.Server(
        FloorProxy(engine_port).handle,
        # tether's flags, each with its reason in proxy/server/runner.py.
        handler_cancellation=True,
        keepalive_timeout=_KEEPALIVE_TIMEOUT_S,
        lingering_time=1.0,
        access_log=None,
        max_field_size=16384,
        max_line_size=16384,
    )
    runner = web.ServerRunner(server, handle_signals=False, shutdown_timeout=1.0)
    await runner.setup()
    await web.SockSite(runner, listening_socket(port), backlog=_LISTEN_BACKLOG).start()
    # As tether's `settle_heap`: what exists once it serves is kept out of the cyclic
    # collector's walks.
    gc.collect()
    gc.freeze()
    await asyncio.Event().wait()


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.floor_proxy", description=__doc__)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--engine-port", type=int, required=True)
    args = parser.parse_args()
    uvloop.run(serve(args.port, args.engine_port))


if __name__ == "__main__":
    main()
