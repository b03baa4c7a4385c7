"""A user middleware for vLLM's `--middleware` flag, loaded by vLLM (not by pytest).

It is a function, so vLLM installs it with `@app.middleware("http")`, i.e. as a Starlette
`BaseHTTPMiddleware`: the kind that historically hid client disconnects from the handler.
Typed loosely on purpose: starlette lives in vLLM's venv, not in tether's.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

MARK_HEADER = "x-tether-test-middleware"


async def tag_responses(request: Any, call_next: Callable[[Any], Awaitable[Any]]) -> Any:
    """Pass the request on and mark the response, so tests can see the middleware ran."""
    response = await call_next(request)
    response.headers[MARK_HEADER] = "1"
    return response
