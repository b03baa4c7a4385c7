"""When the engine cannot be reached, clients get clear JSON errors with the right status."""

from __future__ import annotations

import socket

from .conftest import chat_body, url


def _closed_port() -> int:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    return port


async def test_engine_down_is_a_502_json_error(tether, http) -> None:
    """Nothing listening upstream: 502 with an OpenAI-style body and the client's ID."""
    server = await tether(f"http://127.0.0.1:{_closed_port()}")
    async with http.post(url(server), json=chat_body(), headers={"X-Request-Id": "r1"}) as r:
        assert r.status == 502
        assert r.headers["X-Request-Id"] == "r1"
        error = (await r.json())["error"]
    assert error["code"] == "upstream_unavailable"
    assert error["type"] == "upstream_error"
    assert server.context.metrics.upstream_errors.labels("upstream_unavailable")._value.get() == 1
    assert len(server.context.registry) == 0
    assert server.context.aborts.pending == 0  # nothing reached the engine: nothing to abort


async def test_connect_timeout_is_a_504_json_error(tether, http) -> None:
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
