"""How a stop of the engine's work is reported, beside the request's own report
(`accounting`): the abort metrics, the span's events and one log line, whichever way the stop
ended. The abort tracker decides; this module only says what it decided.

A batch names many engine requests: log lines and span events carry a sample of them and
their count, never the whole list."""

from __future__ import annotations

from dataclasses import dataclass

import structlog

from ..observe.metrics import Metrics
from ..outcomes import AbortResult
from .state import RequestState

log = structlog.get_logger("tether.aborts")

# Engine IDs a log line or span event names (with their count): a sample, never a batch.
LOGGED_ENGINE_IDS = 4


@dataclass(frozen=True, slots=True)
class AbortEnding:
    """How one stop that called the engine's abort ended."""

    result: AbortResult
    engine_request_ids: tuple[str, ...]
    attempts: int
    repeats: int
    latency: float  # from the client's leaving to the call's answer (or giving up)
    detail: str
    tokens_after_disconnect: int
    # From the client's leaving to the end of the engine's response, for a confirmed stop.
    engine_stop: float | None
    accepted: bool  # the engine accepted the call (whatever then happened)


class AbortReport:
    """Reports stops: one per app."""

    __slots__ = ("_metrics", "_warned_missing")

    def __init__(self, metrics: Metrics) -> None:
        self._metrics = metrics
        self._warned_missing = False

    def without_call(self, state: RequestState, result: AbortResult) -> None:
        """No call could name the request (`unknown_route`), or the engine has no abort route
        (`not_supported`): the dropped connection is the stop."""
        self._count(state, result)
        if result is AbortResult.UNKNOWN_ROUTE:
            log.debug(
                "abort_not_possible",
                reason=result.value,
                route=state.route_label,
                consequence="the dropped upstream connection is the only abort signal",
            )

    def accepted(self, seconds: float) -> None:
        """The engine accepted an abort call this long after the client left."""
        self._metrics.abort_latency.observe(seconds)

    def ended(self, state: RequestState, ending: AbortEnding) -> None:
        """A stop that called the engine ended: its result counted, its span's events, and
        one log line at the level its result deserves."""
        result, tokens_after = ending.result, ending.tokens_after_disconnect
        self._count(state, result)
        if ending.accepted:
            self._metrics.record_tokens_after_disconnect(state.route_label, tokens_after)
        named = ending.engine_request_ids
        latency_ms = round(ending.latency * 1000, 2)
        fields: dict[str, object] = {
            "internal_request_id": state.internal_request_id,
            "client_request_id": state.client_request_id,
            "engine_request_ids": list(named[:LOGGED_ENGINE_IDS]),
            "engine_request_count": len(named),
            "result": result.value,
            "attempts": ending.attempts,
            "repeats": ending.repeats,
            "latency_ms": latency_ms,
            "detail": ending.detail,
            "tokens_after_disconnect": tokens_after,
        }
        span = state.span
        if span is not None:
            span.event(
                "abort_sent",
                engine_request_ids=",".join(named[:LOGGED_ENGINE_IDS]),
                engine_request_count=len(named),
                attempts=ending.attempts,
                latency_ms=latency_ms,
            )
            span.set(tokens_after_disconnect=tokens_after)
        if result is AbortResult.CONFIRMED:
            assert ending.engine_stop is not None
            self._metrics.engine_stop.observe(ending.engine_stop)
            stop_ms = round(ending.engine_stop * 1000, 2)
            if span is not None:
                span.event(
                    "abort_confirmed", engine_stop_ms=stop_ms, tokens_after_disconnect=tokens_after
                )
                span.set(engine_stop_ms=stop_ms)
            log.info("abort_sent", **fields, engine_stop_ms=stop_ms)
        elif result is AbortResult.DROPPED:
            log.info(
                "abort_sent",
                **fields,
                consequence="dropped at once: this engine's front end misses aborts",
            )
        elif result is AbortResult.UNCONFIRMED:
            log.warning(
                "abort_sent",
                **fields,
                consequence="the engine's response did not end in time; connection dropped",
            )
        elif result is AbortResult.NOT_SUPPORTED:
            if not self._warned_missing:
                self._warned_missing = True
                log.warning(
                    "abort_route_missing",
                    detail=ending.detail,
                    consequence="the dropped upstream connection is the only abort signal",
                )
            log.debug("abort_not_supported", **fields)
        else:
            log.warning("abort_failed", **fields)

    def missed(self, state: RequestState) -> None:
        """The engine's front end began to miss aborts (the tracker drops at once for a
        while)."""
        log.warning(
            "aborts_missed",
            internal_request_id=state.internal_request_id,
            consequence="the engine answered aborts that did not stop their requests "
            "(several API-server processes behind one port?): for the next minute tether "
            "drops the connection as it sends the abort, as a plain close would",
        )

    def crashed(self, state: RequestState, error: BaseException) -> None:
        """A stop raised: expected failures are results, so this is a bug in tether."""
        log.error("abort_crashed", internal_request_id=state.internal_request_id, exc_info=error)

    def left_running(self, state: RequestState) -> None:
        """A request meant to outlive its client did not end within the confirm timeout."""
        log.info(
            "background_request_left_running",
            internal_request_id=state.internal_request_id,
            reason="background: true; its response did not end in time",
        )

    def _count(self, state: RequestState, result: AbortResult) -> None:
        state.stop_result = result
        self._metrics.count_abort(state.engine.engine, result.value)
        if state.span is not None:
            state.span.set(abort_result=result.value)
