"""Abort calls as tracked tasks: they outlive the cancelled handler that asked for them, are
retried within a deadline, and are drained before the client session closes."""

from __future__ import annotations

import asyncio
from enum import StrEnum

import aiohttp
import structlog

from .engines import AbortCall, EngineProfile
from .metrics import Metrics
from .settings import Settings
from .upstream import UpstreamClient

log = structlog.get_logger("tether.aborts")

# Statuses meaning "this engine has no such route (in this mode)": try the next candidate.
_ROUTE_MISSING = frozenset({403, 404, 405, 501})
# A missing route is remembered this long before it is tried again (the engine may restart
# with its abort endpoint enabled).
_ROUTE_RECHECK_SECONDS = 60.0
_FIRST_BACKOFF = 0.05


class AbortResult(StrEnum):
    OK = "ok"
    NOT_SUPPORTED = "not_supported"
    FAILED = "failed"


class AbortTracker:
    """Owns every abort in progress."""

    def __init__(
        self,
        settings: Settings,
        engine: EngineProfile,
        upstream: UpstreamClient,
        metrics: Metrics,
    ) -> None:
        self._engine = engine
        self._upstream = upstream
        self._metrics = metrics
        self._attempt_timeout = settings.abort_timeout
        self._deadline = settings.abort_deadline
        self._repeat_delay = settings.abort_repeat_delay
        self._tasks: set[asyncio.Task[None]] = set()
        self._missing_until: dict[str, float] = {}
        self._warned_missing = False

    def abort(
        self, path: str, internal_request_id: str, client_request_id: str, since: float
    ) -> None:
        """Ask the engine to stop `internal_request_id`, in the background.

        `since` is the loop time at which the client left, for the latency metric.
        """
        if not self._engine.sends_aborts:
            return
        calls = self._engine.abort_calls(path, internal_request_id)
        task = asyncio.get_running_loop().create_task(
            self._abort(calls, internal_request_id, client_request_id, since),
            name=f"abort-{internal_request_id}",
        )
        self._tasks.add(task)
        task.add_done_callback(self._finished)

    def _finished(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and (error := task.exception()) is not None:
            # Expected failures are results; anything raised here is a bug in tether.
            log.error("abort_crashed", exc_info=error)

    @property
    def pending(self) -> int:
        return len(self._tasks)

    async def drain(self) -> None:
        """Wait for every abort in progress (each is bounded by the abort deadline)."""
        while self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _abort(
        self,
        calls: tuple[AbortCall, ...],
        internal_request_id: str,
        client_request_id: str,
        since: float,
    ) -> None:
        loop = asyncio.get_running_loop()
        result, attempts, detail = await self._send_first_supported(calls)
        latency = loop.time() - since
        self._metrics.aborts.labels(self._engine.engine.value, result.value).inc()
        fields = {
            "internal_request_id": internal_request_id,
            "client_request_id": client_request_id,
            "result": result.value,
            "attempts": attempts,
            "latency_ms": round(latency * 1000, 2),
            "detail": detail,
        }
        if result is AbortResult.OK:
            self._metrics.abort_latency.observe(latency)
            log.info("abort_sent", **fields)
            if self._repeat_delay > 0:
                # The abort may have reached the engine before the request it names was
                # registered there (a request still in its queue); one repeat closes that gap.
                await asyncio.sleep(self._repeat_delay)
                await self._send_first_supported(calls)
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

    async def _send_first_supported(
        self, calls: tuple[AbortCall, ...]
    ) -> tuple[AbortResult, int, str]:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._deadline
        attempts = 0
        detail = "no abort route configured"
        backoff = _FIRST_BACKOFF
        candidates = [call for call in calls if self._missing_until.get(call.url, 0) <= loop.time()]
        if not candidates:
            return AbortResult.NOT_SUPPORTED, 0, "every abort route answered as missing"
        index = 0
        while index < len(candidates):
            call = candidates[index]
            remaining = deadline - loop.time()
            if remaining <= 0:
                return AbortResult.FAILED, attempts, f"deadline passed; last: {detail}"
            attempts += 1
            try:
                status = await self._upstream.send_abort(
                    call, min(self._attempt_timeout, remaining)
                )
            except (TimeoutError, aiohttp.ClientError, OSError) as exc:
                detail = f"{call.url}: {exc.__class__.__name__}: {exc}"
            else:
                if 200 <= status < 300:
                    self._missing_until.pop(call.url, None)
                    return AbortResult.OK, attempts, f"{call.url}: {status}"
                detail = f"{call.url}: {status}"
                if status in _ROUTE_MISSING:
                    self._missing_until[call.url] = loop.time() + _ROUTE_RECHECK_SECONDS
                    index += 1
                    continue
                if status < 500 and status != 429:
                    return AbortResult.FAILED, attempts, detail
            # Connection error, 5xx or 429: the same call again after a backoff.
            pause = min(backoff, deadline - loop.time())
            if pause <= 0:
                return AbortResult.FAILED, attempts, f"deadline passed; last: {detail}"
            await asyncio.sleep(pause)
            backoff *= 2
        return AbortResult.NOT_SUPPORTED, attempts, detail
