"""The engine's slots counted by tether (TETHER_ENGINE_SLOTS): in front of llama.cpp's server,
whose queue does not notice a client leaving while other requests stream, generation
requests beyond its slots wait in tether, where a client that leaves is dropped before the
engine ever sees its request. The fake engine plays llama-server with its queue's blindness:
with the count off, the same abandoned request reaches it and is generated for nobody."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from proxy.engines import Engine
from proxy.observe.metrics import Gauge
from proxy.request.engine_slots import EngineSlots, SlotGrant
from proxy.server.runner import TetherServer
from tether_fake_engine import AbortRoute, FakeEngine, GenerationState

from .support.chat import chat_body
from .support.in_process import TetherFactory, settled
from .support.metrics import metric
from .support.raw_http import RawClient
from .support.upstreams import FakeEngineFactory
from .support.waiting import poll_until, within

WAIT = 5.0


def _slots(size: int | None) -> tuple[EngineSlots, Gauge]:
    queue = Gauge("queue", "")
    slots = EngineSlots(queue, Gauge("slots", ""))
    slots.resize(size)
    return slots, queue


def _waiter(slots: EngineSlots, wanted: int = 1) -> tuple[SlotGrant, asyncio.Task[None]]:
    grant = SlotGrant(wanted)
    return grant, asyncio.get_running_loop().create_task(slots.take(grant))


async def _settle() -> None:
    """Let every task woken so far run its next step."""
    for _ in range(3):
        await asyncio.sleep(0)


# --- the count itself ---------------------------------------------------------------------


async def test_slots_go_in_arrival_order() -> None:
    slots, queue = _slots(1)
    first = SlotGrant(1)
    await slots.take(first)
    second, second_task = _waiter(slots)
    third, third_task = _waiter(slots)
    await _settle()
    assert (second.held, third.held, queue.value) == (0, 0, 2)
    slots.give_back(first)
    await within(second_task, WAIT, "the second request's slot")
    await _settle()
    assert (second.held, third.held, queue.value) == (1, 0, 1)
    assert not third_task.done()
    slots.give_back(second)
    await within(third_task, WAIT, "the third request's slot")


async def test_a_request_takes_a_slot_per_engine_request_at_most_all() -> None:
    """Prompts times n: a request wanting more than there are takes them all; one that does
    not fit holds back those after it (no overtaking)."""
    slots, _ = _slots(2)
    big = SlotGrant(5)
    await slots.take(big)
    assert big.held == 2
    two, two_task = _waiter(slots, 2)
    one, one_task = _waiter(slots, 1)
    await _settle()
    slots.give_back(big)
    await within(two_task, WAIT, "the two-slot request")
    await _settle()
    assert (two.held, one.held) == (2, 0)
    slots.give_back(two)
    await within(one_task, WAIT, "the one-slot request")


async def test_a_cancelled_waiter_leaves_the_queue_and_holds_nothing() -> None:
    slots, queue = _slots(1)
    first = SlotGrant(1)
    await slots.take(first)
    gone, gone_task = _waiter(slots)
    after, after_task = _waiter(slots)
    await _settle()
    gone_task.cancel()
    await _settle()
    assert gone_task.cancelled() and queue.value == 1
    slots.give_back(first)
    await within(after_task, WAIT, "the slot of the request behind the cancelled one")
    assert (gone.held, after.held) == (0, 1)
    slots.give_back(gone)  # (its handler gives back whatever it holds: nothing)
    assert slots.busy == 1


async def test_a_waiter_cancelled_just_after_its_grant_gives_its_slot_back() -> None:
    slots, _ = _slots(1)
    first = SlotGrant(1)
    await slots.take(first)
    granted, task = _waiter(slots)
    await _settle()
    slots.give_back(first)  # granted now, its task not yet run
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert granted.held == 1
    slots.give_back(granted)
    assert slots.busy == 0


async def test_a_resize_lets_waiters_go() -> None:
    """More slots (the engine restarted with a larger -np) let the next waiters go; no count
    (another engine) lets every waiter go."""
    slots, queue = _slots(1)
    await slots.take(SlotGrant(1))
    waiters = [_waiter(slots) for _ in range(3)]
    await _settle()
    slots.resize(2)
    await within(waiters[0][1], WAIT, "the first waiter, with a second slot")
    assert not waiters[1][1].done()
    slots.resize(None)
    await within(asyncio.gather(*(task for _, task in waiters)), WAIT, "every waiter")
    assert queue.value == 0


# --- in front of llama.cpp's server ---------------------------------------------------------


async def _llamacpp(
    fake_engine: FakeEngineFactory, tether: TetherFactory, **settings: Any
) -> tuple[FakeEngine, TetherServer]:
    engine, engine_url = await fake_engine(
        abort_route=AbortRoute.LLAMACPP, hears_disconnects=True, slots=1, token_interval=0.02
    )
    server = await tether(engine_url, engine=Engine.LLAMACPP, **settings)
    return engine, server


def _queued(server: TetherServer) -> float:
    return metric(server.context.metrics.registry, "tether_engine_queue")


async def _stream_holding_the_slot(server: TetherServer, engine: FakeEngine) -> RawClient:
    holder = await RawClient.connect(server.port)
    await holder.send_request(chat_body(max_tokens=100_000))
    await holder.read_until(b"tok0")
    assert len(engine.requests) == 1
    return holder


def _asked(engine: FakeEngine, marker: int) -> bool:
    """Whether the engine received the request whose `max_tokens` is `marker`."""
    return any(json.loads(seen.body).get("max_tokens") == marker for seen in engine.requests)


@pytest.mark.parametrize("stream", [True, False])
async def test_a_request_whose_client_left_in_the_queue_never_reaches_llama_server(
    fake_engine: FakeEngineFactory, tether: TetherFactory, stream: bool
) -> None:
    """Behind a stream holding llama-server's one slot, a request waits in tether; its client
    leaves. The slot frees, and the next request runs: the engine never saw the abandoned one,
    and tether counts it as a client that left while queued."""
    engine, server = await _llamacpp(fake_engine, tether)
    assert metric(server.context.metrics.registry, "tether_engine_slots") == 1
    holder = await _stream_holding_the_slot(server, engine)
    queued = await RawClient.connect(server.port)
    await queued.send_request(chat_body(stream=stream, max_tokens=777))
    await poll_until(lambda: _queued(server) == 1, WAIT, what="the request queued in tether")
    queued.close_fin()
    await poll_until(lambda: _queued(server) == 0, WAIT, what="the request out of the queue")
    holder.close_fin()
    after = await RawClient.connect(server.port)
    await after.send_request(chat_body(stream=False, max_tokens=3))
    assert (await after.read_reply()).status == 200
    await settled(server)
    assert [json.loads(seen.body)["max_tokens"] for seen in engine.requests] == [100_000, 3]
    registry = server.context.metrics.registry
    assert metric(registry, "tether_client_disconnects_total", phase="queued") == 1


async def test_without_the_count_llama_server_generates_it_for_nobody(
    fake_engine: FakeEngineFactory, tether: TetherFactory
) -> None:
    """TETHER_ENGINE_SLOTS=off, the engine alone's behaviour: the same abandoned request goes
    to llama-server's queue, which does not notice its client leaving, and takes the slot
    once it frees (sent as a stream, it stops at its first token's write)."""
    engine, server = await _llamacpp(fake_engine, tether, engine_slots="off")
    assert metric(server.context.metrics.registry, "tether_engine_slots") == 0
    holder = await _stream_holding_the_slot(server, engine)
    queued = await RawClient.connect(server.port)
    await queued.send_request(chat_body(stream=False, max_tokens=7))
    await engine.wait_for(lambda: _asked(engine, 7), WAIT)
    queued.close_fin()
    holder.close_fin()
    await engine.wait_for(lambda: len(engine.generations) == 2, WAIT)
    [abandoned] = [g for g in engine.generations.values() if g.max_tokens == 7]
    await engine.wait_for(lambda: abandoned.state is not GenerationState.RUNNING, WAIT)
    assert abandoned.produced >= 1


async def test_a_queued_request_runs_when_the_slot_frees(
    fake_engine: FakeEngineFactory, tether: TetherFactory
) -> None:
    """A request that waited in tether is sent the moment the stream before it ends, and
    answered in full."""
    engine, server = await _llamacpp(fake_engine, tether)
    first = await RawClient.connect(server.port)
    await first.send_request(chat_body(max_tokens=30))
    await first.read_until(b"tok0")
    second = await RawClient.connect(server.port)
    await second.send_request(chat_body(stream=False, max_tokens=4))
    await poll_until(lambda: _queued(server) == 1, WAIT, what="the second request queued")
    assert not _asked(engine, 4)
    await first.read_until(b"data: [DONE]")
    reply = await second.read_reply()
    assert reply.status == 200
    assert reply.json()["usage"]["completion_tokens"] == 4


async def test_a_queued_stream_is_kept_alive(
    fake_engine: FakeEngineFactory, tether: TetherFactory
) -> None:
    """With TETHER_SSE_KEEPALIVE the wait for a slot is kept alive as the engine's silence
    is: the client's stream begins, with comments, while its request waits in tether."""
    engine, server = await _llamacpp(fake_engine, tether, sse_keepalive=0.1)
    holder = await _stream_holding_the_slot(server, engine)
    queued = await RawClient.connect(server.port)
    await queued.send_request(chat_body(max_tokens=5))
    for _ in range(2):
        await queued.read_until(b": keep-alive\n\n")
    assert _queued(server) == 1 and not _asked(engine, 5)
    holder.close_fin()
    await queued.read_until(b"data: [DONE]")


async def test_other_engines_and_other_routes_never_wait(
    fake_engine: FakeEngineFactory, tether: TetherFactory
) -> None:
    """Only generation requests to an engine whose queue is blind wait: vLLM's are sent at
    once, as are llama.cpp's reads (a tokenizer call beside a full slot)."""
    _, engine_url = await fake_engine(token_interval=0.02)
    vllm = await tether(engine_url, engine=Engine.VLLM)
    assert metric(vllm.context.metrics.registry, "tether_engine_slots") == 0
    llama, server = await _llamacpp(fake_engine, tether)
    holder = await _stream_holding_the_slot(server, llama)
    models = await RawClient.connect(server.port)
    await models.send(b"GET /v1/models HTTP/1.1\r\nHost: t\r\n\r\n")
    assert (await models.read_reply()).status == 200
    holder.close_fin()
