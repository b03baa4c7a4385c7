"""structlog set-up: tether's events and aiohttp's own loggers rendered the same way."""

from __future__ import annotations

import logging
import sys

import structlog
from aiohttp.http_exceptions import HttpProcessingError

from .settings import LogFormat, LogLevel


def configure_logging(log_format: LogFormat, level: LogLevel) -> None:
    numeric_level = logging.getLevelName(level.value.upper())
    shared: list[structlog.types.Processor] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    renderer: structlog.types.Processor
    if log_format is LogFormat.JSON:
        renderer = structlog.processors.JSONRenderer()
        shared.append(structlog.processors.dict_tracebacks)
    else:
        renderer = structlog.dev.ConsoleRenderer(colors=sys.stdout.isatty())
    structlog.configure(
        processors=[*shared, _drop_none, renderer],
        wrapper_class=structlog.make_filtering_bound_logger(numeric_level),
        logger_factory=structlog.WriteLoggerFactory(sys.stdout),
        cache_logger_on_first_use=True,
    )
    # aiohttp, asyncio and anything else on stdlib logging: same renderer, same stream.
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
