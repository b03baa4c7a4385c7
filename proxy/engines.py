"""Everything tether knows about each engine, in one place: its routes, where tether's ID goes
on each, which engine request ID results, how that ID is aborted, and how its responses carry
tokens.

Pure: builds descriptions of calls; the upstream client sends them. Each route entry states
what was verified against the real engine (vLLM 0.32, SGLang 0.5.23); a route whose engine ID
tether cannot name is not guessed at: it is stopped by the dropped connection alone and its
aborts are counted `unknown_route`.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass, replace
from urllib.parse import quote

from .settings import ALLOW_PUBLIC, Engine, Settings
from .tokens import TokenShape

# Dev-mode/tokens-only route first, then the scale-out one; a default server has neither.
_VLLM_ABORT_PATHS = ("/abort_requests", "/inference/v1/abort_requests")
_SGLANG_ABORT_PATH = "/abort_request"


@functools.lru_cache(maxsize=64)
def _quoted(name: str) -> bytes:
    return b'"' + name.encode() + b'"'


# Methods that never start generation: a client leaving one costs the engine nothing.
_READ_ONLY_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})


@dataclass(frozen=True, slots=True)
class BodyField:
    """A JSON field tether sets to carry its ID (`{id}` is tether's ID); a dotted name is a
    field inside an object field (`parameters.rid`)."""

    name: str
    value: str = "{id}"
    # False: set only when the client sent the field (it must not survive), else leave the
    # body alone because the engine reads the ID from the header.
    always: bool = True

    @property
    def quoted_name(self) -> bytes:
        """How the (innermost) field's name appears in a JSON body: `"name"`."""
        return _quoted(self.name.rpartition(".")[2])


@dataclass(frozen=True, slots=True)
class Route:
    """One engine route that can start work, and how tether handles its IDs and aborts."""

    path: str
    # The engine's request ID for tether's ID (`{id}`), as its abort API must name it; None
    # when tether cannot name it (the connection drop is then the only abort).
    engine_id: str | None
    tokens: TokenShape
    body_fields: tuple[BodyField, ...] = ()
    # JSON body fields (the first one present counts) whose list of prompts makes a batch the
    # engine runs as separate requests, each named by `batch_engine_id` (`{index}` numbering
    # them); a body without a list there is one request, named by `engine_id`.
    fan_out: tuple[str, ...] = ()
    batch_engine_id: str | None = None
    # False when the engine ID is the client's handle for follow-up calls (Responses API:
    # `GET /v1/responses/{id}`, `previous_response_id`): it is then returned as the engine
    # made it, and tether makes it unique, instead of mapping it back to the client's ID.
    maps_id_back: bool = True
    # Requests whose JSON body has `"background": true` outlive their connection on purpose.
    may_run_in_background: bool = False
    # The engine runs each of `n > 1` samples under an ID of its own that tether cannot name
    # (SGLang): such a request can only be stopped by the dropped connection.
    samples_unnamed: bool = False
    # SGLang reads X-Override-Rid here (with header overrides on), so the body can stay as is.
    rid_header_honoured: bool = False
    # A stream here reports its usage in a last event when the body asks for it
    # (`stream_options.include_usage`, OpenAI chat and completions on vLLM and SGLang).
    reports_usage_when_asked: bool = False
    # A body field the client may name its request in that tether reads but leaves alone
    # (the engine reads tether's ID from a header that wins over it).
    reads_client_id: BodyField | None = None

    @property
    def client_id_field(self) -> BodyField | None:
        """The body field in which a client names its request to the engine (vLLM's
        `request_id`, SGLang's `rid`): the engine writes that name into its answer, so tether
        gives the client its value back. None where the engine's ID is the client's handle
        for follow-up calls (the Responses API), which tether makes unique instead."""
        if not self.maps_id_back:
            return None
        if self.reads_client_id is not None:
            return self.reads_client_id
        return next((field for field in self.body_fields if field.value == "{id}"), None)

    def engine_request_ids(
        self, internal_request_id: str, batch: int | None = None, samples: int = 1
    ) -> tuple[str, ...]:
        """What the engine's abort API must name to stop this request (`batch`: how many
        prompts the body's list held, None when it held one prompt); () when unknown."""
        if self.engine_id is None or (self.samples_unnamed and samples > 1):
            return ()
        if batch is None or self.batch_engine_id is None:
            return (self.engine_id.format(id=internal_request_id),)
        return tuple(
            self.batch_engine_id.format(id=internal_request_id, index=index)
            for index in range(batch)
        )


# vLLM keys a request by `X-Request-Id` (the header beats a body `request_id`) with a
# per-route prefix, and its abort API matches external IDs exactly (verified on 0.32: the bare
# ID, the engine's internal `-<8 hex>` form and other suffixes match nothing). A client's own
# body `request_id` is overwritten so that it cannot collide.
_VLLM_REQUEST_ID = BodyField("request_id", always=False)
_VLLM_ROUTES = (
    # `chatcmpl-<id>`; n>1 children are reached through it too (verified).
    Route(
        "/v1/chat/completions",
        "chatcmpl-{id}",
        TokenShape.CHAT,
        (_VLLM_REQUEST_ID,),
        reports_usage_when_asked=True,
    ),
    # One engine request per prompt, `cmpl-<id>-<prompt index>`, even for a single prompt.
    Route(
        "/v1/completions",
        "cmpl-{id}-0",
        TokenShape.COMPLETION,
        (_VLLM_REQUEST_ID,),
        fan_out=("prompt",),
        batch_engine_id="cmpl-{id}-{index}",
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
        maps_id_back=False,
        may_run_in_background=True,
    ),
    # Pooling, scoring and audio routes: one engine request per input, audio chunk or
    # document, not verified against the tiny test model (it serves none of them), so tether
    # does not name them.
    Route("/v1/embeddings", None, TokenShape.NONE, (_VLLM_REQUEST_ID,)),
    Route("/pooling", None, TokenShape.NONE, (_VLLM_REQUEST_ID,)),
    Route("/classify", None, TokenShape.NONE, (_VLLM_REQUEST_ID,)),
    Route("/score", None, TokenShape.NONE, (_VLLM_REQUEST_ID,)),
    Route("/v1/score", None, TokenShape.NONE, (_VLLM_REQUEST_ID,)),
    Route("/rerank", None, TokenShape.NONE, (_VLLM_REQUEST_ID,)),
    Route("/v1/rerank", None, TokenShape.NONE, (_VLLM_REQUEST_ID,)),
    Route("/v2/rerank", None, TokenShape.NONE, (_VLLM_REQUEST_ID,)),
    Route("/v1/audio/transcriptions", None, TokenShape.COMPLETION),
    Route("/v1/audio/translations", None, TokenShape.COMPLETION),
)

# SGLang takes its rid from the body and uses it verbatim: as the engine ID, as the response
# `id` and as the name `/abort_request` matches. A batch (a list of prompts) runs as
# `<rid>_<index>`, one per prompt. `/abort_request` ignores a rid its tokenizer manager does
# not hold exactly, then its scheduler aborts every rid starting with it: tether names each
# batch item, and its IDs are fixed-length, so no rid of tether's is a prefix of another's
# (verified on 0.5.23). Started with SGLANG_ENABLE_REQUEST_HEADER_OVERRIDES=1 it takes
# `X-Override-Rid` first on chat and /generate: tether always sets that header to its rid
# too, so a client's own cannot win there, and can skip the body rewrite. Two routes take
# their rid from another field, which tether owns as well: a client's own there could be a
# prefix of others' rids.
_SGLANG_RID = BodyField("rid")
_SGLANG_RID_HEADER = "X-Override-Rid"
_SGLANG_BATCH_ITEM = "{id}_{index}"
_SGLANG_ROUTES = (
    Route(
        "/v1/chat/completions",
        "{id}",
        TokenShape.CHAT,
        (_SGLANG_RID,),
        samples_unnamed=True,
        rid_header_honoured=True,
        reports_usage_when_asked=True,
    ),
    Route(
        "/v1/completions",
        "{id}",
        TokenShape.COMPLETION,
        (_SGLANG_RID,),
        fan_out=("prompt",),
        batch_engine_id=_SGLANG_BATCH_ITEM,
        samples_unnamed=True,
        reports_usage_when_asked=True,
    ),
    # A batch of `input_embeds` is not counted (tether would name `<rid>`, which matches no
    # item: its abort ends `unconfirmed` and the dropped connection stops it).
    Route(
        "/generate",
        "{id}",
        TokenShape.SGLANG_GENERATE,
        (_SGLANG_RID,),
        fan_out=("text", "input_ids"),
        batch_engine_id=_SGLANG_BATCH_ITEM,
        samples_unnamed=True,
        rid_header_honoured=True,
    ),
    # SageMaker's entry point runs the chat handler.
    Route("/invocations", "{id}", TokenShape.CHAT, (_SGLANG_RID,), samples_unnamed=True),
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
        batch_engine_id=_SGLANG_BATCH_ITEM,
    ),
)


# Engine control routes no client may reach: with them anyone could abort every request,
# pause, reload or profile the engine, load adapters, or read the engine's own secrets. Read
# from the route tables of the installed engines (vLLM 0.32 `build_app` under every flag and
# environment combination; SGLang 0.5.23 `http_server.app` and the routers it includes), not
# guessed. Matched as prefixes of the normalised path (`/update_weights` covers
# `/update_weights_from_disk`), in every spelling (`routes.normalised_path`).
_VLLM_CONTROL_ROUTES = (
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
_SGLANG_CONTROL_ROUTES = (
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
# Other engines' (llama.cpp's slot save/restore/erase, LMDeploy's abort), blocked wherever
# tether does not know the engine.
_OTHER_CONTROL_ROUTES = ("/slots",)

# The routes a client of each engine uses (`TETHER_ALLOWED_PATHS=public`): its inference
# APIs and harmless reads, matched as whole path segments (`/v1/responses` covers
# `/v1/responses/<id>/cancel`, the client's own handle). Documentation pages are left out.
_VLLM_PUBLIC_ROUTES = (
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
_SGLANG_PUBLIC_ROUTES = (
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


def control_routes(engine: Engine) -> tuple[str, ...]:
    """The control routes tether refuses in front of `engine` (all it knows of, for an
    engine it does not know)."""
    if engine is Engine.VLLM:
        return _VLLM_CONTROL_ROUTES
    if engine is Engine.SGLANG:
        return _SGLANG_CONTROL_ROUTES
    return tuple(
        dict.fromkeys(_VLLM_CONTROL_ROUTES + _SGLANG_CONTROL_ROUTES + _OTHER_CONTROL_ROUTES)
    )


def public_routes(engine: Engine) -> tuple[str, ...]:
    """The routes a client of `engine` uses; () for an engine tether has no table of."""
    return {Engine.VLLM: _VLLM_PUBLIC_ROUTES, Engine.SGLANG: _SGLANG_PUBLIC_ROUTES}.get(engine, ())


@dataclass(frozen=True, slots=True)
class ConfirmRule:
    """How long an engine takes to end a response whose abort it accepted: the confirm
    window is `steps` engine steps (the one in progress, and those its scheduler takes to act
    on the abort), at least `floor` seconds (its HTTP side's own delays). With
    `acts_within_steps` a call that reached the process holding the request ends it within
    those steps of its answer, floor or not: a response that outlived a repeat and took more
    steps than that (a stream's tokens count them) was ended by the repeat, so the first
    call missed."""

    steps: float
    floor: float
    acts_within_steps: bool = False


# vLLM acts on an abort at its next step boundary. Observed on 0.32 (CPU, ~3 ms a step):
# streams end 1-11 ms after the call, up to 36 ms on the Responses API and behind a
# middleware, up to 38 ms at the p99 of 8 concurrent streams; with two API-server processes
# a call that missed and a repeat that reached the right one end it 20-30 ms after the call.
# The long ends come with long steps (a loaded engine): counted in steps (a stream's tokens
# after the call's answer: 0-1 on one process, 4-6 after a miss at 3 ms a step) they tell
# a miss apart; the repeat (20 ms) alone does not (a 100-client run had stops 30 and 37 ms
# after the call's answer, with no token after it, on one API-server process).
_VLLM_CONFIRM = ConfirmRule(steps=2, floor=0.05, acts_within_steps=True)
# SGLang's scheduler takes a few steps (observed 0.5.23: the stream ends 15-31 ms after the
# call at 6-11 ms a step; 14-60 ms after the close with 8 streams, SGLang and tether on one
# core, and once more than 60): often after the first repeat went out. Its abort reaches the
# scheduler from any tokenizer worker, so a miss is rare and a wide window costs little.
_SGLANG_CONFIRM = ConfirmRule(steps=6, floor=0.1)
_UNKNOWN_CONFIRM = ConfirmRule(steps=4, floor=0.1)


@dataclass(frozen=True, slots=True)
class AbortCall:
    """One HTTP call that asks the engine to stop a request."""

    method: str
    url: str
    body: bytes | None


class EngineProfile:
    """The engine-specific rules, built once from the settings."""

    def __init__(self, settings: Settings) -> None:
        self.engine = settings.engine
        self.blocked_paths = settings.blocked_paths or control_routes(self.engine)
        allowed = settings.allowed_paths
        self.allowed_paths: tuple[str, ...] | None = (
            public_routes(self.engine) if allowed == (ALLOW_PUBLIC,) else allowed
        )
        self._upstream_url = settings.upstream_url
        self._abort_url = settings.abort_url
        self._abort_method = settings.abort_method
        self._abort_body = settings.abort_body
        routes: tuple[Route, ...] = ()
        self.id_headers: tuple[str, ...] = ("X-Request-Id",)
        # Both engines read their ID from the body on routes tether knows nothing else about
        # (a vLLM `request_id`, an SGLang `rid`): a client's own must not reach the engine
        # there either, where it could collide with another request's.
        self._unknown_route_fields: tuple[BodyField, ...] = ()
        self.confirm_rule = _UNKNOWN_CONFIRM
        # vLLM 0.32 writes its system_fingerprint on a stream's finishing chunks, unless the
        # stream reports usage: then on the usage event alone.
        self.usage_takes_fingerprint = self.engine is Engine.VLLM
        # vLLM 0.32 counts a prompt (`prompt_tokens_total`) once its prefill has made the
        # first token; a request ended before that reports its prompt in `usage` but was
        # never prefilled. SGLang counts every finished request's prompt.
        self.prompt_counted_from_first_token = self.engine is Engine.VLLM
        # Which ID an engine writes into its answer when the client named one in the body
        # and one in the request-ID header: vLLM 0.32 the header's (`_base_request_id`),
        # SGLang its `rid` (it does not read X-Request-Id).
        self.body_id_beats_header = self.engine is Engine.SGLANG
        if self.engine is Engine.VLLM:
            routes = _VLLM_ROUTES
            self._unknown_route_fields = (_VLLM_REQUEST_ID,)
            self.confirm_rule = _VLLM_CONFIRM
        elif self.engine is Engine.SGLANG:
            routes = _SGLANG_ROUTES
            self.id_headers = ("X-Request-Id", _SGLANG_RID_HEADER)
            self.confirm_rule = _SGLANG_CONFIRM
            self._unknown_route_fields = (_SGLANG_RID,)
            if settings.sglang_rid_header:
                # The header wins there: a body naming a rid of its own is only read, for the
                # value the client gets back.
                routes = tuple(
                    replace(route, body_fields=(), reads_client_id=_SGLANG_RID)
                    if route.rid_header_honoured
                    else route
                    for route in routes
                )
        self._routes = {route.path: route for route in routes}

    @property
    def sends_aborts(self) -> bool:
        return self.engine is not Engine.NONE

    @property
    def merges_aborts(self) -> bool:
        """Whether one abort call can name many requests (vLLM's `request_ids` list)."""
        return self.engine is Engine.VLLM

    def route(self, method: str, path: str) -> Route | None:
        """The route table entry for a request; None for read-only requests (nothing to
        abort) on routes outside the table."""
        known = self._routes.get(path.rstrip("/") or "/")
        if known is not None:
            return known
        if self.engine is Engine.GENERIC:
            # The operator's abort template names tether's ID; whether it worked shows in
            # whether the response then ends.
            return Route(path, "{id}", TokenShape.NONE)
        if method in _READ_ONLY_METHODS:
            return None
        # Anything else may start work tether cannot name: connection drop only.
        return Route(path, None, TokenShape.NONE, self._unknown_route_fields)

    def abort_calls(self, engine_request_ids: tuple[str, ...]) -> tuple[AbortCall, ...]:
        """Candidate calls, in order: the first the engine supports is the one to use.

        Never called with no ID: vLLM's dev route reads an empty list as "abort everything";
        with one ID unless the engine `merges_aborts` (SGLang and templates name one request).
        """
        assert len(engine_request_ids) == 1 or (engine_request_ids and self.merges_aborts)
        engine_request_id = engine_request_ids[0]
        if self.engine is Engine.VLLM:
            body = json.dumps({"request_ids": list(engine_request_ids)}).encode()
            return tuple(
                AbortCall("POST", self._resolve(path), body)
                for path in self._paths(_VLLM_ABORT_PATHS)
            )
        if self.engine is Engine.SGLANG:
            body = json.dumps({"rid": engine_request_id}).encode()
            return tuple(
                AbortCall("POST", self._resolve(path), body)
                for path in self._paths((_SGLANG_ABORT_PATH,))
            )
        if self.engine is Engine.GENERIC:
            assert self._abort_url is not None  # settings require it for generic
            # In `preserve` mode the ID is the client's, which may hold `"` or `\`: escaped
            # as inside a JSON string, it cannot change what the template's JSON says.
            body_text = (
                self._abort_body.format(internal_request_id=json.dumps(engine_request_id)[1:-1])
                if self._abort_body is not None
                else None
            )
            url = self._abort_url.format(internal_request_id=quote(engine_request_id, safe=""))
            return (
                AbortCall(
                    self._abort_method,
                    self._resolve(url),
                    body_text.encode() if body_text is not None else None,
                ),
            )
        return ()

    def _paths(self, built_in: tuple[str, ...]) -> tuple[str, ...]:
        return (self._abort_url,) if self._abort_url is not None else built_in

    def _resolve(self, url_or_path: str) -> str:
        return self._upstream_url + url_or_path if url_or_path.startswith("/") else url_or_path


def route_table(engine: Engine) -> tuple[Route, ...]:
    """The built-in routes of an engine (for documentation and tests)."""
    return {Engine.VLLM: _VLLM_ROUTES, Engine.SGLANG: _SGLANG_ROUTES}.get(engine, ())
