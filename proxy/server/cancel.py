"""Cancel by ID on the serving port, answered by tether itself for every engine, and only for
the caller that owns the request.

- `POST /v1/requests/{id}/cancel`, `DELETE /v1/requests/{id}`: `{id}` is any ID the client
  knows its request by: the one it sent (`X-Request-Id`, the body's `request_id` or `rid`) or
  the one its answer carried (`chatcmpl-<id>`, `cmpl-<id>`, `resp_…`).
- `POST /v1/requests/cancel {"request_ids": [...]}`: several at once (at most
  `MAX_IDS_PER_CALL`).
- `GET /v1/requests`: the caller's own requests in flight; never another's, never tether's
  internal IDs.
- `GET /v1/requests/{id}/stream`: resumes the caller's stream after a dropped connection
  (TETHER_RESUME_GRACE: `resume`).
- `POST /v1/responses/{id}/cancel`: an in-flight Responses API request tether holds is
  cancelled here; anything else (a stored background response) is the engine's route, and
  forwarded.

A cancelled request is stopped exactly as when its client leaves (the engine's abort and the
dropped connection, confirmed: `aborts.tracker`); its own client's stream ends after a whole
event and then ends as a complete response, a client still waiting for its answer gets 499
`request_cancelled`. The canceller's answer waits, bounded, for the engine's stop.

The caller is the keyed hash of the credential its requests carry (`wire.callers`). An ID
that is unknown, another caller's or finished gets one and the same 404, and failed attempts
on one connection are bounded (then 429 and the connection closes), so IDs cannot be probed
cheaply. An ID not held here is asked of this supervisor's other workers (TETHER_WORKERS > 1,
over their private sockets: `siblings.Siblings`), then, with the fleet settings, of the other
replicas over their admin API (`fleet.Fleet.cancel`); `GET /v1/requests` lists the caller's
requests on every worker. A resume (`GET /v1/requests/{id}/stream`) of a stream not held
here is relayed the same way from the worker, or the replica, that holds it.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from urllib.parse import unquote

import structlog
from aiohttp import web

from ..errors import (
    InvalidRequestBodyError,
    RequestNotFoundError,
    TetherError,
    TooManyFailedCancelsError,
    error_response,
)
from ..outcomes import Outcome, Phase
from ..request.state import RequestState
from ..wire.ids import InvalidClientRequestId, check_client_request_id
from .context import ProxyContext
from .fleet import PeerCancellation
from .respond import relay_peer_stream, relay_resumed
from .resume import STREAM, last_received
from .siblings import Siblings

log = structlog.get_logger("tether.cancel")

REQUESTS_PATH = "/v1/requests"
_REQUESTS_PREFIX = REQUESTS_PATH + "/"
_RESPONSES_PREFIX = "/v1/responses/"
_CANCEL = "cancel"
# IDs one `POST /v1/requests/cancel` may name: a batch may not multiply tether's work.
MAX_IDS_PER_CALL = 64
# A `POST /v1/requests/cancel` body: MAX_IDS_PER_CALL IDs of the longest kind, and room.
_MAX_CANCEL_BODY = 64 * 1024
# The most of a caller's requests `GET /v1/requests` lists.
MAX_LISTED = 1000
# Cancels that found nothing, per client connection, before it gets 429 and is closed.
FAILED_CANCELS_PER_CONNECTION = 8
# How long a cancelled stream may take to finish the event in progress; past it the stream
# is cut (an engine that stalls mid-event).
EVENT_END_SECONDS = 1.0
# The connections tracked for failed cancels before closed ones are swept out.
_SWEEP_ABOVE = 1024
# How sure tether is of the engine's stop, least sure last: what several requests under one ID
# report together.
_CERTAINTY = (
    "finished",  # it ended by itself before the cancel could stop it
    "confirmed",
    "not_sent",
    "left_running",
    "dropped",
    "not_supported",
    "unknown_route",
    "unconfirmed",
    "failed",
    "pending",
)

_Handler = Callable[[web.BaseRequest], Awaitable[web.StreamResponse]]


@dataclass(frozen=True, slots=True)
class Cancellation:
    """What cancelling one ID did here (or on the replica named)."""

    cancelled: int
    engine: str | None  # how the engine's work stopped, None when nothing was cancelled
    replica: str | None = None

    def as_json(self, request_id: str) -> dict[str, object]:
        answer: dict[str, object] = {
            "id": request_id,
            "object": "request.cancellation",
            "cancelled": self.cancelled,
            "engine": self.engine,
        }
        if self.replica is not None:
            answer["replica"] = self.replica
        return answer


class CancelRoutes:
    """The cancel routes of one app: which requests they answer, and the answers."""

    def __init__(self, ctx: ProxyContext, forward: _Handler, siblings: Siblings) -> None:
        self._ctx = ctx
        self._forward = forward  # the engine's route, for what tether does not hold
        self._siblings = siblings  # this supervisor's other workers (none for one process)
        # Failed cancels per client connection (aiohttp's protocol object).
        self._failures: dict[object, int] = {}

    def route(self, request: web.BaseRequest) -> _Handler | None:
        """The handler for one of tether's own routes; None for everything else (forwarded)."""
        path = request.path
        if not path.startswith(("/v1/requests", _RESPONSES_PREFIX)):
            return None
        method = request.method
        parts = [unquote(part) for part in request.rel_url.raw_path.split("/")[1:]]
        if parts[:2] == ["v1", "requests"]:
            rest = parts[2:]
            if method == "GET" and rest == []:
                return self._list
            if method == "POST" and rest == [_CANCEL]:
                return self._cancel_many
            if method == "GET" and len(rest) == 2 and rest[1] == STREAM:
                return self._resume
            if (method == "POST" and len(rest) == 2 and rest[1] == _CANCEL) or (
                method == "DELETE" and len(rest) == 1
            ):
                return self._cancel_one
        elif method == "POST" and len(parts) == 4 and parts[3] == _CANCEL:
            return self._cancel_response
        return None

    # --- the routes ------------------------------------------------------------------------

    async def _cancel_one(self, request: web.BaseRequest) -> web.StreamResponse:
        request_id = unquote(request.rel_url.raw_path.split("/")[3])
        try:
            self._check_budget(request)
            done = await self.cancel(request_id, self._caller(request))
            if done.cancelled == 0:
                self._failed(request, 1)
                raise RequestNotFoundError()
        except TetherError as error:
            return error_response(error)
        return web.json_response(done.as_json(request_id))

    async def _resume(self, request: web.BaseRequest) -> web.StreamResponse:
        """`GET /v1/requests/{id}/stream`: the caller's held stream, resumed on this
        connection, from this replica or (with the fleet settings) from the one that holds
        it; one and the same 404 for anything else (as a cancel's)."""
        request_id = unquote(request.rel_url.raw_path.split("/")[3])
        caller = self._caller(request)
        try:
            self._check_budget(request)
            after = last_received(request)
            held = self._held(request_id, caller)
            if held is not None:
                return await relay_resumed(request, held, self._ctx, after)
            if self._may_act(caller) and _checked(request_id):
                # Held by another worker of this supervisor, else by another replica.
                elsewhere = None
                if self._siblings:
                    elsewhere = await self._siblings.resume(request_id, caller, after)
                fleet = self._ctx.fleet
                if elsewhere is None and fleet.configured:
                    elsewhere = await fleet.resume(request_id, caller, after)
                if elsewhere is not None:
                    return await relay_peer_stream(
                        request, elsewhere, self._ctx.settings.request_id_header
                    )
            self._failed(request, 1)
            raise RequestNotFoundError()
        except TetherError as error:
            return error_response(error)

    async def resume_local(
        self, request: web.BaseRequest, request_id: str, caller: bytes | None, after: int
    ) -> web.StreamResponse:
        """Another replica's resume: the caller's stream held here, resumed on `request`'s
        connection; 404 when it is not held here."""
        held = self._held(request_id, caller)
        try:
            if held is None:
                raise RequestNotFoundError()
            return await relay_resumed(request, held, self._ctx, after)
        except TetherError as error:
            return error_response(error)

    def _held(self, request_id: str, caller: bytes | None) -> RequestState | None:
        """The caller's stream with this ID that may be resumed here (the latest)."""
        held = [
            state
            for state in self._owned(request_id, caller)
            if state.held is not None and state.held.resumable
        ]
        return held[-1] if held else None

    async def _cancel_many(self, request: web.BaseRequest) -> web.StreamResponse:
        try:
            self._check_budget(request)
            request_ids = await _request_ids(request)
            caller = self._caller(request)
            done = await asyncio.gather(*(self.cancel_local(rid, caller) for rid in request_ids))
            # Only as many IDs as the connection may still fail with are asked of other
            # replicas: a batch does not multiply the calls to them.
            budget = max(FAILED_CANCELS_PER_CONNECTION - self._failures.get(request.protocol, 0), 0)
            missing = [at for at, each in enumerate(done) if each.cancelled == 0]
            found = await self._elsewhere([request_ids[at] for at in missing], caller, budget)
            for at, each in zip(missing, found, strict=True):
                done[at] = each
            for each in done:
                if each.cancelled == 0:
                    self._count("not_found")
            self._failed(request, sum(1 for each in done if each.cancelled == 0))
        except TetherError as error:
            return error_response(error)
        data = [each.as_json(rid) for rid, each in zip(request_ids, done, strict=True)]
        return web.json_response({"object": "list", "data": data})

    async def _cancel_response(self, request: web.BaseRequest) -> web.StreamResponse:
        """`POST /v1/responses/{id}/cancel`: tether's own cancel for an in-flight Responses
        API request it holds; the engine's for anything else (a stored background response,
        which only the engine holds)."""
        response_id = unquote(request.rel_url.raw_path.split("/")[3])
        caller = self._caller(request)
        held = [s for s in self._owned(response_id, caller) if not s.body.background]
        if not held:
            return await self._forward(request)
        done = await self._cancel_held(response_id, held)
        return web.json_response(done.as_json(response_id))

    async def _list(self, request: web.BaseRequest) -> web.StreamResponse:
        caller = self._caller(request)
        listed = self.list_local(caller)
        if self._siblings and self._may_act(caller):
            listed.extend(await self._siblings.requests(caller))
            listed.sort(key=lambda entry: -_age(entry))
            del listed[MAX_LISTED:]
        return web.json_response(
            {"object": "list", "data": listed, "has_more": len(listed) == MAX_LISTED}
        )

    def list_local(self, caller: bytes | None) -> list[dict[str, object]]:
        """The caller's requests in flight held here (at most MAX_LISTED), as
        `GET /v1/requests` shows them."""
        now = time.monotonic()
        listed: list[dict[str, object]] = []
        if self._may_act(caller):
            for state in self._ctx.registry:
                if state.caller == caller and _in_flight(state):
                    listed.append(_listing(state, now))
                    if len(listed) == MAX_LISTED:
                        break
        return listed

    # --- cancelling ------------------------------------------------------------------------

    async def cancel(self, request_id: str, caller: bytes | None) -> Cancellation:
        """Cancel the caller's requests with this ID here, else on the worker or (with the
        fleet settings) the replica that holds them."""
        held = self._owned(request_id, caller)
        if held:
            return await self._cancel_held(request_id, held)
        (done,) = await self._elsewhere([request_id], caller, 1)
        if done.cancelled == 0:
            self._count("not_found")
        return done

    async def _elsewhere(
        self, request_ids: list[str], caller: bytes | None, replica_budget: int
    ) -> list[Cancellation]:
        """The caller's requests with these IDs cancelled by the processes that hold them:
        this supervisor's other workers (one call each for all the IDs), then, for the first
        `replica_budget` IDs still not found, the other replicas."""
        done = [Cancellation(0, None)] * len(request_ids)
        fleet = self._ctx.fleet
        if not ((self._siblings or fleet.configured) and self._may_act(caller)):
            return done
        asked = [at for at, request_id in enumerate(request_ids) if _checked(request_id)]
        found: dict[int, PeerCancellation] = {}
        if self._siblings and asked:
            answers = await self._siblings.cancel([request_ids[at] for at in asked], caller)
            found.update(
                (at, each) for at, each in zip(asked, answers, strict=True) if each is not None
            )
        if fleet.configured:
            rest = [at for at in asked if at not in found][:replica_budget]
            answers = await asyncio.gather(*(fleet.cancel(request_ids[at], caller) for at in rest))
            found.update(
                (at, each) for at, each in zip(rest, answers, strict=True) if each is not None
            )
        for at, each in sorted(found.items()):
            self._count("peer")
            log.info(
                "request_cancelled",
                id_asked=request_ids[at],
                replica=each.replica,
                cancelled=each.cancelled,
                engine=each.engine,
            )
            done[at] = Cancellation(each.cancelled, each.engine, each.replica)
        return done

    async def cancel_local(self, request_id: str, caller: bytes | None) -> Cancellation:
        """Cancel the caller's requests with this ID held here only (a peer's call)."""
        held = self._owned(request_id, caller)
        if not held:
            return Cancellation(0, None)
        return await self._cancel_held(request_id, held)

    async def _cancel_held(self, request_id: str, held: list[RequestState]) -> Cancellation:
        loop = asyncio.get_running_loop()
        for state in held:
            state.left = state.left or loop.create_future()
            self._begin(state)
        results = await asyncio.gather(*(self._stopped(state) for state in held))
        engine = max(results, key=_CERTAINTY.index)
        for state, result in zip(held, results, strict=True):
            self._count(result)
            log.info(
                "request_cancelled",
                id_asked=request_id,
                client_request_id=state.client_request_id,
                internal_request_id=state.internal_request_id,
                engine=result,
            )
        return Cancellation(len(held), engine, self._ctx.fleet.replica)

    def _begin(self, state: RequestState) -> None:
        """Stop `state` as its client leaving would; a stream first finishes the event in
        progress (bounded), so its client's stream ends between two events."""
        if state.span is not None:
            state.span.event("cancelled_by_id")
        relay = state.relay
        if state.phase is not Phase.STREAMING or relay is None or not relay.relaying:
            self._stop(state)
            return
        timer = asyncio.get_running_loop().call_later(EVENT_END_SECONDS, self._stop, state)

        def at_boundary() -> None:
            timer.cancel()
            self._stop(state)

        relay.end_at_event_boundary(at_boundary)

    def _stop(self, state: RequestState) -> None:
        # Only while its handler still serves it: a request that ended meanwhile is done, and
        # its connection's task may serve the next request.
        if _in_flight(state) and self._ctx.registry.by_internal(state.internal_request_id):
            state.stop(Outcome.CANCELLED)

    async def _stopped(self, state: RequestState) -> str:
        """How the engine's work for `state` stopped, once known (bounded)."""
        bound = self._ctx.settings.abort_confirm_timeout
        assert state.left is not None
        started = time.monotonic()
        await asyncio.wait({state.left}, timeout=bound + EVENT_END_SECONDS)
        if not state.left.done():
            return "pending"
        left = bound - (time.monotonic() - started)
        if not await self._ctx.aborts.wait_stopped(state, max(left, 0.0)):
            return "pending"
        if state.ending is not None and state.ending.outcome is not Outcome.CANCELLED:
            return "finished"
        if state.stop_result is not None:
            return state.stop_result.value
        if state.upstream is None:
            return "not_sent"
        if state.body.background:
            return "left_running"
        return "dropped"

    # --- whose requests --------------------------------------------------------------------

    def _caller(self, request: web.BaseRequest) -> bytes | None:
        return self._ctx.callers.of(request.headers)

    def _may_act(self, caller: bytes | None) -> bool:
        return caller is not None or self._ctx.settings.cancel_without_credential

    def _owned(self, request_id: str, caller: bytes | None) -> list[RequestState]:
        """The caller's requests in flight that `request_id` names: by the client's ID, or by
        the ID its answer carries."""
        if not self._may_act(caller) or not _checked(request_id):
            return []
        registry = self._ctx.registry
        found = registry.by_client(request_id)
        for prefix in self._ctx.engine.answer_prefixes:
            if not request_id.startswith(prefix):
                continue
            rest = request_id[len(prefix) :]
            named = [*registry.by_client(rest)]
            by_internal = registry.by_internal(rest)
            if by_internal is not None:
                named.append(by_internal)
            found.extend(state for state in named if _answer_id(state) == request_id)
        owned = [state for state in found if state.caller == caller and _in_flight(state)]
        return list(dict.fromkeys(owned))

    # --- failed attempts -------------------------------------------------------------------

    def _check_budget(self, request: web.BaseRequest) -> None:
        if self._failures.get(request.protocol, 0) >= FAILED_CANCELS_PER_CONNECTION:
            self._count("rate_limited")
            raise TooManyFailedCancelsError(
                "too many cancels on this connection named no request of yours"
            )

    def _failed(self, request: web.BaseRequest, count: int) -> None:
        if count == 0:
            return
        failures = self._failures
        if len(failures) > _SWEEP_ABOVE:
            for connection in [c for c in failures if _closed(c)]:
                del failures[connection]
        failures[request.protocol] = failures.get(request.protocol, 0) + count

    def _count(self, result: str) -> None:
        self._ctx.metrics.cancellations.inc(result)


def _checked(request_id: str) -> bool:
    """Whether an ID asked could be one tether holds (and is safe to log)."""
    try:
        check_client_request_id(request_id)
    except InvalidClientRequestId:
        return False
    return True


def _in_flight(state: RequestState) -> bool:
    return state.ending is None and state.stopped_by is None


def _answer_id(state: RequestState) -> str | None:
    """The ID the client saw in its answer: the engine's, with the client's own ID where
    tether maps it back."""
    route = state.route
    if route is None:
        return None
    if route.maps_id_back:
        return route.answer_id(state.echo_id or state.client_request_id)
    return route.answer_id(state.internal_request_id)


def _listing(state: RequestState, now: float) -> dict[str, object]:
    """One of the caller's requests as `GET /v1/requests` shows it: IDs the client knows,
    never tether's own (a Responses API ID is the client's handle)."""
    return {
        "id": state.client_request_id,
        "object": "request",
        "response_id": _answer_id(state),
        "route": state.path,
        "model": state.body.model,
        "stream": state.body.stream,
        "phase": state.phase.value,
        "age_seconds": round(now - state.started_at, 3),
    }


def _age(entry: dict[str, object]) -> float:
    age = entry.get("age_seconds")
    return float(age) if isinstance(age, int | float) else 0.0


def _closed(connection: object) -> bool:
    transport = getattr(connection, "transport", None)
    return transport is None or transport.is_closing()


async def _request_ids(request: web.BaseRequest) -> list[str]:
    """The IDs a `POST /v1/requests/cancel` names: a JSON object with `request_ids`, a list of
    at most MAX_IDS_PER_CALL strings."""
    problem = (
        f'send a JSON object like {{"request_ids": ["<id>", ...]}} with 1 to {MAX_IDS_PER_CALL} IDs'
    )
    body = bytearray()
    while len(body) <= _MAX_CANCEL_BODY and (data := await request.content.read(65536)):
        body += data
    if len(body) > _MAX_CANCEL_BODY:
        raise InvalidRequestBodyError(problem)
    try:
        payload = json.loads(body)
    except ValueError:
        raise InvalidRequestBodyError(problem) from None
    ids = payload.get("request_ids") if isinstance(payload, dict) else None
    if (
        not isinstance(ids, list)
        or not 0 < len(ids) <= MAX_IDS_PER_CALL
        or not all(isinstance(each, str) for each in ids)
    ):
        raise InvalidRequestBodyError(problem)
    return list(dict.fromkeys(ids))


CANCEL_ROUTES = web.AppKey("tether_cancel_routes", CancelRoutes)
