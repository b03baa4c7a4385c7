"""generic: an engine tether has no module for, aborted with a call the operator describes in
templates (TETHER_ABORT_URL, TETHER_ABORT_METHOD, TETHER_ABORT_BODY) that name tether's ID as
`{internal_request_id}`.

tether knows none of its routes: every request may be aborted by tether's ID, and whether
the call worked shows in whether the response then ends. Its control routes are not known
either, so every engine's that tether knows are blocked in front of it.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING
from urllib.parse import quote

from .base import (
    ABORT_ID_FIELD,
    ABORT_ID_NAME,
    BELOW_UVICORN_KEEPALIVE,
    FASTAPI_JSON,
    REQUEST_ID_HEADER,
    ROUTE_MISSING,
    UNKNOWN_CONFIRM,
    AbortCall,
    EngineProfile,
    Route,
    template_fields,
)
from .token_shapes import TokenShape

if TYPE_CHECKING:
    from .base import Settings


class Profile(EngineProfile):
    routes = ()
    unknown_route_fields = ()
    id_headers = (REQUEST_ID_HEADER,)
    control_routes = ()
    control_routes_complete = False
    public_routes = ()
    generation_routes = frozenset()
    probe_routes = frozenset()
    session_header = None
    sends_aborts = True
    # A template names one request.
    merges_aborts = False
    blind_while_queued = False
    confirm_rule = UNKNOWN_CONFIRM
    route_missing_statuses = ROUTE_MISSING
    usage_takes_fingerprint = False
    prompt_counted_from_first_token = False
    body_id_beats_header = False
    # Unknown: the operator's abort may match by prefix, so IDs are kept prefix-free.
    aborts_by_prefix = True
    # The rule of the framework most engines run (FastAPI), and the safe one: a body that
    # could be JSON is read for an ID field.
    json_rule = FASTAPI_JSON
    keepalive_seconds = BELOW_UVICORN_KEEPALIVE
    # An OpenAI-compatible server with the Responses API: GET /v1/responses/{id} watches a
    # stored background response.
    watch_paths = ("/v1/responses/",)

    def __init__(self, settings: Settings, engine: str, default_blocked: tuple[str, ...]) -> None:
        super().__init__(settings, engine, default_blocked)
        assert settings.abort_url is not None  # `check_settings` requires it
        self._abort_template = settings.abort_url
        self._abort_method = settings.abort_method
        self._abort_body = settings.abort_body

    @classmethod
    def check_settings(cls, settings: Settings) -> None:
        if settings.abort_url is None:
            raise ValueError("TETHER_ABORT_URL is required when TETHER_ENGINE=generic")
        names_the_id = [
            template is not None and ABORT_ID_NAME in template_fields(template)
            for template in (settings.abort_url, settings.abort_body)
        ]
        if not any(names_the_id):
            # A call that names no request cannot stop one, and would be counted as if it had.
            raise ValueError(
                f"TETHER_ABORT_URL or TETHER_ABORT_BODY must contain {ABORT_ID_FIELD} when "
                "TETHER_ENGINE=generic: an abort call has to name the request it stops"
            )

    def _unknown_route(self, method: str, path: str) -> Route | None:
        # The operator's abort template names tether's ID; whether it worked shows in
        # whether the response then ends.
        return Route(path, "{id}", TokenShape.NONE)

    def _abort_calls(self, engine_request_ids: tuple[str, ...]) -> tuple[AbortCall, ...]:
        engine_request_id = engine_request_ids[0]
        # In `preserve` mode the ID is the client's, which may hold `"` or `\`: escaped
        # as inside a JSON string, it cannot change what the template's JSON says.
        body_text = (
            self._abort_body.format(internal_request_id=json.dumps(engine_request_id)[1:-1])
            if self._abort_body is not None
            else None
        )
        url = self._abort_template.format(internal_request_id=quote(engine_request_id, safe=""))
        return (
            AbortCall(
                self._abort_method,
                self._resolve(url),
                body_text.encode() if body_text is not None else None,
            ),
        )
