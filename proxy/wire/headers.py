"""Pure header rules: what crosses the proxy in each direction. No I/O."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Final
from urllib.parse import urlsplit

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
_NONE: frozenset[str] = frozenset()

# A request's fields as the client sent them: name and value, as aiohttp keeps them.
RawHeaders = tuple[tuple[bytes, bytes], ...]


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


def _kept(request_id_header: str) -> frozenset[str]:
    """What a `Connection` token may not remove, with the client's request-ID header."""
    return _NEVER_CONNECTION_NAMED | {request_id_header.lower()}


class EngineHeads:
    """Each client request's head as it goes on the wire to one engine: the request line
    (the engine's base path before the client's target, untouched: re-encoding could change
    what the engine routes on), `Host` naming the engine, the client's end-to-end fields,
    `X-Forwarded-*`, tether's ID in every header the engine keys requests by, and the
    framing tether chose.

    Which fields pass is decided once, for one client request-ID header and one engine
    profile's ID headers; each head is then one pass over the client's fields as they
    arrived (aiohttp's raw bytes, which its parsed values only decode: the engine gets the
    bytes the client sent). The client's own request ID never reaches the engine: tether's
    internal ID replaces it in every ID header (`X-Request-Id` for vLLM and most servers,
    plus SGLang's `X-Override-Rid`), so a client cannot pick the engine's ID through any of
    them."""

    __slots__ = (
        "_base_path",
        "_dropped",
        "_host_line",
        "_id_names",
        "_kept",
        "forwards_content_length",
        "forwards_content_type",
    )

    def __init__(
        self,
        upstream_url: str,
        client_request_id_header: str,
        id_headers: tuple[str, ...] = (UPSTREAM_REQUEST_ID_HEADER,),
    ) -> None:
        parts = urlsplit(upstream_url)
        default_port = 443 if parts.scheme == "https" else 80
        host = parts.hostname or ""
        host = f"[{host}]" if ":" in host else host
        authority = host if parts.port in (None, default_port) else f"{host}:{parts.port}"
        self._host_line = f"Host: {authority}\r\n".encode()
        self._base_path = parts.path.rstrip("/")
        self._id_names = [name.encode() for name in id_headers]
        # `Host` names the engine; `Expect` tether (aiohttp) already answered; the
        # `X-Forwarded-*` tether writes anew (`X-Forwarded-For` only where it knows the peer).
        dropped = HOP_BY_HOP | {"host", "expect", "x-forwarded-proto"}
        dropped |= {name.lower() for name in (client_request_id_header, *id_headers)}
        self._dropped = frozenset(name.encode() for name in dropped)
        self._kept = _kept(client_request_id_header)
        # (neither can be named in `Connection`: whether a client's field reaches the engine)
        self.forwards_content_type = b"content-type" not in self._dropped
        self.forwards_content_length = b"content-length" not in self._dropped

    def head(
        self,
        method: str,
        target: str,
        raw_headers: RawHeaders,
        headers: CIMultiDictProxy[str] | CIMultiDict[str],
        *,
        internal_request_id: str,
        peer: str | None,
        scheme: str,
        added: Mapping[str, str] | None = None,
        content_length: int | None = None,
        chunked: bool = False,
    ) -> bytes:
        """The head of one request: `raw_headers` as the client sent them (`headers`, the
        same parsed, tell which ones it named in `Connection`), `added` fields of tether's in
        place of any the client sent by those names (a span's `traceparent`, a WebSocket's
        `Upgrade`), and `content_length` (tether's, in place of the client's) or `chunked`."""
        dropped = self._dropped
        named = _connection_named(headers, self._kept)
        if named or added:  # (rare: no set is built for most requests)
            dropped = dropped | {_field_name(name) for name in named}
            if added:
                dropped = dropped | {_field_name(name.lower()) for name in added}
        own_length = content_length is not None
        # (pieces joined once: a formatted line per field would cost a `str()` of each)
        lines = [
            f"{method} {self._base_path}{target} HTTP/1.1\r\n".encode("utf-8", "surrogateescape"),
            self._host_line,
        ]
        forwarded_for: bytes | None = None
        host: bytes | None = None
        forwarded_host = False
        for field in raw_headers:
            name = field[0]
            lowered = name.lower()
            if lowered == b"x-forwarded-for":
                if forwarded_for is None:
                    forwarded_for = field[1]
                if peer or lowered in dropped:  # (with a peer: appended to, below)
                    continue
            elif lowered in dropped or (own_length and lowered == b"content-length"):
                if lowered == b"host" and host is None:
                    host = field[1]
                continue
            elif lowered == b"x-forwarded-host":
                forwarded_host = True
            lines.append(name)
            lines.append(b": ")
            lines.append(field[1])
            lines.append(b"\r\n")
        if peer:
            lines.append(b"X-Forwarded-For: ")
            if forwarded_for:
                lines.append(forwarded_for)
                lines.append(b", ")
            lines.append(peer.encode("utf-8", "surrogateescape"))
            lines.append(b"\r\n")
        lines.append(b"X-Forwarded-Proto: ")
        lines.append(scheme.encode())
        lines.append(b"\r\n")
        if host and not forwarded_host:
            lines.append(b"X-Forwarded-Host: ")
            lines.append(host)
            lines.append(b"\r\n")
        if added:
            for added_name, added_value in added.items():
                field_line = f"{added_name}: {added_value}\r\n"
                lines.append(field_line.encode("utf-8", "surrogateescape"))
        request_id = internal_request_id.encode("utf-8", "surrogateescape")
        for id_name in self._id_names:
            lines.append(id_name)
            lines.append(b": ")
            lines.append(request_id)
            lines.append(b"\r\n")
        if content_length is not None:
            lines.append(b"Content-Length: %d\r\n" % content_length)
        elif chunked:
            lines.append(b"Transfer-Encoding: chunked\r\n")
        lines.append(b"\r\n")
        return b"".join(lines)


def _field_name(lowered: str) -> bytes:
    """A lower-cased field name as the raw headers spell it (aiohttp decodes them as UTF-8
    with surrogate escapes)."""
    return lowered.encode("utf-8", "surrogateescape")


def client_response_fields(
    headers: CIMultiDictProxy[str] | CIMultiDict[str],
    *,
    client_request_id_header: str,
    client_request_id: str,
    body_rewritten: bool,
) -> list[tuple[str, str]]:
    """The fields to send back to the client for one upstream response, in order: without
    hop-by-hop ones and those named in `Connection` (never the fields of
    `_NEVER_CONNECTION_NAMED` or the client's request-ID header).

    Any request-ID header the engine echoed carries the internal ID; the client gets its own.
    A rewritten body changes length, so its `Content-Length` is set again by the caller.
    """
    dropped, kept = _response_rules(client_request_id_header, body_rewritten)
    named = _connection_named(headers, kept)
    if named:
        dropped = dropped | named
    # (one compiled pass)
    fields = [(name, value) for name, value in headers.items() if name.lower() not in dropped]
    fields.append((client_request_id_header, client_request_id))
    return fields


# The response's rules per client request-ID header, with and without tether's own length
# (one header per process; a few in tests).
_RESPONSE_RULES: dict[tuple[str, bool], tuple[frozenset[str], frozenset[str]]] = {}


def _response_rules(
    client_request_id_header: str, body_rewritten: bool
) -> tuple[frozenset[str], frozenset[str]]:
    """The fields never passed back, and those a `Connection` token cannot remove."""
    key = (client_request_id_header, body_rewritten)
    rules = _RESPONSE_RULES.get(key)
    if rules is None:
        dropped = HOP_BY_HOP | {client_request_id_header.lower(), REQUEST_ID_HEADER.lower()}
        if body_rewritten:
            dropped |= {"content-length"}
        rules = _RESPONSE_RULES[key] = (dropped, _kept(client_request_id_header))
    return rules


# A request line's bytes besides its method and target (` ` and ` HTTP/1.1\r\n`) and the
# blank line that ends the head; each field line's besides its name and value. (`Final`:
# compiled, plain numbers rather than module attributes looked up on every request.)
_REQUEST_LINE_AND_END: Final = len(" ") + len(" HTTP/1.1\r\n") + len("\r\n")
_FIELD_LINE: Final = len(": \r\n")


def client_head_size(method: str, target: str, raw_headers: RawHeaders) -> int:
    """The size of a client's request head: its request line and each `Name: value` line as
    aiohttp parsed them (whitespace around a value, which is not kept, is not counted)."""
    size = len(method) + len(target) + _REQUEST_LINE_AND_END + _FIELD_LINE * len(raw_headers)
    for field in raw_headers:
        size += len(field[0]) + len(field[1])
    return size
