"""Readiness: the engine's health endpoint, polled in the background, and the drain flag."""

from __future__ import annotations

import asyncio
from typing import Protocol

import structlog

from ..observe.metrics import Metrics
from ..upstream.client import UpstreamClient

log = structlog.get_logger("tether.health")

# One slow answer from a busy engine is not an outage: readiness is withdrawn after this many
# failed checks in a row (and restored by one good one).
FAILURES_BEFORE_NOT_READY = 2


class OnReady(Protocol):
    """Told whenever the engine's health check passes after failing (or at first)."""

    def __call__(self, *, after_outage: bool) -> None: ...


class Readiness:
    """Whether tether should receive traffic: the engine is healthy and we are not draining."""

    def __init__(
        self,
        upstream: UpstreamClient,
        interval: float,
        metrics: Metrics,
        on_ready: OnReady | None = None,
    ) -> None:
        self._upstream = upstream
        self._interval = interval
        self._metrics = metrics
        # Told `after_outage=` whenever the engine becomes ready (again).
        self._on_ready = on_ready
        self._was_ready = False
        self.engine_problem: str | None = "engine health not checked yet"
        self.draining = False

    @property
    def problem(self) -> str | None:
        """None when ready, else why not."""
        if self.draining:
            return "tether is shutting down"
        return self.engine_problem

    async def run(self) -> None:
        """Poll the engine until cancelled; log only the changes."""
        failures = 0
        while True:
            problem = await self._upstream.check_health()
            failures = 0 if problem is None else failures + 1
            ready = self.engine_problem is None
            if not ready or problem is None or failures >= FAILURES_BEFORE_NOT_READY:
                if ready != (problem is None):
                    if problem is None:
                        log.info("engine_ready")
                        if self._on_ready is not None:
                            self._on_ready(after_outage=self._was_ready)
                        self._was_ready = True
                    else:
                        log.warning("engine_not_ready", reason=problem)
                self.engine_problem = problem
                self._metrics.upstream_ready.value = 1 if problem is None else 0
            await asyncio.sleep(self._interval)
