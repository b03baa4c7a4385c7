"""One request's life, top to bottom.

accept → refuse what must not pass → register → body (streamed, or with tether's ID written in)
→ send to the engine → its response head → its body relayed as it arrives (IDs mapped back,
tokens counted) → on a disconnect, stop the engine's work (abort and confirm, or drop the
connection) → log, metrics.

The client leaving shows up here in one of two ways: the handler task is cancelled (aiohttp
runs with `handler_cancellation=True`, so a FIN or RST on the client socket cancels it in any
phase), or the relay finds the client's socket closing. Both take the same branch: the
engine's work is stopped and the outcome recorded.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable
from typing import TypeVar

import structlog
from aiohttp import web
from aiohttp.abc import AbstractStreamWriter
from aiohttp.http_writer import StreamWriter
from multidict import CIMultiDict, istr

from .aborts import StopRequest
from .context import ProxyContext
from .engines import EngineProfile, Route
from .errors import (
    AdminAbortedError,
    BlockedRouteError,
    ClientGoneError,
    ClientRequestError,
    DuplicateRequestIdError,
    HttpVersionNotSupportedError,
    InternalError,
    InvalidRequestIdError,
    MethodNotAllowedError,
    RequestTimeoutError,
    RouteNotAllowedError,
    ShuttingDownError,
    StoppedByTetherError,
    TetherError,
    UpstreamError,
)
from .headers import client_response_headers, upstream_request_headers
from .logging import bind_request_ids
from .metrics import route_label
from .registry import Outcome, Phase, RequestState
from .relay import ResponseRelay
from .request_body import outgoing_body
from .request_ids import (
    IdMapper,
    InvalidClientRequestId,
    check_client_request_id,
    json_escaped,
)
from .routes import FORWARDED_VERSIONS, REFUSED_METHODS, is_allowed, is_blocked
from .settings import RequestIdMode
from .tokens import TokenCounter, TokenShape
from .tracing import RequestSpan
from .upstream_connection import ResponseHead
from .upstream_exchange import UpstreamExchange
from .usage_events import UsageEventFilter
from .websocket import SWITCHING_HEADERS, ClientFrames, websocket_asked

log = structlog.get_logger("tether.request")

_T = TypeVar("_T")

_CONTENT_ENCODING = istr("Content-Encoding")
_CONTENT_LENGTH = istr("Content-Length")
_CONTENT_TYPE = istr("Content-Type")
# Response bodies in which the internal ID is replaced by the client's.
_MAPPED_TYPES = frozenset({"application/json", "text/event-stream", "application/x-ndjson"})
# An engine has registered a request once it sent a byte of its body (a streaming head can
# come first), or this long (seconds) after it got all of it (vLLM: a few milliseconds): an
# abort missing it later is the engine's front end missing, not one that overtook it.
_REGISTERED_AFTER = 0.05
# A JSON response with a Content-Length up to this size is read whole so that the rewritten
# body goes out with an exact Content-Length; larger ones are streamed chunked.
_MAX_BUFFERED_RESPONSE = 8 * 1024 * 1024


class RequestCycle:
    """Per-request flags and handles the handler decides from (never shared across requests)."""

    __slots__ = (
        "background",
        "batch",
        "client_response",
        "echo_id",
        "id_in_header",
        "model",
        "relay",
        "route",
        "samples",
        "span",
        "span_handed_over",
        "state",
        "stop",
        "tunnel",
        "upstream",
        "usage_asked",
        "websocket",
    )

    def __init__(self, state: RequestState, route: Route | None, span: RequestSpan | None) -> None:
        self.state = state
        self.route = route
        self.span = span
        # The abort tracker ends the span (and reports the request) once the engine's work
        # has stopped.
        self.span_handed_over = False
        self.stop: StopRequest | None = None
        self.upstream: UpstreamExchange | None = None
        self.relay: ResponseRelay | None = None
        self.client_response: web.StreamResponse | None = None
        self.background = False  # the client asked the engine to outlive the connection
        self.batch: int | None = None  # prompts in the body's batch; None: one prompt
        self.samples = 1  # samples it asks for (`n`)
        self.usage_asked = False  # tether asked for the stream's usage: the client did not
        self.model: str | None = None  # the body's `model`, where tether read the body
        self.id_in_header = False  # the client named the request in the request-ID header
        # The client's ID as the engine would have written it into its answer, where that is
        # not `state.client_request_id` (SGLang answers with a body `rid` over the header's).
        self.echo_id: str | None = None
        self.websocket = False  # it asks for a WebSocket session
        # The client's side of a WebSocket session, once the engine took it (the engine's
        # side is `relay`).
        self.tunnel: ClientFrames | None = None


async def proxy_request(ctx: ProxyContext, request: web.BaseRequest) -> web.StreamResponse:
    """The handler for every client path."""
    settings = ctx.settings

    # 1. Refuse what must never reach the engine, IDs that cannot be echoed safely, and any
    #    new work once shutdown has begun. The engine gets a fresh ID of tether's, or (in
    #    preserve mode) the client's own, which may then not be in flight twice.
    try:
        if ctx.readiness.draining:
            raise ShuttingDownError()
        _refuse_unforwardable(request, ctx.engine)
        websocket = websocket_asked(request)
        header_request_id = _header_request_id(request, settings.request_id_header)
        client_request_id = header_request_id or ctx.ids.mint()
        if settings.request_id_mode is RequestIdMode.UNIQUE:
            internal_request_id = ctx.ids.mint()
        elif ctx.registry.find(client_request_id):
            raise DuplicateRequestIdError(_duplicate_message(client_request_id))
        else:
            internal_request_id = client_request_id
    except TetherError as error:
        return _reject(request, ctx, error)
    bind_request_ids(client_request_id, internal_request_id)

    # 2. Register: from here the request is visible to the admin API and to shutdown.
    state = RequestState(
        client_request_id=client_request_id,
        internal_request_id=internal_request_id,
        method=request.method,
        path=request.path,
        route=route_label(request.path),
        task=request.task,
        connection=request.protocol,
    )
    span = ctx.tracer.start(request.method, state.route, request.headers) if ctx.tracer else None
    cycle = RequestCycle(state, ctx.engine.route(request.method, request.path), span)
    cycle.id_in_header = header_request_id is not None
    cycle.websocket = websocket
    ctx.registry.add(state)
    ctx.metrics.in_flight.value += 1
    try:
        # 3. Forward and relay, bounded by the whole-request timeout when one is set.
        try:
            if settings.request_timeout is None:
                response = await _forward(request, cycle, ctx)
            else:
                async with asyncio.timeout(settings.request_timeout):
                    response = await _forward(request, cycle, ctx)
        except TimeoutError as exc:
            if isinstance(exc, TetherError):
                raise  # tether's own timeouts (connect, idle) already say what happened
            raise RequestTimeoutError(
                f"the request took longer than TETHER_REQUEST_TIMEOUT={settings.request_timeout}s"
            ) from exc
    except asyncio.CancelledError:
        # 4a. Cancelled: the client left, an operator aborted it, or tether is shutting down.
        outcome = _why_cancelled(request, state, ctx)
        _stop_upstream(ctx, cycle, outcome)
        sent = _response_started(cycle)
        if outcome is Outcome.CLIENT_DISCONNECTED:
            _finish(ctx, cycle, outcome, 499)
            raise
        if sent is not None:  # cut mid-response: the status it started with stands
            _finish(ctx, cycle, outcome, sent.status)
            raise
        # tether cancelled it (admin abort, shutdown) before any byte went out and the client
        # is still there: it gets a 503 it may retry elsewhere, then the connection closes.
        asyncio.current_task().uncancel()  # type: ignore[union-attr]
        stopped = _stopped_by_tether(outcome)
        _finish(ctx, cycle, outcome, stopped.status, stopped)
        response = _error_response(stopped, settings.request_id_header, client_request_id)
        response.force_close()
        return response
    except ClientGoneError:
        # 4b. The relay found the client's socket closing: same as a cancellation by a
        # disconnect. The response goes back to aiohttp, whose last write fails quietly on the
        # closed socket (an exception here would be logged as a server error).
        _stop_upstream(ctx, cycle, Outcome.CLIENT_DISCONNECTED)
        _finish(ctx, cycle, Outcome.CLIENT_DISCONNECTED, 499)
        assert cycle.client_response is not None  # only a started relay finds the client gone
        return cycle.client_response
    except TetherError as error:
        # 4c. A bad body, a timeout or an upstream failure: before the response started the
        # client gets a JSON error; after, its stream is cut so it can never pass for a
        # complete one. Only a timeout is tether's decision to stop work the engine is doing,
        # so only then is the engine told: a body the engine never fully received starts no
        # generation, and aborting a crashed engine would only add a storm of calls.
        outcome = _outcome_of(error)
        _stop_upstream(ctx, cycle, outcome, ask_engine=outcome is Outcome.TIMED_OUT)
        if isinstance(error, UpstreamError):
            ctx.metrics.upstream_errors.inc(error.code)
        return _answer_failure(request, ctx, cycle, outcome, error)
    except Exception as exc:
        # 4d. Anything else is a bug in tether. The client still gets an OpenAI-style answer
        # (or a cut stream), the engine is stopped, and the log gets one error line with the
        # traceback, never its local variables.
        bug = InternalError(f"tether failed unexpectedly ({exc.__class__.__name__})")
        _stop_upstream(ctx, cycle, Outcome.INTERNAL_ERROR)
        return _answer_failure(request, ctx, cycle, Outcome.INTERNAL_ERROR, bug, exc)
    finally:
        ctx.registry.remove(state)
        ctx.metrics.in_flight.value -= 1
    # 5. Completed: the engine's answer, whatever its status, went to the client in full.
    _finish(ctx, cycle, Outcome.COMPLETED, response.status)
    return response


async def _forward(
    request: web.BaseRequest, cycle: RequestCycle, ctx: ProxyContext
) -> web.StreamResponse:
    upstream = await _send(request, cycle, ctx)
    cycle.state.phase = Phase.WAITING
    response_head = await upstream.wait_head()
    if response_head.status == 101:  # only ever accepted for a WebSocket handshake
        return await _relay_websocket(request, response_head, cycle, ctx)
    mapper = _id_mapper(response_head, cycle)
    tokens = TokenCounter(cycle.route.tokens if cycle.route is not None else TokenShape.NONE)
    usage = (
        UsageEventFilter(restore_fingerprint=ctx.engine.usage_takes_fingerprint)
        if cycle.usage_asked and _is_sse(response_head)
        else None
    )
    cycle.relay = relay = ResponseRelay(upstream, tokens, mapper, usage)
    cycle.state.relay = relay
    length = response_head.content_length
    if mapper is not None and length is not None and length <= _MAX_BUFFERED_RESPONSE:
        return await _relay_whole(response_head, cycle, ctx, mapper)
    return await _relay_stream(request, response_head, cycle, ctx, mapper)


async def _send(
    request: web.BaseRequest, cycle: RequestCycle, ctx: ProxyContext
) -> UpstreamExchange:
    """The client's request, sent to the engine (its own coroutine, so that what it built,
    the head and body among them, is freed for the rest of a long stream)."""
    state = cycle.state
    settings = ctx.settings
    headers = upstream_request_headers(
        request.headers,
        client_request_id_header=settings.request_id_header,
        internal_request_id=state.internal_request_id,
        peer=request.remote,
        scheme=request.scheme,
        id_headers=ctx.engine.id_headers,
    )
    outgoing = await outgoing_body(
        request,
        headers,
        cycle.route,
        state.internal_request_id,
        max_json_body=settings.max_json_body,
        body_timeout=settings.client_body_timeout,
        ask_for_usage=ctx.usage.enabled,
        json_rule=ctx.engine.json_rule,
        keep_client_id=_preserving(cycle) and not cycle.id_in_header,
    )
    if outgoing.client_id is not None:
        _adopt_body_id(ctx, cycle, outgoing.client_id, headers)
    cycle.usage_asked = outgoing.usage_asked
    cycle.model = outgoing.model
    cycle.background = outgoing.background
    cycle.batch = outgoing.batch
    cycle.samples = outgoing.samples
    if cycle.span is not None:
        # The engine's own span (vLLM's llm_request) nests under tether's.
        headers.update(cycle.span.engine_headers())
    if cycle.websocket:
        headers.update(SWITCHING_HEADERS)
    body = outgoing.body
    content_length = None
    if isinstance(body, bytes):
        headers.popall(_CONTENT_LENGTH, None)
        content_length = len(body)
    chunked = outgoing.streamed and _CONTENT_LENGTH not in headers
    head = ctx.upstream.request_head(
        request.method,
        request.rel_url.raw_path_qs,
        headers,
        content_length=content_length,
        chunked=chunked,
    )
    cycle.upstream = upstream = ctx.upstream.exchange(request.method, upgrade=cycle.websocket)
    state.upstream_contacted = True
    await upstream.send(head, body, chunked=chunked)
    return upstream


def _id_mapper(head: ResponseHead, cycle: RequestCycle) -> IdMapper | None:
    """A mapper for JSON and SSE bodies; None for anything else, anything compressed, and
    routes whose engine ID is the client's handle."""
    if cycle.route is not None and not cycle.route.maps_id_back:
        return None
    if head.headers.get(_CONTENT_ENCODING, "identity").lower() != "identity":
        return None
    media_type = head.headers.get(_CONTENT_TYPE, "").partition(";")[0].strip().lower()
    if media_type not in _MAPPED_TYPES and not media_type.endswith("+json"):
        return None
    state = cycle.state
    echo_id = cycle.echo_id or state.client_request_id
    if state.internal_request_id == echo_id:
        return None  # preserve mode: the engine already used the client's ID
    return IdMapper(state.internal_request_id, json_escaped(echo_id))


async def _relay_whole(
    head: ResponseHead, cycle: RequestCycle, ctx: ProxyContext, mapper: IdMapper
) -> web.StreamResponse:
    """A JSON response of known length: read it, map the ID back, answer with its new length."""
    assert cycle.upstream is not None and cycle.relay is not None
    cycle.relay.to_buffer()
    cycle.upstream.attach(cycle.relay)
    await cycle.upstream.wait_end(ctx.settings.stream_idle_timeout)
    body = mapper.feed(cycle.relay.buffered()) + mapper.flush()
    headers = client_response_headers(
        head.headers,
        client_request_id_header=ctx.settings.request_id_header,
        client_request_id=cycle.state.client_request_id,
        body_rewritten=True,
    )
    cycle.state.bytes_out = len(body)
    response = web.Response(status=head.status, reason=head.reason, headers=headers, body=body)
    if ctx.readiness.draining:
        response.force_close()
    return response


async def _relay_stream(
    request: web.BaseRequest,
    head: ResponseHead,
    cycle: RequestCycle,
    ctx: ProxyContext,
    mapper: IdMapper | None,
) -> web.StreamResponse:
    """Relay the body to the client as it arrives, from the upstream protocol straight into
    the client's socket; this coroutine only waits for the end."""
    assert cycle.upstream is not None and cycle.relay is not None
    headers = client_response_headers(
        head.headers,
        client_request_id_header=ctx.settings.request_id_header,
        client_request_id=cycle.state.client_request_id,
        body_rewritten=mapper is not None,
    )
    response = web.StreamResponse(status=head.status, reason=head.reason, headers=headers)
    if ctx.readiness.draining:
        response.force_close()
    cycle.client_response = response
    writer = await _to_client(response.prepare(request))
    transport = request.transport
    if writer is None or transport is None or transport.is_closing():
        raise ClientGoneError("the client left before the response started")
    cycle.relay.to_client(
        transport,
        writer,
        chunked=_is_chunked(writer),
        is_sse=_is_sse(head),
    )
    cycle.state.phase = Phase.STREAMING
    cycle.upstream.attach(cycle.relay)
    await cycle.upstream.wait_end(ctx.settings.stream_idle_timeout)
    cycle.relay.finish()
    if cycle.relay.engine_reports_usage:
        ctx.usage.engine_reports_usage()
    await _to_client(response.write_eof())
    return response


async def _relay_websocket(
    request: web.BaseRequest, head: ResponseHead, cycle: RequestCycle, ctx: ProxyContext
) -> web.StreamResponse:
    """The engine accepted the WebSocket: its 101 goes to the client, then each connection
    carries the other's bytes until one of them closes."""
    assert cycle.upstream is not None
    headers = client_response_headers(
        head.headers,
        client_request_id_header=ctx.settings.request_id_header,
        client_request_id=cycle.state.client_request_id,
        body_rewritten=False,
    )
    headers.update(SWITCHING_HEADERS)
    response = web.StreamResponse(status=101, reason=head.reason, headers=headers)
    response.force_close()  # the connection ends with the session
    cycle.client_response = response
    writer = await _to_client(response.prepare(request))
    transport = request.transport
    if writer is None or transport is None or transport.is_closing():
        raise ClientGoneError("the client left before the session started")
    # The engine's bytes go to the client as any response body does, unframed and uncounted.
    cycle.relay = relay = ResponseRelay(cycle.upstream, TokenCounter(TokenShape.NONE), None)
    relay.to_client(transport, writer, chunked=False, is_sse=False)
    cycle.tunnel = frames = ClientFrames(cycle.upstream, transport)
    cycle.state.phase = Phase.STREAMING
    ctx.metrics.websocket_sessions_open.value += 1
    try:
        cycle.upstream.attach(relay)
        # From here aiohttp hands the client's bytes to `frames` (those that came with the
        # handshake first), as it would to its own WebSocket reader.
        request.protocol.set_parser(frames)  # type: ignore[arg-type]
        await cycle.upstream.wait_end()
    finally:
        ctx.metrics.websocket_sessions_open.value -= 1
        frames.close()
    transport.close()  # the engine closed the session: the client's side goes after its bytes
    return response


def _is_sse(head: ResponseHead) -> bool:
    return head.headers.get(_CONTENT_TYPE, "").startswith("text/event-stream")


def _is_chunked(writer: AbstractStreamWriter) -> bool:
    """Whether aiohttp framed this response as chunked (no Content-Length, HTTP/1.1): the relay
    then frames each piece the same way, and aiohttp writes the last chunk at the end."""
    return isinstance(writer, StreamWriter) and writer.chunked


async def _to_client(write: Awaitable[_T]) -> _T:
    """Await a write to the client; a failure means the client has left."""
    try:
        return await write
    except ConnectionError as exc:
        raise ClientGoneError(str(exc)) from exc


def _refuse_unforwardable(request: web.BaseRequest, engine: EngineProfile) -> None:
    """What never reaches the engine: a request line other than HTTP/1.0 or 1.1, CONNECT and
    TRACE, the engine's control routes, and (with an allowlist) every path not on it."""
    if request.version not in FORWARDED_VERSIONS:
        raise HttpVersionNotSupportedError(
            f"HTTP/{request.version.major}.{request.version.minor} is not supported; use HTTP/1.1"
        )
    if request.method in REFUSED_METHODS:
        raise MethodNotAllowedError(f"{request.method} is not forwarded to the engine")
    raw_path = request.rel_url.raw_path
    if is_blocked(raw_path, engine.blocked_paths):
        raise BlockedRouteError(
            f"{request.path} is an engine control route; tether does not forward it"
        )
    if engine.allowed_paths is not None and not is_allowed(raw_path, engine.allowed_paths):
        raise RouteNotAllowedError(
            f"{request.path} is not among the routes this tether forwards (TETHER_ALLOWED_PATHS)"
        )


def _header_request_id(request: web.BaseRequest, header: str) -> str | None:
    value = request.headers.get(header)
    if value is None:
        return None
    try:
        return check_client_request_id(value)
    except InvalidClientRequestId as exc:
        raise InvalidRequestIdError(f"the {header} header {exc}") from None


def _duplicate_message(request_id: str) -> str:
    return (
        f"a request with the ID {request_id!r} is already in flight "
        "(TETHER_REQUEST_ID_MODE=preserve passes IDs to the engine unchanged, so each "
        "must be unique while it runs)"
    )


def _preserving(cycle: RequestCycle) -> bool:
    """Whether the engine gets the client's own IDs (TETHER_REQUEST_ID_MODE=preserve)."""
    return cycle.state.internal_request_id == cycle.state.client_request_id


def _adopt_body_id(
    ctx: ProxyContext, cycle: RequestCycle, body_id: str, headers: CIMultiDict[str]
) -> None:
    """A client that named its request in the body (vLLM's `request_id`, SGLang's `rid`)
    gets that name back wherever the engine would have written it into its answer: without
    a header ID it is the request's client ID (logs, the response header, the admin API; in
    preserve mode the engine's ID too), with one it is the engine's choice which wins."""
    state = cycle.state
    if cycle.id_in_header:
        if ctx.engine.body_id_beats_header:
            cycle.echo_id = body_id
        return
    preserving = _preserving(cycle)
    try:
        check_client_request_id(body_id)
    except InvalidClientRequestId as exc:
        if preserving:  # the engine would be keyed by an ID tether cannot log or echo
            raise InvalidRequestIdError(f"the body's request ID {exc}") from None
        cycle.echo_id = body_id  # echoed in the body as the engine would; tether's ID elsewhere
        return
    if preserving and ctx.registry.find(body_id):
        raise DuplicateRequestIdError(_duplicate_message(body_id))
    internal_request_id = body_id if preserving else state.internal_request_id
    ctx.registry.rename(state, body_id, internal_request_id)
    if preserving:
        for name in ctx.engine.id_headers:
            headers[name] = body_id
    bind_request_ids(body_id, internal_request_id)


def _response_started(cycle: RequestCycle) -> web.StreamResponse | None:
    """The client's response if its head already went out (its status can no longer change)."""
    response = cycle.client_response
    return response if response is not None and response.prepared else None


def _stopped_by_tether(outcome: Outcome) -> StoppedByTetherError:
    if outcome is Outcome.ADMIN_ABORTED:
        return AdminAbortedError("an operator aborted this request")
    return ShuttingDownError()


def _outcome_of(error: TetherError) -> Outcome:
    if isinstance(error, ClientRequestError):
        return Outcome.REJECTED
    if isinstance(error, RequestTimeoutError):
        return Outcome.TIMED_OUT
    return Outcome.UPSTREAM_FAILED


def _why_cancelled(request: web.BaseRequest, state: RequestState, ctx: ProxyContext) -> Outcome:
    if state.ended_by is not None:
        return state.ended_by
    transport = request.transport
    if transport is None or transport.is_closing():
        return Outcome.CLIENT_DISCONNECTED
    return Outcome.SHUTDOWN_ABORTED if ctx.readiness.draining else Outcome.CLIENT_DISCONNECTED


def _stop_upstream(
    ctx: ProxyContext, cycle: RequestCycle, outcome: Outcome, *, ask_engine: bool = True
) -> None:
    """Stop what the engine is doing for this request, if it saw the request.

    Without `ask_engine`, or when the engine never got the whole request, the connection is
    dropped (never pooled): an engine that listens for disconnects stops at once. Otherwise
    the abort tracker stops it, confirming from the engine's own response where it can.
    """
    state = cycle.state
    if outcome is Outcome.CLIENT_DISCONNECTED:
        ctx.metrics.client_disconnects.inc(state.phase.value)
        log.info(
            "client_disconnected",
            phase=state.phase.value,
            upstream_contacted=state.upstream_contacted,
        )
        if cycle.span is not None:
            cycle.span.event("client_disconnected", phase=state.phase.value)
            cycle.span.set(disconnect_phase=state.phase.value)
    upstream = cycle.upstream
    if upstream is None:
        return
    if cycle.tunnel is not None:
        # A WebSocket session has no ID an engine API names; its connection closing is
        # what ends it at the engine (vLLM's session cleanup then aborts its request).
        if not upstream.ended:
            ctx.metrics.upstream_cancels.inc(outcome.value)
        upstream.close()
        return
    relay = cycle.relay
    if relay is None:
        # The engine's answer had not begun: it is still counted when it comes.
        shape = cycle.route.tokens if cycle.route is not None else TokenShape.NONE
        cycle.relay = relay = ResponseRelay(upstream, TokenCounter(shape), None)
        upstream.attach(relay)
    if ask_engine and not upstream.ended:
        ctx.metrics.upstream_cancels.inc(outcome.value)
    if not ask_engine or not upstream.sent or upstream.ended:
        relay.discard()
        upstream.close()
        return
    route = cycle.route
    now = asyncio.get_running_loop().time()
    events = relay.tokens.events
    first_body_at = upstream.first_body_at
    stop = StopRequest(
        internal_request_id=state.internal_request_id,
        client_request_id=state.client_request_id,
        route_label=state.route,
        engine_request_ids=(
            route.engine_request_ids(state.internal_request_id, cycle.batch, cycle.samples)
            if route is not None
            else ()
        ),
        upstream=upstream,
        relay=relay,
        since=now,
        span=cycle.span,
        # The mean time between the stream's token events so far: one engine step.
        step=(time.monotonic() - first_body_at) / events
        if first_body_at is not None and events >= 2
        else None,
        registered_by=now if first_body_at is not None else upstream.sent_at + _REGISTERED_AFTER,
    )
    handed_over = ctx.aborts.let_finish(stop) if cycle.background else ctx.aborts.stop(stop)
    cycle.span_handed_over = handed_over
    cycle.stop = stop if handed_over else None


def _answer_failure(
    request: web.BaseRequest,
    ctx: ProxyContext,
    cycle: RequestCycle,
    outcome: Outcome,
    error: TetherError,
    exc: BaseException | None = None,
) -> web.StreamResponse:
    """Before the response started: a JSON error. After: the stream is cut, so the client can
    never take it for a complete one."""
    sent = _response_started(cycle)
    if sent is not None:
        _finish(ctx, cycle, outcome, sent.status, error, exc)
        _cut_client_stream(request)
        return sent
    _finish(ctx, cycle, outcome, error.status, error, exc)
    return _error_response(error, ctx.settings.request_id_header, cycle.state.client_request_id)


def _cut_client_stream(request: web.BaseRequest) -> None:
    """End a started response without its terminator, so the client sees it as truncated.

    Closing the transport makes aiohttp's final `write_eof` fail instead of sending the last
    chunk; the bytes already written are still flushed.
    """
    if request.transport is not None:
        request.transport.close()


def _reject(request: web.BaseRequest, ctx: ProxyContext, error: TetherError) -> web.Response:
    """Refused before anything was forwarded: counted as rejected, never seen by the engine."""
    header = ctx.settings.request_id_header
    echo = request.headers.get(header) if not isinstance(error, InvalidRequestIdError) else None
    if echo is not None:
        try:
            echo = check_client_request_id(echo)
        except InvalidClientRequestId:
            echo = None
    log.log(
        error.log_level,
        "request_rejected",
        method=request.method,
        path=request.path if not isinstance(error, InvalidRequestIdError) else None,
        status=error.status,
        reason=error.message,
    )
    route = route_label(request.path)
    ctx.metrics.record_rejection(route, error.status)
    if ctx.tracer is not None:
        span = ctx.tracer.start(request.method, route, request.headers)
        span.set(client_request_id=echo, outcome=Outcome.REJECTED.value)
        span.finish(error.status, error.message)
        span.end()
    response = _error_response(error, header, echo)
    if isinstance(error, ShuttingDownError):
        # Draining: this connection closes after the answer, and the client (or gateway) is
        # told it may retry at once, elsewhere.
        response.headers["Retry-After"] = "0"
        response.force_close()
    elif isinstance(error, HttpVersionNotSupportedError):
        response.force_close()  # whatever follows on this connection is not HTTP/1.x
    return response


def _error_response(error: TetherError, header: str, client_request_id: str | None) -> web.Response:
    headers = {header: client_request_id} if client_request_id is not None else None
    return web.Response(
        status=error.status,
        body=error.body(),
        content_type="application/json",
        headers=headers,
    )


def _finish(
    ctx: ProxyContext,
    cycle: RequestCycle,
    outcome: Outcome,
    status: int,
    error: TetherError | None = None,
    exc: BaseException | None = None,
) -> None:
    """Metrics and the one summary line of a request."""
    state = cycle.state
    now = time.monotonic()
    duration = now - state.started_at
    relay = cycle.relay
    upstream = cycle.upstream
    if upstream is not None and upstream.head is not None:
        first_byte = upstream.first_body_at or now
        ctx.metrics.record_first_byte(state.route, first_byte - state.started_at)
        state.first_byte_at = first_byte
    tokens = 0
    if relay is not None:
        if relay.relaying or relay.tokens_relayed is None:
            tokens = relay.tokens.total() if outcome is Outcome.COMPLETED else relay.tokens.events
        else:
            tokens = relay.tokens_relayed
        state.bytes_out = max(state.bytes_out, relay.bytes_out)
    tunnel = cycle.tunnel
    if tunnel is not None:
        ctx.metrics.record_websocket_session(outcome.value)
    ctx.metrics.record_request(
        state.route,
        status,
        outcome.value,
        duration,
        state.bytes_out,
        relay.sse_events if relay is not None else 0,
        tokens,
    )
    ttfb = state.first_byte_at - state.started_at if state.first_byte_at is not None else None
    span = cycle.span
    if span is not None:
        span.set(
            client_request_id=state.client_request_id,
            internal_request_id=state.internal_request_id,
            outcome=outcome.value,
            tokens_relayed=tokens,
        )
        span.finish(status, error.message if error is not None else None)
    level = error.log_level if error is not None else logging.INFO
    line: dict[str, object] | None = None
    if log.is_enabled_for(level):  # else the line's fields are not even assembled
        line = {
            "method": state.method,
            "path": state.path,
            "status": status,
            "outcome": outcome.value,
            "duration_ms": round(duration * 1000, 2),
            "ttfb_ms": round(ttfb * 1000, 2) if ttfb is not None else None,
            "bytes_out": state.bytes_out,
            "tokens": tokens,
            "error": error.message if error is not None else None,
        }
        if tunnel is not None:
            line["websocket_bytes_in"] = tunnel.bytes_from_client

    def report(tokens_after_disconnect: int | None) -> None:
        """What the engine says the request used, once known: now, or once tether stopped
        the engine's work for it (the tokens it produced after the client left)."""
        tokens_counted = relay.tokens if relay is not None else None
        prompt = tokens_counted.reported_prompt() if tokens_counted is not None else None
        engine_total = tokens_counted.reported() if tokens_counted is not None else None
        completion = (
            engine_total
            if engine_total is not None
            else tokens + (tokens_after_disconnect or 0)
            if relay is not None
            else None
        )
        if prompt is not None and completion == 0 and ctx.engine.prompt_counted_from_first_token:
            prompt = 0  # ended before its prefill finished: as the engine counts it
        if prompt is not None:
            ctx.metrics.record_prompt_tokens(state.route, prompt)
        if span is not None:
            span.set_gen_ai(
                input_tokens=prompt,
                output_tokens=completion,
                model=cycle.model,
                finish_reasons=tokens_counted.finish_reasons() if tokens_counted else (),
            )
            if not cycle.span_handed_over:
                span.end()
        if line is None:
            return
        log.log(
            level,
            "request_finished",
            **line,
            prompt_tokens=prompt,
            completion_tokens=completion,
            completion_tokens_after_disconnect=tokens_after_disconnect,
            tokens_counted=(
                "engine" if engine_total is not None else "events" if relay is not None else None
            ),
            exc_info=exc,
        )

    if cycle.stop is not None:
        cycle.stop.on_stopped = report
    else:
        report(None)
