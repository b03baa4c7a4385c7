"""Stopping the engine's work for a request nobody will read, and proving that it stopped.

Each stop is a tracked task that outlives the cancelled handler. Where the engine has a
working abort route, tether calls it and keeps reading (not relaying) the engine's response
to see it end: `confirmed` rests on what the engine did, not on what tether sent. Everywhere
else, and whenever the call fails, the upstream connection is dropped at once (the engine's
other signal). What the engine produced after the client left is counted on the way.

Keeping the connection open must never cost generation a plain close would have saved. An
engine front end with several processes (vLLM with `--api-server-count` above 1, its default
for a data-parallel pod) answers 200 to an abort that reached a process not holding the
request, which then runs on, while the process that does hold it notices its own connection
close within milliseconds. So:

- the connection stays open only for the confirm window: as many engine steps as this
  engine's accepted aborts take to end a response, and no less than its HTTP side's own
  delays (its profile says; a step is measured on the stream itself, or on the engine's
  recent streams);
- past the window the connection is dropped (`unconfirmed`). Repeats of the call go out on
  fresh connections, which the kernel may give to another process (the first call goes on
  a kept-alive control connection), until TETHER_ABORT_CONFIRM_TIMEOUT: an engine that
  notices a dropped connection late (SGLang's 4 s poll for a non-streaming request, vLLM
  behind a middleware that hides it) is stopped by the repeat that reaches the right
  process. A request the engine may not have registered yet (sent moments ago, no response
  begun) gets its window only from then: an abort can overtake its request;
- once the front end has missed aborts of requests it certainly held (its response had
  begun, or it had it for long enough: two of the last eight), later stops drop the
  connection at the moment the call goes out (`dropped`), as a plain close would, for a
  minute after the last miss; one stop in sixteen still waits for its confirmation, to
  notice when misses stop.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from enum import StrEnum

import aiohttp
import structlog

from ..engines import AbortCall, ConfirmRule, EngineProfile
from ..observe.metrics import Metrics
from ..observe.tracing import RequestSpan
from ..request.state import RequestState
from ..settings import Settings
from ..upstream.client import UpstreamClient
from ..upstream.exchange import UpstreamExchange
from ..upstream.relay import ResponseRelay

log = structlog.get_logger("tether.aborts")

# A missing route is remembered this long before it is tried again (the engine may restart
# with its abort endpoint enabled).
_ROUTE_RECHECK_SECONDS = 60.0
_FIRST_BACKOFF = 0.05


class AbortResult(StrEnum):
    CONFIRMED = "confirmed"  # the engine ended the response within the confirm window
    UNCONFIRMED = "unconfirmed"  # the call was accepted, the response went on: dropped
    DROPPED = "dropped"  # the call was accepted; dropped at once (a front end that misses)
    NOT_SUPPORTED = "not_supported"  # the engine has no abort route: dropped
    UNKNOWN_ROUTE = "unknown_route"  # tether cannot name the engine's ID here: dropped
    FAILED = "failed"  # the call failed (deadline, errors, refused): dropped


class _CallResult(StrEnum):
    ACCEPTED = "accepted"
    NOT_SUPPORTED = "not_supported"
    FAILED = "failed"


CallOutcome = tuple[_CallResult, int, str]  # result, attempts, detail

# Abort calls in flight at once: when thousands of clients leave together (a gateway
# restarting, a mass cancel), their aborts queue here instead of all opening connections to
# the engine at the same moment (9,000 at once timed out in the benchmark). Where the engine's
# abort takes a list (vLLM), the IDs of stops waiting their turn go out together, up to
# _IDS_PER_CALL per call; one call per request (SGLang, templates) gets more in flight.
_CALLS_IN_FLIGHT = 8
_CALLS_IN_FLIGHT_UNMERGED = 32
_IDS_PER_CALL = 256
# Where each call names one request (SGLang), a batch's items are named this many at a time.
_CALLS_PER_UNMERGED_ABORT = 4
# Engine IDs a log line or span event names (with their count): a sample, never a batch.
LOGGED_ENGINE_IDS = 4


class _CallQueue:
    """Abort calls with a bounded number in flight, IDs merged into one call where they can
    be: no delay while the engine keeps up, fewer and larger calls when it does not."""

    def __init__(
        self, send: Callable[[tuple[str, ...]], Awaitable[CallOutcome]], merges: bool
    ) -> None:
        self._send = send
        self._merges = merges
        self._waiting: deque[tuple[tuple[str, ...], asyncio.Future[CallOutcome]]] = deque()
        self._in_flight: set[asyncio.Task[object]] = set()

    def call(self, engine_request_ids: tuple[str, ...]) -> asyncio.Future[CallOutcome]:
        """The outcome of an abort call naming `engine_request_ids`, once it was made."""
        outcome: asyncio.Future[CallOutcome] = asyncio.get_running_loop().create_future()
        self._waiting.append((engine_request_ids, outcome))
        self._start_calls()
        return outcome

    async def drain(self) -> None:
        """Until no call is in flight (a repeat nobody waits for any more included)."""
        while self._in_flight:
            await asyncio.gather(*self._in_flight, return_exceptions=True)

    def _start_calls(self) -> None:
        limit = _CALLS_IN_FLIGHT if self._merges else _CALLS_IN_FLIGHT_UNMERGED
        while self._waiting and len(self._in_flight) < limit:
            ids, waiters = self._waiting.popleft()
            named, outcomes = list(ids), [waiters]
            while self._merges and self._waiting and len(named) < _IDS_PER_CALL:
                more, waiter = self._waiting.popleft()
                named.extend(more)
                outcomes.append(waiter)
            task = asyncio.get_running_loop().create_task(self._make(tuple(named), outcomes))
            self._in_flight.add(task)

    async def _make(
        self, ids: tuple[str, ...], outcomes: list[asyncio.Future[CallOutcome]]
    ) -> None:
        try:
            result = await self._send(ids)
        except Exception as error:
            # A crash reaches every stop waiting on this call (whose task logs it).
            for outcome in outcomes:
                if not outcome.done():
                    outcome.set_exception(error)
        else:
            for outcome in outcomes:
                if not outcome.done():
                    outcome.set_result(result)
        finally:
            for outcome in outcomes:  # cancelled itself (the loop is closing)
                if not outcome.done():
                    outcome.cancel()
            task = asyncio.current_task()
            if task is not None:
                self._in_flight.discard(task)
            self._start_calls()


# What a confirm window adds to the engine's steps: the call's way back, timer resolution.
_WINDOW_MARGIN = 0.01
# Until a stream's steps were measured: a step this long.
_DEFAULT_STEP = 0.02
# The front end misses aborts when this many of the last _OUTCOMES stops that waited to
# confirm (of requests it certainly held) missed: one slow confirmation is not a pattern.
_MISSES = 2
_OUTCOMES = 8
_DROP_MODE_SECONDS = 60.0
_SAMPLE_EVERY = 16


class FrontEnd:
    """What tether has learnt of the engine's front end: how long a step takes (from the
    streams it relayed), and whether it misses aborts (several processes behind one port)."""

    __slots__ = ("_cap", "_drop_until", "_outcomes", "_rule", "_stops", "step")

    def __init__(self, rule: ConfirmRule, cap: float) -> None:
        self._rule = rule
        self._cap = cap
        self.step = _DEFAULT_STEP
        self._outcomes: deque[bool] = deque(maxlen=_OUTCOMES)
        self._drop_until = 0.0
        self._stops = 0

    def note_step(self, seconds: float) -> None:
        """A stream's step, measured when its client left (a moving average)."""
        self.step += 0.25 * (seconds - self.step)

    def window(self, step: float | None) -> float:
        """The confirm window for a request whose own step is `step` (None: not measured)."""
        steps = self._rule.steps * (step if step is not None else self.step) + _WINDOW_MARGIN
        return min(max(steps, self._rule.floor), self._cap)

    def confirm_outcome(self, missed: bool, now: float) -> bool:
        """A stop that waited to confirm an abort of a request the engine held ended (its first
        call `missed` or not). True when that starts the drop mode."""
        self._outcomes.append(missed)
        if not missed or sum(self._outcomes) < _MISSES:
            return False
        starts = now >= self._drop_until
        self._drop_until = now + _DROP_MODE_SECONDS
        return starts

    def drops_at_once(self, now: float) -> bool:
        """Whether this stop drops the connection when its call goes out (every sixteenth
        waits to confirm, so a front end that stopped missing is noticed)."""
        if now >= self._drop_until:
            return False
        self._stops += 1
        return self._stops % _SAMPLE_EVERY != 0


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


def _certainly_held(request: StopRequest, answered: float) -> bool:
    """Whether the engine held the request when the abort call reached it, so that its
    outcome says whether the front end misses: its response had begun, or it was sent long
    enough before the client left (`registered_by`) plus the front end's lag, which shows in
    how long the call took to answer. A loaded API server takes longer to register a request
    than an abort call takes to overtake it (observed on one vLLM API server at the start of
    a 100-client burst: calls answered in 20-60 ms matched requests not yet registered)."""
    if request.upstream.first_body_at is not None:
        return True
    return request.registered_by + (answered - request.since) <= request.since


@dataclass(slots=True)
class _EngineAborts:
    """What the tracker keeps per engine profile (the engine tether fronts may say what it
    is only after the first requests): its call queues and what it learnt of its front end."""

    engine: EngineProfile
    calls: _CallQueue
    # Repeats go out on fresh connections: a front end with several processes gets each on
    # whichever process accepts it, not always the one that missed.
    repeats: _CallQueue
    front_end: FrontEnd


class AbortTracker:
    """Owns every stop in progress."""

    def __init__(self, settings: Settings, upstream: UpstreamClient, metrics: Metrics) -> None:
        self._upstream = upstream
        self._metrics = metrics
        self._attempt_timeout = settings.abort_timeout
        self._deadline = settings.abort_deadline
        self._repeat_delay = settings.abort_repeat_delay
        self._confirm_timeout = settings.abort_confirm_timeout
        self._tasks: set[asyncio.Task[None]] = set()
        self._missing_until: dict[str, float] = {}
        self._warned_missing = False
        self._engines: dict[str, _EngineAborts] = {}

    def _of(self, engine: EngineProfile) -> _EngineAborts:
        known = self._engines.get(engine.engine)
        if known is None or known.engine is not engine:
            known = self._engines[engine.engine] = _EngineAborts(
                engine,
                _CallQueue(functools.partial(self._send, engine), merges=engine.merges_aborts),
                _CallQueue(
                    functools.partial(self._send, engine, fresh=True), merges=engine.merges_aborts
                ),
                FrontEnd(engine.confirm_rule, self._confirm_timeout),
            )
        return known

    # --- entry points ----------------------------------------------------------------------

    def stop(self, request: StopRequest) -> bool:
        """Stop the engine's work for `request`: abort and confirm where the engine allows,
        else drop the connection at once. Returns at once, True when the rest runs in the
        background (which then ends the request's span)."""
        request.relay.discard()
        engine = request.state.engine
        if not engine.sends_aborts:
            request.upstream.close()
            return False
        if not request.engine_request_ids:
            request.upstream.close()
            self._count(engine, AbortResult.UNKNOWN_ROUTE, request.span)
            log.debug(
                "abort_not_possible",
                reason=AbortResult.UNKNOWN_ROUTE.value,
                route=request.state.route_label,
                consequence="the dropped upstream connection is the only abort signal",
            )
            return False
        # Which routes are missing does not depend on the IDs: the first stands for all.
        if not self._candidates(engine.abort_calls(request.engine_request_ids[:1])):
            request.upstream.close()  # every abort route answered as missing, recently
            self._count(engine, AbortResult.NOT_SUPPORTED, request.span)
            return False
        if request.step is not None:
            self._of(engine).front_end.note_step(request.step)
        self._track(self._abort_and_confirm(request), request)
        return True

    def let_finish(self, request: StopRequest) -> bool:
        """A request that must outlive its client (`background: true`): read its response to
        the end, bounded by the confirm timeout, without aborting it."""
        request.relay.discard()
        self._track(self._finish_quietly(request), request)
        return True

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

    # --- the background work -------------------------------------------------------------------

    def _track(self, work: object, request: StopRequest) -> None:
        assert asyncio.iscoroutine(work)
        name = f"stop-{request.state.internal_request_id}"
        task = asyncio.get_running_loop().create_task(work, name=name)
        self._tasks.add(task)
        task.add_done_callback(functools.partial(self._finished, request))

    def _finished(self, request: StopRequest, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and (error := task.exception()) is not None:
            # Expected failures are results; anything raised here is a bug in tether.
            log.error("abort_crashed", exc_info=error)
        if not request.stopped:  # a stop that crashed still reports its request
            _stopped(request, None)

    async def _abort_and_confirm(self, request: StopRequest) -> None:
        upstream = request.upstream
        confirm_by = request.since + self._confirm_timeout
        engine = self._of(request.state.engine)
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
            outcome, attempts, detail = await sending
            answered = time.monotonic()
            events_at_answer = request.relay.tokens.events
            window_end = answered
            # The next repeat and its delay, where repeats go on blind after the drop.
            blind: tuple[float, float] | None = None
            if outcome is _CallResult.ACCEPTED:
                self._metrics.abort_latency.observe(answered - request.since)
                if at_once:
                    blind = (answered + self._repeat_delay, self._repeat_delay)
                else:
                    # From when the engine has surely registered the request: an abort that
                    # overtook its request is confirmed by a repeat, not taken for a miss.
                    start = max(answered, request.registered_by)
                    window_end = min(start + engine.front_end.window(request.step), confirm_by)
                    repeats, blind = await self._wait_for_end(
                        request, answered, window_end, confirm_by
                    )
            ended_at = upstream.ended_at  # when the engine ended it; never set by tether
            ended_in_time = ended_at is not None and ended_at <= window_end
            if (
                outcome is _CallResult.ACCEPTED
                and not at_once
                and _certainly_held(request, answered)
            ):
                repeated = repeats > 0 and self._ended_by_a_repeat(request, events_at_answer)
                self._note_outcome(request, missed=repeated or not ended_in_time)
            if blind is not None:
                repeats += await self._repeat_blind(request, *blind, confirm_by)
        finally:
            sending.cancel()
            upstream.close()  # never reused after a disconnect
        result = (
            AbortResult.DROPPED
            if at_once and outcome is _CallResult.ACCEPTED
            else self._result(outcome, ended_in_time)
        )
        self._count(engine.engine, result, request.span)
        tokens_after = _tokens_after_disconnect(request.relay)
        if outcome is _CallResult.ACCEPTED:
            self._metrics.record_tokens_after_disconnect(request.state.route_label, tokens_after)
        latency_ms = round((answered - request.since) * 1000, 2)
        named = request.engine_request_ids
        fields: dict[str, object] = {
            "internal_request_id": request.state.internal_request_id,
            "client_request_id": request.state.client_request_id,
            # A batch names many: a sample of them and their count, never the whole list.
            "engine_request_ids": list(named[:LOGGED_ENGINE_IDS]),
            "engine_request_count": len(named),
            "result": result.value,
            "attempts": attempts,
            "repeats": repeats,
            "latency_ms": latency_ms,
            "detail": detail,
        }
        span = request.span
        if span is not None:
            span.event(
                "abort_sent",
                engine_request_ids=",".join(named[:LOGGED_ENGINE_IDS]),
                engine_request_count=len(named),
                attempts=attempts,
                latency_ms=latency_ms,
            )
            span.set(tokens_after_disconnect=tokens_after)
        if result is AbortResult.CONFIRMED:
            assert ended_at is not None
            stop_seconds = ended_at - request.since
            self._metrics.engine_stop.observe(stop_seconds)
            if span is not None:
                span.event(
                    "abort_confirmed",
                    engine_stop_ms=round(stop_seconds * 1000, 2),
                    tokens_after_disconnect=tokens_after,
                )
                span.set(engine_stop_ms=round(stop_seconds * 1000, 2))
            log.info(
                "abort_sent",
                **fields,
                engine_stop_ms=round(stop_seconds * 1000, 2),
                tokens_after_disconnect=tokens_after,
            )
        elif result is AbortResult.DROPPED:
            log.info(
                "abort_sent",
                **fields,
                tokens_after_disconnect=tokens_after,
                consequence="dropped at once: this engine's front end misses aborts",
            )
        elif result is AbortResult.UNCONFIRMED:
            log.warning(
                "abort_sent",
                **fields,
                tokens_after_disconnect=tokens_after,
                consequence="the engine's response did not end in time; connection dropped",
            )
        elif result is AbortResult.NOT_SUPPORTED:
            if not self._warned_missing:
                self._warned_missing = True
                log.warning(
                    "abort_route_missing",
                    detail=detail,
                    consequence="the dropped upstream connection is the only abort signal",
                )
            log.debug("abort_not_supported", **fields)
        else:
            log.warning("abort_failed", **fields)
        _stopped(request, tokens_after)

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
        self, request: StopRequest, answered: float, window_end: float, confirm_by: float
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
                repeats.append(
                    self._of(request.state.engine).repeats.call(request.engine_request_ids)
                )
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

    def _note_outcome(self, request: StopRequest, *, missed: bool) -> None:
        """An abort of a request the engine held did, or did not, end its response within the
        window; a pattern of misses is a front end with several processes (or one that
        ignores aborts)."""
        if self._of(request.state.engine).front_end.confirm_outcome(missed, time.monotonic()):
            log.warning(
                "aborts_missed",
                internal_request_id=request.state.internal_request_id,
                consequence="the engine answered aborts that did not stop their requests "
                "(several API-server processes behind one port?): for the next minute tether "
                "drops the connection as it sends the abort, as a plain close would",
            )

    async def _repeat_blind(
        self, request: StopRequest, repeat_at: float, delay: float, confirm_by: float
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
            repeat = self._of(request.state.engine).repeats.call(request.engine_request_ids)
            repeat.cancel()  # nobody waits for it
            repeats += 1
            delay *= 2
            repeat_at += delay
        return repeats

    async def _finish_quietly(self, request: StopRequest) -> None:
        try:
            if not await _ended_by(request.upstream, request.since + self._confirm_timeout):
                log.info(
                    "background_request_left_running",
                    internal_request_id=request.state.internal_request_id,
                    reason="background: true; its response did not end in time",
                )
        finally:
            request.upstream.close()
            _stopped(request, _tokens_after_disconnect(request.relay))

    # --- the abort call ----------------------------------------------------------------------

    def _candidates(self, calls: tuple[AbortCall, ...]) -> tuple[AbortCall, ...]:
        now = time.monotonic()
        return tuple(call for call in calls if self._missing_until.get(call.url, 0) <= now)

    async def _send(
        self, engine: EngineProfile, engine_request_ids: tuple[str, ...], fresh: bool = False
    ) -> CallOutcome:
        """One abort naming these IDs, on the first route the engine supports; one per ID,
        made together, where the engine's abort names a single request (an SGLang batch)."""
        if len(engine_request_ids) == 1 or engine.merges_aborts:
            return await self._send_naming(engine, engine_request_ids, fresh)
        # A few at a time: a batch's abort never holds more than a few engine connections.
        outcomes: list[CallOutcome] = []
        for start in range(0, len(engine_request_ids), _CALLS_PER_UNMERGED_ABORT):
            outcomes += await asyncio.gather(
                *(
                    self._send_naming(engine, (engine_request_id,), fresh)
                    for engine_request_id in engine_request_ids[
                        start : start + _CALLS_PER_UNMERGED_ABORT
                    ]
                )
            )
        attempts = sum(attempts for _, attempts, _ in outcomes)
        # Accepted only if every call was; else the first that was not says why.
        result, _, detail = next(
            (outcome for outcome in outcomes if outcome[0] is not _CallResult.ACCEPTED),
            outcomes[0],
        )
        return result, attempts, detail

    async def _send_naming(
        self, engine: EngineProfile, engine_request_ids: tuple[str, ...], fresh: bool
    ) -> CallOutcome:
        calls = self._candidates(engine.abort_calls(engine_request_ids))
        if not calls:
            return _CallResult.NOT_SUPPORTED, 0, "every abort route answered as missing"
        return await self._send_first_supported(calls, engine.route_missing_statuses, fresh)

    async def _send_first_supported(
        self, calls: tuple[AbortCall, ...], route_missing: frozenset[int], fresh: bool
    ) -> CallOutcome:
        deadline = time.monotonic() + self._deadline
        attempts = 0
        detail = "no abort route configured"
        backoff = _FIRST_BACKOFF
        index = 0
        while index < len(calls):
            call = calls[index]
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return _CallResult.FAILED, attempts, f"deadline passed; last: {detail}"
            attempts += 1
            try:
                status = await self._upstream.send_abort(
                    call, min(self._attempt_timeout, remaining), fresh=fresh
                )
            except (TimeoutError, aiohttp.ClientError, OSError) as exc:
                detail = f"{call.url}: {exc.__class__.__name__}"
            else:
                if 200 <= status < 300:
                    self._missing_until.pop(call.url, None)
                    return _CallResult.ACCEPTED, attempts, f"{call.url}: {status}"
                detail = f"{call.url}: {status}"
                if status in route_missing:
                    self._missing_until[call.url] = time.monotonic() + _ROUTE_RECHECK_SECONDS
                    index += 1
                    continue
                if status < 500 and status != 429:
                    return _CallResult.FAILED, attempts, detail
            # Connection error, 5xx or 429: the same call again after a backoff.
            pause = min(backoff, deadline - time.monotonic())
            if pause <= 0:
                return _CallResult.FAILED, attempts, f"deadline passed; last: {detail}"
            await asyncio.sleep(pause)
            backoff *= 2
        return _CallResult.NOT_SUPPORTED, attempts, detail

    # --- accounting ----------------------------------------------------------------------------

    @staticmethod
    def _result(outcome: _CallResult, ended_in_time: bool) -> AbortResult:
        if outcome is _CallResult.NOT_SUPPORTED:
            return AbortResult.NOT_SUPPORTED
        if outcome is _CallResult.FAILED:
            return AbortResult.FAILED
        return AbortResult.CONFIRMED if ended_in_time else AbortResult.UNCONFIRMED

    def _count(self, engine: EngineProfile, result: AbortResult, span: RequestSpan | None) -> None:
        self._metrics.count_abort(engine.engine, result.value)
        if span is not None:
            span.set(abort_result=result.value)


def _stopped(request: StopRequest, tokens_after: int | None) -> None:
    """The engine's work for `request` has stopped: its ending can be reported."""
    request.stopped = True
    request.tokens_after_disconnect = tokens_after
    if request.on_stopped is not None:
        request.on_stopped(tokens_after)


async def _ended_by(upstream: UpstreamExchange, deadline: float) -> bool:
    """Whether the engine's response ended (cleanly or not) by `deadline`."""
    try:
        async with asyncio.timeout(deadline - time.monotonic()):
            await upstream.wait_ended()
    except TimeoutError:
        return False
    return True


def _tokens_after_disconnect(relay: ResponseRelay) -> int:
    """Tokens the engine produced after the client left: the engine's own count less what the
    client received where it reported one, else the token-carrying events read since."""
    relayed = relay.tokens_relayed or 0
    reported = relay.tokens.reported()
    if reported is not None and reported >= relayed:
        return reported - relayed
    return max(relay.tokens.events - relayed, 0)
