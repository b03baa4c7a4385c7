"""Hostile or broken clients: slow, oversized, malformed, pipelined, half-closed or too slow
to read. Whatever they send, nothing unchecked reaches the engine, nothing is left running
upstream, and tether's registry and metrics stay consistent."""

from __future__ import annotations

import asyncio
import json
import logging
import pathlib
import socket
import time
import tracemalloc
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import aiohttp
import pytest
import structlog
from aiohttp import web
from multidict import CIMultiDict

from proxy.observe.metrics import route_label
from tether_fake_engine import AbortRoute, FakeEngine, GenerationState, SeenRequest

from .support.canaries import CANARY_PROMPT, canary_bytes
from .support.chat import chat_body, sse_ids
from .support.collected_log import IN_PROCESS, CollectedLog
from .support.in_process import TetherFactory, drained, settled
from .support.metrics import metric
from .support.processes import EngineProcessFactory, TetherProcessFactory
from .support.raw_http import RawClient, json_request, request_head
from .support.upstreams import FakeEngineFactory, UpstreamAppFactory

# Timeout tests run with short limits so that the file stays fast.
HEADER_TIMEOUT = 0.3
BODY_TIMEOUT = 0.3
# How long a test waits for the cut those limits cause. A limit that does not work leaves the
# connection open for good (no other limit applies while a head or body is arriving), so a
# bound this much longer than the limits still catches it and leaves a loaded machine room.
CUT_WITHIN = 5.0


# --- helpers: the checks every test ends with ---------------------------------------------------


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
def logged(
    caplog: pytest.LogCaptureFixture, collected_log: CollectedLog
) -> Iterator[Callable[[], str]]:
    """Everything logged so far, tether's events and aiohttp's records, with every value as the
    raw string a console renderer would print (nothing escaped here). tether's events are
    captured instead of rendered meanwhile: they are added to the collected log at the end."""
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
    collected_log.add_lines(IN_PROCESS, "\n".join(repr(event) for event in events))


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


async def body_target(
    kind: str, fake_engine: FakeEngineFactory, upstream_app: UpstreamAppFactory
) -> BodyTarget:
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


# --- slow clients: bounded by the client timeouts ---------------------------------------------


def cut_answer(answer: bytes) -> bool:
    """What a client cut by a timeout may see before the close: nothing, or a 408."""
    return answer == b"" or answer.split(b" ", 2)[1:2] == [b"408"]


async def test_head_dribbled_byte_by_byte_is_cut_at_the_header_timeout(
    fake_engine: FakeEngineFactory, tether: TetherFactory
) -> None:
    """A head that keeps arriving one byte at a time is cut when the header timeout expires:
    the limit is on the whole head, not on silence."""
    engine, engine_url = await fake_engine()
    server = await tether(engine_url, client_header_timeout=HEADER_TIMEOUT, health_interval=60)
    before = asyncio.all_tasks()
    started = time.monotonic()
    client = await RawClient.connect(server.port)
    endless = request_head(headers=[("X-Pad", "p" * 10_000)])  # far from complete at this pace

    async def dribble() -> None:
        for byte in endless:
            client.writer.write(bytes([byte]))
            await asyncio.sleep(0.02)  # the client's pace, not a synchronisation

    dribbler = asyncio.create_task(dribble())
    try:
        answer = await client.read_until_cut(CUT_WITHIN)
    finally:
        dribbler.cancel()
    assert time.monotonic() - started >= HEADER_TIMEOUT - 0.05
    assert cut_answer(answer)
    nothing_reached(engine)
    await settled(server)
    await no_task_left(before)


async def test_head_never_finished_is_cut_at_the_header_timeout(
    fake_engine: FakeEngineFactory, tether: TetherFactory
) -> None:
    """A client that sends part of a head and then nothing is cut at the header timeout."""
    engine, engine_url = await fake_engine()
    server = await tether(engine_url, client_header_timeout=HEADER_TIMEOUT, health_interval=60)
    before = asyncio.all_tasks()
    client = await RawClient.connect(server.port)
    await client.send(request_head()[:-2])  # the blank line that ends the head never comes

    answer = await client.read_until_cut(CUT_WITHIN)

    assert cut_answer(answer)
    nothing_reached(engine)
    await settled(server)
    await no_task_left(before)


async def test_idle_keep_alive_connection_closes_at_the_header_timeout(
    fake_engine: FakeEngineFactory, tether: TetherFactory
) -> None:
    """An idle keep-alive connection is closed once TETHER_CLIENT_HEADER_TIMEOUT passes without
    a new request head (documented: one timeout bounds slow senders and idle connections, as
    nginx's client_header_timeout and keepalive_timeout do); clients reconnect."""
    _, engine_url = await fake_engine(max_tokens=1)
    server = await tether(engine_url, client_header_timeout=HEADER_TIMEOUT)
    client = await RawClient.connect(server.port)
    await client.send(json_request(chat_body(stream=False, max_tokens=1), "one"))
    assert (await client.read_reply()).status == 200

    answer = await client.read_until_cut(CUT_WITHIN)

    assert answer == b""
    await settled(server)


@pytest.mark.parametrize("kind", ["json", "streamed"])
async def test_silent_body_upload_is_cut_at_the_body_timeout(
    fake_engine: FakeEngineFactory,
    upstream_app: UpstreamAppFactory,
    tether: TetherFactory,
    kind: str,
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
        canary_bytes(100_000), path=path, content_type=content_type, body_bytes_now=1000
    )
    if head_received is not None:
        await asyncio.wait_for(head_received.wait(), 5)

    answer = await client.read_until_cut(CUT_WITHIN)

    assert cut_answer(answer)
    await settled(server)
    registry = server.context.metrics.registry
    assert (
        metric(registry, "tether_requests_total", route=route_label(path), status_class="4xx") == 1
    )
    assert metric(registry, "tether_request_outcomes_total", outcome="completed") == 0
    if broke_off is not None:
        await asyncio.wait_for(broke_off.wait(), 5)
    assert engine.requests == [] and engine.generations == {}
    await drained(server)
    await no_task_left(before)


async def test_slow_but_steady_body_upload_is_not_cut(
    fake_engine: FakeEngineFactory, tether: TetherFactory
) -> None:
    """The body timeout limits silence, not the upload: a body that keeps arriving more slowly
    than the timeout in total is forwarded whole."""
    # 6 pieces 0.25 s apart: 1.5 s in all, longer than the 1 s timeout, while each silence
    # stays 4x below it (a loaded machine may stretch a pause, not by 0.75 s).
    body_timeout, pause, pieces = 1.0, 0.25, 6
    engine, engine_url = await fake_engine(max_tokens=1)
    server = await tether(engine_url, client_body_timeout=body_timeout)
    client = await RawClient.connect(server.port)
    request = json_request(chat_body(stream=False, max_tokens=1), "steady")
    split = request.index(b"\r\n\r\n") + 4
    await client.send(request[:split])
    body = request[split:]
    for index in range(pieces):
        await asyncio.sleep(pause)  # the client's pace, not a synchronisation
        await client.send(body[index * len(body) // pieces : (index + 1) * len(body) // pieces])

    reply = await client.read_reply()

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
    fake_engine: FakeEngineFactory, tether: TetherFactory, path: str, extra: list[tuple[str, str]]
) -> None:
    """A head over the parser's limits (16 KB a line, 128 headers) gets a plain 400 from
    aiohttp (not 431, not JSON) and the connection is closed; nothing reaches the engine."""
    engine, engine_url = await fake_engine()
    server = await tether(engine_url)
    client = await RawClient.connect(server.port)
    await client.send(request_head(path, headers=[("Content-Length", "0"), *extra]))

    reply = await client.read_reply()

    assert reply.status == 400
    assert reply.headers["Content-Type"].startswith("text/plain")
    await client.expect_closed()
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
    fake_engine: FakeEngineFactory, tether: TetherFactory, framing: list[tuple[str, str]]
) -> None:
    """Request-smuggling framings (both lengths, two lengths, bad encodings) are refused with
    400 and the connection closed; nothing reaches the engine."""
    engine, engine_url = await fake_engine()
    server = await tether(engine_url)
    client = await RawClient.connect(server.port)
    await client.send(request_head(path="/echo/smuggle", headers=framing) + b"0\r\n\r\n")

    reply = await client.read_reply()

    assert reply.status == 400
    await client.expect_closed()
    nothing_reached(engine)
    await settled(server)


# --- request IDs ----------------------------------------------------------------------------


@pytest.mark.parametrize("second_line", ["X-Evil: 1", "X-Request-Id: second"])
async def test_crlf_in_a_request_id_only_makes_another_header(
    fake_engine: FakeEngineFactory, tether: TetherFactory, second_line: str
) -> None:
    """`X-Request-Id: a<CR><LF>X-Evil: 1` is simply two headers: the client keeps the first ID,
    the engine sees only tether's ID (never a second request ID)."""
    engine, engine_url = await fake_engine()
    server = await tether(engine_url)
    client = await RawClient.connect(server.port)
    await client.send(
        request_head("/echo/ids", method="GET", headers=[("X-Request-Id", "a")])[:-2]
        + second_line.encode()
        + b"\r\n\r\n",
    )

    reply = await client.read_reply()

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
    fake_engine: FakeEngineFactory, tether: TetherFactory, logged: Callable[[], str], value: bytes
) -> None:
    """Bare CR, bare LF, obs-fold continuations and NUL never make a header: the parser answers
    400 and closes; nothing reaches the engine, and no log line carries the raw bytes."""
    engine, engine_url = await fake_engine()
    server = await tether(engine_url)
    client = await RawClient.connect(server.port)
    await client.send(b"GET /echo/ids HTTP/1.1\r\nHost: t\r\nX-Request-Id: " + value + b"\r\n\r\n")

    reply = await client.read_reply()

    assert reply.status == 400
    await client.expect_closed()
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
async def test_ids_tether_cannot_echo_get_a_json_400(
    fake_engine: FakeEngineFactory, tether: TetherFactory, logged: Callable[[], str], value: bytes
) -> None:
    """An ID the parser accepts but tether cannot log, echo or write into JSON safely gets an
    OpenAI-style 400 from tether, is not echoed, and never reaches the engine or the logs."""
    engine, engine_url = await fake_engine()
    server = await tether(engine_url)
    client = await RawClient.connect(server.port)
    await client.send(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: t\r\nContent-Length: 0\r\n"
        b"X-Request-Id: " + value + b"\r\n\r\n",
    )

    reply = await client.read_reply()

    assert reply.status == 400
    error = reply.json()["error"]
    assert (error["code"], error["type"]) == ("invalid_request_id", "invalid_request_error")
    assert "X-Request-Id" in error["message"]
    assert "X-Request-Id" not in reply.headers
    nothing_reached(engine)
    await settled(server)
    registry = server.context.metrics.registry
    assert metric(registry, "tether_request_outcomes_total", outcome="rejected") == 1
    assert (
        metric(registry, "tether_requests_total", route="/v1/chat/completions", status_class="4xx")
        == 1
    )
    assert value.decode("utf-8", "surrogateescape") not in logged()


# --- bodies tether must read to write its ID into -------------------------------------------

_PROMPT = CANARY_PROMPT.encode()


@pytest.mark.parametrize(
    "body",
    [
        pytest.param(b'{"messages": [{"content": "' + _PROMPT + b'"}', id="truncated"),
        pytest.param(b'{"a": 1} {"prompt": "' + _PROMPT + b'"}', id="trailing-data"),
        pytest.param(b'[1, "' + _PROMPT + b'"]', id="array"),
        pytest.param(b'"' + _PROMPT + b'"', id="string"),
        pytest.param(b'{"text": "' + _PROMPT + b' \xff\xfe"}', id="invalid-utf-8"),
    ],
)
async def test_invalid_json_where_the_id_must_go_is_a_json_400(
    fake_engine: FakeEngineFactory, tether: TetherFactory, body: bytes
) -> None:
    """SGLang takes its ID from the body: a body that is not a JSON object gets an
    OpenAI-style 400, nothing reaches the engine, and nothing is counted as an engine error."""
    engine, engine_url = await fake_engine(abort_route=AbortRoute.SGLANG)
    server = await tether(engine_url, engine="sglang")
    client = await RawClient.connect(server.port)
    await client.send_request(body, path="/generate")

    reply = await client.read_reply()

    assert reply.status == 400
    assert reply.json()["error"]["code"] == "invalid_request_body"
    nothing_reached(engine)
    await settled(server)
    await drained(server)
    assert engine.aborts == []
    registry = server.context.metrics.registry
    assert metric(registry, "tether_requests_total", route="/generate", status_class="4xx") == 1
    assert (
        metric(registry, "tether_upstream_cancellations_total", reason="client_disconnected") == 0
    )


async def test_invalid_body_counts_as_a_rejection_not_an_engine_error(
    fake_engine: FakeEngineFactory, tether: TetherFactory
) -> None:
    """A body the client got wrong is a rejection in the metrics, never an engine failure."""
    _, engine_url = await fake_engine(abort_route=AbortRoute.SGLANG)
    server = await tether(engine_url, engine="sglang")
    client = await RawClient.connect(server.port)
    await client.send_request(b"[1, 2]", path="/generate")

    assert (await client.read_reply()).status == 400

    await settled(server)
    registry = server.context.metrics.registry
    assert metric(registry, "tether_request_outcomes_total", outcome="rejected") == 1
    assert metric(registry, "tether_request_outcomes_total", outcome="upstream_failed") == 0
    assert metric(registry, "tether_upstream_errors_total", kind="invalid_request_body") == 0


@pytest.mark.parametrize("content_type", [None, "application/vnd.api+json"])
async def test_sglang_rid_is_replaced_whatever_the_content_type(
    fake_engine: FakeEngineFactory, tether: TetherFactory, content_type: str | None
) -> None:
    """A client's own `rid` never reaches SGLang, however the JSON body is labelled: otherwise
    IDs collide upstream and tether's abort (by its own rid) misses the generation."""
    engine, engine_url = await fake_engine(abort_route=AbortRoute.SGLANG, max_tokens=1)
    server = await tether(engine_url, engine="sglang")
    client = await RawClient.connect(server.port)
    payload = json.dumps({**chat_body(stream=False, max_tokens=1), "rid": "victim"}).encode()
    labels = [("Content-Type", content_type)] if content_type else []
    await client.send(
        request_head("/generate", headers=[*labels, ("Content-Length", str(len(payload)))])
        + payload,
    )

    assert (await client.read_reply()).status == 200

    [rid] = engine.generations
    assert rid != "victim" and len(rid) == 32
    await settled(server)


# --- Content-Length mismatches ----------------------------------------------------------------


@pytest.mark.parametrize("kind", ["json", "streamed"])
async def test_body_shorter_than_declared_then_fin_is_a_disconnect_in_phase_body(
    fake_engine: FakeEngineFactory,
    upstream_app: UpstreamAppFactory,
    tether: TetherFactory,
    kind: str,
) -> None:
    """A client that declares more body than it sends and then closes its side has left while
    sending: a JSON body never reaches the engine, a streamed one's upstream connection is
    dropped mid-body (the engine never gets a whole request; nothing to abort)."""
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
        canary_bytes(100_000), path=path, content_type=content_type, body_bytes_now=1000
    )
    if head_received is not None:
        await asyncio.wait_for(head_received.wait(), 5)

    client.half_close()  # FIN with 99,000 declared bytes missing

    assert await client.read_to_end() == b""
    await settled(server)
    registry = server.context.metrics.registry
    assert metric(registry, "tether_client_disconnects_total", phase="body") == 1
    assert metric(registry, "tether_request_outcomes_total", outcome="client_disconnected") == 1
    if kind == "json":
        nothing_reached(engine)
        await drained(server)
        assert engine.aborts == []
    else:
        assert target.broke_off is not None
        await asyncio.wait_for(target.broke_off.wait(), 5)
        await drained(server)
        assert engine.aborts == []
        assert (
            metric(registry, "tether_upstream_cancellations_total", reason="client_disconnected")
            == 1
        )


async def test_body_longer_than_declared_is_read_as_a_garbage_next_request(
    fake_engine: FakeEngineFactory, tether: TetherFactory
) -> None:
    """Bytes beyond Content-Length are the next pipelined request; garbage there gets a 400 and
    the connection closed. aiohttp drops the complete request parsed in the same read as the
    garbage, so the engine sees nothing at all (see the report on issue 7)."""
    engine, engine_url = await fake_engine()
    server = await tether(engine_url)
    client = await RawClient.connect(server.port)
    body = b'{"a": 1}'
    request = request_head(
        "/echo/longer", headers=[("Content-Type", "application/json"), ("Content-Length", "8")]
    )
    await client.send(request + body + b"GARBAGE-BEYOND-THE-DECLARED-LENGTH\r\n\r\n")

    reply = await client.read_reply()

    assert reply.status == 400  # the only answer: the complete first request got none
    await client.expect_closed()
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
    upstream_app: UpstreamAppFactory, tether: TetherFactory, path: str, content_type: str
) -> None:
    """A chunked upload arrives at the engine as exactly the bytes the client sent, whether
    tether streams it through as it arrives or reads it whole as JSON."""
    engine, head_received, _ = upload_engine()
    server = await tether(await upstream_app(engine.app))
    payload = json.dumps({"text": f"{CANARY_PROMPT} héllo " * 500, "stream": False}).encode()
    pieces = [payload[:1], payload[1:7777], payload[7777:]]
    client = await RawClient.connect(server.port)
    await client.send(
        request_head(
            path, headers=[("Content-Type", content_type), ("Transfer-Encoding", "chunked")]
        ),
    )
    for index, piece in enumerate(pieces):
        await client.send(f"{len(piece):x}\r\n".encode() + piece + b"\r\n")
        if index == 0 and content_type != "application/json":
            # The rest follows once the engine has the head: the body is still arriving, so
            # it streams (one that arrived whole goes on as it is, with its length).
            await asyncio.wait_for(head_received.wait(), 5)
    await client.send(b"0\r\n\r\n")

    reply = await client.read_reply()

    assert reply.status == 200
    [seen] = engine.requests
    assert seen.body == payload
    if content_type == "application/json":  # read whole: sent on with its exact length
        assert seen.headers["Content-Length"] == str(len(payload))
    else:  # streamed through as it arrived
        assert seen.headers["Transfer-Encoding"] == "chunked"
    await settled(server)
    assert (
        metric(
            server.context.metrics.registry, "tether_request_outcomes_total", outcome="completed"
        )
        == 1
    )


async def test_expect_100_continue_is_answered_by_tether(
    fake_engine: FakeEngineFactory, tether: TetherFactory
) -> None:
    """A client that asks `Expect: 100-continue` gets `100 Continue`, sends its body, gets the
    engine's answer; the engine never sees the Expect header."""
    engine, engine_url = await fake_engine()
    server = await tether(engine_url)
    client = await RawClient.connect(server.port)
    body = b'{"hello": "engine"}'
    await client.send(
        request_head(
            "/echo/expect",
            headers=[
                ("Content-Type", "application/json"),
                ("Content-Length", str(len(body))),
                ("Expect", "100-continue"),
                ("X-Request-Id", "patient"),
            ],
        ),
    )

    interim = await client.read_reply()
    assert (interim.version, interim.status) == ("HTTP/1.1", 100)
    await client.send(body)
    reply = await client.read_reply()

    assert reply.status == 200
    assert reply.headers["X-Request-Id"] == "patient"
    assert reply.json()["body"] == body.decode()
    [seen] = engine.requests
    assert "Expect" not in seen.headers
    assert seen.body == body
    await settled(server)


async def test_expect_100_continue_is_refused_before_an_upload_tether_would_refuse(
    fake_engine: FakeEngineFactory, tether: TetherFactory
) -> None:
    """A client that asks first is told 413 at once when its declared JSON body is over the
    limit, instead of `100 Continue` followed by an upload tether then throws away."""
    engine, engine_url = await fake_engine()
    server = await tether(engine_url, max_json_body=100)
    client = await RawClient.connect(server.port)
    await client.send(
        request_head(
            headers=[
                ("Content-Type", "application/json"),
                ("Content-Length", "5000"),
                ("Expect", "100-continue"),
            ]
        ),
    )

    reply = await client.read_reply()

    assert reply.status == 413
    assert reply.json()["error"]["code"] == "request_body_too_large"
    nothing_reached(engine)
    await settled(server)


async def test_a_chunked_json_body_over_the_limit_is_refused_however_it_arrives(
    fake_engine: FakeEngineFactory, tether: TetherFactory
) -> None:
    """A JSON body with no declared length is measured as it is read: over the limit it is a
    413 whether it arrived whole in one write (read at once) or in pieces (read as they
    come), and the engine never sees it."""
    engine, engine_url = await fake_engine()
    server = await tether(engine_url, max_json_body=100)
    head = request_head(
        headers=[("Content-Type", "application/json"), ("Transfer-Encoding", "chunked")]
    )
    body = json.dumps(chat_body(stream=False, max_tokens=2) | {"pad": "x" * 200}).encode()
    chunk = f"{len(body):x}\r\n".encode() + body + b"\r\n"
    for pieces in ([head + chunk + b"0\r\n\r\n"], [head + chunk, b"0\r\n\r\n"]):
        client = await RawClient.connect(server.port)
        for piece in pieces:
            await client.send(piece)

        reply = await client.read_reply()

        assert reply.status == 413
        assert reply.json()["error"]["code"] == "request_body_too_large"
    nothing_reached(engine)
    await settled(server)


async def test_pipelined_requests_are_answered_in_order_with_their_own_ids(
    fake_engine: FakeEngineFactory, tether: TetherFactory
) -> None:
    """Two requests sent in one write are both answered, in order, each with its own ID in the
    header and the body, and are two distinct requests to the engine."""
    engine, engine_url = await fake_engine(max_tokens=2)
    server = await tether(engine_url)
    client = await RawClient.connect(server.port)
    body = chat_body(stream=False, max_tokens=2)
    await client.send(json_request(body, "first") + json_request(body, "second"))

    replies = [await client.read_reply(), await client.read_reply()]

    assert [reply.status for reply in replies] == [200, 200]
    assert [reply.headers["X-Request-Id"] for reply in replies] == ["first", "second"]
    assert [reply.json()["id"] for reply in replies] == ["chatcmpl-first", "chatcmpl-second"]
    assert len(engine.generations) == 2
    assert all(g.state is GenerationState.COMPLETED for g in engine.generations.values())
    await settled(server)
    assert (
        metric(
            server.context.metrics.registry, "tether_request_outcomes_total", outcome="completed"
        )
        == 2
    )


async def test_http_1_0_client_gets_the_whole_stream_delimited_by_close(
    fake_engine: FakeEngineFactory, tether: TetherFactory
) -> None:
    """An HTTP/1.0 client (no chunked encoding) gets a streamed response complete, ended by
    the connection closing, with its own ID in every event."""
    _, engine_url = await fake_engine(max_tokens=20)
    server = await tether(engine_url)
    client = await RawClient.connect(server.port)
    payload = json.dumps(chat_body(max_tokens=20)).encode()
    await client.send(
        request_head(
            version="HTTP/1.0",
            headers=[
                ("Content-Type", "application/json"),
                ("Content-Length", str(len(payload))),
                ("X-Request-Id", "old-client"),
            ],
        )
        + payload,
    )

    reply = await client.read_reply()  # no length, no chunks: read until close

    assert (reply.version, reply.status) == ("HTTP/1.0", 200)
    assert "Transfer-Encoding" not in reply.headers and "Content-Length" not in reply.headers
    text = reply.body.decode()
    assert text.endswith("data: [DONE]\n\n")
    assert text.count(" tok") == 20
    assert set(sse_ids(text)) == {"chatcmpl-old-client"}
    await settled(server)
    assert (
        metric(
            server.context.metrics.registry, "tether_request_outcomes_total", outcome="completed"
        )
        == 1
    )


# --- a client that half-closes after sending its request --------------------------------------


async def test_half_close_after_the_request_is_a_disconnect(
    fake_engine: FakeEngineFactory, tether: TetherFactory
) -> None:
    """`shutdown(SHUT_WR)` after a complete request reads as the client leaving: aiohttp closes
    the connection on EOF, tether cancels the handler and aborts upstream (as nginx does); the
    client gets no response."""
    engine, engine_url = await fake_engine(token_interval=0.01)
    server = await tether(engine_url)
    client = await RawClient.connect(server.port)
    await client.send_request(chat_body(stream=False, max_tokens=10_000))
    await engine.wait_for(lambda: len(engine.generations) == 1)
    [internal_id] = engine.generations

    client.half_close()

    assert await client.read_to_end() == b""
    await engine.wait_for(lambda: engine.generation(internal_id).state is GenerationState.ABORTED)
    assert engine.aborts[0].ids == (f"chatcmpl-{internal_id}",)
    await settled(server)
    registry = server.context.metrics.registry
    assert metric(registry, "tether_client_disconnects_total", phase="waiting") == 1
    assert metric(registry, "tether_request_outcomes_total", outcome="client_disconnected") == 1
    assert metric(registry, "tether_request_outcomes_total", outcome="completed") == 0


async def test_half_close_right_after_sending_leaves_nothing_running(
    fake_engine: FakeEngineFactory, tether: TetherFactory
) -> None:
    """A client that sends its request and half-closes in the same breath gets no response and
    leaves nothing running: whatever the engine started is aborted."""
    engine, engine_url = await fake_engine(token_interval=0.01)
    # The abort may overtake the request at the engine here: the repeated abort covers it.
    server = await tether(engine_url, abort_repeat_delay=0.05)
    clients = [await RawClient.connect(server.port) for _ in range(5)]
    for client in clients:
        payload = json.dumps(chat_body(stream=False, max_tokens=10_000)).encode()
        client.writer.write(
            request_head(
                headers=[
                    ("Content-Type", "application/json"),
                    ("Content-Length", str(len(payload))),
                ]
            )
            + payload
        )
        client.half_close()

    for client in clients:
        assert await client.read_to_end() == b""
    await settled(server)
    await drained(server)
    await engine.wait_for(
        lambda: all(g.state is GenerationState.ABORTED for g in engine.generations.values())
    )
    registry = server.context.metrics.registry
    assert metric(registry, "tether_request_outcomes_total", outcome="completed") == 0
    assert (
        len(engine.generations)
        <= metric(registry, "tether_request_outcomes_total", outcome="client_disconnected")
        <= 5
    )


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


async def test_slow_reader_paces_the_engine_with_bounded_memory(
    upstream_app: UpstreamAppFactory, tether: TetherFactory
) -> None:
    """A client reading 1 KB every 50 ms from a 16 MB stream: tether's memory stays bounded
    (it stops reading the engine while the client's socket is full), the engine's writes
    block instead of running ahead, and when the client leaves the engine's connection is
    dropped (a route whose engine ID tether cannot name: no guessed abort call)."""
    engine, progress = big_stream_engine()
    server = await tether(await upstream_app(engine.app))
    total = EVENTS * EVENT_SIZE
    client = await RawClient.connect(server.port, receive_buffer=4096)
    await client.send(
        request_head("/v1/big", headers=[("Content-Length", "0"), ("X-Request-Id", "slow")])
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

    client.close_rst()

    await asyncio.wait_for(progress["connection_lost"].wait(), 5)
    await settled(server)
    assert engine.aborts == []
    registry = server.context.metrics.registry
    assert metric(registry, "tether_aborts_total", engine="vllm", result="unknown_route") == 1
    assert metric(registry, "tether_client_disconnects_total", phase="streaming") == 1
    assert metric(registry, "tether_response_bytes_total") < total / 2


# --- bodies built to cost: tether's memory and the others' wait stay bounded ------------------

MIB = 2**20


def _tiny_containers(unit: bytes, size: int) -> bytes:
    """A chat request of about `size` bytes whose messages are copies of `unit` (`{}`, `[]`)."""
    head, tail = b'{"model": "m", "max_tokens": 1, "messages": [', b"]}"
    return head + b",".join([unit] * ((size - len(head) - len(tail)) // (len(unit) + 1))) + tail


def _deep_nesting(size: int) -> bytes:
    depth = (size - 40) // 2
    return b'{"model": "m", "messages": ' + b"[" * depth + b"]" * depth + b"}"


def _reset_peak_memory(pid: int) -> None:
    pathlib.Path(f"/proc/{pid}/clear_refs").write_text("5")


def _memory(pid: int, field: str) -> int:
    """A process's resident memory (VmRSS), or its peak since the last reset (VmHWM)."""
    for line in pathlib.Path(f"/proc/{pid}/status").read_text().splitlines():
        name, _, value = line.partition(":")
        if name == field:
            return int(value.split()[0]) * 1024
    raise AssertionError(f"no {field} for process {pid}")


async def _costly_body_answered(
    http: aiohttp.ClientSession,
    tether_pid: int,
    url: str,
    port: int,
    body: bytes,
    *,
    path: str = "/v1/chat/completions",
) -> tuple[int, int, float]:
    """Send `body` while another client keeps asking: the status tether answered it with,
    how far tether's resident memory rose above where it was, and the longest the other
    client waited for an answer meanwhile."""
    _reset_peak_memory(tether_pid)
    before = _memory(tether_pid, "VmRSS")
    sending = asyncio.Event()
    done = asyncio.Event()
    waits: list[float] = []

    async def other_client() -> None:
        # A request tether answers itself (an ID it cannot echo: 400), so that only tether's
        # time counts, not the engine's parsing of a body tether let through.
        unusable_id = {"X-Request-Id": "x" * 300}
        while not done.is_set():
            started = time.monotonic()
            async with http.post(url, json=chat_body(), headers=unusable_id) as response:
                assert response.status == 400
                await response.read()
            if sending.is_set():
                waits.append(time.monotonic() - started)

    other = asyncio.create_task(other_client())
    try:
        client = await RawClient.connect(port)
        sending.set()
        await client.send_request(body, path=path)
        reply = await client.read_reply(timeout=60)
        client.close_fin()
    finally:
        done.set()
        await asyncio.wait_for(other, 30)
    return reply.status, _memory(tether_pid, "VmHWM") - before, max(waits)


@pytest.mark.parametrize(
    ("body", "status"),
    [
        pytest.param(_tiny_containers(b"{}", 2 * MIB), 200, id="2MiB-tiny-objects"),
        pytest.param(_tiny_containers(b"{}", 8 * MIB), 413, id="8MiB-tiny-objects"),
        pytest.param(_tiny_containers(b"{}", 31 * MIB), 413, id="31MiB-tiny-objects"),
        pytest.param(_tiny_containers(b"[]", 2 * MIB), 200, id="2MiB-tiny-arrays"),
        pytest.param(_tiny_containers(b"[]", 31 * MIB), 413, id="31MiB-tiny-arrays"),
        pytest.param(_deep_nesting(31 * MIB), 413, id="31MiB-deep-nesting"),
    ],
)
async def test_a_body_built_to_cost_costs_tether_a_few_times_its_size(
    engine_process: EngineProcessFactory,
    tether_process: TetherProcessFactory,
    http: aiohttp.ClientSession,
    body: bytes,
    status: int,
) -> None:
    """Up to 31 MiB (the default TETHER_MAX_JSON_BODY) of tiny objects, tiny arrays or
    nesting where tether writes its ID into the JSON (SGLang's rid): tether's memory grows by
    a few times the body, never by the tens of times decoding it would cost, and another
    client is answered meanwhile. Past a million strings, arrays and objects the body is
    refused with an OpenAI-style 413."""
    engine = await engine_process("--abort-route", "sglang", "--token-interval", "0")
    process = await tether_process(engine.url, TETHER_ENGINE="sglang")
    url = process.url()
    async with http.post(url, json=chat_body(stream=False, max_tokens=1)) as response:
        assert response.status == 200  # warm: the first request's own allocations are done

    answered, grown, longest_wait = await _costly_body_answered(
        http, process.pid, url, process.port, body
    )

    # The body as it arrived (aiohttp's pieces), joined, and a copy on its way upstream;
    # decoding it whole took 27 times its size (870 MiB for 31 MiB of `{}`).
    assert grown < 3 * len(body) + 16 * MIB, f"{grown / MIB:.0f} MiB"
    # Decoding 31 MiB of tiny arrays whole held the loop for 6 to 8 s; scanning them takes
    # tens of milliseconds compiled, about a second in pure Python on a loaded machine, and
    # up to 3.2 s with CI's two suites and a compile beside it on two cores.
    assert longest_wait < 5.0
    assert answered == status


@pytest.mark.parametrize(
    ("engine", "path", "body", "code"),
    [
        pytest.param(
            "sglang",
            "/v1/chat/completions",
            json.dumps({**chat_body(max_tokens=100), "rid": "r" * (4 * MIB)}).encode(),
            "invalid_request_id",
            id="4MB-body-rid",
        ),
        pytest.param(
            "vllm",
            "/v1/completions",
            json.dumps(
                {
                    "model": "m",
                    "stream": True,
                    "prompt": [f"prompt {i:032}" for i in range(480_000)],
                }
            ).encode(),
            "too_many_engine_requests",
            id="20MB-batch",
        ),
    ],
)
async def test_an_id_or_batch_built_to_amplify_costs_tether_a_few_times_its_size(
    engine_process: EngineProcessFactory,
    tether_process: TetherProcessFactory,
    http: aiohttp.ClientSession,
    engine: str,
    path: str,
    body: bytes,
    code: str,
) -> None:
    """A 4 MB body `rid` (echoed into every event, it made 424 MB of answer and 466 MiB of
    tether on vLLM 0.32) and a 20 MB batch (one 243 MB abort body and 1.1 GiB): refused with
    an OpenAI-style 400 before the engine sees them, tether's memory growing by a few times
    what the client sent, another client answered meanwhile."""
    abort_route = "sglang" if engine == "sglang" else "dev"
    engine_server = await engine_process("--abort-route", abort_route, "--token-interval", "0")
    process = await tether_process(engine_server.url, TETHER_ENGINE=engine)
    url = process.url()
    async with http.post(url, json=chat_body(stream=False, max_tokens=1)) as response:
        assert response.status == 200  # warm

    status, grown, longest_wait = await _costly_body_answered(
        http, process.pid, url, process.port, body, path=path
    )

    assert status == 400
    assert grown < 3 * len(body) + 16 * MIB, f"{grown / MIB:.0f} MiB"
    assert longest_wait < 3.0
