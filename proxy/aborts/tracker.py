"""Stopping the engine's work for a request nobody will read, and proving that it stopped.

Each stop is a tracked task that outlives the cancelled handler. Where the engine has a
working abort route, tether calls it and keeps reading (not relaying) the engine's response
to see it end: `confirmed` rests on what the engine did, not on what tether sent. Everywhere
else, and whenever the call fails, the upstream connection is dropped at once (the engine's
other signal). What the engine produced after the client left is counted on the way.

Keeping the connection open must never cost generation a plain close would have saved:

- the connection stays open only for the confirm window: as many engine steps as this
  engine's accepted aborts take to end a response, and no less than its HTTP side's own
  delays (its profile says; a step is measured on the stream itself, or on the engine's
  recent streams: `front_end`);
- past the window the connection is dropped (`unconfirmed`). Repeats of the call go out on
  fresh connections, which the kernel may give to another process (the first call goes on
  a kept-alive control connection), until TETHER_ABORT_CONFIRM_TIMEOUT: an engine that
  notices a dropped connection late (SGLang's 4 s poll for a non-streaming request, vLLM
  behind a middleware that hides it) is stopped by the repeat that reaches the right
  process. A request the engine may not have registered yet (sent moments ago, no response
  begun) gets its window only from then: an abort can overtake its request;
- once the front end has missed aborts of requests it certainly held, later stops drop the
  connection at the moment the call goes out (`dropped`), as a plain close would
  (`front_end`).

The calls are `calls` (routes, retries) through `queue` (a bounded number in flight); how
each stop ended is reported by `request.abort_report`.
"""

from __future__ import annotations

import asyncio
import functools
import time
from dataclasses import dataclass

from ..engines import EngineProfile
from ..engines.token_shapes import TokenShape
from ..faults import ABORT_CONFIRM, Faults
from ..outcomes import AbortResult
from ..request.abort_report import AbortEnding, AbortReport
from ..request.state import RequestState
from ..settings import Settings
from ..upstream.client import UpstreamClient
from ..upstream.exchange import UpstreamExchange
from ..upstream.relay import ResponseRelay
from ..wire.tokens import TokenCounter
from .calls import AbortCalls
from .front_end import FrontEnd
from .queue import CallOutcome, CallQueue, CallResult
from .stop import StopRequest, certainly_held, mark_stopped, stop_request, tokens_after_disconnect


@dataclass(slots=True)
class _EngineAborts:
    """What the tracker keeps per engine profile (the engine tether fronts may say what it
    is only after the first requests): its call queues and what it learnt of its front end."""

    engine: EngineProfile
    calls: CallQueue
    # Repeats go out on fresh connections: a front end with several processes gets each on
    # whichever process accepts it, not always the one that missed.
    repeats: CallQueue
    front_end: FrontEnd


class AbortTracker:
    """Owns every stop in progress."""

    def __init__(
        self,
        settings: Settings,
        upstream: UpstreamClient,
        report: AbortReport,
        faults: Faults | None = None,
    ) -> None:
        self._report = report
        self._faults = faults
        self._calls = AbortCalls(upstream, settings.abort_timeout, settings.abort_deadline)
        self._repeat_delay = settings.abort_repeat_delay
        self._confirm_timeout = settings.abort_confirm_timeout
        self._tasks: set[asyncio.Task[None]] = set()
        self._engines: dict[str, _EngineAborts] = {}

    # --- entry points ----------------------------------------------------------------------

    def stop_work(self, state: RequestState, *, ask_engine: bool = True) -> None:
        """Stop what the engine is doing for `state`, if it saw the request.

        Without `ask_engine`, or when the engine never got the whole request, the connection
        is dropped (never pooled): an engine that listens for disconnects stops at once.
        Otherwise the engine's abort stops it, confirmed from its own response where it can;
        a request meant to outlive its client (`background: true`) is only read to its end."""
        upstream = state.upstream
        if upstream is None:
            return
        if state.tunnel is not None:
            # A WebSocket session has no ID an engine API names; its connection closing is
            # what ends it at the engine (vLLM's session cleanup then aborts its request).
            state.upstream_cancelled = not upstream.ended
            upstream.close()
            return
        relay = state.relay
        if relay is None:
            # The engine's answer had not begun: it is still counted when it comes.
            shape = state.route.tokens if state.route is not None else TokenShape.NONE
            state.relay = relay = ResponseRelay(upstream, TokenCounter(shape), None)
            upstream.attach(relay)
        state.upstream_cancelled = ask_engine and not upstream.ended
        if not ask_engine or not upstream.sent or upstream.ended:
            relay.discard()
            upstream.close()
            return
        stop = stop_request(state)
        detached = state.body.background or state.engine.outlives_connection(
            state.method, state.path
        )
        handed_over = self._let_finish(stop) if detached else self._stop(stop)
        state.stopping = stop if handed_over else None

    async def wait_stopped(self, state: RequestState, timeout: float) -> bool:
        """Wait, at most `timeout` seconds, until the stop of `state`'s engine work has ended
        (its result is then `state.stop_result`); whether it did."""
        stop = state.stopping
        if not isinstance(stop, StopRequest) or stop.stopped or stop.task is None:
            return True
        await asyncio.wait({stop.task}, timeout=timeout)
        return stop.stopped

    @property
    def pending(self) -> int:
        return len(self._tasks)

    async def drain(self) -> None:
        """Wait for every stop in progress and every call it made (each bounded by the abort
        deadline)."""
        while self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        for engine in list(self._engines.values()):
            await engine.calls.drain()
            await engine.repeats.drain()

    # --- the stop --------------------------------------------------------------------------

    def _stop(self, request: StopRequest) -> bool:
        """Abort and confirm where the engine allows, else drop the connection at once. True
        when the rest runs in the background (which then ends the request's span)."""
        request.relay.discard()
        state = request.state
        engine = state.engine
        if not engine.sends_aborts:
            request.upstream.close()
            return False
        if not request.engine_request_ids:
            request.upstream.close()
            if engine.session_header is None:
                self._report.without_call(state, AbortResult.UNKNOWN_ROUTE)
            # (else a request outside a session: the dropped connection is its stop by design)
            return False
        if not self._calls.supported(engine, request.engine_request_ids):
            request.upstream.close()  # every abort route answered as missing, recently
            self._report.without_call(state, AbortResult.NOT_SUPPORTED)
            return False
        if request.step is not None:
            self._of(engine).front_end.note_step(request.step)
        self._track(self._abort_and_confirm(request), request)
        return True

    def _let_finish(self, request: StopRequest) -> bool:
        """A request that must outlive its client: read its response to the end, bounded by
        the confirm timeout, without aborting it."""
        request.relay.discard()
        self._track(self._finish_quietly(request), request)
        return True

    def _of(self, engine: EngineProfile) -> _EngineAborts:
        known = self._engines.get(engine.engine)
        if known is None or known.engine is not engine:
            merges = engine.merges_aborts
            known = self._engines[engine.engine] = _EngineAborts(
                engine,
                CallQueue(functools.partial(self._calls.send, engine), merges),
                CallQueue(functools.partial(self._calls.send, engine, fresh=True), merges),
                FrontEnd(engine.confirm_rule, self._confirm_timeout),
            )
        return known

    def _track(self, work: object, request: StopRequest) -> None:
        assert asyncio.iscoroutine(work)
        name = f"stop-{request.state.internal_request_id}"
        task = asyncio.get_running_loop().create_task(work, name=name)
        self._tasks.add(task)
        request.task = task
        task.add_done_callback(functools.partial(self._finished, request))

    def _finished(self, request: StopRequest, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and (error := task.exception()) is not None:
            # Expected failures are results; anything raised here is a bug in tether.
            self._report.crashed(request.state, error)
        if not request.stopped:  # a stop that crashed still reports its request
            mark_stopped(request, None)

    async def _abort_and_confirm(self, request: StopRequest) -> None:
        """The call, then the confirm window: the protocol of one stop."""
        upstream = request.upstream
        confirm_by = request.since + self._confirm_timeout
        engine = self._of(request.state.engine)
        early = request.registered_by - time.monotonic()
        if early > 0 and upstream.first_body_at is None:
            # An abort that overtakes its request at the engine matches nothing, and on vLLM
            # it can leave the request's response never ending when its repeat then stops it
            # (seen in the real suite): the call waits until the engine surely holds it.
            await asyncio.sleep(early)
        sending = engine.calls.call(request.engine_request_ids)
        at_once = engine.front_end.drops_at_once(time.monotonic())
        if at_once:
            upstream.close()  # as a plain close would: this front end misses aborts
        repeats = 0
        try:
            # The connection stays open only while the call can still confirm in time: past
            # the confirm timeout the engine gets the dropped connection whatever the call does.
            await asyncio.wait({sending}, timeout=max(confirm_by - time.monotonic(), 0))
            if not sending.done():
                upstream.close()
            call = await sending
            answered = time.monotonic()
            accepted = call.result is CallResult.ACCEPTED
            events_at_answer = request.relay.tokens.events
            window_end = answered
            blind: tuple[float, float] | None = None  # where repeats go on after the drop
            if accepted:
                self._report.accepted(answered - request.since)
                if self._faults is not None:
                    self._faults.at(ABORT_CONFIRM)
                if at_once:
                    blind = (answered + self._repeat_delay, self._repeat_delay)
                else:
                    # From when the engine has surely registered the request: an abort that
                    # overtook its request is confirmed by a repeat, not taken for a miss.
                    start = max(answered, request.registered_by)
                    window_end = min(start + engine.front_end.window(request.step), confirm_by)
                    repeats, blind = await self._wait_for_end(
                        engine, request, answered, window_end, confirm_by
                    )
            ended_at = upstream.ended_at  # when the engine ended it; never set by tether
            ended_in_time = ended_at is not None and ended_at <= window_end
            if accepted and not at_once and certainly_held(request, answered):
                repeated = repeats > 0 and self._ended_by_a_repeat(request, events_at_answer)
                if engine.front_end.confirm_outcome(
                    repeated or not ended_in_time, time.monotonic()
                ):
                    self._report.missed(request.state)
            if blind is not None:
                repeats += await self._repeat_blind(engine, request, *blind, confirm_by)
        finally:
            sending.cancel()
            upstream.close()  # never reused after a disconnect
        tokens_after = tokens_after_disconnect(request.relay)
        self._report.ended(
            request.state,
            AbortEnding(
                result=_result(call, ended_in_time, dropped_at_once=at_once),
                engine_request_ids=request.engine_request_ids,
                attempts=call.attempts,
                repeats=repeats,
                latency=answered - request.since,
                detail=call.detail,
                tokens_after_disconnect=tokens_after,
                engine_stop=ended_at - request.since if ended_at is not None else None,
                accepted=accepted,
            ),
        )
        mark_stopped(request, tokens_after)

    def _ended_by_a_repeat(self, request: StopRequest, events_at_answer: int) -> bool:
        """Whether a stream that outlived a repeat of its abort was ended by the repeat (the
        first call missed), on an engine whose steps act on a call it holds (vLLM; SGLang's
        scheduler has no such bound). A stream counts its steps in its tokens: past the
        call's answer the engine makes at most `steps` more, however long a loaded engine's
        steps take, where a front end that missed goes on at full pace until a repeat
        reaches the right process. A request with no tokens yet (queued, in prefill, not
        streaming) shows no steps, and the time its step takes is unknown (a prefill's):
        only a window that closed on it says it missed."""
        rule = request.state.engine.confirm_rule
        return (
            rule.acts_within_steps
            and request.step is not None
            and request.relay.tokens.events - events_at_answer > rule.steps
        )

    async def _wait_for_end(
        self,
        engine: _EngineAborts,
        request: StopRequest,
        answered: float,
        window_end: float,
        confirm_by: float,
    ) -> tuple[int, tuple[float, float] | None]:
        """Until the engine's response ends or the confirm window closes, then (if it goes
        on) the connection is dropped. Returns how often the call was repeated, and where
        the repeats go on after a drop (the next one's time and delay).

        An abort can overtake the request it names: vLLM registers a request a few
        milliseconds after its HTTP server got it, and an abort arriving first matches
        nothing (observed on 0.32). And in a front end with several processes it can reach
        one that does not hold the request. So while the response goes on, the call goes
        out again on a fresh connection, after TETHER_ABORT_REPEAT_DELAY and then at
        doubling intervals.
        """
        upstream = request.upstream
        window = asyncio.ensure_future(_ended_by(upstream, window_end))
        delay = self._repeat_delay
        repeat_at = answered + delay if delay > 0 else confirm_by
        repeats: list[asyncio.Future[CallOutcome]] = []
        try:
            while repeat_at < window_end:
                await asyncio.wait({window}, timeout=max(repeat_at - time.monotonic(), 0))
                if window.done():
                    break
                repeats.append(engine.repeats.call(request.engine_request_ids))
                delay *= 2
                repeat_at += delay
            await window
            if upstream.ended:
                return len(repeats), None
            upstream.close()  # the window closed on a response that goes on
            return len(repeats), (repeat_at, delay)
        finally:
            window.cancel()
            for repeat in repeats:
                repeat.cancel()

    async def _repeat_blind(
        self,
        engine: _EngineAborts,
        request: StopRequest,
        repeat_at: float,
        delay: float,
        confirm_by: float,
    ) -> int:
        """Repeats after the connection was dropped, at `repeat_at` and then at doubling
        intervals from `delay` until the confirm timeout, for an engine that notices a dropped
        connection late: a repeat reaching the process that holds the request is what stops
        it. Returns how many went out."""
        if delay <= 0:
            return 0
        repeats = 0
        while repeat_at < confirm_by:
            await asyncio.sleep(max(repeat_at - time.monotonic(), 0))
            engine.repeats.call(request.engine_request_ids).cancel()  # nobody waits for it
            repeats += 1
            delay *= 2
            repeat_at += delay
        return repeats

    async def _finish_quietly(self, request: StopRequest) -> None:
        try:
            if not await _ended_by(request.upstream, request.since + self._confirm_timeout):
                self._report.left_running(request.state)
        finally:
            request.upstream.close()
            mark_stopped(request, tokens_after_disconnect(request.relay))


def _result(call: CallOutcome, ended_in_time: bool, *, dropped_at_once: bool) -> AbortResult:
    if call.result is CallResult.ACCEPTED and dropped_at_once:
        return AbortResult.DROPPED
    if call.result is CallResult.NOT_SUPPORTED:
        return AbortResult.NOT_SUPPORTED
    if call.result is CallResult.FAILED:
        return AbortResult.FAILED
    return AbortResult.CONFIRMED if ended_in_time else AbortResult.UNCONFIRMED


async def _ended_by(upstream: UpstreamExchange, deadline: float) -> bool:
    """Whether the engine's response ended (cleanly or not) by `deadline`."""
    try:
        async with asyncio.timeout(deadline - time.monotonic()):
            await upstream.wait_ended()
    except TimeoutError:
        return False
    return True
