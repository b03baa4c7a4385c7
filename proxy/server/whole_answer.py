"""An answer whose body tether holds whole (a JSON response read and its ID mapped back, a
stream assembled into an answer), written to the client in one write: the bytes aiohttp's
`web.Response` writes for it (tests/test_whole_answer.py compares them, case by case),
without what building and preparing one costs. For a short request that was the largest
part of tether's own work: ~75,000 instructions of the ~330,000 a request took in all,
checking and setting its headers one by one through the response's layers.

What aiohttp decides about a response's head is decided here the same way:

- the status line's version is the request's, its reason phrase the engine's or the
  standard one;
- `Content-Length` is the body's, but never for 1xx, 204, 304 and a CONNECT's 2xx (nor for
  an empty body on HEAD), and no body follows the head for those and HEAD;
- `Content-Type: application/octet-stream` where a body has none; `Date` and `Server`
  where the engine sent none;
- the connection stays open unless the client asked otherwise or tether is draining:
  `Connection: close` says so on HTTP/1.1, `Connection: keep-alive` on HTTP/1.0.

The head is serialized as aiohttp's serializer does it (UTF-8, a control character but the
tab refused, so no field can split the head), written with the body in one write to the
client's transport, and counted in the request's writer (so aiohttp never answers the
request again); the answer waits while the client's socket is above its high-water mark,
as aiohttp's does.
"""

from __future__ import annotations

import re
import time
from email.utils import formatdate
from http import HTTPStatus

from aiohttp import web
from aiohttp.abc import AbstractStreamWriter
from aiohttp.http import SERVER_SOFTWARE
from aiohttp.web_response import StreamResponse  # (by its module: mypyc subclasses it there)
from mypy_extensions import mypyc_attr

_SERVER_LINE = "Server: " + SERVER_SOFTWARE
# The standard reason phrases, as aiohttp gives a status without one.
_REASONS = {status.value: status.phrase for status in HTTPStatus}
# What aiohttp's serializer refuses in a head: control characters but the tab (RFC 9110 5.5).
_FORBIDDEN_IN_HEADERS = re.compile("[\x00-\x08\x0a-\x1f\x7f]")


# (the ignore for the build: there aiohttp is not installed, and its class is of type Any)
@mypyc_attr(native_class=False)
class WholeAnswer(StreamResponse):  # type: ignore[misc,unused-ignore]
    """What aiohttp gets back from the handler for an answer written here: once `send`
    began it counts as sent, so the `prepare` and `write_eof` aiohttp calls after the
    handler do nothing, and it says whether the connection stays open for the next request.

    aiohttp's class, so that the handler returns one kind of response, but not built by
    aiohttp's `__init__` (interpreted, a fifth of what writing the answer costs): its status
    and reason are this class's own, and its header mapping and per-response storage are
    never set up, being what aiohttp writes from and what an `Application`'s handlers share
    (tether writes the head itself, runs no `Application`, and keeps aiohttp's access log
    off, the one reader of a response's headers after its handler). Compiled code subclasses
    aiohttp's class only as a plain Python class."""

    def __init__(self, status: int, reason: str | None, *, keep_alive: bool) -> None:
        self._answer_status = status
        self._answer_reason = _REASONS.get(status, "") if reason is None else reason
        self._stays_open = keep_alive
        self._started = False
        self._length = 0

    @property
    def status(self) -> int:
        return self._answer_status

    @property
    def reason(self) -> str:
        return self._answer_reason

    @property
    def prepared(self) -> bool:
        return self._started

    @property
    def keep_alive(self) -> bool:
        return self._stays_open

    @property
    def body_length(self) -> int:
        return self._length

    async def prepare(self, request: web.BaseRequest) -> AbstractStreamWriter | None:
        return None  # written already (or its client gone): nothing more goes out

    async def write_eof(self, data: bytes = b"") -> None:
        return None

    async def send(
        self, request: web.BaseRequest, method: str, fields: list[tuple[str, str]], body: bytes
    ) -> None:
        """Write a head of `fields` (the engine's, as the client gets them) and the body, the
        answer to a `method` request; a `ConnectionError` means the client has gone, and the
        connection then closes."""
        self._started = True
        status = self._answer_status
        version = request.version
        # No body may follow these heads; nor a length for a bodiless status or a tunnel.
        lengthless = status < 200 or status in (204, 304) or (method == "CONNECT" and status < 300)
        bodiless = lengthless or method == "HEAD"
        lines = [f"HTTP/{version[0]}.{version[1]} {status} {self._answer_reason}"]
        has_length = has_type = has_date = has_server = has_connection = False
        for name, value in fields:
            lowered = name.lower()
            if lowered == "content-length":
                has_length = True
                if lengthless:
                    continue
            elif lowered == "transfer-encoding":
                if bodiless:
                    continue
            elif lowered == "content-type":
                has_type = True
            elif lowered == "date":
                has_date = True
            elif lowered == "server":
                has_server = True
            elif lowered == "connection":
                has_connection = True
            lines.append(name + ": " + value)
        # aiohttp refuses a field that would split the head, or carries a control character.
        if _FORBIDDEN_IN_HEADERS.search("\t".join(lines)) is not None:
            raise ValueError("a control character in the answer's head (header injection?)")
        if not has_length and not lengthless and (body or (status != 304 and method != "HEAD")):
            lines.append(f"Content-Length: {len(body)}")  # (a HEAD's says what a GET gets)
        if bodiless:
            body = b""
        if body and not has_type:
            lines.append("Content-Type: application/octet-stream")
        if not has_date:
            lines.append("Date: " + http_date())
        if not has_server:
            lines.append(_SERVER_LINE)
        if not has_connection:
            if self._stays_open:
                if version == (1, 0):
                    lines.append("Connection: keep-alive")
            elif version == (1, 1):
                lines.append("Connection: close")
        lines.append("\r\n")
        # (surrogates, which UTF-8 cannot encode, are left out, as aiohttp leaves them out)
        head = "\r\n".join(lines).encode("utf-8", "ignore")
        protocol = request.protocol
        transport = protocol.transport
        if transport is None or transport.is_closing():
            self._stays_open = False
            raise ConnectionResetError("the client's connection is closing")
        transport.write(head + body if body else head)
        self._length = len(body)
        writer = request.writer
        writer.output_size += len(head) + len(body)  # (aiohttp never answers it again)
        if protocol.writing_paused:  # the client reads slower than its answer came
            try:
                await writer.drain()
            except ConnectionError:
                self._stays_open = False
                raise


_date_second = 0
_date_text = ""


def http_date() -> str:
    """Now as an HTTP date (`Fri, 04 Dec 2026 17:50:23 GMT`), formatted once a second."""
    global _date_second, _date_text
    now = int(time.time())
    if now != _date_second:
        _date_second, _date_text = now, formatdate(now, usegmt=True)
    return _date_text
