"""Streams that outlive a dropped connection (TETHER_RESUME_GRACE): the same caller resumes
with `Last-Event-ID` and gets every remaining event exactly once while the engine never
notices; nobody resuming means the engine's work is stopped after the grace, as for any
client that left."""

from __future__ import annotations

import asyncio
import re
import time
from typing import Any

import aiohttp
import pytest

from tether_fake_engine import FakeEngine, GenerationState

from .support.canaries import CANARY_SECRET
from .support.chat import chat_body, openai_chat_text
from .support.in_process import TetherFactory, drained, settled
from .support.metrics import metric
from .support.processes import TetherProcessFactory
from .support.raw_http import RawClient
from .support.upstreams import FakeEngineFactory
from .support.waiting import poll_until

ALICE = {"Authorization": "Bearer alice-key"}
BOB = {"Authorization": "Bearer bob-key"}
TOKEN_INTERVAL = 0.01
GRACE = 5.0
# A disconnect's stop, as the abort tests bound it (tests/test_abort.py).
STOP_BOUND = 1.0
_TOKEN = re.compile(r"tok\d+")

# Each streaming API the resume covers: its path and its body.
_ROUTES: dict[str, tuple[str, dict[str, Any]]] = {
    "chat": ("/v1/chat/completions", chat_body(max_tokens=40)),
    "completions": (
        "/v1/completions",
        {"model": "fake", "prompt": "hello", "stream": True, "max_tokens": 40},
    ),
    "responses": (
        "/v1/responses",
        {"model": "fake", "input": "hello", "stream": True, "max_output_tokens": 40},
    ),
}


def _tokens(events: list[bytes]) -> list[str]:
    return [token for event in events for token in _TOKEN.findall(event.decode())]


def _id_of(event: bytes) -> int:
    first = event.split(b"\n", 1)[0]
    assert first.startswith(b"id: "), f"an event without its number first: {event[:80]!r}"
    return int(first[len(b"id: ") :])


async def _events(response: aiohttp.ClientResponse, count: int | None = None) -> list[bytes]:
    """The next `count` whole events of an SSE response (all of them, to its end, by default),
    each with its blank line."""
    events: list[bytes] = []
    async with asyncio.timeout(10):
        while count is None or len(events) < count:
            try:
                event = await response.content.readuntil(b"\n\n")
            except aiohttp.ClientPayloadError:
                break
            if not event.endswith(b"\n\n"):
                assert count is None, f"the stream ended inside an event: {event!r}"
                break
            events.append(event)
    return events


async def _uninterrupted(
    http: aiohttp.ClientSession, port: int, path: str, body: dict[str, Any]
) -> list[bytes]:
    async with http.post(f"http://127.0.0.1:{port}{path}", json=body, headers=ALICE) as response:
        return await _events(response)


async def _resume(
    http: aiohttp.ClientSession,
    port: int,
    request_id: str,
    headers: dict[str, str],
    last: int | None = None,
) -> aiohttp.ClientResponse:
    asked = dict(headers)
    if last is not None:
        asked["Last-Event-ID"] = str(last)
    return await http.get(f"http://127.0.0.1:{port}/v1/requests/{request_id}/stream", headers=asked)


async def _read_then_drop(
    http: aiohttp.ClientSession,
    port: int,
    body: dict[str, Any],
    headers: dict[str, str],
    count: int,
    path: str = "/v1/chat/completions",
) -> list[bytes]:
    """A stream through tether: its first `count` events read, then its connection dropped
    (the client's network gone)."""
    response = await http.post(f"http://127.0.0.1:{port}{path}", json=body, headers=headers)
    try:
        return await _events(response, count)
    finally:
        response.close()


async def _held(server: Any, count: int = 1) -> None:
    registry = server.context.metrics.registry
    await poll_until(
        lambda: metric(registry, "tether_streams_held") == count,
        timeout=5,
        what=f"{count} stream(s) held",
    )


def _generation(engine: FakeEngine) -> Any:
    [generation] = engine.generations.values()
    return generation


@pytest.mark.parametrize("api", list(_ROUTES))
async def test_a_resumed_stream_gets_every_remaining_event_exactly_once_and_the_engine_never_knows(
    api: str, fake_engine: FakeEngineFactory, tether: TetherFactory, http: aiohttp.ClientSession
) -> None:
    """The client reads a few events, its connection drops, it resumes with the last event
    ID it received: the tokens it got before and after are exactly an uninterrupted run's,
    the numbering goes on without a gap, and the engine saw no abort and no disconnect."""
    path, body = _ROUTES[api]
    engine, engine_url = await fake_engine(token_interval=TOKEN_INTERVAL)
    server = await tether(engine_url, resume_grace=GRACE)
    whole = await _uninterrupted(http, server.port, path, body)
    engine.generations.clear()

    # The client reads 4 events, and its connection drops mid-stream.
    before = await _read_then_drop(
        http, server.port, body, {"X-Request-Id": f"job-{api}", **ALICE}, 4, path=path
    )
    await _held(server)
    async with await _resume(http, server.port, f"job-{api}", ALICE, _id_of(before[-1])) as again:
        assert again.status == 200
        assert again.headers["Content-Type"].startswith("text/event-stream")
        after = await _events(again)

    assert _tokens(before) + _tokens(after) == _tokens(whole)
    numbers = [_id_of(event) for event in before + after]
    assert numbers == list(range(1, len(numbers) + 1))
    assert len(before) + len(after) == len(whole)
    generation = _generation(engine)
    assert generation.state is GenerationState.COMPLETED
    assert engine.aborts == [] and engine.disconnects == []
    await settled(server)
    registry = server.context.metrics.registry
    assert metric(registry, "tether_stream_holds_total", result="resumed") == 1
    assert metric(registry, "tether_request_outcomes_total", outcome="completed") == 2
    assert metric(registry, "tether_client_disconnects_total", phase="streaming") == 0


async def test_a_stream_nobody_resumes_is_aborted_after_the_grace_and_its_tokens_counted(
    fake_engine: FakeEngineFactory, tether: TetherFactory, http: aiohttp.ClientSession
) -> None:
    """No resume: the engine runs on through the grace (no abort before it), then gets the
    abort within a disconnect's bound; the request ends as its client's leaving, with the
    tokens generated for nobody counted."""
    grace = 1.0
    engine, engine_url = await fake_engine(token_interval=TOKEN_INTERVAL)
    server = await tether(engine_url, resume_grace=grace)
    await _read_then_drop(http, server.port, chat_body(max_tokens=100_000), ALICE, 3)
    left = time.monotonic()
    generation = _generation(engine)
    await engine.wait_for(lambda: generation.state is not GenerationState.RUNNING, timeout=10)

    assert generation.state is GenerationState.ABORTED and generation.stopped_by == "abort"
    assert generation.ended_at is not None
    assert grace * 0.9 <= generation.ended_at - left < grace + STOP_BOUND
    await settled(server)
    await drained(server)
    registry = server.context.metrics.registry
    assert metric(registry, "tether_stream_holds_total", result="lapsed") == 1
    assert metric(registry, "tether_streams_held") == 0
    assert metric(registry, "tether_request_outcomes_total", outcome="client_disconnected") == 1
    # At least the grace's worth of tokens, at one every TOKEN_INTERVAL, went to nobody.
    after = metric(registry, "tether_tokens_after_disconnect_total", route="/v1/chat/completions")
    assert after >= grace / TOKEN_INTERVAL / 4


async def test_only_the_streams_own_caller_can_resume_it(
    fake_engine: FakeEngineFactory, tether: TetherFactory, http: aiohttp.ClientSession
) -> None:
    """Another credential, no credential and an unknown ID all get the same 404 and change
    nothing: the owner still resumes the stream afterwards."""
    engine, engine_url = await fake_engine(token_interval=TOKEN_INTERVAL)
    server = await tether(engine_url, resume_grace=GRACE)
    before = await _read_then_drop(
        http, server.port, chat_body(max_tokens=60), {"X-Request-Id": "mine", **ALICE}, 2
    )
    await _held(server)

    for request_id, headers in (("mine", BOB), ("mine", {}), ("nobodys", ALICE)):
        async with await _resume(http, server.port, request_id, headers, 0) as refused:
            assert refused.status == 404
            assert (await refused.json())["error"]["code"] == "request_not_found"
    async with await _resume(http, server.port, "mine", ALICE, _id_of(before[-1])) as again:
        assert again.status == 200
        after = await _events(again)
    assert _tokens(before) + _tokens(after) == [f"tok{i}" for i in range(60)]
    assert engine.aborts == []


async def test_a_finished_stream_can_no_longer_be_resumed(
    fake_engine: FakeEngineFactory, tether: TetherFactory, http: aiohttp.ClientSession
) -> None:
    """Once a stream went to its client whole, its ID resumes nothing (404)."""
    _, engine_url = await fake_engine(token_interval=TOKEN_INTERVAL)
    server = await tether(engine_url, resume_grace=GRACE)
    whole = await http.post(
        f"http://127.0.0.1:{server.port}/v1/chat/completions",
        json=chat_body(max_tokens=3),
        headers={"X-Request-Id": "done", **ALICE},
    )
    await _events(whole)
    whole.close()
    await settled(server)
    async with await _resume(http, server.port, "done", ALICE, 1) as refused:
        assert refused.status == 404


async def test_a_stream_that_ends_while_held_is_resumed_to_its_end(
    fake_engine: FakeEngineFactory, tether: TetherFactory, http: aiohttp.ClientSession
) -> None:
    """The engine finishes while the client is away: the resume gets the rest, `[DONE]`
    included, and a clean end; the engine was never aborted."""
    engine, engine_url = await fake_engine(token_interval=TOKEN_INTERVAL)
    server = await tether(engine_url, resume_grace=GRACE)
    before = await _read_then_drop(
        http, server.port, chat_body(max_tokens=30), {"X-Request-Id": "late", **ALICE}, 2
    )
    generation = _generation(engine)
    await engine.wait_for(lambda: generation.state is GenerationState.COMPLETED, timeout=5)
    async with await _resume(http, server.port, "late", ALICE, _id_of(before[-1])) as again:
        after = await _events(again)
    assert _tokens(before) + _tokens(after) == [f"tok{i}" for i in range(30)]
    assert after[-1].endswith(b"data: [DONE]\n\n")
    assert engine.aborts == []


async def test_a_stream_resumed_twice_loses_and_repeats_nothing(
    fake_engine: FakeEngineFactory, tether: TetherFactory, http: aiohttp.ClientSession
) -> None:
    """The resume's own connection drops too: a second resume from its last event still
    makes the whole stream, each token once."""
    engine, engine_url = await fake_engine(token_interval=TOKEN_INTERVAL)
    server = await tether(engine_url, resume_grace=GRACE)
    one = await _read_then_drop(
        http, server.port, chat_body(max_tokens=60), {"X-Request-Id": "twice", **ALICE}, 3
    )
    await _held(server)
    second = await _resume(http, server.port, "twice", ALICE, _id_of(one[-1]))
    two = await _events(second, 5)
    second.close()
    await _held(server)
    async with await _resume(http, server.port, "twice", ALICE, _id_of(two[-1])) as third:
        three = await _events(third)
    assert _tokens(one) + _tokens(two) + _tokens(three) == [f"tok{i}" for i in range(60)]
    assert engine.aborts == []
    await settled(server)
    registry = server.context.metrics.registry
    assert metric(registry, "tether_stream_holds_total", result="resumed") == 2


async def test_a_resume_takes_over_a_connection_tether_still_thinks_open(
    fake_engine: FakeEngineFactory, tether: TetherFactory, http: aiohttp.ClientSession
) -> None:
    """A network change leaves the first connection half-open (tether saw no FIN): a resume
    takes the stream over, the old connection is closed by tether, and the stream goes on
    whole on the new one."""
    engine, engine_url = await fake_engine(token_interval=TOKEN_INTERVAL)
    server = await tether(engine_url, resume_grace=GRACE)
    old = await RawClient.connect(server.port)
    await old.send_request(chat_body(max_tokens=60), headers={"X-Request-Id": "moved", **ALICE})
    seen = await old.read_until(b"tok2")
    last = max(int(number) for number in re.findall(rb"id: (\d+)\n", seen)) - 1
    async with await _resume(http, server.port, "moved", ALICE, last) as again:
        after = await _events(again)
    rest = await old.read_until_cut()
    assert b"tok59" not in rest  # the old connection was closed, not carried to the end
    assert _tokens(after)[-1] == "tok59"
    assert engine.aborts == []
    assert _generation(engine).state is GenerationState.COMPLETED


async def test_a_held_stream_past_its_buffer_is_aborted_before_the_grace(
    fake_engine: FakeEngineFactory, tether: TetherFactory, http: aiohttp.ClientSession
) -> None:
    """The engine outruns TETHER_RESUME_BUFFER while the client is away: the stream is not
    held on to the end of a long grace; the engine is aborted as for a client that left."""
    engine, engine_url = await fake_engine(token_interval=0.001)
    server = await tether(engine_url, resume_grace=60, resume_buffer=4096)
    await _read_then_drop(http, server.port, chat_body(max_tokens=100_000), ALICE, 2)
    generation = _generation(engine)
    await engine.wait_for(lambda: generation.state is not GenerationState.RUNNING, timeout=10)
    assert generation.stopped_by == "abort"
    await settled(server)
    registry = server.context.metrics.registry
    assert metric(registry, "tether_stream_holds_total", result="lapsed") == 1


async def test_a_resume_from_events_no_longer_held_or_never_sent_is_refused(
    fake_engine: FakeEngineFactory, tether: TetherFactory, http: aiohttp.ClientSession
) -> None:
    """Events dropped from a full buffer: 410 `events_no_longer_held`; a last event ID the
    stream never sent, or not a number: 400 `invalid_last_event_id`. The stream stays held
    for a valid resume."""
    engine, engine_url = await fake_engine(token_interval=TOKEN_INTERVAL)
    server = await tether(engine_url, resume_grace=GRACE, resume_buffer=4096)
    # Far more than the 2 KiB kept while the client reads go by: the oldest are dropped.
    # (An engine that then stalls: nothing more comes while the client is away.)
    body = chat_body(max_tokens=100_000, stall_after=60)
    events = await _read_then_drop(http, server.port, body, {"X-Request-Id": "far", **ALICE}, 61)
    await _held(server)
    for last, status, code in (
        (0, 410, "events_no_longer_held"),
        (10**9, 400, "invalid_last_event_id"),
        ("x", 400, "invalid_last_event_id"),
    ):
        async with await http.get(
            f"http://127.0.0.1:{server.port}/v1/requests/far/stream",
            headers={"Last-Event-ID": str(last), **ALICE},
        ) as refused:
            assert refused.status == status
            assert (await refused.json())["error"]["code"] == code
    async with await http.get(
        f"http://127.0.0.1:{server.port}/v1/requests/far/stream"
        f"?starting_after={_id_of(events[-2])}",
        headers=ALICE,
    ) as again:
        assert again.status == 200
        [resent] = await _events(again, 1)  # (nothing follows it: the engine stalls)
    assert resent == events[-1]
    assert engine.aborts == []


async def test_a_held_stream_cancelled_by_its_caller_is_aborted_at_once(
    fake_engine: FakeEngineFactory, tether: TetherFactory, http: aiohttp.ClientSession
) -> None:
    """Its caller cancels it by ID while it is held: the engine gets the abort within a
    disconnect's bound, not at the end of the grace, and the stream can no longer be
    resumed."""
    engine, engine_url = await fake_engine(token_interval=TOKEN_INTERVAL)
    server = await tether(engine_url, resume_grace=60)
    await _read_then_drop(
        http, server.port, chat_body(max_tokens=100_000), {"X-Request-Id": "stop-me", **ALICE}, 2
    )
    await _held(server)
    asked = time.monotonic()
    async with http.post(
        f"http://127.0.0.1:{server.port}/v1/requests/stop-me/cancel", headers=ALICE
    ) as cancelled:
        assert cancelled.status == 200
        assert (await cancelled.json())["cancelled"] == 1
    generation = _generation(engine)
    await engine.wait_for(lambda: generation.state is not GenerationState.RUNNING, timeout=5)
    assert generation.stopped_by == "abort"
    assert generation.ended_at is not None and generation.ended_at - asked < STOP_BOUND
    await settled(server)
    async with await _resume(http, server.port, "stop-me", ALICE, 0) as refused:
        assert refused.status == 404
    registry = server.context.metrics.registry
    assert metric(registry, "tether_request_outcomes_total", outcome="cancelled") == 1
    assert metric(registry, "tether_streams_held") == 0


async def test_a_resume_reaching_another_replica_is_relayed_from_the_one_that_holds_it(
    fake_engine: FakeEngineFactory, tether: TetherFactory, http: aiohttp.ClientSession
) -> None:
    """Two replicas with the fleet settings: the resume reaches the one that does not hold
    the stream; it asks the other (over the admin API, with the caller's hash) and relays
    its stream, whole; another caller still gets 404 there."""
    engine, engine_url = await fake_engine(token_interval=TOKEN_INTERVAL)
    holder = await tether(
        engine_url, admin_token=CANARY_SECRET, replica_name="holder", resume_grace=GRACE
    )
    asked = await tether(
        engine_url,
        admin_token=CANARY_SECRET,
        replica_name="asked",
        resume_grace=GRACE,
        fleet_peers=(f"127.0.0.1:{holder.admin_port}",),
    )
    before = await _read_then_drop(
        http, holder.port, chat_body(max_tokens=60), {"X-Request-Id": "roamer", **ALICE}, 3
    )
    await _held(holder)

    await _resumed_whole_through(http, asked.port, "roamer", before)
    assert engine.aborts == []


async def _resumed_whole_through(
    http: aiohttp.ClientSession, port: int, request_id: str, before: list[bytes]
) -> None:
    """Resumed through the tether at `port`, which does not hold it: another caller gets
    404, its own caller the rest of the stream under its ID, whole."""
    async with await _resume(http, port, request_id, BOB, _id_of(before[-1])) as refused:
        assert refused.status == 404
    async with await _resume(http, port, request_id, ALICE, _id_of(before[-1])) as again:
        assert again.status == 200
        assert again.headers["X-Request-Id"] == request_id
        after = await _events(again)
    assert _tokens(before) + _tokens(after) == [f"tok{i}" for i in range(60)]
    assert after[-1].endswith(b"data: [DONE]\n\n")


# Several workers: the kernel spreads connections over them, so streams on connections of
# their own land on both, and all of them on the resumer's worker once in 2**16 runs.
SPREAD = 16
# Long enough for every resume of a spread, one after another, on a loaded machine.
SPREAD_GRACE = 30.0


async def test_a_resume_reaching_another_worker_is_relayed_from_the_one_that_holds_it(
    fake_engine: FakeEngineFactory, tether_process: TetherProcessFactory
) -> None:
    """TETHER_WORKERS=2, no admin token: streams held by both workers are all resumed
    through one connection (so on one worker), each whole, with no abort; another caller
    gets 404 there."""
    engine, engine_url = await fake_engine(token_interval=TOKEN_INTERVAL)
    process = await tether_process(
        engine_url,
        TETHER_WORKERS="2",
        TETHER_ADMIN_PORT="0",
        TETHER_RESUME_GRACE=str(SPREAD_GRACE),
    )
    async with aiohttp.ClientSession() as http:
        before = {
            f"spread-{index}": await _read_then_drop(
                http,
                process.port,
                chat_body(max_tokens=60),
                {"X-Request-Id": f"spread-{index}", **ALICE},
                3,
            )
            for index in range(SPREAD)
        }
    await poll_until(
        lambda: len(process.events("stream_held")) == SPREAD, 10, what="every stream held"
    )

    # Another caller's resumes, each on a connection of its own (a connection's failures
    # are bounded), are refused whichever worker they reach.
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as others:
        for name in before:
            async with await _resume(others, process.port, name, BOB, 0) as refused:
                assert refused.status == 404
    after: dict[str, list[bytes]] = {}
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1)) as one_connection:
        for name, events in before.items():
            async with await _resume(
                one_connection, process.port, name, ALICE, _id_of(events[-1])
            ) as again:
                assert again.status == 200
                after[name] = await _events(again)

    for name, events in before.items():
        assert _tokens(events) + _tokens(after[name]) == [f"tok{i}" for i in range(60)], name
        assert after[name][-1].endswith(b"data: [DONE]\n\n")
    assert engine.aborts == []
    # Both workers held some: one connection resumed the other worker's.
    assert {line["worker"] for line in process.events("stream_held")} == {0, 1}


async def test_a_resume_from_another_replica_reaches_the_worker_that_holds_it(
    fake_engine: FakeEngineFactory,
    tether: TetherFactory,
    tether_process: TetherProcessFactory,
    http: aiohttp.ClientSession,
) -> None:
    """A replica with TETHER_WORKERS=2 holds the stream; a resume reaching another replica
    with the fleet settings is relayed from it (its supervisor asks its workers), whole."""
    engine, engine_url = await fake_engine(token_interval=TOKEN_INTERVAL)
    holder = await tether_process(
        engine_url,
        TETHER_WORKERS="2",
        TETHER_ADMIN_TOKEN=CANARY_SECRET,
        TETHER_RESUME_GRACE=str(GRACE),
    )
    asked = await tether(
        engine_url,
        admin_token=CANARY_SECRET,
        resume_grace=GRACE,
        fleet_peers=(f"127.0.0.1:{holder.admin_port}",),
    )
    before = await _read_then_drop(
        http, holder.port, chat_body(max_tokens=60), {"X-Request-Id": "far", **ALICE}, 3
    )
    await holder.wait_event("stream_held", timeout=10)

    await _resumed_whole_through(http, asked.port, "far", before)
    assert engine.aborts == []


async def test_a_resumed_stream_keeps_its_keepalive_comments(
    fake_engine: FakeEngineFactory, tether: TetherFactory, http: aiohttp.ClientSession
) -> None:
    """With TETHER_SSE_KEEPALIVE too, the resume's connection gets comments while the engine
    is silent (it passes the same load balancers), never counted as events: the tokens still
    make the whole answer."""
    keepalive = 0.25
    _, engine_url = await fake_engine(token_interval=4 * keepalive)
    server = await tether(engine_url, resume_grace=GRACE, sse_keepalive=keepalive)
    before = await _read_then_drop(
        http, server.port, chat_body(max_tokens=4), {"X-Request-Id": "quiet", **ALICE}, 2
    )
    await _held(server)
    last = max(_id_of(event) for event in before if event.startswith(b"id: "))
    async with await _resume(http, server.port, "quiet", ALICE, last) as again:
        after = await _events(again)
    assert b": keep-alive\n\n" in after
    assert _tokens(before) + _tokens(after) == [f"tok{i}" for i in range(4)]


async def test_the_openai_sdk_reads_a_numbered_stream_unchanged(
    fake_engine: FakeEngineFactory, tether: TetherFactory
) -> None:
    """The `id:` lines resume adds are SSE fields the openai SDK reads past: its chunks and
    text are those of the same stream without them."""
    _, engine_url = await fake_engine(token_interval=TOKEN_INTERVAL)
    plain = await tether(engine_url)
    numbered = await tether(engine_url, resume_grace=GRACE)

    text = await openai_chat_text(numbered.port, max_tokens=8)
    assert text == await openai_chat_text(plain.port, max_tokens=8)
    assert text == "".join(f" tok{i}" for i in range(8))


async def test_a_resumed_stream_is_still_bounded_by_the_whole_request_timeout(
    fake_engine: FakeEngineFactory, tether: TetherFactory, http: aiohttp.ClientSession
) -> None:
    """TETHER_REQUEST_TIMEOUT counts from the request's start, resumes included: the resumed
    stream is cut when it passes, and the engine's work is stopped."""
    engine, engine_url = await fake_engine(token_interval=TOKEN_INTERVAL)
    server = await tether(engine_url, resume_grace=GRACE, request_timeout=1.5)
    before = await _read_then_drop(
        http, server.port, chat_body(max_tokens=100_000), {"X-Request-Id": "bounded", **ALICE}, 2
    )
    await _held(server)
    async with await _resume(http, server.port, "bounded", ALICE, _id_of(before[-1])) as again:
        after = await _events(again)
    assert after and not after[-1].endswith(b"data: [DONE]\n\n")
    generation = _generation(engine)
    await engine.wait_for(lambda: generation.state is not GenerationState.RUNNING, timeout=5)
    assert generation.stopped_by == "abort"
    await settled(server)
    registry = server.context.metrics.registry
    assert metric(registry, "tether_request_outcomes_total", outcome="timed_out") == 1
