"""A whole answer written by tether (`proxy.server.whole_answer`) is the answer aiohttp's
`web.Response` writes for it, byte for byte, in every case aiohttp decides something: each
method, a status with and without a body, HTTP/1.0 and 1.1, a client that closes, tether
draining, an engine that sent its own Date, Server or Content-Type; and the connection is
kept open or closed as aiohttp would."""

from __future__ import annotations

import asyncio
import itertools
import re
import time
from dataclasses import dataclass
from typing import Any

import pytest
from aiohttp import web
from aiohttp.base_protocol import BaseProtocol
from aiohttp.helpers import rfc822_formatted_time
from aiohttp.http import RawRequestMessage
from aiohttp.http_writer import HttpVersion, StreamWriter
from aiohttp.streams import EMPTY_PAYLOAD
from multidict import CIMultiDict, CIMultiDictProxy
from yarl import URL

from proxy.server.whole_answer import WholeAnswer, http_date

from .support.fake_transport import FakeTransport

pytestmark = pytest.mark.socket_free

_METHODS = ("GET", "POST", "HEAD", "CONNECT")
_STATUSES = (
    (200, None),
    (201, "Created"),
    (204, None),
    (304, None),
    (404, "Not Found"),
    (100, None),
    (599, None),
    (299, "Engine's Own"),
)
_VERSIONS = (HttpVersion(1, 0), HttpVersion(1, 1))
_BODIES = (b"", b'{"id":"chatcmpl-client-7","object":"chat.completion"}')
_ENGINE_HEADERS: tuple[tuple[tuple[str, str], ...], ...] = (
    (),
    (("Content-Type", "application/json"), ("X-Engine", "a")),
    # (the engine's own Date spelt in lower case: `_dated` masks only a `Date` added)
    (
        ("content-type", "application/json"),
        ("date", "Thu, 03 Dec 2026 10:00:00 GMT"),
        ("server", "uvicorn"),
        ("Connection", "keep-alive"),
        ("Transfer-Encoding", "chunked"),
    ),
    # repeated fields, a tab and a Latin-1 byte in values (as the engine connection decodes
    # them), a client ID with a byte UTF-8 cannot carry (aiohttp decodes with surrogates)
    (
        ("Set-Cookie", "a=1"),
        ("Set-Cookie", "b=2"),
        ("X-Note", "caf\xe9\tok"),
        ("X-Request-Id", "client-\udcff-7"),
    ),
)
_DATE = re.compile(rb"\r\nDate: [^\r]*\r\n")


class _ClientProtocol(BaseProtocol):
    """The client connection's protocol as the writer sees it (its transport, whether
    writing is paused), and what a request reads of it."""

    ssl_context = None
    peername = ("127.0.0.1", 40000)
    sockname = ("127.0.0.1", 8000)


def _request(
    method: str, version: HttpVersion, *, closing: bool
) -> tuple[web.BaseRequest, FakeTransport, BaseProtocol]:
    """A request as aiohttp's parser makes it (`closing`: its `should_close`, so an HTTP/1.0
    client that asked for keep-alive is one too), on a connection whose writes are kept."""
    loop = asyncio.get_running_loop()
    transport = FakeTransport()
    protocol = _ClientProtocol(loop)
    protocol.transport = transport  # type: ignore[assignment]
    path = "/v1/chat/completions"
    message = RawRequestMessage(
        method,
        path,
        version,
        CIMultiDictProxy(CIMultiDict()),
        (),
        closing,
        None,
        False,
        False,
        URL(path),
    )
    task = asyncio.current_task()
    assert task is not None
    # (aiohttp types the protocol as its server's; a request reads only what this one has)
    handler: Any = protocol
    request = web.BaseRequest(
        message, EMPTY_PAYLOAD, handler, StreamWriter(protocol, loop), task, loop
    )
    return request, transport, protocol


@dataclass(frozen=True)
class _Case:
    """One answer: the request it answers, what the engine said, and tether's state."""

    method: str
    status: tuple[int, str | None]
    version: HttpVersion
    headers: tuple[tuple[str, str], ...]
    body: bytes
    closing: bool  # the client asked to close (`Connection: close`, or HTTP/1.0's default)
    draining: bool  # tether is draining


async def _by_aiohttp(case: _Case) -> tuple[bytes, bool | None]:
    request, transport, _ = _request(case.method, case.version, closing=case.closing)
    status, reason = case.status
    response = web.Response(
        status=status, reason=reason, headers=CIMultiDict(case.headers), body=case.body
    )
    if case.draining:
        response.force_close()
    await response.prepare(request)
    await response.write_eof()
    return transport.written, response.keep_alive


async def _by_tether(case: _Case) -> tuple[bytes, bool | None]:
    request, transport, _ = _request(case.method, case.version, closing=case.closing)
    answer = WholeAnswer(*case.status, keep_alive=request.keep_alive and not case.draining)
    await answer.send(request, case.method, list(case.headers), case.body)
    assert answer.prepared
    # What aiohttp does with the handler's answer writes nothing more.
    assert await answer.prepare(request) is None
    await answer.write_eof()
    return transport.written, answer.keep_alive


def _dated(written: tuple[bytes, bool | None]) -> tuple[bytes, bool | None]:
    return _DATE.sub(b"\r\nDate: *\r\n", written[0]), written[1]


async def test_every_whole_answer_is_the_bytes_aiohttp_writes_for_it() -> None:
    cases = [
        _Case(*fields)
        for fields in itertools.product(
            _METHODS, _STATUSES, _VERSIONS, _ENGINE_HEADERS, _BODIES, (False, True), (False, True)
        )
    ]
    assert len(cases) == 4 * 8 * 2 * 4 * 2 * 2 * 2
    differences = []
    for case in cases:
        expected, written = await _by_aiohttp(case), await _by_tether(case)
        if _dated(written) != _dated(expected):
            differences.append((case, expected, written))
    assert differences == []


async def test_a_whole_answer_is_one_write_that_keeps_a_kept_alive_connection_open() -> None:
    request, transport, _ = _request("POST", HttpVersion(1, 1), closing=False)
    answer = WholeAnswer(200, "OK", keep_alive=True)
    await answer.send(request, "POST", [("Content-Type", "application/json")], b"{}")
    assert len(transport.calls) == 1
    head, _, body = transport.written.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200 OK\r\n")
    assert b"Content-Length: 2" in head and b"Connection" not in head
    assert body == b"{}"
    assert answer.keep_alive and answer.body_length == 2
    assert request.writer.output_size == len(transport.written)  # aiohttp never answers again


async def _sending_to_a_full_socket() -> tuple[
    FakeTransport, BaseProtocol, WholeAnswer, asyncio.Future[None]
]:
    """An answer sent while the client's socket is over its high-water mark, once it began."""
    request, transport, protocol = _request("POST", HttpVersion(1, 1), closing=False)
    protocol.pause_writing()
    answer = WholeAnswer(200, "OK", keep_alive=True)
    sending = asyncio.ensure_future(answer.send(request, "POST", [], b"x" * 100))
    await asyncio.sleep(0)  # (one turn: it writes, then waits for the socket)
    assert not sending.done()
    return transport, protocol, answer, sending


async def test_a_whole_answer_waits_while_the_clients_socket_is_full() -> None:
    transport, protocol, _, sending = await _sending_to_a_full_socket()
    assert transport.written.endswith(b"x" * 100)  # written at once, then the wait
    protocol.resume_writing()
    await asyncio.wait_for(sending, 5)


async def test_a_client_lost_while_its_answer_waits_for_its_socket_fails_the_answer() -> None:
    _, protocol, answer, sending = await _sending_to_a_full_socket()
    protocol.connection_lost(ConnectionResetError("reset by peer"))
    with pytest.raises(ConnectionError):
        await asyncio.wait_for(sending, 5)
    assert not answer.keep_alive


async def test_a_whole_answer_to_a_client_gone_fails_and_closes_its_connection() -> None:
    request, transport, _ = _request("POST", HttpVersion(1, 1), closing=False)
    transport.close()
    answer = WholeAnswer(200, "OK", keep_alive=True)
    with pytest.raises(ConnectionError):
        await answer.send(request, "POST", [], b"{}")
    assert answer.prepared and not answer.keep_alive
    assert transport.written == b""


@pytest.mark.parametrize(
    ("field", "reason"),
    [
        (("X-Engine", "a\r\nSet-Cookie: stolen=1"), None),
        (("X-Engine\nSet-Cookie", "stolen=1"), None),
        (("X-Engine", "a\x01b"), None),
        (("X-Engine", "a\x7fb"), None),
        (("X-Engine", "a"), "OK\x01"),
    ],
)
async def test_a_head_with_a_control_character_is_refused_as_aiohttp_refuses_it(
    field: tuple[str, str], reason: str | None
) -> None:
    case = _Case("GET", (200, reason), HttpVersion(1, 1), (field,), b"{}", False, False)
    with pytest.raises(ValueError):
        await _by_aiohttp(case)
    with pytest.raises(ValueError):
        await _by_tether(case)


async def test_a_reason_that_would_split_the_head_is_refused_as_aiohttp_refuses_it() -> None:
    with pytest.raises(ValueError):
        web.Response(status=200, reason="OK\r\nSet-Cookie: stolen=1")
    case = _Case(
        "GET", (200, "OK\r\nSet-Cookie: stolen=1"), HttpVersion(1, 1), (), b"{}", False, False
    )
    with pytest.raises(ValueError):
        await _by_tether(case)


def test_the_date_is_aiohttps_date() -> None:
    for _ in range(3):  # (aiohttp's and tether's taken in one second)
        second = int(time.time())
        ours, theirs = http_date(), rfc822_formatted_time()
        if int(time.time()) == second:
            assert ours == theirs
            return
    pytest.fail("three seconds ended between two formatted dates")
