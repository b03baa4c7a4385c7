"""`create_app(settings)`: app keys, cleanup contexts, routes. Nothing else."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from aiohttp import web

from .aborts import AbortTracker
from .context import CONTEXT, ProxyContext
from .engines import EngineProfile
from .forward import defer_continue, proxy_request
from .health import Readiness
from .metrics import Metrics
from .registry import Registry
from .settings import Settings
from .upstream import UpstreamClient

SETTINGS = web.AppKey("tether_settings", Settings)


def create_app(settings: Settings) -> web.Application:
    app = web.Application(handler_args={"max_field_size": 16384, "max_line_size": 16384})
    app[SETTINGS] = settings
    app.cleanup_ctx.append(_proxy_context)
    app.router.add_route("*", "/{path:.*}", proxy_request, expect_handler=defer_continue)
    return app


async def _proxy_context(app: web.Application) -> AsyncIterator[None]:
    """Everything that outlives a request, torn down in reverse: aborts drained before the
    client session they use is closed."""
    settings = app[SETTINGS]
    metrics = Metrics()
    engine = EngineProfile(settings)
    async with UpstreamClient.open(settings) as upstream:
        readiness = Readiness(upstream, settings.health_interval, metrics)
        aborts = AbortTracker(settings, engine, upstream, metrics)
        app[CONTEXT] = ProxyContext(
            settings=settings,
            engine=engine,
            upstream=upstream,
            aborts=aborts,
            registry=Registry(),
            metrics=metrics,
            readiness=readiness,
        )
        monitor = asyncio.create_task(readiness.run(), name="readiness")
        try:
            yield
        finally:
            monitor.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await monitor
            await aborts.drain()
