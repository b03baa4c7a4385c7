"""The client's request body on its way to the engine: streamed through as it arrives, or read
whole where tether must write its ID into the JSON (SGLang's `rid`, vLLM's body `request_id`,
the Responses API's `request_id`). Either way a client that goes silent mid-body for
TETHER_CLIENT_BODY_TIMEOUT seconds gets a 408, and `Expect: 100-continue` is answered only
once tether's own checks have passed (tether's server has no router to answer it
before).

Whether a body is JSON is decided as the engine decides it (its profile's `json_rule`), by
what the body is more than by its label. So on a route where tether owns an ID field, a body
the engine takes as labelled JSON is read whole, and any other body is read whole too as
soon as its first bytes say it could be a JSON object. Only a body that cannot be one (a
multipart upload, audio, plain text) streams through untouched: no engine can read an ID
out of it. A body read whole is not decoded whole to learn the few members tether reads
(`json_members`): what it costs stays a small multiple of what the client sent.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any, Final

from aiohttp import web
from multidict import istr

from ..engines import JsonRule, Route
from ..errors import (
    InvalidRequestBodyError,
    RequestBodyTooComplexError,
    RequestBodyTooLargeError,
)
from ..upstream.exchange import RequestBody
from ..wire.json_members import (
    InvalidJsonBody,
    JsonBodyTooComplex,
    JsonMembers,
    JsonObject,
    RawJson,
)
from .body_stream import read_chunk, stream_body

# A body that asks for a stream, as written (a spelling that hides it only loses usage).
_ASKS_FOR_STREAM = re.compile(rb'"stream"\s*:\s*true')
# What asking a stream's usage sets where the body has no stream_options (most bodies).
_INCLUDE_USAGE = RawJson('{"include_usage":true}')
_TRUE = RawJson("true")
_FALSE = RawJson("false")
# The members tether reads of every body it parses, and of its stream_options.
_MEMBERS_READ = ("n", "model", "stream", "stream_options", "background")
_USAGE_OPTIONS = ("include_usage", "continuous_usage_stats")
_EXPECT = istr("Expect")
_CONTENT_LENGTH = istr("Content-Length")
# Members of a non-streaming request that keep it from being assembled from a stream.
_NOT_ASSEMBLED = ("tools", "functions", "tool_choice")


class BodyFacts:
    """What tether learnt from a request's body on the way to the engine (`NOTHING_LEARNT`
    for a body it did not read, or before it was sent). Never changed once made (a plain
    class, not a dataclass, for the reason `state.RequestState` is one)."""

    __slots__ = (
        "assembled",
        "background",
        "batch",
        "client_id",
        "model",
        "samples",
        "stream",
        "usage_asked",
    )

    def __init__(
        self,
        *,
        background: bool = False,
        batch: int | None = None,
        samples: int = 1,
        usage_asked: bool = False,
        model: str | None = None,
        client_id: str | None = None,
        stream: bool | None = None,
        assembled: bool = False,
    ) -> None:
        # The client asked the engine to keep working after the connection closes
        # (Responses API `"background": true`): such a request is never aborted on a
        # disconnect.
        self.background: Final = background
        # How many prompts the list in the route's `fan_out` field holds; None: one prompt.
        self.batch: Final = batch
        self.samples: Final = samples  # how many samples it asks for (`n`)
        # tether asked the engine for the stream's usage, which the client did not ask for:
        # the usage event is taken out of what the client gets.
        self.usage_asked: Final = usage_asked
        self.model: Final = model  # the body's `model`, where tether read the body
        # The ID the client named the request by in the body (vLLM's `request_id`, SGLang's
        # `rid`), which the engine would have written into its answer.
        self.client_id: Final = client_id
        # The body's `stream`, where tether read the body (None: not read).
        self.stream: Final = stream
        # A non-streaming request tether sent as a stream (usage asked): its answer is
        # assembled from the events (`Route.assembles_answer`).
        self.assembled: Final = assembled


NOTHING_LEARNT = BodyFacts()


class OutgoingBody:
    """What goes to the engine, and what tether learnt from the body on the way."""

    __slots__ = ("body", "facts")

    def __init__(self, body: RequestBody, facts: BodyFacts = NOTHING_LEARNT) -> None:
        self.body = body
        self.facts = facts

    @property
    def streamed(self) -> bool:
        return self.body is not None and not isinstance(self.body, bytes)


async def outgoing_body(
    request: web.BaseRequest,
    content_types: Sequence[str],
    route: Route | None,
    internal_request_id: str,
    *,
    max_json_body: int,
    body_timeout: float,
    ask_for_usage: bool,
    json_rule: JsonRule,
    keep_client_id: bool = False,
    assemble: bool = False,
) -> OutgoingBody:
    """The body to send upstream for `request` on `route`; `content_types` are the
    `Content-Type` fields the engine will get, and `json_rule` says which bodies it parses as
    JSON. With
    `ask_for_usage`, a stream on a route that reports usage when asked is asked to; with
    `keep_client_id`, an ID the client named in the body goes to the engine unchanged; with
    `assemble` (the route `assembles_answer`), a non-streaming request that asks for nothing
    tether cannot assemble goes as a stream."""
    if not request.body_exists:
        return OutgoingBody(None)
    fields = route.body_fields if route is not None else ()
    id_field = route.client_id_field if route is not None else None
    usage = ask_for_usage and route is not None and route.reports_usage_when_asked
    # Read whole where tether writes its ID in or reads the client's, or must learn from the
    # body which engine requests it makes (a batch, n > 1) even when the ID goes in a header.
    must_read = route is not None and bool(
        fields or id_field or route.fan_out or route.samples_unnamed or usage or assemble
    )
    if not must_read:
        await _send_continue_if_asked(request)
        return OutgoingBody(_passed_through(request, body_timeout))
    labelled_json = json_rule.labelled(content_types)
    if labelled_json:
        _check_declared_length(request, max_json_body)
    await _send_continue_if_asked(request)
    start = b""
    if not labelled_json:
        start = await _read_start(request, body_timeout, json_rule)
        if not json_rule.could_be_object(start):
            return OutgoingBody(_passed_through(request, body_timeout, start))
        _check_declared_length(request, max_json_body)
    body = start + await _read_whole(request, max_json_body - len(start), body_timeout)
    assert route is not None
    # A field's name as written, or a body that could spell it otherwise (`\u` escapes in a
    # name, a UTF-16 or UTF-32 body): then it is parsed. (Searched once per body, with
    # `find`: bytes' `in` first tries its operand as an int and clears the TypeError, which
    # costs more than the search in a small body.)
    disguised = body.find(b"\\u") >= 0 or body.find(b"\x00") >= 0
    maybe = [
        field for field in fields if field.always or disguised or body.find(field.quoted_name) >= 0
    ]
    names_id = id_field is not None and (disguised or body.find(id_field.quoted_name) >= 0)
    # Not parsed only to learn that a request does not stream (most non-streaming ones).
    usage = usage and _ASKS_FOR_STREAM.search(body) is not None
    if not (
        maybe
        or names_id
        or usage
        or assemble
        or route.may_run_in_background
        or route.fan_out
        or route.samples_unnamed
    ):
        return OutgoingBody(body)
    # Only the members tether reads are decoded, each from its own bytes (`json_members`);
    # what it reads may still turn out not to be JSON, so the reading is inside the try.
    names = [*_MEMBERS_READ, *route.fan_out, *(_NOT_ASSEMBLED if assemble else ())]
    for field in maybe:
        names.append(field.name.partition(".")[0])
    if names_id and id_field is not None:
        names.append(id_field.name.partition(".")[0])
    try:
        document = JsonObject(body, names)
        n = document.scalar("n")
        model = document.scalar("model")
        client_id = _named_id(document, id_field.name) if names_id and id_field else None
        kept = id_field if keep_client_id and client_id is not None else None
        values: dict[str, Any] = {
            field.name: field.value.format(id=internal_request_id)
            for field in maybe
            if (field.always or _holds(document, field.name)) and field is not kept
        }
        stream = document.scalar("stream")
        usage = usage and stream is True and _ask_for_usage(document, values)
        assembled = assemble and _assemblable(document)
        if assembled:
            values["stream"] = _TRUE
            _ask_for_usage(document, values)
        facts = BodyFacts(
            background=route.may_run_in_background and document.scalar("background") is True,
            batch=route.batch(document),
            samples=n if isinstance(n, int) and n > 1 else 1,
            usage_asked=usage,
            model=model if isinstance(model, str) else None,
            client_id=client_id,
            stream=stream if isinstance(stream, bool) else None,
            assembled=assembled,
        )
        return OutgoingBody(document.with_members(values) if values else body, facts)
    except JsonBodyTooComplex as too_complex:
        raise RequestBodyTooComplexError(str(too_complex)) from None
    except InvalidJsonBody as invalid:
        if not labelled_json:
            return OutgoingBody(body)  # not JSON after all: nothing for an engine to read
        raise InvalidRequestBodyError(str(invalid)) from None


def _ask_for_usage(document: JsonMembers, values: dict[str, Any]) -> bool:
    """Add to `values` what makes the engine report the stream's usage; False where the body
    asks for it already."""
    options = document.object("stream_options", _USAGE_OPTIONS)
    if options is None:  # absent, null, or not an object
        values["stream_options"] = _INCLUDE_USAGE
        return True
    if options.scalar("include_usage") is True:
        return False
    values["stream_options.include_usage"] = _TRUE
    if options.truthy("continuous_usage_stats"):
        # Only in effect with include_usage: unasked, it would put usage in every chunk, where
        # the client (straight to the engine) gets none.
        values["stream_options.continuous_usage_stats"] = _FALSE
    return True


def _assemblable(document: JsonMembers) -> bool:
    """A non-streaming request whose answer tether can assemble from a stream faithfully: no
    tools (a tool call's ID is drawn anew in each run, its message differs), one sample."""
    n = document.scalar("n")
    return (
        document.scalar("stream") is not True
        and all(document.kind(name) in (None, "null") for name in _NOT_ASSEMBLED)
        and (n is None or n == 1)
    )


def _check_declared_length(request: web.BaseRequest, limit: int) -> None:
    # (read here rather than by aiohttp's `content_length`, which parses it in Python on
    # every read; its parser let through only digits)
    field = request.headers.get(_CONTENT_LENGTH)
    declared = int(field) if field is not None else None
    if declared is not None and declared > limit:
        raise RequestBodyTooLargeError(
            f"the JSON body is {declared} bytes; the limit is {limit} (TETHER_MAX_JSON_BODY)"
        )


def _holds(document: JsonMembers, name: str) -> bool:
    """Whether the body has the field `name` (dotted for a field inside an object field)."""
    outer, _, inner = name.partition(".")
    if not inner:
        return name in document
    value = document.object(outer, (inner,))
    return value is not None and inner in value


def _named_id(document: JsonMembers, name: str) -> str | None:
    """The non-empty string at field `name` (dotted for a field inside an object field)."""
    outer, _, inner = name.partition(".")
    holder = document.object(outer, (inner,)) if inner else document
    value = holder.scalar(inner or name) if holder is not None else None
    return value if isinstance(value, str) and value else None


def _passed_through(request: web.BaseRequest, timeout: float, start: bytes = b"") -> RequestBody:
    """A body tether does not read into: as it is where it arrived whole (most small ones),
    so that it never holds an engine connection waiting for the client (nor one of
    TETHER_MAX_STREAMED_UPLOADS's places); else streamed as it arrives."""
    content = request.content
    if content.is_eof():
        arrived: bytes = content.read_nowait()
        return start + arrived
    return stream_body(request, timeout, start)


async def _read_whole(request: web.BaseRequest, limit: int, timeout: float) -> bytes:
    content = request.content
    if content.is_eof():  # all of it arrived already (most requests): one read, no awaits
        whole: bytes = content.read_nowait()
        if len(whole) > limit:
            raise _too_large(limit)
        return whole
    chunks: list[bytes] = []
    size = 0
    while chunk := await read_chunk(request, timeout):
        size += len(chunk)
        if size > limit:
            raise _too_large(limit)
        chunks.append(chunk)
    return b"".join(chunks)


def _too_large(limit: int) -> RequestBodyTooLargeError:
    return RequestBodyTooLargeError(f"the JSON body exceeds {limit} bytes (TETHER_MAX_JSON_BODY)")


async def _send_continue_if_asked(request: web.BaseRequest) -> None:
    expect = request.headers.get(_EXPECT)
    if expect is not None and expect.lower() == "100-continue" and request.version >= (1, 1):
        await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")


async def _read_start(request: web.BaseRequest, timeout: float, json_rule: JsonRule) -> bytes:
    """The body's first bytes: enough to tell whether it could be a JSON object."""
    start = b""
    while (
        len(start) < json_rule.sniff_bytes and json_rule.could_be_object(start, final=False) is None
    ):
        chunk = await read_chunk(request, timeout)
        if not chunk:
            break
        start += chunk
    return start
