"""What every handler needs for the app's lifetime, created in the app's cleanup context."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

import structlog
from aiohttp import web

from ..aborts.tracker import AbortTracker
from ..engines import EngineProfile, Route
from ..faults import Faults
from ..observe.metrics import Metrics, route_label
from ..request.accounting import Accounting
from ..request.engine_slots import EngineSlots
from ..request.registry import Registry
from ..settings import Settings
from ..upstream.client import UpstreamClient
from ..wire.callers import Callers
from ..wire.event_log import HeldBytes
from ..wire.headers import EngineHeads
from ..wire.ids import IdMinter
from ..wire.routes import is_allowed, is_blocked
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


# What the refusal checks decide about a path (`PathChecks.verdict`).
PATH_FORWARDED = 0
PATH_BLOCKED = 1  # an engine control route
PATH_NOT_ALLOWED = 2  # not on the allowlist (TETHER_ALLOWED_PATHS)
# Paths remembered: clients use a handful; a longer or a further one is checked each time.
_REMEMBERED_PATH_LENGTH = 512
_REMEMBERED_PATHS = 1024


class PathChecks:
    """The control-route and allowlist checks' verdict on each client path, remembered for
    the engine profile in force, so they run once per path rather than once per request (a
    new profile, once the engine says what it is, starts afresh)."""

    __slots__ = ("_engine", "_verdicts")

    def __init__(self) -> None:
        self._engine: EngineProfile | None = None
        self._verdicts: dict[str, int] = {}

    def verdict(self, raw_path: str, engine: EngineProfile) -> int:
        """`PATH_FORWARDED`, `PATH_BLOCKED` or `PATH_NOT_ALLOWED` for `raw_path` (without
        its query) in front of `engine`."""
        if engine is not self._engine:
            self._engine = engine
            self._verdicts = {}
        verdicts = self._verdicts
        verdict = verdicts.get(raw_path)
        if verdict is not None:
            return verdict
        if is_blocked(raw_path, engine.blocked_paths):
            verdict = PATH_BLOCKED
        elif engine.allowed_paths is not None and not is_allowed(raw_path, engine.allowed_paths):
            verdict = PATH_NOT_ALLOWED
        else:
            verdict = PATH_FORWARDED
        if len(raw_path) <= _REMEMBERED_PATH_LENGTH and len(verdicts) < _REMEMBERED_PATHS:
            verdicts[raw_path] = verdict
        return verdict


class RouteFacts:
    """What the engine profile says of one method and path: its route (None: read-only,
    outside the route table), its metric label, and whether such a request may be sent again
    on a new connection (`EngineProfile.replayable`). Never changed once made."""

    __slots__ = ("label", "replayable", "route")

    def __init__(self, route: Route | None, label: str, replayable: bool) -> None:
        self.route: Final = route
        self.label: Final = label
        self.replayable: Final = replayable


class RouteLookups:
    """The profile's route facts for each method and path, remembered for the engine profile
    in force, as `PathChecks` remembers its verdicts (the profile's lookups run interpreted:
    some 4,000 instructions a request)."""

    __slots__ = ("_engine", "_facts")

    def __init__(self) -> None:
        self._engine: EngineProfile | None = None
        self._facts: dict[tuple[str, str], RouteFacts] = {}

    def of(self, method: str, path: str, engine: EngineProfile) -> RouteFacts:
        if engine is not self._engine:
            self._engine = engine
            self._facts = {}
        known = self._facts
        key = (method, path)
        facts = known.get(key)
        if facts is not None:
            return facts
        facts = RouteFacts(
            engine.route(method, path), route_label(path), engine.replayable(method, path)
        )
        if len(path) <= _REMEMBERED_PATH_LENGTH and len(known) < _REMEMBERED_PATHS:
            known[key] = facts
        return facts


class HeadsForEngine:
    """How client requests' heads go to the engine (`wire.headers.EngineHeads`), for the
    engine profile in force: decided once per profile (its ID headers), not per request."""

    __slots__ = ("_engine", "_heads", "_request_id_header", "_upstream_url")

    def __init__(self, upstream_url: str, request_id_header: str) -> None:
        self._upstream_url = upstream_url
        self._request_id_header = request_id_header
        self._engine: EngineProfile | None = None
        self._heads: EngineHeads | None = None

    def of(self, engine: EngineProfile) -> EngineHeads:
        heads = self._heads
        if heads is None or engine is not self._engine:
            heads = EngineHeads(self._upstream_url, self._request_id_header, engine.id_headers)
            self._engine, self._heads = engine, heads
        return heads


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
    paths: PathChecks  # the refusal checks' verdict per path
    routes: RouteLookups  # the profile's route facts per method and path
    heads: HeadsForEngine  # what of a client's request head the engine gets

    @property
    def slots(self) -> EngineSlots:
        """The engine's slots, where tether counts them (TETHER_ENGINE_SLOTS)."""
        return self.identity.slots

    @property
    def engine(self) -> EngineProfile:
        """The profile a request arriving now is served with."""
        return self.identity.profile


CONTEXT = web.AppKey("tether_context", ProxyContext)
