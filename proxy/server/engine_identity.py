"""Which engine tether fronts, and the profile it serves it with.

With TETHER_ENGINE=auto (the default) tether asks the engine what it is (`engines.identify`:
plain GETs of routes that leak nothing) at start-up and whenever the engine comes back after
being unreachable, and serves it with the profile of what answered; until an answer names a
known engine, and for one that never does, with the `auto` profile, which is safe in front of
any engine. A configured TETHER_ENGINE is asked about the same way: it still decides, but an
engine that says it is another is a warning at start-up, in readiness and in
`tether_engine_info`, never trusted silently.

Every request takes the profile in force when it arrived and keeps it to its end (its abort
included), so a change never mixes two engines' rules in one request.
"""

from __future__ import annotations

import asyncio
import contextlib

import structlog

from ..engines import EngineProfile, asks_engine, contradiction, engine_profile, served_engine
from ..engines.identify import PROBE_PATHS, Identity, identify
from ..observe.metrics import Metrics
from ..request.engine_slots import EngineSlots
from ..settings import OFF, Settings
from ..upstream.client import UpstreamClient

log = structlog.get_logger("tether.engine")

UNKNOWN = "unknown"


class EngineIdentity:
    """The engine's identity as last asked, and the profile requests are served with."""

    def __init__(self, settings: Settings, upstream: UpstreamClient, metrics: Metrics) -> None:
        self._settings = settings
        self._upstream = upstream
        self._metrics = metrics
        self.configured = settings.engine
        self.profile: EngineProfile = engine_profile(settings)
        self.identity: Identity | None = None
        self.asked = False  # an answer (or the lack of one) has been read at least once
        # A configured engine that the engine's own answer contradicts.
        self.mismatch: str | None = None
        self._asking: asyncio.Task[None] | None = None
        # The engine's slots, where tether keeps the requests beyond them waiting itself.
        self.slots = EngineSlots(metrics.engine_queue, metrics.engine_slots)
        self.slots.resize(self._slot_count())
        self._show()

    async def ask(self) -> None:
        """Ask the engine what it is, and serve it accordingly."""
        answers = {}
        found = None
        for path in PROBE_PATHS:
            document = await self._upstream.probe(path)
            if document is not None:
                answers[path] = document
                found = identify(answers)
                if found is not None:
                    break
        if not answers and self.identity is not None:
            return  # gone again before it answered: what it said last still stands
        self._learnt(found)

    def engine_ready(self, *, after_outage: bool) -> None:
        """The engine's health check passes (again): ask what it is where it may have
        changed (it was unreachable in between) or never said."""
        if after_outage or self.identity is None:
            self.ask_again()

    def ask_again(self) -> None:
        """The engine answers again after it could not be reached (started, restarted, maybe
        replaced): ask it what it is, in the background."""
        if self._asking is None or self._asking.done():
            self._asking = asyncio.get_running_loop().create_task(self.ask(), name="identify")

    async def close(self) -> None:
        if self._asking is not None:
            self._asking.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._asking

    def describe(self) -> dict[str, str | None]:
        """For readiness: what is configured, what answered, and any contradiction."""
        identity = self.identity
        return {
            "configured": self.configured.value,
            "identified": identity.product if identity is not None else UNKNOWN,
            "version": identity.version if identity is not None else None,
            "profile": self.profile.engine,
            "warning": self.mismatch,
        }

    def _learnt(self, identity: Identity | None) -> None:
        first, changed = not self.asked, identity != self.identity
        self.asked = True
        self.identity = identity
        if not (first or changed):
            return
        served = served_engine(self._settings, identity)
        if served != self.profile.engine:
            self.profile = engine_profile(self._settings, served)
        self.mismatch = contradiction(self._settings, identity)
        self.slots.resize(self._slot_count())
        if identity is None:
            log.warning(
                "engine_not_identified",
                asked=",".join(PROBE_PATHS),
                profile=self.profile.engine,
                consequence="every known engine's control routes are refused and the dropped "
                "connection is the only stop; set TETHER_ENGINE to name this engine"
                if asks_engine(self._settings)
                else f"TETHER_ENGINE={self.configured.value} is used as configured",
            )
        else:
            log.info(
                "engine_identified",
                engine=identity.product,
                version=identity.version,
                how=identity.evidence,
                profile=self.profile.engine,
                slots=identity.slots,
            )
        if self.mismatch is not None:
            log.warning("engine_mismatch", detail=self.mismatch)
        self._show()

    def _slot_count(self) -> int | None:
        """How many requests tether lets the engine have at once (TETHER_ENGINE_SLOTS), where
        its profile says its own queue is blind to clients leaving; None: no limit."""
        setting = self._settings.engine_slots
        if setting == OFF or not self.profile.blind_while_queued:
            return None
        if isinstance(setting, int):
            return setting
        return self.identity.slots if self.identity is not None else None

    def _show(self) -> None:
        identity = self.identity
        self._metrics.engine_info.labels = (
            self.configured.value,
            identity.product if identity is not None else UNKNOWN,
            (identity.version or "") if identity is not None else "",
            self.profile.engine,
        )
