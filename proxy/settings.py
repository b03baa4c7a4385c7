"""Every setting tether has, read from ``TETHER_*`` environment variables (and ``.env``).

No instance is created at import: ``__main__`` builds one, tests build their own.

One module for every setting (the longest file of the package but for the JSON scanner and
the engine connection): pydantic-settings reads them as one model, the cross-setting checks
need them side by side, and docs/configuration.md is generated from this one file.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from enum import StrEnum
from typing import Annotated, Any, Final, Literal
from urllib.parse import urlsplit

from pydantic import Field, SecretStr, ValidationError, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from . import engines
from .engines import (
    ABORT_ID_FIELD,
    ABORT_ID_NAME,
    ALLOW_PUBLIC,
    DEFAULT_ENGINE,
    Engine,
    EngineSettings,
    template_fields,
)

ENV_PREFIX = "TETHER_"

_HEADER_TOKEN = re.compile(r"^[!#$%&'*+\-.^_`|~0-9A-Za-z]+$")
_HTTP_METHODS = ("POST", "PUT", "PATCH", "DELETE", "GET")
_EVERY_ADDRESS = frozenset({"0.0.0.0", "::", ""})


def _one_of(choices: Sequence[str]) -> str:
    """`a, b or c`."""
    *others, last = choices
    return f"{', '.join(others)} or {last}" if others else last


class RequestIdMode(StrEnum):
    """What tether sends the engine as the request ID."""

    UNIQUE = "unique"  # a fresh internal ID per request; the client's is mapped back
    PRESERVE = "preserve"  # the client's (or router's) ID as is; duplicates in flight refused


class Tracing(StrEnum):
    AUTO = "auto"  # on when OTEL_EXPORTER_OTLP_ENDPOINT is set and the otel extra installed
    ON = "on"
    OFF: Final = "off"


class LogFormat(StrEnum):
    JSON = "json"
    CONSOLE = "console"


class LogLevel(StrEnum):
    DEBUG = "debug"
    INFO = "info"
    WARNING = "warning"
    ERROR = "error"


Seconds = Annotated[float, Field(gt=0)]
AUTO: Final = "auto"
WorkerCount = Annotated[int, Field(ge=1)] | Literal["auto"]
OFF = "off"
SlotCount = Annotated[int, Field(ge=1)] | Literal["auto", "off"]


class _SettingsHead(BaseSettings):
    """The settings `--help` lists first (where tether listens, where the engine is, how it
    is aborted), ahead of those the engines add (`engines.EngineSettings`) and the rest."""

    upstream_url: str = Field(
        description="Base URL of the engine, e.g. http://127.0.0.1:8000 (required)."
    )
    host: str = Field("0.0.0.0", description="Address clients connect to.")
    port: int = Field(
        8080, ge=0, le=65535, description="Port clients connect to (0: any free port)."
    )
    admin_host: str = Field(
        "127.0.0.1",
        description="Address of the admin port: loopback unless set (the image sets 0.0.0.0, "
        "where the kubelet's probes and Prometheus reach the pod's address).",
    )
    admin_port: int = Field(
        9090, ge=0, le=65535, description="Health, readiness, metrics and admin API."
    )
    engine: Engine = Field(
        DEFAULT_ENGINE,
        description=f"{_one_of(tuple(Engine))}: how to abort, where the ID goes; auto asks "
        "the engine what it is (at start-up and whenever it comes back) and, until it says, "
        "refuses every known engine's control routes and stops requests by dropping the "
        "connection. A configured engine the engine contradicts is a warning.",
    )
    engine_slots: SlotCount = Field(
        AUTO,
        description="For an engine that does not notice a queued request's client leaving "
        "(llama.cpp's server): how many requests it generates at once; tether keeps the "
        "generation requests beyond them waiting in its own queue, where a client that leaves "
        "is dropped before the engine sees its request. auto: the count the engine reports "
        "(llama-server's total_slots, its -np); off: every request goes straight to the "
        "engine's queue.",
    )
    abort_url: str | None = Field(
        None,
        description="Abort call: absolute URL or a path on the upstream. Required for generic "
        "(where it may name {internal_request_id}, URL-quoted); overrides the built-in route "
        "for vllm and sglang.",
    )
    abort_method: str = Field("POST", description="HTTP method of the abort call.")
    abort_body: str | None = Field(
        None,
        description="Body template of the abort call for generic; {internal_request_id} is "
        "replaced by tether's ID.",
    )


class Settings(EngineSettings, _SettingsHead):
    """tether's configuration. Every field is the env var ``TETHER_<FIELD NAME>``."""

    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX,
        env_file=".env",
        extra="ignore",
        frozen=True,
        hide_input_in_errors=True,
        # Helm and compose render unset values as empty strings: empty means "use the
        # default", never "empty the block list" or "an empty admin token".
        env_ignore_empty=True,
    )

    upstream_admin_key: SecretStr | None = Field(
        None, description="Sent as a bearer token on abort calls (SGLang admin key)."
    )
    admin_token: SecretStr | None = Field(
        None,
        description="Bearer token for the admin API (GET /admin/requests, POST /admin/abort); "
        "unset refuses it.",
    )
    request_id_header: str = Field("X-Request-Id", description="The header clients use.")
    request_id_mode: RequestIdMode = Field(
        RequestIdMode.UNIQUE,
        description="unique: a fresh ID per request upstream, the client's mapped back; "
        "preserve: the client's ID upstream unchanged (P/D pairs, router-assigned IDs), a "
        "second one in flight refused with 409.",
    )
    cancel_credential_header: str | None = Field(
        None,
        description="The header that names a request's caller for cancel by ID (POST "
        "/v1/requests/{id}/cancel, GET /v1/requests): only a request with the same value "
        "cancels or lists it. Unset: Authorization, else api-key, else x-api-key. tether keeps "
        "a keyed hash of the value, never the value.",
    )
    cancel_without_credential: bool = Field(
        False,
        description="Let a caller that sends no credential cancel and list requests that "
        "carried none (client-chosen IDs are guessable: only where every client is trusted).",
    )
    connect_timeout: Seconds = Field(5.0, description="Seconds to connect upstream.")
    request_timeout: Seconds | None = Field(
        None, description="Seconds a whole request may take; unset means no limit."
    )
    stream_idle_timeout: Seconds | None = Field(
        None,
        description="Seconds of upstream silence allowed mid-response (reset by every byte the "
        "engine sends; apart from TETHER_REQUEST_TIMEOUT, so a long stream that keeps sending "
        "is never cut by it); unset: no limit.",
    )
    sse_keepalive: Seconds | None = Field(
        None,
        description="Seconds of silence after which tether writes an SSE comment line "
        "(': keep-alive') to a client whose generation request asked to stream, so that load "
        "balancers that cut idle connections (AWS ALB 60 s, Envoy 15 s, nginx "
        "proxy_read_timeout) keep its stream. Before the engine's response head this starts "
        "the client's 200 text/event-stream early: an engine error then arrives as one error "
        "event (see Streams through load balancers). Unset: off.",
    )
    sse_keepalive_skip_paths: Annotated[tuple[str, ...], NoDecode] = Field(
        (),
        description="Comma-separated paths (whole segments) whose streams get no SSE "
        "keep-alive (for clients that must see the engine's HTTP status).",
    )
    resume_grace: Seconds | None = Field(
        None,
        description="Seconds a streamed answer outlives its client's connection, held for the "
        "same caller to resume (GET /v1/requests/<id>/stream with Last-Event-ID); each event "
        "then carries an id line. Unset: off, the engine's work is stopped at once.",
    )
    resume_buffer: int = Field(
        1024 * 1024,
        gt=0,
        description="Bytes of one stream's events held for a resume (past it the oldest go "
        "while its client reads; a stream held for a resume is stopped).",
    )
    resume_buffer_total: int = Field(
        64 * 1024 * 1024,
        gt=0,
        description="Bytes of events held for resumes by all streams of one process together "
        "(with TETHER_WORKERS above 1: of each worker).",
    )
    client_header_timeout: Seconds = Field(
        60.0,
        description="Seconds a client connection may go without a complete request head: "
        "bounds slow senders and idle keep-alive connections alike.",
    )
    client_body_timeout: Seconds = Field(
        30.0, description="Seconds a client may go silent while sending its request body."
    )
    abort_timeout: Seconds = Field(2.0, description="Seconds one abort attempt may take.")
    abort_deadline: Seconds = Field(
        5.0, description="Seconds all attempts of one abort (retries included) may take."
    )
    abort_confirm_timeout: Seconds = Field(
        2.0,
        description="Seconds after a disconnect within which an abort may still be confirmed "
        "and its call repeated. tether keeps reading the engine's response only for the "
        "confirm window (the engine's steps to act on an abort, at least 50 ms), never longer "
        "than this; then the connection is dropped.",
    )
    abort_repeat_delay: float = Field(
        0.02,
        ge=0,
        description="While the engine's response goes on after an accepted abort (it may have "
        "overtaken its request, or reached a front-end process that does not hold it), the "
        "call is repeated on a fresh connection after this many seconds, then at doubling "
        "intervals until the confirm timeout; 0 disables the repeats.",
    )
    workers: WorkerCount = Field(
        1,
        description="Processes serving the client port (the kernel spreads connections over "
        "them, SO_REUSEPORT), under one supervisor that owns the admin port and sums their "
        "answers; auto: the CPUs the container may use (affinity, capped by the cgroup's "
        "CPU quota). 1 is one process without a supervisor. Not with "
        "TETHER_REQUEST_ID_MODE=preserve, whose in-flight check must see every request.",
    )
    shutdown_grace: float = Field(
        30.0,
        ge=0,
        description="Seconds in-flight requests may finish after SIGTERM before being aborted.",
    )
    ask_for_usage: bool = Field(
        True,
        description="On streams whose client did not ask for usage (OpenAI chat and "
        "completions on vLLM and SGLang), ask the engine for it (stream_options.include_usage) "
        "and take the usage event out of what the client receives: exact token counts for "
        "every request, abandoned ones included.",
    )
    upstream_health_path: str = Field("/health", description="Engine path polled for readiness.")
    health_interval: Seconds = Field(2.0, description="Seconds between readiness checks.")
    blocked_paths: Annotated[tuple[str, ...] | None, NoDecode] = Field(
        None,
        description="Comma-separated engine control routes refused with 403 (prefix match); "
        "unset: the engine's built-in list, read from its route table.",
    )
    allowed_paths: Annotated[tuple[str, ...] | None, NoDecode] = Field(
        None,
        description="Comma-separated paths (whole segments: /v1/responses covers "
        "/v1/responses/<id>) that alone are forwarded, others refused with 403; public: the "
        "engine's inference and read-only routes (vllm, sglang); unset: every path not blocked.",
    )
    max_request_head: int = Field(
        32 * 1024,
        gt=0,
        description="Largest request head (bytes: the request line and every header line "
        "together); a larger one is refused with 431 and never reaches the engine. One line "
        "over 16 KiB, or over 128 headers, is refused (400) before this is counted.",
    )
    max_json_body: int = Field(
        32 * 1024 * 1024,
        gt=0,
        description="Largest JSON request body (bytes) tether reads to write its ID into.",
    )
    max_engine_requests: int = Field(
        256,
        ge=1,
        description="Most engine requests one client request may start where tether reads "
        "them from its body (the prompts of a batch times its n samples); more is refused "
        "with 400. Each may have to be named in an abort call, so the bound keeps a client "
        "from multiplying abort calls and their size.",
    )
    max_streamed_uploads: int = Field(
        64,
        gt=0,
        description="Requests that may hold an engine connection at once while their body "
        "still arrives (a body tether streams through rather than reads whole) or their "
        "WebSocket handshake awaits the engine's answer; more are refused with 503 and "
        "Retry-After, and never reach the engine. Per process (each of TETHER_WORKERS).",
    )
    tcp_keepalive_idle: int = Field(
        30,
        ge=1,
        description="Seconds of client silence before TCP keepalive probes look for a "
        "vanished peer; one that answers no probe, or acknowledges none of a stream's data, "
        "for this plus 3 probe intervals (idle/3 each; 60 s by default) is gone.",
    )
    fleet_dns: str | None = Field(
        None,
        description="Name whose A/AAAA records are every replica's admin address (a headless "
        "Service), as name or name:port (default port: TETHER_ADMIN_PORT), for fleet-wide "
        "aborts.",
    )
    fleet_peers: Annotated[tuple[str, ...], NoDecode] = Field(
        (),
        description="Comma-separated host:port admin addresses of the other replicas, for "
        "fleet-wide aborts (compose, tests).",
    )
    replica_name: str | None = Field(
        None,
        description="Name this replica gives in fleet-wide aborts (default: the host name, "
        "which is the pod's name in Kubernetes).",
    )
    fleet_timeout: Seconds = Field(
        1.0, description="Seconds one replica may take to answer a fleet-wide abort."
    )
    tracing: Tracing = Field(
        Tracing.AUTO,
        description="auto, on or off: OpenTelemetry spans (pip install 'tether[otel]'; "
        "configured by the standard OTEL_* variables); auto is on when "
        "OTEL_EXPORTER_OTLP_ENDPOINT is set.",
    )
    log_format: LogFormat = Field(LogFormat.JSON, description="json or console.")
    log_level: LogLevel = Field(LogLevel.INFO, description="debug, info, warning or error.")

    @field_validator(
        "engine", "log_format", "log_level", "request_id_mode", "tracing", mode="before"
    )
    @classmethod
    def _case_insensitive_choice(cls, value: Any) -> Any:
        return value.lower() if isinstance(value, str) else value

    @field_validator("workers", mode="before")
    @classmethod
    def _count_or_auto(cls, value: Any) -> Any:
        return _count_or_word(value, (AUTO,))

    @field_validator("engine_slots", mode="before")
    @classmethod
    def _count_auto_or_off(cls, value: Any) -> Any:
        return _count_or_word(value, (AUTO, OFF))

    @field_validator("admin_token", "upstream_admin_key")
    @classmethod
    def _non_empty_secret(cls, value: SecretStr | None) -> SecretStr | None:
        if value is not None and not value.get_secret_value().strip():
            raise ValueError("must not be blank; leave it unset instead")
        return value

    @field_validator("upstream_url")
    @classmethod
    def _http_base_url(cls, value: str) -> str:
        parts = urlsplit(value)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError("must be an http:// or https:// URL with a host")
        if parts.query or parts.fragment:
            raise ValueError("must not carry a query or fragment")
        try:
            parts.port  # noqa: B018 - raises on a malformed port
        except ValueError as exc:
            raise ValueError(f"has an invalid port: {exc}") from None
        return value.rstrip("/")

    @field_validator("abort_url")
    @classmethod
    def _url_or_path(cls, value: str | None) -> str | None:
        if value is None or value.startswith("/"):
            return value
        parts = urlsplit(value)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError("must be an http(s) URL or a path starting with /")
        return value

    @field_validator("abort_method")
    @classmethod
    def _known_method(cls, value: str) -> str:
        method = value.upper()
        if method not in _HTTP_METHODS:
            raise ValueError(f"must be one of {', '.join(_HTTP_METHODS)}")
        return method

    @field_validator("abort_url", "abort_body")
    @classmethod
    def _template_names_only_the_id(cls, value: str | None) -> str | None:
        if value is None:
            return value
        unknown = template_fields(value) - {ABORT_ID_NAME}
        if unknown:
            raise ValueError(
                f"may only use {ABORT_ID_FIELD}, found {{{sorted(unknown)[0]}}} "
                "(write literal braces as {{ and }})"
            )
        return value

    @field_validator("request_id_header", "cancel_credential_header")
    @classmethod
    def _header_name(cls, value: str | None) -> str | None:
        if value is not None and not _HEADER_TOKEN.match(value):
            raise ValueError("must be a valid HTTP header name")
        return value

    @field_validator("upstream_health_path")
    @classmethod
    def _absolute_path(cls, value: str) -> str:
        if not value.startswith("/"):
            raise ValueError("must start with /")
        return value

    @field_validator(
        "blocked_paths", "allowed_paths", "sse_keepalive_skip_paths", "fleet_peers", mode="before"
    )
    @classmethod
    def _comma_separated(cls, value: Any) -> Any:
        if isinstance(value, str):
            value = [part.strip() for part in value.split(",") if part.strip()]
        return value

    @field_validator("blocked_paths", "allowed_paths")
    @classmethod
    def _are_paths(cls, value: tuple[str, ...] | None) -> tuple[str, ...] | None:
        if value is None:
            return value
        if not value:
            raise ValueError("must name at least one path; leave it unset for the default")
        if value == (ALLOW_PUBLIC,):
            return value
        return _normalised_paths(value, "(or the whole value be public)")

    @field_validator("sse_keepalive_skip_paths")
    @classmethod
    def _are_skipped_paths(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        return _normalised_paths(value)

    def secret_values(self) -> tuple[str, ...]:
        """The configured credentials, which must never appear in a log line."""
        return tuple(
            secret.get_secret_value()
            for secret in (self.admin_token, self.upstream_admin_key)
            if secret is not None
        )

    @field_validator("fleet_peers")
    @classmethod
    def _host_ports(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        for peer in value:
            _split_host_port(peer, required=True)
        return value

    @field_validator("fleet_dns")
    @classmethod
    def _dns_name(cls, value: str | None) -> str | None:
        if value is not None:
            _split_host_port(value, required=False)
        return value

    @model_validator(mode="after")
    def _consistent(self) -> Settings:
        if self.port == self.admin_port != 0 and _addresses_overlap(self.host, self.admin_host):
            raise ValueError("TETHER_PORT and TETHER_ADMIN_PORT must differ")
        engines.check_settings(self)  # what the engine itself requires or refuses
        if self.blocked_paths == (ALLOW_PUBLIC,):
            raise ValueError("TETHER_BLOCKED_PATHS: 'public' is a value of TETHER_ALLOWED_PATHS")
        if (
            self.allowed_paths == (ALLOW_PUBLIC,)
            and self.engine not in engines.with_public_routes()
        ):
            raise ValueError(
                f"TETHER_ALLOWED_PATHS=public needs TETHER_ENGINE="
                f"{_one_of(engines.with_public_routes())} (tether has no route table of "
                f"{self.engine.value}); list the paths instead"
            )
        if self.request_id_mode is RequestIdMode.PRESERVE and self.workers != 1:
            raise ValueError(
                "TETHER_REQUEST_ID_MODE=preserve needs TETHER_WORKERS=1: its check that no "
                "other request with the same ID is in flight sees one process's requests "
                "only, and a duplicate on another worker would share the engine's ID (its "
                "client leaving would abort the other's request)"
            )
        if self.resume_buffer > self.resume_buffer_total:
            raise ValueError("TETHER_RESUME_BUFFER must not exceed TETHER_RESUME_BUFFER_TOTAL")
        if self.abort_timeout > self.abort_deadline:
            raise ValueError("TETHER_ABORT_TIMEOUT must not exceed TETHER_ABORT_DEADLINE")
        return self


def _count_or_word(value: Any, words: tuple[str, ...]) -> Any:
    """A whole number of at least 1 from the environment's text, or one of `words`."""
    if isinstance(value, str):
        value = value.strip().lower()
        if value in words:
            return value
        if not value.isdigit() or int(value) < 1:
            raise ValueError(f"must be a whole number of at least 1, or {_one_of(words)}")
        return int(value)
    return value


def _normalised_paths(paths: tuple[str, ...], otherwise: str = "") -> tuple[str, ...]:
    """Paths as `wire.routes` matches them (lower case, no trailing slash); each must be
    absolute."""
    for path in paths:
        if not path.startswith("/"):
            raise ValueError(f"{path!r} must start with / {otherwise}".rstrip())
    return tuple(path.rstrip("/").lower() or "/" for path in paths)


def _addresses_overlap(host: str, other: str) -> bool:
    """Whether listening on both addresses with one port would collide: the same address, or
    either one every address (`0.0.0.0`, `::`, which takes IPv4 too)."""
    return host == other or bool({host, other} & _EVERY_ADDRESS)


def _split_host_port(value: str, *, required: bool) -> tuple[str, int | None]:
    """`host:port` (`[v6]:port` for IPv6) or, unless `required`, a bare host."""
    parts = urlsplit(f"//{value}")
    try:
        port = parts.port
    except ValueError:
        raise ValueError(f"{value!r} has an invalid port") from None
    if not parts.hostname or (required and port is None):
        raise ValueError(f"{value!r} must be host:port")
    return parts.hostname, port


def split_host_port(value: str, default_port: int) -> tuple[str, int]:
    """A validated `host[:port]` setting as (host, port)."""
    host, port = _split_host_port(value, required=False)
    return host, port if port is not None else default_port


def env_var(field_name: str) -> str:
    return f"{ENV_PREFIX}{field_name.upper()}"


def describe_errors(error: ValidationError) -> list[str]:
    """One line per problem, each naming the environment variable to fix."""
    lines = []
    for problem in error.errors():
        message = problem["msg"].removeprefix("Value error, ")
        if problem["loc"]:
            name = env_var(str(problem["loc"][0]))
            if problem["type"] == "missing":
                message = "is required"
            lines.append(f"{name}: {message}")
        else:
            lines.append(message)
    return lines


def describe_settings() -> str:
    """The table `tether --help` prints: every variable, its default and meaning."""
    rows = []
    for name, field in Settings.model_fields.items():
        if field.is_required():
            default = "(required)"
        elif isinstance(field.default, tuple):
            default = ",".join(field.default) if len(field.default) < 4 else "(built-in list)"
        elif field.default is None:
            default = "(unset)"
        else:
            default = str(field.default)
        rows.append((env_var(name), default, field.description or ""))
    width = max(len(row[0]) for row in rows)
    default_width = max(len(row[1]) for row in rows)
    return "\n".join(
        f"  {var:<{width}}  {default:<{default_width}}  {text}" for var, default, text in rows
    )
