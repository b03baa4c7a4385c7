"""SGLang: everything tether knows about it, verified on SGLang 0.5.23 unless a comment says
otherwise.

SGLang takes its rid from the body and uses it verbatim: as the engine ID, as the response
`id` and as the name `/abort_request` matches. A batch (a list of prompts) runs as
`<rid>_<index>`, one per prompt. `/abort_request` ignores a rid its tokenizer manager does
not hold exactly, then its scheduler aborts every rid starting with it: tether names each
batch item, and its IDs are fixed-length, so no rid of tether's is a prefix of another's
(verified on 0.5.23). Started with SGLANG_ENABLE_REQUEST_HEADER_OVERRIDES=1 it takes
`X-Override-Rid` first on chat and /generate: tether always sets that header to its rid
too, so a client's own cannot win there, and can skip the body rewrite
(TETHER_SGLANG_RID_HEADER). Two routes take their rid from another field, which tether owns
as well: a client's own there could be a prefix of others' rids.
"""

from __future__ import annotations

import json
from dataclasses import replace
from typing import TYPE_CHECKING

from pydantic import Field
from pydantic_settings import BaseSettings

from .base import (
    BELOW_UVICORN_KEEPALIVE,
    FASTAPI_JSON,
    REQUEST_ID_HEADER,
    ROUTE_MISSING,
    AbortCall,
    BodyField,
    ConfirmRule,
    EngineProfile,
    Route,
    refuse_templated_abort_url,
)
from .token_shapes import TokenShape

if TYPE_CHECKING:
    from .base import Settings

ABORT_PATH = "/abort_request"
RID = BodyField("rid")
RID_HEADER = "X-Override-Rid"
_BATCH_ITEM = "{id}_{index}"

# SGLang's native /generate: one `meta_info` event per token.
GENERATE_TOKENS = TokenShape("sglang_generate", (b'"meta_info":',))

ROUTES = (
    Route(
        "/v1/chat/completions",
        "{id}",
        TokenShape.CHAT,
        (RID,),
        samples_unnamed=True,
        rid_header_honoured=True,
        reports_usage_when_asked=True,
    ),
    Route(
        "/v1/completions",
        "{id}",
        TokenShape.COMPLETION,
        (RID,),
        fan_out=("prompt",),
        batch_engine_id=_BATCH_ITEM,
        samples_unnamed=True,
        reports_usage_when_asked=True,
    ),
    # A batch of `input_embeds` is not counted (tether would name `<rid>`, which matches no
    # item: its abort ends `unconfirmed` and the dropped connection stops it).
    Route(
        "/generate",
        "{id}",
        GENERATE_TOKENS,
        (RID,),
        fan_out=("text", "input_ids"),
        batch_engine_id=_BATCH_ITEM,
        samples_unnamed=True,
        rid_header_honoured=True,
    ),
    # SageMaker's entry point runs the chat handler.
    Route("/invocations", "{id}", TokenShape.CHAT, (RID,), samples_unnamed=True),
    # The Responses API's rid is its `request_id`, also the client's handle for follow-ups.
    Route(
        "/v1/responses",
        "resp_{id}",
        TokenShape.RESPONSES,
        (BodyField("request_id", "resp_{id}"),),
        maps_id_back=False,
        may_run_in_background=True,
    ),
    # Vertex AI's `instances` are always a batch, even of one.
    Route(
        "/vertex_generate",
        "{id}",
        TokenShape.NONE,
        (BodyField("parameters.rid"),),
        fan_out=("instances",),
        batch_engine_id=_BATCH_ITEM,
    ),
)

# Engine control routes no client may reach: with them anyone could abort every request,
# pause, reload or profile the engine, load adapters, or read the engine's own secrets. Read
# from the route table of the installed engine (SGLang 0.5.23 `http_server.app` and the
# routers it includes), not guessed. Matched as prefixes of the normalised path
# (`/update_weights` covers `/update_weights_from_disk`), in every spelling
# (`routes.normalised_path`).
CONTROL_ROUTES = (
    "/abort_request",  # a prefix match: a short rid aborts every request it starts
    "/pause_generation",
    "/continue_generation",
    "/slow_down",
    "/flush_cache",
    "/freeze_gc",
    "/configure_logging",
    "/set_internal_state",
    "/set_trace_level",
    "/server_info",  # both answer with api_key and admin_api_key in plain text
    "/get_server_info",
    "/open_session",
    "/close_session",
    "/load_lora_adapter",  # also covers /load_lora_adapter_from_tensors
    "/unload_lora_adapter",
    "/start_profile",
    "/stop_profile",
    "/start_expert_distribution_record",
    "/stop_expert_distribution_record",
    "/dump_expert_distribution_record",
    "/update_weights",  # _from_disk, _from_tensor, _from_distributed, _from_ipc
    "/update_weight_version",
    "/begin_weight_update",
    "/end_weight_update",
    "/get_weights_by_name",
    "/weights_checker",
    "/init_weights_update_group",
    "/destroy_weights_update_group",
    "/init_weights_send_group_for_remote_instance",
    "/send_weights_to_remote_instance",
    "/get_remote_instance_transfer_engine_info",
    "/remote_instance_transfer_engine_info",
    "/release_memory_occupation",
    "/resume_memory_occupation",
    "/pd_role_switch",
    "/scale_elastic_ep",
    "/is_scaling_elastic_ep",
    "/add_external_corpus",
    "/remove_external_corpus",
    "/list_external_corpora",
    "/hicache",  # storage backend attach, detach, clear
    "/get_hicache_l3_cache_layout",
    "/dumper",  # DUMPER_SERVER_PORT=reuse
)

# The routes a client uses (`TETHER_ALLOWED_PATHS=public`): its inference APIs and harmless
# reads, matched as whole path segments (`/v1/responses` covers `/v1/responses/<id>/cancel`,
# the client's own handle). Documentation pages are left out.
PUBLIC_ROUTES = (
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/messages",
    "/v1/responses",
    "/v1/embeddings",
    "/v1/audio",
    "/v1/realtime",
    "/v1/models",
    "/v1/score",
    "/v1/rerank",
    "/v1/classify",
    "/v1/decisions",
    "/v1/systemone",
    "/v1/tokenize",
    "/v1/detokenize",
    "/v1/loads",
    "/generate",
    "/encode",
    "/classify",
    "/invocations",
    "/vertex_generate",
    "/api/chat",
    "/api/generate",
    "/api/tags",
    "/api/show",
    "/tokenize",
    "/detokenize",
    "/parse_function_call",
    "/separate_reasoning",
    "/get_model_info",
    "/model_info",
    "/health",
    "/health_generate",
    "/ready",
    "/ping",
    "/metrics",
)

GENERATION_ROUTES = frozenset(
    {
        "/v1/chat/completions",
        "/v1/completions",
        "/v1/responses",
        "/v1/messages",
        "/v1/embeddings",
        "/v1/rerank",
        "/v1/score",
        "/generate",
        "/invocations",
    }
)
PROBE_ROUTES = frozenset(
    {
        "/v1/models",
        "/tokenize",
        "/detokenize",
        "/health",
        "/health_generate",
        "/metrics",
        "/ping",
        "/v1/loads",
        "/get_model_info",
        "/get_server_info",
    }
)

# SGLang's scheduler takes a few steps (observed 0.5.23: the stream ends 15-31 ms after the
# call at 6-11 ms a step; 14-60 ms after the close with 8 streams, SGLang and tether on one
# core, and once more than 60): often after the first repeat went out. Its abort reaches the
# scheduler from any tokenizer worker, so a miss is rare and a wide window costs little.
CONFIRM = ConfirmRule(steps=6, floor=0.1)


class SglangSettings(BaseSettings):
    """SGLang's own settings (`proxy.settings.Settings` inherits them)."""

    sglang_rid_header: bool = Field(
        False,
        description="SGLang only: carry tether's rid in the X-Override-Rid header instead of "
        "rewriting JSON bodies (SGLang started with SGLANG_ENABLE_REQUEST_HEADER_OVERRIDES=1).",
    )


class Profile(EngineProfile):
    routes = ROUTES
    # A route tether knows nothing else about still reads a body `rid`: a client's own must
    # not reach the engine there either, where it could collide with another's.
    unknown_route_fields = (RID,)
    id_headers = (REQUEST_ID_HEADER, RID_HEADER)
    control_routes = CONTROL_ROUTES
    control_routes_complete = True
    public_routes = PUBLIC_ROUTES
    generation_routes = GENERATION_ROUTES
    probe_routes = PROBE_ROUTES
    session_header = None
    sends_aborts = True
    # `{"rid": ...}` names one request (a batch's items one call each).
    merges_aborts = False
    blind_while_queued = False
    confirm_rule = CONFIRM
    route_missing_statuses = ROUTE_MISSING
    usage_takes_fingerprint = False
    # SGLang counts every finished request's prompt.
    prompt_counted_from_first_token = False
    # Given both, SGLang answers with its `rid` (it does not read X-Request-Id).
    body_id_beats_header = True
    # `/abort_request` stops every rid starting with the one named (verified on 0.5.23).
    aborts_by_prefix = True
    json_rule = FASTAPI_JSON
    keepalive_seconds = BELOW_UVICORN_KEEPALIVE
    # GET /v1/responses/{id} reads a stored (background) response; leaving it only stops
    # watching.
    watch_paths = ("/v1/responses/",)

    @classmethod
    def check_settings(cls, settings: Settings) -> None:
        refuse_templated_abort_url(settings)

    def _route_table(self, settings: Settings) -> tuple[Route, ...]:
        if not settings.sglang_rid_header:
            return ROUTES
        # The header wins there: a body naming a rid of its own is only read, for the value
        # the client gets back.
        return tuple(
            replace(route, body_fields=(), reads_client_id=RID)
            if route.rid_header_honoured
            else route
            for route in ROUTES
        )

    def _abort_calls(self, engine_request_ids: tuple[str, ...]) -> tuple[AbortCall, ...]:
        return self._posts((ABORT_PATH,), json.dumps({"rid": engine_request_ids[0]}).encode())
