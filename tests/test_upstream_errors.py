"""When the engine cannot be reached, clients get clear JSON errors with the right status."""

from __future__ import annotations

import socket

import aiohttp

from .support.chat import chat_body
from .support.in_process import TetherFactory, url
from .support.metrics import metric
from .support.net import free_port


async def test_engine_down_is_a_502_json_error(
    tether: TetherFactory, http: aiohttp.ClientSession
) -> None:
    """Nothing listening upstream: 502 with an OpenAI-style body and the client's ID."""
    server = await tether(f"http://127.0.0.1:{free_port()}")
    async with http.post(url(server), json=chat_body(), headers={"X-Request-Id": "r1"}) as r:
        assert r.status == 502
        assert r.headers["X-Request-Id"] == "r1"
        error = (await r.json())["error"]
    assert error["code"] == "upstream_unavailable"
    assert error["type"] == "upstream_error"
    registry = server.context.metrics.registry
    assert metric(registry, "tether_upstream_errors_total", kind="upstream_unavailable") == 1
    assert len(server.context.registry) == 0
    assert server.context.aborts.pending == 0  # nothing reached the engine: nothing to abort


async def test_connect_timeout_is_a_504_json_error(
    tether: TetherFactory, http: aiohttp.ClientSession
) -> None:
    """An engine that never accepts the connection (full backlog) gets 504 after the timeout."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(0)
    port = listener.getsockname()[1]
    # Fill the accept queue so that further SYNs are dropped and connect() hangs.
    fillers = []
    for _ in range(4):
        filler = socket.socket()
        filler.setblocking(False)
        filler.connect_ex(("127.0.0.1", port))
        fillers.append(filler)
    try:
        server = await tether(f"http://127.0.0.1:{port}", connect_timeout=0.3)
        async with http.post(url(server), json=chat_body()) as response:
            assert response.status == 504
            assert (await response.json())["error"]["code"] == "upstream_connect_timeout"
    finally:
        for filler in fillers:
            filler.close()
        listener.close()
