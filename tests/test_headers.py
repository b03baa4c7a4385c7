"""Header rules, as input → output tables (pure, no I/O)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from multidict import CIMultiDict

from proxy.wire.headers import HOP_BY_HOP, EngineHeads, client_response_fields

from .support.canaries import CANARY_SECRET

pytestmark = pytest.mark.socket_free

# The oracle, written out rather than taken from the code under test: RFC 9110 §7.6.1's
# connection-specific fields and the non-standard ones proxies still see.
_CONNECTION_SPECIFIC = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "proxy-connection",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
    }
)


def _upstream(
    headers: CIMultiDict[str], client_request_id_header: str = "X-Request-Id", **options: object
) -> CIMultiDict[str]:
    """The fields of the head the engine gets for a client request with `headers`, read back
    from its bytes."""
    arguments: dict[str, object] = {
        "internal_request_id": "i" * 32,
        "peer": "10.0.0.9",
        "scheme": "http",
    }
    arguments.update(options)
    heads = EngineHeads("http://engine:8000", client_request_id_header)
    head = heads.head("POST", "/v1/x", _raw(headers), headers, **arguments)  # type: ignore[arg-type]
    lines = head.decode("utf-8", "surrogateescape").split("\r\n")
    assert lines[0] == "POST /v1/x HTTP/1.1" and lines[-2:] == ["", ""]
    fields: CIMultiDict[str] = CIMultiDict()
    for line in lines[1:-2]:
        name, separator, value = line.partition(": ")
        assert separator, line
        fields.add(name, value)
    return fields


def _raw(headers: CIMultiDict[str]) -> tuple[tuple[bytes, bytes], ...]:
    """`headers` as aiohttp keeps a request's raw fields (their values decoded as UTF-8 with
    surrogate escapes)."""
    return tuple(
        (name.encode("utf-8", "surrogateescape"), value.encode("utf-8", "surrogateescape"))
        for name, value in headers.items()
    )


def test_the_hop_by_hop_list_is_rfc_9110s() -> None:
    """tether's list holds every connection-specific field."""
    assert HOP_BY_HOP >= _CONNECTION_SPECIFIC


def test_hop_by_hop_and_connection_named_headers_are_dropped() -> None:
    """Connection-specific headers, including those named in Connection, stop at tether."""
    sent = CIMultiDict(
        [
            ("connection", "keep-alive, X-Secret-Hop"),
            ("Keep-Alive", "timeout=5"),
            ("Transfer-Encoding", "chunked"),
            ("te", "trailers"),
            ("Upgrade", "h2c"),
            ("Proxy-Authorization", f"Basic {CANARY_SECRET}"),
            ("x-secret-hop", "1"),
            ("Authorization", f"Bearer {CANARY_SECRET}"),
            ("Accept", "text/event-stream"),
        ]
    )
    result = _upstream(sent)
    assert "Authorization" in result and "Accept" in result
    for name in (
        "Connection",
        "Keep-Alive",
        "Transfer-Encoding",
        "TE",
        "Upgrade",
        "Proxy-Authorization",
        "X-Secret-Hop",
    ):
        assert name not in result


def test_internal_id_replaces_the_client_id_upstream() -> None:
    """The engine sees only tether's ID, whatever header the client used."""
    result = _upstream(
        CIMultiDict([("x-correlation-id", "client"), ("X-Request-Id", "other")]),
        client_request_id_header="X-Correlation-Id",
    )
    assert result.getall("X-Request-Id") == ["i" * 32]
    assert "X-Correlation-Id" not in result


def test_forwarded_headers_are_added_and_appended() -> None:
    """X-Forwarded-For grows by the peer; proto and host are set; `Host` names the engine."""
    result = _upstream(
        CIMultiDict(
            [
                ("X-Forwarded-For", "1.2.3.4"),
                ("X-Forwarded-For", "5.6.7.8"),
                ("Host", "api.example"),
                ("X-Forwarded-Proto", "https"),
            ]
        )
    )
    assert result.getall("X-Forwarded-For") == ["1.2.3.4, 10.0.0.9"]
    assert result.getall("X-Forwarded-Proto") == ["http"]
    assert result["X-Forwarded-Host"] == "api.example"
    assert result.getall("Host") == ["engine:8000"]
    # Without a peer (a Unix socket), the client's X-Forwarded-For passes as it came.
    unknown_peer = _upstream(CIMultiDict([("X-Forwarded-For", "1.2.3.4")]), peer=None)
    assert unknown_peer.getall("X-Forwarded-For") == ["1.2.3.4"]
    # A client's own X-Forwarded-Host stands.
    named_host = _upstream(CIMultiDict([("Host", "a"), ("X-Forwarded-Host", "b")]))
    assert named_host.getall("X-Forwarded-Host") == ["b"]


def test_tethers_fields_replace_the_clients() -> None:
    """tether's span context and its framing replace any the client sent by those names."""
    sent = CIMultiDict([("traceparent", "00-client-01"), ("Content-Length", "99"), ("Accept", "a")])
    result = _upstream(sent, added={"traceparent": "00-tether-01"}, content_length=2)
    assert result.getall("traceparent") == ["00-tether-01"]
    assert result.getall("Content-Length") == ["2"]
    assert result["Accept"] == "a"


def test_expect_is_not_forwarded() -> None:
    """`Expect` was answered by tether already; the length is left to the caller, who frames
    the body it sends (a rewritten one gets its own length)."""
    sent = CIMultiDict([("Content-Length", "10"), ("Expect", "100-continue")])
    result = _upstream(sent)
    assert "Expect" not in result and result["Content-Length"] == "10"


# What a `Connection` token may never remove: the fields tether decides from (the body's
# label and framing, the authority) and the request IDs.
_NEVER_NAMED = ("Content-Type", "Content-Length", "Transfer-Encoding", "Host", "X-Request-Id")


def test_connection_cannot_name_the_fields_tether_decides_from() -> None:
    """`Connection: Content-Type, Content-Length, Host, X-Request-Id` is ignored for those
    fields, in both directions: the engine gets the Content-Type tether read the body by (a
    client could otherwise have it removed after tether decided not to read the body), and
    the client the label its body was mapped by."""
    sent = CIMultiDict(
        [
            ("Connection", ", ".join(name.upper() for name in _NEVER_NAMED) + ", X-Hop"),
            ("Content-Type", "application/json"),
            ("Content-Length", "2"),
            ("Host", "api.example"),
            ("X-Hop", "1"),
        ]
    )
    upstream = _upstream(sent)
    assert upstream["Content-Type"] == "application/json"
    assert upstream["Content-Length"] == "2"
    assert upstream["X-Forwarded-Host"] == "api.example"
    assert "X-Hop" not in upstream
    response = CIMultiDict(
        client_response_fields(
            sent,
            client_request_id_header="X-Request-Id",
            client_request_id="c",
            body_rewritten=False,
        )
    )
    assert response["Content-Type"] == "application/json"
    assert response["X-Request-Id"] == "c"
    assert "X-Hop" not in response


def test_response_carries_the_client_id_not_the_engine_echo() -> None:
    """An engine echoing the internal ID (vLLM --enable-request-id-headers) is overridden."""
    result = CIMultiDict(
        client_response_fields(
            CIMultiDict(
                [("x-request-id", "i" * 32), ("Content-Length", "5"), ("Connection", "close")]
            ),
            client_request_id_header="X-Request-Id",
            client_request_id="mine",
            body_rewritten=True,
        )
    )
    assert result.getall("X-Request-Id") == ["mine"]
    assert "Content-Length" not in result and "Connection" not in result


_token = st.text(
    alphabet="abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ-", min_size=1, max_size=12
)
# (a field's value never holds a line break, which aiohttp refuses, nor a surrogate but
# those that stand for undecodable bytes)
_value = st.text(alphabet=st.characters(codec="utf-8", exclude_characters="\r\n"), max_size=20)
_HOP_BY_HOP_BESIDES_CONNECTION = sorted(_CONNECTION_SPECIFIC - {"connection"})


def _any_case(name: str) -> st.SearchStrategy[str]:
    """`name` with each letter upper- or lower-case."""
    return st.lists(st.booleans(), min_size=len(name), max_size=len(name)).map(
        lambda upper: "".join(
            c.upper() if u else c.lower() for c, u in zip(name, upper, strict=True)
        )
    )


@st.composite
def _headers_with_hop_by_hop(draw: st.DrawFn) -> list[tuple[str, str]]:
    """Headers, in any order and case, that always hold at least one hop-by-hop header and at
    least one header the sender declared hop-by-hop in `Connection`, among arbitrary others."""
    hop = draw(
        st.lists(
            st.tuples(st.sampled_from(_HOP_BY_HOP_BESIDES_CONNECTION).flatmap(_any_case), _value),
            min_size=1,
            max_size=4,
        )
    )
    declared = draw(st.lists(_token, min_size=1, max_size=3))
    connection = (draw(_any_case("connection")), ", ".join(declared))
    named = [(draw(_any_case(name)), draw(_value)) for name in declared]
    others = draw(st.lists(st.tuples(_token, _value), max_size=8))
    return draw(st.permutations([*hop, connection, *named, *others]))


@given(_headers_with_hop_by_hop())
def test_no_hop_by_hop_header_ever_crosses(headers: list[tuple[str, str]]) -> None:
    """Whatever the client sends, no hop-by-hop header (any case) goes upstream or back, nor
    any header it named in `Connection`."""
    sent = CIMultiDict(headers)
    named = {
        token.strip().lower()
        for value in sent.getall("Connection", ())
        for token in value.split(",")
        if token.strip()
    }
    sent_names = {name.lower() for name in sent}
    # What the generator promises, so the property below is never checked on nothing.
    assert sent_names & set(_HOP_BY_HOP_BESIDES_CONNECTION) and sent_names & named
    added = {"x-request-id", "x-forwarded-for", "x-forwarded-proto", "x-forwarded-host"}
    for result in (
        _upstream(sent),
        CIMultiDict(
            client_response_fields(
                sent,
                client_request_id_header="X-Request-Id",
                client_request_id="c",
                body_rewritten=False,
            )
        ),
    ):
        result_names = {name.lower() for name in result}
        assert not result_names & _CONNECTION_SPECIFIC
        never_named = {name.lower() for name in _NEVER_NAMED}
        assert not result_names & (named - added - never_named)


def test_the_request_head_is_the_line_host_headers_and_framing_as_sent() -> None:
    """The bytes the engine gets: the engine's base path before the target, untouched,
    `Host` naming the engine, each header once in order (a repeated one twice) as the client
    sent its bytes, then tether's fields and the framing it chose."""
    headers = CIMultiDict([("Accept", "a"), ("X-Tag", "1"), ("X-Tag", "2")])
    headers.add("X-Raw", b"caf\xe9".decode("utf-8", "surrogateescape"))
    expected_headers = b"Accept: a\r\nX-Tag: 1\r\nX-Tag: 2\r\nX-Raw: caf\xe9\r\n"
    line = b"POST /base/v1/chat%2Fx?q=%20 HTTP/1.1\r\nHost: engine:8000\r\n"
    tethers = b"X-Forwarded-Proto: http\r\nX-Request-Id: i\r\n"
    heads = EngineHeads("http://engine:8000/base/", "X-Request-Id")
    table: list[tuple[int | None, bool, bytes]] = [
        (12, False, b"Content-Length: 12\r\n"),
        (None, True, b"Transfer-Encoding: chunked\r\n"),
        (None, False, b""),
    ]
    for content_length, chunked, framing_line in table:
        head = heads.head(
            "POST",
            "/v1/chat%2Fx?q=%20",
            _raw(headers),
            headers,
            internal_request_id="i",
            peer=None,
            scheme="http",
            content_length=content_length,
            chunked=chunked,
        )
        assert head == line + expected_headers + tethers + framing_line + b"\r\n"


def test_host_names_the_engine_as_its_url_does() -> None:
    """The engine's authority: its port only where it is not the scheme's, an IPv6 address in
    brackets."""
    for url, host in (
        ("http://engine", b"engine"),
        ("http://engine:80", b"engine"),
        ("https://engine:443/v", b"engine"),
        ("https://engine:8443", b"engine:8443"),
        ("http://[::1]:8000", b"[::1]:8000"),
    ):
        head = EngineHeads(url, "X-Request-Id").head(
            "GET", "/", (), CIMultiDict(), internal_request_id="i", peer=None, scheme="http"
        )
        assert head.split(b"\r\n")[1] == b"Host: " + host
