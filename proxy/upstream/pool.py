"""The keep-alive connections to the one engine.

Idle connections are closed after `idle_timeout` (below the engine's own keep-alive), and
the most recently used one is taken first, so the rest expire. Whether a connection comes back
at all is the connection's own decision (`UpstreamConnection`): the pool only keeps what it
is handed and drops what closed.

A connection taken for a request whose body is still arriving (streamed through) or whose
WebSocket handshake waits for the engine's 101 is held for as long as the client takes, so
how many may be held so at once is bounded (`UploadLimit`): nginx buffers a body before it
takes an engine connection, and holds none while a client trickles one.
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import Awaitable, Callable
from typing import Protocol

from ..errors import TooManyUploadsError, UpstreamConnectTimeoutError, UpstreamUnavailableError
from .connection import ConnectionState, UpstreamConnection

# How a connection is opened: the protocol factory in, the connected protocol out. The
# default is a TCP (or TLS) connection; tests drive the pool without sockets.
Connector = Callable[[Callable[[], UpstreamConnection]], Awaitable[UpstreamConnection]]


class Shown(Protocol):
    """Where a number is shown (a metrics gauge)."""

    value: float


class UploadLimit:
    """How many engine connections may wait for their clients at once (a body still
    arriving, or a WebSocket handshake until the engine's answer); one per app."""

    __slots__ = ("_shown", "held", "limit")

    def __init__(self, limit: int, shown: Shown | None = None) -> None:
        self.limit = limit
        self.held = 0
        self._shown = shown

    def take(self) -> None:
        """One more, or `TooManyUploadsError` at the limit (before any connection is taken)."""
        if self.held >= self.limit:
            raise TooManyUploadsError(
                f"{self.limit} requests already hold an engine connection while their clients "
                "send (TETHER_MAX_STREAMED_UPLOADS); retry shortly"
            )
        self._set(self.held + 1)

    def give_back(self) -> None:
        self._set(self.held - 1)

    def _set(self, held: int) -> None:
        self.held = held
        if self._shown is not None:
            self._shown.value = float(held)


class UpstreamPool:
    """Keep-alive connections to the one engine."""

    def __init__(
        self,
        host: str,
        port: int,
        *,
        ssl_context: ssl.SSLContext | None,
        connect_timeout: float,
        idle_timeout: float,
        uploads: UploadLimit,
        connector: Connector | None = None,
    ) -> None:
        self.loop = asyncio.get_running_loop()
        self.uploads = uploads
        self._host = host
        self._port = port
        self._ssl = ssl_context
        self._connect_timeout = connect_timeout
        self._idle_timeout = idle_timeout
        self._connector = connector or self._tcp
        self._idle: list[UpstreamConnection] = []  # most recently released last
        self._open: set[UpstreamConnection] = set()
        self._sweep: asyncio.TimerHandle | None = None

    async def acquire(self) -> UpstreamConnection:
        """The most recently used idle connection still fresh, or a new one."""
        now = self.loop.time()
        while self._idle:
            connection = self._idle.pop()
            if connection.state is not ConnectionState.IDLE:
                continue  # closed while idle
            if now - connection.idle_since >= self._idle_timeout:
                connection.close()
                continue
            return connection
        return await self.connect()

    async def connect(self) -> UpstreamConnection:
        """A new connection (never a pooled one)."""
        factory: Callable[[], UpstreamConnection] = lambda: UpstreamConnection(  # noqa: E731
            self._release, self._forget
        )
        try:
            async with asyncio.timeout(self._connect_timeout):
                connection = await self._connector(factory)
        except TimeoutError as timed_out:
            raise UpstreamConnectTimeoutError(
                f"the engine did not accept a connection within {self._connect_timeout}s "
                "(TETHER_CONNECT_TIMEOUT)"
            ) from timed_out
        except OSError as refused:
            raise UpstreamUnavailableError(
                f"the engine is unreachable: {refused.strerror or refused.__class__.__name__}"
            ) from refused
        self._open.add(connection)
        return connection

    async def _tcp(self, factory: Callable[[], UpstreamConnection]) -> UpstreamConnection:
        _, connection = await self.loop.create_connection(
            factory, self._host, self._port, ssl=self._ssl
        )
        return connection

    def _release(self, connection: UpstreamConnection) -> None:
        """A connection that decided it is reusable comes back."""
        connection.park(self.loop.time())
        self._idle.append(connection)
        if self._sweep is None:
            self._sweep = self.loop.call_later(self._idle_timeout, self._close_expired)

    def _forget(self, connection: UpstreamConnection) -> None:
        self._open.discard(connection)

    def _close_expired(self) -> None:
        self._sweep = None
        deadline = self.loop.time() - self._idle_timeout
        fresh = []
        for connection in self._idle:
            if connection.state is not ConnectionState.IDLE:
                continue
            if connection.idle_since <= deadline:
                connection.close()
            else:
                fresh.append(connection)
        self._idle = fresh
        if fresh:
            wait = fresh[0].idle_since + self._idle_timeout - self.loop.time()
            self._sweep = self.loop.call_later(max(wait, 0.01), self._close_expired)

    @property
    def idle_connections(self) -> int:
        return sum(1 for connection in self._idle if connection.state is ConnectionState.IDLE)

    def close(self) -> None:
        if self._sweep is not None:
            self._sweep.cancel()
            self._sweep = None
        for connection in list(self._open):
            connection.close()
        self._idle.clear()
