"""Behind a real router: smg (SGLang's model gateway) → tether → an engine that keeps
generating after its client left (the fake engine). smg notices a client that leaves and drops
its connection to the worker, and calls no abort API; tether turns that drop into the engine's
abort. Where it matters the same test sends the same client through smg straight to the engine,
where the work goes on."""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import AsyncIterator, Awaitable
from pathlib import Path
from typing import Protocol

import aiohttp
import pytest

from proxy.server.runner import TetherServer
from tether_fake_engine import FakeEngine, Generation, GenerationState

from .support.chat import chat_body, sse_ids
from .support.in_process import TetherFactory, drained, settled, url
from .support.metrics import metric
from .support.raw_http import RawClient
from .support.smg import FAST_HEALTH_CHECKS, SKIP_REASON, Smg, smg_executable, start_smg
from .support.upstreams import FakeEngineFactory
from .support.waiting import poll_until

pytestmark = pytest.mark.skipif(smg_executable() is None, reason=SKIP_REASON)

INTERNAL_ID = re.compile(r"^[0-9a-f]{32}$")
# Seconds from the client's close at smg to the engine ending the request through tether's
# abort: observed a few milliseconds; the bound holds on a loaded 2-core machine and is far
# below what a request the engine keeps running takes (max_tokens times the token interval).
STOPPED_WITHIN = 2.0
# How long a test waits for the engine to show something (a request, a disconnect, tokens).
ENGINE_TIMEOUT = 10.0
TOKEN_INTERVAL = 0.01
LONG = 100_000  # tokens: nothing ends on its own during a test
# Tokens the engine must still make after smg dropped its connection, to count as going on.
GOING_ON = 10
# Seconds of prefill for a client that leaves before the first byte: its close comes
# milliseconds after the engine has the request; an engine left alone then generates.
PREFILL = 1.0


class RouterFactory(Protocol):
    def __call__(self, worker_url: str, *extra: str) -> Awaitable[Smg]: ...


@pytest.fixture
async def smg(tmp_path: Path) -> AsyncIterator[RouterFactory]:
    """smg in front of a worker URL (tether's or the engine's); stopped at teardown. Started
    in a thread: it registers its worker only once tether, in this event loop, answered."""
    started: list[Smg] = []

    async def start(worker_url: str, *extra: str) -> Smg:
        log = tmp_path / f"smg-{len(started)}.log"
        started.append(await asyncio.to_thread(start_smg, worker_url, log, *extra))
        return started[-1]

    yield start
    for router in started:
        await asyncio.to_thread(router.stop)


async def _engine(fake_engine: FakeEngineFactory) -> tuple[FakeEngine, str]:
    """An engine that keeps generating when its client leaves (it hears no disconnect)."""
    return await fake_engine(token_interval=TOKEN_INTERVAL, hears_disconnects=False)


async def _arrived(engine: FakeEngine, count: int) -> Generation:
    """The engine's `count`-th request (1-based), once it arrived."""
    await engine.wait_for(lambda: len(engine.generations) >= count, ENGINE_TIMEOUT)
    return list(engine.generations.values())[count - 1]


async def _leave(router: Smg, engine: FakeEngine, phase: str, client_request_id: str) -> float:
    """A raw client that asks smg for a long generation, leaves in `phase`, and returns the
    monotonic time of its close once the engine has the request."""
    before = len(engine.generations)
    body = {
        "streaming": chat_body(max_tokens=LONG),
        "non-streaming": chat_body(stream=False, max_tokens=LONG),
        # The client leaves during the prefill, before the first byte of the answer.
        "before-first-byte": chat_body(max_tokens=LONG, prefill=PREFILL),
    }[phase]
    client = await RawClient.connect(router.port)
    await client.send_request(body, headers={"X-Request-Id": client_request_id})
    generation = await _arrived(engine, before + 1)
    if phase == "streaming":
        await client.read_until(b"tok2")
    elif phase == "non-streaming":
        await engine.wait_for(lambda: generation.produced >= 3, ENGINE_TIMEOUT)
    client.close_fin()
    return time.monotonic()


@pytest.mark.parametrize("phase", ["streaming", "non-streaming", "before-first-byte"])
async def test_a_client_leaving_at_the_router_stops_the_engine_through_tether(
    fake_engine: FakeEngineFactory, tether: TetherFactory, smg: RouterFactory, phase: str
) -> None:
    """A client that leaves smg mid-stream, during a non-streaming request or before the first
    byte: through tether the engine is aborted by tether's internal ID within moments of the
    close; through smg straight to the engine it only loses its connection and keeps
    generating."""
    engine, engine_url = await _engine(fake_engine)
    server = await tether(engine_url)
    via_tether = await smg(url(server, ""))

    closed_at = await _leave(via_tether, engine, phase, "leaves-1")
    generation = await _arrived(engine, 1)
    await engine.wait_for(lambda: generation.state is not GenerationState.RUNNING, STOPPED_WITHIN)
    assert generation.state is GenerationState.ABORTED and generation.stopped_by == "abort"
    assert INTERNAL_ID.match(generation.request_id), generation.request_id
    assert [abort.ids for abort in engine.aborts] == [(f"chatcmpl-{generation.request_id}",)]
    assert generation.ended_at is not None and generation.ended_at - closed_at < STOPPED_WITHIN
    if phase == "before-first-byte":
        assert generation.produced == 0  # stopped during its prefill
    await settled(server)
    await drained(server)
    registry = server.context.metrics.registry
    assert metric(registry, "tether_aborts_total", engine="vllm", result="confirmed") == 1

    straight = await smg(engine_url)
    await _leave(straight, engine, phase, "leaves-2")
    alone = await _arrived(engine, 2)
    assert alone.request_id == "leaves-2"  # smg passes the client's ID unchanged
    await engine.wait_for(lambda: any(rid == "leaves-2" for rid, _ in engine.disconnects))
    dropped_at = next(at for rid, at in engine.disconnects if rid == "leaves-2")
    await engine.wait_for(lambda: alone.produced_after(dropped_at) >= GOING_ON, ENGINE_TIMEOUT)
    assert alone.state is GenerationState.RUNNING
    assert len(engine.aborts) == 1  # still only tether's: smg calls no abort API


async def _stream(router: Smg, client_request_id: str) -> tuple[str, list[str]]:
    """A whole short stream through `router`: (the X-Request-Id it answered, every chunk's
    `id`)."""
    client = await RawClient.connect(router.port)
    await client.send_request(chat_body(max_tokens=30), headers={"X-Request-Id": client_request_id})
    reply = await client.read_reply(timeout=ENGINE_TIMEOUT)
    client.close_fin()
    assert reply.status == 200, reply.body[:300]
    return reply.headers["X-Request-Id"], sse_ids(reply.body.decode())


async def test_two_clients_with_one_id_stay_distinct_at_the_engine(
    fake_engine: FakeEngineFactory, tether: TetherFactory, smg: RouterFactory
) -> None:
    """Two concurrent clients with the same X-Request-Id through smg: through tether the
    engine runs them under two internal IDs and each client gets its own ID back in the
    header and every chunk; through smg straight to the engine both reach it as one ID, the
    second in the place of the first."""
    engine, engine_url = await _engine(fake_engine)
    server = await tether(engine_url)
    via_tether = await smg(url(server, ""))

    answers = await asyncio.gather(*(_stream(via_tether, "shared-id") for _ in range(2)))
    keys = list(engine.generations)
    assert len(keys) == 2 and all(INTERNAL_ID.match(key) for key in keys), keys
    for header, ids in answers:
        assert header == "shared-id"
        assert set(ids) == {"chatcmpl-shared-id"} and len(ids) >= 30

    straight = await smg(engine_url)
    await asyncio.gather(*(_stream(straight, "shared-id") for _ in range(2)))
    straight_ids = [seen.headers["X-Request-Id"] for seen in engine.requests[2:]]
    assert straight_ids == ["shared-id", "shared-id"]
    assert list(engine.generations)[2:] == ["shared-id"]  # one key for both: they collided


async def test_router_discovers_and_health_checks_the_engine_through_tether(
    fake_engine: FakeEngineFactory,
    tether: TetherFactory,
    smg: RouterFactory,
    http: aiohttp.ClientSession,
) -> None:
    """smg registers tether's port as its worker from the engine's `/v1/models` answered
    through tether, and its `/health` checks reach the engine: an unhealthy engine takes the
    worker out of smg's rotation (its clients get 503, the engine sees nothing), a healthy one
    brings it back."""
    engine, engine_url = await _engine(fake_engine)
    server = await tether(engine_url)
    router = await smg(url(server, ""), *FAST_HEALTH_CHECKS)
    registry = server.context.metrics.registry

    async with http.get(router.url("/v1/models")) as response:
        assert response.status == 200
        assert [model["id"] for model in (await response.json())["data"]] == ["fake"]
    [worker] = await _workers(http, router)
    assert worker["url"] == url(server, "") and worker["model_id"] == "fake"
    assert metric(registry, "tether_requests_total", route="/v1/models", status_class="2xx") >= 1

    engine.healthy = False
    await _wait_health(http, router, healthy=False)
    async with http.post(router.url("/v1/chat/completions"), json=chat_body()) as response:
        assert response.status == 503, await response.text()
    assert engine.requests == []
    assert metric(registry, "tether_requests_total", route="/health", status_class="5xx") >= 1

    engine.healthy = True
    await _wait_health(http, router, healthy=True)
    async with http.post(router.url("/v1/chat/completions"), json=chat_body()) as response:
        assert response.status == 200
        assert (await response.text()).endswith("data: [DONE]\n\n")
    assert len(engine.requests) == 1


async def _workers(http: aiohttp.ClientSession, router: Smg) -> list[dict[str, object]]:
    async with http.get(router.url("/workers")) as response:
        assert response.status == 200
        return list((await response.json())["workers"])


async def _wait_health(http: aiohttp.ClientSession, router: Smg, healthy: bool) -> None:
    """Until smg's only worker is (un)healthy: smg offers no event, so its `/workers` is
    polled; its checks run every second here."""

    async def reached() -> bool:
        [worker] = await _workers(http, router)
        return worker["is_healthy"] is healthy

    await poll_until(reached, ENGINE_TIMEOUT, interval=0.1, what=f"smg's worker healthy={healthy}")


async def test_preserve_mode_keeps_the_id_smg_sends(
    fake_engine: FakeEngineFactory, tether: TetherFactory, smg: RouterFactory
) -> None:
    """With TETHER_REQUEST_ID_MODE=preserve the engine runs the request under the ID smg
    passed on (the client's), a second client with that ID in flight is refused with 409
    before the engine, and the leaving client is aborted by that same ID."""
    engine, engine_url = await _engine(fake_engine)
    server = await tether(engine_url, request_id_mode="preserve")
    router = await smg(url(server, ""))

    client = await RawClient.connect(router.port)
    await client.send_request(chat_body(max_tokens=LONG), headers={"X-Request-Id": "router-7"})
    await client.read_until(b"tok2")
    generation = engine.generation("router-7")
    assert engine.requests[0].headers["X-Request-Id"] == "router-7"

    second = await RawClient.connect(router.port)
    await second.send_request(chat_body(), headers={"X-Request-Id": "router-7"})
    refused = await second.read_reply(timeout=ENGINE_TIMEOUT)
    second.close_fin()
    assert refused.status == 409, refused.body[:300]
    assert json.loads(refused.body)["error"]["code"] == "duplicate_request_id"
    assert len(engine.requests) == 1

    client.close_fin()
    closed_at = time.monotonic()
    await engine.wait_for(lambda: generation.state is not GenerationState.RUNNING, STOPPED_WITHIN)
    assert generation.stopped_by == "abort"
    assert [abort.ids for abort in engine.aborts] == [("chatcmpl-router-7",)]
    assert generation.ended_at is not None and generation.ended_at - closed_at < STOPPED_WITHIN


async def test_without_a_client_id_tether_names_the_request(
    fake_engine: FakeEngineFactory, tether: TetherFactory, smg: RouterFactory
) -> None:
    """A client that sends no ID: smg answers it with an ID of its own making but sends none
    to the worker, so in both modes the engine runs the request under one tether made."""
    engine, engine_url = await _engine(fake_engine)
    servers: list[TetherServer] = [
        await tether(engine_url),
        await tether(engine_url, request_id_mode="preserve"),
    ]
    for count, server in enumerate(servers, start=1):
        router = await smg(url(server, ""))
        client = await RawClient.connect(router.port)
        await client.send_request(chat_body(max_tokens=3))
        reply = await client.read_reply(timeout=ENGINE_TIMEOUT)
        client.close_fin()
        assert reply.status == 200
        assert reply.headers["X-Request-Id"].startswith("chatcmpl-")  # smg's
        seen = engine.requests[count - 1].headers["X-Request-Id"]
        assert INTERNAL_ID.match(seen), seen
