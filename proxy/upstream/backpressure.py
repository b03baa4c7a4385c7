"""Back-pressure through tether: while the side tether writes to cannot take more (its write
buffer passed its high-water mark), the side it reads from is not read, so that TCP flow
control reaches whoever sends too fast. The relay paces the engine by the client's socket; a
WebSocket session's client frames pace the client by the engine's.

The writer says when it is over its mark (the relay reads the client's buffer size; the
engine connection hears asyncio's `pause_writing`); `ReadPacer` does the rest, the same way
for both: reading paused, one task waiting for the buffer to drain, reading resumed.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Protocol


class Readable(Protocol):
    """The side tether reads from (a transport, or the engine exchange)."""

    def pause_reading(self) -> None: ...

    def resume_reading(self) -> None: ...


class ReadPacer:
    """Reading `source` paused until `drained()` returns, one wait at a time. A `drained`
    that fails with `ConnectionError` (where tether writes closed) calls `on_failure`
    instead, and reading stays paused: its owner decides what comes next."""

    __slots__ = ("_drained", "_on_failure", "_source", "_waiting")

    def __init__(
        self,
        source: Readable,
        drained: Callable[[], Awaitable[None]],
        on_failure: Callable[[], None] | None = None,
    ) -> None:
        self._source = source
        self._drained = drained
        self._on_failure = on_failure
        self._waiting: asyncio.Task[None] | None = None

    def pause_until_drained(self) -> None:
        """The side written to is over its high-water mark: `source` is not read until it
        drained (again and again over the mark, still one wait)."""
        if self._waiting is None:
            self._source.pause_reading()
            self._waiting = asyncio.get_running_loop().create_task(self._resume_when_drained())

    def stop(self) -> None:
        """No more waiting (reading stays as it is: its owner resumes it if it wants)."""
        if self._waiting is not None:
            self._waiting.cancel()
            self._waiting = None

    async def _resume_when_drained(self) -> None:
        try:
            await self._drained()
        except ConnectionError:
            self._waiting = None
            if self._on_failure is not None:
                self._on_failure()
            return
        self._waiting = None
        self._source.resume_reading()
