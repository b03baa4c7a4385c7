"""Graceful shutdown of the real `tether` process: SIGTERM stops new work and readiness,
lets in-flight requests finish within the grace period, aborts the rest upstream, exits 0."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import sys

import aiohttp
import pytest

from proxy.fake_engine import GenerationState

from .conftest import chat_body


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


async def _start_tether(engine_url: str, **env: str) -> tuple[asyncio.subprocess.Process, int, int]:
    port, admin_port = _free_port(), _free_port()
    clean = {k: v for k, v in os.environ.items() if not k.startswith("TETHER_")}
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "proxy",
        env={
            **clean,
            "TETHER_UPSTREAM_URL": engine_url,
            "TETHER_HOST": "127.0.0.1",
            "TETHER_PORT": str(port),
            "TETHER_ADMIN_HOST": "127.0.0.1",
            "TETHER_ADMIN_PORT": str(admin_port),
            "TETHER_HEALTH_INTERVAL": "0.1",
            "TETHER_ABORT_REPEAT_DELAY": "0",
            **env,
        },
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    async with aiohttp.ClientSession() as session, asyncio.timeout(15):
        while True:  # the process gives no other signal of readiness than its probe
            try:
                async with session.get(f"http://127.0.0.1:{admin_port}/readyz") as response:
                    if response.status == 200:
                        break
            except aiohttp.ClientConnectionError:
                pass
            await asyncio.sleep(0.05)
    return process, port, admin_port


async def test_sigterm_drains_then_aborts_what_is_left(fake_engine) -> None:
    """One request finishes inside the grace period and is not aborted; one does not and is
    aborted upstream; readiness turns 503 at once; the process exits 0."""
    engine, engine_url = await fake_engine(token_interval=0.01)
    process, port, admin_port = await _start_tether(engine_url, TETHER_SHUTDOWN_GRACE="1.5")
    base = f"http://127.0.0.1:{port}/v1/chat/completions"
    async with aiohttp.ClientSession() as session:
        short = await session.post(
            base, json=chat_body(max_tokens=60), headers={"X-Request-Id": "short"}
        )
        long = await session.post(
            base, json=chat_body(max_tokens=100_000), headers={"X-Request-Id": "long"}
        )
        await engine.wait_for(lambda: len(engine.generations) == 2)

        process.send_signal(signal.SIGTERM)

        async with asyncio.timeout(2):
            while True:  # readiness is polled by kubelet the same way
                async with session.get(f"http://127.0.0.1:{admin_port}/readyz") as response:
                    if response.status == 503:
                        assert "shutting down" in (await response.json())["reason"]
                        break
                await asyncio.sleep(0.02)
        with pytest.raises(aiohttp.ClientConnectionError):
            async with session.get(f"http://127.0.0.1:{port}/health"):
                pass

        assert (await short.text()).endswith("data: [DONE]\n\n")
        with pytest.raises(aiohttp.ClientPayloadError):
            await long.read()

    assert await asyncio.wait_for(process.wait(), 10) == 0
    states = {g.max_tokens: g.state for g in engine.generations.values()}
    assert states == {60: GenerationState.COMPLETED, 100_000: GenerationState.ABORTED}
    assert len(engine.aborts) == 1
    logs = (await process.stdout.read()).decode()  # type: ignore[union-attr]
    assert '"outcome": "shutdown_aborted"' in logs and '"event": "shutdown_finished"' in logs


async def test_sigterm_with_nothing_in_flight_exits_at_once(fake_engine) -> None:
    """An idle tether stops without waiting for the grace period."""
    _, engine_url = await fake_engine()
    process, _, _ = await _start_tether(engine_url, TETHER_SHUTDOWN_GRACE="30")
    loop = asyncio.get_running_loop()
    started = loop.time()
    process.send_signal(signal.SIGINT)
    assert await asyncio.wait_for(process.wait(), 10) == 0
    assert loop.time() - started < 5


async def test_request_still_waiting_at_the_end_of_grace_gets_a_503(fake_engine, tether) -> None:
    """A request that has no response yet when the grace period ends is answered 503
    (safe to retry elsewhere: no token went out) and aborted upstream."""
    engine, engine_url = await fake_engine()
    server = await tether(engine_url, shutdown_grace=0.2)
    async with aiohttp.ClientSession() as session:
        pending = asyncio.ensure_future(
            session.post(
                f"http://127.0.0.1:{server.port}/v1/chat/completions",
                json=chat_body(stream=False, prefill=30),
            )
        )
        await engine.wait_for(lambda: len(engine.generations) == 1)

        await server.stop()

        async with await pending as response:
            assert response.status == 503
            assert (await response.json())["error"]["code"] == "shutting_down"
    [internal_id] = engine.generations
    assert engine.generation(internal_id).state is GenerationState.ABORTED
