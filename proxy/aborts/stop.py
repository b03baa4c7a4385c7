"""One stop of the engine's work for a request, as the abort tracker carries it out: what it
names, when the client left, how long an engine step takes on this stream, and when the
engine certainly holds the request; built from the request's own record."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from ..observe.tracing import RequestSpan
from ..request.state import RequestState
from ..upstream.exchange import UpstreamExchange
from ..upstream.relay import ResponseRelay

# An engine has registered a request once it sent a byte of its body (a streaming head can
# come first), or this long (seconds) after it got all of it (vLLM: a few milliseconds): an
# abort missing it later is the engine's front end missing, not one that overtook it.
_REGISTERED_AFTER = 0.05


@dataclass(slots=True)
class StopRequest:
    """One request whose work at the engine the tracker stops (its exchange and relay are
    the request's own)."""

    state: RequestState
    engine_request_ids: tuple[str, ...]
    since: float  # when the client left (or tether decided to stop)
    # The stream's own engine step, measured when its client left (None: not a stream, or
    # too few events).
    step: float | None = None
    # When the engine certainly holds the request: now if its response body began, else a
    # while after the whole request reached it.
    registered_by: float = 0.0
    # Reports the request's ending once the engine's work has stopped, with the tokens it
    # produced after the client left (None: tether did not see them); set by the accounting.
    on_stopped: Callable[[int | None], None] | None = None
    stopped: bool = False  # the engine's work has stopped (or tether gave up on it)
    tokens_after_disconnect: int | None = None  # once stopped
    task: asyncio.Task[None] | None = None  # the tracker's task carrying it out

    @property
    def upstream(self) -> UpstreamExchange:
        assert self.state.upstream is not None  # only a request sent upstream is stopped
        return self.state.upstream

    @property
    def relay(self) -> ResponseRelay:
        assert self.state.relay is not None  # the handler gives every stop a relay
        return self.state.relay

    @property
    def span(self) -> RequestSpan | None:
        return self.state.span


def certainly_held(request: StopRequest, answered: float) -> bool:
    """Whether the engine held the request when the abort call reached it, so that its
    outcome says whether the front end misses: its response had begun, or it was sent long
    enough before the client left (`registered_by`) plus the front end's lag, which shows in
    how long the call took to answer. A loaded API server takes longer to register a request
    than an abort call takes to overtake it (observed on one vLLM API server at the start of
    a 100-client burst: calls answered in 20-60 ms matched requests not yet registered)."""
    if request.upstream.first_body_at is not None:
        return True
    return request.registered_by + (answered - request.since) <= request.since


def stop_request(state: RequestState) -> StopRequest:
    """The stop of `state`'s work at the engine, as of now (its client just left)."""
    upstream, relay = state.upstream, state.relay
    assert upstream is not None and relay is not None
    now = time.monotonic()
    events = relay.tokens.events
    first_body_at = upstream.first_body_at
    return StopRequest(
        state,
        engine_request_ids=_engine_request_ids(state),
        since=now,
        # The mean time between the stream's token events so far: one engine step.
        step=(now - first_body_at) / events if first_body_at is not None and events >= 2 else None,
        registered_by=now if first_body_at is not None else upstream.sent_at + _REGISTERED_AFTER,
    )


def _engine_request_ids(state: RequestState) -> tuple[str, ...]:
    """What the engine's abort must name: the session a request carries on an engine with
    sessions, unless its answer turned out not to be a stream (only a stream outlives its
    connection: llama.cpp stops any other request when its connection closes); else the
    route's engine IDs."""
    route, head = state.route, state.upstream.head if state.upstream is not None else None
    if state.engine.session_header is not None:
        session = state.engine_session
        if session is None or (head is not None and not _is_event_stream(head.headers)):
            return ()
        return (session,)
    if route is None:
        return ()
    return route.engine_request_ids(state.internal_request_id, state.body.batch, state.body.samples)


def _is_event_stream(headers: Mapping[str, str]) -> bool:
    return headers.get("Content-Type", "").startswith("text/event-stream")


def mark_stopped(request: StopRequest, tokens_after: int | None) -> None:
    """The engine's work for `request` has stopped: its ending can be reported."""
    request.stopped = True
    request.tokens_after_disconnect = tokens_after
    if request.on_stopped is not None:
        request.on_stopped(tokens_after)


def tokens_after_disconnect(relay: ResponseRelay) -> int:
    """Tokens the engine produced after the client left: the engine's own count less what the
    client received where it reported one, else the token-carrying events read since."""
    relayed = relay.tokens_relayed or 0
    reported = relay.tokens.reported()
    if reported is not None and reported >= relayed:
        return reported - relayed
    return max(relay.tokens.events - relayed, 0)
