"""Pure header rules: what crosses the proxy in each direction. No I/O."""

from __future__ import annotations

import functools
from typing import Final

from multidict import CIMultiDict, CIMultiDictProxy, istr

from ..engines import ID_HEADERS, REQUEST_ID_HEADER

# RFC 9110 §7.6.1 connection-specific fields, plus the non-standard ones proxies still see.
HOP_BY_HOP: frozenset[str] = frozenset(
    name.lower()
    for name in (
        "Connection",
        "Keep-Alive",
        "Proxy-Authenticate",
        "Proxy-Authorization",
        "Proxy-Connection",
        "TE",
        "Trailer",
        "Transfer-Encoding",
        "Upgrade",
    )
)

UPSTREAM_REQUEST_ID_HEADER = istr(REQUEST_ID_HEADER)
_HOST = istr("Host")
# tether (aiohttp) already answered `100 Continue` to the client; the engine gets the body.
_EXPECT = istr("Expect")
_CONTENT_LENGTH = istr("Content-Length")
_X_FORWARDED_FOR = istr("X-Forwarded-For")
_X_FORWARDED_PROTO = istr("X-Forwarded-Proto")
_X_FORWARDED_HOST = istr("X-Forwarded-Host")
_NONE: frozenset[str] = frozenset()


# Fields a `Connection` token may not remove (RFC 9110 §7.6.1 lets a sender name only
# hop-by-hop fields there): the framing and the label the engine parses the body by, the
# authority, and the request IDs (every header an engine keys requests by). A client naming
# one is ignored, as nginx ignores it, so what tether decided from a field is what the other
# side gets.
_NEVER_CONNECTION_NAMED = (
    frozenset({"content-type", "content-length", "transfer-encoding", "host"}) | ID_HEADERS
)


def _connection_named(
    headers: CIMultiDictProxy[str] | CIMultiDict[str], keep: frozenset[str]
) -> frozenset[str]:
    """Headers the sender declared hop-by-hop in `Connection` (RFC 9110 §7.6.1), lower-cased,
    other than those in `keep`."""
    if "Connection" not in headers:
        return _NONE
    named: set[str] = set()
    for value in headers.getall("Connection", ()):
        named.update(token.strip().lower() for token in value.split(",") if token.strip())
    return frozenset(named - keep)


def _end_to_end(
    headers: CIMultiDictProxy[str] | CIMultiDict[str], also_drop: tuple[str, ...], keep: str
) -> CIMultiDict[str]:
    """A copy of `headers` without hop-by-hop ones, those named in `Connection` (never the
    fields of `_NEVER_CONNECTION_NAMED` or `keep`, the client's request-ID header) and
    `also_drop`. (One compiled pass over the few headers a request has: cheaper than a copy
    and a case-insensitive lookup of each of the dozen names dropped.)"""
    dropped = _dropped(also_drop)
    named = _connection_named(headers, _kept(keep))
    if named:
        dropped = dropped | named
    result: CIMultiDict[str] = CIMultiDict()
    for name, value in headers.items():
        if name.lower() not in dropped:
            result.add(name, value)
    return result


@functools.lru_cache(maxsize=8)
def _kept(request_id_header: str) -> frozenset[str]:
    return _NEVER_CONNECTION_NAMED | {request_id_header.lower()}


@functools.lru_cache(maxsize=64)
def _dropped(also_drop: tuple[str, ...]) -> frozenset[str]:
    """The headers never passed on, for one set of extra names (a handful per process)."""
    return HOP_BY_HOP | {name.lower() for name in also_drop}


def upstream_request_headers(
    headers: CIMultiDictProxy[str] | CIMultiDict[str],
    *,
    client_request_id_header: str,
    internal_request_id: str,
    peer: str | None,
    scheme: str,
    id_headers: tuple[str, ...] = (UPSTREAM_REQUEST_ID_HEADER,),
) -> CIMultiDict[str]:
    """Headers to send upstream for one client request.

    The client's own request ID never reaches the engine: tether's internal ID replaces it in
    every header the engine keys requests by (`X-Request-Id` for vLLM and most servers, plus
    SGLang's `X-Override-Rid`), so a client cannot pick the engine's ID through any of them.
    `Host` is left to the HTTP client so it names the upstream; the body's framing to the
    caller, who knows what body it sends.
    """
    also_drop = (_HOST, _EXPECT, client_request_id_header, *id_headers)
    result = _end_to_end(headers, also_drop, client_request_id_header)
    if peer:
        forwarded_for = headers.get(_X_FORWARDED_FOR)
        result[_X_FORWARDED_FOR] = f"{forwarded_for}, {peer}" if forwarded_for else peer
    result[_X_FORWARDED_PROTO] = scheme
    host = headers.get(_HOST)
    if host and _X_FORWARDED_HOST not in result:
        result[_X_FORWARDED_HOST] = host
    for name in id_headers:
        result[name] = internal_request_id
    return result


def client_response_headers(
    headers: CIMultiDictProxy[str] | CIMultiDict[str],
    *,
    client_request_id_header: str,
    client_request_id: str,
    body_rewritten: bool,
) -> CIMultiDict[str]:
    """Headers to send back to the client for one upstream response.

    Any request-ID header the engine echoed carries the internal ID; the client gets its own.
    A rewritten body changes length, so its `Content-Length` is set again by the caller.
    """
    also_drop: tuple[str, ...] = (client_request_id_header, UPSTREAM_REQUEST_ID_HEADER)
    if body_rewritten:
        also_drop += (_CONTENT_LENGTH,)
    result = _end_to_end(headers, also_drop, client_request_id_header)
    result[client_request_id_header] = client_request_id
    return result


def request_head(
    method: str,
    target: str,
    host: str,
    headers: CIMultiDict[str],
    *,
    content_length: int | None,
    chunked: bool,
) -> bytes:
    """A request's line and headers as they go on the wire to the engine: `target` as the
    client sent it (re-encoding could change what the engine routes on), `Host` naming the
    engine, the framing tether chose."""
    lines = [f"{method} {target} HTTP/1.1\r\nHost: {host}\r\n"]
    for name, value in headers.items():
        lines.append(f"{name}: {value}\r\n")
    if content_length is not None:
        lines.append(f"Content-Length: {content_length}\r\n")
    elif chunked:
        lines.append("Transfer-Encoding: chunked\r\n")
    lines.append("\r\n")
    # aiohttp decodes header bytes as UTF-8 with surrogate escapes: this gives back exactly
    # the bytes the client sent.
    return "".join(lines).encode("utf-8", "surrogateescape")


# A request line's bytes besides its method and target (` ` and ` HTTP/1.1\r\n`) and the
# blank line that ends the head; each field line's besides its name and value. (`Final`:
# compiled, plain numbers rather than module attributes looked up on every request.)
_REQUEST_LINE_AND_END: Final = len(" ") + len(" HTTP/1.1\r\n") + len("\r\n")
_FIELD_LINE: Final = len(": \r\n")


def client_head_size(method: str, target: str, raw_headers: tuple[tuple[bytes, bytes], ...]) -> int:
    """The size of a client's request head: its request line and each `Name: value` line as
    aiohttp parsed them (whitespace around a value, which is not kept, is not counted)."""
    size = len(method) + len(target) + _REQUEST_LINE_AND_END + _FIELD_LINE * len(raw_headers)
    for field in raw_headers:
        size += len(field[0]) + len(field[1])
    return size
