"""Responses reach the client as the engine sends them: byte for byte apart from IDs, with no
added buffering, exact lengths, untouched compressed bodies, and cut (never clean) ends when
the engine breaks."""

from __future__ import annotations

import asyncio
import gzip
import json

import aiohttp
import pytest
from aiohttp import web
from yarl import URL

from .support.chat import chat_body, sse_ids
from .support.in_process import TetherFactory, settled, url
from .support.metrics import metric
from .support.raw_http import RawClient, parse_reply
from .support.upstreams import FakeEngineFactory, UpstreamAppFactory


def _events(internal_id: str, usage: bool) -> list[bytes]:
    """A stream as engines write it; the usage event only where the body asked for it."""
    events = [
        b'data: {"id":"chatcmpl-'
        + internal_id.encode()
        + b'","choices":[{"delta":{"content":"a"}}]}\n\n',
        b": keep-alive comment\n\n",
        b'data: {"id":"chatcmpl-' + internal_id.encode() + b'","choices":[],"usage":{"x":1}}\n\n',
        b"data: [DONE]\n\n",
    ]
    return events if usage else events[:2] + events[3:]


@pytest.mark.parametrize("client_asks_usage", [False, True], ids=["usage-unasked", "usage-asked"])
async def test_sse_passes_byte_for_byte_apart_from_ids(
    upstream_app: UpstreamAppFactory,
    tether: TetherFactory,
    http: aiohttp.ClientSession,
    client_asks_usage: bool,
) -> None:
    """Every byte of an SSE stream arrives as the client would have had it from the engine,
    except the internal ID, which becomes the client's own in every event: a usage event the
    client asked for comes through; the one tether asked for (where the client did not) is
    taken out."""
    sent: list[bytes] = []
    asked: list[bool] = []

    async def stream(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        usage = bool((body.get("stream_options") or {}).get("include_usage"))
        asked.append(usage)
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for event in _events(request.headers["X-Request-Id"], usage):
            sent.append(event)
            await response.write(event)
        return response

    app = web.Application()
    app.router.add_post("/v1/chat/completions", stream)
    server = await tether(await upstream_app(app), engine="vllm")
    body = chat_body()
    if client_asks_usage:
        body["stream_options"] = {"include_usage": True}

    async with http.post(url(server), json=body, headers={"X-Request-Id": "client-7"}) as r:
        received = await r.read()

    expected = b"".join(_events("client-7", usage=client_asks_usage))
    assert received == expected
    assert asked == [True]  # tether asked where the client did not
    assert b"".join(sent) != expected  # the engine really saw another ID


async def test_each_event_reaches_the_client_before_the_next_is_produced(
    upstream_app: UpstreamAppFactory, tether: TetherFactory
) -> None:
    """No buffering: the engine sends event 2 only once the client has seen event 1."""
    client_saw_first = asyncio.Event()

    async def stream(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write(b'data: {"n":1}\n\n')
        await asyncio.wait_for(client_saw_first.wait(), 5)
        await response.write(b'data: {"n":2}\n\n')
        return response

    app = web.Application()
    app.router.add_post("/v1/chat/completions", stream)
    server = await tether(await upstream_app(app))
    client = await RawClient.connect(server.port)
    await client.send_request(chat_body())

    first = await client.read_until(b'{"n":1}\n\n')  # the engine holds event 2 back till then
    client_saw_first.set()
    rest = await client.read_until(b"\r\n0\r\n\r\n")  # up to the terminating chunk

    reply = await parse_reply(first + rest)
    assert reply.status == 200
    assert reply.body == b'data: {"n":1}\n\ndata: {"n":2}\n\n'  # both whole, then a clean end
    client.close_fin()


async def test_id_split_across_chunks_is_still_mapped_back(
    upstream_app: UpstreamAppFactory, tether: TetherFactory, http: aiohttp.ClientSession
) -> None:
    """An internal ID cut in two by the network is replaced all the same, wherever the cut."""
    event_start, event_end = b'data: {"id":"chatcmpl-', b'"}\n\n'
    cuts = (0, 1, 16, 31)  # bytes of the 32-character ID in tether's first read
    client_saw_start = [asyncio.Event() for _ in cuts]

    async def stream(request: web.Request) -> web.StreamResponse:
        internal = request.headers["X-Request-Id"].encode()
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for cut, seen in zip(cuts, client_saw_start, strict=True):
            # One write is one read for tether (one send on loopback; it reads what arrived).
            await response.write(event_start + internal[:cut])
            # The client saw the event's start: tether has read the first part of the ID (and
            # holds it back). Only now is the rest written, so the ID reaches tether split.
            await asyncio.wait_for(seen.wait(), 5)
            await response.write(internal[cut:] + event_end)
        event = event_start + internal + event_end
        await response.write(event[:5])  # and one event cut outside the ID, in "data:"
        await asyncio.sleep(0.01)
        await response.write(event[5:])
        return response

    app = web.Application()
    app.router.add_post("/v1/chat/completions", stream)
    server = await tether(await upstream_app(app))
    async with http.post(url(server), json=chat_body(), headers={"X-Request-Id": "split"}) as r:
        received = b""
        for seen in client_saw_start:
            received += await r.content.readuntil(event_start)
            seen.set()
        received += await r.content.read()
    assert sse_ids(received.decode()) == ["chatcmpl-split"] * (len(cuts) + 1)


async def test_json_response_keeps_an_exact_content_length(
    fake_engine: FakeEngineFactory, tether: TetherFactory, http: aiohttp.ClientSession
) -> None:
    """A non-streaming JSON answer carries the client's ID and a Content-Length that matches."""
    _, engine_url = await fake_engine(max_tokens=3)
    server = await tether(engine_url)
    async with http.post(
        url(server), json=chat_body(stream=False), headers={"X-Request-Id": "a-much-longer-id"}
    ) as response:
        body = await response.read()
        assert int(response.headers["Content-Length"]) == len(body)
        assert response.headers["X-Request-Id"] == "a-much-longer-id"
    assert json.loads(body)["id"] == "chatcmpl-a-much-longer-id"


async def test_other_bodies_pass_untouched_with_their_length(
    upstream_app: UpstreamAppFactory, tether: TetherFactory, http: aiohttp.ClientSession
) -> None:
    """Bodies that are neither JSON nor SSE are not rewritten, even if they hold the ID."""

    async def plain(request: web.Request) -> web.Response:
        return web.Response(text=f"id={request.headers['X-Request-Id']}")

    app = web.Application()
    app.router.add_get("/plain", plain)
    server = await tether(await upstream_app(app))
    async with http.get(url(server, "/plain")) as response:
        body = await response.text()
        assert response.headers["Content-Length"] == str(len(body))
    internal = body.removeprefix("id=")
    assert len(internal) == 32


async def test_compressed_body_passes_through_untouched(
    upstream_app: UpstreamAppFactory, tether: TetherFactory
) -> None:
    """A gzip body and its Content-Encoding reach the client exactly as the engine sent them."""
    compressed = gzip.compress(b'{"hello": "world"}')

    async def zipped(request: web.Request) -> web.Response:
        return web.Response(
            body=compressed,
            headers={"Content-Encoding": "gzip", "Content-Type": "application/json"},
        )

    app = web.Application()
    app.router.add_get("/zipped", zipped)
    server = await tether(await upstream_app(app))
    timeout = aiohttp.ClientTimeout(total=20)
    async with aiohttp.ClientSession(auto_decompress=False, timeout=timeout) as session:
        async with session.get(url(server, "/zipped")) as response:
            assert response.headers["Content-Encoding"] == "gzip"
            assert await response.read() == compressed


async def test_status_and_error_body_pass_through(
    upstream_app: UpstreamAppFactory, tether: TetherFactory, http: aiohttp.ClientSession
) -> None:
    """An engine's own error answer reaches the client unchanged (but with the client's ID)."""

    async def refuse(request: web.Request) -> web.Response:
        return web.json_response(
            {"error": {"message": "bad", "type": "BadRequestError", "code": 400}}, status=400
        )

    app = web.Application()
    app.router.add_post("/v1/chat/completions", refuse)
    server = await tether(await upstream_app(app))
    async with http.post(url(server), json=chat_body()) as response:
        assert response.status == 400
        assert (await response.json())["error"]["message"] == "bad"


async def test_engine_breaking_mid_stream_cuts_the_client_stream(
    fake_engine: FakeEngineFactory, tether: TetherFactory, http: aiohttp.ClientSession
) -> None:
    """If the engine dies after the response started, the client's stream ends without its
    terminating chunk, so no client mistakes it for a complete answer."""
    _engine, engine_url = await fake_engine(token_interval=0.001, max_tokens=50)
    server = await tether(engine_url)
    async with http.post(url(server), json=chat_body(max_tokens=50, fail_after=3)) as r:
        assert r.status == 200
        with pytest.raises(aiohttp.ClientPayloadError):
            await r.read()
    await settled(server)
    registry = server.context.metrics.registry
    assert metric(registry, "tether_request_outcomes_total", outcome="upstream_failed") == 1


async def test_query_string_and_method_reach_the_engine(
    fake_engine: FakeEngineFactory, tether: TetherFactory, http: aiohttp.ClientSession
) -> None:
    """Any method, path and query string is forwarded as sent."""
    _engine, engine_url = await fake_engine()
    server = await tether(engine_url)
    target = URL(url(server, "/echo/some/path?a=1&b=%2F"), encoded=True)
    async with http.put(target, data=b"payload") as response:
        seen = await response.json()
    assert seen["method"] == "PUT"
    assert seen["path"] == "/echo/some/path?a=1&b=%2F"
    assert seen["body"] == "payload"
