"""The exchange's waits, without sockets: when a request is sent again (the replay rule), the
engine's silence watched by one timer on a clock the test moves (no real waiting), a sink
that stopped taking bytes, and a body that arrives before anything consumes it."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from proxy.errors import RequestTimeoutError, UpstreamProtocolError, UpstreamUnavailableError
from proxy.upstream.exchange import SinkClosedError, UpstreamExchange
from proxy.upstream.pool import UpstreamPool

from .support.fake_transport import FakeEngine, SteppedClockLoop, run_on_stepped_clock, settle
from .support.waiting import within

OK = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"
STREAM_HEAD = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
EVENT = b"6\r\nevent\n\r\n"
END = b"0\r\n\r\n"
IDLE_TIMEOUT = 30.0

pytestmark = pytest.mark.socket_free


class Sink:
    def __init__(self) -> None:
        self.received = b""

    def feed(self, chunk: bytes) -> None:
        self.received += chunk


def request(method: str, path: str = "/v1/models") -> bytes:
    length = b"Content-Length: 2\r\n" if method == "POST" else b""
    return b"%b %b HTTP/1.1\r\n%b\r\n" % (method.encode(), path.encode(), length)


async def warm(engine: FakeEngine, pool: UpstreamPool) -> None:
    """One request answered in full: its connection goes back to the pool, to be reused."""
    exchange = UpstreamExchange(pool, "GET", replayable=True)
    await exchange.send(request("GET", "/health"), None)
    engine.answer(OK)
    exchange.attach(Sink())
    await within(exchange.wait_end(), 2, "the warm-up's end")
    assert pool.idle_connections == 1


async def on_stale_connection(
    engine: FakeEngine, method: str, *, replayable: bool
) -> tuple[asyncio.Future[object], bytes]:
    """A request sent on a reused connection, which the engine then closes without a byte of
    an answer (its keep-alive timeout racing the request); the wait for its head."""
    pool = engine.pool()
    await warm(engine, pool)
    head = request(method)
    exchange = UpstreamExchange(pool, method, replayable=replayable)
    await exchange.send(head, b"{}" if method == "POST" else None)
    waiting: asyncio.Future[object] = asyncio.ensure_future(exchange.wait_head())
    [stale] = engine.carrying(head)
    stale.close()
    await settle()
    return waiting, head


# --- the replay rule ---------------------------------------------------------------------


async def test_a_replayable_request_on_a_stale_connection_is_sent_once_more() -> None:
    """A GET the engine profile calls replayable, on a reused connection closed unanswered:
    it goes out again on a new connection, and the answer there is the client's."""
    engine = FakeEngine()
    waiting, head = await on_stale_connection(engine, "GET", replayable=True)
    await settle()
    assert len(engine.carrying(head)) == 2
    engine.answer(OK)
    assert (await within(waiting, 2, "the head")) is not None


async def test_a_request_that_is_not_replayable_is_never_sent_again() -> None:
    """A POST (or a route that starts generation) in the same race: its client gets the
    error, and the engine got it once."""
    engine = FakeEngine()
    waiting, head = await on_stale_connection(engine, "POST", replayable=False)
    with pytest.raises(UpstreamUnavailableError):
        await within(waiting, 2, "the error")
    assert len(engine.carrying(head)) == 1


async def test_a_new_connection_closed_unanswered_is_not_a_race() -> None:
    """On a connection of its own (never reused) a close before answering is the engine's
    answer, not a keep-alive race: even a replayable request is not sent again."""
    engine = FakeEngine()
    exchange = UpstreamExchange(engine.pool(), "GET", replayable=True)
    await exchange.send(request("GET"), None)
    engine.last.close()
    with pytest.raises(UpstreamUnavailableError):
        await within(exchange.wait_head(), 2, "the error")
    assert len(engine.transports) == 1


async def test_a_stale_connection_that_began_answering_is_not_resent() -> None:
    """Bytes of an answer before the close (a head cut off) mean the engine took the request:
    the client gets the protocol error, and nothing is sent again."""
    engine = FakeEngine()
    pool = engine.pool()
    await warm(engine, pool)
    exchange = UpstreamExchange(pool, "GET", replayable=True)
    await exchange.send(request("GET"), None)
    engine.answer(b"HTTP/1.1 200 OK\r\nContent-Le")
    engine.last.close()
    with pytest.raises(UpstreamProtocolError):
        await within(exchange.wait_head(), 2, "the error")
    assert len(engine.carrying(request("GET"))) == 1


async def test_a_request_is_sent_again_at_most_once() -> None:
    """The second connection closed unanswered as well: the client gets the error; the
    request went out twice, never a third time."""
    engine = FakeEngine()
    waiting, head = await on_stale_connection(engine, "GET", replayable=True)
    await settle()
    engine.last.close()
    with pytest.raises(UpstreamUnavailableError):
        await within(waiting, 2, "the error")
    assert len(engine.carrying(head)) == 2


async def test_a_streamed_body_is_never_sent_again() -> None:
    """A body streamed through is not kept, so it cannot be replayed: even a replayable
    request with one gets the error."""
    engine = FakeEngine()
    pool = engine.pool()
    await warm(engine, pool)

    async def body() -> AsyncIterator[bytes]:
        yield b"{}"

    head = request("POST")
    exchange = UpstreamExchange(pool, "POST", replayable=True)
    await exchange.send(head, body())
    engine.last.close()
    with pytest.raises(UpstreamUnavailableError):
        await within(exchange.wait_head(), 2, "the error")
    assert len(engine.carrying(head)) == 1


# --- the engine's silence: one timer on a stepped clock ----------------------------------------


async def _streaming(engine: FakeEngine) -> UpstreamExchange:
    """An exchange whose streamed response began, with a sink attached."""
    exchange = UpstreamExchange(engine.pool(), "POST", replayable=False)
    await exchange.send(request("POST"), b"{}")
    engine.answer(STREAM_HEAD)
    await exchange.wait_head()
    exchange.attach(Sink())
    return exchange


def test_an_engine_silent_for_the_idle_timeout_ends_the_wait() -> None:
    """Silent for the whole idle timeout: the wait ends with the timeout error (the response
    itself is not ended: stopping the engine's work is the handler's call); a moment less
    is not a timeout."""

    async def main(loop: SteppedClockLoop) -> None:
        engine = FakeEngine()
        exchange = await _streaming(engine)
        waiting = asyncio.ensure_future(exchange.wait_end(IDLE_TIMEOUT))
        await settle()
        loop.advance(IDLE_TIMEOUT - 0.5)
        await settle()
        assert not waiting.done()
        loop.advance(0.5)
        with pytest.raises(RequestTimeoutError, match=r"TETHER_STREAM_IDLE_TIMEOUT=30\.0s"):
            await within(waiting, 2, "the timeout")
        assert not exchange.ended

    run_on_stepped_clock(main)


def test_each_read_gives_the_engine_the_whole_timeout_again() -> None:
    """Reads 20 s apart for 100 s never time out a 30 s idle timeout; 30 s of silence after
    the last one does."""

    async def main(loop: SteppedClockLoop) -> None:
        engine = FakeEngine()
        exchange = await _streaming(engine)
        waiting = asyncio.ensure_future(exchange.wait_end(IDLE_TIMEOUT))
        await settle()
        for _ in range(5):
            loop.advance(20)
            engine.answer(EVENT)
            await settle()
        assert not waiting.done()
        loop.advance(IDLE_TIMEOUT)
        with pytest.raises(RequestTimeoutError):
            await within(waiting, 2, "the timeout")

    run_on_stepped_clock(main)


def test_one_timer_watches_the_whole_response() -> None:
    """However many reads come and however often the timer is re-armed, one timer waits for
    the response's silence, and none is left once the response ended."""

    async def main(loop: SteppedClockLoop) -> None:
        engine = FakeEngine()
        exchange = await _streaming(engine)
        waiting = asyncio.ensure_future(exchange.wait_end(IDLE_TIMEOUT))
        await settle()
        for _ in range(100):
            loop.advance(IDLE_TIMEOUT / 4)
            engine.answer(EVENT)
            await settle()
            assert loop.timers_waiting == 1
        exchange.forbid_reuse()  # (a pooled connection would start the pool's own timer)
        engine.answer(END)
        await within(waiting, 2, "the end")
        assert loop.timers_waiting == 0

    run_on_stepped_clock(main)


def test_a_cancelled_wait_leaves_no_timer() -> None:
    """A wait cancelled (the client left, the request timed out) takes its timer with it."""

    async def main(loop: SteppedClockLoop) -> None:
        engine = FakeEngine()
        exchange = await _streaming(engine)
        waiting = asyncio.ensure_future(exchange.wait_end(IDLE_TIMEOUT))
        await settle()
        assert loop.timers_waiting == 1
        waiting.cancel()
        await settle()
        assert waiting.cancelled() and loop.timers_waiting == 0

    run_on_stepped_clock(main)


# --- the sink, and a body with no sink yet ---------------------------------------------------


async def test_a_sink_that_stopped_taking_bytes_ends_the_wait_not_the_response() -> None:
    """The sink says where it writes closed: the wait for the end stops with `SinkClosedError`
    (its reader decides what that means), and the response goes on."""
    engine = FakeEngine()
    exchange = await _streaming(engine)
    waiting = asyncio.ensure_future(exchange.wait_end())
    await settle()
    exchange.on_sink_closed()
    with pytest.raises(SinkClosedError):
        await within(waiting, 2, "the wait to end")
    assert not exchange.ended


async def test_a_body_nobody_consumes_yet_stops_the_reading_past_its_limit() -> None:
    """Body bytes that arrive before a sink is attached are held up to 64 KiB, then the engine
    is no longer read; attaching a sink hands it all of them and reads on."""
    engine = FakeEngine()
    exchange = UpstreamExchange(engine.pool(), "POST", replayable=False)
    await exchange.send(request("POST"), b"{}")
    engine.answer(STREAM_HEAD)
    await exchange.wait_head()
    piece = b"x" * 16 * 1024
    for _ in range(4):
        engine.answer(b"%x\r\n%b\r\n" % (len(piece), piece))
    assert engine.last.reading
    engine.answer(b"1\r\ny\r\n")
    assert not engine.last.reading
    sink = Sink()
    exchange.attach(sink)
    assert sink.received == piece * 4 + b"y" and engine.last.reading
