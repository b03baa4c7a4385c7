"""Self-cleaning factories: settings that never read the environment, a fake engine that
records what it saw, tether run by the production runner, and raw-socket clients."""

from __future__ import annotations

import asyncio
import json
import socket
import struct
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource

from proxy.fake_engine import FakeEngine
from proxy.runner import TetherServer
from proxy.settings import Settings


class IsolatedSettings(Settings):
    """Settings built from arguments only: the test machine's environment and .env are ignored."""

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        return (init_settings,)


def make_settings(**overrides: Any) -> Settings:
    values: dict[str, Any] = {
        "upstream_url": "http://127.0.0.1:9",
        "host": "127.0.0.1",
        "port": 0,
        "admin_host": "127.0.0.1",
        "admin_port": 0,
        "shutdown_grace": 0,
        "health_interval": 0.05,
        "abort_repeat_delay": 0,
    }
    values.update(overrides)
    return IsolatedSettings(**values)


@pytest.fixture
def settings() -> Callable[..., Settings]:
    return make_settings


class UpstreamServer:
    """An upstream app served on loopback, as real engines' ASGI servers run: handlers are
    cancelled on disconnect (the fake engine decides by itself whether that stops its
    generation), and the accept queue is deep enough for thousands of concurrent streams."""

    def __init__(self, app: web.Application) -> None:
        self._runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
        self.url = ""

    async def start(self) -> None:
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0, backlog=4096)
        await site.start()
        port = self._runner.addresses[0][1]
        self.url = f"http://127.0.0.1:{port}"

    async def close(self) -> None:
        await self._runner.cleanup()


async def serve_upstream(app: web.Application) -> UpstreamServer:
    server = UpstreamServer(app)
    await server.start()
    return server


@pytest.fixture
async def fake_engine() -> AsyncIterator[Callable[..., Awaitable[tuple[FakeEngine, str]]]]:
    servers: list[UpstreamServer] = []

    async def start(**options: Any) -> tuple[FakeEngine, str]:
        engine = FakeEngine(**options)
        server = await serve_upstream(engine.app)
        servers.append(server)
        return engine, server.url

    yield start
    for server in servers:
        await server.close()


@pytest.fixture
async def upstream_app() -> AsyncIterator[Callable[[web.Application], Awaitable[str]]]:
    """Serve a test's own upstream app (for wire-level behaviours); returns its base URL."""
    servers: list[UpstreamServer] = []

    async def start(app: web.Application) -> str:
        server = await serve_upstream(app)
        servers.append(server)
        return server.url

    yield start
    for server in servers:
        await server.close()


@pytest.fixture
async def tether() -> AsyncIterator[Callable[..., Awaitable[TetherServer]]]:
    """tether on loopback, through the same runner `__main__` uses."""
    servers: list[TetherServer] = []

    async def start(upstream_url: str, **overrides: Any) -> TetherServer:
        server = TetherServer(make_settings(upstream_url=upstream_url, **overrides))
        await server.start()
        servers.append(server)
        return server

    yield start
    for server in servers:
        await server.stop()


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


def url(server: TetherServer, path: str = "/v1/chat/completions") -> str:
    return f"http://127.0.0.1:{server.port}{path}"


def admin_url(server: TetherServer, path: str) -> str:
    return f"http://127.0.0.1:{server.admin_port}{path}"


def chat_body(stream: bool = True, max_tokens: int = 5, **fake: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": "fake",
        "messages": [{"role": "user", "content": "hi"}],
        "stream": stream,
        "max_tokens": max_tokens,
    }
    if fake:
        body["fake"] = fake
    return body


def sse_ids(text: str) -> list[str]:
    """The `id` of every JSON event in an SSE body."""
    return [
        json.loads(line[len("data: ") :])["id"]
        for line in text.splitlines()
        if line.startswith("data: {")
    ]


class RawClient:
    """An HTTP/1.1 client on a bare socket, so a test decides exactly when and how it leaves."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer

    @classmethod
    async def connect(cls, port: int) -> RawClient:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        return cls(reader, writer)

    async def send_request(
        self,
        body: dict[str, Any] | bytes,
        *,
        path: str = "/v1/chat/completions",
        headers: dict[str, str] | None = None,
        body_bytes_now: int | None = None,
        content_type: str = "application/json",
    ) -> None:
        """Send headers and the body (or only its first `body_bytes_now` bytes)."""
        payload = body if isinstance(body, bytes) else json.dumps(body).encode()
        lines = [
            f"POST {path} HTTP/1.1",
            "Host: tether",
            f"Content-Type: {content_type}",
            f"Content-Length: {len(payload)}",
        ]
        lines += [f"{name}: {value}" for name, value in (headers or {}).items()]
        head = ("\r\n".join(lines) + "\r\n\r\n").encode()
        self.writer.write(head + payload[: body_bytes_now if body_bytes_now is not None else None])
        await self.writer.drain()

    async def read_until(self, marker: bytes) -> bytes:
        return await asyncio.wait_for(self.reader.readuntil(marker), 5)

    def close_fin(self) -> None:
        """Leave politely: FIN."""
        self.writer.close()

    def close_rst(self) -> None:
        """Leave abruptly: RST (SO_LINGER with a zero timeout)."""
        sock = self.writer.get_extra_info("socket")
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.writer.transport.abort()


async def leave_mid_stream(
    server: TetherServer,
    *,
    close: str = "fin",
    body: dict[str, Any] | None = None,
    path: str = "/v1/chat/completions",
) -> None:
    """Open a long stream through tether, read its first token, leave (FIN or RST), and return
    once tether has let go of the request (its abort is then handed over)."""
    client = await RawClient.connect(server.port)
    await client.send_request(body or chat_body(max_tokens=100_000), path=path)
    await client.read_until(b"tok0")
    client.close_fin() if close == "fin" else client.close_rst()
    async with asyncio.timeout(5):
        await server.context.registry.wait_empty()
