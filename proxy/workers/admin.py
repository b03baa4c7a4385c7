"""The supervisor's admin port (TETHER_WORKERS > 1): the routes of one tether's admin port
(`proxy.server.admin`), answered for all its workers, each asked over its private admin socket.

- `/healthz`: the supervisor runs.
- `/readyz`: every worker runs and is ready, and tether is not draining; else 503 naming
  each worker that is not.
- `/metrics`: the workers' metrics summed (`proxy.workers.metrics_sum`), and the supervisor's own.
- `/admin/requests`: every worker's in-flight list, each entry with its `worker`.
- `/admin/abort`: every worker's local abort, and with `"scope": "fleet"` the other replicas'
  (asked once, from here: this supervisor's instance ID is what a DNS fan-out skips).
- `/admin/cancel`, `/admin/resume`: another replica's cancel or resume for one caller, asked
  of every worker; the resumed stream relayed from the worker that holds it.

Same token rules and error answers as one tether's. A running worker that cannot be asked
is that worker's problem: named in readiness, a 503 for `/metrics` (a partial sum would read
as counter resets), `worker_errors` next to the lists.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TypeVar

import structlog
from aiohttp import ClientResponse, web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from ..errors import AdminError, FleetNotConfiguredError, RequestNotFoundError, error_response
from ..server.admin import (
    abort_answer,
    abort_target,
    add_admin_routes,
    cancel_answer,
    cancel_target,
    check_authorised,
    resume_target,
)
from ..server.cancel import Cancellation
from ..server.fleet import Fleet
from ..server.respond import relay_peer_stream
from ..settings import Settings
from . import metrics_sum
from .client import WorkerAdminError
from .runtime import runtime_directory
from .supervisor import Supervisor, Worker, reserved_port

log = structlog.get_logger("tether.admin")

SETTINGS = web.AppKey("tether_supervisor_settings", Settings)
WORKER_COUNT = web.AppKey("tether_worker_count", int)
SUPERVISOR = web.AppKey("tether_supervisor", Supervisor)
FLEET = web.AppKey("tether_supervisor_fleet", Fleet)

T = TypeVar("T")


def create_supervisor_app(settings: Settings, count: int) -> web.Application:
    """The admin app; its cleanup context reserves the client port and runs the workers."""
    app = web.Application()
    app[SETTINGS] = settings
    app[WORKER_COUNT] = count
    app.cleanup_ctx.append(_supervision)
    add_admin_routes(
        app,
        readyz=readyz,
        metrics=metrics,
        list_requests=list_requests,
        abort_request=abort_request,
        cancel_request=cancel_request,
        resume_request=resume_request,
    )
    return app


async def _supervision(app: web.Application) -> AsyncIterator[None]:
    settings = app[SETTINGS]
    with (
        reserved_port(settings.host, settings.port) as port,
        # Mode 0700: only this user reaches the workers' admin sockets.
        runtime_directory() as runtime_dir,
    ):
        async with (
            Fleet.open(settings) as fleet,
            Supervisor.open(settings, app[WORKER_COUNT], port, runtime_dir) as supervisor,
        ):
            app[FLEET] = fleet
            app[SUPERVISOR] = supervisor
            yield


async def readyz(request: web.Request) -> web.Response:
    """Ready only when every worker is."""
    supervisor = request.app[SUPERVISOR]
    if supervisor.stopping:
        problems = ["tether is shutting down"]
    else:
        found = await asyncio.gather(*(_problem(worker) for worker in supervisor.workers))
        problems = [problem for problem in found if problem is not None]
    if not problems:
        return web.json_response({"status": "ready"})
    return web.json_response({"status": "not_ready", "reason": "; ".join(problems)}, status=503)


async def _problem(worker: Worker) -> str | None:
    if not worker.running:
        return f"worker {worker.index} not running"
    try:
        problem = await worker.admin.readiness_problem()
    except WorkerAdminError as error:
        return str(error)
    return None if problem is None else f"worker {worker.index}: {problem}"


async def metrics(request: web.Request) -> web.Response:
    """The sum over the running workers (and what exited ones counted), and the
    supervisor's own: workers running, restarts."""
    supervisor = request.app[SUPERVISOR]
    running = [worker for worker in supervisor.workers if worker.running]
    try:
        expositions = await asyncio.gather(*(worker.admin.metrics() for worker in running))
    except WorkerAdminError as error:
        log.warning("worker_admin_failed", index=error.index, route="/metrics", detail=error.detail)
        return web.Response(status=503, text=f"{error}\n")
    for worker, exposition in zip(running, expositions, strict=True):
        worker.last_metrics = metrics_sum.parse(exposition)
    families = list(
        metrics_sum.summed([worker.last_metrics for worker in running], supervisor.retired_metrics)
    )
    families.append(
        GaugeMetricFamily("tether_workers", "Worker processes running.", value=len(running))
    )
    families.append(
        CounterMetricFamily(
            "tether_worker_restarts",
            "Worker processes restarted after they exited unexpectedly.",
            value=supervisor.restarts,
        )
    )
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Scrape(families))
    response = web.Response(body=generate_latest(registry))
    response.headers["Content-Type"] = CONTENT_TYPE_LATEST
    return response


class _Scrape:
    """prometheus-client's collector protocol over one scrape's families."""

    def __init__(self, families: list[Metric]) -> None:
        self._families = families

    def collect(self) -> list[Metric]:
        return self._families


async def list_requests(request: web.Request) -> web.Response:
    """Every worker's in-flight requests, each with its `worker`."""
    settings = request.app[SETTINGS]
    try:
        check_authorised(request, settings)
    except AdminError as error:
        return error_response(error)
    token = settings.admin_token
    assert token is not None  # check_authorised refuses the call without one

    async def in_flight(worker: Worker) -> list[dict[str, object]]:
        return [{**entry, "worker": worker.index} for entry in await worker.admin.in_flight(token)]

    lists, errors = await _ask_running(request.app[SUPERVISOR], in_flight, "/admin/requests")
    answer: dict[str, object] = {"requests": [entry for found in lists for entry in found]}
    if errors:
        answer["worker_errors"] = errors
    return web.json_response(answer)


async def abort_request(request: web.Request) -> web.Response:
    """Abort the request on whichever worker holds it (every worker's local abort), and with
    `"scope": "fleet"` on every other replica too. Answers as one tether does."""
    settings = request.app[SETTINGS]
    fleet = request.app[FLEET]
    try:
        check_authorised(request, settings)
        request_id, scope = await abort_target(request)
        if scope == "fleet" and not fleet.configured:
            raise FleetNotConfiguredError()
    except AdminError as error:
        return error_response(error)
    token = settings.admin_token
    assert token is not None

    async def abort(worker: Worker) -> list[str]:
        return await worker.admin.abort(request_id, token)

    workers_ask = _ask_running(request.app[SUPERVISOR], abort, "/admin/abort")
    if scope == "fleet":
        (found, errors), peers = await asyncio.gather(workers_ask, fleet.abort(request_id))
    else:
        (found, errors), peers = await workers_ask, []
    aborted = [internal_id for ids in found for internal_id in ids]
    if errors:
        return abort_answer(request_id, scope, fleet, aborted, peers, worker_errors=errors)
    return abort_answer(request_id, scope, fleet, aborted, peers)


async def cancel_request(request: web.Request) -> web.Response:
    """A cancel by ID another replica asks of this one's workers: each worker's local cancel;
    the answer of the one that held the request. (The workers ask each other directly, with
    no token: `server.siblings`.)"""
    settings = request.app[SETTINGS]
    try:
        check_authorised(request, settings)
        request_id, caller = await cancel_target(request)
    except AdminError as error:
        return error_response(error)
    token = settings.admin_token
    assert token is not None
    hashed = caller.hex() if caller is not None else None

    async def cancel(worker: Worker) -> dict[str, object]:
        return await worker.admin.cancel(request_id, hashed, token)

    answers, _ = await _ask_running(request.app[SUPERVISOR], cancel, "/admin/cancel")
    held = [a for a in answers if isinstance(a.get("cancelled"), int) and a["cancelled"]]
    if not held:
        return cancel_answer(request.app[FLEET], Cancellation(0, None))
    engine = held[0].get("engine")
    cancelled = held[0]["cancelled"]
    assert isinstance(cancelled, int)
    return cancel_answer(
        request.app[FLEET], Cancellation(cancelled, engine if isinstance(engine, str) else None)
    )


async def resume_request(request: web.Request) -> web.StreamResponse:
    """A resume another replica asks of this one's workers: the caller's stream, relayed from
    the worker that holds it. Answers as one tether does (404 when none holds it)."""
    settings = request.app[SETTINGS]
    try:
        check_authorised(request, settings)
        request_id, caller, last = await resume_target(request)
    except AdminError as error:
        return error_response(error)
    token = settings.admin_token
    assert token is not None
    hashed = caller.hex() if caller is not None else None

    async def resume(worker: Worker) -> ClientResponse | None:
        return await worker.admin.resume(request_id, hashed, last, token)

    answers, _ = await _ask_running(request.app[SUPERVISOR], resume, "/admin/resume")
    found = [answer for answer in answers if answer is not None]
    for extra in found[1:]:  # (a stream is held by one worker: never more than one)
        extra.close()
    if not found:
        return error_response(RequestNotFoundError())
    return await relay_peer_stream(request, found[0], settings.request_id_header)


async def _ask_running(
    supervisor: Supervisor, call: Callable[[Worker], Awaitable[T]], route: str
) -> tuple[list[T], list[dict[str, object]]]:
    """`call` on every running worker, concurrently: the answers, and each worker that
    failed (logged). A worker that is not running holds no request, so it is not asked."""
    running = [worker for worker in supervisor.workers if worker.running]
    results = await asyncio.gather(*(call(worker) for worker in running), return_exceptions=True)
    answers: list[T] = []
    errors: list[dict[str, object]] = []
    for result in results:
        if isinstance(result, WorkerAdminError):
            log.warning(
                "worker_admin_failed", index=result.index, route=route, detail=result.detail
            )
            errors.append({"worker": result.index, "detail": result.detail})
        elif isinstance(result, BaseException):
            raise result
        else:
            answers.append(result)
    return answers, errors
