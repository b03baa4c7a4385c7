"""The abort call itself: the first of an engine's abort routes that it supports, retried with
backoff on connection errors, 5xx and 429 within TETHER_ABORT_DEADLINE; a route the engine
answers as missing is remembered for a minute (it may restart with its abort endpoint on)."""

from __future__ import annotations

import asyncio
import time

from ..engines import AbortCall, EngineProfile
from ..upstream.client import UpstreamClient
from .queue import CallOutcome, CallResult

# A missing route is remembered this long before it is tried again.
_ROUTE_RECHECK_SECONDS = 60.0
_FIRST_BACKOFF = 0.05
# Where each call names one request (SGLang), a batch's items are named this many at a time:
# a batch's abort never holds more than a few engine connections.
CALLS_PER_UNMERGED_ABORT = 4


class AbortCalls:
    """Makes abort calls to the engine and remembers which of its routes are missing."""

    def __init__(self, upstream: UpstreamClient, attempt_timeout: float, deadline: float) -> None:
        self._upstream = upstream
        self._attempt_timeout = attempt_timeout
        self._deadline = deadline
        self._missing_until: dict[str, float] = {}

    def supported(self, engine: EngineProfile, engine_request_ids: tuple[str, ...]) -> bool:
        """Whether any of the engine's abort routes may be there (none answered as missing
        within the last minute). Which are missing does not depend on the IDs: the first
        stands for all."""
        return bool(self._candidates(engine.abort_calls(engine_request_ids[:1])))

    async def send(
        self, engine: EngineProfile, engine_request_ids: tuple[str, ...], fresh: bool = False
    ) -> CallOutcome:
        """One abort naming these IDs, on the first route the engine supports (on a new
        connection when `fresh`); one per ID, a few at a time, where the engine's abort names
        a single request (an SGLang batch)."""
        if len(engine_request_ids) == 1 or engine.merges_aborts:
            return await self._send_naming(engine, engine_request_ids, fresh)
        outcomes: list[CallOutcome] = []
        for start in range(0, len(engine_request_ids), CALLS_PER_UNMERGED_ABORT):
            some = engine_request_ids[start : start + CALLS_PER_UNMERGED_ABORT]
            outcomes += await asyncio.gather(
                *(self._send_naming(engine, (one,), fresh) for one in some)
            )
        attempts = sum(outcome.attempts for outcome in outcomes)
        # Accepted only if every call was; else the first that was not says why.
        first = next(
            (outcome for outcome in outcomes if outcome.result is not CallResult.ACCEPTED),
            outcomes[0],
        )
        return CallOutcome(first.result, attempts, first.detail)

    def _candidates(self, calls: tuple[AbortCall, ...]) -> tuple[AbortCall, ...]:
        now = time.monotonic()
        return tuple(call for call in calls if self._missing_until.get(call.url, 0) <= now)

    async def _send_naming(
        self, engine: EngineProfile, engine_request_ids: tuple[str, ...], fresh: bool
    ) -> CallOutcome:
        calls = self._candidates(engine.abort_calls(engine_request_ids))
        if not calls:
            return CallOutcome(CallResult.NOT_SUPPORTED, 0, "every abort route answered as missing")
        deadline = time.monotonic() + self._deadline
        attempts = 0
        detail = "no abort route configured"
        backoff = _FIRST_BACKOFF
        index = 0
        while index < len(calls):
            call = calls[index]
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return CallOutcome(CallResult.FAILED, attempts, f"deadline passed; last: {detail}")
            attempts += 1
            answer = await self._upstream.send_abort(
                call, min(self._attempt_timeout, remaining), fresh=fresh
            )
            status = answer.status
            detail = f"{call.url}: {status if status is not None else answer.failure}"
            if status is not None:
                if 200 <= status < 300:
                    self._missing_until.pop(call.url, None)
                    return CallOutcome(CallResult.ACCEPTED, attempts, detail)
                if status in engine.route_missing_statuses:
                    self._missing_until[call.url] = time.monotonic() + _ROUTE_RECHECK_SECONDS
                    index += 1
                    continue
                if status < 500 and status != 429:
                    return CallOutcome(CallResult.FAILED, attempts, detail)
            # No answer, 5xx or 429: the same call again after a backoff.
            pause = min(backoff, deadline - time.monotonic())
            if pause <= 0:
                return CallOutcome(CallResult.FAILED, attempts, f"deadline passed; last: {detail}")
            await asyncio.sleep(pause)
            backoff *= 2
        return CallOutcome(CallResult.NOT_SUPPORTED, attempts, detail)
