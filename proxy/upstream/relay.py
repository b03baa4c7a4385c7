"""Where the engine's response body goes, chunk by chunk, straight from the upstream
protocol's `data_received`: into the client's socket as it arrives (the hot path), into a
buffer (a JSON answer rewritten whole, for an exact Content-Length), or nowhere once the
client has left, while tether waits for the engine to confirm it stopped. In every mode each
chunk is counted, so tether knows the tokens it relayed and those generated after the client
left."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from enum import Enum

from aiohttp.abc import AbstractStreamWriter
from mypy_extensions import mypyc_attr

from ..wire.answer_assembly import AnswerAssembler
from ..wire.event_log import EventLog
from ..wire.ids import IdMapper
from ..wire.tokens import TokenCounter
from ..wire.usage_events import UsageEventFilter
from .backpressure import ReadPacer
from .exchange import UpstreamExchange

# Below this a chunk is copied into its chunked framing (one buffer is cheaper to send than
# three); above it the framing goes out beside it (aiohttp's own threshold).
_COPY_BELOW = 2048


class _Mode(Enum):
    HOLD = 0  # nothing decided yet: chunks are counted only (waiting for the client side)
    CLIENT = 1
    BUFFER = 2
    DISCARD = 3  # the client has left
    # Its caller cancelled it: the event in progress goes to the client, nothing after it.
    ENDING = 4
    # Its client is away, and may resume: events are numbered and held, not written.
    HELD = 5


# Compiled, a class may only be subclassed in Python where it says so: the tests inject a
# fault into a relay that way (tests/test_internal_errors.py). Calls to its methods from
# compiled code then go through its method table, one indirection.
@mypyc_attr(allow_interpreted_subclasses=True)
class ResponseRelay:
    """The sink of one exchange's response body."""

    __slots__ = (
        "_assembler",
        "_buffer",
        "_chunked",
        "_events",
        "_exchange",
        "_high_water",
        "_is_sse",
        "_last_written",
        "_mapper",
        "_mode",
        "_on_boundary",
        "_on_overflow",
        "_pacer",
        "_transport",
        "_usage",
        "bytes_out",
        "ended_at_boundary",
        "sse_events",
        "tokens",
        "tokens_relayed",
    )

    def __init__(
        self,
        exchange: UpstreamExchange,
        tokens: TokenCounter,
        mapper: IdMapper | None,
        usage: UsageEventFilter | None = None,
        assembler: AnswerAssembler | None = None,
        events: EventLog | None = None,
    ) -> None:
        self._exchange = exchange
        # BUFFER mode reads a stream into the non-streaming answer it makes, not into bytes.
        self._assembler = assembler
        self._mapper = mapper
        # Takes out the usage event tether asked for (counted above, never relayed).
        self._usage = usage
        # Numbers the events the client gets and holds the latest, for a resume (None: its
        # client cannot resume).
        self._events = events
        self._on_overflow: Callable[[], None] | None = None
        self._mode = _Mode.HOLD
        self._transport: asyncio.Transport | None = None
        self._chunked = False
        self._is_sse = False
        self._high_water = 0
        # Pauses reading the engine while the client's socket buffer drains.
        self._pacer: ReadPacer | None = None
        self._buffer: list[bytes] = []
        self._last_written = b""
        self._on_boundary: Callable[[], None] | None = None
        # The client's stream was ended after a whole event (a cancel by ID): its response
        # can be finished cleanly.
        self.ended_at_boundary = False
        self.tokens = tokens
        # Token-carrying events that went to the client (set when it leaves; until then
        # every counted event did).
        self.tokens_relayed: int | None = None
        self.bytes_out = 0
        self.sse_events = 0

    # --- modes ---------------------------------------------------------------------------

    def to_client(
        self,
        transport: asyncio.Transport,
        writer: AbstractStreamWriter,
        *,
        chunked: bool,
        is_sse: bool,
    ) -> None:
        """Relay to the client, whose response head already went out through `writer`."""
        self._is_sse = is_sse
        self._write_to(transport, writer, chunked=chunked)

    def _write_to(
        self, transport: asyncio.Transport, writer: AbstractStreamWriter, *, chunked: bool
    ) -> None:
        self._transport = transport
        self._pacer = ReadPacer(self._exchange, writer.drain, self._transport_closed)
        self._chunked = chunked
        self._high_water = transport.get_write_buffer_limits()[1]
        self._mode = _Mode.CLIENT

    def to_buffer(self) -> None:
        self._mode = _Mode.BUFFER

    def discard(self) -> None:
        """The client has left: stop relaying, keep counting, and never hold the engine up."""
        if self._mode is _Mode.DISCARD:
            return
        if self.tokens_relayed is None:
            relaying = self._mode is _Mode.CLIENT or self._mode is _Mode.ENDING
            self.tokens_relayed = self.tokens.events if relaying else 0
        self._mode = _Mode.DISCARD
        if self._events is not None:
            self._events.release()
        self._exchange.forbid_reuse()
        if self._pacer is not None:
            self._pacer.stop()
        self._exchange.resume_reading()

    def hold(self, on_overflow: Callable[[], None] | None = None) -> None:
        """Its client is away and may resume: from here the events are held, not written, and
        `on_overflow` is called once more is held than allowed. (Reading the engine goes on
        unpaced: the bound on what is held bounds it.)"""
        assert self._events is not None
        if on_overflow is not None:
            if self._events.over_limit:
                on_overflow()
            else:
                self._on_overflow = on_overflow
        if self._mode is _Mode.HELD:
            return
        if self.tokens_relayed is None:
            self.tokens_relayed = self.tokens.events
        self._mode = _Mode.HELD
        if self._pacer is not None:
            self._pacer.stop()
        self._exchange.resume_reading()

    def resume(
        self,
        transport: asyncio.Transport,
        writer: AbstractStreamWriter,
        *,
        chunked: bool,
        last_received: int,
    ) -> bool:
        """Relay to another connection of the same client (whose response head went out
        through `writer`): every event after `last_received` first, then the rest as it comes.
        False, and nothing changes, when those events are no longer held."""
        assert self._events is not None
        backlog = self._events.since(last_received)
        if backlog is None or self._mode not in (_Mode.CLIENT, _Mode.HELD):
            return False
        if self._pacer is not None:
            self._pacer.stop()
        self._on_overflow = None
        self.tokens_relayed = None
        self._write_to(transport, writer, chunked=chunked)
        if backlog:
            self._write(transport, backlog)
            self._last_written = backlog
        return True

    def release_events(self) -> None:
        """No resume can come any more: what the events held goes back to the budget."""
        if self._events is not None:
            self._events.release()

    def holds_after(self, last_received: int) -> bool:
        """Whether every event after `last_received` is still held."""
        return self._events is not None and self._events.since(last_received) is not None

    @property
    def resumable(self) -> bool:
        """Its client may resume it: its events are numbered and held, and it still relays."""
        return self._events is not None and self._mode in (_Mode.CLIENT, _Mode.HELD)

    @property
    def events_sent(self) -> int:
        """Events begun on the way to the client (the last `id:` it may have seen)."""
        return self._events.number if self._events is not None else 0

    def end_at_event_boundary(self, then: Callable[[], None]) -> None:
        """Its caller cancelled the request: the client's stream ends after the event in
        progress (never inside one), then `then` is called; at once where no event is in
        progress, or where the body is not a stream of events (it can only be cut)."""
        if self._mode is not _Mode.CLIENT or not self._is_sse:
            then()
            return
        self._on_boundary = then
        if self.bytes_out == 0 or _event_end(b"", self._last_written) == 0:
            self._end_here()
        else:
            self._mode = _Mode.ENDING

    def _end_here(self) -> None:
        self.ended_at_boundary = True
        self.discard()
        then, self._on_boundary = self._on_boundary, None
        if then is not None:
            then()

    # --- the hot path ----------------------------------------------------------------------

    def feed(self, chunk: bytes) -> None:
        self.tokens.feed(chunk)
        mode = self._mode
        if mode is _Mode.BUFFER:
            if self._assembler is not None:
                self._assembler.feed(chunk)
            else:
                self._buffer.append(chunk)
            return
        if mode is not _Mode.CLIENT and mode is not _Mode.ENDING and mode is not _Mode.HELD:
            return
        if self._usage is not None:
            chunk = self._usage.feed(chunk)
            if not chunk:
                return
        if self._mapper is not None:
            chunk = self._mapper.feed(chunk)
            if not chunk:
                return
        if self._events is not None:
            held = mode is _Mode.HELD
            chunk = self._events.feed(chunk, drop_oldest=not held)
            if held:
                if self._events.over_limit and self._on_overflow is not None:
                    on_overflow, self._on_overflow = self._on_overflow, None
                    on_overflow()
                return
        end = -1
        if mode is _Mode.ENDING:
            end = _event_end(chunk, self._last_written)
            if end >= 0:
                chunk = chunk[:end]
        transport = self._transport
        assert transport is not None
        if transport.is_closing():
            self._transport_closed()
            return
        if chunk:  # (else the event in progress had ended with the last write)
            self._write(transport, chunk)
        self.bytes_out += len(chunk)
        self._last_written = chunk
        if self._is_sse:
            self.sse_events += chunk.count(b"\n\n")
        if end >= 0:
            self._end_here()
            return
        if transport.get_write_buffer_size() > self._high_water:
            # The client reads slower than the engine writes: stop reading the engine until
            # the client's socket drains (TCP flow control then paces the engine).
            assert self._pacer is not None
            self._pacer.pause_until_drained()

    def _write(self, transport: asyncio.Transport, chunk: bytes) -> None:
        if not self._chunked:
            transport.write(chunk)
        elif len(chunk) < _COPY_BELOW:
            transport.write(b"%x\r\n%b\r\n" % (len(chunk), chunk))
        else:  # a large read (the engine outpacing the client): framed without a copy
            transport.writelines((b"%x\r\n" % len(chunk), chunk, b"\r\n"))

    def _transport_closed(self) -> None:
        """Where the body goes closed: relaying stops (events a client may resume are still
        numbered and kept until the handler decides), and the exchange's reader hears of it
        (the handler takes it for its client leaving)."""
        if self.resumable:
            self.hold()
        else:
            self.discard()
        self._exchange.on_sink_closed()

    # --- the end ---------------------------------------------------------------------------

    def finish(self) -> None:
        """The engine's response ended: what the usage filter and the ID mapper still held
        goes out."""
        if self._mode is not _Mode.CLIENT:
            return
        tail = self._usage.flush() if self._usage is not None else b""
        if self._mapper is not None:
            tail = self._mapper.feed(tail) + self._mapper.flush()
        if tail:
            self._write_tail(tail)

    def _write_tail(self, tail: bytes) -> None:
        if self._events is not None:
            tail = self._events.feed(tail)  # (held for a resume, even if the write fails)
        transport = self._transport
        assert transport is not None
        if transport.is_closing():
            self._transport_closed()
            return
        self._write(transport, tail)
        self.bytes_out += len(tail)

    @property
    def engine_reports_usage(self) -> bool:
        """The engine put usage in this stream unasked (tether asked anyway)."""
        return self._usage is not None and self._usage.engine_reports_usage

    def take_buffered(self) -> bytes:
        """The whole body read in BUFFER mode, IDs mapped back: what the client gets."""
        body = b"".join(self._buffer)
        self._buffer.clear()
        if self._mapper is not None:
            body = self._mapper.feed(body) + self._mapper.flush()
        self.bytes_out = len(body)
        return body

    @property
    def relaying(self) -> bool:
        return self._mode is _Mode.CLIENT

    # --- keep-alive comments (`stream_keepalive`) ------------------------------------------

    def write_between_events(self, comment: bytes) -> bool:
        """`comment` (a whole SSE comment) to the client, framed as every write is, where its
        stream stands between two events: nothing written yet, or what was written last ended
        an event. Bytes the ID mapper or the usage filter hold back come after what was
        written, so the comment never splits an event. Nothing is written (False) where the
        stream is inside an event, is not relayed to the client (any other mode), or has bytes
        waiting in the socket's buffer (the client is not idle: it is slow). Neither body
        bytes nor an event: `bytes_out` and `sse_events` count the engine's."""
        transport = self._transport
        if (
            self._mode is not _Mode.CLIENT
            or not self._is_sse
            or transport is None
            or transport.is_closing()
            or transport.get_write_buffer_size() > 0
            or (self.bytes_out > 0 and _event_end(b"", self._last_written) != 0)
        ):
            return False
        transport.write(b"%x\r\n%b\r\n" % (len(comment), comment) if self._chunked else comment)
        return True


def _event_end(chunk: bytes, before: bytes) -> int:
    """Where the first server-sent event ending in `chunk` ends (the length of `chunk` up to
    and with its blank line), -1 when none does; `before`: the bytes written just before it,
    for a blank line split across chunks (an empty `chunk`: 0 when `before` ended an event)."""
    for done, rest in _SPLIT_BLANK_LINES:
        if before.endswith(done) and chunk.startswith(rest):
            return len(rest)
    ends = [at + len(mark) for mark in (b"\n\n", b"\r\n\r\n") if (at := chunk.find(mark)) >= 0]
    return min(ends) if ends else -1


# An event's blank line as two writes may split it: what the first ended with, what the
# second must start with.
_SPLIT_BLANK_LINES = (
    (b"\n\n", b""),
    (b"\r\n\r\n", b""),
    (b"\n", b"\n"),
    (b"\r\n", b"\r\n"),
    (b"\r\n\r", b"\n"),
)
