"""The relay, without sockets: the engine's reads go through a real connection and exchange
into a relay whose client is a fake transport. Its modes (to the client, to a buffer,
discarding), its pacing (the engine not read while the client's buffer is over its high-water
mark), its framing (a small chunk copied into its chunked frame, a large one framed beside
it), and what it does when the client's side closes under it."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import pytest

from proxy.engines.token_shapes import TokenShape
from proxy.upstream.exchange import SinkClosedError, UpstreamExchange
from proxy.upstream.relay import ResponseRelay
from proxy.wire.ids import IdMapper
from proxy.wire.tokens import TokenCounter

from .support.fake_transport import HIGH_WATER, FakeEngine, FakeTransport, FakeWriter, settle
from .support.waiting import within

INTERNAL = b"0123456789abcdef0123456789abcdef"
CLIENT = b"client-named-request"
REQUEST = b"POST /v1/chat/completions HTTP/1.1\r\nContent-Length: 2\r\n\r\n"
SSE_HEAD = (
    b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
)
END = b"0\r\n\r\n"

pytestmark = pytest.mark.socket_free


def event(n: int, request_id: bytes = INTERNAL) -> bytes:
    """One token event of an OpenAI chat stream, as the engine writes it."""
    return (
        b'data: {"id":"chatcmpl-%b","object":"chat.completion.chunk","choices":'
        b'[{"index":0,"delta":{"content":"token %d"},"finish_reason":null}]}\n\n' % (request_id, n)
    )


def framed(data: bytes) -> bytes:
    """One HTTP/1.1 chunk."""
    return b"%x\r\n%b\r\n" % (len(data), data)


@dataclass
class Relayed:
    engine: FakeEngine
    exchange: UpstreamExchange
    relay: ResponseRelay
    client: FakeTransport
    writer: FakeWriter

    def engine_sends(self, *events: bytes) -> None:
        """One read of the engine's, holding these events as chunks."""
        self.engine.answer(b"".join(framed(e) for e in events))

    @property
    def engine_read(self) -> bool:
        """Whether tether reads the engine's socket."""
        return self.engine.last.reading


async def relayed(*, mapped: bool = True, chunked: bool = True, to_client: bool = True) -> Relayed:
    """An exchange whose SSE head arrived, relayed to a client (or, with `to_client` False, to
    a buffer) from then on."""
    engine = FakeEngine()
    exchange = UpstreamExchange(engine.pool(), "POST", replayable=False)
    await exchange.send(REQUEST, b"{}")
    engine.answer(SSE_HEAD)
    await exchange.wait_head()
    mapper = IdMapper(INTERNAL.decode(), CLIENT) if mapped else None
    relay = ResponseRelay(exchange, TokenCounter(TokenShape.CHAT), mapper)
    client, writer = FakeTransport(), FakeWriter()
    if to_client:
        relay.to_client(
            client,  # type: ignore[arg-type]
            writer,  # type: ignore[arg-type]
            chunked=chunked,
            is_sse=True,
        )
    else:
        relay.to_buffer()
    exchange.attach(relay)
    return Relayed(engine, exchange, relay, client, writer)


# --- modes -------------------------------------------------------------------------------


async def test_each_read_reaches_the_client_framed_with_its_own_id() -> None:
    """To the client: each engine read goes out at once as one chunk, the internal ID
    replaced by the client's, and is counted (bytes, SSE events, token events)."""
    r = await relayed()
    r.engine_sends(event(1), event(2))
    expected = event(1, CLIENT) + event(2, CLIENT)
    assert r.client.written == framed(expected)
    assert (r.relay.bytes_out, r.relay.sse_events, r.relay.tokens.events) == (len(expected), 2, 2)


async def test_a_response_aiohttp_does_not_chunk_goes_out_unframed() -> None:
    """A client response with a length or over HTTP/1.0 (not chunked): the bytes as they are."""
    r = await relayed(chunked=False)
    r.engine_sends(event(1))
    assert r.client.written == event(1, CLIENT)


async def test_to_a_buffer_the_body_is_held_whole_then_mapped_back() -> None:
    """To a buffer: nothing reaches the client's socket; the whole body, IDs mapped back even
    across reads, is taken at the end, counted."""
    r = await relayed(to_client=False)
    whole = event(1) + event(2)
    r.engine.answer(framed(whole[:30]))  # the internal ID split between two reads
    r.engine.answer(framed(whole[30:]) + END)
    await within(r.exchange.wait_end(), 2, "the end of the response")
    body = r.relay.take_buffered()
    assert body == event(1, CLIENT) + event(2, CLIENT)
    assert r.client.written == b"" and r.relay.bytes_out == len(body)
    assert r.relay.tokens.events == 2


async def test_once_discarding_the_rest_is_counted_never_relayed() -> None:
    """After `discard` (the client left) nothing more is written; every event is still counted,
    those the client got apart; and the connection is never pooled afterwards."""
    r = await relayed()
    r.engine_sends(event(1))
    r.relay.discard()
    r.engine_sends(event(2), event(3))
    r.engine.answer(END)
    await within(r.exchange.wait_end(), 2, "the end of the response")
    assert r.client.written == framed(event(1, CLIENT))
    assert (r.relay.tokens_relayed, r.relay.tokens.events) == (1, 3)
    await settle()
    assert r.engine.last.closed


async def test_the_end_sends_what_the_id_mapper_held_back() -> None:
    """A read ending in what could be the start of the internal ID is held back until the next
    read shows it is not; at the end, `finish` sends it."""
    r = await relayed()
    r.engine_sends(b"data: tail " + INTERNAL[:8])
    assert r.client.written == framed(b"data: tail ")
    r.engine.answer(END)
    await within(r.exchange.wait_end(), 2, "the end of the response")
    r.relay.finish()
    assert r.client.written == framed(b"data: tail ") + framed(INTERNAL[:8])


# --- pacing --------------------------------------------------------------------------------


async def test_over_high_water_the_engine_is_not_read_until_the_client_drained() -> None:
    """A client whose socket buffer passed its high-water mark: the engine's socket is not
    read (one drain waited for, however many reads came meanwhile) until the client's buffer
    drained, then it is read again."""
    r = await relayed()
    r.client.buffered = HIGH_WATER + 1
    r.engine_sends(event(1))
    assert not r.engine_read
    r.engine_sends(event(2))  # a read already in llhttp's hands when reading paused
    await settle()
    assert r.writer.waits == 1
    r.client.buffered = 0
    r.writer.drained()
    await settle()
    assert r.engine_read
    assert r.client.written == framed(event(1, CLIENT)) + framed(event(2, CLIENT))


async def test_under_high_water_the_engine_is_read_on() -> None:
    """At the high-water mark, not over it, the engine is read on and nothing waits."""
    r = await relayed()
    r.client.buffered = HIGH_WATER
    r.engine_sends(event(1))
    await settle()
    assert r.engine_read and r.writer.waits == 0


async def test_discarding_never_holds_the_engine_up() -> None:
    """A client that leaves while its buffer is full: the wait for it is dropped and the
    engine is read again (its confirmation of a stop must still arrive)."""
    r = await relayed()
    r.client.buffered = HIGH_WATER + 1
    r.engine_sends(event(1))
    assert not r.engine_read
    r.relay.discard()
    assert r.engine_read


# --- framing --------------------------------------------------------------------------------


@pytest.mark.parametrize(("size", "buffers"), [(2047, 1), (2048, 3)])
async def test_a_small_read_is_copied_into_its_frame_a_large_one_framed_beside_it(
    size: int, buffers: int
) -> None:
    """Below 2 KiB a read and its chunk framing go out as one buffer (one copy is cheaper than
    three writes); from 2 KiB on, as three buffers (the read itself never copied)."""
    r = await relayed(mapped=False)
    payload = b"x" * size
    r.engine_sends(payload)
    [call] = r.client.calls
    assert len(call) == buffers
    assert b"".join(call) == framed(payload)


# --- the client's side closing under the relay ------------------------------------------------


async def test_a_client_socket_found_closing_ends_the_wait_as_a_closed_sink() -> None:
    """A read that meets the client's socket closing is not written: the exchange's wait ends
    with `SinkClosedError` (the handler's "client gone"), the response itself goes on and is
    still counted, and the connection is never pooled."""
    r = await relayed()
    waiting = asyncio.ensure_future(r.exchange.wait_end())
    r.client.close()
    r.engine_sends(event(1))
    with pytest.raises(SinkClosedError):
        await within(waiting, 2, "the wait to end")
    assert r.client.written == b"" and not r.exchange.ended
    r.engine_sends(event(2))
    r.engine.answer(END)
    assert r.relay.tokens.events == 2
    await settle()
    assert r.engine.last.closed


async def test_a_drain_that_fails_ends_the_wait_as_a_closed_sink() -> None:
    """The client's connection reset while the relay waited for its buffer to drain: the wait
    for the end stops with `SinkClosedError` and the engine is read again."""
    r = await relayed()
    waiting = asyncio.ensure_future(r.exchange.wait_end())
    r.client.buffered = HIGH_WATER + 1
    r.engine_sends(event(1))
    assert not r.engine_read
    r.writer.reset()
    with pytest.raises(SinkClosedError):
        await within(waiting, 2, "the wait to end")
    assert r.engine_read
