"""One request's life, top to bottom.

accept → client ID → internal ID → register → forward the body → wait for the engine →
stream the response back (IDs mapped back) → on a disconnect, abort upstream → log, metrics.

The client leaving shows up here in one of two ways: the handler task is cancelled (aiohttp
runs with `handler_cancellation=True`, so a FIN or RST on the client socket cancels it in any
phase), or a write to the client fails. Both take the same branch: drop the upstream
connection, hand the abort call to the tracker, record the outcome.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable

import aiohttp
import structlog
from aiohttp import web
from multidict import istr

from .context import CONTEXT, ProxyContext
from .errors import (
    AdminAbortedError,
    BlockedRouteError,
    ClientBodyTimeoutError,
    ClientRequestError,
    InvalidRequestBodyError,
    InvalidRequestIdError,
    RequestBodyTooLargeError,
    RequestTimeoutError,
    ShuttingDownError,
    StoppedByTetherError,
    TetherError,
    UpstreamBrokenError,
    UpstreamError,
)
from .headers import client_response_headers, upstream_request_headers
from .metrics import route_label
from .registry import Outcome, Phase, RequestState
from .request_ids import (
    IdMapper,
    InvalidClientRequestId,
    InvalidJsonBody,
    check_client_request_id,
    json_escaped,
    mint_internal_request_id,
    write_request_id_fields,
)
from .routes import is_blocked
from .upstream import Body

log = structlog.get_logger("tether.request")

_CONTENT_ENCODING = istr("Content-Encoding")
_CONTENT_TYPE = istr("Content-Type")
# Response bodies in which the internal ID is replaced by the client's.
_MAPPED_TYPES = frozenset({"application/json", "text/event-stream", "application/x-ndjson"})
# A JSON response with a Content-Length up to this size is read whole so that the rewritten
# body goes out with an exact Content-Length; larger ones are streamed chunked.
_MAX_BUFFERED_RESPONSE = 8 * 1024 * 1024
_REQUEST_ID_FIELD = b'"request_id"'


class ClientGoneError(ConnectionError):
    """A write to the client failed: it has left."""


class Exchange:
    """Per-request flags and handles the handler decides from (never shared across requests)."""

    __slots__ = ("body_error", "client_response", "state", "upstream_response")

    def __init__(self, state: RequestState) -> None:
        self.state = state
        self.upstream_response: aiohttp.ClientResponse | None = None
        self.client_response: web.StreamResponse | None = None
        # Why a streamed body stopped, when the client's side of it failed: aiohttp reports
        # it to us only as a broken upstream request.
        self.body_error: TetherError | None = None


async def proxy_request(request: web.Request) -> web.StreamResponse:
    """The handler for every client path."""
    ctx = request.app[CONTEXT]
    settings = ctx.settings
    internal_request_id = mint_internal_request_id()
    structlog.contextvars.bind_contextvars(internal_request_id=internal_request_id)

    # 1. Refuse what must never reach the engine, and IDs that cannot be echoed safely.
    try:
        if is_blocked(request.rel_url.raw_path, settings.blocked_paths):
            raise BlockedRouteError(
                f"{request.path} is an engine control route; tether does not forward it"
            )
        client_request_id = _client_request_id(request, settings.request_id_header)
    except ClientRequestError as error:
        return _reject(request, ctx, error)
    structlog.contextvars.bind_contextvars(client_request_id=client_request_id)

    # 2. Register: from here the request is visible to the admin API and to shutdown.
    state = RequestState(
        client_request_id=client_request_id,
        internal_request_id=internal_request_id,
        method=request.method,
        path=request.path,
        route=route_label(request.path),
        task=asyncio.current_task(),
    )
    exchange = Exchange(state)
    ctx.registry.add(state)
    ctx.metrics.in_flight.inc()
    try:
        # 3. Forward and relay, bounded by the whole-request timeout when one is set.
        try:
            if settings.request_timeout is None:
                response = await _forward(request, exchange, ctx)
            else:
                async with asyncio.timeout(settings.request_timeout):
                    response = await _forward(request, exchange, ctx)
        except TimeoutError as exc:
            if isinstance(exc, TetherError):
                raise  # tether's own timeouts (connect, idle) already say what happened
            raise RequestTimeoutError(
                f"the request took longer than TETHER_REQUEST_TIMEOUT={settings.request_timeout}s"
            ) from exc
    except asyncio.CancelledError:
        # 4a. Cancelled: the client left, an operator aborted it, or tether is shutting down.
        outcome = _why_cancelled(request, state, ctx)
        _stop_upstream(ctx, exchange, outcome)
        sent = _response_started(exchange)
        if outcome is Outcome.CLIENT_DISCONNECTED:
            _finish(ctx, state, outcome, 499)
            raise
        if sent is not None:  # cut mid-response: the status it started with stands
            _finish(ctx, state, outcome, sent.status)
            raise
        # tether cancelled it (admin abort, shutdown) before any byte went out and the client
        # is still there: it gets a 503 it may retry elsewhere, then the connection closes.
        asyncio.current_task().uncancel()  # type: ignore[union-attr]
        stopped = _stopped_by_tether(outcome)
        _finish(ctx, state, outcome, stopped.status, stopped)
        response = _error_response(stopped, settings.request_id_header, client_request_id)
        response.force_close()
        return response
    except ClientGoneError:
        # 4b. A write to the client failed: same as a cancellation by a disconnect. The
        # response goes back to aiohttp, whose last write fails quietly on the closed socket
        # (an exception here would be logged as a server error).
        _stop_upstream(ctx, exchange, Outcome.CLIENT_DISCONNECTED)
        _finish(ctx, state, Outcome.CLIENT_DISCONNECTED, 499)
        assert exchange.client_response is not None  # only writes to it raise ClientGoneError
        return exchange.client_response
    except TetherError as error:
        # 4c. A bad body, a timeout or an upstream failure: before the response started the
        # client gets a JSON error; after, its stream is cut so it can never pass for a
        # complete one. Only a timeout is tether's decision to stop work the engine is doing,
        # so only then is the engine told: a body the engine never fully received starts no
        # generation, and aborting a crashed engine would only add a storm of calls.
        outcome = _outcome_of(error)
        _stop_upstream(ctx, exchange, outcome, ask_engine=outcome is Outcome.TIMED_OUT)
        if isinstance(error, UpstreamError):
            ctx.metrics.upstream_errors.labels(error.code).inc()
        sent = _response_started(exchange)
        if sent is not None:
            _finish(ctx, state, outcome, sent.status, error)
            _cut_client_stream(request)
            return sent
        _finish(ctx, state, outcome, error.status, error)
        return _error_response(error, settings.request_id_header, client_request_id)
    finally:
        ctx.registry.remove(state)
        ctx.metrics.in_flight.dec()
    # 5. Completed: the engine's answer, whatever its status, went to the client in full.
    _finish(ctx, state, Outcome.COMPLETED, response.status)
    return response


async def _forward(
    request: web.Request, exchange: Exchange, ctx: ProxyContext
) -> web.StreamResponse:
    state = exchange.state
    settings = ctx.settings
    body, body_rewritten = await _request_body(request, exchange, ctx)
    headers = upstream_request_headers(
        request.headers,
        client_request_id_header=settings.request_id_header,
        internal_request_id=state.internal_request_id,
        peer=request.remote,
        scheme=request.scheme,
        body_rewritten=body_rewritten,
    )
    state.upstream_contacted = True
    try:
        exchange.upstream_response = upstream = await ctx.upstream.send(
            request.method, request.rel_url.raw_path_qs, headers, body
        )
    except TetherError:
        if exchange.body_error is not None:
            raise exchange.body_error from None
        raise
    state.phase = Phase.WAITING
    mapper = _id_mapper(upstream, state)
    length = upstream.content_length
    if mapper is not None and length is not None and length <= _MAX_BUFFERED_RESPONSE:
        return await _relay_whole(upstream, exchange, ctx, mapper)
    return await _relay_stream(request, upstream, exchange, ctx, mapper)


async def _request_body(
    request: web.Request, exchange: Exchange, ctx: ProxyContext
) -> tuple[Body, bool]:
    """The body to send upstream, and whether tether rewrote it.

    JSON bodies are read whole only where the engine needs tether's ID inside them; anything
    else streams through as it arrives. Either way a client that goes silent mid-body for
    TETHER_CLIENT_BODY_TIMEOUT seconds gets a 408.
    """
    state = exchange.state
    if not request.body_exists:
        state.phase = Phase.WAITING
        return None, False
    timeout = ctx.settings.client_body_timeout
    if not (ctx.engine.rewrites_json_bodies and _engine_reads_as_json(request)):
        await _send_continue_if_asked(request)
        return _stream_body(request, exchange, timeout), False
    limit = ctx.settings.max_json_body
    if request.content_length is not None and request.content_length > limit:
        raise RequestBodyTooLargeError(
            f"the JSON body is {request.content_length} bytes; the limit is {limit} "
            "(TETHER_MAX_JSON_BODY)"
        )
    await _send_continue_if_asked(request)
    chunks: list[bytes] = []
    size = 0
    while chunk := await _read_body_chunk(request, timeout):
        size += len(chunk)
        if size > limit:
            raise RequestBodyTooLargeError(
                f"the JSON body exceeds {limit} bytes (TETHER_MAX_JSON_BODY)"
            )
        chunks.append(chunk)
    body = b"".join(chunks)
    state.phase = Phase.WAITING
    fields = ctx.engine.body_fields(_REQUEST_ID_FIELD in body, state.internal_request_id)
    if not fields:
        return body, False
    try:
        return write_request_id_fields(body, fields), True
    except InvalidJsonBody as exc:
        raise InvalidRequestBodyError(str(exc)) from None


async def _stream_body(
    request: web.Request, exchange: Exchange, timeout: float
) -> AsyncIterator[bytes]:
    try:
        while chunk := await _read_body_chunk(request, timeout):
            yield chunk
    except ClientBodyTimeoutError as error:
        exchange.body_error = error
        raise
    exchange.state.phase = Phase.WAITING


async def _read_body_chunk(request: web.Request, timeout: float) -> bytes:
    """The next piece of the client's body (b"" at its end), bounded by the body timeout."""
    content = request.content
    if content.is_eof():  # all of it arrived already (most requests): nothing to wait for
        return await content.readany()
    try:
        async with asyncio.timeout(timeout):
            return await content.readany()
    except TimeoutError:
        raise ClientBodyTimeoutError(
            f"the client sent no body data for TETHER_CLIENT_BODY_TIMEOUT={timeout}s"
        ) from None


async def defer_continue(request: web.Request) -> None:
    """aiohttp's `Expect: 100-continue` hook: say nothing yet; tether answers once its own
    checks (route, request ID, body size) have passed, so a refused upload is never sent."""


async def _send_continue_if_asked(request: web.Request) -> None:
    if request.version >= (1, 1) and request.headers.get("Expect", "").lower() == "100-continue":
        await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")


def _engine_reads_as_json(request: web.Request) -> bool:
    """Whether the engine's HTTP layer (FastAPI for vLLM and SGLang) parses this body as JSON:
    no Content-Type at all, application/json or application/*+json. Rewriting only bodies
    labelled application/json would let a client's own `rid` through unlabelled."""
    if _CONTENT_TYPE not in request.headers:
        return True
    media_type = request.content_type.lower()
    return media_type == "application/json" or (
        media_type.startswith("application/") and media_type.endswith("+json")
    )


def _id_mapper(upstream: aiohttp.ClientResponse, state: RequestState) -> IdMapper | None:
    """A mapper for JSON and SSE bodies; None for anything else, or anything compressed."""
    if upstream.headers.get(_CONTENT_ENCODING, "identity").lower() != "identity":
        return None
    media_type = upstream.headers.get(_CONTENT_TYPE, "").partition(";")[0].strip().lower()
    if media_type not in _MAPPED_TYPES and not media_type.endswith("+json"):
        return None
    return IdMapper(state.internal_request_id, json_escaped(state.client_request_id))


async def _relay_whole(
    upstream: aiohttp.ClientResponse, exchange: Exchange, ctx: ProxyContext, mapper: IdMapper
) -> web.StreamResponse:
    """A JSON response of known length: read it, map the ID back, answer with its new length."""
    state = exchange.state
    try:
        body = await _idle_bounded(upstream.read(), ctx.settings.stream_idle_timeout)
    except aiohttp.ClientError as exc:
        raise UpstreamBrokenError(f"the engine's response broke off: {exc}") from exc
    _first_byte(ctx, state)
    upstream.release()
    body = mapper.feed(body) + mapper.flush()
    headers = client_response_headers(
        upstream.headers,
        client_request_id_header=ctx.settings.request_id_header,
        client_request_id=state.client_request_id,
        body_rewritten=True,
    )
    state.bytes_out = len(body)
    return web.Response(status=upstream.status, reason=upstream.reason, headers=headers, body=body)


async def _relay_stream(
    request: web.Request,
    upstream: aiohttp.ClientResponse,
    exchange: Exchange,
    ctx: ProxyContext,
    mapper: IdMapper | None,
) -> web.StreamResponse:
    """Relay the body chunk by chunk as it arrives; the awaited write is the backpressure."""
    state = exchange.state
    idle_timeout = ctx.settings.stream_idle_timeout
    headers = client_response_headers(
        upstream.headers,
        client_request_id_header=ctx.settings.request_id_header,
        client_request_id=state.client_request_id,
        body_rewritten=mapper is not None,
    )
    response = web.StreamResponse(status=upstream.status, reason=upstream.reason, headers=headers)
    exchange.client_response = response
    await _to_client(response.prepare(request))
    state.phase = Phase.STREAMING
    is_sse = headers.get(_CONTENT_TYPE, "").startswith("text/event-stream")
    reader = upstream.content
    # The hot loop: one read, one write per chunk. Counters are kept on the request and
    # published once at its end (`_finish`), not per chunk.
    while True:
        try:
            if idle_timeout is None:
                chunk = await reader.readany()
            else:
                chunk = await _idle_bounded(reader.readany(), idle_timeout)
        except aiohttp.ClientError as exc:
            raise UpstreamBrokenError(f"the engine's response broke off: {exc}") from exc
        if not chunk:
            break
        if state.first_byte_at is None:
            _first_byte(ctx, state)
        if mapper is not None:
            chunk = mapper.feed(chunk)
            if not chunk:
                continue
        try:
            await response.write(chunk)
        except ConnectionError as exc:
            raise ClientGoneError(str(exc)) from exc
        state.bytes_out += len(chunk)
        if is_sse:
            state.sse_events += chunk.count(b"\n\n")
    if mapper is not None:
        tail = mapper.flush()
        if tail:
            await _to_client(response.write(tail))
            state.bytes_out += len(tail)
    if state.first_byte_at is None:
        _first_byte(ctx, state)
    upstream.release()
    await _to_client(response.write_eof())
    return response


async def _idle_bounded(read: Awaitable[bytes], timeout: float | None) -> bytes:
    """Await an upstream read, bounded by TETHER_STREAM_IDLE_TIMEOUT when set."""
    if timeout is None:
        return await read
    try:
        async with asyncio.timeout(timeout):
            return await read
    except TimeoutError as exc:
        raise RequestTimeoutError(
            f"the engine sent nothing for TETHER_STREAM_IDLE_TIMEOUT={timeout}s"
        ) from exc


async def _to_client(write: Awaitable[object]) -> None:
    """Await a write to the client; a failure means the client has left."""
    try:
        await write
    except ConnectionError as exc:
        raise ClientGoneError(str(exc)) from exc


def _first_byte(ctx: ProxyContext, state: RequestState) -> None:
    state.first_byte_at = time.monotonic()
    ctx.metrics.record_first_byte(state.route, state.first_byte_at - state.started_at)


def _client_request_id(request: web.Request, header: str) -> str:
    value = request.headers.get(header)
    if value is None:
        return mint_internal_request_id()
    try:
        return check_client_request_id(value)
    except InvalidClientRequestId as exc:
        raise InvalidRequestIdError(f"the {header} header {exc}") from None


def _response_started(exchange: Exchange) -> web.StreamResponse | None:
    """The client's response if its head already went out (its status can no longer change)."""
    response = exchange.client_response
    return response if response is not None and response.prepared else None


def _stopped_by_tether(outcome: Outcome) -> StoppedByTetherError:
    if outcome is Outcome.ADMIN_ABORTED:
        return AdminAbortedError("an operator aborted this request")
    return ShuttingDownError("tether is shutting down; retry the request elsewhere")


def _outcome_of(error: TetherError) -> Outcome:
    if isinstance(error, ClientRequestError):
        return Outcome.REJECTED
    if isinstance(error, RequestTimeoutError):
        return Outcome.TIMED_OUT
    return Outcome.UPSTREAM_FAILED


def _why_cancelled(request: web.Request, state: RequestState, ctx: ProxyContext) -> Outcome:
    if state.ended_by is not None:
        return state.ended_by
    transport = request.transport
    if transport is None or transport.is_closing():
        return Outcome.CLIENT_DISCONNECTED
    return Outcome.SHUTDOWN_ABORTED if ctx.readiness.draining else Outcome.CLIENT_DISCONNECTED


def _stop_upstream(
    ctx: ProxyContext, exchange: Exchange, outcome: Outcome, *, ask_engine: bool = True
) -> None:
    """Drop the upstream connection and ask the engine to abort, if it saw the request.

    `close()` (never `release()`) so the socket is not returned to the pool: an engine that
    listens for disconnects stops at once, whatever the abort call achieves.
    """
    state = exchange.state
    if outcome is Outcome.CLIENT_DISCONNECTED:
        ctx.metrics.client_disconnects.labels(state.phase.value).inc()
        log.info(
            "client_disconnected",
            phase=state.phase.value,
            upstream_contacted=state.upstream_contacted,
        )
    if exchange.upstream_response is not None:
        exchange.upstream_response.close()
    if not (state.upstream_contacted and ask_engine):
        return
    ctx.metrics.upstream_cancels.labels(outcome.value).inc()
    ctx.aborts.abort(
        state.path,
        state.internal_request_id,
        state.client_request_id,
        asyncio.get_running_loop().time(),
    )


def _cut_client_stream(request: web.Request) -> None:
    """End a started response without its terminator, so the client sees it as truncated.

    Closing the transport makes aiohttp's final `write_eof` fail instead of sending the last
    chunk; the bytes already written are still flushed.
    """
    if request.transport is not None:
        request.transport.close()


def _reject(request: web.Request, ctx: ProxyContext, error: ClientRequestError) -> web.Response:
    header = ctx.settings.request_id_header
    client_request_id = request.headers.get(header)
    echo = client_request_id if isinstance(error, BlockedRouteError) else None
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
    ctx.metrics.record_rejection(route_label(request.path), error.status)
    return _error_response(error, header, echo)


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
    state: RequestState,
    outcome: Outcome,
    status: int,
    error: TetherError | None = None,
) -> None:
    """Metrics and the one summary line of a request."""
    now = time.monotonic()
    duration = now - state.started_at
    ctx.metrics.record_request(
        state.route, status, outcome.value, duration, state.bytes_out, state.sse_events
    )
    ttfb = state.first_byte_at - state.started_at if state.first_byte_at is not None else None
    log.log(
        error.log_level if error is not None else logging.INFO,
        "request_finished",
        method=state.method,
        path=state.path,
        status=status,
        outcome=outcome.value,
        duration_ms=round(duration * 1000, 2),
        ttfb_ms=round(ttfb * 1000, 2) if ttfb is not None else None,
        bytes_out=state.bytes_out,
        error=error.message if error is not None else None,
    )
