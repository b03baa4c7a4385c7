"""One request's life, top to bottom, and nothing else.

accept → refuse what must not pass → name it and register → body (streamed, or with tether's
ID written in) → a free engine slot, where tether counts them → send to the engine → its
response relayed (`respond`) → on a disconnect, stop the engine's work (`aborts`), or hold
its stream for a resume that carries it on (`resume`) → one report (`request.accounting`).

Every way out of the ladder below decides the request's `Ending` in one place. The client
leaving shows up here in one of two ways: the handler task is cancelled (aiohttp runs with
`handler_cancellation=True`, so a FIN or RST on the client socket cancels it in any phase),
or a write finds the client's socket closing; both take `_client_gone`.
"""

from __future__ import annotations

import asyncio

from aiohttp import web
from multidict import istr

from ..engines import EngineProfile
from ..errors import (
    AdminAbortedError,
    BlockedRouteError,
    ClientGoneError,
    ClientRequestError,
    HttpVersionNotSupportedError,
    InternalError,
    MethodNotAllowedError,
    RequestCancelledError,
    RequestHeadTooLargeError,
    RequestTimeoutError,
    RouteNotAllowedError,
    ShuttingDownError,
    StoppedByTetherError,
    TetherError,
    TooManyEngineRequestsError,
    error_response,
)
from ..observe.logging import bind_request_ids
from ..outcomes import Outcome, Phase
from ..request.body import outgoing_body
from ..request.engine_slots import SlotGrant
from ..request.naming import adopt_body_id, header_request_id, preserved_id, preserving
from ..request.state import Ending, RequestState
from ..request.websocket import SWITCHING_HEADERS, websocket_asked
from ..settings import RequestIdMode
from ..upstream.connection import ResponseHead
from ..upstream.exchange import RequestBody, SinkClosedError
from ..wire.headers import client_head_size
from ..wire.routes import FORWARDED_VERSIONS, REFUSED_METHODS
from .context import PATH_BLOCKED, PATH_NOT_ALLOWED, ProxyContext
from .early_commit import head_kept_alive, keepalive_for
from .respond import (
    KeptAlive,
    answer_failure,
    began_early_without_events,
    end_stream,
    reject,
    relay_response,
    reported_status,
    response_started,
)
from .resume import carry_on

_CONTENT_LENGTH = istr("Content-Length")
_CONTENT_TYPE = istr("Content-Type")


async def proxy_request(ctx: ProxyContext, request: web.BaseRequest) -> web.StreamResponse:
    """The handler for every client path."""
    settings = ctx.settings
    engine = ctx.engine  # the profile this request keeps to its end
    # (each of aiohttp's request properties runs Python on every read, or on the first: read
    # once here, and later from the request's state)
    method, path, headers = request.method, request.path, request.headers

    # 1. Refuse what must never reach the engine, IDs that cannot be echoed safely, and any
    #    new work once shutdown has begun. The engine gets a fresh ID of tether's, or (in
    #    preserve mode) the client's own, which may then not be in flight twice.
    try:
        _refuse_unforwardable(request, method, ctx, engine)
        websocket = websocket_asked(request)
        named = header_request_id(headers, settings.request_id_header)
        if settings.request_id_mode is RequestIdMode.UNIQUE:
            client_request_id = named or ctx.ids.mint()
            internal_request_id = ctx.ids.mint()
        else:
            client_request_id = preserved_id(ctx.registry, ctx.ids, engine, named)
            internal_request_id = client_request_id
    except TetherError as error:
        return reject(request, ctx, error)
    bind_request_ids(client_request_id, internal_request_id)

    # 2. Register: from here the request is visible to the admin API and to shutdown, and
    #    whatever happens ends in one report.
    facts = ctx.routes.of(method, path, engine)
    state = RequestState(
        client_request_id=client_request_id,
        internal_request_id=internal_request_id,
        method=method,
        path=path,
        route_label=facts.label,
        route=facts.route,
        engine=engine,
        task=request.task,
        connection=request.protocol,
        id_in_header=named is not None,
        websocket=websocket,
        replayable=facts.replayable,
        caller=ctx.callers.of(headers),
        # Only a POST starts a session's stream (a replay's GET is not the session).
        engine_session=(
            headers.get(engine.session_header)
            if engine.session_header and method == "POST"
            else None
        ),
    )
    ctx.registry.add(state)
    ctx.accounting.began(state, headers)
    response: web.StreamResponse
    # Where the client's connection is gone but its stream may be resumed: whether the
    # handler learnt it from its cancellation (else a failed write). The hold is awaited after
    # the `except` clauses, never inside one: a compiled coroutine suspended in one leaves its
    # exception as the one being handled for whatever else the loop runs meanwhile.
    resumable_since_cancel: bool | None = None
    # A stream its caller cancelled that stopped after a whole event: ended as a complete
    # response, after the `except` clauses too.
    ended_at_boundary: web.StreamResponse | None = None
    try:
        try:
            # 3. Forward and relay, bounded by the whole-request timeout when one is set.
            try:
                if settings.request_timeout is None:
                    response = await _forward(request, state, ctx)
                else:
                    async with asyncio.timeout(settings.request_timeout):
                        response = await _forward(request, state, ctx)
            except TimeoutError as timed_out:
                if isinstance(timed_out, TetherError):
                    raise  # tether's own timeouts (connect, idle) already say what happened
                raise RequestTimeoutError(
                    "the request took longer than "
                    f"TETHER_REQUEST_TIMEOUT={settings.request_timeout}s"
                ) from timed_out
            # 4. Completed: the engine's answer, whatever its status, went to the client in full.
            state.ending = Ending(Outcome.COMPLETED, reported_status(response, state))
            return response
        except asyncio.CancelledError:
            # 5a. Cancelled: the client left, an operator aborted it, or tether is shutting down.
            outcome = _why_cancelled(request, state, ctx)
            if outcome is Outcome.CLIENT_DISCONNECTED:
                if not _may_be_resumed(ctx, state):
                    state.ending = _client_gone(ctx, state)
                    raise
                # Its stream may be resumed: the handler carries on without its connection.
                asyncio.current_task().uncancel()  # type: ignore[union-attr]
                resumable_since_cancel = True
            else:
                ctx.aborts.stop_work(state)
                if began_early_without_events(state):
                    # (a stream tether began before the engine answered: its one event says so)
                    asyncio.current_task().uncancel()  # type: ignore[union-attr]
                    stopped = _stopped_by_tether(outcome)
                    response, state.ending = answer_failure(
                        request,
                        state,
                        Ending(outcome, stopped.status, stopped),
                        settings.request_id_header,
                    )
                    return response
                sent = response_started(state)
                if sent is None:
                    # tether cancelled it (admin abort, shutdown) before any byte went out and
                    # the client is still there: it gets a 503 it may retry elsewhere, then the
                    # connection closes.
                    asyncio.current_task().uncancel()  # type: ignore[union-attr]
                    stopped = _stopped_by_tether(outcome)
                    state.ending = Ending(outcome, stopped.status, stopped)
                    return error_response(stopped, settings.request_id_header, client_request_id)
                # Cut mid-response: the status it started with stands.
                state.ending = Ending(outcome, sent.status)
                relay = state.relay
                if outcome is not Outcome.CANCELLED or relay is None or not relay.ended_at_boundary:
                    raise
                # Its caller cancelled it and its stream stopped after a whole event: it ends
                # as a complete HTTP response (5e), not a cut one.
                asyncio.current_task().uncancel()  # type: ignore[union-attr]
                ended_at_boundary = sent
        except (ClientGoneError, SinkClosedError):
            # 5b. A write found the client's socket closing, or the relay its sink. The response
            # goes back to aiohttp, whose last write fails quietly on the closed socket (an
            # exception here would be logged as a server error).
            assert state.client_response is not None  # only a started answer finds it gone
            if not _may_be_resumed(ctx, state):
                state.ending = _client_gone(ctx, state)
                return state.client_response
            resumable_since_cancel = False
        except TetherError as error:
            # 5c. A bad body, a timeout or an upstream failure: before the response started the
            # client gets a JSON error; after, its stream is cut so it can never pass for a
            # complete one. Only a timeout is tether's decision to stop work the engine is doing,
            # so only then is the engine told: a body the engine never fully received starts no
            # generation, and aborting a crashed engine would only add a storm of calls.
            outcome = _outcome_of(error)
            ctx.aborts.stop_work(state, ask_engine=outcome is Outcome.TIMED_OUT)
            response, state.ending = answer_failure(
                request, state, Ending(outcome, error.status, error), settings.request_id_header
            )
            return response
        except Exception as exc:
            # 5d. Anything else is a bug in tether. The client still gets an OpenAI-style answer
            # (or a cut stream), the engine is stopped, and the log gets one error line with the
            # traceback, never its local variables.
            bug = InternalError(f"tether failed unexpectedly ({exc.__class__.__name__})")
            ctx.aborts.stop_work(state)
            response, state.ending = answer_failure(
                request,
                state,
                Ending(Outcome.INTERNAL_ERROR, bug.status, bug, exc),
                settings.request_id_header,
            )
            return response
        if ended_at_boundary is not None:
            # 5e. Cancelled by its caller at an event's boundary: the stream's clean end.
            await end_stream(ended_at_boundary)
            return ended_at_boundary
        # 5f. The client's connection is gone, but its stream may be resumed: held for the
        # grace, carried on by a resume, or stopped as for any client that left.
        assert resumable_since_cancel is not None
        state.ending = await _held_or_gone(ctx, state, cancelled=resumable_since_cancel)
        assert state.client_response is not None
        return state.client_response
    finally:
        # 6. Every way out: its engine slots go to the next request waiting for one, and the
        #    request leaves the registry and is reported, once.
        if state.slots is not None:
            ctx.slots.give_back(state.slots)
        ctx.registry.remove(state)
        ctx.accounting.ended(state)


async def _forward(
    request: web.BaseRequest, state: RequestState, ctx: ProxyContext
) -> web.StreamResponse:
    head, kept_alive = await _answered(request, state, ctx)
    return await relay_response(request, head, state, ctx, kept_alive)


async def _answered(
    request: web.BaseRequest, state: RequestState, ctx: ProxyContext
) -> tuple[ResponseHead, KeptAlive | None]:
    """The engine's response head, and how the wait for it was kept alive (its own
    coroutine, so that the request it sent, head and body, is freed for the rest of a long
    stream)."""
    outgoing = await _outgoing(request, state, ctx)
    keepalive = keepalive_for(request, state, ctx.settings)
    if keepalive is None:
        return await _sent(request, outgoing, state, ctx), None
    # (a wait for a slot is kept alive as the engine's silence is)
    return await head_kept_alive(
        request, _sent(request, outgoing, state, ctx), state, ctx, keepalive
    )


async def _sent(
    request: web.BaseRequest, outgoing: _Outgoing, state: RequestState, ctx: ProxyContext
) -> ResponseHead:
    """Once the engine has a slot free for it (where tether counts them), the request sent
    to the engine; its response head."""
    slots = ctx.slots
    if slots.size is not None and _takes_a_slot(state):
        state.slots = grant = SlotGrant(outgoing.engine_requests)
        state.phase = Phase.QUEUED
        await slots.take(grant)
    state.upstream = upstream = ctx.upstream.exchange(
        state.method,
        replayable=state.replayable,
        upgrade=state.websocket,
    )
    await upstream.send(outgoing.head, outgoing.body, chunked=outgoing.chunked)
    state.phase = Phase.WAITING
    return await upstream.wait_head()


def _takes_a_slot(state: RequestState) -> bool:
    """A request that starts generation on an engine whose own queue does not see its client
    leave."""
    engine = state.engine
    return (
        engine.blind_while_queued
        and state.method == "POST"
        and state.path in engine.generation_routes
    )


class _Outgoing:
    """What goes to the engine: its head, its body, and how many requests it runs for it (a
    plain class for the reason `RequestState` is one)."""

    __slots__ = ("body", "chunked", "engine_requests", "head")

    def __init__(self, head: bytes, body: RequestBody, chunked: bool, engine_requests: int) -> None:
        self.head = head
        self.body = body
        self.chunked = chunked
        self.engine_requests = engine_requests


async def _outgoing(request: web.BaseRequest, state: RequestState, ctx: ProxyContext) -> _Outgoing:
    """The client's request as the engine gets it: its body read (or begun), checked and
    given tether's ID, and the head it goes with (its own coroutine, so that what it built is
    freed for the rest of a long stream)."""
    settings = ctx.settings
    engine = state.engine
    heads = ctx.heads.of(engine)
    headers = request.headers
    outgoing = await outgoing_body(
        request,
        headers.getall(_CONTENT_TYPE, ()) if heads.forwards_content_type else (),
        state.route,
        state.internal_request_id,
        max_json_body=settings.max_json_body,
        body_timeout=settings.client_body_timeout,
        ask_for_usage=ctx.usage.enabled,
        json_rule=engine.json_rule,
        keep_client_id=preserving(state) and not state.id_in_header,
        # (not a session's request: sent as a stream, it would outlive its connection)
        assemble=state.route is not None
        and state.route.assembles_answer
        and state.engine_session is None,
    )
    state.body = facts = outgoing.facts
    engine_requests = (facts.batch or 1) * facts.samples
    if engine_requests > settings.max_engine_requests:
        raise TooManyEngineRequestsError(
            f"the request would start {engine_requests} engine requests (prompts times n); "
            f"the limit is {settings.max_engine_requests} (TETHER_MAX_ENGINE_REQUESTS)"
        )
    if facts.client_id is not None:
        adopt_body_id(ctx.registry, state, facts.client_id)
    added: dict[str, str] = {}  # fields of tether's, in place of any the client sent
    if state.span is not None:
        # The engine's own span (vLLM's llm_request) nests under tether's.
        added.update(state.span.engine_headers())
    if state.websocket:
        added.update(SWITCHING_HEADERS)
    body = outgoing.body
    content_length = len(body) if isinstance(body, bytes) else None
    chunked = outgoing.streamed and not (
        heads.forwards_content_length and _CONTENT_LENGTH in headers
    )
    head = heads.head(
        state.method,
        request.rel_url.raw_path_qs,
        request.raw_headers,
        headers,
        internal_request_id=state.internal_request_id,
        peer=request.remote,
        scheme=request.scheme,
        added=added,
        content_length=content_length,
        chunked=chunked,
    )
    return _Outgoing(head, body, chunked, engine_requests)


def _client_gone(ctx: ProxyContext, state: RequestState) -> Ending:
    """The client left before its answer was complete, however that showed: counted, and the
    engine's work for it stopped."""
    ctx.accounting.connection_cut(state)
    return _abandoned(ctx, state)


def _abandoned(ctx: ProxyContext, state: RequestState) -> Ending:
    ctx.accounting.client_left(state)
    ctx.aborts.stop_work(state)
    return Ending(Outcome.CLIENT_DISCONNECTED, 499)


def _may_be_resumed(ctx: ProxyContext, state: RequestState) -> bool:
    """Its client's connection is gone, but its stream may be resumed (TETHER_RESUME_GRACE),
    or a resume already carries it."""
    held = state.held
    return held is not None and held.resumable and not ctx.readiness.draining


async def _held_or_gone(ctx: ProxyContext, state: RequestState, *, cancelled: bool) -> Ending:
    """Its client's connection is gone and its stream held for a resume (`resume.carry_on`):
    carried to its end by one, or, with none in time, abandoned as by any client that left."""
    held = state.held
    assert held is not None
    if not held.carried:  # (else a resume took it over and closed the connection itself)
        ctx.accounting.connection_cut(state)
    ending = await carry_on(ctx, state, held, cancelled=cancelled)
    return ending if ending is not None else _abandoned(ctx, state)


def _refuse_unforwardable(
    request: web.BaseRequest, method: str, ctx: ProxyContext, engine: EngineProfile
) -> None:
    """What never reaches the engine: any new request once shutdown began, a request head
    larger than nginx's, a request line other than HTTP/1.0 or 1.1, CONNECT and TRACE, the
    engine's control routes, and (with an allowlist) every path not on it."""
    settings = ctx.settings
    if ctx.readiness.draining:
        raise ShuttingDownError()
    head_size = client_head_size(method, request.raw_path, request.raw_headers)
    if head_size > settings.max_request_head:
        raise RequestHeadTooLargeError(
            f"the request head is {head_size} bytes; the limit is "
            f"{settings.max_request_head} (TETHER_MAX_REQUEST_HEAD)"
        )
    if request.version not in FORWARDED_VERSIONS:
        raise HttpVersionNotSupportedError(
            f"HTTP/{request.version.major}.{request.version.minor} is not supported; use HTTP/1.1"
        )
    if method in REFUSED_METHODS:
        raise MethodNotAllowedError(f"{method} is not forwarded to the engine")
    verdict = ctx.paths.verdict(request.rel_url.raw_path, engine)
    if verdict == PATH_BLOCKED:
        raise BlockedRouteError(
            f"{request.path} is an engine control route; tether does not forward it"
        )
    if verdict == PATH_NOT_ALLOWED:
        raise RouteNotAllowedError(
            f"{request.path} is not among the routes this tether forwards (TETHER_ALLOWED_PATHS)"
        )


def _stopped_by_tether(outcome: Outcome) -> StoppedByTetherError:
    if outcome is Outcome.CANCELLED:
        return RequestCancelledError()
    return AdminAbortedError() if outcome is Outcome.ADMIN_ABORTED else ShuttingDownError()


def _outcome_of(error: TetherError) -> Outcome:
    if isinstance(error, ClientRequestError):
        return Outcome.REJECTED
    if isinstance(error, RequestTimeoutError):
        return Outcome.TIMED_OUT
    return Outcome.UPSTREAM_FAILED


def _why_cancelled(request: web.BaseRequest, state: RequestState, ctx: ProxyContext) -> Outcome:
    if state.stopped_by is not None:
        return state.stopped_by
    transport = request.transport
    if transport is None or transport.is_closing():
        return Outcome.CLIENT_DISCONNECTED
    return Outcome.SHUTDOWN_ABORTED if ctx.readiness.draining else Outcome.CLIENT_DISCONNECTED
