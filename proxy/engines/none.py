"""none: an engine with no abort call tether can make (TGI, Ollama, or one nobody
described): closing the upstream connection is the only lever, and tether sends no abort at
all.

tether knows none of its routes or control routes: every known engine's control routes are
blocked in front of it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .base import (
    BELOW_UVICORN_KEEPALIVE,
    FASTAPI_JSON,
    REQUEST_ID_HEADER,
    ROUTE_MISSING,
    UNKNOWN_CONFIRM,
    AbortCall,
    EngineProfile,
)

if TYPE_CHECKING:
    from .base import Settings


class Profile(EngineProfile):
    routes = ()
    unknown_route_fields = ()
    id_headers = (REQUEST_ID_HEADER,)
    # None of its own: llama.cpp's are its profile's, LMDeploy's abort is SGLang's
    # `/abort_request` (every profile refuses them all).
    control_routes = ()
    control_routes_complete = False
    public_routes = ()
    # TGI's native generation routes.
    generation_routes = frozenset({"/generate", "/generate_stream"})
    probe_routes = frozenset()
    session_header = None
    sends_aborts = False
    merges_aborts = False
    blind_while_queued = False
    confirm_rule = UNKNOWN_CONFIRM
    route_missing_statuses = ROUTE_MISSING
    usage_takes_fingerprint = False
    prompt_counted_from_first_token = False
    body_id_beats_header = False
    # No abort call: nothing is matched by prefix.
    aborts_by_prefix = False
    # The rule of the framework most engines run (FastAPI), and the safe one: a body that
    # could be JSON is read for an ID field.
    json_rule = FASTAPI_JSON
    keepalive_seconds = BELOW_UVICORN_KEEPALIVE
    # An OpenAI-compatible server with the Responses API: GET /v1/responses/{id} watches a
    # stored background response.
    watch_paths = ("/v1/responses/",)

    @classmethod
    def check_settings(cls, settings: Settings) -> None:
        """Every setting fits: the abort ones are not used."""

    def _abort_calls(self, engine_request_ids: tuple[str, ...]) -> tuple[AbortCall, ...]:
        return ()
