"""What every handler needs for the app's lifetime, created in the app's cleanup context."""

from __future__ import annotations

from dataclasses import dataclass

import structlog
from aiohttp import web

from ..aborts.tracker import AbortTracker
from ..engines import EngineProfile
from ..faults import Faults
from ..observe.metrics import Metrics
from ..request.accounting import Accounting
from ..request.engine_slots import EngineSlots
from ..request.registry import Registry
from ..settings import Settings
from ..upstream.client import UpstreamClient
from ..wire.callers import Callers
from ..wire.event_log import HeldBytes
from ..wire.ids import IdMinter
from .engine_identity import EngineIdentity
from .fleet import Fleet
from .health import Readiness

log = structlog.get_logger("tether.usage")


class UsageAsking:
    """Whether tether asks the engine for the usage of streams whose client did not
    (TETHER_ASK_FOR_USAGE): until the engine shows it reports usage on every stream by itself,
    where asking would only have tether take out events its clients get anyway."""

    __slots__ = ("enabled",)

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled

    def engine_reports_usage(self) -> None:
        if self.enabled:
            self.enabled = False
            log.info(
                "engine_reports_usage",
                consequence="the engine puts usage in every stream by itself: tether stops "
                "asking for it and reads it from there",
            )


@dataclass(frozen=True, slots=True)
class ProxyContext:
    settings: Settings
    # Which engine answers, and the profile requests are served with (it may change once
    # the engine says what it is): `engine`.
    identity: EngineIdentity
    upstream: UpstreamClient
    aborts: AbortTracker
    registry: Registry
    metrics: Metrics
    accounting: Accounting  # reports each request's ending (with tracing: its span too)
    readiness: Readiness
    fleet: Fleet
    ids: IdMinter
    callers: Callers  # the keyed hash of a request's credential: who may cancel it
    usage: UsageAsking
    # The bytes streams hold for resumes (TETHER_RESUME_GRACE); None: resume is off.
    resume_budget: HeldBytes | None
    faults: Faults | None  # a test's failures at named points; None in production

    @property
    def slots(self) -> EngineSlots:
        """The engine's slots, where tether counts them (TETHER_ENGINE_SLOTS)."""
        return self.identity.slots

    @property
    def engine(self) -> EngineProfile:
        """The profile a request arriving now is served with."""
        return self.identity.profile


CONTEXT = web.AppKey("tether_context", ProxyContext)
