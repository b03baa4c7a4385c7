"""Everything tether knows about each engine, one module per engine: its routes, where tether's
ID goes on each, which engine request ID results, how that ID is aborted and the abort
confirmed, which routes are the engine's control routes and which its clients use, how its
responses carry tokens and usage, what it parses as JSON, how long it keeps a connection,
and which settings only it has or only it refuses.

Each route entry states what was verified against the real engine (vLLM 0.32, SGLang
0.5.23, llama.cpp b11434); a route whose engine ID tether cannot name is not guessed at: it is
stopped by the dropped connection alone and its aborts are counted `unknown_route`.

`Engine` below is the registry: a new engine is one module in this package, named by the
value of its one line there, that subclasses `base.EngineProfile` as `Profile` (and, if it
has settings of its own, its settings class among `EngineSettings`'s bases).
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from enum import StrEnum
from typing import TYPE_CHECKING

from .base import (
    ABORT_ID_FIELD,
    ABORT_ID_NAME,
    ALLOW_PUBLIC,
    FASTAPI_JSON,
    REQUEST_ID_HEADER,
    AbortCall,
    BodyField,
    ConfirmRule,
    EngineProfile,
    JsonRule,
    Route,
    template_fields,
)
from .identify import Identity
from .sglang import SglangSettings

if TYPE_CHECKING:
    from .base import Settings

__all__ = [
    "ABORT_ID_FIELD",
    "ABORT_ID_NAME",
    "ALLOW_PUBLIC",
    "DEFAULT_ENGINE",
    "FASTAPI_JSON",
    "GENERATION_ROUTES",
    "ID_HEADERS",
    "KEEPALIVE_SECONDS",
    "PROBE_ROUTES",
    "PROFILES",
    "REQUEST_ID_HEADER",
    "AbortCall",
    "BodyField",
    "ConfirmRule",
    "Engine",
    "EngineProfile",
    "EngineSettings",
    "Identity",
    "JsonRule",
    "Route",
    "asks_engine",
    "check_settings",
    "contradiction",
    "control_routes",
    "engine_profile",
    "public_routes",
    "refused_control_routes",
    "route_table",
    "served_engine",
    "template_fields",
    "with_public_routes",
]


class Engine(StrEnum):
    """The engines tether knows (TETHER_ENGINE), in the order `--help` lists them; each
    value is the name of the module in this package that describes the engine. `auto` is
    the profile of an engine not identified (yet): tether asks the engine what it is and
    then uses that engine's profile (`identify`)."""

    AUTO = "auto"
    VLLM = "vllm"
    SGLANG = "sglang"
    LLAMACPP = "llamacpp"
    GENERIC = "generic"
    NONE = "none"


DEFAULT_ENGINE = Engine.AUTO


class EngineSettings(SglangSettings):
    """The settings engines add to tether's own (`proxy.settings.Settings` inherits them)."""


def _profile_of(engine: Engine) -> type[EngineProfile]:
    profile = importlib.import_module(f"{__name__}.{engine.value}").Profile
    if not (isinstance(profile, type) and issubclass(profile, EngineProfile)):
        raise TypeError(f"{__name__}.{engine.value}.Profile is not an EngineProfile")
    return profile


PROFILES: Mapping[Engine, type[EngineProfile]] = {engine: _profile_of(engine) for engine in Engine}


def route_table(engine: Engine) -> tuple[Route, ...]:
    """The built-in routes of an engine (for documentation, tests and the fake engines)."""
    return PROFILES[engine].routes


def control_routes(engine: Engine) -> tuple[str, ...]:
    """The control routes tether refuses in front of `engine` (every one it knows of, for
    an engine it has no table of)."""
    profile = PROFILES[engine]
    if profile.control_routes_complete:
        return profile.control_routes
    return tuple(dict.fromkeys(path for p in PROFILES.values() for path in p.control_routes))


def refused_control_routes() -> tuple[str, ...]:
    """Every control route of every engine tether knows: refused in front of any engine
    (unless the operator says otherwise), so that an engine identified or configured
    wrongly never opens another's."""
    return tuple(dict.fromkeys(path for p in PROFILES.values() for path in p.control_routes))


def public_routes(engine: Engine) -> tuple[str, ...]:
    """The routes a client of `engine` uses; () for an engine tether has no table of."""
    return PROFILES[engine].public_routes


def with_public_routes() -> tuple[Engine, ...]:
    """The engines `TETHER_ALLOWED_PATHS=public` works with (with auto: the public routes of
    the engine that answers, none until one does)."""
    return tuple(
        engine
        for engine, profile in PROFILES.items()
        if profile.public_routes or engine is Engine.AUTO
    )


def check_settings(settings: Settings) -> None:
    """Raise ValueError, naming the variable to fix, where the settings do not fit their
    engine."""
    PROFILES[Engine(settings.engine)].check_settings(settings)


def asks_engine(settings: Settings) -> bool:
    """Whether the profile follows what the engine says it is (TETHER_ENGINE=auto)."""
    return settings.engine == Engine.AUTO


def served_engine(settings: Settings, identity: Identity | None) -> Engine:
    """The engine whose profile requests are served with: the configured one; with auto, the
    one that answered (auto's own while none did)."""
    if not asks_engine(settings):
        return Engine(settings.engine)
    return Engine(identity.profile) if identity is not None else Engine.AUTO


def contradiction(settings: Settings, identity: Identity | None) -> str | None:
    """What is wrong where a configured engine is not the one that answers (None: nothing)."""
    if asks_engine(settings) or identity is None or identity.profile == settings.engine:
        return None
    return (
        f"TETHER_ENGINE={settings.engine}, but the engine says it is "
        f"{identity.product} ({identity.evidence}): tether keeps the configured profile, "
        f"whose aborts and request IDs may not fit it; set TETHER_ENGINE={identity.profile} "
        "or auto"
    )


def engine_profile(settings: Settings, engine: Engine | None = None) -> EngineProfile:
    """The profile of `engine` (default: the one the settings name), with the operator's
    lists applied."""
    engine = Engine(settings.engine) if engine is None else engine
    return PROFILES[engine](settings, engine, refused_control_routes())


# Every header some engine keys requests by (lower-cased): a client may not name one in
# `Connection`, and never picks the engine's ID through one.
ID_HEADERS = frozenset(name.lower() for profile in PROFILES.values() for name in profile.id_headers)
# Metric labels of their own: every engine's generation routes, and the probes and scrapes
# sent to its serving port.
GENERATION_ROUTES = frozenset(
    path for profile in PROFILES.values() for path in profile.generation_routes
)
PROBE_ROUTES = frozenset(path for profile in PROFILES.values() for path in profile.probe_routes)
# How long an idle pooled connection to the engine stays open: below every known engine's own
# keep-alive, since the pool serves whichever engine answers before it says which it is.
KEEPALIVE_SECONDS = min(profile.keepalive_seconds for profile in PROFILES.values())
