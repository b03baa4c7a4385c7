"""A streamed answer its client may resume (TETHER_RESUME_GRACE): which connection carries it
now, and the meeting point of the request's handler, which holds it while its client is away,
and the resume that takes it over.

Its handler keeps reading the engine all along; only the connection the events go to changes.
A resume may come while the client is away (the stream is held: its events kept, none
written) or while tether still thinks its last connection is there (a network change leaves
it half-open): either way the new connection takes over, and the one before is closed.
"""

from __future__ import annotations

import asyncio

from aiohttp.abc import AbstractStreamWriter

from ..upstream.exchange import UpstreamExchange
from ..upstream.relay import ResponseRelay


class Resumer:
    """A resume's connection, carrying the stream once it took it over; `done` says how the
    stream ended for it (True: whole, its end follows; False: it must be cut)."""

    __slots__ = ("chunked", "done", "transport", "writer")

    def __init__(
        self, transport: asyncio.Transport, writer: AbstractStreamWriter, *, chunked: bool
    ) -> None:
        self.transport = transport
        self.writer = writer  # where its response head went (the relay waits on its drain)
        self.chunked = chunked
        self.done: asyncio.Future[bool] = asyncio.get_running_loop().create_future()

    def end(self, whole: bool) -> None:
        if not self.done.done():
            self.done.set_result(whole)


class HeldStream:
    """One resumable stream: the connection it is written to, and the wait for a resume."""

    __slots__ = (
        "_exchange",
        "_waiter",
        "ended",
        "first",
        "keepalive",
        "relay",
        "sink",
    )

    def __init__(
        self,
        relay: ResponseRelay,
        exchange: UpstreamExchange,
        first: asyncio.Transport,
        keepalive: float | None,
    ) -> None:
        self.relay = relay
        # Its SSE keep-alive interval (TETHER_SSE_KEEPALIVE), kept on the connections that
        # resume it: they pass the same load balancers.
        self.keepalive = keepalive
        self._exchange = exchange
        self.first: asyncio.Transport | None = first  # the request's own connection, until left
        # The resume carrying it now; None: its own connection does, or nobody (held).
        self.sink: Resumer | None = None
        self.ended = False  # for its client: nothing more to resume
        self._waiter: asyncio.Future[Resumer | None] | None = None

    @property
    def resumable(self) -> bool:
        return not self.ended and self.relay.resumable

    @property
    def carried(self) -> bool:
        """A resume's connection carries it (its own connection's end is no longer its
        client's leaving)."""
        return self.sink is not None

    def take_over(self, resumer: Resumer, last_received: int) -> bool:
        """`resumer` carries the stream from here, every event after `last_received` first;
        the connection that carried it is closed. False when those events are no longer held
        or the stream no longer relays (it ended for its client)."""
        if self.ended or not self.relay.resume(
            resumer.transport, resumer.writer, chunked=resumer.chunked, last_received=last_received
        ):
            return False
        self._exchange.on_sink_reopened()
        previous, self.sink = self.sink, resumer
        if previous is not None:
            previous.end(False)
        first, self.first = self.first, None
        if first is not None:
            first.close()
        waiter, self._waiter = self._waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_result(resumer)
        return True

    async def wait_resume(self, until: float) -> Resumer | None:
        """Hold the stream until a resume takes it over (that resume), at the latest until
        `until` (the loop's clock) or until it holds more than allowed (None)."""
        self.first = None
        if self.sink is not None:
            self.sink.end(False)
            self.sink = None
        waiter: asyncio.Future[Resumer | None] = asyncio.get_running_loop().create_future()
        self._waiter = waiter
        self.relay.hold(self._overflowed)
        try:
            async with asyncio.timeout_at(until):
                return await waiter
        except TimeoutError:
            # (a resume may have taken it over in the same turn of the loop)
            return waiter.result() if waiter.done() and not waiter.cancelled() else None
        finally:
            self._waiter = None

    def _overflowed(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def resumer_left(self, resumer: Resumer) -> None:
        """A resume's connection closed while it carried the stream: the stream is held again
        (its handler hears of it as of any client leaving)."""
        if self.sink is resumer:
            self.sink = None
            self.relay.hold()
            self._exchange.on_sink_closed()

    def sink_lost(self) -> None:
        """The connection carrying it was found closed (a write failed): nobody carries it."""
        sink, self.sink = self.sink, None
        if sink is not None:
            sink.end(False)

    def end(self, whole: bool) -> None:
        """The stream ended for its client (whole, or cut): the resume carrying it finishes
        it, and what it held goes back to the budget."""
        self.ended = True
        self.relay.release_events()
        sink, self.sink = self.sink, None
        if sink is not None:
            sink.end(whole)
