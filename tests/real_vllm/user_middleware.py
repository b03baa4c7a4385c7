"""A user middleware for vLLM's `--middleware` flag (a function, so vLLM installs it as a
Starlette `BaseHTTPMiddleware`, the kind that historically hid client disconnects)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from starlette.requests import Request
from starlette.responses import Response

MARK_HEADER = "x-tether-test-middleware"


async def tag_responses(request: Request, call_next: Callable[[Request], Awaitable[Response]]) -> Response:
    """Pass the request on and mark the response, so tests can see the middleware ran."""
    response = await call_next(request)
    response.headers[MARK_HEADER] = "1"
    return response
