"""One request's life, top to bottom.

accept → refuse what must not pass → register → body (streamed, or with tether's ID written in)
→ send to the engine → its response head → its body relayed as it arrives (IDs mapped back,
tokens counted) → on a disconnect, stop the engine's work (abort and confirm, or drop the
connection) → one report (log line, metrics, span: `accounting`).

The client leaving shows up here in one of two ways: the handler task is cancelled (aiohttp
runs with `handler_cancellation=True`, so a FIN or RST on the client socket cancels it in any
phase), or the relay finds the client's socket closing. Both take the same branch: the
engine's work is stopped and the outcome recorded.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable
from dataclasses import replace
from typing import TypeVar

from aiohttp import web
from aiohttp.abc import AbstractStreamWriter
from aiohttp.http_writer import StreamWriter
from multidict import CIMultiDict, istr

from ..aborts.tracker import StopRequest
from ..engines import EngineProfile
from ..errors import (
    AdminAbortedError,
    BlockedRouteError,
    ClientGoneError,
    ClientRequestError,
    DuplicateRequestIdError,
    HttpVersionNotSupportedError,
    InternalError,
    InvalidRequestIdError,
    MethodNotAllowedError,
    OverlappingRequestIdError,
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
from ..observe.metrics import route_label
from ..outcomes import Outcome, Phase
from ..request.body import outgoing_body
from ..request.state import Ending, RequestState
from ..request.websocket import SWITCHING_HEADERS, ClientFrames, websocket_asked
from ..settings import RequestIdMode
from ..upstream.connection import ResponseHead
from ..upstream.exchange import SinkClosedError, UpstreamExchange
from ..upstream.relay import ResponseRelay
from ..wire.headers import client_head_size, client_response_headers, upstream_request_headers
from ..wire.ids import (
    IdMapper,
    InvalidClientRequestId,
    check_client_request_id,
    json_escaped,
)
from ..wire.routes import FORWARDED_VERSIONS, REFUSED_METHODS, is_allowed, is_blocked
from ..wire.tokens import TokenCounter, TokenShape
from ..wire.usage_events import UsageEventFilter
from .context import ProxyContext

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


async def proxy_request(ctx: ProxyContext, request: web.BaseRequest) -> web.StreamResponse:
    """The handler for every client path."""
    settings = ctx.settings
    engine = ctx.engine  # the profile this request keeps to its end

    # 1. Refuse what must never reach the engine, IDs that cannot be echoed safely, and any
    #    new work once shutdown has begun. The engine gets a fresh ID of tether's, or (in
    #    preserve mode) the client's own, which may then not be in flight twice.
    try:
        if ctx.readiness.draining:
            raise ShuttingDownError()
        head_size = client_head_size(request.method, request.raw_path, request.raw_headers)
        if head_size > settings.max_request_head:
            raise RequestHeadTooLargeError(
                f"the request head is {head_size} bytes; the limit is "
                f"{settings.max_request_head} (TETHER_MAX_REQUEST_HEAD)"
            )
        _refuse_unforwardable(request, engine)
        websocket = websocket_asked(request)
        header_request_id = _header_request_id(request, settings.request_id_header)
        if settings.request_id_mode is RequestIdMode.UNIQUE:
            client_request_id = header_request_id or ctx.ids.mint()
            internal_request_id = ctx.ids.mint()
        else:
            client_request_id = internal_request_id = _preserved_id(ctx, engine, header_request_id)
    except TetherError as error:
        return _reject(request, ctx, error)
    bind_request_ids(client_request_id, internal_request_id)

    # 2. Register: from here the request is visible to the admin API and to shutdown, and
    #    whatever happens ends in one report.
    state = RequestState(
        client_request_id=client_request_id,
        internal_request_id=internal_request_id,
        method=request.method,
        path=request.path,
        route_label=route_label(request.path),
        route=engine.route(request.method, request.path),
        engine=engine,
        task=request.task,
        connection=request.protocol,
        id_in_header=header_request_id is not None,
        websocket=websocket,
    )
    ctx.registry.add(state)
    ctx.accounting.began(state, request.headers)
    try:
        # 3. Forward and relay, bounded by the whole-request timeout when one is set.
        try:
            if settings.request_timeout is None:
                response = await _forward(request, state, ctx)
            else:
                async with asyncio.timeout(settings.request_timeout):
                    response = await _forward(request, state, ctx)
        except TimeoutError as exc:
            if isinstance(exc, TetherError):
                raise  # tether's own timeouts (connect, idle) already say what happened
            raise RequestTimeoutError(
                f"the request took longer than TETHER_REQUEST_TIMEOUT={settings.request_timeout}s"
            ) from exc
        # 4. Completed: the engine's answer, whatever its status, went to the client in full.
        state.ending = Ending(Outcome.COMPLETED, response.status)
        return response
    except asyncio.CancelledError:
        # 5a. Cancelled: the client left, an operator aborted it, or tether is shutting down.
        outcome = _why_cancelled(request, state, ctx)
        if outcome is Outcome.CLIENT_DISCONNECTED:
            ctx.accounting.client_left(state)
        _stop_upstream(ctx, state, outcome)
        if outcome is Outcome.CLIENT_DISCONNECTED:
            state.ending = Ending(outcome, 499)
            raise
        sent = _response_started(state)
        if sent is not None:  # cut mid-response: the status it started with stands
            state.ending = Ending(outcome, sent.status)
            raise
        # tether cancelled it (admin abort, shutdown) before any byte went out and the client
        # is still there: it gets a 503 it may retry elsewhere, then the connection closes.
        asyncio.current_task().uncancel()  # type: ignore[union-attr]
        stopped = _stopped_by_tether(outcome)
        state.ending = Ending(outcome, stopped.status, stopped)
        return error_response(stopped, settings.request_id_header, client_request_id)
    except (ClientGoneError, SinkClosedError):
        # 5b. The relay found the client's socket closing: same as a cancellation by a
        # disconnect. The response goes back to aiohttp, whose last write fails quietly on the
        # closed socket (an exception here would be logged as a server error).
        ctx.accounting.client_left(state)
        _stop_upstream(ctx, state, Outcome.CLIENT_DISCONNECTED)
        state.ending = Ending(Outcome.CLIENT_DISCONNECTED, 499)
        assert state.client_response is not None  # only a started relay finds the client gone
        return state.client_response
    except TetherError as error:
        # 5c. A bad body, a timeout or an upstream failure: before the response started the
        # client gets a JSON error; after, its stream is cut so it can never pass for a
        # complete one. Only a timeout is tether's decision to stop work the engine is doing,
        # so only then is the engine told: a body the engine never fully received starts no
        # generation, and aborting a crashed engine would only add a storm of calls.
        outcome = _outcome_of(error)
        _stop_upstream(ctx, state, outcome, ask_engine=outcome is Outcome.TIMED_OUT)
        return _answer_failure(request, ctx, state, Ending(outcome, error.status, error))
    except Exception as exc:
        # 5d. Anything else is a bug in tether. The client still gets an OpenAI-style answer
        # (or a cut stream), the engine is stopped, and the log gets one error line with the
        # traceback, never its local variables.
        bug = InternalError(f"tether failed unexpectedly ({exc.__class__.__name__})")
        _stop_upstream(ctx, state, Outcome.INTERNAL_ERROR)
        return _answer_failure(
            request, ctx, state, Ending(Outcome.INTERNAL_ERROR, bug.status, bug, exc)
        )
    finally:
        # 6. Every way out: the request leaves the registry and is reported, once.
        ctx.registry.remove(state)
        ctx.accounting.ended(state)


async def _forward(
    request: web.BaseRequest, state: RequestState, ctx: ProxyContext
) -> web.StreamResponse:
    upstream = await _send(request, state, ctx)
    state.phase = Phase.WAITING
    response_head = await upstream.wait_head()
    if response_head.status == 101:  # only ever accepted for a WebSocket handshake
        return await _relay_websocket(request, response_head, state, ctx)
    mapper = _id_mapper(response_head, state)
    tokens = TokenCounter(state.route.tokens if state.route is not None else TokenShape.NONE)
    usage = (
        UsageEventFilter(restore_fingerprint=state.engine.usage_takes_fingerprint)
        if state.body.usage_asked and _is_sse(response_head)
        else None
    )
    state.relay = ResponseRelay(upstream, tokens, mapper, usage)
    length = response_head.content_length
    if mapper is not None and length is not None and length <= _MAX_BUFFERED_RESPONSE:
        return await _relay_whole(request, response_head, state, ctx, mapper)
    return await _relay_stream(request, response_head, state, ctx, mapper)


async def _send(
    request: web.BaseRequest, state: RequestState, ctx: ProxyContext
) -> UpstreamExchange:
    """The client's request, sent to the engine (its own coroutine, so that what it built,
    the head and body among them, is freed for the rest of a long stream)."""
    settings = ctx.settings
    headers = upstream_request_headers(
        request.headers,
        client_request_id_header=settings.request_id_header,
        internal_request_id=state.internal_request_id,
        peer=request.remote,
        scheme=request.scheme,
        id_headers=state.engine.id_headers,
    )
    outgoing = await outgoing_body(
        request,
        headers,
        state.route,
        state.internal_request_id,
        max_json_body=settings.max_json_body,
        body_timeout=settings.client_body_timeout,
        ask_for_usage=ctx.usage.enabled,
        json_rule=state.engine.json_rule,
        keep_client_id=_preserving(state) and not state.id_in_header,
    )
    state.body = facts = outgoing.facts
    engine_requests = (facts.batch or 1) * facts.samples
    if engine_requests > settings.max_engine_requests:
        raise TooManyEngineRequestsError(
            f"the request would start {engine_requests} engine requests (prompts times n); "
            f"the limit is {settings.max_engine_requests} (TETHER_MAX_ENGINE_REQUESTS)"
        )
    if facts.client_id is not None:
        _adopt_body_id(ctx, state, facts.client_id, headers)
    if state.span is not None:
        # The engine's own span (vLLM's llm_request) nests under tether's.
        headers.update(state.span.engine_headers())
    if state.websocket:
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
    state.upstream = upstream = ctx.upstream.exchange(
        request.method,
        replayable=state.engine.replayable(request.method, request.path),
        upgrade=state.websocket,
    )
    await upstream.send(head, body, chunked=chunked)
    return upstream


def _id_mapper(head: ResponseHead, state: RequestState) -> IdMapper | None:
    """A mapper for JSON and SSE bodies; None for anything else, anything compressed, and
    routes whose engine ID is the client's handle."""
    if state.route is not None and not state.route.maps_id_back:
        return None
    if head.headers.get(_CONTENT_ENCODING, "identity").lower() != "identity":
        return None
    media_type = head.headers.get(_CONTENT_TYPE, "").partition(";")[0].strip().lower()
    if media_type not in _MAPPED_TYPES and not media_type.endswith("+json"):
        return None
    echo_id = state.echo_id or state.client_request_id
    if state.internal_request_id == echo_id:
        return None  # preserve mode: the engine already used the client's ID
    return IdMapper(state.internal_request_id, json_escaped(echo_id))


async def _relay_whole(
    request: web.BaseRequest,
    head: ResponseHead,
    state: RequestState,
    ctx: ProxyContext,
    mapper: IdMapper,
) -> web.StreamResponse:
    """A JSON response of known length: read it, map the ID back, answer with its new length."""
    assert state.upstream is not None and state.relay is not None
    state.relay.to_buffer()
    state.upstream.attach(state.relay)
    await state.upstream.wait_end(ctx.settings.stream_idle_timeout)
    body = state.relay.take_buffered()
    headers = client_response_headers(
        head.headers,
        client_request_id_header=ctx.settings.request_id_header,
        client_request_id=state.client_request_id,
        body_rewritten=True,
    )
    response = web.Response(status=head.status, reason=head.reason, headers=headers, body=body)
    if ctx.readiness.draining:
        response.force_close()
    state.client_response = response
    # Written here rather than by aiohttp once the handler returns: the client has its answer
    # before the request is reported (its log line, metrics and span cost a request's
    # latency otherwise), and "completed" means it was written.
    await _to_client(response.prepare(request))
    await _to_client(response.write_eof())
    return response


async def _relay_stream(
    request: web.BaseRequest,
    head: ResponseHead,
    state: RequestState,
    ctx: ProxyContext,
    mapper: IdMapper | None,
) -> web.StreamResponse:
    """Relay the body to the client as it arrives, from the upstream protocol straight into
    the client's socket; this coroutine only waits for the end."""
    assert state.upstream is not None and state.relay is not None
    headers = client_response_headers(
        head.headers,
        client_request_id_header=ctx.settings.request_id_header,
        client_request_id=state.client_request_id,
        body_rewritten=mapper is not None,
    )
    response = web.StreamResponse(status=head.status, reason=head.reason, headers=headers)
    if ctx.readiness.draining:
        response.force_close()
    state.client_response = response
    writer = await _to_client(response.prepare(request))
    transport = request.transport
    if writer is None or transport is None or transport.is_closing():
        raise ClientGoneError("the client left before the response started")
    state.relay.to_client(
        transport,
        writer,
        chunked=_is_chunked(writer),
        is_sse=_is_sse(head),
    )
    state.phase = Phase.STREAMING
    state.upstream.attach(state.relay)
    await state.upstream.wait_end(ctx.settings.stream_idle_timeout)
    state.relay.finish()
    if state.relay.engine_reports_usage:
        ctx.usage.engine_reports_usage()
    await _to_client(response.write_eof())
    return response


async def _relay_websocket(
    request: web.BaseRequest, head: ResponseHead, state: RequestState, ctx: ProxyContext
) -> web.StreamResponse:
    """The engine accepted the WebSocket: its 101 goes to the client, then each connection
    carries the other's bytes until one of them closes."""
    assert state.upstream is not None
    headers = client_response_headers(
        head.headers,
        client_request_id_header=ctx.settings.request_id_header,
        client_request_id=state.client_request_id,
        body_rewritten=False,
    )
    headers.update(SWITCHING_HEADERS)
    response = web.StreamResponse(status=101, reason=head.reason, headers=headers)
    response.force_close()  # the connection ends with the session
    state.client_response = response
    writer = await _to_client(response.prepare(request))
    transport = request.transport
    if writer is None or transport is None or transport.is_closing():
        raise ClientGoneError("the client left before the session started")
    # The engine's bytes go to the client as any response body does, unframed and uncounted.
    state.relay = relay = ResponseRelay(state.upstream, TokenCounter(TokenShape.NONE), None)
    relay.to_client(transport, writer, chunked=False, is_sse=False)
    state.tunnel = frames = ClientFrames(state.upstream, transport)
    state.phase = Phase.STREAMING
    ctx.accounting.websocket_opened()
    try:
        state.upstream.attach(relay)
        # From here aiohttp hands the client's bytes to `frames` (those that came with the
        # handshake first), as it would to its own WebSocket reader.
        request.protocol.set_parser(frames)  # type: ignore[arg-type]
        await state.upstream.wait_end()
    finally:
        ctx.accounting.websocket_closed()
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


# Fresh IDs tried for a request without one in preserve mode before it is refused: each is
# refused only where an in-flight client ID is a prefix of it (1 in 16 per one-character ID).
_MINT_TRIES = 4


def _preserved_id(ctx: ProxyContext, engine: EngineProfile, client_request_id: str | None) -> str:
    """Preserve mode: the engine runs the client's own ID, or one tether mints where it sent
    none; neither may be in flight already, or (for an engine that aborts by prefix) be a
    prefix of one in flight or start with one."""
    if client_request_id is not None:
        _refuse_in_flight(ctx, engine, client_request_id)
        return client_request_id
    for _ in range(_MINT_TRIES - 1):
        minted = ctx.ids.mint()
        if not (engine.aborts_by_prefix and ctx.registry.prefix_related(minted)):
            return minted
    minted = ctx.ids.mint()
    _refuse_in_flight(ctx, engine, minted)
    return minted


def _refuse_in_flight(
    ctx: ProxyContext, engine: EngineProfile, request_id: str, ignoring: str | None = None
) -> None:
    """Preserve mode: an ID the engine would run a second time is refused (409), and so,
    where the engine aborts by prefix (SGLang), is one whose abort would stop another
    request or be stopped by another's."""
    if ctx.registry.find(request_id):
        raise DuplicateRequestIdError(
            f"a request with the ID {request_id!r} is already in flight "
            "(TETHER_REQUEST_ID_MODE=preserve passes IDs to the engine unchanged, so each "
            "must be unique while it runs)"
        )
    if not engine.aborts_by_prefix:
        return
    related = ctx.registry.prefix_related(request_id, ignoring)
    if related is not None:
        shorter, longer = sorted((request_id, related), key=len)
        raise OverlappingRequestIdError(
            f"the ID {request_id!r} overlaps one already in flight: {shorter!r} is a prefix of "
            f"{longer!r}, and this engine aborts every request whose ID starts with the one "
            "named (TETHER_REQUEST_ID_MODE=preserve passes IDs to the engine unchanged, so "
            "those in flight must not be prefixes of one another)"
        )


def _preserving(state: RequestState) -> bool:
    """Whether the engine gets the client's own IDs (TETHER_REQUEST_ID_MODE=preserve)."""
    return state.internal_request_id == state.client_request_id


def _adopt_body_id(
    ctx: ProxyContext, state: RequestState, body_id: str, headers: CIMultiDict[str]
) -> None:
    """A client that named its request in the body (vLLM's `request_id`, SGLang's `rid`)
    gets that name back wherever the engine would have written it into its answer: without
    a header ID it is the request's client ID (logs, the response header, the admin API; in
    preserve mode the engine's ID too), with one it is the engine's choice which wins.

    The name obeys the header ID's rules whichever wins: the engine writes it into every
    event of a stream, so one of any length would multiply the answer's size (a 4 MB name
    and 100 tokens made 424 MB on vLLM 0.32)."""
    try:
        check_client_request_id(body_id)
    except InvalidClientRequestId as exc:
        assert state.route is not None and state.route.client_id_field is not None
        field = state.route.client_id_field.name
        raise InvalidRequestIdError(f"the body's {field} {exc}") from None
    if state.id_in_header:
        if state.engine.body_id_beats_header:
            state.echo_id = body_id
        return
    preserving = _preserving(state)
    if preserving:  # the request's own ID (tether's, minted) is about to be replaced
        _refuse_in_flight(ctx, state.engine, body_id, ignoring=state.internal_request_id)
    internal_request_id = body_id if preserving else state.internal_request_id
    ctx.registry.rename(state, body_id, internal_request_id)
    if preserving:
        for name in state.engine.id_headers:
            headers[name] = body_id
    bind_request_ids(body_id, internal_request_id)


def _response_started(state: RequestState) -> web.StreamResponse | None:
    """The client's response if its head already went out (its status can no longer change)."""
    response = state.client_response
    return response if response is not None and response.prepared else None


def _stopped_by_tether(outcome: Outcome) -> StoppedByTetherError:
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


def _stop_upstream(
    ctx: ProxyContext, state: RequestState, outcome: Outcome, *, ask_engine: bool = True
) -> None:
    """Stop what the engine is doing for this request, if it saw the request.

    Without `ask_engine`, or when the engine never got the whole request, the connection is
    dropped (never pooled): an engine that listens for disconnects stops at once. Otherwise
    the abort tracker stops it, confirming from the engine's own response where it can.
    """
    upstream = state.upstream
    if upstream is None:
        return
    if state.tunnel is not None:
        # A WebSocket session has no ID an engine API names; its connection closing is
        # what ends it at the engine (vLLM's session cleanup then aborts its request).
        state.upstream_cancelled = not upstream.ended
        upstream.close()
        return
    relay = state.relay
    if relay is None:
        # The engine's answer had not begun: it is still counted when it comes.
        shape = state.route.tokens if state.route is not None else TokenShape.NONE
        state.relay = relay = ResponseRelay(upstream, TokenCounter(shape), None)
        upstream.attach(relay)
    state.upstream_cancelled = ask_engine and not upstream.ended
    if not ask_engine or not upstream.sent or upstream.ended:
        relay.discard()
        upstream.close()
        return
    route = state.route
    now = time.monotonic()
    events = relay.tokens.events
    first_body_at = upstream.first_body_at
    stop = StopRequest(
        state,
        engine_request_ids=(
            route.engine_request_ids(
                state.internal_request_id, state.body.batch, state.body.samples
            )
            if route is not None
            else ()
        ),
        since=now,
        # The mean time between the stream's token events so far: one engine step.
        step=(now - first_body_at) / events if first_body_at is not None and events >= 2 else None,
        registered_by=now if first_body_at is not None else upstream.sent_at + _REGISTERED_AFTER,
    )
    handed_over = ctx.aborts.let_finish(stop) if state.body.background else ctx.aborts.stop(stop)
    state.stopping = stop if handed_over else None


def _answer_failure(
    request: web.BaseRequest, ctx: ProxyContext, state: RequestState, ending: Ending
) -> web.StreamResponse:
    """Before the response started: a JSON error. After: the stream is cut, so the client can
    never take it for a complete one (the status it started with stands)."""
    assert ending.error is not None
    sent = _response_started(state)
    if sent is not None:
        state.ending = replace(ending, status=sent.status)
        _cut_client_stream(request)
        return sent
    state.ending = ending
    return error_response(ending.error, ctx.settings.request_id_header, state.client_request_id)


def _cut_client_stream(request: web.BaseRequest) -> None:
    """End a started response without its terminator, so the client sees it as truncated.

    Closing the transport makes aiohttp's final `write_eof` fail instead of sending the last
    chunk; the bytes already written are still flushed.
    """
    if request.transport is not None:
        request.transport.close()


def _reject(request: web.BaseRequest, ctx: ProxyContext, error: TetherError) -> web.Response:
    """Refused before anything was forwarded: counted as rejected, never seen by the engine.
    The client's ID is echoed where it is one tether can echo safely."""
    header = ctx.settings.request_id_header
    bad_id = isinstance(error, InvalidRequestIdError)
    echo = request.headers.get(header) if not bad_id else None
    if echo is not None:
        try:
            echo = check_client_request_id(echo)
        except InvalidClientRequestId:
            echo = None
    ctx.accounting.rejected(
        request.method, request.path, request.headers, error, echo, path_is_safe=not bad_id
    )
    return error_response(error, header, echo)
