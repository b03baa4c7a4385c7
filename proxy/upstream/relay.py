"""Where the engine's response body goes, chunk by chunk, straight from the upstream
protocol's `data_received`: into the client's socket as it arrives (the hot path), into a
buffer (a JSON answer rewritten whole, for an exact Content-Length), or nowhere once the
client has left, while tether waits for the engine to confirm it stopped. In every mode each
chunk is counted, so tether knows the tokens it relayed and those generated after the client
left."""

from __future__ import annotations

import asyncio
from enum import Enum

from aiohttp.abc import AbstractStreamWriter
from mypy_extensions import mypyc_attr

from ..wire.answer_assembly import AnswerAssembler
from ..wire.ids import IdMapper
from ..wire.tokens import TokenCounter
from ..wire.usage_events import UsageEventFilter
from .exchange import UpstreamExchange

# Below this a chunk is copied into its chunked framing (one buffer is cheaper to send than
# three); above it the framing goes out beside it (aiohttp's own threshold).
_COPY_BELOW = 2048


class _Mode(Enum):
    HOLD = 0  # nothing decided yet: chunks are counted only (waiting for the client side)
    CLIENT = 1
    BUFFER = 2
    DISCARD = 3  # the client has left


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
        "_drain",
        "_exchange",
        "_high_water",
        "_is_sse",
        "_mapper",
        "_mode",
        "_transport",
        "_usage",
        "_writer",
        "bytes_out",
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
    ) -> None:
        self._exchange = exchange
        # BUFFER mode reads a stream into the non-streaming answer it makes, not into bytes.
        self._assembler = assembler
        self._mapper = mapper
        # Takes out the usage event tether asked for (counted above, never relayed).
        self._usage = usage
        self._mode = _Mode.HOLD
        self._transport: asyncio.Transport | None = None
        self._writer: AbstractStreamWriter | None = None
        self._chunked = False
        self._is_sse = False
        self._high_water = 0
        self._drain: asyncio.Task[None] | None = None
        self._buffer: list[bytes] = []
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
        self._transport = transport
        self._writer = writer
        self._chunked = chunked
        self._is_sse = is_sse
        self._high_water = transport.get_write_buffer_limits()[1]
        self._mode = _Mode.CLIENT

    def to_buffer(self) -> None:
        self._mode = _Mode.BUFFER

    def discard(self) -> None:
        """The client has left: stop relaying, keep counting, and never hold the engine up."""
        if self._mode is _Mode.DISCARD:
            return
        if self.tokens_relayed is None:
            self.tokens_relayed = self.tokens.events if self._mode is _Mode.CLIENT else 0
        self._mode = _Mode.DISCARD
        self._exchange.forbid_reuse()
        if self._drain is not None:
            self._drain.cancel()
            self._drain = None
        self._exchange.resume_reading()

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
        if mode is not _Mode.CLIENT:
            return
        if self._usage is not None:
            chunk = self._usage.feed(chunk)
            if not chunk:
                return
        if self._mapper is not None:
            chunk = self._mapper.feed(chunk)
            if not chunk:
                return
        transport = self._transport
        assert transport is not None
        if transport.is_closing():
            self._client_left()
            return
        if not self._chunked:
            transport.write(chunk)
        elif len(chunk) < _COPY_BELOW:
            transport.write(b"%x\r\n%b\r\n" % (len(chunk), chunk))
        else:  # a large read (the engine outpacing the client): framed without a copy
            transport.writelines((b"%x\r\n" % len(chunk), chunk, b"\r\n"))
        self.bytes_out += len(chunk)
        if self._is_sse:
            self.sse_events += chunk.count(b"\n\n")
        if transport.get_write_buffer_size() > self._high_water and self._drain is None:
            # The client reads slower than the engine writes: stop reading the engine until
            # the client's socket drains (TCP flow control then paces the engine).
            self._exchange.pause_reading()
            self._drain = asyncio.get_running_loop().create_task(self._resume_when_drained())

    async def _resume_when_drained(self) -> None:
        assert self._writer is not None
        try:
            await self._writer.drain()
        except ConnectionError:
            self._client_left()
            return
        finally:
            self._drain = None
        self._exchange.resume_reading()

    def _client_left(self) -> None:
        self.discard()
        self._exchange.notify_client_gone()

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
        transport = self._transport
        assert transport is not None
        if transport.is_closing():
            self._client_left()
            return
        transport.write(b"%x\r\n%b\r\n" % (len(tail), tail) if self._chunked else tail)
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
