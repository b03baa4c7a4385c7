"""The admin port: probes that tell the truth, metrics that move, the in-flight list and
abort by ID behind a token."""

from __future__ import annotations

import asyncio
import json
import socket
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from tether_fake_engine import GenerationState

from .support.canaries import CANARY_SECRET
from .support.chat import chat_body
from .support.in_process import TetherFactory, admin_url, drained, leave_mid_stream, url
from .support.metrics import metric, metric_in_text
from .support.processes import TetherProcessFactory
from .support.raw_http import RawClient, request_with_header_bytes
from .support.upstreams import FakeEngineFactory, UpstreamAppFactory
from .support.waiting import poll_until

ADMIN = {"Authorization": f"Bearer {CANARY_SECRET}"}


async def _poll_status(http: aiohttp.ClientSession, target: str, status: int) -> Any:
    """Poll a probe until it answers `status` (probes are polled, like kubelet does); return
    its JSON body."""

    async def answered() -> dict[str, Any] | None:
        async with http.get(target) as response:
            if response.status == status:
                return {"body": await response.json()}
            return None

    return (await poll_until(answered, 5, interval=0.02, what=f"{target} to be {status}"))["body"]


async def test_healthz_answers_while_the_process_serves(
    fake_engine: FakeEngineFactory, tether: TetherFactory, http: aiohttp.ClientSession
) -> None:
    """Liveness does not depend on the engine."""
    server = await tether("http://127.0.0.1:9")
    async with http.get(admin_url(server, "/healthz")) as response:
        assert response.status == 200


@pytest.mark.parametrize(
    ("admin_host", "reachable_elsewhere"),
    [pytest.param("", False, id="unset"), pytest.param("0.0.0.0", True, id="all-addresses")],
)
async def test_the_admin_port_listens_on_loopback_unless_told(
    fake_engine: FakeEngineFactory,
    tether_process: TetherProcessFactory,
    admin_host: str,
    reachable_elsewhere: bool,
) -> None:
    """Without TETHER_ADMIN_HOST (empty counts as unset) the admin port takes connections on
    127.0.0.1 only: another address of this machine (127.0.0.2, also loopback) is refused, as
    any address but loopback would be. With 0.0.0.0, as the image sets, it takes them there."""
    _, engine_url = await fake_engine()
    process = await tether_process(engine_url, TETHER_ADMIN_HOST=admin_host)

    try:
        _, writer = await asyncio.wait_for(
            asyncio.open_connection("127.0.0.2", process.admin_port), 5
        )
    except ConnectionRefusedError:
        reachable = False
    else:
        writer.close()
        reachable = True

    assert reachable is reachable_elsewhere


async def test_readyz_follows_the_engine_health(
    fake_engine: FakeEngineFactory, tether: TetherFactory, http: aiohttp.ClientSession
) -> None:
    """Ready while the engine's /health passes, 503 with a reason while it fails, and back."""
    engine, engine_url = await fake_engine()
    server = await tether(engine_url)
    await _poll_status(http, admin_url(server, "/readyz"), 200)

    engine.healthy = False
    body = await _poll_status(http, admin_url(server, "/readyz"), 503)
    assert "503" in body["reason"]

    engine.healthy = True
    await _poll_status(http, admin_url(server, "/readyz"), 200)


async def test_readyz_is_503_when_the_engine_is_unreachable(
    tether: TetherFactory, http: aiohttp.ClientSession
) -> None:
    """No engine at all: not ready, and the reason says why."""
    server = await tether("http://127.0.0.1:9")
    body = await _poll_status(http, admin_url(server, "/readyz"), 503)
    assert "failed" in body["reason"]


async def test_metrics_count_disconnects_and_aborts(
    fake_engine: FakeEngineFactory, tether: TetherFactory, http: aiohttp.ClientSession
) -> None:
    """After a disconnect, /metrics shows it by phase, the abort by result, its latency, the
    engine's stop time and the tokens relayed."""
    engine, engine_url = await fake_engine(token_interval=0.01)
    server = await tether(engine_url)
    async with http.post(url(server), json=chat_body(max_tokens=3)) as response:
        await response.read()
    await leave_mid_stream(server)
    await engine.wait_for(lambda: engine.aborted_ids() != set())
    await drained(server)

    async with http.get(admin_url(server, "/metrics")) as response:
        assert response.headers["Content-Type"].startswith("text/plain")
        text = await response.text()
    route = "/v1/chat/completions"
    assert metric_in_text(text, "tether_requests_total", route=route, status_class="2xx") == 1
    assert metric_in_text(text, "tether_requests_total", route=route, status_class="4xx") == 1
    assert metric_in_text(text, "tether_client_disconnects_total", phase="streaming") == 1
    assert metric_in_text(text, "tether_aborts_total", engine="vllm", result="confirmed") == 1
    assert metric_in_text(text, "tether_abort_latency_seconds_count") == 1
    assert metric_in_text(text, "tether_engine_stop_seconds_count") == 1
    # The completed request's 3 tokens, and at least the one the leaving client read.
    assert metric_in_text(text, "tether_tokens_relayed_total", route=route) >= 3 + 1
    assert metric_in_text(text, "tether_requests_in_flight") == 0
    assert metric_in_text(text, "tether_request_outcomes_total", outcome="client_disconnected") == 1
    assert metric_in_text(text, "tether_sse_events_total") >= 6
    assert metric_in_text(text, "tether_response_bytes_total") > 0
    assert metric_in_text(text, "tether_time_to_first_byte_seconds_count", route=route) == 2


async def test_metric_labels_stay_bounded(
    fake_engine: FakeEngineFactory, tether: TetherFactory, http: aiohttp.ClientSession
) -> None:
    """Unknown paths are counted as route="other", never by their raw path."""
    _engine, engine_url = await fake_engine()
    server = await tether(engine_url)
    for index in range(5):
        async with http.get(url(server, f"/random/{index}")) as response:
            await response.read()
    async with http.get(admin_url(server, "/metrics")) as response:
        text = await response.text()
    assert "/random/" not in text
    assert 'tether_requests_total{route="other",status_class="4xx"} 5.0' in text


async def test_in_flight_requests_are_listed(
    fake_engine: FakeEngineFactory, tether: TetherFactory, http: aiohttp.ClientSession
) -> None:
    """/admin/requests shows both IDs, method, path, phase, age and bytes of each request."""
    engine, engine_url = await fake_engine(token_interval=0.01)
    server = await tether(engine_url, admin_token=CANARY_SECRET)
    stream = await http.post(
        url(server), json=chat_body(max_tokens=10_000), headers={"X-Request-Id": "listed"}
    )
    await stream.content.readuntil(b"tok0")

    async with http.get(
        admin_url(server, "/admin/requests"), headers={"Authorization": f"Bearer {CANARY_SECRET}"}
    ) as response:
        [listed] = (await response.json())["requests"]
    stream.close()
    [internal_id] = engine.generations
    assert listed["client_request_id"] == "listed"
    assert listed["internal_request_id"] == internal_id
    assert (listed["method"], listed["path"], listed["phase"]) == (
        "POST",
        "/v1/chat/completions",
        "streaming",
    )
    assert listed["age_seconds"] >= 0 and listed["bytes_out"] > 0


@pytest.mark.parametrize("token", [None, CANARY_SECRET], ids=["no-token-set", "token-set"])
@pytest.mark.parametrize("sent", [None, "Bearer wrong"], ids=["none-sent", "wrong-sent"])
async def test_in_flight_list_names_no_request_without_the_token(
    fake_engine: FakeEngineFactory,
    tether: TetherFactory,
    http: aiohttp.ClientSession,
    token: str | None,
    sent: str | None,
) -> None:
    """Internal IDs are engine handles (`resp_<id>` fetches a response): /admin/requests
    answers 403 (no token configured) or 401 (none or a wrong one sent) and names none of
    them, while the probes and /metrics stay open."""
    engine, engine_url = await fake_engine(token_interval=0.01)
    server = await tether(engine_url, admin_token=token)
    stream = await http.post(
        url(server), json=chat_body(max_tokens=10_000), headers={"X-Request-Id": "secret-job"}
    )
    await stream.content.readuntil(b"tok0")
    [internal_id] = engine.generations
    headers = {"Authorization": sent} if sent is not None else {}

    async with http.get(admin_url(server, "/admin/requests"), headers=headers) as response:
        body = await response.text()
        status = response.status
    for probe in ("/healthz", "/readyz", "/metrics"):
        async with http.get(admin_url(server, probe)) as open_response:
            assert open_response.status == 200, probe
    stream.close()

    assert status == (403 if token is None else 401)
    assert internal_id not in body and "secret-job" not in body
    assert "TETHER_ADMIN_TOKEN" in json.loads(body)["error"]["message"]


async def test_admin_abort_is_refused_without_a_configured_token(
    fake_engine: FakeEngineFactory, tether: TetherFactory, http: aiohttp.ClientSession
) -> None:
    """With no TETHER_ADMIN_TOKEN, mutations answer 403 saying how to enable them."""
    server = await tether("http://127.0.0.1:9")
    async with http.post(admin_url(server, "/admin/abort"), json={"request_id": "x"}) as r:
        assert r.status == 403
        assert "TETHER_ADMIN_TOKEN" in (await r.json())["error"]["message"]


async def test_admin_abort_needs_the_right_token(
    fake_engine: FakeEngineFactory, tether: TetherFactory, http: aiohttp.ClientSession
) -> None:
    """A missing or wrong bearer token gets 401."""
    server = await tether("http://127.0.0.1:9", admin_token=CANARY_SECRET)
    for headers in (
        {},
        {"Authorization": f"Bearer {CANARY_SECRET}-wrong"},
        {"Authorization": CANARY_SECRET},  # no "Bearer"
    ):
        async with http.post(
            admin_url(server, "/admin/abort"), json={"request_id": "x"}, headers=headers
        ) as response:
            assert response.status == 401


# Bytes that are not UTF-8 (which no client library sends): alone, and after the right token.
UNREADABLE_TOKENS = [
    pytest.param(b"Bearer \xff\xfe", id="not-utf8"),
    pytest.param(b"Bearer " + CANARY_SECRET.encode() + b"\xe9", id="right-token-then-latin1"),
]


@pytest.mark.parametrize("route", ["GET /admin/requests", "POST /admin/abort"])
@pytest.mark.parametrize("authorization", UNREADABLE_TOKENS)
async def test_a_token_that_is_not_utf8_gets_401(
    tether: TetherFactory, route: str, authorization: bytes
) -> None:
    """An `Authorization` header that is not UTF-8 is a wrong token: 401 with the JSON
    error, never a 500."""
    server = await tether("http://127.0.0.1:9", admin_token=CANARY_SECRET)
    client = await RawClient.connect(server.admin_port)
    method, _, path = route.partition(" ")
    body = b'{"request_id": "x"}' if method == "POST" else b""
    await client.send(request_with_header_bytes(path, "Authorization", authorization, method, body))

    reply = await client.read_reply()

    assert reply.status == 401
    assert reply.json()["error"]["code"] == "invalid_admin_token"


async def test_admin_abort_by_client_id_aborts_every_match(
    fake_engine: FakeEngineFactory, tether: TetherFactory, http: aiohttp.ClientSession
) -> None:
    """Every in-flight request with that client ID is cut and aborted upstream, exactly as on
    a disconnect; the answer lists the internal IDs."""
    engine, engine_url = await fake_engine(token_interval=0.01)
    server = await tether(engine_url, admin_token=CANARY_SECRET)
    streams = [
        await http.post(
            url(server), json=chat_body(max_tokens=10_000), headers={"X-Request-Id": "runaway"}
        )
        for _ in range(2)
    ]
    for stream in streams:
        await stream.content.readuntil(b"tok0")

    async with http.post(
        admin_url(server, "/admin/abort"),
        json={"request_id": "runaway"},
        headers=ADMIN,
    ) as response:
        assert response.status == 200
        aborted = (await response.json())["aborted"]

    assert sorted(aborted) == sorted(engine.generations)
    for stream in streams:
        with pytest.raises(aiohttp.ClientPayloadError):  # cut, not ended
            await stream.read()
    await engine.wait_for(lambda: engine.aborted_ids() == set(aborted))
    await drained(server)
    registry = server.context.metrics.registry
    assert metric(registry, "tether_request_outcomes_total", outcome="admin_aborted") == 2
    assert metric(registry, "tether_client_disconnects_total", phase="streaming") == 0


async def test_admin_abort_by_internal_id(
    fake_engine: FakeEngineFactory, tether: TetherFactory, http: aiohttp.ClientSession
) -> None:
    """The internal ID from the logs works as well."""
    engine, engine_url = await fake_engine(token_interval=0.01)
    server = await tether(engine_url, admin_token=CANARY_SECRET)
    stream = await http.post(url(server), json=chat_body(max_tokens=10_000))
    await stream.content.readuntil(b"tok0")
    [internal_id] = engine.generations

    async with http.post(
        admin_url(server, "/admin/abort"),
        json={"request_id": internal_id},
        headers=ADMIN,
    ) as response:
        assert (await response.json())["aborted"] == [internal_id]
    await engine.wait_for(lambda: engine.generation(internal_id).state is GenerationState.ABORTED)
    stream.close()


async def test_admin_abort_of_an_unknown_id_aborts_nothing(
    tether: TetherFactory, http: aiohttp.ClientSession
) -> None:
    """An ID with nothing in flight is answered with an empty list."""
    server = await tether("http://127.0.0.1:9", admin_token=CANARY_SECRET)
    async with http.post(
        admin_url(server, "/admin/abort"),
        json={"request_id": "nope"},
        headers=ADMIN,
    ) as response:
        answer = await response.json()
    assert (answer["request_id"], answer["scope"], answer["aborted"]) == ("nope", "local", [])
    assert answer["replica"] == socket.gethostname() and len(answer["instance"]) == 16
    async with http.post(admin_url(server, "/admin/abort"), data=b"{", headers=ADMIN) as response:
        assert response.status == 400


async def test_admin_api_is_not_on_the_client_port(
    fake_engine: FakeEngineFactory, tether: TetherFactory, http: aiohttp.ClientSession
) -> None:
    """The client port forwards everything to the engine; tether's own endpoints are not there."""
    _engine, engine_url = await fake_engine()
    server = await tether(engine_url, admin_token=CANARY_SECRET)
    async with http.post(
        url(server, "/admin/abort"), json={"request_id": "x"}, headers=ADMIN
    ) as response:
        assert response.status == 404  # the engine's answer


async def test_admin_abort_before_the_first_byte_answers_503(
    fake_engine: FakeEngineFactory, tether: TetherFactory, http: aiohttp.ClientSession
) -> None:
    """A request still in prefill when an operator aborts it gets a 503 JSON error saying so,
    and the engine is aborted."""
    engine, engine_url = await fake_engine()
    server = await tether(engine_url, admin_token=CANARY_SECRET)
    pending = asyncio.ensure_future(
        http.post(
            url(server),
            json=chat_body(stream=False, prefill=30),
            headers={"X-Request-Id": "queued"},
        )
    )
    await engine.wait_for(lambda: len(engine.generations) == 1)

    async with http.post(
        admin_url(server, "/admin/abort"),
        json={"request_id": "queued"},
        headers=ADMIN,
    ) as response:
        assert len((await response.json())["aborted"]) == 1

    async with await pending as answer:
        assert answer.status == 503
        assert (await answer.json())["error"]["code"] == "aborted_by_operator"
        assert answer.headers["X-Request-Id"] == "queued"
    [internal_id] = engine.generations
    await engine.wait_for(lambda: engine.generation(internal_id).state is GenerationState.ABORTED)


async def test_one_failed_health_check_does_not_withdraw_readiness(
    upstream_app: UpstreamAppFactory, tether: TetherFactory, http: aiohttp.ClientSession
) -> None:
    """A busy engine missing one check stays ready; two failures in a row withdraw it."""
    answers = iter([200, 503, 200, 503, 503] + [503] * 1000)
    seen = asyncio.Event()
    statuses: list[int] = []

    async def health(request: web.Request) -> web.Response:
        statuses.append(next(answers))
        if len(statuses) == 3:
            seen.set()
        return web.Response(status=statuses[-1])

    app = web.Application()
    app.router.add_get("/health", health)
    server = await tether(await upstream_app(app), health_interval=0.05)
    await asyncio.wait_for(seen.wait(), 5)
    assert server.context.readiness.problem is None  # 200, 503, 200: still ready
    body = await _poll_status(http, admin_url(server, "/readyz"), 503)
    assert statuses[:5] == [200, 503, 200, 503, 503]
    assert "503" in body["reason"]
