"""One keep-alive HTTP/1.1 connection to the engine: a state machine over llhttp (`httptools`).

A connection carries one exchange at a time. Its legal moves are one table (`TRANSITIONS`,
as h11's `_state.py` keeps them): a state and an event give the next state, and an event the
table has no move for is tether's bug, raised at once (`ConnectionStateError`), never a
silent state. The table, drawn (tests/test_upstream_connection.py fails when the two differ):

    idle            ──begin───────────▶ sending
    sending         ──request_written─▶ awaiting_head
    sending         ──final_head──────▶ reading_body
    awaiting_head   ──final_head──────▶ reading_body
    awaiting_head   ──switched────────▶ upgraded
    reading_body    ──response_end────▶ response_read
    response_read   ──keep────────────▶ done_reusable
    done_reusable   ──park────────────▶ idle
    closed          ──close───────────▶ closed
    any other state ──close───────────▶ done_closing
    any state       ──lost────────────▶ closed

`final_head` from `sending` is an early answer (a 401, 404 or 413 before the whole body);
1xx heads are not final and move nothing; `switched` is a 101 to an exchange that asked for a
WebSocket; `response_end` is llhttp reading the response to its end (a HEAD response's: its
head); `close` is tether letting go (or a reply that failed); `lost`, the transport gone.

Which of the two ends a read response leads to (`keep`, or `close`) is decided in one place
(`_end_of_response`) from one flag, `_keep_alive` (as h11's), which every exchange starts with
and whatever rules reuse out clears where it is found. A connection is reused when

- the whole request was handed to the socket before the engine's final head arrived (an
  engine that answers early, a 401, 404 or 413, discards the rest of the body by its length;
  a next request written there would land inside that body),
- llhttp read the response to its end and says the connection stays open (keep-alive,
  HTTP/1.1, no `Connection: close`); a response to HEAD, whose end tether decides because
  llhttp cannot know it has no body, never is,
- nothing followed the response in the same read, and it had no trailer fields, and
- nobody forbade it (the client left).

Framing is llhttp's alone: it frames by the last `Transfer-Encoding` coding, rejects a
`Content-Length` beside it, duplicates and bad digits. tether refuses what llhttp would read
one way and a client another (a `Transfer-Encoding` that is not exactly one `chunked`, as
nginx does) and reads no length or coding a second time; a body ends at the connection's
close only where its head had neither field. Trailer fields are dropped (nginx does too).

A `101 Switching Protocols` is accepted only from an exchange that asked for a WebSocket
(`begin(upgrade=True)`) and only with `Upgrade: websocket`: from then on the connection is a
byte pipe both ways (nothing is parsed, it is never reused) until either side closes it.
Anywhere else a 101 is a protocol error, as before.

No socket is needed to drive it: `connection_made` with any transport-like object, then
`data_received` and `connection_lost`, is the whole interface to the network.

One module, longer than most: the table, the llhttp callbacks that produce its events and the
reuse rules above are one state machine; split, a move would live in one file and the event
that makes it in another, which is how the old nine scattered assignments drifted.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from enum import StrEnum
from typing import Final, Protocol, cast

import httptools
from multidict import CIMultiDict, istr
from mypy_extensions import mypyc_attr

from ..errors import (
    InternalError,
    TetherError,
    UpstreamBrokenError,
    UpstreamProtocolError,
    UpstreamUnavailableError,
)

# The engine's status line and headers together may not exceed this (aiohttp's limit was
# 8 KiB per line; llhttp has none of its own).
MAX_RESPONSE_HEAD = 64 * 1024

_CONTENT_LENGTH = istr("Content-Length")
_TRANSFER_ENCODING = istr("Transfer-Encoding")


# StrEnums: a (state, event) key hashes as its two strings do, in C, once per move.
class ConnectionState(StrEnum):
    IDLE = "idle"
    SENDING = "sending"
    AWAITING_HEAD = "awaiting_head"
    READING_BODY = "reading_body"
    RESPONSE_READ = "response_read"  # to its end; the rest of the same read decides reuse
    DONE_REUSABLE = "done_reusable"
    DONE_CLOSING = "done_closing"
    UPGRADED = "upgraded"  # a WebSocket: bytes both ways, unparsed, until it closes
    CLOSED = "closed"


class ConnectionEvent(StrEnum):
    BEGIN = "begin"
    REQUEST_WRITTEN = "request_written"
    FINAL_HEAD = "final_head"
    SWITCHED = "switched"
    RESPONSE_END = "response_end"
    KEEP = "keep"
    PARK = "park"
    CLOSE = "close"
    LOST = "lost"


def _transitions() -> dict[tuple[ConnectionState, ConnectionEvent], ConnectionState]:
    state, event = ConnectionState, ConnectionEvent
    table = {
        (state.IDLE, event.BEGIN): state.SENDING,
        (state.SENDING, event.REQUEST_WRITTEN): state.AWAITING_HEAD,
        (state.SENDING, event.FINAL_HEAD): state.READING_BODY,  # an early answer
        (state.AWAITING_HEAD, event.FINAL_HEAD): state.READING_BODY,
        (state.AWAITING_HEAD, event.SWITCHED): state.UPGRADED,
        (state.READING_BODY, event.RESPONSE_END): state.RESPONSE_READ,
        (state.RESPONSE_READ, event.KEEP): state.DONE_REUSABLE,
        (state.DONE_REUSABLE, event.PARK): state.IDLE,
        (state.CLOSED, event.CLOSE): state.CLOSED,
    }
    for each in ConnectionState:
        if each is not state.CLOSED:
            table[each, event.CLOSE] = state.DONE_CLOSING
        table[each, event.LOST] = state.CLOSED
    return table


# Every legal move: (state, event) -> the next state. The module docstring draws it.
TRANSITIONS: Final = _transitions()


# (mypyc compiles no subclass of a built-in exception but as a regular Python class.)
@mypyc_attr(native_class=False)
class ConnectionStateError(RuntimeError):
    """An event the connection's table has no move for in its state: a bug in tether."""

    def __init__(self, state: ConnectionState, event: ConnectionEvent) -> None:
        super().__init__(f"the engine connection has no move for {event} in state {state}")


class ResponseHead:
    """The engine's status line and headers (informational 1xx heads are never one)."""

    __slots__ = ("content_length", "headers", "reason", "status")

    def __init__(self, status: int, reason: str, headers: CIMultiDict[str]) -> None:
        self.status = status
        self.reason = reason
        self.headers = headers
        # llhttp has validated it (digits only, one field, never beside Transfer-Encoding):
        # read here only to decide whether the body is small enough to buffer.
        length = headers.get(_CONTENT_LENGTH)
        self.content_length = int(length) if length is not None and length.isdigit() else None


class ResponseListener(Protocol):
    """The exchange a connection is carrying: told about its response as it is parsed."""

    def on_head(self, head: ResponseHead) -> None: ...

    def on_end(self) -> None: ...

    def on_error(self, error: TetherError) -> None: ...


class _ResponseOver(Exception):
    """Raised inside llhttp to stop it at bytes that follow a complete response."""


class UpstreamConnection(asyncio.Protocol):
    """One TCP connection to the engine; llhttp calls the `on_*` methods as it parses."""

    # One per open stream: no per-instance dict.
    __slots__ = (
        "_body",
        "_body_ends_at_close",
        "_deliver",
        "_drained",
        "_head_only",
        "_head_size",
        "_headers",
        "_keep_alive",
        "_listener",
        "_on_closed",
        "_on_reusable",
        "_parser",
        "_reason",
        "_unparsed_head",
        "_upgrade_asked",
        "_write_paused",
        "idle_since",
        "received",
        "reused",
        "state",
        "transport",
    )

    def __init__(
        self,
        on_reusable: Callable[[UpstreamConnection], None],
        on_closed: Callable[[UpstreamConnection], None],
    ) -> None:
        self._on_reusable = on_reusable  # the pool takes it back
        self._on_closed = on_closed  # the pool forgets it
        self._parser = httptools.HttpResponseParser(self)
        self.transport: asyncio.Transport | None = None
        self.state = ConnectionState.IDLE
        self.reused = False  # it served an exchange before this one
        self.idle_since = 0.0
        self._listener: ResponseListener | None = None
        self._deliver: Callable[[bytes], None] = _nowhere
        self._body: list[bytes] = []  # the body pieces of the read being parsed
        self._headers: list[tuple[str, str]] = []
        self._reason = b""
        self._write_paused = False
        self._drained: asyncio.Future[None] | None = None
        self._reset_exchange()

    def _reset_exchange(self) -> None:
        self.received = 0  # bytes of the current exchange's response so far
        self._head_size = self._unparsed_head = 0
        self._head_only = False
        self._upgrade_asked = False
        # The connection may go back to the pool when this exchange ends: cleared by an
        # early answer, a response to HEAD, llhttp's keep-alive verdict, trailer fields,
        # bytes after the response, and `forbid_reuse`.
        self._keep_alive = True
        self._body_ends_at_close = False
        self._headers = []
        self._reason = b""

    # --- the exchange's side ---------------------------------------------------------------

    def begin(
        self,
        listener: ResponseListener,
        body_receiver: Callable[[bytes], None],
        *,
        head_only: bool,
        upgrade: bool = False,
    ) -> None:
        """`begin`: carry `listener`'s exchange, its response body going to `body_receiver`
        one call per read. `head_only` for HEAD requests; `upgrade` for a request asking for
        a WebSocket (a 101 then makes the connection its pipe)."""
        self._move(ConnectionEvent.BEGIN)
        self._reset_exchange()
        self._listener = listener
        self._deliver = body_receiver
        self._head_only = head_only
        self._upgrade_asked = upgrade

    def deliver_body_to(self, body_receiver: Callable[[bytes], None]) -> None:
        """From now on the response body goes to `body_receiver`."""
        if self._listener is not None:
            self._deliver = body_receiver

    def park(self, now: float) -> None:
        """`park`: in the pool, waiting for the next exchange."""
        self._move(ConnectionEvent.PARK)
        self.idle_since = now

    @property
    def sending(self) -> bool:
        """Whether request bytes may still be written: not once the engine answered."""
        return self.state is ConnectionState.SENDING

    def write(self, data: bytes) -> None:
        """Request bytes, or a WebSocket's frames: dropped once the engine answered or the
        connection closed."""
        state = self.state
        if self.transport is not None and (
            state is ConnectionState.SENDING or state is ConnectionState.UPGRADED
        ):
            self.transport.write(data)

    @property
    def upgraded(self) -> bool:
        return self.state is ConnectionState.UPGRADED

    @property
    def writing_paused(self) -> bool:
        """The engine's socket buffer is full: it reads slower than tether writes."""
        return self._write_paused

    def request_written(self) -> None:
        """`request_written`: the last byte of the request went to the socket (called only
        while `sending`: an engine that answered first stopped the sending)."""
        self._move(ConnectionEvent.REQUEST_WRITTEN)

    async def drain(self) -> None:
        """Until the engine has read enough of what was written (TCP flow control)."""
        if not self._write_paused or self.transport is None:
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

    def forbid_reuse(self) -> None:
        """Whatever happens now, this exchange's end closes the connection."""
        self._keep_alive = False

    def close(self) -> None:
        """`close`: let go of the exchange (it hears nothing more) and close the connection."""
        self._listener = None
        self._deliver = _nowhere
        self._move(ConnectionEvent.CLOSE)
        if self.transport is not None:
            self.transport.close()

    # --- asyncio.Protocol --------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not subclasses of asyncio's, only alike.
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        if self.state is ConnectionState.UPGRADED:
            self._deliver(data)  # the WebSocket's bytes, as they came
            return
        if self._listener is None:
            # Bytes nobody asked for (on an idle connection, or after tether let go of a
            # response): this connection can no longer be trusted for a new request.
            self.close()
            return
        self.received += len(data)
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserUpgrade as upgrade:
            if self.upgraded:  # (the head's callback just made it so)
                # What followed the 101 head in the same read is the WebSocket's first bytes.
                rest = data[upgrade.args[0] :]
                if rest:
                    self._deliver(rest)
                return
            self._deliver_body()
            self._fail(UpstreamProtocolError("the engine switched protocols unasked"))
            return
        except httptools.HttpParserError as exc:
            self._deliver_body()  # what arrived before the fault still goes where it belongs
            if self.state is ConnectionState.RESPONSE_READ:
                # The response was complete; llhttp stopped at what followed it (a stray
                # response, bytes after `Connection: close`): the response stands, the
                # connection does not.
                self._keep_alive = False
                self._end_of_response()
                return
            # A callback below that refused the reply raised a TetherError, which llhttp
            # reports as the context of its own error; one that met a move the table does not
            # have is tether's bug, never the engine's.
            cause = exc.__context__
            if isinstance(cause, TetherError):
                self._fail(cause)
            elif isinstance(cause, ConnectionStateError):
                self._fail(InternalError(str(cause)))
            else:
                self._fail(
                    UpstreamProtocolError(
                        f"the engine's reply is not valid HTTP/1.1 ({exc.__class__.__name__})"
                    )
                )
            return
        self._deliver_body()
        if self.state is ConnectionState.RESPONSE_READ:
            self._end_of_response()
        elif self.state is not ConnectionState.READING_BODY and self._listener is not None:
            # llhttp buffers a header that has not ended yet without bound: whatever arrived
            # while the head is still incomplete counts against its limit.
            self._unparsed_head += len(data)
            if self._unparsed_head > MAX_RESPONSE_HEAD:
                self._fail(_head_too_large())

    def connection_lost(self, exc: Exception | None) -> None:
        was = self.state
        self._move(ConnectionEvent.LOST)
        self.transport = None
        self._on_closed(self)
        if self._drained is not None and not self._drained.done():
            self._drained.set_result(None)
        listener = self._listener
        self._listener = None
        self._deliver = _nowhere
        if listener is None:
            return
        # An exchange still listening is in one of four states: it ends as they say.
        if was is ConnectionState.UPGRADED or (
            was is ConnectionState.READING_BODY and self._body_ends_at_close
        ):
            listener.on_end()  # the body was delimited by the close
        elif was is ConnectionState.READING_BODY:
            listener.on_error(UpstreamBrokenError("the engine's response broke off"))
        elif self.received:
            listener.on_error(
                UpstreamProtocolError("the engine closed the connection inside its reply head")
            )
        else:
            listener.on_error(
                UpstreamUnavailableError("the engine closed the connection before answering")
            )

    def pause_writing(self) -> None:
        self._write_paused = True

    def resume_writing(self) -> None:
        self._write_paused = False
        if self._drained is not None and not self._drained.done():
            self._drained.set_result(None)

    # --- llhttp callbacks --------------------------------------------------------------------

    def on_message_begin(self) -> None:
        if self.state is ConnectionState.RESPONSE_READ:
            raise _ResponseOver()  # a further message in the same read: not ours to parse

    def on_status(self, reason: bytes) -> None:
        self._reason += reason
        self._count_head(len(reason))

    def on_header(self, name: bytes, value: bytes) -> None:
        if self.state is ConnectionState.READING_BODY:
            self._keep_alive = False  # a trailer field: dropped, and the connection with it
            return
        self._count_head(len(name) + len(value) + 4)
        self._headers.append((name.decode("latin-1"), value.decode("latin-1")))

    def on_headers_complete(self) -> None:
        status = self._parser.get_status_code()
        headers, self._headers = CIMultiDict(self._headers), []
        reason, self._reason = self._reason.decode("latin-1"), b""
        self._head_size = self._unparsed_head = 0
        if status == 101 and self._upgrade_asked:
            _check_upgrade(headers)
            self._move(ConnectionEvent.SWITCHED)
            if self._listener is not None:
                self._listener.on_head(ResponseHead(status, reason, headers))
            return
        if status < 200:  # 1xx: informational, the real head follows
            return
        _check_framing(headers)
        self._body_ends_at_close = (
            _CONTENT_LENGTH not in headers and _TRANSFER_ENCODING not in headers
        )
        if self.state is ConnectionState.SENDING:
            self._keep_alive = False  # an early answer: the request never ended
        self._move(ConnectionEvent.FINAL_HEAD)
        listener = self._listener
        if listener is not None:
            listener.on_head(ResponseHead(status, reason, headers))
        if self._head_only:
            # A HEAD response has no body, which llhttp cannot know: the message ends here,
            # and the connection, whose parser now expects one, is not reused.
            self._keep_alive = False
            self._move(ConnectionEvent.RESPONSE_END)

    def on_body(self, body: bytes) -> None:
        # An engine frames every event as its own HTTP chunk; when it outpaces the relay a
        # read holds hundreds of them. The pieces of one read go on together, after it is
        # parsed (`_deliver_body`): one pass through the relay per read, not per event.
        # (A HEAD response's "body", which llhttp expects by its length, is dropped.)
        if self.state is ConnectionState.READING_BODY:
            self._body.append(body)

    def on_message_complete(self) -> None:
        # The end of the response being read; not that of a 1xx message before its final
        # head, nor that of a HEAD response's expected body.
        if self.state is ConnectionState.READING_BODY:
            if not self._parser.should_keep_alive():
                self._keep_alive = False
            self._move(ConnectionEvent.RESPONSE_END)

    # --- the one decision ------------------------------------------------------------------

    def _end_of_response(self) -> None:
        """The response was read to its end: `keep` (back to the pool), or `close`."""
        listener = self._listener
        reusable = (
            self._keep_alive and self.transport is not None and not self.transport.is_closing()
        )
        self._listener = None
        self._deliver = _nowhere
        if reusable:
            self._move(ConnectionEvent.KEEP)
            self.reused = True
            self._on_reusable(self)
        else:
            self.close()
        if listener is not None:
            listener.on_end()

    def _move(self, event: ConnectionEvent) -> None:
        following = TRANSITIONS.get((self.state, event))
        if following is None:
            raise ConnectionStateError(self.state, event)
        self.state = following

    def _deliver_body(self) -> None:
        body = self._body
        if not body:
            return
        chunk = body[0] if len(body) == 1 else b"".join(body)
        body.clear()
        self._deliver(chunk)

    def _count_head(self, size: int) -> None:
        self._head_size += size
        if self._head_size > MAX_RESPONSE_HEAD:
            raise _head_too_large()

    def _fail(self, error: TetherError) -> None:
        listener = self._listener
        self.close()
        if listener is not None:
            listener.on_error(error)


def _check_framing(headers: CIMultiDict[str]) -> None:
    """Refuse a coding llhttp would frame differently from a reader of the first field, or
    that would reach the client undecoded (`gzip, chunked`): one `Transfer-Encoding` field,
    `chunked` alone, or none."""
    codings = headers.getall(_TRANSFER_ENCODING, ())
    if codings and (len(codings) > 1 or codings[0].strip().lower() != "chunked"):
        raise UpstreamProtocolError(
            "the engine's reply has a Transfer-Encoding other than chunked: "
            + ", ".join(repr(coding) for coding in codings)
        )


def _check_upgrade(headers: CIMultiDict[str]) -> None:
    """A 101 must switch to what was asked for (RFC 6455 §4.1: `Upgrade: websocket`)."""
    if headers.get("Upgrade", "").strip().lower() != "websocket":
        raise UpstreamProtocolError(
            "the engine switched protocols to something other than a WebSocket: "
            + repr(headers.get("Upgrade", ""))
        )


def _head_too_large() -> UpstreamProtocolError:
    return UpstreamProtocolError(f"the engine's reply head exceeds {MAX_RESPONSE_HEAD} bytes")


def _nowhere(chunk: bytes) -> None:
    """The body's receiver while nobody listens."""
