"""Every answer a client gets, built here: the engine's response relayed (read whole and
rewritten, streamed as it arrives, or a WebSocket session), an OpenAI-style error before the
response started, a cut stream after. With `whole_answer` (an answer held whole, written in
one write), the only modules that touch aiohttp's own writer.

A write that fails means the client has left (`ClientGoneError`): the handler takes it as a
disconnect."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable
from typing import Any, Final, TypeVar

import aiohttp
from aiohttp import web
from aiohttp.abc import AbstractStreamWriter
from aiohttp.http_writer import StreamWriter
from multidict import CIMultiDict, istr

from ..errors import (
    ClientGoneError,
    EventsNoLongerHeldError,
    InvalidLastEventIdError,
    InvalidRequestIdError,
    TetherError,
    UpstreamBrokenError,
    error_response,
)
from ..faults import RESPONSE_HEAD, STREAM_END
from ..outcomes import Phase
from ..request.held_stream import HeldStream, Resumer
from ..request.state import EarlyStart, Ending, RequestState
from ..request.websocket import SWITCHING_HEADERS, ClientFrames
from ..upstream.connection import ResponseHead
from ..upstream.relay import ResponseRelay
from ..upstream.stream_keepalive import KEEPALIVE_COMMENT, StreamKeepAlive
from ..wire.answer_assembly import AnswerAssembler
from ..wire.error_events import engine_error, error_event
from ..wire.event_log import EventLog
from ..wire.headers import client_response_fields
from ..wire.ids import (
    IdMapper,
    InvalidClientRequestId,
    MintedIdMapper,
    check_client_request_id,
    json_escaped,
)
from ..wire.tokens import TokenCounter, TokenShape
from ..wire.usage_events import UsageEventFilter
from .context import ProxyContext
from .whole_answer import WholeAnswer

_T = TypeVar("_T")

_CONTENT_ENCODING = istr("Content-Encoding")
_CONTENT_TYPE = istr("Content-Type")
_CACHE_CONTROL = istr("Cache-Control")
_ACCEL_BUFFERING = istr("X-Accel-Buffering")
# Response bodies in which the internal ID is replaced by the client's.
_MAPPED_TYPES = frozenset({"application/json", "text/event-stream", "application/x-ndjson"})
# What llama-server's non-streaming answers carry, and what only its streams do.
_JSON = "application/json; charset=utf-8"
_STREAM_ONLY_HEADERS = frozenset({"x-accel-buffering"})
# A JSON response with a Content-Length up to this size is read whole so that the rewritten
# body goes out with an exact Content-Length; larger ones are streamed chunked.
_MAX_BUFFERED_RESPONSE = 8 * 1024 * 1024
# What a resume relayed from another replica keeps of its head (the rest is hop-by-hop, or
# that replica's own).
_RESUMED_HEADERS = (_CONTENT_TYPE, istr("Cache-Control"), istr("X-Accel-Buffering"))
# Of an engine's answer that cannot follow a stream begun early (an error), this much is read
# for the error event; the rest is read and dropped.
_MAX_ERROR_BODY = 64 * 1024


class KeptAlive:
    """A request whose wait for the engine's head was kept alive (`early_commit`): its
    interval, and the client's stream if it began before the head came, last written
    `quiet_for` seconds before it did. (A plain class: one is built per such request.)"""

    __slots__ = ("committed", "quiet_for", "seconds")

    def __init__(
        self, seconds: float, committed: web.StreamResponse | None, quiet_for: float
    ) -> None:
        self.seconds: Final = seconds
        self.committed: Final = committed
        self.quiet_for: Final = quiet_for


async def relay_response(
    request: web.BaseRequest,
    head: ResponseHead,
    state: RequestState,
    ctx: ProxyContext,
    kept_alive: KeptAlive | None = None,
) -> web.StreamResponse:
    """The engine's response to the client: its head, then its body as the engine sends it,
    IDs mapped back and tokens counted on the way. With `kept_alive` a stream gets keep-alive
    comments while the engine is silent, and goes on in the client's stream begun before the
    engine answered (`commit_stream`), if one was."""
    assert state.upstream is not None
    committed = kept_alive.committed if kept_alive is not None else None
    if head.status == 101:  # only ever accepted for a WebSocket handshake
        return await _relay_websocket(request, head, state, ctx)
    mapper = _id_mapper(head, state)
    tokens = TokenCounter(state.route.tokens if state.route is not None else TokenShape.NONE)
    sse = _is_sse(head)
    if committed is not None:
        assert state.early_start is not None  # (begun with the committed stream)
        state.early_start.engine_status = head.status
        if head.status != 200 or not sse:
            return await _answer_in_stream(head, state, ctx, committed, mapper)
    if state.body.assembled and head.status == 200 and sse:
        return await _relay_assembled(request, head, state, ctx, tokens, mapper)
    usage = (
        UsageEventFilter(restore_fingerprint=state.engine.usage_takes_fingerprint)
        if state.body.usage_asked and sse
        else None
    )
    length = head.content_length
    if (
        mapper is not None
        and length is not None
        and length <= _MAX_BUFFERED_RESPONSE
        and committed is None
    ):
        state.relay = ResponseRelay(state.upstream, tokens, mapper, usage)
        return await _relay_whole(request, head, state, ctx)
    events = _resumable_events(head, state, ctx, sse=sse)
    state.relay = ResponseRelay(state.upstream, tokens, mapper, usage, events=events)
    return await _relay_stream(
        request,
        head,
        state,
        ctx,
        rewritten=mapper is not None,
        sse=sse,
        committed=committed,
        keepalive=kept_alive.seconds if kept_alive is not None else None,
        first_check=(
            max(kept_alive.seconds - kept_alive.quiet_for, 0.0) if kept_alive is not None else 0.0
        ),
    )


def _resumable_events(
    head: ResponseHead, state: RequestState, ctx: ProxyContext, *, sse: bool
) -> EventLog | None:
    """With TETHER_RESUME_GRACE, a generation's stream of events is numbered and its latest
    events held, so that its client can resume it after a dropped connection."""
    budget = ctx.resume_budget
    if budget is None or not sse or head.status != 200 or state.route is None:
        return None
    return EventLog(ctx.settings.resume_buffer, budget)


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
    if state.route is not None and state.route.minted_id_prefix is not None:
        # The engine ignored every ID and minted its own: the client's goes in its place.
        return MintedIdMapper(state.route.minted_id_prefix, json_escaped(echo_id))
    if state.internal_request_id == echo_id:
        return None  # preserve mode: the engine already used the client's ID
    return IdMapper(state.internal_request_id, json_escaped(echo_id))


async def _relay_whole(
    request: web.BaseRequest, head: ResponseHead, state: RequestState, ctx: ProxyContext
) -> web.StreamResponse:
    """A JSON response of known length: read it, map the ID back, answer with its new length."""
    assert state.upstream is not None and state.relay is not None
    state.relay.to_buffer()
    state.upstream.attach(state.relay)
    await state.upstream.wait_end(ctx.settings.stream_idle_timeout)
    body = state.relay.take_buffered()
    fields = _client_fields(head, state, ctx, rewritten=True)
    return await _answer_whole(request, state, ctx, head.status, head.reason, fields, body)


async def _answer_whole(
    request: web.BaseRequest,
    state: RequestState,
    ctx: ProxyContext,
    status: int,
    reason: str | None,
    fields: list[tuple[str, str]],
    body: bytes,
) -> WholeAnswer:
    """Write an answer whose body tether holds whole (`whole_answer`). Written here rather
    than by aiohttp once the handler returns: the client has its answer before the request
    is reported (its log line, metrics and span cost a request's latency otherwise), and
    "completed" means it was written."""
    # Draining: its client goes to the other replicas for its next request.
    keep_alive = request.keep_alive and not ctx.readiness.draining
    state.client_response = answer = WholeAnswer(status, reason, keep_alive=keep_alive)
    await _to_client(answer.send(request, state.method, fields, body))
    return answer


async def _relay_assembled(
    request: web.BaseRequest,
    head: ResponseHead,
    state: RequestState,
    ctx: ProxyContext,
    tokens: TokenCounter,
    mapper: IdMapper | None,
) -> web.StreamResponse:
    """A non-streaming request tether sent as a stream: the events are read as they come
    (the engine writes each token, so it notices at once if tether lets go) and the client
    gets the answer they make, as the engine would have answered it."""
    assert state.upstream is not None
    assembler = AnswerAssembler()
    state.relay = ResponseRelay(state.upstream, tokens, None, assembler=assembler)
    state.relay.to_buffer()
    state.upstream.attach(state.relay)
    await state.upstream.wait_end(ctx.settings.stream_idle_timeout)
    assembled = assembler.answer()
    if assembled is None:
        raise UpstreamBrokenError(
            "the engine's stream did not make a whole answer"
            + (f" ({assembler.unfaithful})" if assembler.unfaithful else "")
        )
    status, body = assembled
    if mapper is not None:
        body = mapper.feed(body) + mapper.flush()
    state.relay.bytes_out = len(body)
    fields = _as_answer(_client_fields(head, state, ctx, rewritten=True))
    return await _answer_whole(request, state, ctx, status, None, fields, body)


async def _relay_stream(
    request: web.BaseRequest,
    head: ResponseHead,
    state: RequestState,
    ctx: ProxyContext,
    *,
    rewritten: bool,
    sse: bool,
    committed: web.StreamResponse | None = None,
    keepalive: float | None = None,
    first_check: float = 0.0,
) -> web.StreamResponse:
    """Relay the body to the client as it arrives, from the upstream protocol straight into
    the client's socket; this coroutine only waits for the end. A stream begun early
    (`committed`) goes on in the response already started."""
    assert state.upstream is not None and state.relay is not None
    response = committed
    if response is None:
        headers = _client_headers(head, state, ctx, rewritten=rewritten)
        response = web.StreamResponse(status=head.status, reason=head.reason, headers=headers)
        if ctx.readiness.draining:
            response.force_close()
        state.client_response = response
    writer = await _to_client(response.prepare(request))
    transport = request.transport
    if writer is None or transport is None or transport.is_closing():
        raise ClientGoneError("the client left before the response started")
    state.relay.to_client(transport, writer, chunked=_is_chunked(writer), is_sse=sse)
    if state.relay.resumable:
        state.held = HeldStream(state.relay, state.upstream, transport, keepalive if sse else None)
    state.phase = Phase.STREAMING
    keeping_alive = (
        StreamKeepAlive(state.relay, keepalive, first_check=first_check)
        if keepalive is not None and sse
        else None
    )
    try:
        state.upstream.attach(state.relay)
        await state.upstream.wait_end(ctx.settings.stream_idle_timeout)
    finally:
        if keeping_alive is not None:
            keeping_alive.stop()
    if ctx.faults is not None:
        ctx.faults.at(STREAM_END)
    state.relay.finish()
    _refuse_cut_session(state, sse=sse)
    if state.relay.engine_reports_usage:
        ctx.usage.engine_reports_usage()
    if state.held is not None:
        carried = state.held.carried
        state.held.end(whole=True)
        if carried:  # a resume took it over (its own connection was closed then) and ends it
            return response
    await _to_client(response.write_eof())
    return response


async def relay_peer_stream(
    request: web.BaseRequest, peer: aiohttp.ClientResponse, request_id_header: str
) -> web.StreamResponse:
    """A resume another process answered (another worker, another replica, or for the
    supervisor one of its workers): its refusal as it is, or its stream relayed as it
    comes, cut where it is cut. The client leaving closes the peer's connection, which
    holds the stream there again."""
    async with peer:
        if peer.status != 200:
            return web.Response(
                status=peer.status, body=await peer.read(), content_type="application/json"
            )
        headers = CIMultiDict[str]()
        for name in (*_RESUMED_HEADERS, request_id_header):
            if name in peer.headers:
                headers[name] = peer.headers[name]
        response = web.StreamResponse(status=200, headers=headers)
        await _to_client(response.prepare(request))
        try:
            async for chunk in peer.content.iter_any():
                await _to_client(response.write(chunk))
        except aiohttp.ClientError:
            if request.transport is not None:
                request.transport.close()  # cut there: cut here
            return response
        with contextlib.suppress(ClientGoneError):
            await _to_client(response.write_eof())
        return response


async def relay_resumed(
    request: web.BaseRequest, state: RequestState, ctx: ProxyContext, last_received: int
) -> web.StreamResponse:
    """A resume's answer: the stream's events after `last_received`, then the rest as the
    engine sends them (written by the request's own relay), then its end; cut when the
    stream is cut. Before its head: the events asked must still be held."""
    held = state.held
    assert held is not None
    if last_received > held.relay.events_sent:
        raise InvalidLastEventIdError(
            f"the stream has sent {held.relay.events_sent} events; the last received cannot "
            f"be {last_received}"
        )
    if not held.relay.holds_after(last_received):
        raise EventsNoLongerHeldError()
    response = web.StreamResponse(
        status=200,
        headers={
            _CONTENT_TYPE: "text/event-stream",
            "Cache-Control": "no-cache",
            "X-Accel-Buffering": "no",
            ctx.settings.request_id_header: state.client_request_id,
        },
    )
    writer = await _to_client(response.prepare(request))
    transport = request.transport
    if writer is None or transport is None or transport.is_closing():
        raise ClientGoneError("the client left before the resumed stream started")
    resumer = Resumer(transport, writer, chunked=_is_chunked(writer))
    if not held.take_over(resumer, last_received):
        transport.close()  # it ended for its client a moment ago: nothing to resume
        return response
    try:
        whole = await resumer.done
    except asyncio.CancelledError:
        held.resumer_left(resumer)
        raise
    if not whole:
        transport.close()  # cut, so that it never passes for a complete stream
        return response
    with contextlib.suppress(ClientGoneError):
        await _to_client(response.write_eof())
    return response


def _refuse_cut_session(state: RequestState, *, sse: bool) -> None:
    """A session's stream (llama.cpp's conversation) that ended without its last event was
    cut, by a second request naming the same session: the client's stream is cut too, so
    that it can never pass for a complete one (straight, its body ends cleanly)."""
    route, relay = state.route, state.relay
    if state.engine_session is None or not sse or route is None or route.stream_end is None:
        return
    assert relay is not None
    if not relay.tokens.ended_with(route.stream_end):
        raise UpstreamBrokenError(
            "the engine ended the stream without its last event: another request with the "
            f"same {state.engine.session_header} took the session over"
        )


# --- a stream begun before the engine answered (SSE keep-alive, `early_commit`) ------------


async def commit_stream(
    request: web.BaseRequest, state: RequestState, ctx: ProxyContext
) -> web.StreamResponse:
    """Start the client's stream before the engine answered: `200 text/event-stream`,
    unbuffered, with the client's ID, and its first keep-alive comment. Whatever the engine
    then answers follows in it (`relay_response` with `committed`)."""
    response = web.StreamResponse(
        status=200,
        headers={
            _CONTENT_TYPE: "text/event-stream",
            _CACHE_CONTROL: "no-cache",
            _ACCEL_BUFFERING: "no",
            ctx.settings.request_id_header: state.client_request_id,
        },
    )
    if ctx.readiness.draining:
        response.force_close()
    state.client_response = response
    writer = await _to_client(response.prepare(request))
    if writer is None:
        raise ClientGoneError("the client left before the response started")
    state.early_start = EarlyStart(_is_chunked(writer))
    await write_comment(response)
    return response


async def write_comment(response: web.StreamResponse) -> None:
    """A keep-alive comment in a stream begun early, while the engine has not answered."""
    await _to_client(response.write(KEEPALIVE_COMMENT))


async def _answer_in_stream(
    head: ResponseHead,
    state: RequestState,
    ctx: ProxyContext,
    committed: web.StreamResponse,
    mapper: IdMapper | None,
) -> web.StreamResponse:
    """The engine answered a stream begun early with something other than a stream (an
    error, mostly): it goes to the client as the stream's one event, `data: {"error": ...}`,
    and the stream ends cleanly."""
    assert state.upstream is not None
    body = _BoundedBody(_MAX_ERROR_BODY)
    state.upstream.attach(body)
    await state.upstream.wait_end(ctx.settings.stream_idle_timeout)
    document = body.take()
    if mapper is not None:
        document = mapper.feed(document) + mapper.flush()
    await _to_client(committed.write(error_event(engine_error(head.status, document))))
    await _to_client(committed.write_eof())
    return committed


class _BoundedBody:
    """A response body's first `limit` bytes; the rest is read and dropped."""

    __slots__ = ("_chunks", "_room")

    def __init__(self, limit: int) -> None:
        self._chunks: list[bytes] = []
        self._room = limit

    def feed(self, chunk: bytes) -> None:
        if self._room > 0:
            kept = chunk[: self._room]
            self._chunks.append(kept)
            self._room -= len(kept)

    def take(self) -> bytes:
        body = b"".join(self._chunks)
        self._chunks.clear()
        return body


def _error_in_early_stream(
    request: web.BaseRequest, state: RequestState, response: web.StreamResponse, error: TetherError
) -> bool:
    """tether failed after it began the client's stream early, before any of the engine's
    stream went into it (the engine unreachable, a timeout, a bug): the error goes out as the
    stream's one event, then its end, written at once (never a cut stream). False where the
    stream did not begin early, or the engine's events already flow in it."""
    early = state.early_start if response is state.client_response else None
    transport = request.transport
    relayed = state.relay is not None and state.relay.bytes_out > 0
    if early is None or relayed or transport is None or transport.is_closing():
        return False
    event = error_event(error.body())
    transport.write(b"%x\r\n%b\r\n0\r\n\r\n" % (len(event), event) if early.chunked else event)
    return True


def began_early_without_events(state: RequestState) -> bool:
    """Its client's stream began before the engine answered (SSE keep-alive), and none of the
    engine's events went into it yet: an error can still go out as its one event."""
    sent = response_started(state)
    relayed = state.relay is not None and state.relay.bytes_out > 0
    return sent is not None and state.early_start is not None and not relayed


def reported_status(response: web.StreamResponse, state: RequestState) -> int:
    """The status a completed request is reported with: the engine's, also where its client's
    stream began before the engine answered (with a 200 of tether's)."""
    # (typed here: where mypyc compiles this, aiohttp's own types are unknown)
    status: int = response.status
    early = state.early_start if response is state.client_response else None
    return early.engine_status if early is not None and early.engine_status else status


async def _relay_websocket(
    request: web.BaseRequest, head: ResponseHead, state: RequestState, ctx: ProxyContext
) -> web.StreamResponse:
    """The engine accepted the WebSocket: its 101 goes to the client, then each connection
    carries the other's bytes until one of them closes."""
    assert state.upstream is not None
    headers = _client_headers(head, state, ctx, rewritten=False)
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
        # (aiohttp types the parser as its own HttpRequestParser; it only calls feed_data.)
        parser: Any = frames
        request.protocol.set_parser(parser)
        await state.upstream.wait_end()
    finally:
        ctx.accounting.websocket_closed()
        frames.close()
    transport.close()  # the engine closed the session: the client's side goes after its bytes
    return response


def _client_headers(
    head: ResponseHead, state: RequestState, ctx: ProxyContext, *, rewritten: bool
) -> CIMultiDict[str]:
    return CIMultiDict(_client_fields(head, state, ctx, rewritten=rewritten))


def _client_fields(
    head: ResponseHead, state: RequestState, ctx: ProxyContext, *, rewritten: bool
) -> list[tuple[str, str]]:
    if ctx.faults is not None:
        ctx.faults.at(RESPONSE_HEAD)
    return client_response_fields(
        head.headers,
        client_request_id_header=ctx.settings.request_id_header,
        client_request_id=state.client_request_id,
        body_rewritten=rewritten,
    )


def _as_answer(fields: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """A stream's fields for the answer assembled from it: what only a stream carries left
    out, and its Content-Type a non-streaming answer's (where the stream's stood)."""
    answer: list[tuple[str, str]] = []
    typed = False
    for name, value in fields:
        lowered = name.lower()
        if lowered in _STREAM_ONLY_HEADERS:
            continue
        if lowered == "content-type":
            if typed:
                continue
            typed = True
            value = _JSON
        answer.append((name, value))
    if not typed:
        answer.append((_CONTENT_TYPE, _JSON))
    return answer


def _is_sse(head: ResponseHead) -> bool:
    content_type: str = head.headers.get(_CONTENT_TYPE, "")
    return content_type.startswith("text/event-stream")


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


async def end_stream(response: web.StreamResponse) -> None:
    """A stream cut short after a whole event: its end (the last chunk), then the connection
    closes (the engine's connection is being stopped; nothing else follows on this one)."""
    response.force_close()
    with contextlib.suppress(ClientGoneError):
        await _to_client(response.write_eof())


def response_started(state: RequestState) -> web.StreamResponse | None:
    """The client's response if its head already went out (its status can no longer change)."""
    response = state.client_response
    return response if response is not None and response.prepared else None


def answer_failure(
    request: web.BaseRequest, state: RequestState, ending: Ending, request_id_header: str
) -> tuple[web.StreamResponse, Ending]:
    """Before the response started: a JSON error. After: the stream is cut, so the client can
    never take it for a complete one (the status it started with stands: the ending's)."""
    assert ending.error is not None
    sent = response_started(state)
    if sent is not None:
        told = _error_in_early_stream(request, state, sent, ending.error)
        # Closing the transport makes aiohttp's final `write_eof` fail instead of sending the
        # last chunk; the bytes already written are still flushed.
        if request.transport is not None:
            request.transport.close()
        if told:  # reported as it would be without keep-alive: the client has the error
            return sent, ending
        return sent, Ending(ending.outcome, sent.status, ending.error, ending.exc)
    return error_response(ending.error, request_id_header, state.client_request_id), ending


def reject(request: web.BaseRequest, ctx: ProxyContext, error: TetherError) -> web.Response:
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
