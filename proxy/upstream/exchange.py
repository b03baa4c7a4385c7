"""One client request sent to the engine, and the engine's response to it: the data plane.

The request goes out on a pooled connection (`UpstreamConnection`); the response's head and
body come back through that connection's `data_received`, parsed by llhttp, straight into
the exchange's sink. No task step, future or coroutine runs per chunk: the handler waits only
for the head and for the end.

A request is sent once. It is sent again, on a new connection, only when that cannot make the
engine run it twice: the caller says the request is replayable (an idempotent method, RFC 9110
§9.2.2, on a route that does not start generation: the engine profile decides) and a reused
connection was closed before any byte of a response, which is the race of an engine's
keep-alive timeout. A POST the engine may have read is never resent: its client gets the
error.

The wait for the end may watch for the engine going silent (TETHER_STREAM_IDLE_TIMEOUT) with
one timer for the whole response, as the pool watches its idle connections: each read notes
its time on the loop's clock, and the timer, when it runs out, either finds the silence long
enough or is re-armed for what is left of it from the last read.

Just over 400 lines: sending, the replay rule, the waits and the sink hand-off share the
exchange's state, which nothing else may write.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterable
from typing import Protocol

from mypy_extensions import mypyc_attr

from ..errors import (
    RequestTimeoutError,
    TetherError,
    UpstreamBrokenError,
    UpstreamUnavailableError,
)
from .connection import ResponseHead, UpstreamConnection
from .pool import UpstreamPool

# Body bytes held for an exchange before anything consumes them: above this the engine is
# not read any further until a sink is attached.
_PENDING_LIMIT = 64 * 1024

RequestBody = bytes | AsyncIterable[bytes] | None


# The idle timer runs out up to this early (uvloop's timers count whole milliseconds): a
# silence this close to the timeout is the timeout, not a reason to re-arm.
_TIMER_RESOLUTION = 0.001


class BodySink(Protocol):
    """Whatever consumes an exchange's response body, chunk by chunk. One that can no longer
    pass bytes on (where it writes to closed) says so with `UpstreamExchange.on_sink_closed`."""

    def feed(self, chunk: bytes) -> None: ...


# (mypyc compiles no subclass of a built-in exception but as a regular Python class.)
@mypyc_attr(native_class=False)
class SinkClosedError(ConnectionError):
    """The response body's sink stopped taking bytes: where it writes to closed. The
    exchange's reader decides what that means (the handler's: its client left)."""


class UpstreamExchange:
    """One client request sent to the engine, and the engine's response to it."""

    __slots__ = (
        "_body_writer",
        "_connection",
        "_event",
        "_head_only",
        "_holds_upload",
        "_idle_timeout",
        "_idle_timer",
        "_last_data_at",
        "_loop",
        "_pending",
        "_pending_size",
        "_pool",
        "_replay",
        "_replayable",
        "_retried",
        "_silent_too_long",
        "_sink",
        "_sink_closed",
        "_upgrade",
        "complete",
        "ended_at",
        "error",
        "first_body_at",
        "head",
        "sent",
        "sent_at",
    )

    def __init__(
        self, pool: UpstreamPool, method: str, *, replayable: bool, upgrade: bool = False
    ) -> None:
        self._pool = pool
        self._loop = pool.loop
        self._head_only = method == "HEAD"
        # It asks for a WebSocket: an engine's 101 turns the connection into its pipe, whose
        # "body" is the engine's bytes and which ends when either side closes it.
        self._upgrade = upgrade
        self._replayable = replayable
        self._connection: UpstreamConnection | None = None
        self._replay: tuple[bytes, bytes | None] | None = None  # the request, if resendable
        self._retried = False
        self._holds_upload = False  # one of the pool's `UploadLimit` places
        self._body_writer: asyncio.Task[None] | None = None
        self._event: asyncio.Future[None] | None = None
        self._sink: BodySink | None = None
        self._pending: list[bytes] = []
        self._pending_size = 0
        self.head: ResponseHead | None = None
        self.error: TetherError | None = None
        self.complete = False
        self._sink_closed = False
        self.sent = False  # the whole request reached the engine's socket
        self.sent_at = 0.0  # time.monotonic() it did
        # Watching for silence: the timeout (None: not watched), its one timer, the last
        # read's time on the loop's clock, and whether the timer found the silence too long.
        self._idle_timeout: float | None = None
        self._idle_timer: asyncio.TimerHandle | None = None
        self._last_data_at = 0.0
        self._silent_too_long = False
        self.first_body_at: float | None = None
        self.ended_at: float | None = None

    # --- sending ----------------------------------------------------------------------------

    async def send(self, head: bytes, body: RequestBody, *, chunked: bool = False) -> None:
        """Connect (or reuse a pooled connection) and send the request head and body.

        A streamed body goes out as it arrives, with chunked framing when `chunked`, until it
        ends or the engine answers: an early answer (an engine refusing the request before
        reading it all) returns at once, and the rest of the body is never read or sent.

        Until then, or until the engine answers a WebSocket handshake, the connection waits
        for the client: it takes one of the pool's upload places first, and with none left
        the request is refused (`TooManyUploadsError`) before any connection is taken."""
        whole = body is None or isinstance(body, bytes)
        if self._upgrade or not whole:
            self._take_upload()
        try:
            connection = await self._pool.acquire()
        except BaseException:
            self._give_back_upload()
            raise
        self._attach_connection(connection)
        if body is None or isinstance(body, bytes):
            if self._replayable:
                self._replay = (head, body)
            connection.write(head + body if body else head)
            connection.request_written()
            self._mark_sent()
            return
        connection.write(head)
        writer = self._loop.create_task(self._write_body(connection, body, chunked))
        self._body_writer = writer
        try:
            while not writer.done() and self.head is None and self.error is None:
                await asyncio.wait((writer, self._next_event()), return_when="FIRST_COMPLETED")
        finally:
            if not writer.done():
                writer.cancel()  # answered early, failed, or the handler was cancelled
            self._give_back_upload()
        if writer.done() and not writer.cancelled():
            writer.result()  # the client's body failed (a timeout): its error is the answer

    async def _write_body(
        self, connection: UpstreamConnection, body: AsyncIterable[bytes], chunked: bool
    ) -> None:
        async for chunk in body:
            if not connection.sending:
                return  # the engine answered (or failed) before reading it all
            if chunk:
                connection.write(b"%x\r\n%b\r\n" % (len(chunk), chunk) if chunked else chunk)
                await connection.drain()
        if not connection.sending:
            return
        if chunked:
            connection.write(b"0\r\n\r\n")
        connection.request_written()
        self._mark_sent()

    def _take_upload(self) -> None:
        self._pool.uploads.take()
        self._holds_upload = True

    def _give_back_upload(self) -> None:
        if self._holds_upload:
            self._holds_upload = False
            self._pool.uploads.give_back()

    def _mark_sent(self) -> None:
        self.sent = True
        self.sent_at = time.monotonic()

    def _attach_connection(self, connection: UpstreamConnection) -> None:
        self._connection = connection
        connection.begin(self, self._on_body, head_only=self._head_only, upgrade=self._upgrade)

    async def _resend(self) -> None:
        """The pooled connection was stale: the same request once more, on a new one."""
        assert self._replay is not None
        self._retried = True
        head, body = self._replay
        if self._upgrade:  # the handshake waits again (its place went with the failure)
            self._take_upload()
        connection = await self._pool.connect()
        self._attach_connection(connection)
        connection.write(head + body if body else head)
        connection.request_written()

    # --- waiting ----------------------------------------------------------------------------

    async def wait_head(self) -> ResponseHead:
        """Until the engine's response head arrived; raises what went wrong otherwise."""
        while self.head is None:
            if self.error is not None:
                if not self._may_resend():
                    raise self.error
                self.error = None
                await self._resend()
                continue
            await self._next_event()
        if self.error is not None:
            # It broke right behind its head (in the same read): nothing went to the client
            # yet, so it still gets the error rather than a cut stream.
            raise self.error
        return self.head

    async def wait_end(self, idle_timeout: float | None = None) -> None:
        """Until the response ended; raises what went wrong otherwise: the engine's failure,
        `SinkClosedError` once the sink stopped taking bytes, and with an idle timeout
        `RequestTimeoutError` once the engine was silent for longer than that."""
        if idle_timeout is not None and not self.ended:
            self._watch_silence(idle_timeout)
        try:
            while not self.complete:
                if self.error is not None:
                    raise self.error
                if self._sink_closed:
                    raise SinkClosedError("the response body's sink stopped taking bytes")
                if self._silent_too_long:
                    raise RequestTimeoutError(
                        f"the engine sent nothing for TETHER_STREAM_IDLE_TIMEOUT={idle_timeout}s",
                        setting="stream_idle_timeout",
                    )
                await self._next_event()
        finally:
            if self._idle_timeout is not None:
                self._stop_watching()

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

    def _watch_silence(self, idle_timeout: float) -> None:
        """From now on every read notes its time, and one timer watches the silence."""
        self._idle_timeout = idle_timeout
        self._silent_too_long = False
        self._last_data_at = now = self._loop.time()
        self._idle_timer = self._loop.call_at(now + idle_timeout, self._on_idle_timer)
        self._route_body()

    def _on_idle_timer(self) -> None:
        """The timer ran out: the engine was silent all along (the wait ends), or it sent
        something since, and the timer is re-armed for the rest of the silence allowed."""
        assert self._idle_timeout is not None  # (the wait cancels its timer when it ends)
        deadline = self._last_data_at + self._idle_timeout
        if deadline - self._loop.time() > _TIMER_RESOLUTION:
            self._idle_timer = self._loop.call_at(deadline, self._on_idle_timer)
            return
        self._idle_timer = None
        self._silent_too_long = True
        self._signal()

    def _stop_watching(self) -> None:
        self._idle_timeout = None
        if self._idle_timer is not None:
            self._idle_timer.cancel()
            self._idle_timer = None
        self._route_body()

    def _may_resend(self) -> bool:
        connection = self._connection
        return (
            isinstance(self.error, UpstreamUnavailableError)
            and self._replay is not None
            and not self._retried
            and connection is not None
            and connection.reused
        )

    # --- consuming ---------------------------------------------------------------------------

    def attach(self, sink: BodySink) -> None:
        """Send the body (what already arrived, then every chunk as it arrives) to `sink`."""
        self._sink = sink
        pending, self._pending, self._pending_size = self._pending, [], 0
        for chunk in pending:
            sink.feed(chunk)
        self._route_body()
        if pending:
            self.resume_reading()

    def pause_reading(self) -> None:
        if self._connection is not None:
            self._connection.pause_reading()

    # --- an upgraded connection's other direction ---------------------------------------------

    def write(self, data: bytes) -> None:
        """Bytes for the engine on a connection its 101 upgraded (the client's frames)."""
        if self._connection is not None:
            self._connection.write(data)

    @property
    def writing_paused(self) -> bool:
        return self._connection is not None and self._connection.writing_paused

    async def drain(self) -> None:
        """Until the engine has read enough of what was written to it."""
        if self._connection is not None:
            await self._connection.drain()

    def resume_reading(self) -> None:
        if self._connection is not None:
            self._connection.resume_reading()

    def forbid_reuse(self) -> None:
        """Whatever happens now, the connection is closed at the end, never pooled: the
        client left, and tether makes no exception to that rule."""
        if self._connection is not None:
            self._connection.forbid_reuse()

    def on_sink_closed(self) -> None:
        """The sink found where it writes to closed: the wait for the end stops with
        `SinkClosedError`. The response itself goes on (the sink may still count it)."""
        self._sink_closed = True
        self._signal()

    def on_sink_reopened(self) -> None:
        """The sink writes somewhere again (a resumed stream's new connection): the wait for
        the end goes on."""
        self._sink_closed = False

    def close(self) -> None:
        """Drop the upstream connection (never pooled): the engine sees the disconnect.

        `ended_at` stays unset: it records when the engine ended the response, never when
        tether let go of it."""
        connection, self._connection = self._connection, None
        if connection is not None:
            connection.close()
        if self._body_writer is not None and not self._body_writer.done():
            self._body_writer.cancel()
        if not self.ended:
            self.error = UpstreamBrokenError("tether closed the connection")
        self._give_back_upload()
        self._signal()

    # --- told by the connection (ResponseListener) -------------------------------------------

    def on_head(self, head: ResponseHead) -> None:
        self.head = head
        self._replay = None  # answered: it will not be sent again, so not kept either
        self._give_back_upload()  # a handshake answered no longer waits
        self._signal()

    def _on_body(self, chunk: bytes) -> None:
        if self._idle_timeout is not None:
            self._last_data_at = self._loop.time()
        if self.first_body_at is None:
            self.first_body_at = time.monotonic()
            self._route_body()
        sink = self._sink
        if sink is not None:
            sink.feed(chunk)
            return
        self._pending.append(chunk)
        self._pending_size += len(chunk)
        if self._pending_size > _PENDING_LIMIT:
            self.pause_reading()

    def _route_body(self) -> None:
        """In the steady state of a stream (a sink, the first byte noted, no silence to
        watch) the connection hands each read to the sink itself: nothing else to note."""
        connection = self._connection
        if connection is None:
            return
        sink = self._sink
        steady = sink is not None and self.first_body_at is not None and self._idle_timeout is None
        connection.deliver_body_to(sink.feed if steady and sink is not None else self._on_body)

    def on_end(self) -> None:
        if self.ended:
            return
        self.complete = True
        self.ended_at = time.monotonic()
        self._connection = None
        self._signal()

    def on_error(self, error: TetherError) -> None:
        if self.ended:
            return
        self.error = error
        self.ended_at = time.monotonic()
        self._give_back_upload()
        self._signal()
