"""An engine (or a broken load balancer in front of it) whose reply is not valid HTTP/1.1:
before the response started the client gets a 502 JSON `upstream_protocol_error`, after it the
stream is cut; either way exactly one `request_finished` line and one metric update."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable

import aiohttp
import pytest

from proxy.server.runner import TetherServer

from .support.chat import chat_body
from .support.in_process import TetherFactory, settled, url
from .support.metrics import metric
from .support.raw_http import RawClient

RawEngineFactory = Callable[[list[bytes]], Awaitable[str]]


@pytest.fixture
async def raw_engine() -> AsyncIterator[RawEngineFactory]:
    """An engine that answers every request with the given bytes, written one piece after
    another (a short pause between them), then closes."""
    servers: list[asyncio.Server] = []

    async def start(pieces: list[bytes]) -> str:
        async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await reader.readuntil(b"\r\n\r\n")
            for piece in pieces:
                writer.write(piece)
                await writer.drain()
                await asyncio.sleep(0.05)
            writer.close()

        server = await asyncio.start_server(answer, "127.0.0.1", 0)
        servers.append(server)
        return f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"

    yield start
    for server in servers:
        server.close()
        await server.wait_closed()


def request_finished_lines(output: str) -> list[dict[str, object]]:
    events = [json.loads(line) for line in output.splitlines() if line.startswith("{")]
    return [event for event in events if event.get("event") == "request_finished"]


async def expect_502(server: TetherServer, http: aiohttp.ClientSession) -> dict[str, str]:
    async with http.post(url(server), json=chat_body(), headers={"X-Request-Id": "bad"}) as r:
        assert r.status == 502
        assert r.headers["X-Request-Id"] == "bad"
        error: dict[str, str] = (await r.json())["error"]
    await settled(server)
    return error


@pytest.mark.parametrize(
    "reply",
    [
        pytest.param([b"HTTP/1.1 2x0 OK\r\nContent-Length: 2\r\n\r\nok"], id="malformed-status"),
        pytest.param(
            [b"HTTP/1.1 200 OK\r\nX-Big: " + b"a" * 100_000 + b"\r\n\r\n"], id="head-over-limit"
        ),
        pytest.param(
            [b"HTTP/1.1 200 OK\r\nX-Big: ", b"a" * 40_000, b"a" * 40_000], id="head-dribbled"
        ),
        pytest.param([b"HTTP/1.1 200 OK\r\nContent-Le"], id="closed-inside-head"),
        pytest.param([b"HTTP/1.1 200 OK\r\nBad Header\r\n\r\n"], id="malformed-header"),
        pytest.param(
            [
                b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                b"Transfer-Encoding: chunked\r\n\r\nZZ\r\n"
            ],
            id="bad-first-chunk",
        ),
        pytest.param(
            [b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n"],
            id="ambiguous-framing",
        ),
    ],
)
async def test_unparseable_reply_is_a_502_json_error_logged_once(
    raw_engine: RawEngineFactory,
    tether: TetherFactory,
    http: aiohttp.ClientSession,
    capsys: pytest.CaptureFixture[str],
    reply: list[bytes],
) -> None:
    """Malformed status line or header, a head over the limit (at once or dribbled), a close
    inside the head, broken chunked framing: 502 `upstream_protocol_error`, one summary line,
    the error counted, nothing from aiohttp's own error page or logger."""
    server = await tether(await raw_engine(reply))
    error = await expect_502(server, http)

    assert error["code"] == "upstream_protocol_error"
    assert error["type"] == "upstream_error"
    registry = server.context.metrics.registry
    assert metric(registry, "tether_upstream_errors_total", kind="upstream_protocol_error") == 1
    assert metric(registry, "tether_request_outcomes_total", outcome="upstream_failed") == 1
    output = capsys.readouterr().out
    [finished] = request_finished_lines(output)
    assert (finished["status"], finished["outcome"]) == (502, "upstream_failed")
    assert "Error handling request" not in output


async def test_broken_chunk_framing_mid_stream_cuts_the_stream(
    raw_engine: RawEngineFactory, tether: TetherFactory, capsys: pytest.CaptureFixture[str]
) -> None:
    """After the first events went out, broken framing can only cut the client's stream (never
    a clean end, never a hang): one summary line with the 200 it started with."""
    head = (
        b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
    )
    event = b'data: {"choices":[{"delta":{"content":"tok0"}}]}\n\n'
    server = await tether(
        await raw_engine([head, b"%x\r\n%b\r\n" % (len(event), event), b"ZZ\r\nmore"])
    )
    client = await RawClient.connect(server.port)
    await client.send_request(chat_body())

    received = await client.read_until_cut()

    assert received.startswith(b"HTTP/1.1 200") and b"tok0" in received
    assert not received.endswith(b"0\r\n\r\n")  # no terminating chunk: the client sees a cut
    await settled(server)
    registry = server.context.metrics.registry
    assert metric(registry, "tether_upstream_errors_total", kind="upstream_protocol_error") == 1
    [finished] = request_finished_lines(capsys.readouterr().out)
    assert (finished["status"], finished["outcome"]) == (200, "upstream_failed")


async def test_engine_closing_before_any_reply_is_unavailable_not_a_protocol_error(
    raw_engine: RawEngineFactory, tether: TetherFactory, http: aiohttp.ClientSession
) -> None:
    """A close with no byte of reply is an engine that went away (502 upstream_unavailable),
    told apart from a reply that is broken."""
    server = await tether(await raw_engine([]))
    error = await expect_502(server, http)
    assert error["code"] == "upstream_unavailable"
