"""WebSocket sessions through tether (vLLM's Realtime API shape): a client talks to the engine
exactly as it would directly, and when it leaves (close, reset, or gone silent) the engine's
session ends at once, where straight to the engine a silent client keeps it running until
uvicorn's ping timeout.

The engine is uvicorn + FastAPI with `websockets`, as vLLM serves `/v1/realtime`
(tests/support/realtime_engine.py), in the test's event loop; the clients are the
`websockets` library and a raw socket."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import struct
import time
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
import websockets

from proxy.server.runner import TetherServer

from .support.in_process import TetherFactory, admin_url, settled, url
from .support.metrics import metric
from .support.packets import can_drop_packets, silenced
from .support.raw_http import RawClient, request_head
from .support.realtime_engine import RealtimeEngine, Session, realtime_engine

# From the client's reset (or tether's verdict on a silent one) to the engine's session
# ending: tether closes the engine's connection in the same loop turn; the rest is uvicorn.
SESSION_END_BOUND = 0.1


@pytest.fixture
async def engine() -> AsyncIterator[RealtimeEngine]:
    async with realtime_engine() as started:
        yield started


def ws_url(base: str) -> str:
    return base.replace("http://", "ws://") + "/v1/realtime"


async def wait_session(engine: RealtimeEngine, count: int) -> Session:
    """The `count`-th session the engine accepted, once it has."""
    await engine.wait_for(lambda: len(engine.sessions) >= count)
    return engine.sessions[count - 1]


async def conversation(base: str) -> dict[str, Any]:
    """One session as a Realtime client runs it, recorded: the handshake's outcome, every
    event both ways, a ping, a large binary frame each way, the client's close code."""
    record: dict[str, Any] = {}
    async with websockets.connect(
        ws_url(base),
        subprotocols=["realtime", "other"],  # type: ignore[list-item]
        compression="deflate",
        max_size=None,
    ) as ws:
        record["subprotocol"] = ws.subprotocol
        assert ws.response is not None
        record["extensions"] = ws.response.headers.get("Sec-WebSocket-Extensions")
        record["created"] = json.loads(await ws.recv())
        await ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": "AAAA"}))
        record["ack"] = json.loads(await ws.recv())
        await ws.send(json.dumps({"type": "echo", "text": "h\u00e9llo"}))
        record["echo"] = json.loads(await ws.recv())
        await ws.send(b"\x00\x01\xff")
        record["binary"] = await ws.recv()
        large = os.urandom(4 * 1024 * 1024)  # both directions fill their sockets' buffers
        await ws.send(large)
        record["large_back"] = await ws.recv() == large
        await (await ws.ping(b"are you there"))
        record["pong"] = True
        await ws.close(code=4000, reason="bye")
        record["close_code"] = ws.close_code
    return record


async def test_a_session_through_tether_is_the_session_straight(
    engine: RealtimeEngine, tether: TetherFactory
) -> None:
    """Handshake (subprotocol, permessage-deflate), text and binary frames both ways, 4 MB
    frames each way, ping/pong and the close code: the same straight and through tether,
    and the engine saw the same session, under tether's ID, with the client's frames."""
    server = await tether(engine.url)
    straight = await conversation(engine.url)
    through = await conversation(url(server, ""))

    assert through == straight
    assert straight["subprotocol"] == "realtime"
    assert "permessage-deflate" in (straight["extensions"] or "")
    assert straight["created"]["type"] == "session.created"
    assert straight["close_code"] == 4000
    direct, proxied = engine.sessions
    await asyncio.wait_for(proxied.ended.wait(), 5)
    assert direct.close_code == proxied.close_code == 4000
    assert [len(frame) for frame in proxied.received] == [len(frame) for frame in direct.received]
    assert proxied.request_id is not None and len(proxied.request_id) == 32
    assert direct.request_id is None
    await settled(server)


async def test_the_engine_closing_reaches_the_client_with_its_code(
    engine: RealtimeEngine, tether: TetherFactory
) -> None:
    """The engine ends the session (code 4001): the client gets that close frame and code,
    tether's connection to it closes, and the session counts as completed."""
    server = await tether(engine.url)
    async with websockets.connect(ws_url(url(server, ""))) as ws:
        await ws.recv()  # session.created
        await ws.send(json.dumps({"type": "close", "code": 4001, "reason": "done"}))
        with pytest.raises(websockets.ConnectionClosed):
            await asyncio.wait_for(ws.recv(), 5)
        assert (ws.close_code, ws.close_reason) == (4001, "done")
    await settled(server)
    registry = server.context.metrics.registry
    assert metric(registry, "tether_websocket_sessions_total", outcome="completed") == 1
    assert metric(registry, "tether_websocket_sessions_open") == 0


def handshake(headers: tuple[tuple[str, str], ...] = ()) -> bytes:
    key = base64.b64encode(os.urandom(16)).decode()
    return request_head(
        "/v1/realtime",
        method="GET",
        headers=(
            ("Upgrade", "websocket"),
            ("Connection", "Upgrade"),
            ("Sec-WebSocket-Key", key),
            ("Sec-WebSocket-Version", "13"),
            *headers,
        ),
    )


def client_frame(text: str) -> bytes:
    """A masked text frame (every client frame is masked, RFC 6455 §5.3)."""
    payload = text.encode()
    mask = os.urandom(4)
    masked = bytes(byte ^ mask[index % 4] for index, byte in enumerate(payload))
    assert len(payload) < 126
    return struct.pack("!BB", 0x81, 0x80 | len(payload)) + mask + masked


async def transcribing_session(port: int, engine: RealtimeEngine, count: int) -> RawClient:
    """A raw client whose session is transcribing (the engine sends deltas until it ends)."""
    client = await RawClient.connect(port)
    await client.send(handshake((("X-Request-Id", f"raw-{count}"),)))
    head = await client.read_until(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 101 "), head
    await client.send(client_frame(json.dumps({"type": "input_audio_buffer.commit"})))
    session = await wait_session(engine, count)
    await engine.wait_for(lambda: session.deltas_sent >= 3)
    return client


@pytest.mark.parametrize("how", ["rst", "fin"])
async def test_a_client_that_leaves_mid_session_ends_it_within_100_ms(
    engine: RealtimeEngine, tether: TetherFactory, how: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """A client whose socket resets (or closes) while the engine transcribes: the engine's
    session ends within 100 ms, counted and logged once with both IDs and the duration."""
    server = await tether(engine.url)
    client = await transcribing_session(server.port, engine, 1)
    session = engine.sessions[0]
    left_at = time.monotonic()
    client.close(how)
    await asyncio.wait_for(session.ended.wait(), 5)
    assert session.ended_at is not None
    assert session.ended_at - left_at < SESSION_END_BOUND
    await settled(server)
    registry = server.context.metrics.registry
    assert metric(registry, "tether_websocket_sessions_total", outcome="client_disconnected") == 1
    assert metric(registry, "tether_websocket_sessions_open") == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line[:1] == "{"]
    [finished] = [line for line in lines if line.get("event") == "request_finished"]
    assert finished["client_request_id"] == "raw-1"
    assert finished["internal_request_id"] == session.request_id
    assert finished["outcome"] == "client_disconnected"
    assert finished["duration_ms"] > 0 and finished["websocket_bytes_in"] > 0


@pytest.mark.skipif(not can_drop_packets(), reason="needs root and a working iptables")
@pytest.mark.timeout(30)
async def test_a_client_gone_silent_ends_its_session_when_keepalive_finds_it(
    engine: RealtimeEngine, tether: TetherFactory
) -> None:
    """A client that vanishes without a FIN or RST: tether's TCP keepalive (idle 1 s here,
    3 probes 1 s apart) finds it gone and the engine's session ends within 100 ms of that.
    The same client straight to the engine keeps its session (and its transcription)
    running: uvicorn would notice only at its ping timeout, 20 s later."""
    server: TetherServer = await tether(engine.url, tcp_keepalive_idle=1)
    proxied_client = await transcribing_session(server.port, engine, 1)
    engine_port = int(engine.url.rsplit(":", 1)[1])
    direct_client = await transcribing_session(engine_port, engine, 2)
    proxied, direct = engine.sessions
    with silenced(proxied_client, server.port), silenced(direct_client, engine_port):
        gone_at = time.monotonic()
        await asyncio.wait_for(proxied.ended.wait(), 15)
        assert proxied.ended_at is not None
        # Keepalive's own verdict takes 1 + 3 x 1 s; the engine's end follows it at once.
        assert 3.0 <= proxied.ended_at - gone_at < 4.0 + 1.0
        assert not direct.ended.is_set()
        deltas = direct.deltas_sent
        # The direct session still transcribes, for nobody.
        await engine.wait_for(lambda: direct.deltas_sent > deltas + 3)
    proxied_client.close("rst")
    direct_client.close("rst")
    await asyncio.wait_for(direct.ended.wait(), 5)
    await settled(server)


async def test_an_engine_refusing_the_handshake_is_answered_as_the_engine_answers(
    engine: RealtimeEngine, tether: TetherFactory, http: aiohttp.ClientSession
) -> None:
    """vLLM with a model without the realtime task refuses the handshake (403): whatever the
    engine answers other than 101 goes to the client as a normal response, and the
    connection serves the next request."""
    server = await tether(engine.url)
    client = await RawClient.connect(server.port)
    key = ("Sec-WebSocket-Key", base64.b64encode(os.urandom(16)).decode())
    refused = request_head(
        "/v1/nope",
        method="GET",
        headers=(
            ("Upgrade", "websocket"),
            ("Connection", "Upgrade"),
            key,
            ("Sec-WebSocket-Version", "13"),
        ),
    )
    await client.send(refused)
    reply = await client.read_reply()
    assert reply.status == 403  # uvicorn's answer to a handshake no route takes
    await client.send(request_head("/health", method="GET"))
    assert (await client.read_reply()).status == 200
    await settled(server)


@pytest.mark.parametrize(
    ("upgrade", "method"),
    [("tcp", "GET"), ("websocket, foo", "GET"), ("websocket", "POST")],
    ids=["tcp", "websocket-and-more", "websocket-post"],
)
async def test_upgrades_tether_cannot_relay_are_refused_with_a_clear_error(
    engine: RealtimeEngine, tether: TetherFactory, upgrade: str, method: str
) -> None:
    """Anything but a WebSocket GET is refused with a 400 naming the problem, never
    forwarded half-upgraded."""
    server = await tether(engine.url)
    client = await RawClient.connect(server.port)
    headers = (("Upgrade", upgrade), ("Connection", "Upgrade"), ("Content-Length", "0"))
    await client.send(request_head("/v1/realtime", method=method, headers=headers))
    reply = await client.read_reply()
    assert reply.status == 400
    assert reply.json()["error"]["code"] == "unsupported_upgrade"
    assert engine.sessions == []


async def test_h2c_is_ignored_and_answered_in_http_1_1(
    engine: RealtimeEngine, tether: TetherFactory
) -> None:
    """`curl --http2` on an http URL asks for h2c: served in HTTP/1.1, as uvicorn and nginx
    do (RFC 9110 §7.8), not refused."""
    server = await tether(engine.url)
    client = await RawClient.connect(server.port)
    headers = (
        ("Upgrade", "h2c"),
        ("Connection", "Upgrade, HTTP2-Settings"),
        ("HTTP2-Settings", "AAMAAABkAAQAoAAAAAIAAAAA"),
    )
    await client.send(request_head("/health", method="GET", headers=headers))
    reply = await client.read_reply()
    assert (reply.version, reply.status) == ("HTTP/1.1", 200)
    assert reply.json() == {"status": "ok"}


async def test_shutdown_closes_open_sessions_at_the_end_of_the_grace(
    engine: RealtimeEngine, tether: TetherFactory
) -> None:
    """A session still open when the grace period ends is closed on both sides: the engine's
    session ends, the client's connection closes, counted as shutdown_aborted."""
    server = await tether(engine.url, shutdown_grace=0.3)
    client = await transcribing_session(server.port, engine, 1)
    session = engine.sessions[0]
    stopping = asyncio.create_task(server.stop())
    await asyncio.wait_for(session.ended.wait(), 5)
    assert session.ended_at is not None
    await client.read_until_cut()
    await asyncio.wait_for(stopping, 10)
    registry = server.context.metrics.registry
    assert metric(registry, "tether_websocket_sessions_total", outcome="shutdown_aborted") == 1


@pytest.mark.parametrize("ended_by", ["timeout", "admin"])
async def test_a_session_tether_ends_is_closed_on_both_sides(
    engine: RealtimeEngine, tether: TetherFactory, http: aiohttp.ClientSession, ended_by: str
) -> None:
    """TETHER_REQUEST_TIMEOUT bounds a whole session (a quiet one too: the stream idle
    timeout does not apply), and an operator's abort by client ID ends it: the engine's
    session ends, the client's connection closes, counted by outcome."""
    secret = "admin-secret-for-ws"
    timeout = 0.5 if ended_by == "timeout" else None
    server = await tether(engine.url, request_timeout=timeout, admin_token=secret)
    client = await transcribing_session(server.port, engine, 1)
    session = engine.sessions[0]
    if ended_by == "admin":
        async with http.post(
            admin_url(server, "/admin/abort"),
            json={"request_id": "raw-1"},
            headers={"Authorization": f"Bearer {secret}"},
        ) as response:
            assert response.status == 200
    await asyncio.wait_for(session.ended.wait(), 5)
    await client.read_until_cut()
    await settled(server)
    outcome = "timed_out" if ended_by == "timeout" else "admin_aborted"
    registry = server.context.metrics.registry
    assert metric(registry, "tether_websocket_sessions_total", outcome=outcome) == 1
