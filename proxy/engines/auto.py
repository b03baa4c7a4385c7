"""auto: an engine tether has not identified (yet), or one it does not recognise.

TETHER_ENGINE=auto (the default) asks the engine what it is (`identify`) and then uses that
engine's profile; this one holds until an answer names a known engine, and for an engine that
never does. It does only what is safe in front of any engine: every known engine's control
routes are refused, the dropped connection is the only stop (the one signal every engine
understands: an abort call needs an engine ID only a known engine defines, and a route an
unknown server may define otherwise, such as an abort matching by prefix, could stop other
clients' work), and a client's own `request_id` or `rid` in a body is replaced by tether's ID
where it appears, so that no client-chosen ID reaches an engine that may key requests by it.
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
    BodyField,
    EngineProfile,
    refuse_templated_abort_url,
)

if TYPE_CHECKING:
    from .base import Settings


class Profile(EngineProfile):
    routes = ()
    # vLLM's and SGLang's ID fields, replaced only where the client wrote them.
    unknown_route_fields = (
        BodyField("request_id", always=False),
        BodyField("rid", always=False),
    )
    id_headers = (REQUEST_ID_HEADER,)
    control_routes = ()
    control_routes_complete = False
    public_routes = ()
    generation_routes = frozenset()
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
    json_rule = FASTAPI_JSON
    keepalive_seconds = BELOW_UVICORN_KEEPALIVE
    # Until the engine says what it is: the OpenAI API's watch of a background response.
    watch_paths = ("/v1/responses/",)

    @classmethod
    def check_settings(cls, settings: Settings) -> None:
        # Overrides vLLM's or SGLang's abort route once identified: it may not name a request.
        refuse_templated_abort_url(settings)

    def _abort_calls(self, engine_request_ids: tuple[str, ...]) -> tuple[AbortCall, ...]:
        return ()
