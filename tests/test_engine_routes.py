"""The route table: on each engine route tether's ID goes where that route reads it (a client's
own never survives there), and a request tether cannot name at the engine is stopped by the
dropped connection, never by a guessed abort."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from multidict import CIMultiDict

from proxy.engines import Engine, engine_profile, route_table
from proxy.wire.tokens import TokenShape

from .support.canaries import CANARY_PROMPT
from .support.in_process import TetherFactory, drained, settled, url
from .support.metrics import metric
from .support.raw_http import RawClient
from .support.settings import make_settings
from .support.upstreams import UpstreamAppFactory


class Recorder:
    """An upstream that records every request's body and headers and answers `{}`; with
    `stream=True` it streams until the client's connection drops."""

    def __init__(self) -> None:
        self.bodies: list[dict[str, Any]] = []
        self.headers: list[CIMultiDict[str]] = []
        self.dropped = asyncio.Event()

    async def handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.json() if request.can_read_body else {}
        self.bodies.append(body)
        self.headers.append(CIMultiDict(request.headers))
        if not body.get("stream"):
            return web.json_response({})
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        try:
            while True:
                await response.write(b'data: {"choices":[{"delta":{"content":"tok"}}]}\n\n')
                await asyncio.sleep(0.01)
        except (asyncio.CancelledError, ConnectionError):
            self.dropped.set()
            raise

    def app(self, *paths: str) -> web.Application:
        app = web.Application()
        for path in paths:
            app.router.add_post(path, self.handle)
        app.router.add_get("/health", self.healthy)
        return app

    async def healthy(self, request: web.Request) -> web.Response:
        return web.Response()


async def send(server: Any, http: aiohttp.ClientSession, path: str, body: dict[str, Any]) -> None:
    async with http.post(url(server, path), json=body) as response:
        assert response.status == 200
        await response.read()


@pytest.mark.parametrize(
    ("path", "body", "field", "value_prefix"),
    [
        ("/v1/chat/completions", {"rid": "short"}, ("rid",), ""),
        ("/invocations", {"rid": "short"}, ("rid",), ""),
        ("/v1/responses", {"request_id": "short"}, ("request_id",), "resp_"),
        ("/vertex_generate", {"parameters": {"rid": ["short"]}}, ("parameters", "rid"), ""),
        ("/vertex_generate", {"instances": []}, ("parameters", "rid"), ""),
    ],
)
async def test_sglang_routes_carry_tethers_rid_where_each_reads_it(
    upstream_app: UpstreamAppFactory,
    tether: TetherFactory,
    http: aiohttp.ClientSession,
    path: str,
    body: dict[str, Any],
    field: tuple[str, ...],
    value_prefix: str,
) -> None:
    """SGLang takes the rid from `rid`, from the Responses API's `request_id` and from
    /vertex_generate's `parameters.rid`: tether owns each, so a client's short rid can never
    be a prefix of other requests' rids (SGLang aborts by prefix)."""
    recorder = Recorder()
    server = await tether(await upstream_app(recorder.app(path)), engine="sglang")
    await send(server, http, path, {**body, "prompt": CANARY_PROMPT})
    [seen] = recorder.bodies
    value: Any = seen
    for key in field:
        value = value[key]
    assert value.startswith(value_prefix) and len(value) == len(value_prefix) + 32
    assert value != "short"


async def test_sglang_parallel_samples_are_stopped_by_the_dropped_connection(
    upstream_app: UpstreamAppFactory, tether: TetherFactory
) -> None:
    """With n > 1 SGLang runs each sample under a random rid of its own: tether sends no
    abort that could only match nothing, drops the connection at once and counts
    `unknown_route`."""
    recorder = Recorder()
    aborts: list[bytes] = []

    async def abort(request: web.Request) -> web.Response:
        aborts.append(await request.read())
        return web.Response()

    app = recorder.app("/v1/chat/completions")
    app.router.add_post("/abort_request", abort)
    server = await tether(await upstream_app(app), engine="sglang")
    client = await RawClient.connect(server.port)
    await client.send_request({"messages": [], "stream": True, "n": 2})
    await client.read_until(b"tok")
    client.close_fin()
    await asyncio.wait_for(recorder.dropped.wait(), 5)
    await settled(server)
    await drained(server)
    assert aborts == []
    registry = server.context.metrics.registry
    assert metric(registry, "tether_aborts_total", engine="sglang", result="unknown_route") == 1


async def test_sglang_header_mode_leaves_bodies_alone_where_the_header_is_read(
    upstream_app: UpstreamAppFactory, tether: TetherFactory, http: aiohttp.ClientSession
) -> None:
    """TETHER_SGLANG_RID_HEADER: on chat and /generate, where SGLang reads X-Override-Rid,
    the body goes untouched; /v1/completions, where it does not, still gets the body rid."""
    recorder = Recorder()
    app = recorder.app("/v1/chat/completions", "/v1/completions")
    server = await tether(await upstream_app(app), engine="sglang", sglang_rid_header=True)
    await send(server, http, "/v1/chat/completions", {"messages": [], "rid": "mine"})
    await send(server, http, "/v1/completions", {"prompt": "x", "rid": "mine"})
    chat, completion = recorder.bodies
    assert chat == {"messages": [], "rid": "mine"}  # as the client sent it
    rid = recorder.headers[0]["X-Override-Rid"]
    assert len(rid) == 32
    assert completion["rid"] != "mine" and len(completion["rid"]) == 32


async def test_vllm_anthropic_messages_bodies_are_not_rewritten(
    upstream_app: UpstreamAppFactory, tether: TetherFactory, http: aiohttp.ClientSession
) -> None:
    """vLLM's /v1/messages reads the ID from X-Request-Id only: its body passes byte for byte
    (no JSON rewrite to pay for)."""
    recorder = Recorder()
    server = await tether(await upstream_app(recorder.app("/v1/messages")))
    body = {"model": "x", "messages": [{"role": "user", "content": CANARY_PROMPT}]}
    await send(server, http, "/v1/messages", body)
    assert recorder.bodies == [body]
    assert len(recorder.headers[0]["X-Request-Id"]) == 32


@pytest.mark.socket_free
def test_every_named_engine_id_contains_tethers_id() -> None:
    """The table's engine IDs are built from tether's ID (never the client's), and the
    routes that carry tokens say how."""
    for engine in (Engine.VLLM, Engine.SGLANG):
        for route in route_table(engine):
            ids = route.engine_request_ids("i" * 32, batch=2)
            assert all("i" * 32 in engine_id for engine_id in ids)
            if ids:
                assert route.tokens is not TokenShape.NONE or route.path == "/vertex_generate"


@pytest.mark.socket_free
def test_read_only_requests_outside_the_table_have_nothing_to_abort() -> None:
    """A GET the table does not know (models, metrics, health) is no work to stop; any other
    method is, and is counted `unknown_route`."""
    profile = engine_profile(make_settings(engine="vllm"))
    assert profile.route("GET", "/v1/models") is None
    unknown = profile.route("POST", "/v1/brand-new")
    assert unknown is not None and unknown.engine_request_ids("x" * 32) == ()
