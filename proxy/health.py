"""Readiness: the engine's health endpoint, polled in the background, and the drain flag."""

from __future__ import annotations

import asyncio

import structlog

from .metrics import Metrics
from .upstream import UpstreamClient

log = structlog.get_logger("tether.health")


class Readiness:
    """Whether tether should receive traffic: the engine is healthy and we are not draining."""

    def __init__(self, upstream: UpstreamClient, interval: float, metrics: Metrics) -> None:
        self._upstream = upstream
        self._interval = interval
        self._metrics = metrics
        self.engine_problem: str | None = "engine health not checked yet"
        self.draining = False
        self._checked = asyncio.Event()

    @property
    def problem(self) -> str | None:
        """None when ready, else why not."""
        if self.draining:
            return "tether is shutting down"
        return self.engine_problem

    async def wait_checked(self) -> None:
        """Until the first health check has answered (either way)."""
        await self._checked.wait()

    async def run(self) -> None:
        """Poll the engine until cancelled; log only the changes."""
        while True:
            problem = await self._upstream.check_health()
            if problem != self.engine_problem:
                if problem is None:
                    log.info("engine_ready")
                else:
                    log.warning("engine_not_ready", reason=problem)
            self.engine_problem = problem
            self._metrics.upstream_ready.set(1 if problem is None else 0)
            self._checked.set()
            await asyncio.sleep(self._interval)
