"""Abort truth: tether aborts the ID the engine really uses on each route, counts an abort as
`confirmed` only when the engine's response ended, and counts the tokens the engine produced
after the client left. The fake engine keys each route as vLLM 0.32 and SGLang 0.5.23 do."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from proxy.server.runner import TetherServer
from tether_fake_engine import AbortRoute, FakeEngine, GenerationState

from .support.canaries import CANARY_PROMPT
from .support.chat import chat_body
from .support.in_process import TetherFactory, drained, settled, url
from .support.metrics import metric
from .support.raw_http import RawClient
from .support.upstreams import FakeEngineFactory, UpstreamAppFactory

# Generation runs at one token per 10 ms: an abort that failed would leave a 100,000-token
# stream running for 1,000 s; the bounds below are seconds, far below that and far above what
# a loaded 2-core machine needs to see the abort.
TOKEN_INTERVAL = 0.01


def aborts(server: TetherServer, result: str, engine: str = "vllm") -> float:
    return metric(
        server.context.metrics.registry, "tether_aborts_total", engine=engine, result=result
    )


def tokens_after(server: TetherServer, route: str) -> float:
    registry = server.context.metrics.registry
    return metric(registry, "tether_tokens_after_disconnect_total", route=route)


async def start_stream(
    server: TetherServer,
    body: dict[str, Any],
    *,
    path: str = "/v1/chat/completions",
    marker: bytes = b"tok2",
    headers: dict[str, str] | None = None,
) -> RawClient:
    """A streaming request through tether, read up to `marker`."""
    client = await RawClient.connect(server.port)
    await client.send_request(body, path=path, headers=headers)
    await client.read_until(marker)
    return client


async def leave(server: TetherServer, client: RawClient) -> float:
    """Close the client (FIN); return when it closed, once tether has let go of the request."""
    closed_at = time.monotonic()
    client.close_fin()
    await settled(server)
    return closed_at


def only_generation(engine: FakeEngine) -> Any:
    [generation] = engine.generations.values()
    return generation


async def test_chat_stream_abort_is_confirmed_by_the_end_of_the_engines_stream(
    fake_engine: FakeEngineFactory, tether: TetherFactory
) -> None:
    """A client leaves mid-stream: tether names `chatcmpl-<internal>`, keeps reading until the
    engine's stream ends (finish_reason abort, [DONE]), and counts `confirmed`, the time the
    engine took to stop and the tokens it produced after the client left."""
    engine, engine_url = await fake_engine(token_interval=TOKEN_INTERVAL)
    server = await tether(engine_url)
    client = await start_stream(server, chat_body(max_tokens=100_000))
    generation = only_generation(engine)

    closed_at = await leave(server, client)
    await drained(server)

    assert engine.aborts[0].ids == (f"chatcmpl-{generation.request_id}",)
    assert generation.state is GenerationState.ABORTED
    assert aborts(server, "confirmed") == 1
    registry = server.context.metrics.registry
    assert metric(registry, "tether_engine_stop_seconds_count") == 1
    # What tether counted after the client left is what the engine generated after the close,
    # give or take the one token that was on its way at that moment.
    assert (
        abs(tokens_after(server, "/v1/chat/completions") - generation.produced_after(closed_at))
        <= 1
    )


async def test_abort_log_line_names_what_was_sent_and_what_it_achieved(
    fake_engine: FakeEngineFactory, tether: TetherFactory, capsys: pytest.CaptureFixture[str]
) -> None:
    """The `abort_sent` line carries the engine IDs exactly as sent, the result, the engine's
    stop time and the tokens generated after the disconnect."""
    engine, engine_url = await fake_engine(token_interval=TOKEN_INTERVAL)
    server = await tether(engine_url)
    client = await start_stream(server, chat_body(max_tokens=100_000))
    await leave(server, client)
    await drained(server)

    lines = [
        json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")
    ]
    [sent] = [line for line in lines if line.get("event") == "abort_sent"]
    generation = only_generation(engine)
    assert sent["engine_request_ids"] == [f"chatcmpl-{generation.request_id}"]
    assert sent["result"] == "confirmed"
    assert sent["engine_stop_ms"] >= 0 and sent["tokens_after_disconnect"] >= 0


async def test_completions_abort_names_each_prompts_engine_request(
    fake_engine: FakeEngineFactory, tether: TetherFactory
) -> None:
    """vLLM runs every completion prompt as `cmpl-<id>-<index>`, even a single one: tether
    names each (aborting `cmpl-<id>` would match nothing)."""
    engine, engine_url = await fake_engine(token_interval=TOKEN_INTERVAL)
    server = await tether(engine_url)
    body = {"model": "fake", "prompt": [CANARY_PROMPT, CANARY_PROMPT], "stream": True}
    client = await start_stream(server, {**body, "max_tokens": 100_000}, path="/v1/completions")
    generation = only_generation(engine)

    await leave(server, client)
    await drained(server)

    internal = generation.request_id
    assert engine.aborts[0].ids == (f"cmpl-{internal}-0", f"cmpl-{internal}-1")
    assert generation.state is GenerationState.ABORTED
    assert aborts(server, "confirmed") == 1


async def test_anthropic_messages_are_aborted_as_chat_requests(
    fake_engine: FakeEngineFactory, tether: TetherFactory
) -> None:
    """`/v1/messages` runs through vLLM's chat path: `chatcmpl-<X-Request-Id>`; the client's
    own ID comes back in `message_start`."""
    engine, engine_url = await fake_engine(token_interval=TOKEN_INTERVAL)
    server = await tether(engine_url)
    body = {"model": "fake", "messages": [{"role": "user", "content": CANARY_PROMPT}]}
    client = await RawClient.connect(server.port)
    await client.send_request(
        {**body, "stream": True, "max_tokens": 100_000},
        path="/v1/messages",
        headers={"X-Request-Id": "my-message"},
    )
    start = await client.read_until(b"tok2")
    generation = only_generation(engine)
    assert b'"id":"chatcmpl-my-message"' in start

    closed_at = await leave(server, client)
    await drained(server)

    assert engine.aborts[0].ids == (f"chatcmpl-{generation.request_id}",)
    assert aborts(server, "confirmed") == 1
    # The engine's own count (message_delta's output_tokens) less what the client received.
    assert abs(tokens_after(server, "/v1/messages") - generation.produced_after(closed_at)) <= 1


async def test_responses_api_ids_are_unique_handles_aborted_by_their_first_turn(
    fake_engine: FakeEngineFactory, tether: TetherFactory
) -> None:
    """The Responses API ignores X-Request-Id and names the request from the body: tether
    writes `resp_<internal>` there (a client's own `request_id` cannot collide), the client
    gets that ID unchanged as its handle, and an abort names the engine's `resp_<internal>_0`."""
    engine, engine_url = await fake_engine(token_interval=TOKEN_INTERVAL)
    server = await tether(engine_url)
    body = {"model": "fake", "input": CANARY_PROMPT, "stream": True, "max_output_tokens": 100_000}
    clients = [
        await start_stream(
            server,
            {**body, "request_id": "resp_mine"},
            path="/v1/responses",
            headers={"X-Request-Id": "same"},
        )
        for _ in range(2)
    ]
    handles = sorted(generation.request_id for generation in engine.generations.values())
    assert len(set(handles)) == 2
    assert all(handle.startswith("resp_") and len(handle) == 37 for handle in handles)

    for client in clients:
        client.close_fin()
    await settled(server)
    await drained(server)

    sent = sorted(abort.ids for abort in engine.aborts)
    assert sent == [(f"{handle}_0",) for handle in handles]
    assert aborts(server, "confirmed") == 2


async def test_responses_api_handle_reaches_the_client_unmapped(
    fake_engine: FakeEngineFactory, tether: TetherFactory, http: aiohttp.ClientSession
) -> None:
    """The `id` a client gets is the engine's handle (for GET /v1/responses/{id} and
    previous_response_id), not rewritten to the client's X-Request-Id."""
    engine, engine_url = await fake_engine(max_tokens=2)
    server = await tether(engine_url)
    body = {"model": "fake", "input": CANARY_PROMPT, "stream": False}
    async with http.post(
        url(server, "/v1/responses"), json=body, headers={"X-Request-Id": "client-7"}
    ) as response:
        assert response.headers["X-Request-Id"] == "client-7"
        answer = await response.json()
    [generation] = engine.generations.values()
    assert answer["id"] == generation.request_id


async def test_background_responses_are_never_aborted_when_their_connection_closes(
    upstream_app: UpstreamAppFactory, tether: TetherFactory
) -> None:
    """`background: true` asks the engine to outlive the connection: a client that leaves
    before the answer arrives triggers no abort call, and tether reads the answer to its end
    instead of dropping the connection."""
    received = asyncio.Event()
    release = asyncio.Event()
    answered = asyncio.Event()

    async def create(request: web.Request) -> web.Response:
        await request.read()
        received.set()
        await release.wait()
        answered.set()
        return web.json_response({"id": "resp_x", "status": "queued"})

    app = web.Application()
    app.router.add_post("/v1/responses", create)
    server = await tether(await upstream_app(app))
    client = await RawClient.connect(server.port)
    await client.send_request(
        {"model": "fake", "input": CANARY_PROMPT, "background": True}, path="/v1/responses"
    )
    await asyncio.wait_for(received.wait(), 5)
    client.close_fin()  # before the engine answered
    await settled(server)
    release.set()

    await asyncio.wait_for(answered.wait(), 5)
    await drained(server)
    assert aborts(server, "confirmed") + aborts(server, "unknown_route") == 0
    assert server.context.aborts.pending == 0


async def test_engine_that_ignores_the_abort_is_unconfirmed_then_dropped(
    fake_engine: FakeEngineFactory, tether: TetherFactory
) -> None:
    """An abort call the engine accepts but acts on nothing (a wrong ID would do that): the
    response goes on, so when the confirm window closes (200 ms before any abort was
    confirmed) it is counted `unconfirmed` and the connection is dropped; the call is
    repeated once more before the confirm timeout."""
    engine, engine_url = await fake_engine(token_interval=TOKEN_INTERVAL)
    engine.ignore_aborts = 10_000
    server = await tether(engine_url, abort_confirm_timeout=0.6, abort_repeat_delay=0.2)
    client = await start_stream(server, chat_body(max_tokens=100_000))
    await leave(server, client)
    started = asyncio.get_running_loop().time()

    await drained(server)

    assert len(engine.aborts) == 2  # the call and its repeat
    await engine.wait_for(lambda: len(engine.disconnects) == 1)
    # Dropped at the confirm window, not at the end of a 1,000 s stream.
    assert asyncio.get_running_loop().time() - started < 5
    assert aborts(server, "unconfirmed") == 1 and aborts(server, "confirmed") == 0
    registry = server.context.metrics.registry
    assert metric(registry, "tether_engine_stop_seconds_count") == 0


async def test_engine_without_an_abort_route_is_dropped_at_once(
    fake_engine: FakeEngineFactory, tether: TetherFactory
) -> None:
    """A default `vllm serve` (404 and 403 from both routes): `not_supported`, and the
    connection is dropped as soon as that is known; later disconnects skip the probe."""
    engine, engine_url = await fake_engine(
        token_interval=TOKEN_INTERVAL, abort_route=AbortRoute.NONE
    )
    server = await tether(engine_url)
    for dropped in (1, 2):
        client = await start_stream(server, chat_body(max_tokens=100_000))
        await leave(server, client)
        await drained(server)
        await engine.wait_for(lambda count=dropped: len(engine.disconnects) == count)
    assert [abort.status for abort in engine.aborts] == [404, 403]  # probed once, remembered
    assert aborts(server, "not_supported") == 2
    assert tokens_after(server, "/v1/chat/completions") == 0


async def test_route_whose_engine_id_tether_cannot_name_is_counted_unknown_route(
    upstream_app: UpstreamAppFactory, tether: TetherFactory
) -> None:
    """A generation route outside the table: no guessed abort call, the connection dropped,
    the abort counted `unknown_route` (never `confirmed`)."""
    lost = asyncio.Event()

    async def stream(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        try:
            while True:
                await response.write(b'data: {"tok": 1}\n\n')
                await asyncio.sleep(TOKEN_INTERVAL)
        except (asyncio.CancelledError, ConnectionError):
            lost.set()
            raise

    app = web.Application()
    app.router.add_post("/v1/brand-new-api", stream)
    aborted: list[bytes] = []

    async def abort_route(request: web.Request) -> web.Response:
        aborted.append(await request.read())
        return web.json_response({})

    app.router.add_post("/abort_requests", abort_route)
    server = await tether(await upstream_app(app), engine="vllm")
    client = await start_stream(
        server, {"x": CANARY_PROMPT}, path="/v1/brand-new-api", marker=b"tok"
    )
    await leave(server, client)

    await asyncio.wait_for(lost.wait(), 5)
    assert aborted == []
    assert aborts(server, "unknown_route") == 1
    assert aborts(server, "confirmed") == 0


async def test_failing_abort_call_still_drops_the_connection_within_the_confirm_timeout(
    fake_engine: FakeEngineFactory, tether: TetherFactory
) -> None:
    """An abort endpoint answering 503 while tether retries: the engine is not kept waiting on
    an open connection past the confirm timeout, and the result is `failed`."""
    engine, engine_url = await fake_engine(token_interval=TOKEN_INTERVAL)
    engine.abort_failures = 10_000
    server = await tether(
        engine_url, abort_confirm_timeout=0.3, abort_timeout=0.2, abort_deadline=1.0
    )
    client = await start_stream(server, chat_body(max_tokens=100_000))
    closed_at = await leave(server, client)

    await engine.wait_for(lambda: len(engine.disconnects) == 1)
    # Dropped at 0.3 s (well before the retries give up at 1 s); 2 s leaves a loaded machine
    # room and still fails if tether waited for the deadline plus the whole stream.
    assert engine.disconnects[0][1] - closed_at < 2.0
    await drained(server)
    assert aborts(server, "failed") == 1


async def test_non_streaming_request_left_behind_counts_its_whole_answer(
    fake_engine: FakeEngineFactory, tether: TetherFactory
) -> None:
    """A non-streaming client that leaves while the engine generates: the engine's answer
    comes back with finish_reason abort and its usage; all of it is waste, and counted."""
    engine, engine_url = await fake_engine(token_interval=TOKEN_INTERVAL)
    server = await tether(engine_url)
    client = await RawClient.connect(server.port)
    await client.send_request(chat_body(stream=False, max_tokens=100_000))
    await engine.wait_for(lambda: any(g.produced >= 5 for g in engine.generations.values()))
    await leave(server, client)
    await drained(server)

    generation = only_generation(engine)
    assert generation.state is GenerationState.ABORTED
    assert aborts(server, "confirmed") == 1
    assert tokens_after(server, "/v1/chat/completions") == generation.produced


async def test_sglang_abort_is_confirmed_by_its_rid(
    fake_engine: FakeEngineFactory, tether: TetherFactory
) -> None:
    """SGLang: tether's rid in the body, `/abort_request {"rid"}`, confirmed by the stream's
    end, on chat and on /generate."""
    engine, engine_url = await fake_engine(
        token_interval=TOKEN_INTERVAL, abort_route=AbortRoute.SGLANG
    )
    server = await tether(engine_url, engine="sglang")
    for path, body in (
        ("/v1/chat/completions", chat_body(max_tokens=100_000)),
        ("/generate", {"text": CANARY_PROMPT, "stream": True, "sampling_params": {}}),
    ):
        client = await start_stream(server, {**body, "max_tokens": 100_000}, path=path)
        await leave(server, client)
        await drained(server)
        [rid] = engine.aborts[-1].ids
        assert len(rid) == 32
        assert engine.generation(rid).state is GenerationState.ABORTED
    assert aborts(server, "confirmed", engine="sglang") == 2


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/generate", {"text": [CANARY_PROMPT, CANARY_PROMPT], "stream": True}),
        ("/generate", {"input_ids": [[1, 2], [3, 4]], "stream": True}),
        ("/v1/completions", {"prompt": [CANARY_PROMPT, CANARY_PROMPT], "stream": True}),
    ],
)
async def test_sglang_batch_is_aborted_item_by_item(
    fake_engine: FakeEngineFactory, tether: TetherFactory, path: str, body: dict[str, Any]
) -> None:
    """SGLang runs a list of prompts as `<rid>_0`, `<rid>_1`, ... and ignores an abort of a
    rid it does not hold exactly (the batch's `<rid>`): tether names every item, one call
    each, and the abort is confirmed."""
    engine, engine_url = await fake_engine(
        token_interval=TOKEN_INTERVAL, abort_route=AbortRoute.SGLANG
    )
    server = await tether(engine_url, engine="sglang")
    client = await start_stream(server, {**body, "max_tokens": 100_000}, path=path)
    generation = only_generation(engine)

    await leave(server, client)
    await drained(server)

    rid = generation.request_id
    assert sorted(abort.ids for abort in engine.aborts) == [(f"{rid}_0",), (f"{rid}_1",)]
    assert generation.state is GenerationState.ABORTED
    assert aborts(server, "confirmed", engine="sglang") == 1


async def test_sglang_abort_of_a_batch_by_its_rid_alone_would_stop_nothing(
    fake_engine: FakeEngineFactory, http: aiohttp.ClientSession
) -> None:
    """The fake engine keeps SGLang's rule that makes naming each item necessary: `<rid>`
    for a batch running as `<rid>_<index>` matches nothing."""
    engine, engine_url = await fake_engine(
        token_interval=TOKEN_INTERVAL, abort_route=AbortRoute.SGLANG
    )
    body = {"text": ["a", "b"], "rid": "batch", "stream": True, "max_tokens": 100_000}
    async with http.post(f"{engine_url}/generate", json=body) as response:
        await response.content.readline()
        async with http.post(f"{engine_url}/abort_request", json={"rid": "batch"}) as aborted:
            assert aborted.status == 200
        assert engine.generation("batch").state is GenerationState.RUNNING
        for item in ("batch_0", "batch_1"):
            async with http.post(f"{engine_url}/abort_request", json={"rid": item}):
                pass
        assert engine.generation("batch").state is GenerationState.ABORTED


async def test_tokens_relayed_come_from_usage_when_the_client_asked_for_it(
    fake_engine: FakeEngineFactory, tether: TetherFactory, http: aiohttp.ClientSession
) -> None:
    """A completed stream counts its tokens: the engine's usage where the client asked for
    it, the token-carrying events otherwise; a non-streaming answer from its usage."""
    _, engine_url = await fake_engine(max_tokens=7)
    server = await tether(engine_url)
    with_usage = {**chat_body(max_tokens=7), "stream_options": {"include_usage": True}}
    for body in (chat_body(max_tokens=7), with_usage, chat_body(stream=False, max_tokens=7)):
        async with http.post(url(server), json=body) as response:
            await response.read()
    await settled(server)
    registry = server.context.metrics.registry
    assert metric(registry, "tether_tokens_relayed_total", route="/v1/chat/completions") == 21


async def test_clients_leaving_together_are_aborted_in_few_calls(
    fake_engine: FakeEngineFactory, tether: TetherFactory
) -> None:
    """Hundreds of clients leaving at once (a gateway restarting): their aborts queue behind
    a few calls in flight, and vLLM's list-taking route gets their IDs merged; every one is
    still confirmed by its stream's end."""
    engine, engine_url = await fake_engine(token_interval=0.01)
    server = await tether(engine_url)
    streams = 200
    clients = []
    for _ in range(streams):
        client = await RawClient.connect(server.port)
        await client.send_request(chat_body(max_tokens=100_000))
        clients.append(client)
    for client in clients:
        await client.read_until(b"tok0")
    for client in clients:
        client.close_fin()
    await settled(server)
    await drained(server)

    named = [engine_id for abort in engine.aborts for engine_id in abort.ids]
    assert sorted(named) == sorted(g.engine_id for g in engine.generations.values())
    assert len(engine.aborts) < streams / 4  # merged, not one call per stream
    assert aborts(server, "confirmed") == streams
