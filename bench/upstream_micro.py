"""The upstream layer's own cost, without sockets: `python -m bench.upstream_micro`.

Two figures, each the best and the median of several runs on uvloop (the extension modules where
they are built, the pure-Python ones with TETHER_NO_EXTENSIONS=1):

- **relay per chunk**: one engine read holding one chunked SSE event (vLLM's, as
  `bench/engine.py` sends it) through the connection's parser, the exchange, the relay (ID
  mapped back, tokens counted, chunked framing) into the client's transport; with and without
  an idle timeout watched (TETHER_STREAM_IDLE_TIMEOUT).
- **non-streaming request**: one JSON request on a pooled keep-alive connection: the exchange
  sent, its head and then its body read in two loop turns, the body buffered and mapped back.

Both transports are stand-ins that take every write at once, so the figures are tether's code
and the event loop's turns, not the kernel's; each is the process's CPU time (not the wall
clock), so that other work on a shared machine disturbs it less. Compare them before and
after a change to the upstream layer (the same machine, the same build kind)."""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from collections.abc import Callable, Coroutine
from typing import cast

import uvloop
from aiohttp.abc import AbstractStreamWriter

from proxy.compiled import extensions
from proxy.engines.token_shapes import TokenShape
from proxy.upstream.connection import UpstreamConnection
from proxy.upstream.exchange import UpstreamExchange
from proxy.upstream.pool import UploadLimit, UpstreamPool
from proxy.upstream.relay import ResponseRelay
from proxy.wire.ids import IdMapper
from proxy.wire.tokens import TokenCounter

INTERNAL_ID = "0123456789abcdef0123456789abcdef"
REQUEST_HEAD = b"POST /v1/chat/completions HTTP/1.1\r\nHost: engine\r\nContent-Length: 2\r\n\r\n"
SSE_HEAD = (
    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
)
EVENT = (
    b'data: {"id":"chatcmpl-' + INTERNAL_ID.encode() + b'","object":"chat.completion.chunk",'
    b'"created":1764460800,"model":"bench-model","choices":[{"index":0,"delta":'
    b'{"content":" token"},"finish_reason":null}],"bench_ts":1764460800123456}\n\n'
)
EVENT_CHUNK = b"%x\r\n%b\r\n" % (len(EVENT), EVENT)
JSON_BODY = (
    b'{"id":"chatcmpl-' + INTERNAL_ID.encode() + b'","object":"chat.completion",'
    b'"model":"bench-model","choices":[{"index":0,"message":{"role":"assistant",'
    b'"content":"a short answer"},"finish_reason":"stop"}],'
    b'"usage":{"prompt_tokens":5,"completion_tokens":4,"total_tokens":9}}'
)
JSON_HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n" % (
    len(JSON_BODY)
)


class ClientTransport:
    """The client's socket: takes every write at once (its buffer never fills)."""

    def write(self, data: bytes) -> None:
        pass

    def writelines(self, data: object) -> None:
        pass

    def is_closing(self) -> bool:
        return False

    def get_write_buffer_size(self) -> int:
        return 0

    def get_write_buffer_limits(self) -> tuple[int, int]:
        return (16 * 1024, 64 * 1024)


class EngineTransport:
    """The engine's socket. When a whole request was written it answers with `reply`: the
    head in the next loop turn, the body in the one after (as two reads)."""

    def __init__(self, protocol: UpstreamConnection, reply: tuple[bytes, bytes]) -> None:
        self.protocol = protocol
        self.reply = reply
        self.reading = True
        self.loop = asyncio.get_running_loop()

    def write(self, data: bytes) -> None:
        if self.reply[0] and data.endswith(b"\r\n\r\n{}"):
            self.loop.call_soon(self._answer)

    def _answer(self) -> None:
        self.protocol.data_received(self.reply[0])
        self.loop.call_soon(self.protocol.data_received, self.reply[1])

    def close(self) -> None:
        self.loop.call_soon(self.protocol.connection_lost, None)

    def is_closing(self) -> bool:
        return False

    def is_reading(self) -> bool:
        return self.reading

    def pause_reading(self) -> None:
        self.reading = False

    def resume_reading(self) -> None:
        self.reading = True

    def get_write_buffer_size(self) -> int:
        return 0


def _pool(reply: tuple[bytes, bytes], opened: list[UpstreamConnection]) -> UpstreamPool:
    async def connect(factory: Callable[[], UpstreamConnection]) -> UpstreamConnection:
        connection = factory()
        connection.connection_made(EngineTransport(connection, reply))  # type: ignore[arg-type]
        opened.append(connection)
        return connection

    return UpstreamPool(
        "engine",
        80,
        ssl_context=None,
        connect_timeout=5,
        idle_timeout=60,
        uploads=UploadLimit(10),
        connector=connect,
    )


async def relay_per_chunk(chunks: int, idle_timeout: float | None) -> float:
    """Seconds per engine read of one SSE event, relayed to the client."""
    opened: list[UpstreamConnection] = []
    pool = _pool((b"", b""), opened)
    exchange = UpstreamExchange(pool, "POST", replayable=False)
    await exchange.send(REQUEST_HEAD, b"{}")
    [connection] = opened
    connection.data_received(SSE_HEAD)
    await exchange.wait_head()
    relay = ResponseRelay(
        exchange, TokenCounter(TokenShape.CHAT), IdMapper(INTERNAL_ID, b"client-id")
    )
    writer = cast(AbstractStreamWriter, None)  # never drained: the client's buffer never fills
    relay.to_client(ClientTransport(), writer, chunked=True, is_sse=True)  # type: ignore[arg-type]
    exchange.attach(relay)
    waiting = asyncio.ensure_future(exchange.wait_end(idle_timeout))
    await asyncio.sleep(0)  # the wait begins (and, with a timeout, watches for silence)
    connection.data_received(EVENT_CHUNK)  # the first byte noted: the steady state from here
    feed = connection.data_received
    start = time.process_time()
    for _ in range(chunks):
        feed(EVENT_CHUNK)
    elapsed = time.process_time() - start
    connection.data_received(b"0\r\n\r\n")
    await waiting
    pool.close()
    return elapsed / chunks


async def non_streaming_request(requests: int, idle_timeout: float | None) -> float:
    """Seconds per JSON request on a reused connection, from `send` to the body mapped back."""
    opened: list[UpstreamConnection] = []
    pool = _pool((JSON_HEAD, JSON_BODY), opened)
    mapped = b"client-id"

    async def one() -> None:
        exchange = UpstreamExchange(pool, "POST", replayable=False)
        await exchange.send(REQUEST_HEAD, b"{}")
        await exchange.wait_head()
        mapper = IdMapper(INTERNAL_ID, mapped)
        relay = ResponseRelay(exchange, TokenCounter(TokenShape.CHAT), mapper)
        relay.to_buffer()
        exchange.attach(relay)
        await exchange.wait_end(idle_timeout)
        relay.take_buffered()

    await one()  # the connection opened, then reused by every measured request
    start = time.process_time()
    for _ in range(requests):
        await one()
    elapsed = time.process_time() - start
    assert len(opened) == 1, "the connection was not reused"
    pool.close()
    return elapsed / requests


def _best_and_median_us(run: Callable[[], float], repeats: int) -> tuple[float, float]:
    figures = [run() * 1e6 for _ in range(repeats)]
    return min(figures), statistics.median(figures)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--chunks", type=int, default=50_000)
    parser.add_argument("--requests", type=int, default=10_000)
    args = parser.parse_args()
    print(f"data plane: {extensions()}; best and median of {args.repeats} runs, µs")
    measures: dict[str, Callable[[float | None], Coroutine[None, None, float]]] = {
        "relay per chunk": lambda idle: relay_per_chunk(args.chunks, idle),
        "non-streaming request": lambda idle: non_streaming_request(args.requests, idle),
    }
    for name, measure in measures.items():
        for idle in (None, 30.0):
            best, median = _best_and_median_us(
                lambda: uvloop.run(measure(idle)),  # noqa: B023 - called before the next
                args.repeats,
            )
            label = f"{name}, idle timeout {'off' if idle is None else 'on'}"
            print(f"  {label:<40} best {best:8.3f}   median {median:8.3f}")


if __name__ == "__main__":
    main()
