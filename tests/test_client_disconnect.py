"""A client that leaves, in any phase, gets its request aborted upstream: the connection is
dropped and the engine's abort API names the right internal ID."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest
from aiohttp import web

from proxy.outcomes import Phase
from proxy.server.runner import TetherServer
from tether_fake_engine import AbortRoute, FakeEngine, GenerationState

from .support.canaries import canary_bytes
from .support.chat import chat_body
from .support.in_process import TetherFactory, drained, settled, url
from .support.metrics import metric
from .support.raw_http import RawClient
from .support.upstreams import FakeEngineFactory, UpstreamAppFactory
from .support.waiting import poll_until


def _disconnects(server: TetherServer, phase: str) -> float:
    return metric(server.context.metrics.registry, "tether_client_disconnects_total", phase=phase)


async def _one_generation(engine: FakeEngine) -> str:
    await engine.wait_for(lambda: len(engine.generations) == 1)
    return next(iter(engine.generations))


@pytest.mark.parametrize("close", ["fin", "rst"])
async def test_disconnect_mid_stream_aborts_the_generation(
    fake_engine: FakeEngineFactory, tether: TetherFactory, close: str
) -> None:
    """Leaving after the first tokens stops the engine, which would otherwise go on."""
    engine, engine_url = await fake_engine(token_interval=0.01, max_tokens=10_000)
    server = await tether(engine_url)
    client = await RawClient.connect(server.port)
    await client.send_request(chat_body(max_tokens=10_000), headers={"X-Request-Id": "mine"})
    await client.read_until(b"tok1")
    internal_id = await _one_generation(engine)

    client.close(close)

    await engine.wait_for(lambda: engine.generation(internal_id).state is GenerationState.ABORTED)
    assert engine.aborts[0].ids == (f"chatcmpl-{internal_id}",)
    await drained(server)
    assert _disconnects(server, "streaming") == 1


@pytest.mark.parametrize("close", ["fin", "rst"])
async def test_disconnect_before_first_token_aborts(
    fake_engine: FakeEngineFactory, tether: TetherFactory, close: str
) -> None:
    """Leaving while the engine is still in prefill (no byte yet) is noticed at once."""
    engine, engine_url = await fake_engine()
    server = await tether(engine_url)
    client = await RawClient.connect(server.port)
    await client.send_request(chat_body(stream=False, prefill=30))
    internal_id = await _one_generation(engine)
    assert server.context.registry.find(internal_id)[0].phase is Phase.WAITING

    client.close(close)

    await engine.wait_for(lambda: engine.generation(internal_id).state is GenerationState.ABORTED)
    assert engine.generation(internal_id).produced == 0


async def test_disconnect_during_non_streaming_generation_aborts(
    fake_engine: FakeEngineFactory, tether: TetherFactory
) -> None:
    """A non-streaming request whose client leaves mid-generation is aborted too."""
    engine, engine_url = await fake_engine(token_interval=0.01)
    server = await tether(engine_url)
    client = await RawClient.connect(server.port)
    await client.send_request(chat_body(stream=False, max_tokens=10_000))
    internal_id = await _one_generation(engine)
    await engine.wait_for(lambda: engine.generation(internal_id).produced >= 3)

    client.close_fin()

    await engine.wait_for(lambda: engine.generation(internal_id).state is GenerationState.ABORTED)
    assert engine.generation(internal_id).produced < 10_000


async def test_disconnect_while_streaming_a_body_drops_the_engines_connection(
    upstream_app: UpstreamAppFactory, tether: TetherFactory
) -> None:
    """A body that streams through (an upload) reached the engine before the client left:
    the engine's connection is dropped mid-body, so it never gets a whole request and starts
    no work; no abort call is needed for what never started."""
    engine = FakeEngine()
    received_head = asyncio.Event()
    upload_cut = asyncio.Event()

    async def upload(request: web.Request) -> web.Response:
        received_head.set()
        try:
            await request.read()
        except (asyncio.CancelledError, ConnectionError):
            upload_cut.set()
            raise
        return web.Response(text="done")

    engine.app.router.add_post("/v1/audio/transcriptions", upload)
    engine_url = await upstream_app(engine.app)
    server = await tether(engine_url)
    client = await RawClient.connect(server.port)
    await client.send_request(
        canary_bytes(100_000),
        path="/v1/audio/transcriptions",
        content_type="application/octet-stream",
        body_bytes_now=1000,
    )
    await asyncio.wait_for(received_head.wait(), 5)
    [state] = list(server.context.registry)
    assert state.phase is Phase.BODY

    client.close_fin()

    await asyncio.wait_for(upload_cut.wait(), 5)
    await drained(server)
    assert engine.aborts == []
    assert _disconnects(server, "body") == 1
    registry = server.context.metrics.registry
    assert (
        metric(registry, "tether_upstream_cancellations_total", reason="client_disconnected") == 1
    )


async def test_disconnect_while_sending_a_json_body_never_reaches_the_engine(
    fake_engine: FakeEngineFactory, tether: TetherFactory
) -> None:
    """A JSON body is read whole first (tether writes its ID into it): a client that leaves
    half-way leaves nothing upstream to abort."""
    engine, engine_url = await fake_engine()
    server = await tether(engine_url)
    client = await RawClient.connect(server.port)
    await client.send_request(chat_body(), body_bytes_now=10)
    # tether has no event for "a request arrived": poll its registry.
    await poll_until(lambda: len(server.context.registry) == 1, 5, what="the request registered")

    client.close_fin()

    await settled(server)
    assert engine.requests == []
    assert engine.aborts == []
    assert _disconnects(server, "body") == 1


async def test_engine_without_abort_api_still_sees_the_connection_drop(
    fake_engine: FakeEngineFactory, tether: TetherFactory
) -> None:
    """With TETHER_ENGINE=none the dropped upstream connection is the abort."""
    engine, engine_url = await fake_engine(
        hears_disconnects=True, token_interval=0.01, abort_route=AbortRoute.NONE
    )
    server = await tether(engine_url, engine="none")
    client = await RawClient.connect(server.port)
    await client.send_request(chat_body(max_tokens=10_000))
    await client.read_until(b"tok1")
    internal_id = await _one_generation(engine)

    client.close_rst()

    await engine.wait_for(lambda: engine.generation(internal_id).state is GenerationState.ABORTED)
    assert engine.disconnects[0][0] == internal_id
    assert engine.aborts == []


async def test_completed_request_is_never_aborted(
    fake_engine: FakeEngineFactory, tether: TetherFactory, http: aiohttp.ClientSession
) -> None:
    """A request that ran to the end is not aborted, even if the client closes right after."""
    engine, engine_url = await fake_engine(max_tokens=3)
    server = await tether(engine_url)
    async with http.post(url(server), json=chat_body(max_tokens=3)) as response:
        text = await response.text()
    assert text.endswith("data: [DONE]\n\n")
    await settled(server)
    await drained(server)
    assert engine.aborts == []
    assert all(g.state is GenerationState.COMPLETED for g in engine.generations.values())
