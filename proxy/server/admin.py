"""The admin port: liveness, readiness, metrics, the in-flight list and abort by ID, and the
other replicas' cancels and resumes for one caller (`/admin/cancel`, `/admin/resume`).

Never served on the client port. The probes and `/metrics` are open (they name no request);
everything that names or acts on requests needs `Authorization: Bearer $TETHER_ADMIN_TOKEN`:
internal IDs are the engine's handles (a Responses API `resp_<id>` fetches or cancels a
response), so listing them is as sensitive as aborting.

A worker's admin app, served on its private Unix socket only, also answers the other workers'
cancels, lists and resumes for one caller (`/siblings/…`, no token: `siblings` says why).
"""

from __future__ import annotations

import asyncio
import hmac
import time
from collections.abc import Awaitable, Callable

import structlog
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from ..errors import (
    AdminDisabledError,
    AdminError,
    FleetNotConfiguredError,
    InvalidAdminBodyError,
    InvalidAdminTokenError,
    error_response,
)
from ..outcomes import Outcome
from ..settings import Settings
from . import siblings
from .cancel import CANCEL_ROUTES, MAX_IDS_PER_CALL, Cancellation
from .context import CONTEXT, ProxyContext
from .fleet import Fleet, PeerResult

log = structlog.get_logger("tether.admin")

PROXY_APP = web.AppKey("tether_proxy_app", web.Application)
_SCOPES = ("local", "fleet")
_Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def create_admin_app(proxy_app: web.Application, *, for_siblings: bool = False) -> web.Application:
    """The admin app reads the proxy app's context (created by the proxy app's cleanup).
    `for_siblings`: it is a worker's, served on its private socket only, and answers the
    other workers' cancels, lists and resumes there too (`siblings`)."""
    app = web.Application()
    app[PROXY_APP] = proxy_app
    add_admin_routes(
        app,
        readyz=readyz,
        metrics=metrics,
        list_requests=list_requests,
        abort_request=abort_request,
        cancel_request=cancel_request,
        resume_request=resume_request,
    )
    if for_siblings:
        app.router.add_post(siblings.CANCEL_PATH, sibling_cancel)
        app.router.add_post(siblings.REQUESTS_PATH, sibling_requests)
        app.router.add_post(siblings.RESUME_PATH, sibling_resume)
    return app


def add_admin_routes(
    app: web.Application,
    *,
    readyz: _Handler,
    metrics: _Handler,
    list_requests: _Handler,
    abort_request: _Handler,
    cancel_request: _Handler,
    resume_request: _Handler,
) -> None:
    """The admin API's routes, one tether's or the supervisor's for its workers: the same
    paths and methods, so an operator, a probe or `tether abort` cannot tell them apart."""
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/admin/requests", list_requests)
    app.router.add_post("/admin/abort", abort_request)
    app.router.add_post("/admin/cancel", cancel_request)
    app.router.add_post("/admin/resume", resume_request)


def _context(request: web.Request) -> ProxyContext:
    return request.app[PROXY_APP][CONTEXT]


async def healthz(request: web.Request) -> web.Response:
    """Liveness: the process serves."""
    return web.json_response({"status": "ok"})


async def readyz(request: web.Request) -> web.Response:
    """Readiness: the engine's last health check passed and tether is not draining; with
    which engine answers (and a configured one it contradicts)."""
    ctx = _context(request)
    problem = ctx.readiness.problem
    engine = ctx.identity.describe()
    if problem is None:
        return web.json_response({"status": "ready", "engine": engine})
    return web.json_response(
        {"status": "not_ready", "reason": problem, "engine": engine}, status=503
    )


async def metrics(request: web.Request) -> web.Response:
    body = generate_latest(_context(request).metrics.registry)
    response = web.Response(body=body)
    response.headers["Content-Type"] = CONTENT_TYPE_LATEST
    return response


async def list_requests(request: web.Request) -> web.Response:
    """Every in-flight request: client and internal ID, method, path, phase, age, bytes."""
    ctx = _context(request)
    try:
        check_authorised(request, ctx.settings)
    except AdminError as error:
        return error_response(error)
    now = time.monotonic()
    registry = ctx.registry
    return web.json_response({"requests": [state.as_json(now) for state in registry]})


async def abort_request(request: web.Request) -> web.Response:
    """Abort every in-flight request with this client ID (or this internal ID), here or, with
    `"scope": "fleet"`, on every replica.

    Each is ended exactly as on a client disconnect: its client connection is closed, the
    engine's work stopped (abort call, or the dropped connection).
    """
    ctx = _context(request)
    try:
        check_authorised(request, ctx.settings)
        request_id, scope = await abort_target(request)
        if scope == "fleet" and not ctx.fleet.configured:
            raise FleetNotConfiguredError()
    except AdminError as error:
        return error_response(error)
    aborted = [
        state.internal_request_id
        for state in ctx.registry.find(request_id)
        if state.stop(Outcome.ADMIN_ABORTED)
    ]
    peers = await ctx.fleet.abort(request_id) if scope == "fleet" else []
    return abort_answer(request_id, scope, ctx.fleet, aborted, peers)


async def cancel_request(request: web.Request) -> web.Response:
    """A cancel by ID another process asks of this one (a replica, or this replica's other
    worker): the caller's requests with this ID held here, cancelled as on the serving port.
    The caller comes as its keyed hash, never as a credential."""
    ctx = _context(request)
    try:
        check_authorised(request, ctx.settings)
        request_id, caller = await cancel_target(request)
    except AdminError as error:
        return error_response(error)
    done = await request.app[PROXY_APP][CANCEL_ROUTES].cancel_local(request_id, caller)
    return cancel_answer(ctx.fleet, done)


async def resume_request(request: web.Request) -> web.StreamResponse:
    """A resume another replica asks of this one: the caller's held stream with this ID,
    resumed on this connection (the asking replica relays it to its client)."""
    try:
        check_authorised(request, _context(request).settings)
    except AdminError as error:
        return error_response(error)
    return await _resume_held_here(request)


async def sibling_resume(request: web.Request) -> web.StreamResponse:
    """Another worker's resume: the caller's stream held here, resumed on this connection
    (the asking worker relays it to its client). No token: only this user's processes reach
    the socket (`siblings`)."""
    return await _resume_held_here(request)


async def _resume_held_here(request: web.Request) -> web.StreamResponse:
    try:
        request_id, caller, last = await resume_target(request)
    except AdminError as error:
        return error_response(error)
    return await request.app[PROXY_APP][CANCEL_ROUTES].resume_local(
        request, request_id, caller, last
    )


async def sibling_cancel(request: web.Request) -> web.Response:
    """Another worker's cancel by ID: the caller's requests with these IDs held here, each
    ID's answer in order. No token: only this user's processes reach the socket
    (`siblings`)."""
    try:
        payload = await request.json()
        request_ids = payload["request_ids"]
        caller = _caller_hash(payload)
        if not (
            isinstance(request_ids, list)
            and 0 < len(request_ids) <= MAX_IDS_PER_CALL
            and all(isinstance(each, str) for each in request_ids)
        ):
            raise TypeError
    except (ValueError, KeyError, TypeError, AttributeError):
        return error_response(
            InvalidAdminBodyError('send {"request_ids": ["<id>", ...], "caller": "<hex>" or null}')
        )
    cancel_routes = request.app[PROXY_APP][CANCEL_ROUTES]
    done = await asyncio.gather(*(cancel_routes.cancel_local(rid, caller) for rid in request_ids))
    replica = _context(request).fleet.replica
    data = [
        {"cancelled": each.cancelled, "engine": each.engine, "replica": replica} for each in done
    ]
    return web.json_response({"data": data})


async def sibling_requests(request: web.Request) -> web.Response:
    """Another worker's `GET /v1/requests`: the caller's requests held here, nobody else's."""
    try:
        caller = _caller_hash(await request.json())
    except (ValueError, KeyError, TypeError, AttributeError):
        return error_response(InvalidAdminBodyError('send {"caller": "<hex>" or null}'))
    listed = request.app[PROXY_APP][CANCEL_ROUTES].list_local(caller)
    return web.json_response({"object": "list", "data": listed})


def _caller_hash(payload: dict[str, object]) -> bytes | None:
    """The caller a sibling's call names: its hash, hex, or null (no credential)."""
    caller = payload["caller"]
    if caller is None:
        return None
    if not isinstance(caller, str):
        raise TypeError
    return bytes.fromhex(caller)


def cancel_answer(fleet: Fleet, done: Cancellation) -> web.Response:
    """The answer to a peer's cancel: what was cancelled here, and where here is."""
    return web.json_response(
        {
            "replica": fleet.replica,
            "instance": fleet.instance_id,
            "cancelled": done.cancelled,
            "engine": done.engine,
        }
    )


async def cancel_target(request: web.Request) -> tuple[str, bytes | None]:
    """The request ID and caller hash a peer's cancel names."""
    problem = InvalidAdminBodyError(
        'send a JSON object like {"request_id": "<id>", "caller": "<hex>" or null}'
    )
    try:
        payload = await request.json()
        request_id = payload["request_id"]
        caller = payload.get("caller")
        if not isinstance(request_id, str) or not request_id:
            raise problem
        return request_id, bytes.fromhex(caller) if caller is not None else None
    except (ValueError, KeyError, TypeError, AttributeError):
        raise problem from None


async def resume_target(request: web.Request) -> tuple[str, bytes | None, int]:
    """The request ID, caller hash and last event received that another process's resume
    names."""
    request_id, caller = await cancel_target(request)
    last = (await request.json()).get("last_received")
    if not isinstance(last, int) or isinstance(last, bool) or last < 0:
        raise InvalidAdminBodyError("last_received must be the last event number received")
    return request_id, caller, last


def abort_answer(
    request_id: str,
    scope: str,
    fleet: Fleet,
    aborted: list[str],
    peers: list[PeerResult],
    **extra: object,
) -> web.Response:
    """The answer to an abort call, one tether's or the supervisor's for its workers (with
    `extra` members: the workers that could not be asked), and its log line."""
    answer: dict[str, object] = {
        "request_id": request_id,
        "scope": scope,
        "replica": fleet.replica,
        "instance": fleet.instance_id,
        "aborted": aborted,
        **extra,
    }
    fan_out: dict[str, object] = {}
    if scope == "fleet":
        answer["peers"] = [peer.as_json() for peer in peers]
        answer["aborted_total"] = len(aborted) + sum(len(peer.aborted) for peer in peers)
        fan_out = {
            "aborted_total": answer["aborted_total"],
            "unreachable": [peer.peer for peer in peers if peer.status != "ok"],
        }
    log.info("admin_abort", request_id=request_id, scope=scope, aborted=aborted, **fan_out, **extra)
    return web.json_response(answer)


async def abort_target(request: web.Request) -> tuple[str, str]:
    """The request ID and scope an abort call names."""
    try:
        payload = await request.json()
        request_id = payload["request_id"]
        scope = payload.get("scope", "local")
    except (ValueError, KeyError, TypeError, AttributeError):
        raise InvalidAdminBodyError() from None
    if not isinstance(request_id, str) or not request_id or scope not in _SCOPES:
        raise InvalidAdminBodyError()
    return request_id, scope


def check_authorised(request: web.Request, settings: Settings) -> None:
    token = settings.admin_token
    if token is None:
        raise AdminDisabledError()
    # aiohttp decodes header bytes that are not UTF-8 with `surrogateescape`: encoded the same
    # way, any header gives back the bytes the client sent (a plain `encode()` raises on them),
    # and bytes compare in constant time whatever they hold.
    sent = request.headers.get("Authorization", "").encode("utf-8", "surrogateescape")
    expected = f"Bearer {token.get_secret_value()}".encode()
    if not hmac.compare_digest(sent, expected):
        raise InvalidAdminTokenError()
