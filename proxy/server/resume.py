"""Streams that outlive a dropped connection (TETHER_RESUME_GRACE).

With a grace set, each event of a generation's stream goes to the client numbered (`id: <n>`)
and the latest are held (`wire.event_log`). When the client's connection drops, the request's
handler does not stop the engine's work: it holds the stream (`carry_on`), reading the engine
on, for the grace. The same caller (the cancel routes' rule: the same credential) resumes it
with `GET /v1/requests/{id}/stream` and `Last-Event-ID: <n>` (or `?starting_after=<n>`): it
gets every event after `n` exactly once, then the rest as the engine sends it, and the engine
never notices. Nobody within the grace, or more held than TETHER_RESUME_BUFFER allows: the
engine's work is stopped as for any client that left. A resume may also take over a stream
whose connection tether still thinks alive (a network change leaves it half-open): the old
connection is closed.
"""

from __future__ import annotations

import asyncio
import time

from aiohttp import web

from ..errors import InvalidLastEventIdError, RequestTimeoutError, TetherError
from ..outcomes import Outcome
from ..request.held_stream import HeldStream
from ..request.state import Ending, RequestState
from ..upstream.exchange import SinkClosedError
from ..upstream.stream_keepalive import StreamKeepAlive
from .context import ProxyContext

STREAM = "stream"
LAST_EVENT_ID = "Last-Event-ID"
STARTING_AFTER = "starting_after"
# An event number as a client names it: decimal digits, no sign, at most this many.
_MAX_DIGITS = 18


async def carry_on(
    ctx: ProxyContext, state: RequestState, held: HeldStream, *, cancelled: bool
) -> Ending | None:
    """The client's connection is gone: hold its stream for a resume, and carry it to its end
    on the connections that resume it. None when nobody resumed it within the grace (or it
    held more than allowed): its engine work is then stopped as for any client that left.
    `cancelled`: the handler learnt it from its cancellation (else from a failed write, and
    the cancellation aiohttp makes when it sees the connection closed is still to come)."""
    grace = ctx.settings.resume_grace
    assert grace is not None and state.upstream is not None and state.relay is not None
    task = asyncio.current_task()
    assert task is not None
    loop = asyncio.get_running_loop()
    held_until: float | None = None  # while held: the end of its grace, on the loop's clock
    # The handler was cancelled because its first connection closed: aiohttp does so once.
    first_closed = cancelled
    try:
        while True:
            try:
                if not held.carried:
                    if held_until is None:
                        held_until = loop.time() + grace
                        ctx.accounting.stream_held(state, grace)
                    if await held.wait_resume(held_until) is None:
                        held.end(whole=False)  # no resume may take it over from here
                        return None
                    held_until = None
                    ctx.accounting.stream_resumed(state)
                await _carried_to_end(ctx, state, held)
            except SinkClosedError:
                held.sink_lost()  # the resume's connection dropped too: held again
                continue
            except asyncio.CancelledError:
                if state.stopped_by is None and not first_closed:
                    # Its first connection closing (once): after a resume took the stream
                    # over, or after a failed write already told the handler it was gone.
                    first_closed = True
                    task.uncancel()
                    continue
                # Its caller cancelled it, an operator aborted it, or tether is shutting down.
                held.end(whole=state.relay.ended_at_boundary)
                ctx.aborts.stop_work(state)
                return Ending(state.stopped_by or Outcome.SHUTDOWN_ABORTED, 200)
            except TetherError as error:
                timed_out = isinstance(error, RequestTimeoutError)
                ctx.aborts.stop_work(state, ask_engine=timed_out)
                held.end(whole=False)
                outcome = Outcome.TIMED_OUT if timed_out else Outcome.UPSTREAM_FAILED
                return Ending(outcome, 200, error)
            state.relay.finish()
            held.end(whole=True)
            return Ending(Outcome.COMPLETED, 200)
    finally:
        if held_until is not None:  # it ended held, with no resume
            ctx.accounting.stream_not_resumed(state)


async def _carried_to_end(ctx: ProxyContext, state: RequestState, held: HeldStream) -> None:
    """Until the engine's response ended, its events going to the resume that carries it
    (with keep-alive comments where the stream had them)."""
    assert state.upstream is not None and state.relay is not None
    seconds = held.keepalive
    keeping_alive = (
        StreamKeepAlive(state.relay, seconds, first_check=seconds) if seconds is not None else None
    )
    limit = ctx.settings.request_timeout
    try:
        if limit is None:
            await state.upstream.wait_end(ctx.settings.stream_idle_timeout)
            return
        # The whole-request timeout still bounds it, from the request's start.
        try:
            async with asyncio.timeout(state.started_at + limit - time.monotonic()):
                await state.upstream.wait_end(ctx.settings.stream_idle_timeout)
        except TimeoutError as exc:
            if isinstance(exc, TetherError):
                raise
            raise RequestTimeoutError(
                f"the request took longer than TETHER_REQUEST_TIMEOUT={limit}s"
            ) from exc
    finally:
        if keeping_alive is not None:
            keeping_alive.stop()


def last_received(request: web.BaseRequest) -> int:
    """The number of the last event the resuming client received whole (0: none)."""
    named = request.headers.get(LAST_EVENT_ID)
    if named is None:
        named = request.query.get(STARTING_AFTER, "0")
    named = named.strip()
    if not named.isdigit() or not named.isascii() or len(named) > _MAX_DIGITS:
        raise InvalidLastEventIdError(
            f"{LAST_EVENT_ID} (or ?{STARTING_AFTER}=) must be the number of the last event "
            "received (its id line)"
        )
    return int(named)
