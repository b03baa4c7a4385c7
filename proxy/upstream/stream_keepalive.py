"""SSE keep-alive while a stream is relayed (TETHER_SSE_KEEPALIVE): when the client has been
sent nothing for a while, a comment line goes out between two events, so that a load balancer
that cuts idle connections keeps the stream.

One timer per stream, every half interval, never one per chunk: each tick compares what went
to the client (the relay's body bytes and the comments) with what the last tick saw, and
writes a comment where nothing went since. So a comment follows at most one interval of
silence, and during a long silence one goes out every interval. The relay's hot path carries
none of it: it already counts the bytes it writes.
"""

from __future__ import annotations

import asyncio

from .relay import ResponseRelay

# An SSE comment: every client ignores it (a line starting with a colon, WHATWG HTML
# §9.2.6), as the OpenAI SDKs, curl and vLLM's bench client do.
KEEPALIVE_COMMENT = b": keep-alive\n\n"


class StreamKeepAlive:
    """The keep-alive of one relayed stream, from its start until `stop`."""

    __slots__ = ("_comments", "_loop", "_period", "_relay", "_seen", "_timer")

    def __init__(self, relay: ResponseRelay, seconds: float, *, first_check: float) -> None:
        """`first_check`: seconds until the first look (up to `seconds`: what is left of the
        interval since the client was last sent something)."""
        self._relay = relay
        self._loop = asyncio.get_running_loop()
        self._period = seconds / 2
        self._comments = 0
        self._seen = relay.bytes_out
        self._timer: asyncio.TimerHandle | None = self._loop.call_later(first_check, self._check)

    @property
    def comments(self) -> int:
        """The comments it wrote."""
        return self._comments

    def _check(self) -> None:
        written = self._relay.bytes_out + self._comments
        # (Seen before the comment: the next tick counts the comment as what went out, so in
        # a long silence comments go one interval apart, not half of one.)
        if written == self._seen and self._relay.write_between_events(KEEPALIVE_COMMENT):
            self._comments += 1
        self._seen = written
        self._timer = self._loop.call_later(self._period, self._check)

    def stop(self) -> None:
        """The stream ended, however it did: no more comments, no timer left."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
