"""What every engine profile is made of: routes, the body fields that carry tether's ID, abort
calls and the rule that confirms them, and `EngineProfile`, the base each engine's module
fills in with what tether knows about that engine.

Pure: builds descriptions of calls; the upstream client sends them. Imports nothing of
tether's settings at run time (`proxy.settings` reads the engines from this package).

Somewhat over 400 lines because every profile's facts are declared here once, with their
defaults and the one place that derives the route tables from them; each engine's module
is then a short list of what differs.
"""

from __future__ import annotations

import json
import string
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol

from .token_shapes import TokenShape

# TETHER_ALLOWED_PATHS=public: the engine's own list of the routes its clients use.
ALLOW_PUBLIC = "public"

# The request-ID header tether sets to its ID in front of every engine: vLLM and NVIDIA
# Dynamo key requests by it, and echo it in their answers.
REQUEST_ID_HEADER = "X-Request-Id"

# The one name an abort template (TETHER_ABORT_URL, TETHER_ABORT_BODY) may use: the engine's
# request ID, `{internal_request_id}`.
ABORT_ID_NAME = "internal_request_id"
ABORT_ID_FIELD = f"{{{ABORT_ID_NAME}}}"

# Methods that never start generation: a client leaving one costs the engine nothing.
_READ_ONLY_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
# Methods a request may be sent again with (RFC 9110 §9.2.2, as aiohttp's client and nginx
# decide), unless its route starts generation.
_IDEMPOTENT_METHODS = frozenset({"GET", "HEAD", "OPTIONS", "PUT", "DELETE"})


class Settings(Protocol):
    """The settings engines read (`proxy.settings.Settings` has them all): configuration
    depends on what tether knows of engines, never the reverse."""

    @property
    def engine(self) -> str: ...  # the TETHER_ENGINE value (`proxy.engines.Engine`)
    @property
    def upstream_url(self) -> str: ...
    @property
    def abort_url(self) -> str | None: ...
    @property
    def abort_method(self) -> str: ...
    @property
    def abort_body(self) -> str | None: ...
    @property
    def blocked_paths(self) -> tuple[str, ...] | None: ...
    @property
    def allowed_paths(self) -> tuple[str, ...] | None: ...
    @property
    def sglang_rid_header(self) -> bool: ...


def _blocks_any(path: str, routes: tuple[str, ...]) -> bool:
    """Whether refusing `path` (a prefix, as `routes.is_blocked` matches) would refuse one of
    `routes`. A control route below a public one (llama.cpp's `/v1/chat/completions/control`)
    refuses only itself."""
    return any(route.startswith(path) for route in routes)


def template_fields(template: str) -> set[str]:
    """The names a format template replaces (`{{x}}` is literal text, not a field)."""
    return {name for _, name, _, _ in string.Formatter().parse(template) if name is not None}


@dataclass(frozen=True, slots=True)
class BodyField:
    """A JSON field tether sets to carry its ID (`{id}` is tether's ID); a dotted name is a
    field inside an object field (`parameters.rid`)."""

    name: str
    value: str = "{id}"
    # False: set only when the client sent the field (it must not survive), else leave the
    # body alone because the engine reads the ID from the header.
    always: bool = True
    # How the (innermost) field's name appears in a JSON body: `"name"` (looked for in every
    # body read whole, so made once).
    quoted_name: bytes = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        innermost = self.name.rpartition(".")[2]
        object.__setattr__(self, "quoted_name", b'"' + innermost.encode() + b'"')

    def id_in(self, value: str) -> str:
        """tether's ID in a value this field's template wrote (`resp_<id>` gives `<id>`); a
        value the template did not write (a client's own) is returned whole."""
        prefix, _, suffix = self.value.partition("{id}")
        written = value.startswith(prefix) and value.endswith(suffix)
        if written and len(value) > len(prefix) + len(suffix):
            return value[len(prefix) : len(value) - len(suffix)]
        return value


class _Array(Protocol):
    """An array member, counted without being built (`wire.json_members.JsonArray`)."""

    @property
    def length(self) -> int: ...
    @property
    def first(self) -> Any: ...


class _Members(Protocol):
    """A JSON body's top-level members, read by name (`wire.json_members.JsonMembers`)."""

    def kind(self, name: str, /) -> str | None: ...

    def array(self, name: str, /) -> _Array | None: ...


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
    # The `id` the engine's answer carries (`{id}` tether's ID) where it is not `engine_id`.
    # tether maps it back as it does any occurrence of its ID; the fake engines answer with it.
    response_id: str | None = None
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
    # The engine ignores every ID a client or tether gives it and answers with one it mints,
    # this prefix followed by its own random characters (llama.cpp's `chatcmpl-`): tether
    # learns it from the answer and writes the client's ID in its place.
    minted_id_prefix: str | None = None
    # What a complete stream on this route carries last (`data: [DONE]`): a stream of a
    # session the engine may hand to another request (llama.cpp's conversation) that ends
    # without it was cut, not completed. None: not checked.
    stream_end: bytes | None = None
    # A non-streaming request here is sent to the engine as a stream and its answer
    # assembled from the events (`wire.answer_assembly`): an engine that notices a client
    # that left only when it writes (llama-server) then notices at its next token.
    assembles_answer: bool = False
    # The body field in which a client names its request to the engine (vLLM's `request_id`,
    # SGLang's `rid`): the engine writes that name into its answer, so tether gives the
    # client its value back. None where the engine's ID is the client's handle for follow-up
    # calls (the Responses API), which tether makes unique instead. (Derived once: every
    # request on the route asks.)
    client_id_field: BodyField | None = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "client_id_field", self._client_id_field())

    def _client_id_field(self) -> BodyField | None:
        if not self.maps_id_back:
            return None
        if self.reads_client_id is not None:
            return self.reads_client_id
        return next((body for body in self.body_fields if body.value == "{id}"), None)

    def batch(self, body: _Members) -> int | None:
        """How many prompts the first `fan_out` field present in `body` holds as a list,
        counted without building it (a string or a list of token IDs is one prompt: None)."""
        for name in self.fan_out:
            if body.kind(name) in (None, "null"):
                continue
            prompts = body.array(name)
            if prompts is None or isinstance(prompts.first, int):  # token IDs: one prompt
                return None
            return prompts.length
        return None

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

    def answer_id(self, internal_request_id: str) -> str:
        """The `id` the engine's answer carries for a request it ran under tether's ID."""
        template = self.response_id or self.engine_id or "{id}"
        return template.format(id=internal_request_id)


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


# An engine tether knows no timings of.
UNKNOWN_CONFIRM = ConfirmRule(steps=4, floor=0.1)


@dataclass(frozen=True, slots=True)
class AbortCall:
    """One HTTP call that asks the engine to stop a request."""

    method: str
    url: str
    body: bytes | None


# Statuses meaning "this engine has no such route (in this mode)": try the next candidate.
# vLLM answers 404 on a route its flags leave out and 403 on the scale-out one while it is
# disabled (observed 0.32); LMDeploy answers 501 unless started with --enable-abort-handling;
# 405: a path the engine serves with other methods only.
ROUTE_MISSING = frozenset({403, 404, 405, 501})

# uvicorn closes an idle keep-alive connection after 5 s (its default, which vLLM and SGLang
# keep): tether closes its own idle ones sooner, so it never sends a request on a connection
# the engine is closing.
BELOW_UVICORN_KEEPALIVE = 4.0


class JsonRule(Protocol):
    """Which request bodies an engine's web framework parses as JSON."""

    # How much of a body's start `could_be_object` may need to decide.
    sniff_bytes: int

    def labelled(self, content_types: Sequence[str]) -> bool:
        """Whether these Content-Type values (all the engine gets) make it parse JSON."""
        ...

    def could_be_object(self, start: bytes, *, final: bool = True) -> bool | None:
        """Whether a body beginning with `start` could parse as a JSON object; None while
        `start` is too short to tell (only when not `final`)."""
        ...


class FastApiJson:
    """FastAPI's rule (vLLM and SGLang run FastAPI): a body without (or with an empty)
    Content-Type is parsed as JSON, releases before its strict checking parse any body, and a
    handler that calls `request.json()` ignores the label, so what a body is counts, not how
    it is labelled. `json.loads` is its parser: it detects the encoding from the first bytes
    (UTF-8, -16 or -32, a BOM)."""

    # Enough of a body's start to see its encoding and first character through leading
    # whitespace; a body that is only whitespace this far is read whole (bounded).
    sniff_bytes = 4096
    _WHITESPACE = " \t\r\n"

    def labelled(self, content_types: Sequence[str]) -> bool:
        """JSON, `+json`, or no label at all: FastAPI parses such a body as JSON."""
        if len(content_types) == 1 and content_types[0] == "application/json":
            return True  # what nearly every client sends, decided without a list
        labels = [value.partition(";")[0].strip().lower() for value in content_types]
        return not any(labels) or any(
            label == "application/json"
            or (label.startswith("application/") and label.endswith("+json"))
            for label in labels
        )

    def could_be_object(self, start: bytes, *, final: bool = True) -> bool | None:
        """Whitespace, then `{`, in the encoding `json.loads` would detect."""
        if len(start) < 4 and not final:
            return None
        text = start.decode(json.detect_encoding(start), errors="ignore").lstrip(self._WHITESPACE)
        if not text:
            return None if not final and len(start) < self.sniff_bytes else True
        return text[0] == "{"


FASTAPI_JSON = FastApiJson()


def refuse_templated_abort_url(settings: Settings) -> None:
    """For an engine whose abort route names requests in its body: TETHER_ABORT_URL (an
    override of that route) may not name the request."""
    if settings.abort_url is not None and ABORT_ID_NAME in template_fields(settings.abort_url):
        raise ValueError(
            f"TETHER_ABORT_URL may contain {ABORT_ID_FIELD} only when TETHER_ENGINE=generic "
            f"({settings.engine}'s abort route names requests in its body)"
        )


class EngineProfile(ABC):
    """The engine-specific rules, built once from the settings.

    Each engine's module subclasses it as `Profile` and states every fact declared here
    (tests/test_engine_profiles.py checks that none is left out); the methods below turn
    them, with the operator's settings, into what the request path asks for."""

    # --- what the engine's module states --------------------------------------------------

    # The routes tether knows: where its ID goes on each, which engine ID results, how the
    # responses carry tokens.
    routes: ClassVar[tuple[Route, ...]]
    # Fields a client's own ID must not survive in on routes outside `routes` (the engine
    # reads an ID from them everywhere).
    unknown_route_fields: ClassVar[tuple[BodyField, ...]]
    # The headers tether sets to its ID on every request (the engine keys requests by them).
    id_headers: ClassVar[tuple[str, ...]]
    # Engine control routes no client may reach (prefix match, `routes.normalised_path`).
    control_routes: ClassVar[tuple[str, ...]]
    # False for an engine tether has no table of: every known engine's control routes are
    # blocked in front of it.
    control_routes_complete: ClassVar[bool]
    # The routes a client of the engine uses (TETHER_ALLOWED_PATHS=public); () when unknown.
    public_routes: ClassVar[tuple[str, ...]]
    # Metric labels: routes that start generation, and the probes and scrapes routers and
    # monitors send to the serving port (labels of their own, never "other").
    generation_routes: ClassVar[frozenset[str]]
    probe_routes: ClassVar[frozenset[str]]
    # Whether the engine has an abort call at all, and whether one call names many requests.
    sends_aborts: ClassVar[bool]
    # The request header naming a session the engine runs on after its client's connection
    # closed (llama.cpp's X-Conversation-Id on a stream); None: no such sessions. The abort
    # call names a request carrying it by the header's value; a request without it, on an
    # engine with sessions, is stopped by the dropped connection alone.
    session_header: ClassVar[str | None]
    merges_aborts: ClassVar[bool]
    # How long an accepted abort takes to end the response.
    confirm_rule: ClassVar[ConfirmRule]
    # Statuses of an abort call meaning "no such route here": the next candidate is tried.
    route_missing_statuses: ClassVar[frozenset[int]]
    # The engine writes its system_fingerprint on a stream's finishing chunks, unless the
    # stream reports usage: then on the usage event alone.
    usage_takes_fingerprint: ClassVar[bool]
    # The engine counts a prompt once its prefill made the first token: a request ended
    # before that reports its prompt in `usage` but was never prefilled.
    prompt_counted_from_first_token: ClassVar[bool]
    # Which ID the engine writes into its answer when the client named one in the body and
    # one in the request-ID header: True for the body's.
    body_id_beats_header: ClassVar[bool]
    # The engine's abort stops every request whose ID starts with the one named (SGLang's
    # scheduler matches with `startswith`): IDs it runs by must be prefix-free.
    aborts_by_prefix: ClassVar[bool]
    # Which request bodies the engine parses as JSON.
    json_rule: ClassVar[JsonRule]
    # Seconds an idle pooled connection to the engine stays open: below its own keep-alive.
    keepalive_seconds: ClassVar[float]
    # The engine does not notice that a queued request's client left while other requests
    # produce results (llama-server's one-second wait, restarted by every result): tether
    # keeps generation requests beyond its slots in its own queue (TETHER_ENGINE_SLOTS).
    blind_while_queued: ClassVar[bool]
    # Path prefixes whose GET requests watch work that outlives its connection (a stored
    # background response: `GET /v1/responses/{id}`, streaming or not): a client leaving one
    # only stopped watching, so no abort is sent and the response is read to its end, as for
    # the POST with `"background": true` (a route fact, `may_run_in_background`).
    watch_paths: ClassVar[tuple[str, ...]]

    # --- built from the settings ------------------------------------------------------------

    def __init__(self, settings: Settings, engine: str, default_blocked: tuple[str, ...]) -> None:
        """`engine`: the name this profile goes by (`proxy.engines.Engine`); `default_blocked`:
        the control routes refused unless TETHER_BLOCKED_PATHS says otherwise (every known
        engine's: `proxy.engines.refused_control_routes`), less any that would refuse one
        of the engine's own public routes and those the operator names in
        TETHER_ALLOWED_PATHS."""
        self.engine = engine
        allowed = settings.allowed_paths
        named = () if allowed is None or allowed == (ALLOW_PUBLIC,) else allowed
        self.blocked_paths = settings.blocked_paths or tuple(
            path
            for path in default_blocked
            if not _blocks_any(path, self.public_routes)
            and not any(name.startswith(path) for name in named)
        )
        self.allowed_paths: tuple[str, ...] | None = (
            self.public_routes if allowed == (ALLOW_PUBLIC,) else allowed
        )
        self._upstream_url = settings.upstream_url
        self._abort_url = settings.abort_url
        self._routes = {route.path: route for route in self._route_table(settings)}
        # What the IDs of the engine's answers start with (`chatcmpl-`, `cmpl-`, `resp_`): a
        # client may name its request by the ID it saw.
        self.answer_prefixes = tuple(
            dict.fromkeys(
                prefix
                for route in self._routes.values()
                if (prefix := (route.response_id or route.engine_id or "{id}").partition("{id}")[0])
            )
        )

    @classmethod
    @abstractmethod
    def check_settings(cls, settings: Settings) -> None:
        """Raise ValueError, naming the variable to fix, where the settings do not fit the
        engine. Called by the settings' own validation, before the profile is built."""

    def _route_table(self, settings: Settings) -> tuple[Route, ...]:
        """The routes as the settings make them (an engine's option may change them)."""
        return self.routes

    def route(self, method: str, path: str) -> Route | None:
        """The route table entry for a request; None for read-only requests (nothing to
        abort) on routes outside the table."""
        known = self._routes.get(path.rstrip("/") or "/")
        if known is not None:
            return known
        return self._unknown_route(method, path)

    def replayable(self, method: str, path: str) -> bool:
        """Whether a request may be sent again on a new connection when a reused one closed
        before answering: an idempotent method on a route that does not start generation
        (SGLang's /generate takes PUT as well as POST: sent twice, it would run twice)."""
        if method not in _IDEMPOTENT_METHODS:
            return False
        path = path.rstrip("/") or "/"
        return path not in self._routes and path not in self.generation_routes

    def outlives_connection(self, method: str, path: str) -> bool:
        """Whether this request watches work meant to outlive its connection."""
        return method == "GET" and any(path.startswith(prefix) for prefix in self.watch_paths)

    def _unknown_route(self, method: str, path: str) -> Route | None:
        if method in _READ_ONLY_METHODS:
            return None
        # Anything else may start work tether cannot name: connection drop only.
        return Route(path, None, TokenShape.NONE, self.unknown_route_fields)

    def abort_calls(self, engine_request_ids: tuple[str, ...]) -> tuple[AbortCall, ...]:
        """Candidate calls, in order: the first the engine supports is the one to use.

        Never called with no ID: vLLM's dev route reads an empty list as "abort everything";
        with one ID unless the engine `merges_aborts` (SGLang and templates name one request).
        """
        assert len(engine_request_ids) == 1 or (engine_request_ids and self.merges_aborts)
        return self._abort_calls(engine_request_ids)

    @abstractmethod
    def _abort_calls(self, engine_request_ids: tuple[str, ...]) -> tuple[AbortCall, ...]: ...

    def _posts(self, built_in: tuple[str, ...], body: bytes) -> tuple[AbortCall, ...]:
        """`body` POSTed to each of the engine's abort routes, in order, or to the one
        TETHER_ABORT_URL names instead."""
        paths = (self._abort_url,) if self._abort_url is not None else built_in
        return tuple(AbortCall("POST", self._resolve(path), body) for path in paths)

    def _resolve(self, url_or_path: str) -> str:
        return self._upstream_url + url_or_path if url_or_path.startswith("/") else url_or_path
