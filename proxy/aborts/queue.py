"""Abort calls with a bounded number in flight: when thousands of clients leave together (a
gateway restarting, a mass cancel), their aborts queue here instead of all opening
connections to the engine at the same moment (9,000 at once timed out in the benchmark).
Where the engine's abort takes a list (vLLM), the IDs of stops waiting their turn go out
together, up to `IDS_PER_CALL` per call; one call per request (SGLang, templates) gets more
in flight. No delay while the engine keeps up, fewer and larger calls when it does not."""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from enum import StrEnum

_CALLS_IN_FLIGHT = 8
_CALLS_IN_FLIGHT_UNMERGED = 32
IDS_PER_CALL = 256


class CallResult(StrEnum):
    ACCEPTED = "accepted"
    NOT_SUPPORTED = "not_supported"
    FAILED = "failed"


@dataclass(frozen=True, slots=True)
class CallOutcome:
    """What one abort call (its attempts and retries included) came to."""

    result: CallResult
    attempts: int
    detail: str


class CallQueue:
    """The abort calls of one engine profile, made `send` at a time."""

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
            while self._merges and self._waiting and len(named) < IDS_PER_CALL:
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
