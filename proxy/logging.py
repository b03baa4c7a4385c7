"""structlog set-up: tether's events and aiohttp's own loggers rendered the same way, and
nothing in them that must not leave the pod.

Logs are shipped to third-party systems, so no record carries a prompt, a completion or a
credential: tracebacks are rendered without local variables (the request path's locals hold
bodies and headers, the abort path's the engine's admin key), and a redaction step masks
credential fields, drops body fields, and masks bearer tokens, URL user-info and the
configured secrets wherever they appear in a string, in tether's records and in aiohttp's and
asyncio's alike.
"""

from __future__ import annotations

import functools
import logging
import re
import sys
from collections.abc import Iterable
from enum import Enum

import structlog
from aiohttp.http_exceptions import HttpProcessingError

from .settings import LogFormat, LogLevel

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
_BEARER = re.compile(r"(?i)\b(bearer|basic)\s+[^\s,;\"']+")
_URL_USERINFO = re.compile(r"(?i)\b([a-z][a-z0-9+.-]*://)[^/@\s\"']+@")


def configure_logging(log_format: LogFormat, level: LogLevel, secrets: Iterable[str] = ()) -> None:
    numeric_level = logging.getLevelName(level.value.upper())
    redact = Redactor(secrets)
    shared: list[structlog.types.Processor] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    renderer: structlog.types.Processor
    if log_format is LogFormat.JSON:
        renderer = structlog.processors.JSONRenderer()
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
    structlog.configure(
        processors=[*shared, _drop_none, renderer],
        wrapper_class=structlog.make_filtering_bound_logger(numeric_level),
        logger_factory=structlog.WriteLoggerFactory(sys.stdout),
        cache_logger_on_first_use=True,
    )
    # aiohttp, asyncio and anything else on stdlib logging: same renderer, same stream, same
    # redaction (their messages can quote raw protocol bytes).
    handler = logging.StreamHandler(sys.stdout)
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


class Redactor:
    """Keeps credentials and content out of every record, in two steps that stay cheap on the
    one line per request: as a processor, it drops content fields and masks credential
    fields by name (names are classified once); `masking(renderer)` then masks bearer
    tokens, URL user-info and the configured secrets in the rendered line, looking for them
    only where a plain substring test says they could be."""

    def __init__(self, secrets: Iterable[str]) -> None:
        # Longest first, so a secret that contains another is masked whole.
        self._secrets = sorted({secret for secret in secrets if secret}, key=len, reverse=True)

    def __call__(
        self, _logger: object, _method: str, event: structlog.types.EventDict
    ) -> structlog.types.EventDict:
        clean: structlog.types.EventDict = {}
        for key, value in event.items():
            kind = _field_kind(key)
            if kind is _Field.CONTENT:
                continue
            if kind is _Field.CREDENTIAL:
                clean[key] = REDACTED
            elif value.__class__ is dict:
                clean[key] = self(None, "", value)
            elif value.__class__ is list or value.__class__ is tuple:
                clean[key] = [
                    self(None, "", item) if item.__class__ is dict else item for item in value
                ]
            else:
                clean[key] = value
        return clean

    def mask(self, text: str) -> str:
        """`text` with every secret it quotes masked."""
        for secret in self._secrets:
            if secret in text:
                text = text.replace(secret, REDACTED)
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


class _Field(Enum):
    PLAIN = 0
    CREDENTIAL = 1
    CONTENT = 2


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


def _drop_none(
    _logger: object, _method: str, event: structlog.types.EventDict
) -> structlog.types.EventDict:
    """Leave out fields that do not apply (e.g. `error` on a request that completed)."""
    return {key: value for key, value in event.items() if value is not None}
