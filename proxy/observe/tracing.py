"""Optional OpenTelemetry tracing: one SERVER span per request, aborted ones included.

vLLM emits its `llm_request` span only for requests that finish normally: in a trace, an
abandoned request simply vanishes. tether sees both the client leaving and the engine
stopping, so its span carries both: it continues the caller's `traceparent` (or starts a
trace), is injected as the parent of the engine request (vLLM's span nests under it), and
stays open until the engine's work for it has stopped, with `client_disconnected`,
`abort_sent` and `abort_confirmed` events and the abort's result as attributes.

Installed with `pip install 'tether[otel]'` and configured by the standard OTEL_* variables
(exporter endpoint, service name, sampler). Without it, or with TETHER_TRACING=off, nothing
here runs: the request path only checks that there is no tracer.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from ..settings import Settings, Tracing

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.trace import Span

_ENDPOINT_VARIABLES = ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")


class TracingUnavailableError(RuntimeError):
    """TETHER_TRACING=on without the otel extra installed."""


class RequestSpan:
    """One request's span, from its arrival to the end of the engine's work for it."""

    __slots__ = ("_propagator", "_span")

    def __init__(self, span: Span, propagator: Any) -> None:
        self._span = span
        self._propagator = propagator

    def engine_headers(self) -> dict[str, str]:
        """`traceparent` (and `tracestate`) naming this span as the engine request's parent."""
        from opentelemetry.trace import set_span_in_context

        carrier: dict[str, str] = {}
        self._propagator.inject(carrier, context=set_span_in_context(self._span))
        return carrier

    def set(self, **attributes: str | int | float | bool | None) -> None:
        for name, value in attributes.items():
            if value is not None:
                self._span.set_attribute(f"tether.{name}", value)

    def set_gen_ai(
        self,
        *,
        input_tokens: int | None,
        output_tokens: int | None,
        model: str | None,
        finish_reasons: tuple[str, ...],
    ) -> None:
        """The OpenTelemetry GenAI semantic conventions' usage and model attributes."""
        for name, value in (
            ("gen_ai.usage.input_tokens", input_tokens),
            ("gen_ai.usage.output_tokens", output_tokens),
            ("gen_ai.request.model", model),
        ):
            if value is not None:
                self._span.set_attribute(name, value)
        if finish_reasons:
            self._span.set_attribute("gen_ai.response.finish_reasons", list(finish_reasons))

    def event(self, name: str, **attributes: str | int | float | bool | None) -> None:
        self._span.add_event(
            name, {f"tether.{key}": value for key, value in attributes.items() if value is not None}
        )

    def finish(self, status: int, error: str | None = None) -> None:
        """The request's response is decided (its span may stay open for the abort)."""
        from opentelemetry.trace import Status, StatusCode

        self._span.set_attribute("http.response.status_code", status)
        if status >= 500:  # server spans: 4xx (499 included) are the client's, not errors
            self._span.set_status(Status(StatusCode.ERROR, error))

    def end(self) -> None:
        self._span.end()


class Tracer:
    """Starts request spans; owns the SDK's provider (its exporter is flushed on close)."""

    def __init__(self, provider: TracerProvider) -> None:
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        self._provider = provider
        self._tracer = provider.get_tracer("tether")
        self._propagator = TraceContextTextMapPropagator()

    @classmethod
    @contextmanager
    def open(
        cls, settings: Settings, provider: TracerProvider | None = None
    ) -> Iterator[Tracer | None]:
        """A tracer when tracing is on (`provider` given, or built from OTEL_*), else None."""
        if provider is None:
            provider = _provider_from_environment(settings.tracing)
            owned = provider is not None
        else:
            owned = False
        if provider is None:
            yield None
            return
        try:
            yield cls(provider)
        finally:
            if owned:
                provider.shutdown()

    def start(self, method: str, route: str, headers: Mapping[str, str]) -> RequestSpan:
        from opentelemetry.trace import SpanKind

        parent = self._propagator.extract(headers)
        span = self._tracer.start_span(
            f"{method} {route}",
            context=parent,
            kind=SpanKind.SERVER,
            attributes={"http.request.method": method, "http.route": route},
        )
        return RequestSpan(span, self._propagator)


def check_available(mode: Tracing) -> None:
    """Fail at start-up, naming the setting, when tracing is asked for and cannot run."""
    if mode is not Tracing.ON:
        return
    try:
        import opentelemetry.exporter.otlp.proto.http.trace_exporter
        import opentelemetry.sdk.trace  # noqa: F401
    except ImportError as exc:
        raise TracingUnavailableError(
            "TETHER_TRACING=on needs the otel extra: pip install 'tether[otel]'"
        ) from exc


def _provider_from_environment(mode: Tracing) -> TracerProvider | None:
    if mode is Tracing.OFF:
        return None
    if mode is Tracing.AUTO and not any(os.environ.get(name) for name in _ENDPOINT_VARIABLES):
        return None
    check_available(mode)
    try:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
    except ImportError:
        return None  # auto: the extra is not installed, so no tracing
    # The SDK reads OTEL_SERVICE_NAME, OTEL_RESOURCE_ATTRIBUTES and the exporter's OTEL_*
    # itself; "tether" is only the default name (attributes given here would win over them).
    named = os.environ.get("OTEL_SERVICE_NAME") or "service.name=" in os.environ.get(
        "OTEL_RESOURCE_ATTRIBUTES", ""
    )
    provider = TracerProvider(resource=Resource.create({} if named else {"service.name": "tether"}))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    return provider
