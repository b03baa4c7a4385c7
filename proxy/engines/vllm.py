"""vLLM: everything tether knows about it, verified on vLLM 0.32 unless a comment says
otherwise.

vLLM keys a request by `X-Request-Id` (the header beats a body `request_id`) with a
per-route prefix, and its abort API matches external IDs exactly (verified on 0.32: the bare
ID, the engine's internal `-<8 hex>` form and other suffixes match nothing). A client's own
body `request_id` is overwritten so that it cannot collide. A default `vllm serve` has no
abort route: the dropped connection stops the request (vLLM listens for disconnects).
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

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

# Dev-mode/tokens-only route first, then the scale-out one; a default server has neither.
ABORT_PATHS = ("/abort_requests", "/inference/v1/abort_requests")

REQUEST_ID = BodyField("request_id", always=False)
ROUTES = (
    # `chatcmpl-<id>`; n>1 children are reached through it too (verified).
    Route(
        "/v1/chat/completions",
        "chatcmpl-{id}",
        TokenShape.CHAT,
        (REQUEST_ID,),
        reports_usage_when_asked=True,
    ),
    # One engine request per prompt, `cmpl-<id>-<prompt index>`, even for a single prompt;
    # the answer's `id` is `cmpl-<id>`.
    Route(
        "/v1/completions",
        "cmpl-{id}-0",
        TokenShape.COMPLETION,
        (REQUEST_ID,),
        fan_out=("prompt",),
        batch_engine_id="cmpl-{id}-{index}",
        response_id="cmpl-{id}",
        reports_usage_when_asked=True,
    ),
    # Anthropic messages run through the chat path: `chatcmpl-<X-Request-Id>`.
    Route("/v1/messages", "chatcmpl-{id}", TokenShape.MESSAGES),
    # The Responses API ignores `X-Request-Id`: the engine ID is the body's `request_id` plus
    # `_<turn>` (`_0` until a built-in tool adds turns). That ID is the client's handle for
    # follow-up calls, so tether makes it unique and leaves it as it is.
    Route(
        "/v1/responses",
        "resp_{id}_0",
        TokenShape.RESPONSES,
        (BodyField("request_id", "resp_{id}"),),
        response_id="resp_{id}",
        maps_id_back=False,
        may_run_in_background=True,
    ),
    # Pooling, scoring and audio routes: one engine request per input, audio chunk or
    # document, not verified against the tiny test model (it serves none of them), so tether
    # does not name them.
    Route("/v1/embeddings", None, TokenShape.NONE, (REQUEST_ID,)),
    Route("/pooling", None, TokenShape.NONE, (REQUEST_ID,)),
    Route("/classify", None, TokenShape.NONE, (REQUEST_ID,)),
    Route("/score", None, TokenShape.NONE, (REQUEST_ID,)),
    Route("/v1/score", None, TokenShape.NONE, (REQUEST_ID,)),
    Route("/rerank", None, TokenShape.NONE, (REQUEST_ID,)),
    Route("/v1/rerank", None, TokenShape.NONE, (REQUEST_ID,)),
    Route("/v2/rerank", None, TokenShape.NONE, (REQUEST_ID,)),
    Route("/v1/audio/transcriptions", None, TokenShape.COMPLETION),
    Route("/v1/audio/translations", None, TokenShape.COMPLETION),
)

# Engine control routes no client may reach: with them anyone could abort every request,
# pause, reload or profile the engine, load adapters, or read the engine's own secrets. Read
# from the route table of the installed engine (vLLM 0.32 `build_app` under every flag and
# environment combination), not guessed. Matched as prefixes of the normalised path
# (`/update_weights` covers `/update_weights_from_disk`), in every spelling
# (`routes.normalised_path`).
CONTROL_ROUTES = (
    "/abort_requests",  # dev mode and --tokens-only; an empty list aborts everything
    "/inference/v1/abort_requests",  # --enable-scale-out
    "/adapters",  # SageMaker-style LoRA load/unload (VLLM_ALLOW_RUNTIME_LORA_UPDATING)
    "/v1/load_lora_adapter",
    "/v1/unload_lora_adapter",
    "/collective_rpc",
    "/fault_tolerance",  # --enable-fault-tolerance
    "/get_world_size",
    "/is_paused",
    "/is_scaling_elastic_ep",
    "/is_sleeping",
    "/kv_event_sources",
    "/pause",
    "/release_kv_cache_memory",
    "/reset_encoder_cache",
    "/reset_mm_cache",
    "/reset_prefix_cache",
    "/resume",
    "/scale_elastic_ep",  # registered on every generative server, no flag
    "/server_info",  # dev mode: the server's arguments
    "/sleep",
    "/wake_up",
    "/start_profile",
    "/stop_profile",
    "/init_weight_transfer_engine",
    "/shutdown_weight_transfer_engine",
    "/start_weight_update",
    "/start_draft_weight_update",
    "/finish_weight_update",
    "/update_weights",
    "/update_weight_version",
    "/weight_checker",
    "/weight_info",
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
    "/v1/systemone",
    "/v2/embed",
    "/v2/rerank",
    "/cohere/v2/chat",
    "/inference/v1/generate",
    "/pooling",
    "/classify",
    "/score",
    "/rerank",
    "/generative_scoring",
    "/invocations",
    "/ping",
    "/tokenize",
    "/detokenize",
    "/tokenizer_info",
    "/health",
    "/load",
    "/version",
    "/metrics",
)

GENERATION_ROUTES = frozenset(
    {
        "/v1/chat/completions",
        "/v1/completions",
        "/v1/responses",
        "/v1/messages",
        "/v1/embeddings",
        "/v1/audio/transcriptions",
        "/v1/audio/translations",
        "/v1/rerank",
        "/v1/score",
        "/invocations",  # SageMaker's entry point
        "/v1/realtime",  # WebSocket sessions (the Realtime API)
    }
)
PROBE_ROUTES = frozenset(
    {
        "/v1/models",
        "/tokenize",
        "/detokenize",
        "/health",
        "/metrics",
        "/version",
        "/ping",
        "/load",
    }
)

# vLLM acts on an abort at its next step boundary. Observed on 0.32 (CPU, ~3 ms a step):
# streams end 1-11 ms after the call, up to 36 ms on the Responses API and behind a
# middleware, up to 38 ms at the p99 of 8 concurrent streams; with two API-server processes
# a call that missed and a repeat that reached the right one end it 20-30 ms after the call.
# The long ends come with long steps (a loaded engine): counted in steps (a stream's tokens
# after the call's answer: 0-1 on one process, 4-6 after a miss at 3 ms a step) they tell
# a miss apart; the repeat (20 ms) alone does not (a 100-client run had stops 30 and 37 ms
# after the call's answer, with no token after it, on one API-server process).
CONFIRM = ConfirmRule(steps=2, floor=0.05, acts_within_steps=True)


class Profile(EngineProfile):
    routes = ROUTES
    # A route tether knows nothing else about still reads a body `request_id`: a client's
    # own must not reach the engine there either, where it could collide with another's.
    unknown_route_fields = (REQUEST_ID,)
    id_headers = (REQUEST_ID_HEADER,)
    control_routes = CONTROL_ROUTES
    control_routes_complete = True
    public_routes = PUBLIC_ROUTES
    generation_routes = GENERATION_ROUTES
    probe_routes = PROBE_ROUTES
    session_header = None
    sends_aborts = True
    # One call names many requests: `{"request_ids": [...]}`.
    merges_aborts = True
    blind_while_queued = False
    confirm_rule = CONFIRM
    route_missing_statuses = ROUTE_MISSING
    # vLLM 0.32 writes its system_fingerprint on a stream's finishing chunks, unless the
    # stream reports usage: then on the usage event alone.
    usage_takes_fingerprint = True
    # vLLM 0.32 counts a prompt (`prompt_tokens_total`) once its prefill has made the first
    # token; a request ended before that reports its prompt in `usage` but was never
    # prefilled.
    prompt_counted_from_first_token = True
    # Given both, vLLM 0.32 answers with the header's ID (`_base_request_id`).
    body_id_beats_header = False
    # vLLM aborts exact external IDs (verified on 0.32).
    aborts_by_prefix = False
    json_rule = FASTAPI_JSON
    keepalive_seconds = BELOW_UVICORN_KEEPALIVE
    # GET /v1/responses/{id} (with ?stream=true too) watches a stored background response
    # (VLLM_ENABLE_RESPONSES_API_STORE=1); leaving it only stops watching (observed on 0.32).
    watch_paths = ("/v1/responses/",)

    @classmethod
    def check_settings(cls, settings: Settings) -> None:
        refuse_templated_abort_url(settings)

    def _abort_calls(self, engine_request_ids: tuple[str, ...]) -> tuple[AbortCall, ...]:
        return self._posts(
            ABORT_PATHS, json.dumps({"request_ids": list(engine_request_ids)}).encode()
        )
