"""One client's bytes never reach another's request or response: the engine connection is as
strict as nginx's. Each finding of the protocol review is a test here, against engines scripted
byte by byte (and uvicorn + FastAPI, the stack vLLM and SGLang run), with nginx run in the
same test where it is installed, configured as an operator runs it before an engine
(upstream keep-alive, `proxy_request_buffering off`)."""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AsyncExitStack
from dataclasses import dataclass
from typing import Any, Protocol

import aiohttp
import pytest

from proxy.server.runner import TetherServer
from tether_fake_engine import AbortRoute

from .support.in_process import TetherFactory
from .support.metrics import metric
from .support.net import free_port
from .support.nginx import nginx_binary, nginx_in_front_of
from .support.raw_http import RawClient, Reply, request_head
from .support.scripted_engine import CLOSE, Response, ScriptedEngine, SeenRequest, http_response
from .support.upstreams import FakeEngineFactory
from .support.waiting import poll_until

VIAS = [
    "tether",
    pytest.param(
        "nginx",
        marks=pytest.mark.skipif(nginx_binary() is None, reason="nginx is not installed"),
    ),
]


@dataclass
class Front:
    """Where clients connect: tether (in-process, so its pool can be looked at) or nginx."""

    port: int
    tether: TetherServer | None = None


class FrontFactory(Protocol):
    """The `front` fixture: nginx or tether (with settings `overrides`) before an engine."""

    def __call__(self, via: str, engine_port: int, **overrides: Any) -> Awaitable[Front]: ...


@pytest.fixture
async def front(tether: TetherFactory) -> AsyncIterator[FrontFactory]:
    async with AsyncExitStack() as stack:

        async def start(via: str, engine_port: int, **settings: Any) -> Front:
            if via == "nginx":
                return Front(await stack.enter_async_context(nginx_in_front_of(engine_port)))
            server = await tether(
                f"http://127.0.0.1:{engine_port}", health_interval=5.0, **settings
            )
            return Front(server.port, server)

        yield start


EngineFactory = Callable[[Callable[[SeenRequest], Response]], Awaitable[ScriptedEngine]]


@pytest.fixture
async def scripted_engine() -> AsyncIterator[EngineFactory]:
    engines: list[ScriptedEngine] = []

    async def start(respond: Callable[[SeenRequest], Response]) -> ScriptedEngine:
        engine = await ScriptedEngine(respond).start()
        engines.append(engine)
        return engine

    yield start
    for engine in engines:
        await engine.close()


def _served(request: SeenRequest) -> bytes:
    return http_response(200, json.dumps({"served": request.headers.get("X-Client")}).encode())


def _client_requests(engine: ScriptedEngine) -> list[SeenRequest]:
    return [r for r in engine.requests if r.path != "/health"]


def _forwarded_length(request: SeenRequest) -> int:
    """The bytes a proxy wrote for `request`: its head as `Name: value` lines, and its body."""
    head = request_head(request.path, method=request.method, headers=list(request.headers.items()))
    # request_head adds a `Host: tether` line of its own; the engine recorded the real one.
    return len(head) - len("Host: tether\r\n") + len(request.body)


def _smuggled_abort(size: int) -> bytes:
    """`POST /abort_requests` (an empty body: abort everything, on vLLM's dev route) padded
    with a body of its own to exactly `size` bytes, the length of the victim's request: an
    engine discarding the attacker's body by its length, with the victim's request swallowed
    into it, then parses this as a request."""
    padding = 0
    while True:
        head = b"POST /abort_requests HTTP/1.1\r\nHost: engine\r\nContent-Length: %d\r\n\r\n"
        request = head % padding + b"z" * padding
        if len(request) == size:
            return request
        padding += size - len(request)


async def _victim(port: int) -> bytes:
    client = await RawClient.connect(port)
    payload = b'{"messages":[]}'
    await client.send(
        request_head(
            headers=[
                ("Content-Type", "application/json"),
                ("Content-Length", str(len(payload))),
                ("X-Client", "victim"),
            ]
        )
        + payload
    )
    try:
        reply = await client.read_reply(timeout=3)
    except (TimeoutError, asyncio.IncompleteReadError, ConnectionError):
        return b"(no answer)"
    finally:
        client.close_fin()
    return reply.body


async def _answered_early(
    client: RawClient, front: Front, engine_saw_it: Callable[[], Awaitable[bool]]
) -> asyncio.Task[Reply]:
    """Until the engine has parsed the client's head (and so written its early answer) and
    that answer reached the proxy: the client is reading it, or (a proxy that holds it back
    while it waits for the rest of the body) tether pooled the connection it came on.
    Returns the client's read of its answer."""
    await poll_until(engine_saw_it, 5, what="the engine to parse the early-answered head")
    reply = asyncio.create_task(client.read_reply())

    def arrived() -> bool:
        pooled = front.tether is not None and front.tether.context.upstream.idle_connections > 0
        return pooled or reply.done()

    await poll_until(arrived, 5, what="the early answer to reach the proxy")
    return reply


def _closed(engine: ScriptedEngine, connection: int) -> Callable[[], bool]:
    return lambda: engine.transports[connection] is None


def _parsed(engine: ScriptedEngine, path: str) -> Callable[[], Awaitable[bool]]:
    async def seen() -> bool:
        return any(request.path == path for request in engine.requests)

    return seen


# --- 1. request smuggling through an early answer ----------------------------------------------


@pytest.mark.parametrize("via", VIAS)
async def test_an_early_answer_never_lets_a_request_into_another_clients_body(
    scripted_engine: EngineFactory, front: FrontFactory, via: str
) -> None:
    """The attack: `POST /nope` with a length, half its body sent; the engine answers 404 at
    once and discards the rest by length, keeping the connection. A victim's request must not
    be written into that body, and the attacker's second half, an `/abort_requests` sized to
    start where the engine's discarding ends, must never be parsed as a request."""

    def respond(request: SeenRequest) -> Response:
        if request.path == "/health":
            return [http_response()]
        if request.path == "/v1/chat/completions":
            return [_served(request)] if request.complete else None
        if request.path == "/abort_requests":
            return [http_response(200, b'{"status":"aborted"}')] if request.complete else None
        return [http_response(404, b'{"detail":"Not Found"}')]  # early: before the body

    engine = await scripted_engine(respond)
    proxy = await front(via, engine.port)
    # How long the victim's request is on the engine's side (the smuggled request must start
    # exactly where the victim's ends), measured on a request of its own.
    assert await _victim(proxy.port) == b'{"served": "victim"}'
    victim_length = _forwarded_length(_client_requests(engine)[-1])

    part1 = b"0123456789"
    part2 = b"x" * 64 + _smuggled_abort(victim_length)
    attacker = await RawClient.connect(proxy.port)
    await attacker.send(
        request_head(
            "/nope",
            headers=[
                ("Content-Type", "text/plain"),
                ("Content-Length", str(len(part1) + len(part2))),
            ],
        )
        + part1
    )
    answer = await _answered_early(attacker, proxy, _parsed(engine, "/nope"))
    victim_answer = await _victim(proxy.port)
    await attacker.send(part2)
    attacker_answer = await answer
    attacker.close_fin()

    assert victim_answer == b'{"served": "victim"}'
    assert attacker_answer.status == 404
    assert ("POST", "/abort_requests") not in engine.seen()
    assert [r.headers.get("X-Client") for r in _client_requests(engine) if r.path != "/nope"] == [
        "victim",
        "victim",
    ]


@pytest.mark.parametrize("via", VIAS)
async def test_an_early_answer_to_a_streamed_body_does_not_break_the_next_request(
    scripted_engine: EngineFactory, front: FrontFactory, via: str
) -> None:
    """No attacker: an engine's early 413 to a body that is still arriving (the client sends
    it in two parts), then an ordinary request from another client: it gets its own answer,
    and the first client its 413."""

    def respond(request: SeenRequest) -> Response:
        if request.path == "/health":
            return [http_response()]
        if request.path == "/v1/chat/completions":
            return [_served(request)] if request.complete else None
        return [http_response(413, b'{"detail":"too large"}')]

    engine = await scripted_engine(respond)
    proxy = await front(via, engine.port)
    uploader = await RawClient.connect(proxy.port)
    await uploader.send(
        request_head(
            "/v1/audio/transcriptions",
            headers=[("Content-Type", "audio/wav"), ("Content-Length", "200")],
        )
        + b"R" * 100
    )
    answer = await _answered_early(uploader, proxy, _parsed(engine, "/v1/audio/transcriptions"))

    assert await _victim(proxy.port) == b'{"served": "victim"}'
    await uploader.send(b"R" * 100)
    assert (await answer).status == 413
    uploader.close_fin()
    # No client's bytes landed inside another's body: the engine could parse all it got, and
    # parsed the victim's request once.
    assert engine.unparseable == 0
    assert [r.headers.get("X-Client") for r in _client_requests(engine)] == [None, "victim"]


@pytest.mark.parametrize("http_impl", ["httptools", "h11"])
@pytest.mark.parametrize("via", VIAS)
async def test_smuggling_fails_against_uvicorn_and_fastapi(
    front: FrontFactory, via: str, http_impl: str
) -> None:
    """The same attack against a real uvicorn + FastAPI engine (both of uvicorn's parsers):
    FastAPI's 404 for an unknown path goes out before the body is read, and uvicorn discards
    the rest by its length. uvicorn never parses the smuggled `/abort_requests`, and the
    victim gets its own answer."""
    port = free_port()
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "uvicorn",
        "tests.support.fastapi_engine:app",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--http",
        http_impl,
        "--log-level",
        "warning",
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.DEVNULL,
    )
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as http:

            async def up() -> bool:
                async with http.get(f"http://127.0.0.1:{port}/health") as response:
                    return response.status == 200

            await poll_until(up, 20, what="uvicorn to listen", ignoring=(aiohttp.ClientError,))
            proxy = await front(via, port)

            async def seen() -> list[dict[str, object]]:
                async with http.get(f"http://127.0.0.1:{port}/_seen") as response:
                    answer: list[dict[str, object]] = await response.json()
                    return answer

            assert await _victim(proxy.port) == b'{"served":"victim"}'
            victim_length = int(str((await seen())[-1]["head_bytes"])) + len(b'{"messages":[]}')
            part1 = b"0123456789"
            part2 = b"x" * 64 + _smuggled_abort(victim_length)
            attacker = await RawClient.connect(proxy.port)
            await attacker.send(
                request_head(
                    "/nope",
                    headers=[
                        ("Content-Type", "text/plain"),
                        ("Content-Length", str(len(part1) + len(part2))),
                    ],
                )
                + part1
            )

            async def nope_parsed() -> bool:
                return any(entry["path"] == "/nope" for entry in await seen())

            answer = await _answered_early(attacker, proxy, nope_parsed)
            victim_answer = await _victim(proxy.port)
            await attacker.send(part2)
            attacker_status = (await answer).status
            attacker.close_fin()
            parsed = [(entry["method"], entry["path"], entry["client"]) for entry in await seen()]
    finally:
        process.terminate()
        await asyncio.wait_for(process.wait(), 10)

    assert victim_answer == b'{"served":"victim"}'
    assert attacker_status == 404
    assert ("POST", "/abort_requests", None) not in parsed
    assert [entry for entry in parsed if entry[1] != "/nope"] == [
        ("POST", "/v1/chat/completions", "victim"),
        ("POST", "/v1/chat/completions", "victim"),
    ]


# --- 2. trailers -------------------------------------------------------------------------------


@pytest.mark.parametrize("via", VIAS)
async def test_trailers_reach_neither_their_client_nor_the_next(
    scripted_engine: EngineFactory, front: FrontFactory, via: str
) -> None:
    """A chunked response ending in trailer fields (another user's `Set-Cookie`, a
    `Content-Type`): the next client on the pooled connection gets its own headers only, and
    the trailers are dropped (nginx drops upstream trailers too)."""
    served = 0

    def respond(request: SeenRequest) -> Response:
        nonlocal served
        if request.path == "/health":
            return [http_response()]
        if not request.complete:
            return None
        served += 1
        if served == 1:
            return [
                b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                b"Transfer-Encoding: chunked\r\n\r\n2\r\n{}\r\n0\r\n"
                b"Set-Cookie: session=first-users\r\nContent-Type: text/html\r\n\r\n"
            ]
        return [_served(request)]

    engine = await scripted_engine(respond)
    proxy = await front(via, engine.port)
    client = await RawClient.connect(proxy.port)
    await client.send(request_head(headers=[("Content-Length", "2")]) + b"{}")
    first = await client.read_reply()
    client.close_fin()
    second_client = await RawClient.connect(proxy.port)
    await second_client.send(
        request_head(headers=[("Content-Length", "2"), ("X-Client", "second")]) + b"{}"
    )
    second = await second_client.read_reply()
    second_client.close_fin()

    assert first.body == b"{}" and "Set-Cookie" not in first.headers
    assert second.body == b'{"served": "second"}'
    assert "Set-Cookie" not in second.headers
    assert second.headers.getall("Content-Type") == ["application/json"]


# --- 3. bytes past the end of a response ---------------------------------------------------------


LEFTOVERS = {
    "partial-head": b"HTTP/1.1 200 OK\r\nX-Injected: yes",
    "head-with-length": b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\n",
    "whole-response": http_response(200, b'{"served": "nobody"}'),
}


@pytest.mark.parametrize("leftover", LEFTOVERS)
@pytest.mark.parametrize("via", VIAS)
async def test_bytes_after_a_response_never_reach_the_next_client(
    scripted_engine: EngineFactory, front: FrontFactory, via: str, leftover: str
) -> None:
    """An engine writes more than its response in the same read (a partial head, a head with
    a length, a whole extra response): the connection is not reused, and the next client gets
    its own answer, never the leftover (nginx: "upstream sent more data than specified")."""
    served = 0

    def respond(request: SeenRequest) -> Response:
        nonlocal served
        if request.path == "/health":
            return [http_response()]
        if not request.complete:
            return None
        served += 1
        if served == 1:
            return [http_response(200, b'{"served": "first"}') + LEFTOVERS[leftover]]
        return [_served(request)]

    engine = await scripted_engine(respond)
    proxy = await front(via, engine.port)
    replies = []
    for name in ("first", "second"):
        client = await RawClient.connect(proxy.port)
        await client.send(
            request_head(headers=[("Content-Length", "2"), ("X-Client", name)]) + b"{}"
        )
        replies.append(await client.read_reply())
        client.close_fin()

    assert replies[0].status == 200 and replies[0].body == b'{"served": "first"}'
    assert replies[1].status == 200 and replies[1].body == b'{"served": "second"}'
    assert "X-Injected" not in replies[1].headers
    first, second = (r for r in _client_requests(engine))
    assert first.connection != second.connection


@pytest.mark.parametrize("via", VIAS)
async def test_bytes_after_a_response_in_a_later_read_close_the_idle_connection(
    scripted_engine: EngineFactory, front: FrontFactory, via: str
) -> None:
    """Bytes that arrive later on a pooled connection nobody asked anything of close it: the
    next client's request goes on a new connection and gets its own answer."""

    def respond(request: SeenRequest) -> Response:
        if request.path == "/health":
            return [http_response()]
        return [_served(request)] if request.complete else None

    engine = await scripted_engine(respond)
    proxy = await front(via, engine.port)
    replies = []
    for name in ("first", "second"):
        client = await RawClient.connect(proxy.port)
        await client.send(
            request_head(headers=[("Content-Length", "2"), ("X-Client", name)]) + b"{}"
        )
        replies.append(await client.read_reply())
        client.close_fin()
        if name == "first":
            [answered] = _client_requests(engine)
            engine.write_unasked(answered.connection, http_response(200, b'{"served": "nobody"}'))
            await poll_until(
                _closed(engine, answered.connection),
                5,
                what="the proxy to close the connection the stray bytes came on",
            )

    assert [reply.body for reply in replies] == [b'{"served": "first"}', b'{"served": "second"}']
    first, second = _client_requests(engine)
    assert first.connection != second.connection


# --- 4. framing read in one place ----------------------------------------------------------------


@pytest.mark.parametrize(
    "head",
    [
        pytest.param(
            b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
            b"Transfer-Encoding: gzip\r\nTransfer-Encoding: chunked\r\n\r\n",
            id="two-coding-lines",
        ),
        pytest.param(
            b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n",
            id="chunked",
        ),
        pytest.param(
            b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nContent-Length: 1000\r\n\r\n",
            id="content-length",
        ),
    ],
)
@pytest.mark.parametrize("via", VIAS)
async def test_a_truncated_body_is_never_passed_as_complete(
    scripted_engine: EngineFactory, front: FrontFactory, via: str, head: bytes
) -> None:
    """The engine dies inside its body, whatever its framing (`Transfer-Encoding` on two
    lines, `gzip` then `chunked`, included): the client gets an error answer or a cut stream,
    never a terminating chunk or a short body of the announced length."""
    event = b'data: {"choices":[{"delta":{"content":"tok0"}}]}\n\n'
    chunked = b"chunked" in head

    def respond(request: SeenRequest) -> Response:
        if request.path == "/health":
            return [http_response()]
        if not request.complete:
            return None
        body = b"%x\r\n%b\r\n" % (len(event), event) + b"100\r\npartial" if chunked else event
        return [head + body, CLOSE]

    engine = await scripted_engine(respond)
    proxy = await front(via, engine.port)
    client = await RawClient.connect(proxy.port)
    await client.send(request_head(headers=[("Content-Length", "2")]) + b"{}")
    received = await client.read_until(b"\r\n\r\n")
    status = int(received.split(b" ", 2)[1])
    if status == 200:
        received += await client.read_until_cut()
    client.close_fin()

    if status == 200:
        assert not received.endswith(b"0\r\n\r\n"), "a terminating chunk ended a cut body"
        reply_head, _, body = received.partition(b"\r\n\r\n")
        if b"Content-Length" in reply_head:
            length = int(reply_head.split(b"Content-Length: ")[1].split(b"\r\n")[0])
            assert len(body) < length
    else:
        assert status == 502


# --- 5. a POST is never sent twice ---------------------------------------------------------------


@pytest.mark.parametrize("via", VIAS)
async def test_a_post_the_engine_may_have_read_is_not_sent_again(
    scripted_engine: EngineFactory, front: FrontFactory, via: str
) -> None:
    """The engine reads the second request on a reused connection and closes without a word:
    for a POST the client gets a 502 and the engine saw it once (a generation never runs
    twice)."""
    per_connection: dict[int, int] = {}

    def respond(request: SeenRequest) -> Response:
        if request.path == "/health":
            return [http_response()]
        if not request.complete:
            return None
        per_connection[request.connection] = per_connection.get(request.connection, 0) + 1
        if per_connection[request.connection] > 1:
            return CLOSE
        return [_served(request)]

    engine = await scripted_engine(respond)
    proxy = await front(via, engine.port)
    statuses = []
    for name in ("first", "second"):
        client = await RawClient.connect(proxy.port)
        await client.send(
            request_head(headers=[("Content-Length", "2"), ("X-Client", name)]) + b"{}"
        )
        statuses.append((await client.read_reply()).status)
        client.close_fin()

    assert statuses == [200, 502]
    assert [r.headers.get("X-Client") for r in _client_requests(engine)] == ["first", "second"]


async def test_an_idempotent_request_on_a_stale_connection_is_sent_again(
    scripted_engine: EngineFactory, front: FrontFactory
) -> None:
    """A GET the engine dropped the same way is safe to send again: the client gets its
    answer from a second connection."""
    per_connection: dict[int, int] = {}

    def respond(request: SeenRequest) -> Response:
        if request.path == "/health":
            return [http_response()]
        per_connection[request.connection] = per_connection.get(request.connection, 0) + 1
        if per_connection[request.connection] > 1:
            return CLOSE
        return [_served(request)]

    engine = await scripted_engine(respond)
    proxy = await front("tether", engine.port)
    for name in ("first", "second"):
        client = await RawClient.connect(proxy.port)
        await client.send(request_head("/v1/models", method="GET", headers=[("X-Client", name)]))
        reply = await client.read_reply()
        client.close_fin()
        assert (reply.status, reply.body) == (200, json.dumps({"served": name}).encode())
    assert [r.headers.get("X-Client") for r in _client_requests(engine)] == [
        "first",
        "second",
        "second",
    ]


async def test_a_put_to_a_generation_route_on_a_stale_connection_is_not_sent_again(
    scripted_engine: EngineFactory, front: FrontFactory
) -> None:
    """SGLang's /generate takes PUT too: idempotent by its method, it starts a generation,
    which sent again would run twice. Dropped the same way, it gets a 502 and the engine
    saw it once."""
    per_connection: dict[int, int] = {}

    def respond(request: SeenRequest) -> Response:
        if request.path == "/health":
            return [http_response()]
        if not request.complete:
            return None
        per_connection[request.connection] = per_connection.get(request.connection, 0) + 1
        if per_connection[request.connection] > 1:
            return CLOSE
        return [_served(request)]

    engine = await scripted_engine(respond)
    proxy = await front("tether", engine.port, engine="sglang")
    statuses = []
    for name in ("first", "second"):
        client = await RawClient.connect(proxy.port)
        await client.send(
            request_head(
                "/generate",
                method="PUT",
                headers=[
                    ("Content-Length", "2"),
                    ("Content-Type", "text/plain"),
                    ("X-Client", name),
                ],
            )
            + b"{}"
        )
        statuses.append((await client.read_reply()).status)
        client.close_fin()

    assert statuses == [200, 502]
    assert [r.headers.get("X-Client") for r in _client_requests(engine)] == ["first", "second"]


# --- 6. the engine ID rewrite decided on what the engine will see --------------------------------


def _utf16(document: dict[str, object]) -> bytes:
    return json.dumps(document).encode("utf-16")


def _escaped(field: str) -> bytes:
    """A body naming `field` with every character as a `\\u` escape."""
    name = "".join(f"\\u{ord(char):04x}" for char in field)
    return b'{"' + name.encode() + b'": "victim", "messages": []}'


def _twice(field: str) -> bytes:
    return b'{"%b": "mine", "%b": "victim", "messages": []}' % (field.encode(), field.encode())


# How a client could try to get its own ID past tether: each case is the headers and body it
# sends, built around the field the engine keys requests by.
BYPASSES: dict[str, Callable[[str], tuple[list[tuple[str, str]], bytes]]] = {
    # tether once decided from the label not to read the body, then dropped the label as
    # named in Connection: the engine got an unlabelled body, which FastAPI parses as JSON.
    "connection-names-content-type": lambda field: (
        [("Content-Type", "text/plain"), ("Connection", "Content-Type")],
        json.dumps({field: "victim", "messages": []}).encode(),
    ),
    "empty-content-type": lambda field: (
        [("Content-Type", "")],
        json.dumps({field: "victim", "messages": []}).encode(),
    ),
    "no-content-type": lambda field: ([], json.dumps({field: "victim", "messages": []}).encode()),
    "text-plain": lambda field: (
        [("Content-Type", "text/plain")],
        json.dumps({field: "victim", "messages": []}).encode(),
    ),
    "utf-16-body": lambda field: (
        [("Content-Type", "text/plain")],
        _utf16({field: "victim", "messages": []}),
    ),
    "escaped-name": lambda field: (
        [("Content-Type", "application/json")],
        _escaped(field),
    ),
    "duplicate-field": lambda field: (
        [("Content-Type", "application/json")],
        _twice(field),
    ),
}


@pytest.mark.parametrize("bypass", BYPASSES)
@pytest.mark.parametrize(("engine", "field"), [("sglang", "rid"), ("vllm", "request_id")])
async def test_a_clients_own_engine_id_never_reaches_the_engine(
    fake_engine: FakeEngineFactory, tether: TetherFactory, engine: str, field: str, bypass: str
) -> None:
    """Whatever the client's Content-Type and Connection headers say, and however its JSON
    spells the field (UTF-16, `\\u` escapes, twice), the engine, which here parses any body as
    JSON as older FastAPI releases and `request.json()` handlers do, gets tether's ID in
    SGLang's `rid` and vLLM's body `request_id`, never the client's."""
    fake, engine_url = await fake_engine(
        abort_route=AbortRoute.SGLANG if engine == "sglang" else AbortRoute.DEV
    )
    server = await tether(engine_url, engine=engine)
    headers, body = BYPASSES[bypass](field)
    client = await RawClient.connect(server.port)
    await client.send(request_head(headers=[*headers, ("Content-Length", str(len(body)))]) + body)
    reply = await client.read_reply()
    client.close_fin()

    assert reply.status == 200, reply.body
    [seen] = fake.requests
    sent_type = [value for name, value in headers if name == "Content-Type"]
    assert seen.headers.getall("Content-Type", []) == sent_type  # the label tether read by
    internal_request_id = seen.headers["X-Request-Id"]
    assert json.loads(seen.body)[field] == internal_request_id
    assert b"victim" not in seen.body


@pytest.mark.parametrize("engine", ["sglang", "vllm"])
async def test_a_body_that_cannot_be_json_streams_through_untouched(
    fake_engine: FakeEngineFactory, tether: TetherFactory, engine: str
) -> None:
    """A multipart upload on a route where tether owns an ID field is not read whole: its
    first character says no engine can parse it as JSON, so it streams to the engine as it
    arrives (chunked), byte for byte. (Its rest follows once tether has begun sending the
    request: a body that arrived whole with its head goes on as it is, with its length.)"""
    fake, engine_url = await fake_engine()
    server = await tether(engine_url, engine=engine)
    body = b'--x\r\nContent-Disposition: form-data; name="file"\r\n\r\n' + b"R" * 70_000
    body += b"\r\n--x--\r\n"
    client = await RawClient.connect(server.port)
    await client.send(
        request_head(
            "/echo/upload",
            headers=[
                ("Content-Type", "multipart/form-data; boundary=x"),
                ("Transfer-Encoding", "chunked"),
            ],
        )
    )
    await client.send(b"%x\r\n%b\r\n" % (100, body[:100]))
    await poll_until(
        lambda: any(state.upstream is not None for state in server.context.registry),
        5,
        what="tether to send the request on",
    )
    await client.send(b"%x\r\n%b\r\n0\r\n\r\n" % (len(body) - 100, body[100:]))
    reply = await client.read_reply()
    client.close_fin()

    assert reply.status == 200
    [seen] = fake.requests
    assert seen.body == body
    assert seen.headers["Transfer-Encoding"] == "chunked"


# --- 7. request heads bounded as nginx bounds them ------------------------------------------------

# Header lines of this size: within nginx's 8 KiB buffers and aiohttp's 16 KiB line limit, so
# only the head's total decides.
_PAD_LINE = 4080


@pytest.mark.parametrize(("head_kib", "passes"), [(16, True), (40, False)])
@pytest.mark.parametrize("via", VIAS)
async def test_a_request_head_over_32_kib_never_reaches_the_engine(
    scripted_engine: EngineFactory, front: FrontFactory, via: str, head_kib: int, passes: bool
) -> None:
    """A request head of 16 KiB passes; one of 40 KiB (in 4 KB lines) is refused, by nginx
    past its 4 buffers of 8 KiB (400) and by tether past TETHER_MAX_REQUEST_HEAD, 32 KiB
    (431 JSON, counted as rejected), with the connection closed and nothing sent to the
    engine."""

    def respond(request: SeenRequest) -> Response:
        return [_served(request)] if request.complete else None

    engine = await scripted_engine(respond)
    proxy = await front(via, engine.port)
    padding = [(f"X-Pad-{n}", "p" * _PAD_LINE) for n in range(head_kib * 1024 // _PAD_LINE)]
    client = await RawClient.connect(proxy.port)
    head = request_head("/v1/models", method="GET", headers=[("X-Client", "big"), *padding])
    assert len(head) // 1024 == head_kib

    await client.send(head)
    reply = await client.read_reply()

    seen = [r.headers.get("X-Client") for r in _client_requests(engine)]
    if passes:
        assert (reply.status, seen) == (200, ["big"])
        return
    assert seen == []
    await client.expect_closed()
    if proxy.tether is None:
        assert reply.status == 400  # nginx: "Request Header Or Cookie Too Large"
        return
    assert reply.status == 431
    assert reply.json()["error"]["code"] == "request_header_fields_too_large"
    registry = proxy.tether.context.metrics.registry
    assert metric(registry, "tether_request_outcomes_total", outcome="rejected") == 1
