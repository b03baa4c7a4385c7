"""TETHER_REQUEST_TIMEOUT and TETHER_STREAM_IDLE_TIMEOUT: the engine is aborted, the client
gets a 504 (before the response started) or a cut stream (after)."""

from __future__ import annotations

import aiohttp
import pytest

from tether_fake_engine import GenerationState

from .support.chat import chat_body
from .support.in_process import TetherFactory, url
from .support.metrics import metric
from .support.upstreams import FakeEngineFactory


async def test_request_timeout_before_the_response_is_a_504(
    fake_engine: FakeEngineFactory, tether: TetherFactory, http: aiohttp.ClientSession
) -> None:
    """A request still waiting for the engine when the timeout fires gets 504 JSON; the engine
    is told to abort it."""
    engine, engine_url = await fake_engine()
    server = await tether(engine_url, request_timeout=0.2)
    async with http.post(url(server), json=chat_body(stream=False, prefill=30)) as response:
        assert response.status == 504
        assert (await response.json())["error"]["code"] == "upstream_timeout"
    [internal_id] = engine.generations
    await engine.wait_for(lambda: engine.generation(internal_id).state is GenerationState.ABORTED)
    registry = server.context.metrics.registry
    assert metric(registry, "tether_request_outcomes_total", outcome="timed_out") == 1


async def test_request_timeout_mid_stream_cuts_the_stream(
    fake_engine: FakeEngineFactory, tether: TetherFactory, http: aiohttp.ClientSession
) -> None:
    """A stream that outlives the request timeout is cut, and the engine aborted."""
    engine, engine_url = await fake_engine(token_interval=0.01)
    server = await tether(engine_url, request_timeout=0.3)
    async with http.post(url(server), json=chat_body(max_tokens=10_000)) as response:
        assert response.status == 200
        with pytest.raises(aiohttp.ClientPayloadError):
            await response.read()
    [internal_id] = engine.generations
    await engine.wait_for(lambda: engine.generation(internal_id).state is GenerationState.ABORTED)


async def test_idle_stream_is_cut_and_aborted(
    fake_engine: FakeEngineFactory, tether: TetherFactory, http: aiohttp.ClientSession
) -> None:
    """An engine that stalls mid-stream for longer than the idle timeout is aborted."""
    engine, engine_url = await fake_engine(token_interval=0.01)
    server = await tether(engine_url, stream_idle_timeout=0.2)
    body = chat_body(max_tokens=100, stall_after=3)
    async with http.post(url(server), json=body) as response:
        received = b""
        with pytest.raises(aiohttp.ClientPayloadError):
            async for chunk in response.content.iter_any():
                received += chunk
    assert b"tok2" in received and b"[DONE]" not in received
    [internal_id] = engine.generations
    await engine.wait_for(lambda: engine.generation(internal_id).state is GenerationState.ABORTED)
    registry = server.context.metrics.registry
    assert metric(registry, "tether_upstream_errors_total", kind="upstream_timeout") == 1


async def test_slow_but_steady_stream_is_not_cut_by_the_idle_timeout(
    fake_engine: FakeEngineFactory, tether: TetherFactory, http: aiohttp.ClientSession
) -> None:
    """The idle timeout bounds silence, not length: a stream with regular tokens completes."""
    engine, engine_url = await fake_engine(token_interval=0.05)
    server = await tether(engine_url, stream_idle_timeout=0.5)
    async with http.post(url(server), json=chat_body(max_tokens=15)) as response:
        assert (await response.text()).endswith("data: [DONE]\n\n")
    assert engine.aborts == []
