"""Cancel by ID on the serving port: the caller that owns a request stops it as its client
leaving would, its stream ends between two events, and nobody else learns the ID exists."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from typing import Any

import aiohttp
from aiohttp import web

from proxy.server.cancel import FAILED_CANCELS_PER_CONNECTION
from tether_fake_engine import GenerationState

from .support.canaries import CANARY_PROMPT, CANARY_SECRET
from .support.chat import chat_body
from .support.in_process import TetherFactory, drained, settled, url
from .support.metrics import metric
from .support.processes import TetherProcessFactory
from .support.raw_http import RawClient
from .support.upstreams import FakeEngineFactory, UpstreamAppFactory
from .support.waiting import poll_until

ALICE = {"Authorization": "Bearer alice-key"}
BOB = {"Authorization": "Bearer bob-key"}
TOKEN_INTERVAL = 0.01
# A disconnect's stop, as the abort tests bound it (tests/test_abort.py): the engine ends the
# stream within this of the abort.
STOP_BOUND = 1.0


async def _stream(server: Any, request_id: str, headers: dict[str, str]) -> RawClient:
    """A long stream through tether, named `request_id`, its first token read."""
    client = await RawClient.connect(server.port)
    await client.send_request(
        chat_body(max_tokens=100_000), headers={"X-Request-Id": request_id, **headers}
    )
    await client.read_until(b"tok0")
    return client


async def _cancel(
    http: aiohttp.ClientSession, server: Any, request_id: str, headers: dict[str, str]
) -> tuple[int, Any]:
    """POST /v1/requests/<id>/cancel on `server` (in-process or a process: its `port`)."""
    target = f"http://127.0.0.1:{server.port}/v1/requests/{request_id}/cancel"
    async with http.post(target, headers=headers) as response:
        return response.status, await response.json()


def _events_of(raw: bytes) -> list[str]:
    """The SSE events of a chunked response read raw to its end (framing removed); the body
    must end with the last chunk, and the stream with a whole event."""
    body = b""
    rest = raw.partition(b"\r\n\r\n")[2]
    while True:
        size_line, _, rest = rest.partition(b"\r\n")
        size = int(size_line, 16)
        if size == 0:
            break
        body, rest = body + rest[:size], rest[size + 2 :]
    assert body.endswith(b"\n\n"), f"the stream ended inside an event: {body[-80:]!r}"
    return body.decode().split("\n\n")[:-1]


async def test_a_stream_cancelled_by_its_callers_id_stops_at_the_engine_and_ends_cleanly(
    fake_engine: FakeEngineFactory, tether: TetherFactory, http: aiohttp.ClientSession
) -> None:
    """POST /v1/requests/<client id>/cancel with the request's own credential: the engine gets
    the abort naming tether's ID and stops within a disconnect's bound, the streaming client's
    response ends after a whole event as a complete chunked body, and the canceller is told
    one request was cancelled and the engine's stop confirmed."""
    engine, engine_url = await fake_engine(token_interval=TOKEN_INTERVAL)
    server = await tether(engine_url)
    client = await RawClient.connect(server.port)
    await client.send_request(
        chat_body(max_tokens=100_000), headers={"X-Request-Id": "job-1", **ALICE}
    )
    first = await client.read_until(b"tok0")
    [generation] = engine.generations.values()

    asked = time.monotonic()
    status, answer = await _cancel(http, server, "job-1", ALICE)
    raw = first + await client.read_to_end()

    assert status == 200
    assert answer == {
        "id": "job-1",
        "object": "request.cancellation",
        "cancelled": 1,
        "engine": "confirmed",
        "replica": server.context.fleet.replica,
    }
    assert generation.state is GenerationState.ABORTED and generation.stopped_by == "abort"
    # The engine ran tether's ID (not the client's), and the abort named it.
    assert generation.request_id != "job-1" and generation.request_id in engine.aborted_ids()
    assert generation.ended_at is not None and generation.ended_at - asked < STOP_BOUND
    events = _events_of(raw)
    assert all(event.startswith("data: ") for event in events)
    json.loads(events[-1][len("data: ") :])  # the last event is whole JSON
    await settled(server)
    registry = server.context.metrics.registry
    assert metric(registry, "tether_cancellations_total", result="confirmed") == 1
    assert metric(registry, "tether_request_outcomes_total", outcome="cancelled") == 1


async def test_a_cancel_with_another_or_no_credential_gets_404_and_the_request_runs_on(
    fake_engine: FakeEngineFactory, tether: TetherFactory, http: aiohttp.ClientSession
) -> None:
    """Another caller's credential, no credential, and an unknown ID get the same 404
    `request_not_found`; the engine is never asked to abort and the stream goes on."""
    engine, engine_url = await fake_engine(token_interval=TOKEN_INTERVAL)
    server = await tether(engine_url)
    client = await _stream(server, "job-2", ALICE)

    answers = [
        await _cancel(http, server, "job-2", BOB),
        await _cancel(http, server, "job-2", {}),
        await _cancel(http, server, "no-such-job", ALICE),
    ]
    await client.read_until(b"tok20")

    assert {status for status, _ in answers} == {404}
    assert len({json.dumps(body) for _, body in answers}) == 1
    assert answers[0][1]["error"]["code"] == "request_not_found"
    assert engine.aborts == []
    [generation] = engine.generations.values()
    assert generation.state is GenerationState.RUNNING
    client.close_fin()


async def test_a_finished_request_gets_404(
    fake_engine: FakeEngineFactory, tether: TetherFactory, http: aiohttp.ClientSession
) -> None:
    """Once a request has completed its ID names nothing: the same 404."""
    _engine, engine_url = await fake_engine()
    server = await tether(engine_url)
    async with http.post(
        url(server), json=chat_body(), headers={"X-Request-Id": "done-1", **ALICE}
    ) as response:
        await response.read()

    status, answer = await _cancel(http, server, "done-1", ALICE)

    assert status == 404 and answer["error"]["code"] == "request_not_found"


async def test_requests_without_a_credential_are_cancelled_only_where_the_operator_allows(
    fake_engine: FakeEngineFactory, tether: TetherFactory, http: aiohttp.ClientSession
) -> None:
    """A request that carried no credential: 404 for a caller with none by default; with
    TETHER_CANCEL_WITHOUT_CREDENTIAL a caller with none cancels it (one with a key still
    cannot)."""
    engine, engine_url = await fake_engine(token_interval=TOKEN_INTERVAL)
    strict = await tether(engine_url)
    lenient = await tether(engine_url, cancel_without_credential=True)
    strict_client = await _stream(strict, "anon-1", {})
    lenient_client = await _stream(lenient, "anon-2", {})

    refused, _ = await _cancel(http, strict, "anon-1", {})
    keyed, _ = await _cancel(http, lenient, "anon-2", ALICE)
    allowed, answer = await _cancel(http, lenient, "anon-2", {})

    assert (refused, keyed, allowed) == (404, 404, 200)
    assert answer["cancelled"] == 1
    states = sorted(generation.state.value for generation in engine.generations.values())
    assert states == ["aborted", "running"]
    strict_client.close_fin()
    lenient_client.close_fin()


async def test_the_callers_own_requests_are_listed_and_no_one_elses(
    fake_engine: FakeEngineFactory, tether: TetherFactory, http: aiohttp.ClientSession
) -> None:
    """GET /v1/requests lists the caller's requests in flight with the IDs it knows (client
    ID, response ID), route, model, phase and age; never another caller's, never tether's
    internal IDs."""
    engine, engine_url = await fake_engine(token_interval=TOKEN_INTERVAL)
    server = await tether(engine_url)
    mine = await _stream(server, "mine", ALICE)
    theirs = await _stream(server, "theirs", BOB)

    async with http.get(url(server, "/v1/requests"), headers=ALICE) as response:
        listed = await response.json()

    [entry] = listed["data"]
    assert entry["id"] == "mine"
    assert entry["response_id"] == "chatcmpl-mine"
    assert (entry["route"], entry["model"], entry["phase"]) == (
        "/v1/chat/completions",
        "fake",
        "streaming",
    )
    assert entry["age_seconds"] >= 0
    text = json.dumps(listed)
    for generation in engine.generations.values():
        assert generation.request_id not in text
    assert "theirs" not in text
    mine.close_fin()
    theirs.close_fin()


async def test_duplicate_ids_under_one_credential_are_all_cancelled_under_two_only_the_callers(
    fake_engine: FakeEngineFactory, tether: TetherFactory, http: aiohttp.ClientSession
) -> None:
    """Two of Alice's streams and one of Bob's share an ID: Alice's cancel stops her two (and
    says so) and leaves Bob's running."""
    engine, engine_url = await fake_engine(token_interval=TOKEN_INTERVAL)
    server = await tether(engine_url)
    alices = [await _stream(server, "shared", ALICE) for _ in range(2)]
    bobs = await _stream(server, "shared", BOB)
    bobs_generation = list(engine.generations.values())[2]

    status, answer = await _cancel(http, server, "shared", ALICE)
    for client in alices:
        await client.read_until(b"0\r\n\r\n")
    await bobs.read_until(f"tok{bobs_generation.produced + 5}".encode())

    assert (status, answer["cancelled"]) == (200, 2)
    states = [g.state for g in engine.generations.values()]
    assert states == [GenerationState.ABORTED, GenerationState.ABORTED, GenerationState.RUNNING]
    assert bobs_generation.request_id not in engine.aborted_ids()
    bobs.close_fin()


async def test_a_request_is_cancelled_by_the_response_id_its_client_saw(
    fake_engine: FakeEngineFactory, tether: TetherFactory, http: aiohttp.ClientSession
) -> None:
    """DELETE /v1/requests/chatcmpl-<client id>: the ID in the answer's `id` names it too."""
    engine, engine_url = await fake_engine(token_interval=TOKEN_INTERVAL)
    server = await tether(engine_url)
    client = await _stream(server, "seen-1", ALICE)

    async with http.delete(url(server, "/v1/requests/chatcmpl-seen-1"), headers=ALICE) as reply:
        status, answer = reply.status, await reply.json()

    assert (status, answer["id"], answer["cancelled"]) == (200, "chatcmpl-seen-1", 1)
    await client.read_until(b"0\r\n\r\n")
    [generation] = engine.generations.values()
    assert generation.state is GenerationState.ABORTED


async def test_several_ids_are_cancelled_in_one_call(
    fake_engine: FakeEngineFactory, tether: TetherFactory, http: aiohttp.ClientSession
) -> None:
    """POST /v1/requests/cancel {"request_ids": [...]}: one answer per ID, the unknown ones
    with nothing cancelled."""
    engine, engine_url = await fake_engine(token_interval=TOKEN_INTERVAL)
    server = await tether(engine_url)
    clients = [await _stream(server, name, ALICE) for name in ("a", "b")]

    async with http.post(
        url(server, "/v1/requests/cancel"),
        json={"request_ids": ["a", "b", "nope"]},
        headers=ALICE,
    ) as response:
        answer = await response.json()

    assert [(item["id"], item["cancelled"]) for item in answer["data"]] == [
        ("a", 1),
        ("b", 1),
        ("nope", 0),
    ]
    for client in clients:
        await client.read_until(b"0\r\n\r\n")
    assert all(g.state is GenerationState.ABORTED for g in engine.generations.values())


async def test_a_waiting_non_streaming_caller_gets_an_openai_style_error(
    fake_engine: FakeEngineFactory, tether: TetherFactory, http: aiohttp.ClientSession
) -> None:
    """A non-streaming request cancelled while its client waits: the client gets 499 with
    `request_cancelled` as JSON, not a reset; the engine got the abort."""
    engine, engine_url = await fake_engine(token_interval=TOKEN_INTERVAL)
    server = await tether(engine_url)
    waiting = asyncio.ensure_future(
        http.post(
            url(server),
            json=chat_body(stream=False, max_tokens=100_000),
            headers={"X-Request-Id": "whole-1", **ALICE},
        )
    )
    await engine.wait_for(lambda: engine.generations)

    status, answer = await _cancel(http, server, "whole-1", ALICE)
    async with await waiting as response:
        body = await response.json()

    assert (status, answer["cancelled"]) == (200, 1)
    assert response.status == 499
    assert body["error"]["code"] == "request_cancelled"
    [generation] = engine.generations.values()
    assert generation.stopped_by == "abort"


async def test_failed_cancels_on_one_connection_run_out(
    fake_engine: FakeEngineFactory, tether: TetherFactory
) -> None:
    """IDs cannot be probed cheaply: after a few cancels that found nothing, the connection
    gets 429 `too_many_failed_cancels` and is closed."""
    _engine, engine_url = await fake_engine()
    server = await tether(engine_url)
    client = await RawClient.connect(server.port)
    statuses = []
    for guess in range(FAILED_CANCELS_PER_CONNECTION + 1):
        await client.send_request(b"", path=f"/v1/requests/guess-{guess}/cancel", headers=ALICE)
        statuses.append((await client.read_reply()).status)

    assert statuses == [404] * FAILED_CANCELS_PER_CONNECTION + [429]
    await client.expect_closed()
    assert (
        metric(server.context.metrics.registry, "tether_cancellations_total", result="rate_limited")
        == 1
    )


async def test_a_cancel_reaches_the_replica_that_holds_the_request(
    fake_engine: FakeEngineFactory, tether: TetherFactory, http: aiohttp.ClientSession
) -> None:
    """Two replicas with the fleet settings: a cancel sent to the one that does not hold the
    request is asked of the other (with the caller's hash, over the admin API), which stops
    it; the answer names that replica."""
    engine, engine_url = await fake_engine(token_interval=TOKEN_INTERVAL)
    holder = await tether(engine_url, admin_token=CANARY_SECRET, replica_name="holder")
    asked = await tether(
        engine_url,
        admin_token=CANARY_SECRET,
        replica_name="asked",
        fleet_peers=(f"127.0.0.1:{holder.admin_port}",),
    )
    client = await _stream(holder, "far-1", ALICE)

    status, answer = await _cancel(http, asked, "far-1", ALICE)
    refused, _ = await _cancel(http, asked, "far-1", BOB)

    assert (status, answer["cancelled"], answer["replica"]) == (200, 1, "holder")
    assert answer["engine"] == "confirmed"
    assert refused == 404
    await client.read_until(b"0\r\n\r\n")
    [generation] = engine.generations.values()
    assert generation.stopped_by == "abort"


async def test_leaving_a_watch_of_a_background_response_aborts_nothing(
    upstream_app: UpstreamAppFactory, tether: TetherFactory
) -> None:
    """GET /v1/responses/{id}?stream=true watches a background response: a client that leaves
    it only stopped watching; no abort call goes out and tether reads the engine's stream to
    its end instead of dropping the connection."""
    watching = asyncio.Event()
    finished = asyncio.Event()
    release = asyncio.Event()

    async def watch(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write(b'data: {"type": "response.created"}\n\n')
        watching.set()
        await release.wait()
        assert request.transport is not None
        dropped.append(request.transport.is_closing())
        await response.write(b'data: {"type": "response.completed"}\n\n')
        await response.write_eof()
        finished.set()
        return response

    aborts: list[bytes] = []
    dropped: list[bool] = []

    async def abort(request: web.Request) -> web.Response:
        aborts.append(await request.read())
        return web.json_response({})

    app = web.Application()
    app.router.add_get("/v1/responses/{id}", watch)
    app.router.add_post("/abort_requests", abort)
    server = await tether(await upstream_app(app), engine="vllm")
    client = await RawClient.connect(server.port)
    await client.send(b"GET /v1/responses/resp_abc?stream=true HTTP/1.1\r\nHost: t\r\n\r\n")
    await asyncio.wait_for(watching.wait(), 5)
    await client.read_until(b"response.created")
    client.close_fin()
    await settled(server)
    reading_on = server.context.aborts.pending  # tether still reads the engine's stream
    release.set()

    await asyncio.wait_for(finished.wait(), 5)
    await drained(server)
    assert reading_on == 1
    assert aborts == []
    assert dropped == [False]


async def test_a_held_responses_request_is_cancelled_by_tether_and_others_go_to_the_engine(
    fake_engine: FakeEngineFactory, tether: TetherFactory, http: aiohttp.ClientSession
) -> None:
    """POST /v1/responses/{id}/cancel: an in-flight Responses request tether holds is
    cancelled by tether (the engine gets its abort); an ID tether does not hold goes to the
    engine's own route."""
    engine, engine_url = await fake_engine(token_interval=TOKEN_INTERVAL)
    server = await tether(engine_url)
    client = await RawClient.connect(server.port)
    await client.send_request(
        {"model": "fake", "input": CANARY_PROMPT, "stream": True, "max_output_tokens": 100_000},
        path="/v1/responses",
        headers=ALICE,
    )
    await client.read_until(b"tok0")
    [generation] = engine.generations.values()

    async with http.post(
        url(server, f"/v1/responses/{generation.response_id}/cancel"), headers=ALICE
    ) as response:
        answer = await response.json()
    async with http.post(url(server, "/v1/responses/resp_stored/cancel"), headers=ALICE) as other:
        forwarded = other.status, await other.text()

    assert (answer["id"], answer["cancelled"]) == (generation.response_id, 1)
    assert generation.stopped_by == "abort"
    # The fake engine has no such route: its own (aiohttp's) 404, not tether's JSON.
    assert forwarded == (404, "404: Not Found")


async def test_a_cancel_reaches_the_worker_that_holds_the_request(
    fake_engine: FakeEngineFactory,
    tether_process: TetherProcessFactory,
    http: aiohttp.ClientSession,
) -> None:
    """TETHER_WORKERS=2 with an admin token: streams on both workers are cancelled through one
    connection (so one worker is asked for a request the other holds); each reaches the engine
    as an abort of its own internal ID."""
    engine, engine_url = await fake_engine(token_interval=TOKEN_INTERVAL)
    process = await tether_process(engine_url, TETHER_WORKERS="2", TETHER_ADMIN_TOKEN=CANARY_SECRET)
    admin = {"Authorization": f"Bearer {CANARY_SECRET}"}
    streams: dict[int, tuple[str, RawClient]] = {}
    internal_ids: list[str] = []
    for index in range(32):  # new connections until both workers hold one
        client = await RawClient.connect(process.port)
        name = f"w-{index}"
        await client.send_request(
            chat_body(max_tokens=100_000), headers={"X-Request-Id": name, **ALICE}
        )
        await client.read_until(b"tok0")
        async with http.get(process.admin_url("/admin/requests"), headers=admin) as response:
            listed = (await response.json())["requests"]
        [entry] = [e for e in listed if e["client_request_id"] == name]
        if entry["worker"] in streams:
            client.close_fin()
            continue
        streams[entry["worker"]] = (name, client)
        internal_ids.append(entry["internal_request_id"])
        if len(streams) == 2:
            break
    assert len(streams) == 2, "every connection landed on one worker"

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1)) as one_connection:
        answers = []
        for name, _ in streams.values():
            answers.append(await _cancel(one_connection, process, name, ALICE))

    assert [(status, body["cancelled"]) for status, body in answers] == [(200, 1), (200, 1)]
    for _, client in streams.values():
        await client.read_until(b"0\r\n\r\n")
    assert set(internal_ids) <= engine.aborted_ids()


async def test_a_stream_cancelled_inside_an_event_ends_after_that_event(
    upstream_app: UpstreamAppFactory, tether: TetherFactory, http: aiohttp.ClientSession
) -> None:
    """The engine has sent half an event when the cancel arrives: the client gets the rest of
    that event and nothing after it, then the stream's end; the canceller waits for that."""
    half_sent = asyncio.Event()
    send_rest = asyncio.Event()

    async def chat(request: web.Request) -> web.StreamResponse:
        await request.read()
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write(b'data: {"n": 1}\n\n')
        await response.write(b'data: {"n": ')
        half_sent.set()
        await send_rest.wait()
        await response.write(b'2}\n\ndata: {"n": 3}\n\n')
        await asyncio.Event().wait()  # an engine that would go on
        return response

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    server = await tether(await upstream_app(app), engine="vllm")
    client = await RawClient.connect(server.port)
    await client.send_request(chat_body(), headers={"X-Request-Id": "split-1", **ALICE})
    first = await client.read_until(b'{"n": 1}')
    first += await client.read_until(b'{"n": ')  # half of the second event
    await asyncio.wait_for(half_sent.wait(), 5)

    [state] = server.context.registry
    cancelling = asyncio.ensure_future(_cancel(http, server, "split-1", ALICE))
    await poll_until(lambda: state.left is not None, 5, what="the cancel to arrive")
    send_rest.set()  # the engine finishes the event (and starts another)
    raw = first + await client.read_to_end()
    status, answer = await cancelling

    assert (status, answer["cancelled"]) == (200, 1)
    events = _events_of(raw)
    assert [json.loads(event[len("data: ") :])["n"] for event in events] == [1, 2]


# --- several workers, no admin token ---------------------------------------------------------

# Two workers with the defaults an operator starts with: no admin token, the admin port the
# kernel picks.
WORKERS_WITHOUT_TOKEN = {"TETHER_WORKERS": "2", "TETHER_ADMIN_PORT": "0"}
# Streams on connections of their own: the kernel spreads connections over the workers, so
# all of them land on the canceller's worker once in 2**16 runs.
SPREAD = 16


async def _spread_streams(process: Any, prefix: str, headers: dict[str, str]) -> dict[str, Any]:
    """SPREAD long streams, each on a connection of its own, by name."""
    return {
        f"{prefix}-{index}": await _stream(process, f"{prefix}-{index}", headers)
        for index in range(SPREAD)
    }


async def _cancel_all(process: Any, streams: dict[str, Any]) -> list[tuple[int, Any]]:
    """Alice's cancel of each stream, all through one connection (so on one worker)."""
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1)) as one_connection:
        return [await _cancel(one_connection, process, name, ALICE) for name in streams]


async def _holders(process: Any, count: int) -> set[int]:
    """The workers that cancelled requests they held, once `count` of them said so."""

    def held() -> set[int] | None:
        lines = [e for e in process.events("request_cancelled") if "client_request_id" in e]
        return {line["worker"] for line in lines} if len(lines) >= count else None

    return await poll_until(held, 10.0, what=f"{count} request_cancelled lines")


async def test_without_an_admin_token_a_cancel_reaches_the_worker_that_holds_the_request(
    fake_engine: FakeEngineFactory, tether_process: TetherProcessFactory
) -> None:
    """TETHER_WORKERS=2, no admin token, admin port 0: streams spread over both workers are
    all cancelled through one connection, and each stops at the engine."""
    engine, engine_url = await fake_engine(token_interval=TOKEN_INTERVAL)
    process = await tether_process(engine_url, **WORKERS_WITHOUT_TOKEN)
    streams = await _spread_streams(process, "w", ALICE)

    answers = await _cancel_all(process, streams)

    assert [(status, body.get("cancelled")) for status, body in answers] == [(200, 1)] * SPREAD
    for client in streams.values():
        await client.read_until(b"0\r\n\r\n")
    await engine.wait_for(lambda: len(engine.aborted_ids()) == SPREAD)
    # Both workers held some: one connection reached the other worker's.
    assert await _holders(process, SPREAD) == {0, 1}


async def test_a_cancel_reaches_a_worker_that_restarted(
    fake_engine: FakeEngineFactory, tether_process: TetherProcessFactory
) -> None:
    """TETHER_WORKERS=2, no admin token: once a killed worker is restarted, cancels through
    one connection reach the streams it holds again."""
    engine, engine_url = await fake_engine(token_interval=TOKEN_INTERVAL)
    process = await tether_process(engine_url, **WORKERS_WITHOUT_TOKEN)
    # The workers have asked each other before the restart.
    await _cancel_all(process, await _spread_streams(process, "before", ALICE))
    victim = await process.wait_event("worker_started", worker=1)
    os.kill(victim["pid"], signal.SIGKILL)
    await process.wait_event("worker_restarted", index=1)

    streams = await _spread_streams(process, "after", ALICE)
    answers = await _cancel_all(process, streams)

    assert [(status, body.get("cancelled")) for status, body in answers] == [(200, 1)] * SPREAD
    for client in streams.values():
        await client.read_until(b"0\r\n\r\n")
    await engine.wait_for(lambda: len(engine.aborted_ids()) == 2 * SPREAD)


async def test_without_an_admin_token_a_batch_cancel_reaches_every_worker(
    fake_engine: FakeEngineFactory,
    tether_process: TetherProcessFactory,
    http: aiohttp.ClientSession,
) -> None:
    """TETHER_WORKERS=2, no admin token: one POST /v1/requests/cancel stops the caller's
    streams on both workers, and says so for each."""
    engine, engine_url = await fake_engine(token_interval=TOKEN_INTERVAL)
    process = await tether_process(engine_url, **WORKERS_WITHOUT_TOKEN)
    streams = await _spread_streams(process, "b", ALICE)

    async with http.post(
        process.url("/v1/requests/cancel"), json={"request_ids": [*streams]}, headers=ALICE
    ) as response:
        answer = await response.json()

    assert [(item["id"], item["cancelled"]) for item in answer["data"]] == [
        (name, 1) for name in streams
    ]
    for client in streams.values():
        await client.read_until(b"0\r\n\r\n")
    await engine.wait_for(lambda: len(engine.aborted_ids()) == SPREAD)
    assert await _holders(process, SPREAD) == {0, 1}


async def test_without_an_admin_token_the_callers_requests_are_listed_from_every_worker(
    fake_engine: FakeEngineFactory,
    tether_process: TetherProcessFactory,
    http: aiohttp.ClientSession,
) -> None:
    """TETHER_WORKERS=2, no admin token: GET /v1/requests lists the caller's streams on both
    workers, and only the caller's."""
    _, engine_url = await fake_engine(token_interval=TOKEN_INTERVAL)
    process = await tether_process(engine_url, **WORKERS_WITHOUT_TOKEN)
    alices = await _spread_streams(process, "alice", ALICE)
    bobs = await _spread_streams(process, "bob", BOB)

    listed = {}
    for who, headers in (("alice", ALICE), ("bob", BOB)):
        async with http.get(process.url("/v1/requests"), headers=headers) as response:
            listed[who] = sorted(entry["id"] for entry in (await response.json())["data"])

    assert listed == {"alice": sorted(alices), "bob": sorted(bobs)}
    for client in [*alices.values(), *bobs.values()]:
        client.close_fin()


async def test_without_an_admin_token_another_credential_cancels_nothing_on_any_worker(
    fake_engine: FakeEngineFactory,
    tether_process: TetherProcessFactory,
    http: aiohttp.ClientSession,
) -> None:
    """TETHER_WORKERS=2, no admin token: another caller's cancels, one by one or in a batch,
    get 404 (or nothing cancelled) whichever worker holds the request, and it runs on."""
    engine, engine_url = await fake_engine(token_interval=TOKEN_INTERVAL)
    process = await tether_process(engine_url, **WORKERS_WITHOUT_TOKEN)
    streams = await _spread_streams(process, "x", ALICE)

    # A connection per cancel: failed cancels on one connection are bounded.
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as fresh:
        answers = [await _cancel(fresh, process, name, BOB) for name in streams]
        async with fresh.post(
            process.url("/v1/requests/cancel"), json={"request_ids": [*streams]}, headers=BOB
        ) as response:
            batch = await response.json()
    async with http.get(process.url("/v1/requests"), headers=ALICE) as response:
        still = sorted(entry["id"] for entry in (await response.json())["data"])

    assert [status for status, _ in answers] == [404] * SPREAD
    assert [item["cancelled"] for item in batch["data"]] == [0] * SPREAD
    assert still == sorted(streams)
    assert engine.aborted_ids() == set()
    for client in streams.values():
        client.close_fin()
