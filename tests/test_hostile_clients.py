"""Hostile or broken clients: slow, oversized, malformed, pipelined, half-closed or too slow
to read. Whatever they send, nothing unchecked reaches the engine, nothing is left running
upstream, and tether's registry and metrics stay consistent."""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import time
import tracemalloc
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import structlog
from aiohttp import web
from multidict import CIMultiDict

from proxy.fake_engine import AbortRoute, FakeEngine, GenerationState, SeenRequest
from proxy.metrics import route_label
from proxy.runner import TetherServer

from .conftest import RawClient, chat_body, sse_ids

# Timeout tests run with short limits so that the file stays fast.
HEADER_TIMEOUT = 0.3
BODY_TIMEOUT = 0.3


# --- helpers: a raw HTTP/1.x reader and the checks every test ends with -----------------------


@dataclass
class Reply:
    """One HTTP response as the client received it."""

    version: str
    status: int
    headers: CIMultiDict[str]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


async def read_reply(reader: asyncio.StreamReader, timeout: float = 5.0) -> Reply:
    """Read one response: framed by Content-Length, chunked encoding or connection close."""
    async with asyncio.timeout(timeout):
        head = await reader.readuntil(b"\r\n\r\n")
        status_line, *lines = head[:-4].decode("latin-1").split("\r\n")
        version, status, *_ = status_line.split(" ", 2)
        headers: CIMultiDict[str] = CIMultiDict()
        for line in lines:
            name, _, value = line.partition(":")
            headers.add(name, value.strip())
        code = int(status)
        if 100 <= code < 200 or code in (204, 304):
            body = b""
        elif headers.get("Transfer-Encoding", "").lower() == "chunked":
            body = await _read_chunked(reader)
        elif "Content-Length" in headers:
            body = await reader.readexactly(int(headers["Content-Length"]))
        else:
            body = await reader.read()  # delimited by the connection's end
    return Reply(version, code, headers, body)


async def _read_chunked(reader: asyncio.StreamReader) -> bytes:
    parts = []
    while True:
        size = int((await reader.readuntil(b"\r\n")).split(b";")[0], 16)
        if size == 0:
            while await reader.readuntil(b"\r\n") != b"\r\n":
                pass  # trailers
            return b"".join(parts)
        parts.append(await reader.readexactly(size))
        await reader.readexactly(2)


async def read_to_end(reader: asyncio.StreamReader, timeout: float = 5.0) -> bytes:
    """Everything the server still sends, until it closes the connection."""
    async with asyncio.timeout(timeout):
        return await reader.read()


async def send_raw(client: RawClient, data: bytes) -> None:
    client.writer.write(data)
    await client.writer.drain()


def head(
    path: str = "/v1/chat/completions",
    *,
    method: str = "POST",
    version: str = "HTTP/1.1",
    headers: list[tuple[str, str]] | None = None,
) -> bytes:
    lines = [f"{method} {path} {version}", "Host: tether", *(f"{n}: {v}" for n, v in headers or [])]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def json_request(
    body: dict[str, Any], request_id: str, path: str = "/v1/chat/completions"
) -> bytes:
    payload = json.dumps(body).encode()
    return (
        head(
            path,
            headers=[
                ("Content-Type", "application/json"),
                ("Content-Length", str(len(payload))),
                ("X-Request-Id", request_id),
            ],
        )
        + payload
    )


def counter(metric: Any, *labels: str) -> float:
    return float(metric.labels(*labels)._value.get())


async def settled(server: TetherServer) -> None:
    """No request left in flight: the registry is empty and the gauge agrees."""
    async with asyncio.timeout(5):
        await server.context.registry.wait_empty()
    assert server.context.metrics.in_flight._value.get() == 0


async def no_task_left(before: set[asyncio.Task[Any]]) -> None:
    """Every task started since `before` (connection handlers) has finished."""
    new = asyncio.all_tasks() - before - {asyncio.current_task()}
    if new:
        _, pending = await asyncio.wait(new, timeout=2)
        assert not pending, f"tasks left behind: {pending}"


def nothing_reached(engine: FakeEngine) -> None:
    assert engine.requests == []
    assert engine.generations == {}


@pytest.fixture
def logged(caplog: pytest.LogCaptureFixture) -> Iterator[Callable[[], str]]:
    """Everything logged so far, tether's events and aiohttp's records, with every value as the
    raw string a console renderer would print (nothing escaped here)."""
    caplog.set_level(logging.DEBUG)
    with structlog.testing.capture_logs() as events:

        def text() -> str:
            lines = [" ".join(str(value) for value in event.values()) for event in events]
            for record in caplog.records:
                lines.append(record.getMessage())
                if record.exc_info and record.exc_info[1] is not None:
                    lines.append(str(record.exc_info[1]))
            return "\n".join(lines)

        yield text


def upload_engine() -> tuple[FakeEngine, asyncio.Event, asyncio.Event]:
    """The fake engine plus a route that reads a streamed upload and records it; the events
    say that an upload's head arrived and that an upload broke off before its end."""
    engine = FakeEngine()
    head_received, broke_off = asyncio.Event(), asyncio.Event()

    async def upload(request: web.Request) -> web.Response:
        head_received.set()
        try:
            body = await request.read()
        except (asyncio.CancelledError, ConnectionError):
            broke_off.set()
            raise
        seen = SeenRequest(
            request.method, request.path, CIMultiDict(request.headers), body, time.monotonic()
        )
        engine.requests.append(seen)
        return web.json_response({"received": len(body)})

    engine.app.router.add_post("/v1/audio/transcriptions", upload)
    return engine, head_received, broke_off


@dataclass
class BodyTarget:
    """Where a test's request body goes: read whole as JSON, or streamed to an upload route."""

    engine: FakeEngine
    url: str
    path: str
    content_type: str
    head_received: asyncio.Event | None  # streamed only: the engine got the request head
    broke_off: asyncio.Event | None  # streamed only: the upload ended before its body did


async def body_target(kind: str, fake_engine, upstream_app) -> BodyTarget:  # type: ignore[no-untyped-def]
    """The engine for a `kind` of "json" (tether reads the body whole) or "streamed"."""
    if kind == "json":
        engine, url = await fake_engine()
        return BodyTarget(engine, url, "/v1/chat/completions", "application/json", None, None)
    engine, head_received, broke_off = upload_engine()
    url = await upstream_app(engine.app)
    return BodyTarget(
        engine,
        url,
        "/v1/audio/transcriptions",
        "application/octet-stream",
        head_received,
        broke_off,
    )


async def assert_closed(client: RawClient) -> None:
    """tether closed the connection (FIN, or RST when it left unread bytes behind)."""
    try:
        assert await read_to_end(client.reader) == b""
    except ConnectionResetError:
        pass


# --- slow clients: bounded by the client timeouts ---------------------------------------------


async def read_until_cut(client: RawClient, timeout: float) -> bytes:
    """What tether sends until it closes the connection; a reset (bytes the client was still
    sending arrived after the close) ends it as well as a FIN."""
    answer = b""
    async with asyncio.timeout(timeout):
        try:
            while chunk := await client.reader.read(65536):
                answer += chunk
        except ConnectionResetError:
            pass
    return answer


def cut_answer(answer: bytes) -> bool:
    """What a client cut by a timeout may see before the close: nothing, or a 408."""
    return answer == b"" or answer.split(b" ", 2)[1:2] == [b"408"]


async def test_head_dribbled_byte_by_byte_is_cut_at_the_header_timeout(fake_engine, tether) -> None:
    """A head that keeps arriving one byte at a time is cut when the header timeout expires:
    the limit is on the whole head, not on silence."""
    engine, engine_url = await fake_engine()
    server = await tether(engine_url, client_header_timeout=HEADER_TIMEOUT, health_interval=60)
    before = asyncio.all_tasks()
    started = time.monotonic()
    client = await RawClient.connect(server.port)
    endless = head(headers=[("X-Pad", "p" * 10_000)])  # far from complete at this pace

    async def dribble() -> None:
        for byte in endless:
            client.writer.write(bytes([byte]))
            await asyncio.sleep(0.02)  # the client's pace, not a synchronisation

    dribbler = asyncio.create_task(dribble())
    try:
        answer = await read_until_cut(client, HEADER_TIMEOUT + 3)
    finally:
        dribbler.cancel()
    assert time.monotonic() - started >= HEADER_TIMEOUT - 0.05
    assert cut_answer(answer)
    nothing_reached(engine)
    await settled(server)
    await no_task_left(before)


async def test_head_never_finished_is_cut_at_the_header_timeout(fake_engine, tether) -> None:
    """A client that sends part of a head and then nothing is cut at the header timeout."""
    engine, engine_url = await fake_engine()
    server = await tether(engine_url, client_header_timeout=HEADER_TIMEOUT, health_interval=60)
    before = asyncio.all_tasks()
    client = await RawClient.connect(server.port)
    await send_raw(client, head()[:-2])  # the blank line that ends the head never comes

    answer = await read_until_cut(client, HEADER_TIMEOUT + 3)

    assert cut_answer(answer)
    nothing_reached(engine)
    await settled(server)
    await no_task_left(before)


async def test_idle_keep_alive_connection_closes_at_the_header_timeout(fake_engine, tether) -> None:
    """An idle keep-alive connection is closed once TETHER_CLIENT_HEADER_TIMEOUT passes without
    a new request head (documented: one timeout bounds slow senders and idle connections, as
    nginx's client_header_timeout and keepalive_timeout do); clients reconnect."""
    _, engine_url = await fake_engine(max_tokens=1)
    server = await tether(engine_url, client_header_timeout=HEADER_TIMEOUT)
    client = await RawClient.connect(server.port)
    await send_raw(client, json_request(chat_body(stream=False, max_tokens=1), "one"))
    assert (await read_reply(client.reader)).status == 200

    answer = await read_until_cut(client, HEADER_TIMEOUT + 3)

    assert answer == b""
    await settled(server)


@pytest.mark.parametrize("kind", ["json", "streamed"])
async def test_silent_body_upload_is_cut_at_the_body_timeout(
    fake_engine, upstream_app, tether, kind
) -> None:
    """A body that stops arriving is cut after TETHER_CLIENT_BODY_TIMEOUT of silence and the
    connection closed: a JSON body (read whole) never reaches the engine, a streamed one
    breaks off there, so the engine never has a complete request to work on."""
    target = await body_target(kind, fake_engine, upstream_app)
    engine, engine_url, path, content_type = (
        target.engine,
        target.url,
        target.path,
        target.content_type,
    )
    head_received, broke_off = target.head_received, target.broke_off
    server = await tether(engine_url, client_body_timeout=BODY_TIMEOUT, health_interval=60)
    before = asyncio.all_tasks()
    client = await RawClient.connect(server.port)
    await client.send_request(
        b"x" * 100_000, path=path, content_type=content_type, body_bytes_now=1000
    )
    if head_received is not None:
        await asyncio.wait_for(head_received.wait(), 5)

    answer = await read_until_cut(client, BODY_TIMEOUT + 1.5)

    assert cut_answer(answer)
    await settled(server)
    metrics = server.context.metrics
    assert counter(metrics.requests, route_label(path), "4xx") == 1
    assert counter(metrics.outcomes, "completed") == 0
    if broke_off is not None:
        await asyncio.wait_for(broke_off.wait(), 5)
    assert engine.requests == [] and engine.generations == {}
    await server.context.aborts.drain()
    await no_task_left(before)


async def test_slow_but_steady_body_upload_is_not_cut(fake_engine, tether) -> None:
    """The body timeout limits silence, not the upload: a body that keeps arriving more slowly
    than the timeout in total is forwarded whole."""
    engine, engine_url = await fake_engine(max_tokens=1)
    server = await tether(engine_url, client_body_timeout=BODY_TIMEOUT)
    client = await RawClient.connect(server.port)
    request = json_request(chat_body(stream=False, max_tokens=1), "steady")
    split = request.index(b"\r\n\r\n") + 4
    await send_raw(client, request[:split])
    body, pieces = request[split:], 8
    for index in range(pieces):  # about 0.8 s in total, never silent for BODY_TIMEOUT
        await asyncio.sleep(BODY_TIMEOUT / 3)
        await send_raw(
            client, body[index * len(body) // pieces : (index + 1) * len(body) // pieces]
        )

    reply = await read_reply(client.reader)

    assert (reply.status, reply.json()["id"]) == (200, "chatcmpl-steady")
    assert json.loads(engine.requests[0].body)["messages"] == chat_body()["messages"]
    await settled(server)


# --- oversized and malformed heads: refused by the HTTP parser, before tether's handler -------


@pytest.mark.parametrize(
    ("path", "extra"),
    [
        pytest.param("/v1/chat/completions", [("X-Request-Id", "i" * 100_000)], id="100KB-id"),
        pytest.param("/v1/chat/completions", [("X-Pad", "p" * 100_000)], id="100KB-header"),
        pytest.param(
            "/v1/chat/completions", [(f"X-Pad-{n}", "p") for n in range(200)], id="200-headers"
        ),
        pytest.param("/v1/" + "p" * 100_000, [], id="100KB-path"),
    ],
)
async def test_oversized_head_is_refused_before_the_engine(
    fake_engine, tether, path, extra
) -> None:
    """A head over the parser's limits (16 KB a line, 128 headers) gets a plain 400 from
    aiohttp (not 431, not JSON) and the connection is closed; nothing reaches the engine."""
    engine, engine_url = await fake_engine()
    server = await tether(engine_url)
    client = await RawClient.connect(server.port)
    await send_raw(client, head(path, headers=[("Content-Length", "0"), *extra]))

    reply = await read_reply(client.reader)

    assert reply.status == 400
    assert reply.headers["Content-Type"].startswith("text/plain")
    await assert_closed(client)
    nothing_reached(engine)
    await settled(server)


@pytest.mark.parametrize(
    "framing",
    [
        pytest.param([("Content-Length", "5"), ("Transfer-Encoding", "chunked")], id="CL+TE"),
        pytest.param([("Content-Length", "5"), ("Content-Length", "6")], id="two-CL"),
        pytest.param([("Content-Length", "-1")], id="negative-CL"),
        pytest.param([("Transfer-Encoding", "gzip, chunked, identity")], id="TE-not-last"),
    ],
)
async def test_ambiguous_body_framing_is_refused_before_the_engine(
    fake_engine, tether, framing
) -> None:
    """Request-smuggling framings (both lengths, two lengths, bad encodings) are refused with
    400 and the connection closed; nothing reaches the engine."""
    engine, engine_url = await fake_engine()
    server = await tether(engine_url)
    client = await RawClient.connect(server.port)
    await send_raw(client, head(path="/echo/smuggle", headers=framing) + b"0\r\n\r\n")

    reply = await read_reply(client.reader)

    assert reply.status == 400
    await assert_closed(client)
    nothing_reached(engine)
    await settled(server)


# --- request IDs ----------------------------------------------------------------------------


@pytest.mark.parametrize("second_line", ["X-Evil: 1", "X-Request-Id: second"])
async def test_crlf_in_a_request_id_only_makes_another_header(
    fake_engine, tether, second_line
) -> None:
    """`X-Request-Id: a<CR><LF>X-Evil: 1` is simply two headers: the client keeps the first ID,
    the engine sees only tether's ID (never a second request ID)."""
    engine, engine_url = await fake_engine()
    server = await tether(engine_url)
    client = await RawClient.connect(server.port)
    await send_raw(
        client,
        head("/echo/ids", method="GET", headers=[("X-Request-Id", "a")])[:-2]
        + second_line.encode()
        + b"\r\n\r\n",
    )

    reply = await read_reply(client.reader)

    assert reply.status == 200
    assert reply.headers.getall("X-Request-Id") == ["a"]
    [seen] = engine.requests
    [internal_id] = seen.headers.getall("X-Request-Id")
    assert len(internal_id) == 32 and internal_id != "a"
    if second_line.startswith("X-Evil"):
        assert seen.headers["X-Evil"] == "1"  # an ordinary header, like any the client sends
    assert server.context.registry.find("a") == []
    await settled(server)


@pytest.mark.parametrize(
    "value",
    [
        pytest.param(b"a\rX-Evil: 1", id="bare-CR"),
        pytest.param(b"a\nX-Evil: 1", id="bare-LF"),
        pytest.param(b"a\r\n X-Evil: 1", id="obs-fold"),
        pytest.param(b"a\x00X-Evil: 1", id="NUL"),
    ],
)
async def test_control_bytes_in_a_request_id_are_refused_by_the_parser(
    fake_engine, tether, logged, value
) -> None:
    """Bare CR, bare LF, obs-fold continuations and NUL never make a header: the parser answers
    400 and closes; nothing reaches the engine, and no log line carries the raw bytes."""
    engine, engine_url = await fake_engine()
    server = await tether(engine_url)
    client = await RawClient.connect(server.port)
    await send_raw(
        client, b"GET /echo/ids HTTP/1.1\r\nHost: t\r\nX-Request-Id: " + value + b"\r\n\r\n"
    )

    reply = await read_reply(client.reader)

    assert reply.status == 400
    await assert_closed(client)
    nothing_reached(engine)
    await settled(server)
    text = logged()  # aiohttp logs the refusal at error level, quoting the bytes escaped
    assert value.decode() not in text
    assert "\nX-Evil" not in text and "\n X-Evil" not in text


@pytest.mark.parametrize(
    "value",
    [
        pytest.param("café-☃".encode(), id="utf-8"),
        pytest.param(b"caf\xe9", id="latin-1-byte"),
        pytest.param(b"a\tb", id="tab"),
        pytest.param(b"a b", id="space"),
        pytest.param(b"i" * 10_000, id="10KB"),
    ],
)
async def test_ids_tether_cannot_echo_get_a_json_400(fake_engine, tether, logged, value) -> None:
    """An ID the parser accepts but tether cannot log, echo or write into JSON safely gets an
    OpenAI-style 400 from tether, is not echoed, and never reaches the engine or the logs."""
    engine, engine_url = await fake_engine()
    server = await tether(engine_url)
    client = await RawClient.connect(server.port)
    await send_raw(
        client,
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: t\r\nContent-Length: 0\r\n"
        b"X-Request-Id: " + value + b"\r\n\r\n",
    )

    reply = await read_reply(client.reader)

    assert reply.status == 400
    error = reply.json()["error"]
    assert (error["code"], error["type"]) == ("invalid_request_id", "invalid_request_error")
    assert "X-Request-Id" in error["message"]
    assert "X-Request-Id" not in reply.headers
    nothing_reached(engine)
    await settled(server)
    metrics = server.context.metrics
    assert counter(metrics.outcomes, "rejected") == 1
    assert counter(metrics.requests, "/v1/chat/completions", "4xx") == 1
    assert value.decode("utf-8", "surrogateescape") not in logged()


# --- bodies tether must read to write its ID into -------------------------------------------


@pytest.mark.parametrize(
    "body",
    [
        pytest.param(b'{"messages": [', id="truncated"),
        pytest.param(b'{"a": 1} {"b": 2}', id="trailing-data"),
        pytest.param(b"[1, 2]", id="array"),
        pytest.param(b'"just a string"', id="string"),
        pytest.param(b'{"text": "\xff\xfe"}', id="invalid-utf-8"),
    ],
)
async def test_invalid_json_where_the_id_must_go_is_a_json_400(fake_engine, tether, body) -> None:
    """SGLang takes its ID from the body: a body that is not a JSON object gets an
    OpenAI-style 400, nothing reaches the engine, and nothing is counted as an engine error."""
    engine, engine_url = await fake_engine(abort_route=AbortRoute.SGLANG)
    server = await tether(engine_url, engine="sglang")
    client = await RawClient.connect(server.port)
    await client.send_request(body, path="/generate")

    reply = await read_reply(client.reader)

    assert reply.status == 400
    assert reply.json()["error"]["code"] == "invalid_request_body"
    nothing_reached(engine)
    await settled(server)
    await server.context.aborts.drain()
    assert engine.aborts == []
    metrics = server.context.metrics
    assert counter(metrics.requests, "/generate", "4xx") == 1
    assert counter(metrics.upstream_cancels, "client_disconnected") == 0


async def test_invalid_body_counts_as_a_rejection_not_an_engine_error(fake_engine, tether) -> None:
    """A body the client got wrong is a rejection in the metrics, never an engine failure."""
    _, engine_url = await fake_engine(abort_route=AbortRoute.SGLANG)
    server = await tether(engine_url, engine="sglang")
    client = await RawClient.connect(server.port)
    await client.send_request(b"[1, 2]", path="/generate")

    assert (await read_reply(client.reader)).status == 400

    await settled(server)
    metrics = server.context.metrics
    assert counter(metrics.outcomes, "rejected") == 1
    assert counter(metrics.outcomes, "upstream_failed") == 0
    assert counter(metrics.upstream_errors, "invalid_request_body") == 0


@pytest.mark.parametrize("content_type", [None, "application/vnd.api+json"])
async def test_sglang_rid_is_replaced_whatever_the_content_type(
    fake_engine, tether, content_type
) -> None:
    """A client's own `rid` never reaches SGLang, however the JSON body is labelled: otherwise
    IDs collide upstream and tether's abort (by its own rid) misses the generation."""
    engine, engine_url = await fake_engine(abort_route=AbortRoute.SGLANG, max_tokens=1)
    server = await tether(engine_url, engine="sglang")
    client = await RawClient.connect(server.port)
    payload = json.dumps({**chat_body(stream=False, max_tokens=1), "rid": "victim"}).encode()
    labels = [("Content-Type", content_type)] if content_type else []
    await send_raw(
        client,
        head("/generate", headers=[*labels, ("Content-Length", str(len(payload)))]) + payload,
    )

    assert (await read_reply(client.reader)).status == 200

    [rid] = engine.generations
    assert rid != "victim" and len(rid) == 32
    await settled(server)


# --- Content-Length mismatches ----------------------------------------------------------------


@pytest.mark.parametrize("kind", ["json", "streamed"])
async def test_body_shorter_than_declared_then_fin_is_a_disconnect_in_phase_body(
    fake_engine, upstream_app, tether, kind
) -> None:
    """A client that declares more body than it sends and then closes its side has left while
    sending: a JSON body never reaches the engine, a streamed one is aborted upstream."""
    target = await body_target(kind, fake_engine, upstream_app)
    engine, engine_url, path, content_type = (
        target.engine,
        target.url,
        target.path,
        target.content_type,
    )
    head_received = target.head_received
    server = await tether(engine_url)
    client = await RawClient.connect(server.port)
    await client.send_request(
        b"x" * 100_000, path=path, content_type=content_type, body_bytes_now=1000
    )
    if head_received is not None:
        await asyncio.wait_for(head_received.wait(), 5)

    client.writer.write_eof()  # FIN with 99,000 declared bytes missing

    assert await read_to_end(client.reader) == b""
    await settled(server)
    metrics = server.context.metrics
    assert counter(metrics.client_disconnects, "body") == 1
    assert counter(metrics.outcomes, "client_disconnected") == 1
    if kind == "json":
        nothing_reached(engine)
        await server.context.aborts.drain()
        assert engine.aborts == []
    else:
        await engine.wait_for(lambda: len(engine.aborts) == 1)
        assert counter(metrics.upstream_cancels, "client_disconnected") == 1


async def test_body_longer_than_declared_is_read_as_a_garbage_next_request(
    fake_engine, tether
) -> None:
    """Bytes beyond Content-Length are the next pipelined request; garbage there gets a 400 and
    the connection closed. aiohttp drops the complete request parsed in the same read as the
    garbage, so the engine sees nothing at all (see the report on issue 7)."""
    engine, engine_url = await fake_engine()
    server = await tether(engine_url)
    client = await RawClient.connect(server.port)
    body = b'{"a": 1}'
    request = head(
        "/echo/longer", headers=[("Content-Type", "application/json"), ("Content-Length", "8")]
    )
    await send_raw(client, request + body + b"GARBAGE-BEYOND-THE-DECLARED-LENGTH\r\n\r\n")

    reply = await read_reply(client.reader)

    assert reply.status == 400  # the only answer: the complete first request got none
    await assert_closed(client)
    nothing_reached(engine)
    await settled(server)


# --- framings a proxy must translate ---------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "content_type"),
    [
        pytest.param("/v1/audio/transcriptions", "application/octet-stream", id="streamed"),
        pytest.param("/echo/chunked", "application/json", id="json-read-whole"),
    ],
)
async def test_chunked_request_body_reaches_the_engine_byte_for_byte(
    upstream_app, tether, path, content_type
) -> None:
    """A chunked upload arrives at the engine as exactly the bytes the client sent, whether
    tether streams it through or reads it whole as JSON."""
    engine, _, _ = upload_engine()
    server = await tether(await upstream_app(engine.app))
    payload = json.dumps({"text": "héllo " * 5000, "stream": False}).encode()
    pieces = [payload[:1], payload[1:7777], payload[7777:]]
    client = await RawClient.connect(server.port)
    await send_raw(
        client,
        head(path, headers=[("Content-Type", content_type), ("Transfer-Encoding", "chunked")]),
    )
    for piece in pieces:
        await send_raw(client, f"{len(piece):x}\r\n".encode() + piece + b"\r\n")
    await send_raw(client, b"0\r\n\r\n")

    reply = await read_reply(client.reader)

    assert reply.status == 200
    [seen] = engine.requests
    assert seen.body == payload
    if content_type == "application/json":  # read whole: sent on with its exact length
        assert seen.headers["Content-Length"] == str(len(payload))
    else:  # streamed through as it arrived
        assert seen.headers["Transfer-Encoding"] == "chunked"
    await settled(server)
    assert counter(server.context.metrics.outcomes, "completed") == 1


async def test_expect_100_continue_is_answered_by_tether(fake_engine, tether) -> None:
    """A client that asks `Expect: 100-continue` gets `100 Continue`, sends its body, gets the
    engine's answer; the engine never sees the Expect header."""
    engine, engine_url = await fake_engine()
    server = await tether(engine_url)
    client = await RawClient.connect(server.port)
    body = b'{"hello": "engine"}'
    await send_raw(
        client,
        head(
            "/echo/expect",
            headers=[
                ("Content-Type", "application/json"),
                ("Content-Length", str(len(body))),
                ("Expect", "100-continue"),
                ("X-Request-Id", "patient"),
            ],
        ),
    )

    interim = await read_reply(client.reader)
    assert (interim.version, interim.status) == ("HTTP/1.1", 100)
    await send_raw(client, body)
    reply = await read_reply(client.reader)

    assert reply.status == 200
    assert reply.headers["X-Request-Id"] == "patient"
    assert reply.json()["body"] == body.decode()
    [seen] = engine.requests
    assert "Expect" not in seen.headers
    assert seen.body == body
    await settled(server)


async def test_expect_100_continue_is_refused_before_an_upload_tether_would_refuse(
    fake_engine, tether
) -> None:
    """A client that asks first is told 413 at once when its declared JSON body is over the
    limit, instead of `100 Continue` followed by an upload tether then throws away."""
    engine, engine_url = await fake_engine()
    server = await tether(engine_url, max_json_body=100)
    client = await RawClient.connect(server.port)
    await send_raw(
        client,
        head(
            headers=[
                ("Content-Type", "application/json"),
                ("Content-Length", "5000"),
                ("Expect", "100-continue"),
            ]
        ),
    )

    reply = await read_reply(client.reader)

    assert reply.status == 413
    assert reply.json()["error"]["code"] == "request_body_too_large"
    nothing_reached(engine)
    await settled(server)


async def test_pipelined_requests_are_answered_in_order_with_their_own_ids(
    fake_engine, tether
) -> None:
    """Two requests sent in one write are both answered, in order, each with its own ID in the
    header and the body, and are two distinct requests to the engine."""
    engine, engine_url = await fake_engine(max_tokens=2)
    server = await tether(engine_url)
    client = await RawClient.connect(server.port)
    body = chat_body(stream=False, max_tokens=2)
    await send_raw(client, json_request(body, "first") + json_request(body, "second"))

    replies = [await read_reply(client.reader), await read_reply(client.reader)]

    assert [reply.status for reply in replies] == [200, 200]
    assert [reply.headers["X-Request-Id"] for reply in replies] == ["first", "second"]
    assert [reply.json()["id"] for reply in replies] == ["chatcmpl-first", "chatcmpl-second"]
    assert len(engine.generations) == 2
    assert all(g.state is GenerationState.COMPLETED for g in engine.generations.values())
    await settled(server)
    assert counter(server.context.metrics.outcomes, "completed") == 2


async def test_http_1_0_client_gets_the_whole_stream_delimited_by_close(
    fake_engine, tether
) -> None:
    """An HTTP/1.0 client (no chunked encoding) gets a streamed response complete, ended by
    the connection closing, with its own ID in every event."""
    _, engine_url = await fake_engine(max_tokens=20)
    server = await tether(engine_url)
    client = await RawClient.connect(server.port)
    payload = json.dumps(chat_body(max_tokens=20)).encode()
    await send_raw(
        client,
        head(
            version="HTTP/1.0",
            headers=[
                ("Content-Type", "application/json"),
                ("Content-Length", str(len(payload))),
                ("X-Request-Id", "old-client"),
            ],
        )
        + payload,
    )

    reply = await read_reply(client.reader)  # no length, no chunks: read until close

    assert (reply.version, reply.status) == ("HTTP/1.0", 200)
    assert "Transfer-Encoding" not in reply.headers and "Content-Length" not in reply.headers
    text = reply.body.decode()
    assert text.endswith("data: [DONE]\n\n")
    assert text.count(" tok") == 20
    assert set(sse_ids(text)) == {"chatcmpl-old-client"}
    await settled(server)
    assert counter(server.context.metrics.outcomes, "completed") == 1


# --- a client that half-closes after sending its request --------------------------------------


async def test_half_close_after_the_request_is_a_disconnect(fake_engine, tether) -> None:
    """`shutdown(SHUT_WR)` after a complete request reads as the client leaving: aiohttp closes
    the connection on EOF, tether cancels the handler and aborts upstream (as nginx does); the
    client gets no response."""
    engine, engine_url = await fake_engine(token_interval=0.01)
    server = await tether(engine_url)
    client = await RawClient.connect(server.port)
    await client.send_request(chat_body(stream=False, max_tokens=10_000))
    await engine.wait_for(lambda: len(engine.generations) == 1)
    [internal_id] = engine.generations

    client.writer.write_eof()

    assert await read_to_end(client.reader) == b""
    await engine.wait_for(lambda: engine.generation(internal_id).state is GenerationState.ABORTED)
    assert engine.aborts[0].ids == (f"chatcmpl-{internal_id}",)
    await settled(server)
    metrics = server.context.metrics
    assert counter(metrics.client_disconnects, "waiting") == 1
    assert counter(metrics.outcomes, "client_disconnected") == 1
    assert counter(metrics.outcomes, "completed") == 0


async def test_half_close_right_after_sending_leaves_nothing_running(fake_engine, tether) -> None:
    """A client that sends its request and half-closes in the same breath gets no response and
    leaves nothing running: whatever the engine started is aborted."""
    engine, engine_url = await fake_engine(token_interval=0.01)
    # The abort may overtake the request at the engine here: the repeated abort covers it.
    server = await tether(engine_url, abort_repeat_delay=0.05)
    clients = [await RawClient.connect(server.port) for _ in range(5)]
    for client in clients:
        payload = json.dumps(chat_body(stream=False, max_tokens=10_000)).encode()
        client.writer.write(
            head(
                headers=[
                    ("Content-Type", "application/json"),
                    ("Content-Length", str(len(payload))),
                ]
            )
            + payload
        )
        client.writer.write_eof()

    for client in clients:
        assert await read_to_end(client.reader) == b""
    await settled(server)
    await server.context.aborts.drain()
    await engine.wait_for(
        lambda: all(g.state is GenerationState.ABORTED for g in engine.generations.values())
    )
    metrics = server.context.metrics
    assert counter(metrics.outcomes, "completed") == 0
    assert len(engine.generations) <= counter(metrics.outcomes, "client_disconnected") <= 5


# --- a client that reads extremely slowly ----------------------------------------------------

EVENT_SIZE = 8192
EVENTS = 2000


def big_stream_engine() -> tuple[FakeEngine, dict[str, Any]]:
    """The fake engine plus a route streaming EVENTS events of EVENT_SIZE bytes, counting the
    bytes its awaited writes accepted and whether a write is still waiting for room."""
    engine = FakeEngine()
    progress: dict[str, Any] = {"written": 0, "writing": False, "connection_lost": asyncio.Event()}

    async def big(request: web.Request) -> web.StreamResponse:
        internal_id = request.headers["X-Request-Id"]
        assert request.transport is not None
        engine_socket = request.transport.get_extra_info("socket")
        engine_socket.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 16384)
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        padding = "x" * (EVENT_SIZE - 100)
        try:
            for index in range(EVENTS):
                event = {"id": f"chatcmpl-{internal_id}", "index": index, "text": padding}
                data = f"data: {json.dumps(event)}\n\n".encode()
                progress["writing"] = True
                await response.write(data)
                progress["writing"] = False
                progress["written"] += len(data)
            await response.write_eof()
        except (asyncio.CancelledError, ConnectionError):
            progress["connection_lost"].set()
            raise
        return response

    engine.app.router.add_post("/v1/big", big)
    return engine, progress


async def slow_reader(port: int) -> RawClient:
    """A client with a small receive window, like a slow mobile link."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", port))
    reader, writer = await asyncio.open_connection(sock=sock)
    return RawClient(reader, writer)


async def test_slow_reader_paces_the_engine_with_bounded_memory(upstream_app, tether) -> None:
    """A client reading 1 KB every 50 ms from a 16 MB stream: tether's memory stays bounded
    (nothing is buffered beyond the awaited writes), the engine's writes block instead of
    running ahead, and when the client leaves the request is aborted upstream."""
    engine, progress = big_stream_engine()
    server = await tether(await upstream_app(engine.app))
    total = EVENTS * EVENT_SIZE
    client = await slow_reader(server.port)
    await send_raw(
        client, head("/v1/big", headers=[("Content-Length", "0"), ("X-Request-Id", "slow")])
    )
    reply_head = await client.read_until(b"\r\n\r\n")
    assert reply_head.startswith(b"HTTP/1.1 200")

    tracemalloc.start()
    try:
        baseline, _ = tracemalloc.get_traced_memory()
        received = b""
        for _ in range(20):  # one second of reading 1 KB every 50 ms
            received += await client.reader.read(1024)
            await asyncio.sleep(0.05)  # the client's pace, not a synchronisation
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()

    # Python memory of the whole process (engine, tether, client) grew by far less than the
    # stream: only the kernel's socket buffers hold what the client has not read yet.
    assert peak - baseline < 4 * 2**20
    # The engine is paced: it is blocked in a write, far from the end of its stream. (What it
    # got to write sits in socket buffers; tether's send buffer autotunes up to
    # net.ipv4.tcp_wmem's maximum, 4 MB by default: about 4 MB in all after one second.)
    assert progress["writing"]
    assert progress["written"] < total / 2
    assert b'"id": "chatcmpl-slow"' in received
    [state] = list(server.context.registry)

    client.close_rst()

    await asyncio.wait_for(progress["connection_lost"].wait(), 5)
    await engine.wait_for(lambda: len(engine.aborts) == 1)
    assert engine.aborts[0].ids == (
        f"chatcmpl-{state.internal_request_id}",
        f"cmpl-{state.internal_request_id}",
    )
    await settled(server)
    metrics = server.context.metrics
    assert counter(metrics.client_disconnects, "streaming") == 1
    assert metrics.bytes_streamed._value.get() < total / 2
