"""tether's protocols driven without sockets: a transport that records what is written to it,
an engine that hands the pool such transports, a client writer whose drain the test decides,
and an event loop whose clock the test moves.

- `FakeTransport`: what a protocol writes (each call's buffers), its close (reaching the
  protocol's `connection_lost` on the loop's next turn, as asyncio's transports do), whether
  it is read, and a write buffer as full as the test sets it.
- `FakeEngine`: the pool's connector (`pool()` makes one on it); every connection it opens,
  each on a `FakeTransport`; `answer(data)` is one read of the engine's bytes.
- `FakeWriter`: the client's response writer (aiohttp's `StreamWriter`, for its `drain`).
- `SteppedClockLoop`: `advance(seconds)` makes timers that far ahead due at once, and it
  counts the timers still waiting; `run_on_stepped_clock(main)` runs a test in one.
- `settle()`: a few loop turns, for what transports schedule with `call_soon`.
"""

from __future__ import annotations

import asyncio
import contextvars
from collections.abc import Callable, Coroutine
from typing import TypeVarTuple, Unpack

from proxy.upstream.connection import UpstreamConnection
from proxy.upstream.pool import UploadLimit, UpstreamPool

_Ts = TypeVarTuple("_Ts")

# asyncio's default write-buffer limits (the relay reads the high one from its transport).
LOW_WATER = 16 * 1024
HIGH_WATER = 64 * 1024


class FakeTransport:
    """A transport with no socket behind it. A write to a closing transport goes nowhere, as
    asyncio's does; `buffered` is what the write buffer holds (the test sets it)."""

    def __init__(self, protocol: asyncio.BaseProtocol | None = None) -> None:
        self.protocol = protocol
        self.written = b""
        self.calls: list[list[bytes]] = []  # each write's buffers: one, or writelines' parts
        self.closed = False
        self.reading = True
        self.buffered = 0

    @property
    def connection(self) -> UpstreamConnection:
        """The engine connection on this transport."""
        assert isinstance(self.protocol, UpstreamConnection)
        return self.protocol

    def write(self, data: bytes) -> None:
        if not self.closed:
            self.calls.append([data])
            self.written += data

    def writelines(self, parts: list[bytes] | tuple[bytes, ...]) -> None:
        if not self.closed:
            self.calls.append(list(parts))
            self.written += b"".join(parts)

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            if self.protocol is not None:
                asyncio.get_running_loop().call_soon(self.protocol.connection_lost, None)

    def is_closing(self) -> bool:
        return self.closed

    def is_reading(self) -> bool:
        return self.reading

    def pause_reading(self) -> None:
        self.reading = False

    def resume_reading(self) -> None:
        self.reading = True

    def get_write_buffer_size(self) -> int:
        return self.buffered

    def get_write_buffer_limits(self) -> tuple[int, int]:
        return LOW_WATER, HIGH_WATER


class FakeEngine:
    """The pool's connector: every connection the pool opens, on a `FakeTransport`."""

    def __init__(self) -> None:
        self.transports: list[FakeTransport] = []

    async def connect(self, factory: Callable[[], UpstreamConnection]) -> UpstreamConnection:
        connection = factory()
        transport = FakeTransport(connection)
        connection.connection_made(transport)  # type: ignore[arg-type]
        self.transports.append(transport)
        return connection

    def pool(self) -> UpstreamPool:
        """A pool (in the running loop) whose connections this engine opens."""
        return UpstreamPool(
            "engine",
            80,
            ssl_context=None,
            connect_timeout=1,
            idle_timeout=60,
            uploads=UploadLimit(8),
            connector=self.connect,
        )

    def carrying(self, head: bytes) -> list[FakeTransport]:
        """The transports the request with this head was written to."""
        return [t for t in self.transports if head in t.written]

    @property
    def last(self) -> FakeTransport:
        return self.transports[-1]

    def answer(self, data: bytes, transport: FakeTransport | None = None) -> None:
        """The engine's bytes, as one read of the last connection (or of `transport`)."""
        (transport or self.last).connection.data_received(data)


class FakeWriter:
    """The client's response writer: `drain()` waits until the test calls `drained()`, or
    fails as a reset connection's does after `reset()`."""

    def __init__(self) -> None:
        self._drained = asyncio.Event()
        self._reset = False
        self.waits = 0  # drain calls

    async def drain(self) -> None:
        self.waits += 1
        await self._drained.wait()
        self._drained.clear()
        if self._reset:
            raise ConnectionResetError("Connection lost")

    def drained(self) -> None:
        self._drained.set()

    def reset(self) -> None:
        self._reset = True
        self._drained.set()


class SteppedClockLoop(asyncio.SelectorEventLoop):
    """An event loop whose clock the test moves on: `advance(seconds)` and every timer that
    falls due by then runs on the next turns, at once. `timers_waiting` counts the timers
    scheduled and neither run nor cancelled."""

    def __init__(self) -> None:
        super().__init__()
        self._skipped = 0.0
        self._timers: set[asyncio.TimerHandle] = set()

    def time(self) -> float:
        return super().time() + self._skipped

    def advance(self, seconds: float) -> None:
        self._skipped += seconds

    def call_at(
        self,
        when: float,
        callback: Callable[[Unpack[_Ts]], object],
        *args: *_Ts,
        context: contextvars.Context | None = None,
    ) -> asyncio.TimerHandle:
        def run(*args: *_Ts) -> None:
            self._timers.discard(handle)
            callback(*args)

        handle = super().call_at(when, run, *args, context=context)
        self._timers.add(handle)
        return handle

    @property
    def timers_waiting(self) -> int:
        return sum(1 for timer in self._timers if not timer.cancelled())


def run_on_stepped_clock(main: Callable[[SteppedClockLoop], Coroutine[None, None, None]]) -> None:
    """Run `main(loop)` to its end in a new `SteppedClockLoop`."""
    with asyncio.Runner(loop_factory=SteppedClockLoop) as runner:
        loop = runner.get_loop()
        assert isinstance(loop, SteppedClockLoop)
        runner.run(main(loop))


async def settle() -> None:
    """Let what the transports scheduled (`connection_lost`) run."""
    for _ in range(3):
        await asyncio.sleep(0)
