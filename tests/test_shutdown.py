"""Graceful shutdown of the real `tether` process: SIGTERM stops new work and readiness,
lets in-flight requests finish within the grace period, aborts the rest upstream, exits 0."""

from __future__ import annotations

import asyncio
import signal

import aiohttp
import pytest

from tether_fake_engine import GenerationState

from .support.chat import chat_body
from .support.in_process import TetherFactory, url
from .support.processes import TetherProcessFactory
from .support.upstreams import FakeEngineFactory
from .support.waiting import poll_until


async def test_sigterm_drains_then_aborts_what_is_left(
    fake_engine: FakeEngineFactory,
    tether_process: TetherProcessFactory,
    http: aiohttp.ClientSession,
) -> None:
    """One request finishes inside the grace period and is not aborted; one does not and is
    aborted upstream; readiness turns 503 at once; the process exits 0."""
    engine, engine_url = await fake_engine(token_interval=0.01)
    # The short stream needs 1 s (100 tokens, 10 ms apart), 3x less than the grace period: a
    # loaded machine finishes it in time, and it is still running when the shutdown starts.
    process = await tether_process(engine_url, TETHER_SHUTDOWN_GRACE="3")
    short = await http.post(
        process.url(), json=chat_body(max_tokens=100), headers={"X-Request-Id": "short"}
    )
    long = await http.post(
        process.url(), json=chat_body(max_tokens=100_000), headers={"X-Request-Id": "long"}
    )
    await engine.wait_for(lambda: len(engine.generations) == 2)
    by_length = {g.max_tokens: g for g in engine.generations.values()}

    process.send_signal(signal.SIGTERM)

    async def not_ready() -> dict[str, str] | None:  # readiness is polled by kubelet the same way
        async with http.get(process.admin_url("/readyz")) as response:
            if response.status != 503:
                return None
            body: dict[str, str] = await response.json()
            return body

    answer = await poll_until(not_ready, 2, interval=0.02, what="/readyz to turn 503")
    assert "shutting down" in answer["reason"]
    # Draining has something to drain: the short stream is still running.
    assert by_length[100].state is GenerationState.RUNNING
    with pytest.raises(aiohttp.ClientConnectionError):
        async with http.get(process.url("/health")):
            pass

    assert (await short.text()).endswith("data: [DONE]\n\n")
    with pytest.raises(aiohttp.ClientPayloadError):
        await long.read()

    assert await process.wait_exit() == 0
    states = {max_tokens: g.state for max_tokens, g in by_length.items()}
    assert states == {100: GenerationState.COMPLETED, 100_000: GenerationState.ABORTED}
    assert len(engine.aborts) == 1
    logs = process.output()
    assert '"outcome": "shutdown_aborted"' in logs and '"event": "shutdown_finished"' in logs


async def test_sigterm_with_nothing_in_flight_exits_at_once(
    fake_engine: FakeEngineFactory, tether_process: TetherProcessFactory
) -> None:
    """An idle tether stops without waiting for the grace period."""
    _, engine_url = await fake_engine()
    process = await tether_process(engine_url, TETHER_SHUTDOWN_GRACE="30")
    loop = asyncio.get_running_loop()
    started = loop.time()
    assert await process.stop(signal.SIGINT) == 0
    # Waiting for the grace period would take 30 s; an idle exit takes well under 1 s.
    assert loop.time() - started < 5


async def test_request_still_waiting_at_the_end_of_grace_gets_a_503(
    fake_engine: FakeEngineFactory, tether: TetherFactory, http: aiohttp.ClientSession
) -> None:
    """A request that has no response yet when the grace period ends is answered 503
    (safe to retry elsewhere: no token went out) and aborted upstream."""
    engine, engine_url = await fake_engine()
    server = await tether(engine_url, shutdown_grace=0.2)
    pending = asyncio.ensure_future(
        http.post(url(server), json=chat_body(stream=False, prefill=30))
    )
    await engine.wait_for(lambda: len(engine.generations) == 1)

    await server.stop()

    async with await pending as response:
        assert response.status == 503
        assert (await response.json())["error"]["code"] == "shutting_down"
    [internal_id] = engine.generations
    assert engine.generation(internal_id).state is GenerationState.ABORTED
