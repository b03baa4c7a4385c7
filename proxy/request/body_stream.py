"""A client's body read piece by piece, each piece bounded by TETHER_CLIENT_BODY_TIMEOUT: the
reads `body` makes, and the body streamed through to the engine as it arrives.

Apart from `body` because the stream is an async generator, which mypyc does not compile:
`body`, on every request's path, is compiled, and this stays Python.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from aiohttp import web

from ..errors import ClientBodyTimeoutError


async def stream_body(
    request: web.BaseRequest, timeout: float, start: bytes = b""
) -> AsyncIterator[bytes]:
    """The body as it arrives (after `start`, what was already read of it)."""
    if start:
        yield start
    while chunk := await read_chunk(request, timeout):
        yield chunk


async def read_chunk(request: web.BaseRequest, timeout: float) -> bytes:
    """The next piece of the client's body (b"" at its end), bounded by the body timeout."""
    content = request.content
    if content.is_eof():  # all of it arrived already (most requests): nothing to wait for
        piece: bytes = await content.readany()
        return piece
    try:
        async with asyncio.timeout(timeout):
            piece = await content.readany()
            return piece
    except TimeoutError:
        raise ClientBodyTimeoutError(
            f"the client sent no body data for TETHER_CLIENT_BODY_TIMEOUT={timeout}s"
        ) from None
