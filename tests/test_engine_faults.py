"""Engine faults: crashes, silence, a broken abort endpoint, restarts and malformed output.
Each case checks what the client saw, what the engine saw, and tether's own state after."""

from __future__ import annotations

import asyncio
import os
import signal
import tracemalloc

import aiohttp
import pytest
from aiohttp import web

from proxy.server.runner import TetherServer
from tether_fake_engine import FakeEngine, GenerationState

from .support.chat import chat_body
from .support.in_process import TetherFactory, admin_url, drained, leave_mid_stream, settled, url
from .support.metrics import metric
from .support.net import free_port
from .support.processes import EngineProcessFactory
from .support.upstreams import FakeEngineFactory, UpstreamAppFactory, serve_upstream
from .support.waiting import poll_until


async def test_engine_killed_mid_stream_cuts_streams_without_an_abort_storm(
    engine_process: EngineProcessFactory, tether: TetherFactory, http: aiohttp.ClientSession
) -> None:
    """SIGKILL of the engine process: every client stream is cut (never a clean [DONE]), the
    requests end as upstream failures, no abort call is attempted, the registry empties."""
    engine = await engine_process("--token-interval", "0.01", "--max-tokens", "100000")
    server = await tether(engine.url)
    streams = [await http.post(url(server), json=chat_body(max_tokens=100_000)) for _ in range(10)]
    for stream in streams:
        await stream.content.readuntil(b"tok0")

    engine.process.send_signal(signal.SIGKILL)

    for stream in streams:
        with pytest.raises(aiohttp.ClientPayloadError):
            await stream.read()
    await settled(server)
    registry = server.context.metrics.registry
    assert metric(registry, "tether_request_outcomes_total", outcome="upstream_failed") == 10
    assert metric(registry, "tether_upstream_errors_total", kind="upstream_broken") == 10
    assert server.context.aborts.pending == 0
    assert (
        metric(registry, "tether_upstream_cancellations_total", reason="client_disconnected") == 0
    )


async def test_engine_that_never_answers_is_bounded_by_the_request_timeout(
    tether: TetherFactory, http: aiohttp.ClientSession
) -> None:
    """An engine that accepts connections and never answers: the client gets 504 when
    TETHER_REQUEST_TIMEOUT fires; the abort call (to the same dead engine) never holds the
    client up, and gives up at its deadline."""
    connections: list[asyncio.StreamWriter] = []

    async def swallow(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connections.append(writer)
        await reader.read(-1)

    silent = await asyncio.start_server(swallow, "127.0.0.1", 0)
    port = silent.sockets[0].getsockname()[1]
    try:
        server = await tether(
            f"http://127.0.0.1:{port}",
            engine="vllm",
            request_timeout=0.3,
            abort_timeout=0.2,
            abort_deadline=0.4,
        )
        loop = asyncio.get_running_loop()
        started = loop.time()
        async with http.post(url(server), json=chat_body()) as response:
            assert response.status == 504
            assert (await response.json())["error"]["code"] == "upstream_timeout"
        # The timeout fires at 0.3 s; without it the client would wait for the engine forever
        # (here: the test session's 20 s). 3 s leaves a loaded machine room.
        assert loop.time() - started < 3.0
        await drained(server)
        registry = server.context.metrics.registry
        assert metric(registry, "tether_aborts_total", engine="vllm", result="failed") == 1
        assert len(server.context.registry) == 0
    finally:
        for writer in connections:
            writer.close()
        silent.close()
        await silent.wait_closed()


async def test_abort_endpoint_failing_is_bounded_and_logged_once(
    fake_engine: FakeEngineFactory, tether: TetherFactory, capsys: pytest.CaptureFixture[str]
) -> None:
    """An abort endpoint that keeps answering 503: attempts stop at the deadline, the client
    was never held up, and the failure is counted and logged once."""
    engine, engine_url = await fake_engine(token_interval=0.01)
    engine.abort_failures = 10_000
    server = await tether(engine_url, abort_timeout=0.1, abort_deadline=0.5)
    await leave_mid_stream(server)  # the client side is done before the aborts are
    assert server.context.aborts.pending == 1

    await drained(server)

    registry = server.context.metrics.registry
    assert metric(registry, "tether_aborts_total", engine="vllm", result="failed") == 1
    assert 2 <= len(engine.aborts) <= 10  # backoff keeps the attempts few
    assert capsys.readouterr().out.count("abort_failed") == 1


async def test_engine_restart_gives_502_then_works_again(
    tether: TetherFactory, http: aiohttp.ClientSession
) -> None:
    """While the engine is down clients get 502 JSON and readiness is 503; when it is back on
    the same port, readiness returns and requests work, without restarting tether."""
    port = free_port()
    first = await serve_upstream(FakeEngine(max_tokens=2).app, port)
    server = await tether(f"http://127.0.0.1:{port}")
    async with http.post(url(server), json=chat_body(stream=False)) as response:
        assert response.status == 200

    await first.close()
    async with http.post(url(server), json=chat_body(stream=False)) as response:
        assert response.status == 502
        assert (await response.json())["error"]["code"] == "upstream_unavailable"
    await _wait_ready(http, server, 503)

    second = await serve_upstream(FakeEngine(max_tokens=2).app, port)
    try:
        await _wait_ready(http, server, 200)
        async with http.post(url(server), json=chat_body(stream=False)) as response:
            assert response.status == 200
    finally:
        await second.close()


async def _wait_ready(http: aiohttp.ClientSession, server: TetherServer, status: int) -> None:
    async def answers() -> bool:  # readiness is a polled probe
        async with http.get(admin_url(server, "/readyz")) as response:
            return response.status == status

    await poll_until(answers, 5, interval=0.02, what=f"/readyz to answer {status}")


@pytest.mark.parametrize(
    "body",
    [
        b"data: {not json at all\n\n",
        b"data: \xff\xfe garbage bytes\n\n",
        b"event without data field\n\n",
        b'data: {"id": "unterminated',
    ],
)
async def test_malformed_sse_passes_through_unchanged(
    upstream_app: UpstreamAppFactory,
    tether: TetherFactory,
    http: aiohttp.ClientSession,
    body: bytes,
) -> None:
    """tether does not parse events: malformed ones reach the client byte for byte."""

    async def stream(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write(body)
        return response

    app = web.Application()
    app.router.add_post("/v1/chat/completions", stream)
    server = await tether(await upstream_app(app))
    async with http.post(url(server), json=chat_body()) as response:
        assert await response.read() == body


async def test_invalid_json_response_passes_through(
    upstream_app: UpstreamAppFactory, tether: TetherFactory, http: aiohttp.ClientSession
) -> None:
    """A non-streaming body that claims JSON but is not still reaches the client exactly."""
    broken = b'{"id": "x", oops'

    async def answer(request: web.Request) -> web.Response:
        return web.Response(body=broken, content_type="application/json")

    app = web.Application()
    app.router.add_post("/v1/chat/completions", answer)
    server = await tether(await upstream_app(app))
    async with http.post(url(server), json=chat_body(stream=False)) as response:
        assert await response.read() == broken
        assert response.headers["Content-Length"] == str(len(broken))


async def test_huge_single_event_is_relayed_in_bounded_memory(
    upstream_app: UpstreamAppFactory, tether: TetherFactory, http: aiohttp.ClientSession
) -> None:
    """A 32 MiB event with no line break is relayed chunk by chunk; tether never holds it."""
    piece = os.urandom(64 * 1024).hex().encode()  # 128 KiB of hex, no newline
    pieces = 256  # 32 MiB

    async def stream(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write(b"data: ")
        for _ in range(pieces):
            await response.write(piece)
        await response.write(b"\n\n")
        return response

    app = web.Application()
    app.router.add_post("/v1/chat/completions", stream)
    server = await tether(await upstream_app(app))
    received = 0
    tracemalloc.start()
    try:
        async with http.post(url(server), json=chat_body()) as response:
            async for chunk in response.content.iter_any():
                received += len(chunk)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert received == len(b"data: ") + pieces * len(piece) + 2
    # Engine, tether and client share this process: all three together stay far below 32 MiB.
    assert peak < 8 * 1024 * 1024


async def test_engine_closing_before_headers_is_a_502(
    upstream_app: UpstreamAppFactory, tether: TetherFactory, http: aiohttp.ClientSession
) -> None:
    """An engine that drops the connection without answering gives a 502, not a hang."""

    async def drop(request: web.Request) -> web.Response:
        assert request.transport is not None
        request.transport.abort()
        await asyncio.Event().wait()
        raise AssertionError("unreachable")

    app = web.Application()
    app.router.add_post("/v1/chat/completions", drop)
    server = await tether(await upstream_app(app))
    async with http.post(url(server), json=chat_body()) as response:
        assert response.status == 502
        assert (await response.json())["error"]["type"] == "upstream_error"
    assert server.context.aborts.pending == 0


async def test_generation_state_after_faults_is_consistent(
    fake_engine: FakeEngineFactory, tether: TetherFactory, http: aiohttp.ClientSession
) -> None:
    """After a mix of completed, abandoned and failed requests, metrics add up."""
    engine, engine_url = await fake_engine(token_interval=0.005)
    server = await tether(engine_url)
    async with http.post(url(server), json=chat_body(max_tokens=3)) as response:
        await response.read()
    await leave_mid_stream(server, close="rst")
    async with http.post(url(server), json=chat_body(max_tokens=50, fail_after=2)) as response:
        with pytest.raises(aiohttp.ClientPayloadError):
            await response.read()
    await settled(server)  # the in-flight gauge is back to 0 too
    await drained(server)
    registry = server.context.metrics.registry
    assert [
        metric(registry, "tether_request_outcomes_total", outcome=outcome)
        for outcome in ("completed", "client_disconnected", "upstream_failed")
    ] == [1, 1, 1]
    assert engine.aborted_ids() == {
        g.request_id for g in engine.generations.values() if g.max_tokens == 100_000
    }
    assert GenerationState.RUNNING not in {
        g.state for g in engine.generations.values() if g.max_tokens != 50
    }
