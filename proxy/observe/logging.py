"""structlog set-up: tether's events and aiohttp's own loggers rendered the same way, and
nothing in them that must not leave the pod.

Logs are shipped to third-party systems, so no record carries a prompt, a completion or a
credential: tracebacks are rendered without local variables (the request path's locals hold
bodies and headers, the abort path's the engine's admin key), and a redaction step masks
credential fields, drops body fields, and masks bearer tokens, URL user-info and the
configured secrets wherever they appear in a string (a secret as a whole value, never inside
a longer word), in tether's records and in aiohttp's and asyncio's alike.
"""

from __future__ import annotations

import asyncio
import atexit
import functools
import json
import logging
import re
import select
import sys
import threading
import time
from collections.abc import Iterable, Mapping
from contextvars import ContextVar
from enum import Enum
from typing import Any, TextIO

import structlog
from aiohttp.http_exceptions import HttpProcessingError

from ..settings import LogFormat, LogLevel

REDACTED = "[redacted]"
# Field names (lower-cased, `-` read as `_`) whose values are credentials.
_CREDENTIAL_FIELDS = frozenset(
    {
        "authorization",
        "proxy_authorization",
        "cookie",
        "set_cookie",
        "x_api_key",
        "api_key",
        "apikey",
        "token",
        "admin_token",
        "upstream_admin_key",
        "password",
        "secret",
    }
)
# Field names that would carry what users wrote or what the model answered.
_CONTENT_FIELDS = frozenset(
    {
        "body",
        "request_body",
        "response_body",
        "payload",
        "prompt",
        "messages",
        "input",
        "completion",
        "content",
    }
)
_CONTAINERS = frozenset({dict, list, tuple})
# The request a line belongs to: (client ID, internal ID), set once per request task.
_REQUEST_IDS: ContextVar[tuple[str, str] | None] = ContextVar("tether_request_ids", default=None)
_BEARER = re.compile(r"(?i)\b(bearer|basic)\s+[^\s,;\"']+")
# A configured secret is masked only where it stands as a whole value: a letter or digit
# right beside it, or beyond one of the characters a token holds inside it (RFC 6750's
# b64token: `-._~+/`, and `=` padding after it), makes it part of a longer word, which a
# short secret (`abc` in `fabcde`) must not mangle. A `=` before it is a separator
# (`?key=abc`).
_WORD_BEFORE = r"(?<![A-Za-z0-9])(?<![A-Za-z0-9][-._~+/])"
_WORD_AFTER = r"(?![A-Za-z0-9])(?![-._~+/=][A-Za-z0-9])"
_URL_USERINFO = re.compile(r"(?i)\b([a-z][a-z0-9+.-]*://)[^/@\s\"']+@")


def configure_logging(
    log_format: LogFormat,
    level: LogLevel,
    secrets: Iterable[str] = (),
    worker: int | None = None,
) -> None:
    """`worker`: the index of the supervisor's worker this process is, named on every line
    (the workers share one stdout)."""
    numeric_level = logging.getLevelName(level.value.upper())
    redact = Redactor(secrets)
    # Each step is on the one line per request, so each is the cheap form of structlog's own
    # (its merge_contextvars, TimeStamper and JSONRenderer cost 3-16 µs apiece there).
    shared: list[structlog.types.Processor] = [
        _add_request_ids,
        structlog.processors.add_log_level,
        _UtcTimestamp(),
    ]
    if worker is not None:
        shared.append(_WorkerIndex(worker))
    renderer: structlog.types.Processor
    if log_format is LogFormat.JSON:
        renderer = render_json
        shared.append(
            structlog.processors.ExceptionRenderer(
                structlog.tracebacks.ExceptionDictTransformer(show_locals=False)
            )
        )
    else:
        renderer = structlog.dev.ConsoleRenderer(
            colors=sys.stdout.isatty(), exception_formatter=structlog.dev.plain_traceback
        )
    shared.append(redact)
    renderer = redact.masking(renderer)
    output = LoopTurnLines(sys.stdout)
    atexit.register(output.write_pending)
    structlog.configure(
        processors=[*shared, renderer],
        wrapper_class=structlog.make_filtering_bound_logger(numeric_level),
        logger_factory=structlog.WriteLoggerFactory(output),  # type: ignore[arg-type]
        cache_logger_on_first_use=True,
    )
    # aiohttp, asyncio and anything else on stdlib logging: same renderer, same stream, same
    # redaction (their messages can quote raw protocol bytes).
    handler = logging.StreamHandler(output)
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(
            foreign_pre_chain=[structlog.stdlib.add_logger_name, *shared],
            processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, renderer],
        )
    )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(numeric_level)
    # tether writes its own line per request; aiohttp's access log would repeat it.
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)
    logging.getLogger("aiohttp.server").addFilter(_MalformedRequestsAreInfo())


class LoopTurnLines:
    """The log's stream: lines written on the event loop's thread wait for the end of the
    loop's turn, then all of that turn's lines go out in one write. A line per request (at
    `info`) would otherwise be a write system call per request, the dearest step of logging
    it. Lines from other threads (the span exporter's), or with no loop running, are written
    at once; the lines still waiting are written at exit."""

    # structlog keeps a lock per stream, by weak reference.
    __slots__ = ("__weakref__", "_pending", "_scheduled_on", "_stream")

    def __init__(self, stream: TextIO) -> None:
        self._stream = stream
        self._pending: list[str] = []
        # The loop whose turn ends with a write of the pending lines, if one is scheduled.
        self._scheduled_on: asyncio.AbstractEventLoop | None = None

    def write(self, text: str) -> int:
        loop = asyncio._get_running_loop()
        if loop is None:
            if self._pending and threading.current_thread() is threading.main_thread():
                self.write_pending()  # the loop has stopped: its lines come first
            self._write(text)
        else:
            self._pending.append(text)
            if self._scheduled_on is not loop:
                self._scheduled_on = loop
                loop.call_soon(self.write_pending)
        return len(text)

    def flush(self) -> None:
        """Asked after every record: the write is the loop turn's (see `write`)."""

    def write_pending(self) -> None:
        """The waiting lines, in writes a pipe keeps whole: workers of one supervisor share
        the stream, and a write up to PIPE_BUF bytes is never interleaved with another's
        (JSON lines are ASCII, a character a byte)."""
        self._scheduled_on = None
        batch: list[str] = []
        size = 0
        for line in self._pending:
            if batch and size + len(line) > select.PIPE_BUF:
                self._write("".join(batch))
                batch, size = [], 0
            batch.append(line)
            size += len(line)
        self._pending.clear()
        if batch:
            self._write("".join(batch))

    def _write(self, text: str) -> None:
        self._stream.write(text)
        self._stream.flush()


def bind_request_ids(client_request_id: str, internal_request_id: str) -> None:
    """Name the request on every line logged from here on in this task (and the tasks it
    starts, which copy its context)."""
    _REQUEST_IDS.set((client_request_id, internal_request_id))


def _add_request_ids(
    _logger: object, _method: str, event: structlog.types.EventDict
) -> structlog.types.EventDict:
    ids = _REQUEST_IDS.get()
    if ids is not None:
        event.setdefault("internal_request_id", ids[1])
        event.setdefault("client_request_id", ids[0])
    return event


class _WorkerIndex:
    """`worker=<index>` on every line."""

    __slots__ = ("_index",)

    def __init__(self, index: int) -> None:
        self._index = index

    def __call__(
        self, _logger: object, _method: str, event: structlog.types.EventDict
    ) -> structlog.types.EventDict:
        event["worker"] = self._index
        return event


class _UtcTimestamp:
    """`timestamp` as structlog's TimeStamper(fmt="iso", utc=True) writes it
    (`2026-12-01T12:42:36.818843Z`), with the date and time formatted once per second."""

    __slots__ = ("_formatted",)

    def __init__(self) -> None:
        # (second, its text) in one attribute: a thread logging beside the loop's (the
        # tracing exporter's) reads a pair that belongs together.
        self._formatted = (-1, "")

    def __call__(
        self, _logger: object, _method: str, event: structlog.types.EventDict
    ) -> structlog.types.EventDict:
        now = time.time()
        second = int(now)
        cached_second, prefix = self._formatted
        if second != cached_second:
            prefix = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(second))
            self._formatted = (second, prefix)
        event["timestamp"] = f"{prefix}.{int((now - second) * 1_000_000):06d}Z"
        return event


# One encoder for every line (json.dumps builds a new one per call when given `default`);
# anything JSON has no form for is written as its repr, as structlog's renderer does.
_JSON_ENCODER = json.JSONEncoder(default=repr)


def render_json(_logger: object, _method: str, event: structlog.types.EventDict) -> str:
    """The record as one line of JSON."""
    return _JSON_ENCODER.encode(event)


class Redactor:
    """Keeps credentials and content out of every record, in two steps that stay cheap on the
    one line per request: as a processor, it drops content fields and masks credential
    fields by name (names are classified once), and leaves out fields that do not apply
    (None, e.g. `error` on a request that completed); `masking(renderer)` then masks bearer
    tokens, URL user-info and the configured secrets (whole values: a short token must not
    mangle the words that contain it) in the rendered line, looking for them only where a
    plain substring test says they could be."""

    def __init__(self, secrets: Iterable[str]) -> None:
        # Longest first, so a secret that contains another is masked whole.
        self._secrets = [
            (secret, _whole_value(secret))
            for secret in sorted({secret for secret in secrets if secret}, key=len, reverse=True)
        ]
        # Field names already classified plain: a record with only those and no nested
        # values (tether's own lines, nearly always) needs no look at each field.
        self._plain: set[str] = set()

    def __call__(
        self, _logger: object, _method: str, event: structlog.types.EventDict
    ) -> structlog.types.EventDict:
        # (Both tests in C: on the line per request a generator over the values cost more
        # than the rest of this step.)
        if self._plain.issuperset(event) and _CONTAINERS.isdisjoint(map(type, event.values())):
            return {key: value for key, value in event.items() if value is not None}
        return self._clean(event, top_level=True)

    def _clean(self, fields: Mapping[str, Any], *, top_level: bool) -> dict[str, Any]:
        clean: dict[str, Any] = {}
        for key, value in fields.items():
            kind = _field_kind(key)
            if kind is _Field.CONTENT:
                continue
            if kind is _Field.CREDENTIAL:
                clean[key] = REDACTED
                continue
            if top_level:
                if len(self._plain) < _MAX_PLAIN_NAMES:
                    self._plain.add(key)
                if value is None:  # a field that does not apply; inside a value, None is data
                    continue
            if value.__class__ is dict:
                clean[key] = self._clean(value, top_level=False)
            elif value.__class__ is list or value.__class__ is tuple:
                clean[key] = [
                    self._clean(item, top_level=False) if item.__class__ is dict else item
                    for item in value
                ]
            else:
                clean[key] = value
        return clean

    def mask(self, text: str) -> str:
        """`text` with every secret it quotes masked."""
        for secret, whole_value in self._secrets:
            if secret in text:
                text = whole_value.sub(REDACTED, text)
        if "://" in text:
            text = _URL_USERINFO.sub(rf"\1{REDACTED}@", text)
        lowered = text.lower()
        if "bearer" in lowered or "basic" in lowered:
            text = _BEARER.sub(rf"\1 {REDACTED}", text)
        return text

    def masking(self, renderer: structlog.types.Processor) -> structlog.types.Processor:
        """`renderer`, whose output goes through `mask`."""

        def render(logger: object, method: str, event: structlog.types.EventDict) -> str | bytes:
            line = renderer(logger, method, event)
            assert isinstance(line, str)  # tether's renderers (JSON, console) render text
            return self.mask(line)

        return render


def _whole_value(secret: str) -> re.Pattern[str]:
    """`secret` wherever it is not part of a longer word (its ends bounded only where they
    are word characters: a secret ending in `!` is masked before anything)."""
    before = _WORD_BEFORE if secret[0].isascii() and secret[0].isalnum() else ""
    after = _WORD_AFTER if secret[-1].isascii() and secret[-1].isalnum() else ""
    return re.compile(before + re.escape(secret) + after)


class _Field(Enum):
    PLAIN = 0
    CREDENTIAL = 1
    CONTENT = 2


_MAX_PLAIN_NAMES = 4096  # records with keys beyond these take the field-by-field path


@functools.lru_cache(maxsize=4096)
def _field_kind(key: str) -> _Field:
    name = key.lower().replace("-", "_")
    if name in _CONTENT_FIELDS:
        return _Field.CONTENT
    if name in _CREDENTIAL_FIELDS:
        return _Field.CREDENTIAL
    return _Field.PLAIN


class _MalformedRequestsAreInfo(logging.Filter):
    """aiohttp logs a request it cannot parse as an error with a traceback; it is the
    client's fault, so it becomes one info line (kept only where info is enabled)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info is None or not isinstance(record.exc_info[1], HttpProcessingError):
            return True
        record.levelno, record.levelname = logging.INFO, "INFO"
        record.msg = f"{record.getMessage()}: {record.exc_info[1]}"
        record.args, record.exc_info, record.exc_text = None, None, None
        return logging.getLogger().isEnabledFor(logging.INFO)
