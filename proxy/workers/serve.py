"""Run tether as a supervisor of TETHER_WORKERS processes: what `server.runner.serve` is
for one.

Start-up: the client port is reserved, the workers started and each found answering, then
the admin port opens and one `tether_started` line says so. Shutdown (SIGTERM/SIGINT):
readiness is withdrawn at once, every worker drains, then the admin port closes.
"""

from __future__ import annotations

import asyncio
import socket

import structlog
from aiohttp import web

from ..server.runner import LISTEN_BACKLOG, listening_socket, started_facts
from ..settings import Settings
from .admin import SUPERVISOR, create_supervisor_app
from .supervisor import StartupError

log = structlog.get_logger("tether.runner")


async def serve_workers(settings: Settings, count: int, stop: asyncio.Event) -> None:
    """Run `count` workers until `stop` is set, then shut down gracefully. Raises
    `StartupError` when they cannot start."""
    app = create_supervisor_app(settings, count)
    runner = web.AppRunner(app, handle_signals=False, access_log=None)
    await runner.setup()  # reserves the client port, starts the workers
    try:
        admin_socket = _admin_socket(settings)
        await web.SockSite(runner, admin_socket, backlog=LISTEN_BACKLOG).start()
        supervisor = app[SUPERVISOR]
        log.info(
            "tether_started",
            port=supervisor.port,
            admin_port=admin_socket.getsockname()[1],
            workers=count,
            **started_facts(settings),
        )
        await stop.wait()
        log.info(
            "shutdown_started", workers=supervisor.running, grace_seconds=settings.shutdown_grace
        )
        await supervisor.stop()
    finally:
        await runner.cleanup()
    log.info("shutdown_finished")


def _admin_socket(settings: Settings) -> socket.socket:
    """The admin port, bound once the workers run (so /readyz never answers for workers that
    are not there yet); a port in use stops start-up naming it (the workers are stopped)."""
    host, port = settings.admin_host, settings.admin_port
    try:
        return listening_socket(host, port, settings.tcp_keepalive_idle)
    except OSError as exc:
        raise StartupError(
            f"TETHER_ADMIN_HOST:TETHER_ADMIN_PORT {host}:{port} cannot be used: "
            f"{exc.strerror or exc}"
        ) from None
