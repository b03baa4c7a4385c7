"""SSE keep-alive (TETHER_SSE_KEEPALIVE) for the wait before the engine's response head: which
requests get it, and the wait itself.

A long prefill, a reasoning model or a full queue can keep the engine's head from coming for
longer than a load balancer lets a connection idle. So, as LiteLLM does, tether starts the
client's `200 text/event-stream` itself once the keep-alive interval passed without a head,
and writes a comment every interval until the head comes (`respond.commit_stream`). The
engine's stream then follows in it; any other answer becomes one error event
(`respond.relay_response` with `committed`). A wait in tether's own queue for an engine
slot (TETHER_ENGINE_SLOTS) is part of that wait, and kept alive the same way. The price: the
client no longer sees the HTTP status of an engine error, only the event (docs/streams.md).

The interval never cancels the wait for the head (a wait cancelled while it resends the
request of a stale pooled connection would not resend it again): the wait runs as its own
task, which the handler watches with a timeout, and cancels only when the handler itself is.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any

from aiohttp import web

from ..request.state import RequestState
from ..settings import Settings
from ..upstream.connection import ResponseHead
from ..wire.routes import is_allowed
from .context import ProxyContext
from .respond import KeptAlive, commit_stream, write_comment


def keepalive_for(
    request: web.BaseRequest, state: RequestState, settings: Settings
) -> float | None:
    """The keep-alive interval of this request, once its body was read: a
    generation request (an engine route) whose body asked to stream, not a WebSocket, not one
    tether assembles into a whole answer, on a path not skipped; None: no keep-alive."""
    seconds = settings.sse_keepalive
    if (
        seconds is None
        or state.route is None
        or state.websocket
        or state.body.stream is not True
        or state.body.assembled
    ):
        return None
    skipped = settings.sse_keepalive_skip_paths
    if skipped and is_allowed(request.rel_url.raw_path, skipped):
        return None
    return seconds


async def head_kept_alive(
    request: web.BaseRequest,
    answered: Coroutine[Any, Any, ResponseHead],
    state: RequestState,
    ctx: ProxyContext,
    seconds: float,
) -> tuple[ResponseHead, KeptAlive]:
    """The engine's head (`answered`: the request sent, and its head read), the client's
    stream begun early (with a comment every `seconds`) if it takes longer than `seconds`."""
    loop = asyncio.get_running_loop()
    head_came = loop.create_task(answered)
    committed: web.StreamResponse | None = None
    last_comment_at = 0.0
    try:
        while not (await asyncio.wait((head_came,), timeout=seconds))[0]:
            if committed is None:
                committed = await commit_stream(request, state, ctx)
            else:
                await write_comment(committed)
            last_comment_at = loop.time()
        head: ResponseHead = head_came.result()  # (raises what went wrong)
    finally:
        if not head_came.done():
            head_came.cancel()  # the handler was cancelled (the client left, a stop)
        elif not head_came.cancelled():
            head_came.exception()  # seen: never reported as an exception nobody retrieved
    quiet_for = loop.time() - last_comment_at if committed is not None else 0.0
    return head, KeptAlive(seconds, committed, quiet_for)
