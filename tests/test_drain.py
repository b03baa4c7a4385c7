"""Drain takes no new work (the real process): from SIGTERM on, idle keep-alive connections
are closed; a request that still arrives on a kept-alive connection during the grace period
gets 503 `shutting_down` with `Connection: close` and `Retry-After: 0` and never reaches the
engine; responses still in flight finish, with `Connection: close` where their head had not
gone out yet. In Kubernetes this is the traffic of the endpoint-removal lag."""

from __future__ import annotations

import asyncio
import signal

from .support.chat import chat_body
from .support.metrics import metric_in_text
from .support.processes import TetherProcessFactory
from .support.raw_http import RawClient, json_request, read_reply
from .support.upstreams import FakeEngineFactory
from .support.waiting import poll_until


async def test_drain_closes_idle_connections_and_refuses_new_requests(
    fake_engine: FakeEngineFactory, tether_process: TetherProcessFactory
) -> None:
    """SIGTERM with a long stream keeping tether in its grace period."""
    engine, engine_url = await fake_engine(token_interval=0.01)
    process = await tether_process(engine_url, TETHER_SHUTDOWN_GRACE="4")
    idle = await RawClient.connect(process.port)
    await idle.send(json_request(chat_body(stream=False, max_tokens=1), "idle-1"))
    assert (await idle.read_reply()).status == 200  # now an idle keep-alive connection
    long = await RawClient.connect(process.port)
    await long.send(json_request(chat_body(max_tokens=100_000), "long"))
    await long.read_until(b"tok0")
    # Streams 40 tokens (0.4 s): its head is out before SIGTERM, it ends inside the grace.
    kept = await RawClient.connect(process.port)
    await kept.send(json_request(chat_body(max_tokens=40), "kept"))
    await kept.read_until(b"tok0")
    # Answers after 60 tokens (0.6 s): its head goes out after SIGTERM.
    waiting = await RawClient.connect(process.port)
    await waiting.send(json_request(chat_body(stream=False, max_tokens=60), "waiting"))
    await engine.wait_for(lambda: len(engine.generations) == 4)

    process.send_signal(signal.SIGTERM)

    await idle.expect_closed(timeout=2)  # closed at once, not at the end of the grace
    rest = await kept.read_until(b"\r\n0\r\n\r\n")  # the stream, to its last chunk
    assert b"data: [DONE]\n\n" in rest
    answer = await waiting.read_reply()
    assert answer.status == 200 and answer.headers["Connection"] == "close"

    # A new request on the kept-alive connection, during the grace period.
    await kept.send(json_request(chat_body(max_tokens=1), "late"))
    refused = await kept.read_reply()
    assert refused.status == 503
    assert refused.json()["error"]["code"] == "shutting_down"
    assert refused.headers["Connection"] == "close"
    assert refused.headers["Retry-After"] == "0"
    assert refused.headers["X-Request-Id"] == "late"
    await kept.expect_closed()
    assert len(engine.generations) == 4  # the late request never reached the engine

    async def rejected() -> bool:
        scrape = await _scrape(process.admin_port)
        return metric_in_text(scrape, "tether_request_outcomes_total", outcome="rejected") == 1

    await poll_until(rejected, 2, what="the refusal to be counted as rejected")
    assert await process.wait_exit() == 0


async def _scrape(admin_port: int) -> str:
    reader, writer = await asyncio.open_connection("127.0.0.1", admin_port)
    writer.write(b"GET /metrics HTTP/1.1\r\nHost: tether\r\nConnection: close\r\n\r\n")
    await writer.drain()
    reply = await read_reply(reader)
    writer.close()
    return reply.body.decode()
