"""One keep-alive HTTP/1.1 connection to the engine: a state machine over llhttp (`httptools`).

A connection carries one exchange at a time and moves through these states:

    IDLE ──begin──▶ SENDING ──request_written──▶ AWAITING_HEAD ──final head──▶ READING_BODY
                       │                               │                          │
                       └──────── final head (an early answer) ───────────────────▶│
                                                       │                          ▼
                         DONE_REUSABLE (back to the pool: IDLE)  or  DONE_CLOSING ──▶ CLOSED
                                                       │
                                   101, asked for ─────┴──▶ UPGRADED ──▶ CLOSED

Any state ends in CLOSED when the transport goes, a reply is not valid HTTP/1.1, or tether
lets go of the exchange. Which of the two DONE states an ended response leads to is decided
in one place (`_end_of_response`), and only there: a connection is reused when

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
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from enum import Enum
from typing import Protocol, cast

import httptools
from multidict import CIMultiDict, istr

from ..errors import (
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


class ConnectionState(Enum):
    IDLE = "idle"
    SENDING = "sending"
    AWAITING_HEAD = "awaiting_head"
    READING_BODY = "reading_body"
    DONE_REUSABLE = "done_reusable"
    DONE_CLOSING = "done_closing"
    UPGRADED = "upgraded"  # a WebSocket: bytes both ways, unparsed, until it closes
    CLOSED = "closed"


# Where request bytes may still go out: the request itself, or a WebSocket's frames.
_WRITABLE = frozenset({ConnectionState.SENDING, ConnectionState.UPGRADED})


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
        "_bytes_after",
        "_deliver",
        "_drained",
        "_ended",
        "_final_head",
        "_head_only",
        "_head_size",
        "_headers",
        "_keep_alive",
        "_listener",
        "_on_closed",
        "_on_reusable",
        "_parser",
        "_reason",
        "_request_complete",
        "_reuse_forbidden",
        "_trailers",
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
        # The whole request went to the socket before the engine's final head arrived: an
        # early answer leaves it False for good (sending stops at the head).
        self._request_complete = False
        self._reuse_forbidden = False
        self._trailers = False
        self._bytes_after = False  # something followed the response in the same read
        self._final_head = False
        self._ended = False  # llhttp read the final response to its end
        self._keep_alive = False
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
        """IDLE → SENDING: carry `listener`'s exchange, its response body going to
        `body_receiver` one call per read. `head_only` for HEAD requests; `upgrade` for a
        request asking for a WebSocket (a 101 then makes the connection its pipe)."""
        assert self.state is ConnectionState.IDLE and self._listener is None
        self._reset_exchange()
        self._listener = listener
        self._deliver = body_receiver
        self._head_only = head_only
        self._upgrade_asked = upgrade
        self.state = ConnectionState.SENDING

    def deliver_body_to(self, body_receiver: Callable[[bytes], None]) -> None:
        """From now on the response body goes to `body_receiver`."""
        if self._listener is not None:
            self._deliver = body_receiver

    def park(self, now: float) -> None:
        """DONE_REUSABLE → IDLE: in the pool, waiting for the next exchange."""
        assert self.state is ConnectionState.DONE_REUSABLE
        self.state = ConnectionState.IDLE
        self.idle_since = now

    @property
    def sending(self) -> bool:
        """Whether request bytes may still be written: not once the engine answered."""
        return self.state is ConnectionState.SENDING

    def write(self, data: bytes) -> None:
        if self.transport is not None and self.state in _WRITABLE:
            self.transport.write(data)

    @property
    def upgraded(self) -> bool:
        return self.state is ConnectionState.UPGRADED

    @property
    def writing_paused(self) -> bool:
        """The engine's socket buffer is full: it reads slower than tether writes."""
        return self._write_paused

    def request_written(self) -> None:
        """SENDING → AWAITING_HEAD: the last byte of the request went to the socket."""
        if self.state is ConnectionState.SENDING:
            self._request_complete = True
            self.state = ConnectionState.AWAITING_HEAD

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
        self._reuse_forbidden = True

    def close(self) -> None:
        """Let go of the exchange (it hears nothing more) and close the connection."""
        self._listener = None
        self._deliver = _nowhere
        if self.state is not ConnectionState.CLOSED:
            self.state = ConnectionState.DONE_CLOSING
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
            if self._ended:
                # The response was complete; llhttp stopped at what followed it (a stray
                # response, bytes after `Connection: close`): the response stands, the
                # connection does not.
                self._bytes_after = True
                self._end_of_response()
                return
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
        if self._ended:
            self._end_of_response()
        elif self.state is not ConnectionState.READING_BODY and self._listener is not None:
            # llhttp buffers a header that has not ended yet without bound: whatever arrived
            # while the head is still incomplete counts against its limit.
            self._unparsed_head += len(data)
            if self._unparsed_head > MAX_RESPONSE_HEAD:
                self._fail(_head_too_large())

    def connection_lost(self, exc: Exception | None) -> None:
        upgraded = self.state is ConnectionState.UPGRADED
        self.state = ConnectionState.CLOSED
        self.transport = None
        self._on_closed(self)
        if self._drained is not None and not self._drained.done():
            self._drained.set_result(None)
        listener = self._listener
        self._listener = None
        self._deliver = _nowhere
        if listener is None:
            return
        if upgraded or (self._final_head and self._body_ends_at_close):
            listener.on_end()  # the body was delimited by the close
        elif self._final_head:
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
        if self._ended:
            raise _ResponseOver()  # a further message in the same read: not ours to parse

    def on_status(self, reason: bytes) -> None:
        self._reason += reason
        self._count_head(len(reason))

    def on_header(self, name: bytes, value: bytes) -> None:
        if self.state is ConnectionState.READING_BODY:
            self._trailers = True  # a trailer field: dropped, and the connection with it
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
            self._final_head = True
            self.state = ConnectionState.UPGRADED
            if self._listener is not None:
                self._listener.on_head(ResponseHead(status, reason, headers))
            return
        if status < 200:  # 1xx: informational, the real head follows
            return
        _check_framing(headers)
        self._body_ends_at_close = (
            _CONTENT_LENGTH not in headers and _TRANSFER_ENCODING not in headers
        )
        self._final_head = True
        self.state = ConnectionState.READING_BODY
        listener = self._listener
        if listener is not None:
            listener.on_head(ResponseHead(status, reason, headers))
        if self._head_only:
            # A HEAD response has no body, which llhttp cannot know: the message ends here,
            # and the connection, whose parser now expects one, is not reused (llhttp never
            # said keep-alive for it).
            self._ended = True

    def on_body(self, body: bytes) -> None:
        # An engine frames every event as its own HTTP chunk; when it outpaces the relay a
        # read holds hundreds of them. The pieces of one read go on together, after it is
        # parsed (`_deliver_body`): one pass through the relay per read, not per event.
        if not self._ended:
            self._body.append(body)

    def on_message_complete(self) -> None:
        if self.state is not ConnectionState.READING_BODY:
            return  # the end of a 1xx message
        if not self._ended:
            self._ended = True
            self._keep_alive = self._parser.should_keep_alive()

    # --- the one decision ------------------------------------------------------------------

    def _end_of_response(self) -> None:
        """The response was read to its end: DONE_REUSABLE back to the pool, or DONE_CLOSING."""
        listener = self._listener
        reusable = (
            self._keep_alive
            and self._request_complete
            and not self._trailers
            and not self._bytes_after
            and not self._reuse_forbidden
            and self.transport is not None
            and not self.transport.is_closing()
        )
        self._listener = None
        self._deliver = _nowhere
        if reusable:
            self.state = ConnectionState.DONE_REUSABLE
            self.reused = True
            self._on_reusable(self)
        else:
            self.close()
        if listener is not None:
            listener.on_end()

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
