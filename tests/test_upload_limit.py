"""TETHER_MAX_STREAMED_UPLOADS: a request whose body streams through holds an engine
connection while its client sends the body, and a WebSocket handshake holds one until the
engine answers it. How many may do so at once is bounded: past the bound a request gets 503
`too_many_uploads` with `Retry-After` and never reaches the engine, so slow clients cannot
take every connection the engine accepts (nginx buffers a body first and holds none)."""

from __future__ import annotations

import asyncio
import base64
import os
from dataclasses import dataclass, field

from aiohttp import web

from .support.chat import chat_body
from .support.in_process import TetherFactory, settled
from .support.metrics import metric
from .support.raw_http import RawClient, Reply, request_head
from .support.upstreams import UpstreamAppFactory
from .support.waiting import poll_until

LIMIT = 3
UPLOAD = "/v1/audio/transcriptions"
UPLOAD_SIZE = 1000


@dataclass
class UploadEngine:
    """An engine that reads uploads as they arrive and counts them, and holds each WebSocket
    handshake until the test lets it answer (a refusal: any answer ends the wait)."""

    app: web.Application = field(default_factory=web.Application)
    uploads_begun: int = 0
    uploading: int = 0
    handshakes_begun: int = 0
    answer_handshakes: asyncio.Event = field(default_factory=asyncio.Event)

    def __post_init__(self) -> None:
        self.app.router.add_get("/health", self._health)
        self.app.router.add_post(UPLOAD, self._upload)
        self.app.router.add_post("/v1/chat/completions", self._chat)
        self.app.router.add_get("/v1/realtime", self._handshake)

    async def _health(self, request: web.Request) -> web.Response:
        return web.json_response({})

    async def _upload(self, request: web.Request) -> web.Response:
        self.uploads_begun += 1
        self.uploading += 1
        try:
            body = await request.read()
        finally:
            self.uploading -= 1
        return web.json_response({"text": f"{len(body)} bytes"})

    async def _chat(self, request: web.Request) -> web.Response:
        await request.read()
        return web.json_response({"id": "chatcmpl-1", "choices": []})

    async def _handshake(self, request: web.Request) -> web.Response:
        self.handshakes_begun += 1
        await self.answer_handshakes.wait()
        return web.json_response({"detail": "no realtime model"}, status=403)


def upload_head() -> bytes:
    return request_head(
        UPLOAD, headers=[("Content-Type", "audio/wav"), ("Content-Length", str(UPLOAD_SIZE))]
    )


async def slow_upload(port: int) -> RawClient:
    """An upload whose client sent its head and half its body, and waits."""
    client = await RawClient.connect(port)
    await client.send(upload_head() + b"R" * (UPLOAD_SIZE // 2))
    return client


async def finish_upload(client: RawClient) -> Reply:
    await client.send(b"R" * (UPLOAD_SIZE - UPLOAD_SIZE // 2))
    return await client.read_reply()


def handshake() -> bytes:
    key = base64.b64encode(os.urandom(16)).decode()
    return request_head(
        "/v1/realtime",
        method="GET",
        headers=[
            ("Upgrade", "websocket"),
            ("Connection", "Upgrade"),
            ("Sec-WebSocket-Key", key),
            ("Sec-WebSocket-Version", "13"),
        ],
    )


def assert_refused(reply: Reply) -> None:
    assert reply.status == 503
    assert reply.headers["Retry-After"] == "1"
    assert reply.json()["error"]["code"] == "too_many_uploads"


async def test_uploads_past_the_limit_are_refused_and_never_reach_the_engine(
    upstream_app: UpstreamAppFactory, tether: TetherFactory
) -> None:
    """Three uploads trickling their bodies hold three engine connections; a fourth gets
    503 with Retry-After, never reaches the engine and is counted as rejected; once one of
    the three has finished, the next upload passes."""
    engine = UploadEngine()
    server = await tether(await upstream_app(engine.app), max_streamed_uploads=LIMIT)
    registry = server.context.metrics.registry
    uploaders = [await slow_upload(server.port) for _ in range(LIMIT)]
    await poll_until(lambda: engine.uploading == LIMIT, 5, what="three uploads at the engine")

    refused = await slow_upload(server.port)
    reply = await refused.read_reply()

    assert_refused(reply)
    assert (engine.uploads_begun, engine.uploading) == (LIMIT, LIMIT)
    assert metric(registry, "tether_streamed_uploads") == LIMIT
    assert metric(registry, "tether_request_outcomes_total", outcome="rejected") == 1
    refused.close_fin()

    assert (await finish_upload(uploaders[0])).status == 200
    late = await slow_upload(server.port)
    await poll_until(lambda: engine.uploads_begun == LIMIT + 1, 5, what="the next upload")
    assert (await finish_upload(late)).status == 200
    for uploader in uploaders[1:]:
        assert (await finish_upload(uploader)).status == 200
    await settled(server)
    assert metric(registry, "tether_streamed_uploads") == 0


async def test_requests_whose_body_arrived_whole_pass_while_the_limit_is_reached(
    upstream_app: UpstreamAppFactory, tether: TetherFactory
) -> None:
    """While slow uploads hold every place, an upload sent whole and a JSON request (read
    whole by tether) hold no engine connection waiting for their client: both are served."""
    engine = UploadEngine()
    server = await tether(await upstream_app(engine.app), max_streamed_uploads=LIMIT)
    uploaders = [await slow_upload(server.port) for _ in range(LIMIT)]
    await poll_until(lambda: engine.uploading == LIMIT, 5, what="three uploads at the engine")

    whole = await RawClient.connect(server.port)
    await whole.send(upload_head() + b"R" * UPLOAD_SIZE)
    chat = await RawClient.connect(server.port)
    await chat.send_request(chat_body())

    assert (await whole.read_reply()).status == 200
    assert (await chat.read_reply()).status == 200
    for uploader in uploaders:
        assert (await finish_upload(uploader)).status == 200
    await settled(server)


async def test_handshakes_waiting_for_the_engine_count_against_the_limit(
    upstream_app: UpstreamAppFactory, tether: TetherFactory
) -> None:
    """A WebSocket handshake holds its engine connection until the engine answers: with as
    many waiting as the limit, the next handshake gets 503 and never reaches the engine;
    once the engine has answered them, handshakes pass again."""
    engine = UploadEngine()
    server = await tether(await upstream_app(engine.app), max_streamed_uploads=LIMIT)
    waiting = []
    for _ in range(LIMIT):
        client = await RawClient.connect(server.port)
        await client.send(handshake())
        waiting.append(client)
    await poll_until(lambda: engine.handshakes_begun == LIMIT, 5, what="three handshakes")

    refused = await RawClient.connect(server.port)
    await refused.send(handshake())
    assert_refused(await refused.read_reply())
    assert engine.handshakes_begun == LIMIT

    engine.answer_handshakes.set()
    for client in waiting:
        assert (await client.read_reply()).status == 403
    another = await RawClient.connect(server.port)
    await another.send(handshake())
    assert (await another.read_reply()).status == 403
    assert engine.handshakes_begun == LIMIT + 1
    await settled(server)
    assert metric(server.context.metrics.registry, "tether_streamed_uploads") == 0
