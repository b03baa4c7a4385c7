"""What every handler needs for the app's lifetime, created in the app's cleanup context."""

from __future__ import annotations

from dataclasses import dataclass

from aiohttp import web

from .aborts import AbortTracker
from .engines import EngineProfile
from .fleet import Fleet
from .health import Readiness
from .metrics import Metrics
from .registry import Registry
from .request_ids import IdMinter
from .settings import Settings
from .tracing import Tracer
from .upstream import UpstreamClient


@dataclass(frozen=True, slots=True)
class ProxyContext:
    settings: Settings
    engine: EngineProfile
    upstream: UpstreamClient
    aborts: AbortTracker
    registry: Registry
    metrics: Metrics
    readiness: Readiness
    fleet: Fleet
    tracer: Tracer | None  # None: tracing is off (or not installed) and costs nothing
    ids: IdMinter


CONTEXT = web.AppKey("tether_context", ProxyContext)
