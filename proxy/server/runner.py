"""Run tether: the proxy and admin servers, and the graceful shutdown.

`__main__` and the tests use this same code, so production flags cannot drift from tested ones.
"""

from __future__ import annotations

import asyncio
import gc
import os
import socket
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import structlog
from aiohttp import web

from .. import compiled
from ..faults import Faults
from ..observe.cuts import LostConnections
from ..outcomes import Outcome
from ..settings import Settings
from .admin import create_admin_app
from .app import client_port_handler, create_app
from .context import CONTEXT, ProxyContext

log = structlog.get_logger("tether.runner")

# Connections the kernel may queue before tether accepts them: a gateway opening hundreds at
# once must not meet resets (aiohttp's default is 128, and listening again with it would
# shrink the queue).
LISTEN_BACKLOG = 4096
# Unanswered keepalive probes before a silent client counts as gone.
_KEEPALIVE_PROBES = 3
# How long cancelled handlers get to hand their aborts over, once the grace period is over.
_CANCEL_SETTLE_SECONDS = 5.0


def listening_socket(
    host: str, port: int, keepalive_idle: int, *, reuse_port: bool = False
) -> socket.socket:
    """A listening socket whose accepted connections inherit TCP keepalive settings (Linux),
    so a client that vanished without FIN or RST is noticed within about a minute: by the
    probes while nothing is sent to it, and by TCP_USER_TIMEOUT (the same time) while its
    stream or WebSocket session is, where keepalive never probes and retransmissions
    would go on for a quarter of an hour. (nginx's `send_timeout` also gives a client
    that accepts nothing 60 s.) With `reuse_port`, workers each listen on the same port and
    the kernel spreads new connections over them."""
    sock = tcp_socket(host, reuse_port=reuse_port)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    if hasattr(socket, "TCP_KEEPIDLE"):
        interval = max(1, keepalive_idle // 3)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, keepalive_idle)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, interval)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, _KEEPALIVE_PROBES)
        sock.setsockopt(
            socket.IPPROTO_TCP,
            socket.TCP_USER_TIMEOUT,
            (keepalive_idle + _KEEPALIVE_PROBES * interval) * 1000,
        )
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.bind((host, port))
    sock.listen(LISTEN_BACKLOG)
    sock.setblocking(False)
    return sock


def tcp_socket(host: str, *, reuse_port: bool) -> socket.socket:
    """A TCP socket for `host`'s address family, not yet bound."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if reuse_port:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    return sock


@dataclass(frozen=True, slots=True)
class WorkerSeat:
    """Where one of a supervisor's workers listens: the client port it shares with the other
    workers, its own admin app on a Unix socket only this user's processes can reach (the
    supervisor, the other workers), and the other workers' sockets."""

    index: int
    port: int
    admin_socket: str
    caller_key: bytes | None = None  # shared by all the supervisor's workers (`wire.callers`)
    sibling_sockets: tuple[str, ...] = ()  # the other workers' admin sockets (`siblings`)


def started_facts(settings: Settings) -> dict[str, str]:
    """What the `tether_started` line says besides the ports."""
    return {
        "upstream_url": settings.upstream_url,
        "engine": settings.engine.value,
        # compiled (mypyc), or pure Python and why: `proxy.compiled`
        "extensions": compiled.extensions(),
    }


class ClientServer(web.Server):
    """aiohttp's server for the client port, which also records why each connection was lost
    (a FIN, an RST, a keepalive timeout: `observe.cuts`) for as long as its handler runs, so
    that the request being handled on it can say why its client was cut."""

    def __init__(
        self,
        handler: Callable[[web.BaseRequest], Awaitable[web.StreamResponse]],
        lost: LostConnections,
        **kwargs: Any,
    ) -> None:
        super().__init__(handler, **kwargs)
        self._lost = lost

    def connection_lost(
        self, handler: web.RequestHandler, exc: BaseException | None = None
    ) -> None:
        # aiohttp calls this first, then cancels the connection's handler task (read here as
        # aiohttp's own Server reads it, to keep the connection listed until the task ends):
        # the record is there when the request's handler sees its client gone, and goes
        # when the handler is done.
        task = handler._task_handler
        super().connection_lost(handler, exc)
        if task is not None and not task.done():
            lost = self._lost
            lost.lost(handler, exc)
            task.add_done_callback(lambda _: lost.forget(handler))


class TetherServer:
    """The proxy and admin servers with their lifetimes; `stop()` is the graceful shutdown."""

    def __init__(
        self,
        settings: Settings,
        tracer_provider: object | None = None,
        seat: WorkerSeat | None = None,
        faults: Faults | None = None,
    ) -> None:
        self.settings = settings
        self.seat = seat
        self.app = create_app(
            settings,
            tracer_provider,
            faults,
            seat.caller_key if seat is not None else None,
            seat.sibling_sockets if seat is not None else (),
        )
        self._proxy_runner: web.ServerRunner | None = None
        # A worker's admin app is served on its private socket only: there it also answers
        # the other workers (`siblings`).
        self._admin_runner = web.AppRunner(
            create_admin_app(self.app, for_siblings=seat is not None),
            handle_signals=False,
            access_log=None,
        )
        self._proxy_site: web.SockSite | None = None
        self._stopped = False
        self.port = 0
        self.admin_port = 0

    @property
    def context(self) -> ProxyContext:
        return self.app[CONTEXT]

    async def start(self) -> None:
        settings = self.settings
        # The cleanup contexts (everything that outlives a request) start as AppRunner would
        # start them: they may still set the app's keys, then the app is frozen.
        self.app.on_startup.freeze()
        await self.app.startup()
        self.app.freeze()
        self._proxy_runner = web.ServerRunner(
            ClientServer(
                client_port_handler(self.app),
                self.context.accounting.lost,
                # A client that leaves cancels its handler at once, in every phase.
                handler_cancellation=True,
                # aiohttp closes a connection that has no complete request head this long
                # after it opened or after its last response: the bound on slow-loris
                # senders, and the idle keep-alive timeout (as nginx's client_header_timeout
                # and keepalive_timeout).
                keepalive_timeout=settings.client_header_timeout,
                # After an early answer (408, 413) read what the client still sends for at
                # most this long, then close: a silent uploader does not hold a connection.
                lingering_time=1.0,
                access_log=None,
                # Per line; the whole head is bounded by TETHER_MAX_REQUEST_HEAD (handler.py).
                max_field_size=16384,
                max_line_size=16384,
            ),
            handle_signals=False,
            # Idle keep-alive connections close at shutdown; in-flight requests are drained
            # by `stop()` before the runner is cleaned up.
            shutdown_timeout=1.0,
        )
        await self._proxy_runner.setup()
        seat = self.seat
        proxy_socket = listening_socket(
            settings.host,
            settings.port if seat is None else seat.port,
            settings.tcp_keepalive_idle,
            reuse_port=seat is not None,
        )
        self._proxy_site = web.SockSite(self._proxy_runner, proxy_socket, backlog=LISTEN_BACKLOG)
        await self._proxy_site.start()
        self.port = proxy_socket.getsockname()[1]
        await self._admin_runner.setup()
        if seat is not None:
            await web.UnixSite(self._admin_runner, seat.admin_socket).start()
            log.info("worker_started", pid=os.getpid(), port=self.port)
            return
        admin_socket = listening_socket(
            settings.admin_host, settings.admin_port, settings.tcp_keepalive_idle
        )
        await web.SockSite(self._admin_runner, admin_socket, backlog=LISTEN_BACKLOG).start()
        self.admin_port = admin_socket.getsockname()[1]
        log.info(
            "tether_started", port=self.port, admin_port=self.admin_port, **started_facts(settings)
        )

    async def stop(self) -> None:
        """Graceful shutdown: refuse new work, let in-flight requests finish within the grace
        period, abort the rest upstream, drain the aborts, then close everything. Idempotent."""
        if self._stopped:
            return
        self._stopped = True
        ctx = self.context
        ctx.readiness.draining = True
        if self._proxy_site is not None:
            await self._proxy_site.stop()
        self._close_idle_connections(ctx)
        in_flight = len(ctx.registry)
        log.info(
            "shutdown_started", in_flight=in_flight, grace_seconds=self.settings.shutdown_grace
        )
        if in_flight:
            try:
                async with asyncio.timeout(self.settings.shutdown_grace):
                    await ctx.registry.wait_empty()
            except TimeoutError:
                await self._abort_in_flight(ctx)
        if self._proxy_runner is not None:
            await self._proxy_runner.cleanup()
        await self.app.cleanup()  # drains the abort tracker, closes the sessions
        await self._admin_runner.cleanup()
        log.info("shutdown_finished")

    def _close_idle_connections(self, ctx: ProxyContext) -> None:
        """Keep-alive connections with no request in flight are closed at once, so clients
        and gateways open their next connection elsewhere. Busy ones stay: their responses
        finish (with `Connection: close` where the head has not gone out yet), and a request
        that still arrives on one is answered 503 `shutting_down` with `Retry-After: 0`."""
        server = self._proxy_runner.server if self._proxy_runner is not None else None
        if server is None:
            return
        busy = ctx.registry.connections()
        for connection in server.connections:
            if connection not in busy:
                connection.force_close()

    async def _abort_in_flight(self, ctx: ProxyContext) -> None:
        left = list(ctx.registry)
        log.warning("shutdown_aborting", in_flight=len(left))
        for state in left:
            state.stop(Outcome.SHUTDOWN_ABORTED)
        try:
            async with asyncio.timeout(_CANCEL_SETTLE_SECONDS):
                await ctx.registry.wait_empty()
        except TimeoutError:
            log.error("shutdown_handlers_stuck", in_flight=len(ctx.registry))


async def serve(settings: Settings, stop: asyncio.Event) -> None:
    """Run until `stop` is set, then shut down gracefully."""
    server = TetherServer(settings)
    await server.start()
    settle_heap()
    try:
        await stop.wait()
    finally:
        await server.stop()


def settle_heap() -> None:
    """What exists once tether serves (modules, settings, the app: some 60,000 objects)
    lives as long as the process: it is moved out of the cyclic collector's sight, which
    would otherwise walk all of it in every full collection (every few hundred requests)."""
    gc.collect()
    gc.freeze()
