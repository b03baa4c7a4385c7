"""tether's keep-alive connections to the engine: reused while fresh, closed before the
engine's own keep-alive would close them, never reused after a client left. (What may be sent
again after the engine closed a reused connection is in test_protocol_safety.py.)"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable

import aiohttp
import pytest

from proxy.upstream.client import UpstreamClient
from proxy.upstream.pool import UploadLimit

from .support.chat import chat_body
from .support.in_process import TetherFactory, drained, settled, url
from .support.raw_http import RawClient
from .support.settings import SettingsFactory
from .support.upstreams import FakeEngineFactory

CountingEngineFactory = Callable[..., Awaitable[tuple[str, list[int]]]]


@pytest.fixture
async def counting_engine() -> AsyncIterator[CountingEngineFactory]:
    """A minimal engine that answers every request with a small JSON body; it records, per
    connection, how many client requests (POSTs: tether's health checks are GETs on their own
    connections) it served."""
    servers: list[asyncio.Server] = []

    async def start() -> tuple[str, list[int]]:
        served: list[int] = []

        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            index: int | None = None
            try:
                while True:
                    head = await reader.readuntil(b"\r\n\r\n")
                    length = 0
                    for line in head.split(b"\r\n"):
                        if line.lower().startswith(b"content-length:"):
                            length = int(line.split(b":")[1])
                    await reader.readexactly(length)
                    if head.startswith(b"POST"):
                        if index is None:
                            index = len(served)
                            served.append(0)
                        served[index] += 1
                    writer.write(
                        b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                        b"Content-Length: 2\r\n\r\n{}"
                    )
                    await writer.drain()
            except (asyncio.IncompleteReadError, ConnectionError):
                pass
            writer.close()

        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        servers.append(server)
        return f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}", served

    yield start
    for server in servers:
        server.close()
        await server.wait_closed()


async def test_sequential_requests_share_one_connection(
    counting_engine: CountingEngineFactory, tether: TetherFactory, http: aiohttp.ClientSession
) -> None:
    """Keep-alive: ten requests one after another use one connection to the engine."""
    engine_url, served = await counting_engine()
    server = await tether(engine_url)
    for _ in range(10):
        async with http.post(url(server), json=chat_body(stream=False)) as response:
            assert response.status == 200
    assert served == [10]


class _Discard:
    def feed(self, chunk: bytes) -> None:
        pass


async def _post(upstream: UpstreamClient) -> None:
    """One request over the client's pooled connections, its response read to the end."""
    exchange = upstream.exchange("POST", replayable=False)
    head = b"POST /v1/chat/completions HTTP/1.1\r\nHost: engine\r\nContent-Length: 2\r\n\r\n"
    await exchange.send(head, b"{}")
    assert (await exchange.wait_head()).status == 200
    exchange.attach(_Discard())
    await exchange.wait_end()


async def test_idle_connections_are_closed_before_the_engines_keep_alive(
    counting_engine: CountingEngineFactory, settings: SettingsFactory
) -> None:
    """An idle pooled connection is closed after the pool's idle timeout (the engine
    profile's keep-alive: 4 s for vLLM and SGLang, below uvicorn's 5 s; 0.2 s here): the
    next request opens a new one."""
    engine_url, served = await counting_engine()
    async with UpstreamClient.open(
        settings(upstream_url=engine_url), keepalive_seconds=0.2, uploads=UploadLimit(1)
    ) as upstream:
        await _post(upstream)
        await asyncio.sleep(0.5)  # idle for longer than the pool keeps connections
        await _post(upstream)
    assert served == [1, 1]


async def test_a_connection_is_never_reused_after_its_client_left(
    fake_engine: FakeEngineFactory, tether: TetherFactory, http: aiohttp.ClientSession
) -> None:
    """Even when the engine ended the aborted response cleanly, its connection is closed:
    the next request gets a fresh one (the rule the engine's disconnect detection relies on)."""
    _, engine_url = await fake_engine(token_interval=0.01)
    server = await tether(engine_url)
    client = await RawClient.connect(server.port)
    await client.send_request(chat_body(max_tokens=100_000))
    await client.read_until(b"tok0")
    client.close_fin()
    await settled(server)
    await drained(server)
    assert server.context.upstream.idle_connections == 0
    async with http.post(url(server), json=chat_body(stream=False, max_tokens=1)) as response:
        assert response.status == 200
    assert server.context.upstream.idle_connections == 1
