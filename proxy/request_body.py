"""The client's request body on its way to the engine: streamed through as it arrives, or read
whole where tether must write its ID into the JSON (SGLang's `rid`, vLLM's body `request_id`,
the Responses API's `request_id`). Either way a client that goes silent mid-body for
TETHER_CLIENT_BODY_TIMEOUT seconds gets a 408, and `Expect: 100-continue` is answered only
once tether's own checks have passed (tether's server has no router to answer it
before)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from aiohttp import web
from multidict import istr

from .engines import BodyField, Route
from .errors import ClientBodyTimeoutError, InvalidRequestBodyError, RequestBodyTooLargeError
from .request_ids import InvalidJsonBody, read_json_object, write_json_object
from .upstream_protocol import RequestBody

_CONTENT_TYPE = istr("Content-Type")
_EXPECT = istr("Expect")


@dataclass(slots=True)
class OutgoingBody:
    """What goes to the engine, and what tether learnt from the body on the way."""

    body: RequestBody
    rewritten: bool = False
    # The client asked the engine to keep working after the connection closes (Responses
    # API `"background": true`): such a request is never aborted on a disconnect.
    background: bool = False
    # How many prompts the list in the route's `fan_out` field holds; None: one prompt.
    batch: int | None = None
    # How many samples it asks for (`n`).
    samples: int = 1

    @property
    def streamed(self) -> bool:
        return self.body is not None and not isinstance(self.body, bytes)


async def outgoing_body(
    request: web.BaseRequest,
    route: Route | None,
    internal_request_id: str,
    *,
    max_json_body: int,
    body_timeout: float,
) -> OutgoingBody:
    """The body to send upstream for `request` on `route`."""
    if not request.body_exists:
        return OutgoingBody(None)
    fields = route.body_fields if route is not None else ()
    # Read whole where tether writes its ID in, or must learn from the body which engine
    # requests it makes (a batch, n > 1) even when the ID goes in a header.
    must_read = route is not None and bool(fields or route.fan_out or route.samples_unnamed)
    if not (must_read and _engine_reads_as_json(request)):
        await _send_continue_if_asked(request)
        return OutgoingBody(stream_body(request, body_timeout))
    if request.content_length is not None and request.content_length > max_json_body:
        raise RequestBodyTooLargeError(
            f"the JSON body is {request.content_length} bytes; the limit is {max_json_body} "
            "(TETHER_MAX_JSON_BODY)"
        )
    await _send_continue_if_asked(request)
    body = await _read_whole(request, max_json_body, body_timeout)
    assert route is not None
    needed = [field for field in fields if field.always or _mentions(body, field)]
    if not (needed or route.may_run_in_background or route.fan_out or route.samples_unnamed):
        return OutgoingBody(body)
    try:
        document = read_json_object(body)
    except InvalidJsonBody as exc:
        raise InvalidRequestBodyError(str(exc)) from None
    n = document.get("n")
    outgoing = OutgoingBody(
        body,
        background=route.may_run_in_background and document.get("background") is True,
        batch=_batch(document, route.fan_out),
        samples=n if isinstance(n, int) and n > 1 else 1,
    )
    if needed:
        for field in needed:
            _set_field(document, field.name, field.value.format(id=internal_request_id))
        outgoing.body, outgoing.rewritten = write_json_object(document), True
    return outgoing


def _set_field(document: dict[str, Any], name: str, value: str) -> None:
    """Set `name` (dotted for a field inside an object field) to `value`; an inner field the
    body has not got, or that is not an object, becomes one."""
    *outer, last = name.split(".")
    for key in outer:
        inner = document.get(key)
        if not isinstance(inner, dict):
            inner = document[key] = {}
        document = inner
    document[last] = value


def _batch(document: dict[str, Any], fields: tuple[str, ...]) -> int | None:
    """How many prompts the first of `fields` present holds as a list (a string or a list of
    token IDs is one prompt: None)."""
    for name in fields:
        value = document.get(name)
        if value is None:
            continue
        if isinstance(value, list) and not (value and isinstance(value[0], int)):
            return len(value)
        return None
    return None


async def stream_body(request: web.BaseRequest, timeout: float) -> AsyncIterator[bytes]:
    while chunk := await _read_chunk(request, timeout):
        yield chunk


async def _read_whole(request: web.BaseRequest, limit: int, timeout: float) -> bytes:
    chunks: list[bytes] = []
    size = 0
    while chunk := await _read_chunk(request, timeout):
        size += len(chunk)
        if size > limit:
            raise RequestBodyTooLargeError(
                f"the JSON body exceeds {limit} bytes (TETHER_MAX_JSON_BODY)"
            )
        chunks.append(chunk)
    return b"".join(chunks)


async def _read_chunk(request: web.BaseRequest, timeout: float) -> bytes:
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


def _mentions(body: bytes, field: BodyField) -> bool:
    return field.quoted_name in body


async def _send_continue_if_asked(request: web.BaseRequest) -> None:
    expect = request.headers.get(_EXPECT)
    if expect is not None and expect.lower() == "100-continue" and request.version >= (1, 1):
        await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")


def _engine_reads_as_json(request: web.BaseRequest) -> bool:
    """Whether the engine's HTTP layer (FastAPI for vLLM and SGLang) parses this body as JSON:
    no Content-Type at all, application/json or application/*+json. Rewriting only bodies
    labelled application/json would let a client's own `rid` through unlabelled."""
    if _CONTENT_TYPE not in request.headers:
        return True
    media_type = request.content_type.lower()
    return media_type == "application/json" or (
        media_type.startswith("application/") and media_type.endswith("+json")
    )
