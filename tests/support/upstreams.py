"""Upstreams served in the test's own event loop: the fake engine, or a test's own app.

They log through their own logger (`UPSTREAM_LOGGER`), so their errors, which show request
bodies, are not taken for tether's in the collected log (`tests.support.collected_log`).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable
from typing import Any, Protocol

from aiohttp import web

from tether_fake_engine import FakeEngine

UPSTREAM_LOGGER = "tests.upstream"


class UpstreamServer:
    """An upstream app served on loopback, as real engines' ASGI servers run: handlers are
    cancelled on disconnect (the fake engine decides by itself whether that stops its
    generation), and the accept queue is deep enough for thousands of concurrent streams."""

    def __init__(self, app: web.Application, port: int = 0) -> None:
        self._runner = web.AppRunner(
            app,
            handler_cancellation=True,
            access_log=None,
            logger=logging.getLogger(UPSTREAM_LOGGER),
        )
        self._port = port
        self.url = ""

    async def start(self) -> None:
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", self._port, backlog=4096)
        await site.start()
        port = self._runner.addresses[0][1]
        self.url = f"http://127.0.0.1:{port}"

    async def close(self) -> None:
        await self._runner.cleanup()


async def serve_upstream(app: web.Application, port: int = 0) -> UpstreamServer:
    server = UpstreamServer(app, port)
    await server.start()
    return server


class FakeEngineFactory(Protocol):
    """The `fake_engine` fixture: a started FakeEngine(**options) and its base URL."""

    def __call__(self, **options: Any) -> Awaitable[tuple[FakeEngine, str]]: ...


class UpstreamAppFactory(Protocol):
    """The `upstream_app` fixture: a test's own app served; its base URL."""

    def __call__(self, app: web.Application) -> Awaitable[str]: ...
