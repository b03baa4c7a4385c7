"""`create_app(settings)`: app keys and cleanup contexts: everything that outlives a request;
and `client_port_handler`, the routes of the client port.

Requests themselves are served by a low-level aiohttp server (`runner.py`) with one handler
for every path: a proxy has next to no routes to resolve (tether's own are the cancel routes,
told apart by a prefix), and skipping the router is a few percent of the CPU of every
request.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, cast

from aiohttp import web

from ..aborts.tracker import AbortTracker
from ..engines import KEEPALIVE_SECONDS
from ..faults import Faults
from ..observe.metrics import Metrics
from ..observe.tracing import Tracer
from ..request.abort_report import AbortReport
from ..request.accounting import Accounting
from ..request.registry import Registry
from ..settings import RequestIdMode, Settings
from ..upstream.client import UpstreamClient
from ..upstream.pool import UploadLimit
from ..wire.callers import Callers, caller_key
from ..wire.event_log import HeldBytes
from ..wire.ids import IdMinter
from .cancel import CANCEL_ROUTES, CancelRoutes
from .context import (
    CONTEXT,
    HeadsForEngine,
    PathChecks,
    ProxyContext,
    RouteLookups,
    UsageAsking,
)
from .engine_identity import EngineIdentity
from .fleet import Fleet
from .handler import proxy_request
from .health import Readiness
from .siblings import Siblings

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider

SETTINGS = web.AppKey("tether_settings", Settings)
# Set by tests that read spans back (an in-memory exporter); production builds its provider
# from the OTEL_* environment.
TRACER_PROVIDER = web.AppKey("tether_tracer_provider", object)
FAULTS = web.AppKey("tether_faults", Faults)
# The key callers are hashed with, as the supervisor hands it to its workers (`wire.callers`).
CALLER_KEY = web.AppKey("tether_caller_key", bytes)
# The other workers' admin sockets, as the supervisor hands them to a worker (`siblings`).
SIBLING_SOCKETS = web.AppKey[tuple[str, ...]]("tether_sibling_sockets")


# How long start-up waits for the engine to say what it is (an engine that is up answers in
# milliseconds; one still starting is asked again once ready).
_FIRST_ASK_SECONDS = 2.0


def create_app(
    settings: Settings,
    tracer_provider: object | None = None,
    faults: Faults | None = None,
    caller_key: bytes | None = None,
    sibling_sockets: tuple[str, ...] = (),
) -> web.Application:
    """`faults`: a test's own failures at named points (`proxy.faults`); None in production.
    `caller_key`: the key a supervisor shares with its workers (None: one process).
    `sibling_sockets`: a worker's way to the supervisor's other workers (`siblings`)."""
    # Never served itself (runner.py serves requests): it holds the keys and lifetimes.
    app = web.Application()
    app[SETTINGS] = settings
    if tracer_provider is not None:
        app[TRACER_PROVIDER] = tracer_provider
    if faults is not None:
        app[FAULTS] = faults
    if caller_key is not None:
        app[CALLER_KEY] = caller_key
    app[SIBLING_SOCKETS] = sibling_sockets
    app.cleanup_ctx.append(_proxy_context)
    return app


def _caller_key(settings: Settings, app: web.Application) -> bytes:
    token = settings.admin_token
    return caller_key(token.get_secret_value() if token is not None else None, app.get(CALLER_KEY))


async def _proxy_context(app: web.Application) -> AsyncIterator[None]:
    """Everything that outlives a request, torn down in reverse: stops drained before the
    client sessions they use are closed, and before the spans they end are flushed."""
    settings = app[SETTINGS]
    metrics = Metrics()
    uploads = UploadLimit(settings.max_streamed_uploads, metrics.streamed_uploads)
    provider = cast("TracerProvider | None", app.get(TRACER_PROVIDER))
    with Tracer.open(settings, provider) as tracer:
        async with (
            UpstreamClient.open(
                settings, keepalive_seconds=KEEPALIVE_SECONDS, uploads=uploads
            ) as upstream,
            Fleet.open(settings) as fleet,
            Siblings.open(settings, app[SIBLING_SOCKETS]) as siblings,
        ):
            identity = EngineIdentity(settings, upstream, metrics)
            # Asked before the first client is served, where the engine answers at once (it
            # runs already); an engine still starting is asked once it is ready.
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(_FIRST_ASK_SECONDS):
                    await identity.ask()
            readiness = Readiness(
                upstream, settings.health_interval, metrics, on_ready=identity.engine_ready
            )
            faults = app.get(FAULTS)
            aborts = AbortTracker(settings, upstream, AbortReport(metrics), faults)
            app[CONTEXT] = ctx = ProxyContext(
                settings=settings,
                identity=identity,
                upstream=upstream,
                aborts=aborts,
                registry=Registry(prefix_index=settings.request_id_mode is RequestIdMode.PRESERVE),
                metrics=metrics,
                accounting=Accounting(metrics, tracer),
                readiness=readiness,
                fleet=fleet,
                ids=IdMinter(),
                callers=Callers(_caller_key(settings, app), settings.cancel_credential_header),
                usage=UsageAsking(settings.ask_for_usage),
                resume_budget=(
                    HeldBytes(settings.resume_buffer_total)
                    if settings.resume_grace is not None
                    else None
                ),
                faults=faults,
                paths=PathChecks(),
                routes=RouteLookups(),
                heads=HeadsForEngine(settings.upstream_url, settings.request_id_header),
            )
            app[CANCEL_ROUTES] = CancelRoutes(ctx, functools.partial(proxy_request, ctx), siblings)
            monitor = asyncio.create_task(readiness.run(), name="readiness")
            try:
                yield
            finally:
                monitor.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await monitor
                await identity.close()
                await aborts.drain()


def client_port_handler(
    app: web.Application,
) -> Callable[[web.BaseRequest], Awaitable[web.StreamResponse]]:
    """The handler for every request on the client port (once the app has started): tether's
    own routes (cancel by ID, `cancel.CancelRoutes`), else the engine's, forwarded."""
    ctx = app[CONTEXT]
    own = app[CANCEL_ROUTES]

    async def handle(request: web.BaseRequest) -> web.StreamResponse:
        route = own.route(request)
        if route is not None:
            return await route(request)
        return await proxy_request(ctx, request)

    return handle
