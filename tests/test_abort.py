"""The abort call: right route and ID per engine, retried when the engine is busy, bounded in
time, remembered when missing, never an empty list."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass

from aiohttp import web

from proxy.server.runner import TetherServer
from tether_fake_engine import AbortRoute, FakeEngine, GenerationState

from .support.canaries import CANARY_PROMPT, CANARY_SECRET
from .support.chat import chat_body
from .support.in_process import TetherFactory, drained, leave_mid_stream, settled
from .support.metrics import metric
from .support.raw_http import RawClient
from .support.upstreams import FakeEngineFactory, UpstreamAppFactory


async def _leave_mid_stream(server: TetherServer, engine: FakeEngine) -> str:
    """Start a long stream, read a token, leave; return the internal ID once tether let go."""
    await leave_mid_stream(server)
    return list(engine.generations)[-1]  # the engine records requests in arrival order


def _count(server: TetherServer, result: str) -> float:
    return metric(
        server.context.metrics.registry,
        "tether_aborts_total",
        engine=server.context.engine.engine,
        result=result,
    )


async def test_abort_is_retried_while_the_engine_answers_503(
    fake_engine: FakeEngineFactory, tether: TetherFactory
) -> None:
    """A busy engine (503) gets the abort again, with backoff, until it accepts it."""
    engine, engine_url = await fake_engine(token_interval=0.01)
    engine.abort_failures = 2
    server = await tether(engine_url)
    internal_id = await _leave_mid_stream(server, engine)

    await engine.wait_for(lambda: engine.generation(internal_id).state is GenerationState.ABORTED)
    assert [abort.status for abort in engine.aborts] == [503, 503, 200]
    await drained(server)
    assert _count(server, "confirmed") == 1


async def test_abort_falls_back_to_the_scale_out_route(
    fake_engine: FakeEngineFactory, tether: TetherFactory
) -> None:
    """Without dev mode, vLLM's /inference/v1/abort_requests (--enable-scale-out) is used."""
    engine, engine_url = await fake_engine(abort_route=AbortRoute.SCALE_OUT, token_interval=0.01)
    server = await tether(engine_url)
    internal_id = await _leave_mid_stream(server, engine)

    await engine.wait_for(lambda: engine.generation(internal_id).state is GenerationState.ABORTED)
    assert [(a.path, a.status) for a in engine.aborts] == [
        ("/abort_requests", 404),
        ("/inference/v1/abort_requests", 200),
    ]


async def test_engine_without_abort_route_is_detected_once(
    fake_engine: FakeEngineFactory, tether: TetherFactory
) -> None:
    """A default `vllm serve` (404/403) is noticed, counted as not_supported, and not asked
    again for every request; the dropped connection still reaches the engine."""
    engine, engine_url = await fake_engine(
        abort_route=AbortRoute.NONE, token_interval=0.01, hears_disconnects=True
    )
    server = await tether(engine_url)
    first = await _leave_mid_stream(server, engine)
    await engine.wait_for(lambda: engine.generation(first).state is GenerationState.ABORTED)
    await drained(server)
    second = await _leave_mid_stream(server, engine)
    await engine.wait_for(lambda: engine.generation(second).state is GenerationState.ABORTED)
    await drained(server)

    assert [(a.path, a.status) for a in engine.aborts] == [
        ("/abort_requests", 404),
        ("/inference/v1/abort_requests", 403),
    ]
    assert _count(server, "not_supported") == 2
    assert [request_id for request_id, _ in engine.disconnects] == [first, second]


async def test_abort_attempts_stop_at_the_deadline(
    fake_engine: FakeEngineFactory, tether: TetherFactory
) -> None:
    """An abort endpoint that hangs costs at most TETHER_ABORT_DEADLINE, then counts as failed."""
    engine, engine_url = await fake_engine(token_interval=0.01)
    engine.abort_hangs = True
    server = await tether(engine_url, abort_timeout=0.2, abort_deadline=0.5)
    await _leave_mid_stream(server, engine)
    await engine.wait_for(lambda: len(engine.aborts) >= 1)
    loop = asyncio.get_running_loop()
    first_attempt = loop.time()

    await drained(server)

    # Without the deadline the attempts against a hanging endpoint never end (drained() fails
    # after 5 s); with it they end 0.5 s after the first: 2.5 s leaves a loaded machine room.
    assert loop.time() - first_attempt < 2.5
    assert _count(server, "failed") == 1
    # Two attempts fit: at 0 and at 0.25 s (0.2 s timeout each, 0.05 s backoff between).
    assert 1 <= len(engine.aborts) <= 3


async def test_an_abort_that_overtook_its_request_is_repeated_and_confirmed(
    fake_engine: FakeEngineFactory, tether: TetherFactory
) -> None:
    """A client that leaves the moment its request went out: the abort can overtake the
    request at the engine (still being registered there, it matches nothing). The response
    goes on past the repeat delay, so the abort goes out once more, and its effect confirms
    it; an abort that worked at once is not repeated."""
    engine, engine_url = await fake_engine(token_interval=0.01)
    server = await tether(engine_url, abort_repeat_delay=0.03)
    engine.ignore_aborts = 1
    client = await RawClient.connect(server.port)
    # A long prefill: no response has begun when the client leaves.
    await client.send_request(chat_body(max_tokens=100_000, prefill=0.5))
    await engine.wait_for(lambda: len(engine.generations) == 1)
    client.close_fin()
    await settled(server)
    await drained(server)
    [overtaken] = engine.generations
    assert [a.ids for a in engine.aborts] == [(f"chatcmpl-{overtaken}",)] * 2
    assert engine.generation(overtaken).state is GenerationState.ABORTED
    assert _count(server, "confirmed") == 1

    stopped_at_once = await _leave_mid_stream(server, engine)
    await drained(server)
    assert [a.ids for a in engine.aborts[2:]] == [(f"chatcmpl-{stopped_at_once}",)]


async def test_completions_route_aborts_with_the_cmpl_prefix(
    fake_engine: FakeEngineFactory, tether: TetherFactory
) -> None:
    """vLLM runs each completion prompt as cmpl-<id>-<index> (a single one too); the abort
    names exactly that (cmpl-<id> alone would match nothing)."""
    engine, engine_url = await fake_engine(token_interval=0.01)
    server = await tether(engine_url)
    await leave_mid_stream(
        server,
        close="rst",
        body={"prompt": CANARY_PROMPT, "stream": True, "max_tokens": 10_000},
        path="/v1/completions",
    )
    await engine.wait_for(lambda: engine.aborted_ids() != set())
    [internal_id] = engine.aborted_ids()
    assert engine.aborts[0].ids == (f"cmpl-{internal_id}-0",)


async def test_sglang_abort_names_the_rid(
    fake_engine: FakeEngineFactory, tether: TetherFactory
) -> None:
    """SGLang gets POST /abort_request {"rid": <internal>} with the admin key."""
    engine, engine_url = await fake_engine(abort_route=AbortRoute.SGLANG, token_interval=0.01)
    server = await tether(engine_url, engine="sglang", upstream_admin_key=CANARY_SECRET)
    internal_id = await _leave_mid_stream(server, engine)
    await engine.wait_for(lambda: engine.generation(internal_id).state is GenerationState.ABORTED)
    assert engine.aborts[0].path == "/abort_request"
    assert engine.aborts[0].ids == (internal_id,)


@dataclass(frozen=True)
class _CancelCall:
    """One call a generic engine's cancel route received."""

    method: str
    match_info: dict[str, str]
    body: bytes
    authorization: str | None


async def _engine_with_cancel_route(
    upstream_app: UpstreamAppFactory, method: str, path: str
) -> tuple[FakeEngine, str, list[_CancelCall]]:
    """A fake engine that also serves a generic engine's cancel route (answering 204), its
    URL, and the calls that route receives."""
    engine = FakeEngine(token_interval=0.01)
    calls: list[_CancelCall] = []

    async def cancel(request: web.Request) -> web.Response:
        calls.append(
            _CancelCall(
                request.method,
                dict(request.match_info),
                await request.read(),
                request.headers.get("Authorization"),
            )
        )
        return web.Response(status=204)

    engine.app.router.add_route(method, path, cancel)
    return engine, await upstream_app(engine.app), calls


async def test_generic_engine_uses_the_configured_template(
    upstream_app: UpstreamAppFactory, tether: TetherFactory
) -> None:
    """TETHER_ENGINE=generic sends the configured method, URL and body template."""
    engine, engine_url, calls = await _engine_with_cancel_route(
        upstream_app, "DELETE", "/v1/requests/cancel"
    )
    server = await tether(
        engine_url,
        engine="generic",
        abort_url="/v1/requests/cancel",
        abort_method="DELETE",
        abort_body='{{"id": "{internal_request_id}"}}',
        upstream_admin_key=CANARY_SECRET,
    )
    internal_id = await _leave_mid_stream(server, engine)
    await drained(server)
    assert [(call.method, call.body, call.authorization) for call in calls] == [
        ("DELETE", json.dumps({"id": internal_id}).encode(), f"Bearer {CANARY_SECRET}")
    ]


async def test_generic_template_names_a_client_id_safely_in_url_and_body(
    upstream_app: UpstreamAppFactory, tether: TetherFactory
) -> None:
    """In `preserve` mode the generic template carries the client's own ID: URL-quoted in the
    URL, JSON-escaped in the body, so that an ID with `"` or `/` names only its request."""
    _, engine_url, calls = await _engine_with_cancel_route(
        upstream_app, "POST", "/v1/requests/{id}/cancel"
    )
    server = await tether(
        engine_url,
        engine="generic",
        request_id_mode="preserve",
        abort_url="/v1/requests/{internal_request_id}/cancel",
        abort_body='{{"id": "{internal_request_id}", "all": false}}',
    )
    client_id = 'a/b","all":true,"x":"'
    await leave_mid_stream(server, headers={"X-Request-Id": client_id})
    await drained(server)
    # One path segment (a `/` left unquoted would miss the route) and one JSON string.
    assert [(call.match_info["id"], json.loads(call.body)) for call in calls] == [
        (client_id, {"id": client_id, "all": False})
    ]


async def test_abort_never_sends_an_empty_list(
    fake_engine: FakeEngineFactory, tether: TetherFactory
) -> None:
    """vLLM's dev route aborts *everything* on an empty list: every call names one request."""
    engine, engine_url = await fake_engine(token_interval=0.01)
    server = await tether(engine_url)
    for _ in range(3):
        await _leave_mid_stream(server, engine)
    await drained(server)
    assert engine.aborts and all(len(abort.ids) >= 1 for abort in engine.aborts)
