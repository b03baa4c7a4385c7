"""HTTP/1.1 to the engine on asyncio protocols and llhttp (`httptools`): the data plane.

One engine, one pool of keep-alive connections. A client request takes a connection for one
`UpstreamExchange`: the request goes out, and the response's head and body come back through
`data_received`, parsed by llhttp, straight into the exchange's sink. No task step, future or
coroutine runs per chunk: the handler waits only for the head and for the end.

Pool rules: idle connections are closed after `idle_timeout` (below the engine's own
keep-alive), the most recently used one is taken first (so the rest expire), a connection is
never reused after an exchange that did not end cleanly (a client that left, an error), and a
request on a reused connection that the engine closed before answering is sent once more on a
fresh one when its body can be replayed.
"""

from __future__ import annotations

import asyncio
import ssl
import time
from collections.abc import AsyncIterable, Callable
from typing import Protocol, cast

import httptools
from multidict import CIMultiDict

from .errors import (
    ClientGoneError,
    RequestTimeoutError,
    TetherError,
    UpstreamBrokenError,
    UpstreamConnectTimeoutError,
    UpstreamProtocolError,
    UpstreamUnavailableError,
)

# The engine's status line and headers together may not exceed this (aiohttp's limit was
# 8 KiB per line; llhttp has none of its own).
MAX_RESPONSE_HEAD = 64 * 1024
# Body bytes held for an exchange before anything consumes them: above this the engine is
# not read any further until a sink is attached.
_PENDING_LIMIT = 64 * 1024

RequestBody = bytes | AsyncIterable[bytes] | None


class BodySink(Protocol):
    """Whatever consumes an exchange's response body, chunk by chunk."""

    def feed(self, chunk: bytes) -> None: ...


class ResponseHead:
    """The engine's status line and headers."""

    __slots__ = ("chunked", "content_length", "headers", "keep_alive", "reason", "status")

    def __init__(
        self,
        status: int,
        reason: str,
        headers: CIMultiDict[str],
        keep_alive: bool,
    ) -> None:
        self.status = status
        self.reason = reason
        self.headers = headers
        self.keep_alive = keep_alive
        length = headers.get("Content-Length", "").strip()
        self.content_length = int(length) if length.isdigit() else None
        self.chunked = "chunked" in headers.get("Transfer-Encoding", "").lower()


class UpstreamExchange:
    """One client request sent to the engine, and the engine's response to it."""

    __slots__ = (
        "_connection",
        "_event",
        "_head_only",
        "_loop",
        "_pending",
        "_pending_size",
        "_pool",
        "_request",
        "_retried",
        "_reusable",
        "_sink",
        "_watch_silence",
        "client_gone",
        "complete",
        "ended_at",
        "error",
        "first_body_at",
        "head",
        "last_data_at",
        "sent",
    )

    def __init__(self, pool: UpstreamPool, head_only: bool) -> None:
        self._pool = pool
        self._loop = pool.loop
        self._head_only = head_only
        self._connection: UpstreamConnection | None = None
        self._request: tuple[bytes, bytes | None] | None = None  # replayable request bytes
        self._retried = False
        self._event: asyncio.Future[None] | None = None
        self._sink: BodySink | None = None
        self._pending: list[bytes] = []
        self._pending_size = 0
        self.head: ResponseHead | None = None
        self.error: TetherError | None = None
        self.complete = False
        self.client_gone = False
        self._reusable = True
        self.sent = False  # the whole request reached the engine's socket
        self._watch_silence = False  # set by a wait with an idle timeout
        self.first_body_at: float | None = None
        self.last_data_at = 0.0
        self.ended_at: float | None = None

    # --- sending ----------------------------------------------------------------------------

    async def send(self, head: bytes, body: RequestBody, *, chunked: bool = False) -> None:
        """Connect (or reuse a pooled connection) and send the request head and body; a
        streamed body goes out as it arrives, with chunked framing when `chunked`."""
        connection = await self._pool.acquire()
        self._attach_connection(connection)
        if body is None or isinstance(body, bytes):
            self._request = (head, body)
            connection.write(head + body if body else head)
            self.sent = True
            return
        connection.write(head)
        async for chunk in body:
            if connection.closed:
                return  # the engine answered (or failed) before reading it all
            if chunk:
                connection.write(b"%x\r\n%b\r\n" % (len(chunk), chunk) if chunked else chunk)
                await connection.drain()
        if chunked and not connection.closed:
            connection.write(b"0\r\n\r\n")
        self.sent = True

    def _attach_connection(self, connection: UpstreamConnection) -> None:
        self._connection = connection
        connection.exchange = self
        self.last_data_at = self._loop.time()

    async def _resend(self) -> None:
        """The pooled connection was stale: the same request once more, on a new one."""
        assert self._request is not None
        self._retried = True
        head, body = self._request
        self._attach_connection(await self._pool.connect())
        assert self._connection is not None
        self._connection.write(head + body if body else head)

    # --- waiting ----------------------------------------------------------------------------

    async def wait_head(self) -> ResponseHead:
        """Until the engine's response head arrived; raises what went wrong otherwise."""
        while self.head is None:
            if self.error is not None:
                raise self.error
            await self._next_event()
            if self._should_resend():
                self.error = None
                await self._resend()
        if self.error is not None:
            # It broke right behind its head (in the same read): nothing went to the client
            # yet, so it still gets the error rather than a cut stream.
            raise self.error
        return self.head

    async def wait_end(self, idle_timeout: float | None = None) -> None:
        """Until the response ended; raises what went wrong otherwise.

        With an idle timeout, the engine may not go silent for longer than that.
        """
        while not self.complete:
            if self.error is not None:
                raise self.error
            if self.client_gone:
                raise ClientGoneError("a write to the client failed")
            if idle_timeout is None:
                await self._next_event()
                continue
            if not self._watch_silence:
                self._watch_silence = True
                self.last_data_at = self._loop.time()
            silent_for = self._loop.time() - self.last_data_at
            if silent_for >= idle_timeout:
                raise RequestTimeoutError(
                    f"the engine sent nothing for TETHER_STREAM_IDLE_TIMEOUT={idle_timeout}s"
                )
            try:
                async with asyncio.timeout(idle_timeout - silent_for):
                    await self._next_event()
            except TimeoutError:
                continue

    async def wait_ended(self) -> None:
        """Until the response ended, cleanly or not (for whoever no longer relays it)."""
        while not self.ended:
            await self._next_event()

    @property
    def ended(self) -> bool:
        return self.complete or self.error is not None

    def _next_event(self) -> asyncio.Future[None]:
        if self._event is None or self._event.done():
            self._event = self._loop.create_future()
        return self._event

    def _signal(self) -> None:
        event, self._event = self._event, None
        if event is not None and not event.done():
            event.set_result(None)

    def _should_resend(self) -> bool:
        connection = self._connection
        return (
            isinstance(self.error, UpstreamUnavailableError)
            and self._request is not None
            and not self._retried
            and connection is not None
            and connection.reused
            and connection.received == 0
        )

    # --- consuming ---------------------------------------------------------------------------

    def attach(self, sink: BodySink) -> None:
        """Send the body (what already arrived, then every chunk as it arrives) to `sink`."""
        self._sink = sink
        pending, self._pending, self._pending_size = self._pending, [], 0
        for chunk in pending:
            sink.feed(chunk)
        if pending:
            self.resume_reading()

    def pause_reading(self) -> None:
        if self._connection is not None:
            self._connection.pause_reading()

    def resume_reading(self) -> None:
        if self._connection is not None:
            self._connection.resume_reading()

    def forbid_reuse(self) -> None:
        """Whatever happens now, the connection is closed at the end, never pooled: the
        client left, and tether makes no exception to that rule."""
        self._reusable = False

    def notify_client_gone(self) -> None:
        """The sink found the client gone: the handler's wait ends."""
        self.client_gone = True
        self._signal()

    def close(self) -> None:
        """Drop the upstream connection (never pooled): the engine sees the disconnect.

        `ended_at` stays unset: it records when the engine ended the response, never when
        tether let go of it."""
        connection = self._connection
        if connection is not None:
            connection.exchange = None
            connection.close()
        if not self.ended:
            self.error = UpstreamBrokenError("tether closed the connection")
        self._signal()

    # --- called by the connection ------------------------------------------------------------

    def _on_head(self, head: ResponseHead) -> None:
        self.head = head
        self._request = None  # answered: it will not be sent again, so not kept either
        self._signal()
        if self._head_only:
            # llhttp cannot know that a HEAD response has no body: the message ends here,
            # and the connection, whose parser now expects one, is not reused.
            self._on_complete(reusable=False)

    def _on_body(self, chunk: bytes) -> None:
        if self._watch_silence:
            self.last_data_at = self._loop.time()
        if self.first_body_at is None:
            self.first_body_at = time.monotonic()
        sink = self._sink
        if sink is not None:
            sink.feed(chunk)
            return
        self._pending.append(chunk)
        self._pending_size += len(chunk)
        if self._pending_size > _PENDING_LIMIT:
            self.pause_reading()

    def _on_complete(self, reusable: bool) -> None:
        if self.ended:
            return
        self.complete = True
        self.ended_at = self._loop.time()
        connection = self._connection
        if connection is not None:
            connection.exchange = None
            self._connection = None
            if reusable and self._reusable:
                self._pool.release(connection)
            else:
                connection.close()
        self._signal()

    def _on_error(self, error: TetherError) -> None:
        if self.ended:
            return
        self.error = error
        self.ended_at = self._loop.time()
        connection = self._connection
        if connection is not None:
            connection.exchange = None
            connection.close()
        self._signal()


class UpstreamConnection(asyncio.Protocol):
    """One TCP connection to the engine; llhttp calls the `on_*` methods as it parses."""

    # One per open stream: no per-instance dict.
    __slots__ = (
        "_body",
        "_drained",
        "_head_size",
        "_headers",
        "_in_head",
        "_parser",
        "_pool",
        "_reason",
        "_unparsed_head",
        "_write_paused",
        "closed",
        "exchange",
        "idle_since",
        "received",
        "reused",
        "transport",
    )

    def __init__(self, pool: UpstreamPool) -> None:
        self._pool = pool
        self._parser = httptools.HttpResponseParser(self)
        self._body: list[bytes] = []  # the body pieces of the read being parsed
        self.transport: asyncio.Transport | None = None
        self.exchange: UpstreamExchange | None = None
        self.closed = False
        self.reused = False
        self.idle_since = 0.0
        self.received = 0  # bytes of the current exchange's response so far
        self._head_size = 0
        self._unparsed_head = 0
        self._reason = b""
        self._headers: list[tuple[str, str]] = []
        self._in_head = True
        self._write_paused = False
        self._drained: asyncio.Future[None] | None = None

    # --- asyncio.Protocol --------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not subclasses of asyncio's, only alike.
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        exchange = self.exchange
        if exchange is None:
            # Bytes nobody asked for (on an idle connection, or after tether let go of a
            # response): this connection can no longer be trusted for a new request.
            self.close()
            return
        self.received += len(data)
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._deliver_body()
            self._fail(UpstreamProtocolError("the engine switched protocols unasked"))
        except httptools.HttpParserError as exc:
            self._deliver_body()  # what arrived before the fault still goes where it belongs
            # A callback below that refused the reply raised a TetherError, which llhttp
            # reports as the context of its own error.
            cause = exc.__context__
            self._fail(
                cause
                if isinstance(cause, TetherError)
                else UpstreamProtocolError(
                    f"the engine's reply is not valid HTTP/1.1 ({exc.__class__.__name__})"
                )
            )
            return
        self._deliver_body()
        if self._in_head and self.exchange is not None:
            # llhttp buffers a header that has not ended yet without bound: whatever arrived
            # while the head is still incomplete counts against its limit.
            self._unparsed_head += len(data)
            if self._unparsed_head > MAX_RESPONSE_HEAD:
                self._fail(self._head_too_large())

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.transport = None
        self._pool.forget(self)
        if self._drained is not None and not self._drained.done():
            self._drained.set_result(None)
        exchange = self.exchange
        if exchange is None:
            return
        head = exchange.head
        if head is None:
            if self.received:
                exchange._on_error(
                    UpstreamProtocolError("the engine closed the connection inside its reply head")
                )
            else:
                exchange._on_error(
                    UpstreamUnavailableError("the engine closed the connection before answering")
                )
        elif not head.chunked and head.content_length is None:
            exchange._on_complete(reusable=False)  # the body was delimited by the close
        else:
            exchange._on_error(UpstreamBrokenError("the engine's response broke off"))

    def pause_writing(self) -> None:
        self._write_paused = True

    def resume_writing(self) -> None:
        self._write_paused = False
        if self._drained is not None and not self._drained.done():
            self._drained.set_result(None)

    # --- llhttp callbacks --------------------------------------------------------------------

    def on_status(self, reason: bytes) -> None:
        self._reason += reason
        self._count_head(len(reason))

    def on_header(self, name: bytes, value: bytes) -> None:
        self._count_head(len(name) + len(value) + 4)
        self._headers.append((name.decode("latin-1"), value.decode("latin-1")))

    def on_headers_complete(self) -> None:
        status = self._parser.get_status_code()
        headers, self._headers = CIMultiDict(self._headers), []
        reason, self._reason = self._reason.decode("latin-1"), b""
        self._head_size = self._unparsed_head = 0
        if status < 200:  # 1xx: informational, the real head follows
            return
        self._in_head = False
        exchange = self.exchange
        if exchange is not None:
            exchange._on_head(
                ResponseHead(status, reason, headers, self._parser.should_keep_alive())
            )

    def on_body(self, body: bytes) -> None:
        # An engine frames every event as its own HTTP chunk; when it outpaces the relay a
        # read holds hundreds of them. The pieces of one read go on together, after it is
        # parsed (`_deliver_body`): one pass through the relay per read, not per event.
        self._body.append(body)

    def _deliver_body(self) -> None:
        body = self._body
        if not body:
            return
        chunk = body[0] if len(body) == 1 else b"".join(body)
        body.clear()
        exchange = self.exchange
        if exchange is None:
            return
        sink = exchange._sink
        if sink is not None and exchange.first_body_at is not None and not exchange._watch_silence:
            sink.feed(chunk)  # the steady state of a stream: nothing else to note per read
        else:
            exchange._on_body(chunk)

    def on_message_complete(self) -> None:
        if self._in_head:
            return  # the end of a 1xx message
        self._deliver_body()
        self._in_head = True
        self._head_size = self._unparsed_head = 0
        exchange = self.exchange
        if exchange is not None:
            exchange._on_complete(reusable=self._parser.should_keep_alive())

    # --- used by the exchange and the pool ---------------------------------------------------

    def write(self, data: bytes) -> None:
        if self.transport is not None:
            self.transport.write(data)

    async def drain(self) -> None:
        """Until the engine has read enough of what was written (TCP flow control)."""
        if not self._write_paused or self.closed:
            return
        self._drained = asyncio.get_running_loop().create_future()
        try:
            await self._drained
        finally:
            self._drained = None

    def pause_reading(self) -> None:
        if self.transport is not None and self.transport.is_reading():
            self.transport.pause_reading()

    def resume_reading(self) -> None:
        if self.transport is not None and not self.transport.is_reading():
            self.transport.resume_reading()

    def begin(self) -> None:
        """Ready for a new exchange on this connection."""
        self.received = 0
        self._head_size = self._unparsed_head = 0
        self._in_head = True

    def close(self) -> None:
        self.exchange = None
        if self.transport is not None:
            self.transport.close()

    def _count_head(self, size: int) -> None:
        self._head_size += size
        if self._head_size > MAX_RESPONSE_HEAD:
            raise self._head_too_large()

    @staticmethod
    def _head_too_large() -> UpstreamProtocolError:
        return UpstreamProtocolError(f"the engine's reply head exceeds {MAX_RESPONSE_HEAD} bytes")

    def _fail(self, error: TetherError) -> None:
        exchange = self.exchange
        self.close()
        if exchange is not None:
            exchange._on_error(error)


class UpstreamPool:
    """Keep-alive connections to the one engine, and the exchanges that use them."""

    def __init__(
        self,
        host: str,
        port: int,
        *,
        ssl_context: ssl.SSLContext | None,
        connect_timeout: float,
        idle_timeout: float,
    ) -> None:
        self.loop = asyncio.get_running_loop()
        self._host = host
        self._port = port
        self._ssl = ssl_context
        self._connect_timeout = connect_timeout
        self._idle_timeout = idle_timeout
        self._idle: list[UpstreamConnection] = []  # most recently released last
        self._open: set[UpstreamConnection] = set()
        self._sweep: asyncio.TimerHandle | None = None

    def exchange(self, *, head_only: bool = False) -> UpstreamExchange:
        """A new exchange; `send` it. `head_only` for HEAD requests: no body will follow."""
        return UpstreamExchange(self, head_only)

    async def acquire(self) -> UpstreamConnection:
        """The most recently used idle connection still fresh, or a new one."""
        now = self.loop.time()
        while self._idle:
            connection = self._idle.pop()
            if connection.closed or now - connection.idle_since >= self._idle_timeout:
                connection.close()
                continue
            connection.reused = True
            connection.begin()
            return connection
        return await self.connect()

    async def connect(self) -> UpstreamConnection:
        factory: Callable[[], UpstreamConnection] = lambda: UpstreamConnection(self)  # noqa: E731
        try:
            async with asyncio.timeout(self._connect_timeout):
                _, connection = await self.loop.create_connection(
                    factory, self._host, self._port, ssl=self._ssl
                )
        except TimeoutError as exc:
            raise UpstreamConnectTimeoutError(
                f"the engine did not accept a connection within {self._connect_timeout}s "
                "(TETHER_CONNECT_TIMEOUT)"
            ) from exc
        except OSError as exc:
            raise UpstreamUnavailableError(
                f"the engine is unreachable: {exc.strerror or exc.__class__.__name__}"
            ) from exc
        self._open.add(connection)
        return connection

    def release(self, connection: UpstreamConnection) -> None:
        """A connection whose exchange ended cleanly goes back for reuse."""
        if connection.closed:
            return
        connection.idle_since = self.loop.time()
        self._idle.append(connection)
        if self._sweep is None:
            self._sweep = self.loop.call_later(self._idle_timeout, self._close_expired)

    def forget(self, connection: UpstreamConnection) -> None:
        self._open.discard(connection)

    def _close_expired(self) -> None:
        self._sweep = None
        deadline = self.loop.time() - self._idle_timeout
        fresh = []
        for connection in self._idle:
            if connection.idle_since <= deadline or connection.closed:
                connection.close()
            else:
                fresh.append(connection)
        self._idle = fresh
        if fresh:
            wait = fresh[0].idle_since + self._idle_timeout - self.loop.time()
            self._sweep = self.loop.call_later(max(wait, 0.01), self._close_expired)

    @property
    def idle_connections(self) -> int:
        return len(self._idle)

    def close(self) -> None:
        if self._sweep is not None:
            self._sweep.cancel()
            self._sweep = None
        for connection in list(self._open):
            connection.close()
        self._idle.clear()
