"""OpenTelemetry: one SERVER span per request, a child of the caller's traceparent and the
parent of the engine's request; an aborted request keeps its span, with the disconnect and
the confirmed abort as events. Exported over real OTLP/HTTP from the real process."""

from __future__ import annotations

import asyncio
import gzip
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from proxy.server.runner import TetherServer

from .support.chat import chat_body
from .support.in_process import drained, settled, url
from .support.processes import TetherProcessFactory
from .support.raw_http import RawClient
from .support.settings import make_settings
from .support.upstreams import FakeEngineFactory
from .support.waiting import poll_until

CALLER_TRACE = "0af7651916cd43dd8448eb211c80319c"
CALLER_SPAN = "b7ad6b7169203331"
TRACEPARENT = f"00-{CALLER_TRACE}-{CALLER_SPAN}-01"


@pytest.fixture
async def traced() -> AsyncIterator[tuple[InMemorySpanExporter, list[TetherServer]]]:
    exporter = InMemorySpanExporter()
    servers: list[TetherServer] = []
    yield exporter, servers
    for server in servers:
        await server.stop()


async def start_traced(
    traced: tuple[InMemorySpanExporter, list[TetherServer]], engine_url: str
) -> TetherServer:
    exporter, servers = traced
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    server = TetherServer(make_settings(upstream_url=engine_url), tracer_provider=provider)
    await server.start()
    servers.append(server)
    return server


def attributes(span: ReadableSpan) -> dict[str, Any]:
    return dict(span.attributes or {})


async def test_span_continues_the_callers_trace_and_parents_the_engine_request(
    fake_engine: FakeEngineFactory,
    traced: tuple[InMemorySpanExporter, list[TetherServer]],
    http: aiohttp.ClientSession,
) -> None:
    """tether's SERVER span is a child of the caller's traceparent; the engine gets a
    traceparent naming tether's span, so the engine's span nests under it."""
    engine, engine_url = await fake_engine()
    server = await start_traced(traced, engine_url)
    headers = {"traceparent": TRACEPARENT, "X-Request-Id": "traced-1"}
    async with http.post(url(server), json=chat_body(max_tokens=3), headers=headers) as response:
        await response.read()
    await settled(server)

    [span] = traced[0].get_finished_spans()
    assert span.kind is SpanKind.SERVER and span.name == "POST /v1/chat/completions"
    assert span.context is not None and span.parent is not None
    assert format(span.context.trace_id, "032x") == CALLER_TRACE
    assert format(span.parent.span_id, "016x") == CALLER_SPAN
    sent = engine.requests[0].headers["traceparent"]
    assert sent == f"00-{CALLER_TRACE}-{format(span.context.span_id, '016x')}-01"
    values = attributes(span)
    assert values["tether.client_request_id"] == "traced-1"
    assert len(values["tether.internal_request_id"]) == 32
    assert values["tether.outcome"] == "completed"
    assert values["http.response.status_code"] == 200
    assert values["tether.tokens_relayed"] == 3


async def test_aborted_request_keeps_its_span_with_the_disconnect_and_the_confirmation(
    fake_engine: FakeEngineFactory,
    traced: tuple[InMemorySpanExporter, list[TetherServer]],
) -> None:
    """vLLM emits no span for an aborted request; tether's span for it ends once the engine
    stopped, with `client_connection_cut`, `client_disconnected`, `abort_sent` and
    `abort_confirmed` events and the cut's cause, phase, abort result, engine stop time and
    tokens after the disconnect."""
    _, engine_url = await fake_engine(token_interval=0.01)
    server = await start_traced(traced, engine_url)
    client = await RawClient.connect(server.port)
    await client.send_request(chat_body(max_tokens=100_000), headers={"traceparent": TRACEPARENT})
    await client.read_until(b"tok2")
    client.close_fin()
    await settled(server)
    await drained(server)

    [span] = traced[0].get_finished_spans()
    assert [event.name for event in span.events] == [
        "client_connection_cut",
        "client_disconnected",
        "abort_sent",
        "abort_confirmed",
    ]
    values = attributes(span)
    assert values["tether.outcome"] == "client_disconnected"
    assert values["http.response.status_code"] == 499
    assert values["tether.cut_cause"] == "client_closed"
    assert values["tether.disconnect_phase"] == "streaming"
    assert values["tether.abort_result"] == "confirmed"
    assert values["tether.engine_stop_ms"] >= 0
    assert values["tether.tokens_after_disconnect"] >= 0
    assert span.context is not None
    assert format(span.context.trace_id, "032x") == CALLER_TRACE


async def test_a_request_cancelled_by_id_has_the_cancel_in_its_span(
    fake_engine: FakeEngineFactory,
    traced: tuple[InMemorySpanExporter, list[TetherServer]],
    http: aiohttp.ClientSession,
) -> None:
    """A stream its caller cancelled by ID: its span has the `cancelled_by_id` event before
    the abort's, and `cancelled` as its outcome."""
    _, engine_url = await fake_engine(token_interval=0.01)
    server = await start_traced(traced, engine_url)
    client = await RawClient.connect(server.port)
    await client.send_request(
        chat_body(max_tokens=100_000), headers={"X-Request-Id": "traced-cancel", "api-key": "k"}
    )
    await client.read_until(b"tok2")
    async with http.post(
        url(server, "/v1/requests/traced-cancel/cancel"), headers={"api-key": "k"}
    ) as response:
        assert response.status == 200
    await client.read_to_end()
    await settled(server)
    await drained(server)

    [span] = traced[0].get_finished_spans()
    assert [event.name for event in span.events] == [
        "cancelled_by_id",
        "abort_sent",
        "abort_confirmed",
    ]
    assert attributes(span)["tether.outcome"] == "cancelled"


async def test_rejected_requests_get_a_span_too(
    fake_engine: FakeEngineFactory,
    traced: tuple[InMemorySpanExporter, list[TetherServer]],
    http: aiohttp.ClientSession,
) -> None:
    """A request refused before the engine (a control route) is still one span."""
    _, engine_url = await fake_engine()
    server = await start_traced(traced, engine_url)
    async with http.post(url(server, "/abort_requests"), json={}) as response:
        assert response.status == 403
    [span] = traced[0].get_finished_spans()
    assert attributes(span)["tether.outcome"] == "rejected"


async def test_spans_are_exported_over_otlp_http_by_the_real_process(
    fake_engine: FakeEngineFactory, tether_process: TetherProcessFactory
) -> None:
    """`tether` with OTEL_EXPORTER_OTLP_ENDPOINT set exports its spans (protobuf over HTTP)
    to a receiver: here a minimal OTLP/HTTP endpoint decoding what it gets."""
    received: list[ExportTraceServiceRequest] = []

    async def traces(request: web.Request) -> web.Response:
        body = await request.read()
        if request.headers.get("Content-Encoding") == "gzip":
            body = gzip.decompress(body)
        message = ExportTraceServiceRequest()
        message.ParseFromString(body)
        received.append(message)
        return web.Response(content_type="application/x-protobuf")

    app = web.Application()
    app.router.add_post("/v1/traces", traces)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    collector_port = runner.addresses[0][1]
    try:
        _, engine_url = await fake_engine(token_interval=0.01)
        process = await tether_process(
            engine_url,
            OTEL_EXPORTER_OTLP_ENDPOINT=f"http://127.0.0.1:{collector_port}",
            OTEL_SERVICE_NAME="tether-under-test",
            OTEL_BSP_SCHEDULE_DELAY="50",
        )
        client = await RawClient.connect(process.port)
        await client.send_request(
            chat_body(max_tokens=100_000), headers={"traceparent": TRACEPARENT}
        )
        await client.read_until(b"tok2")
        client.close_fin()

        def spans() -> list[Any]:
            return [
                span
                for message in received
                for resource in message.resource_spans
                for scope in resource.scope_spans
                for span in scope.spans
            ]

        await poll_until(lambda: bool(spans()), 10, what="the span to be exported")
        [span] = spans()
        assert span.trace_id.hex() == CALLER_TRACE
        assert [event.name for event in span.events] == [
            "client_connection_cut",
            "client_disconnected",
            "abort_sent",
            "abort_confirmed",
        ]
        [resource] = [resource for message in received for resource in message.resource_spans]
        names = {a.key: a.value.string_value for a in resource.resource.attributes}
        assert names["service.name"] == "tether-under-test"
        assert await process.stop() == 0
    finally:
        await runner.cleanup()
        await asyncio.sleep(0)


async def test_span_carries_the_genai_usage_of_an_abandoned_request(
    fake_engine: FakeEngineFactory,
    traced: tuple[InMemorySpanExporter, list[TetherServer]],
) -> None:
    """OpenTelemetry's GenAI attributes, from the engine's own usage: the model asked for,
    the prompt's and the completion's tokens (those after the client left included) and the
    finish reason, for a stream its client abandoned."""
    engine, engine_url = await fake_engine(token_interval=0.01)
    server = await start_traced(traced, engine_url)
    client = await RawClient.connect(server.port)
    await client.send_request(chat_body(max_tokens=100_000))
    await client.read_until(b"tok2")
    client.close_fin()
    await settled(server)
    await drained(server)

    [span] = traced[0].get_finished_spans()
    [generation] = engine.generations.values()
    values = attributes(span)
    assert values["gen_ai.request.model"] == "fake"
    assert values["gen_ai.usage.input_tokens"] == 3
    assert values["gen_ai.usage.output_tokens"] == generation.produced
    assert list(values["gen_ai.response.finish_reasons"]) == ["abort"]
