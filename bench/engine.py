"""A fast fake OpenAI-compatible engine that speaks like vLLM and records aborts.

It is a raw asyncio protocol so that one event costs a few microseconds: the engine shares
a core with the load generator and must never be what limits a proxy's figures.

Routes:
- `POST /v1/chat/completions`, `POST /v1/completions`: the JSON body's `stream` picks SSE
  or one JSON object (a stream's last event has `finish_reason: "length"`, then, if the
  body asks for it with `stream_options.include_usage`, a usage event); the body's `bench`
  object sets `events` (count), `rate` (events/s per stream, 0 means as fast as the socket
  takes them), `hold: true` (send one event, then stay open and silent) and `tag` (a
  client-chosen key under which disconnects and aborts are recorded). In the body, not the
  query: a router (smg) forwards a body's unknown members, but not the query.
  Every object carries the `id` vLLM answers with (`chatcmpl-<X-Request-Id>`,
  `cmpl-<X-Request-Id>`), and every event a `bench_ts` send stamp (CLOCK_MONOTONIC ns, which
  is system-wide on Linux). Both IDs, and the engine request ID an abort must name, come from
  tether's own vLLM route table (`proxy.engines.vllm`), read once at import.
- `GET /health`; `GET /v1/models` (one model, `bench-model`, which a router such as smg
  reads before it registers the engine); `POST /abort_requests` (`{"request_ids": [...]}`,
  vLLM's abort API): a stream it names ends as vLLM's does, with a `finish_reason: "abort"`
  event and `[DONE]` (which is what tether waits for to count the abort as confirmed).
- `POST /v1/traces`: an OTLP/HTTP trace sink for tether with tracing on. It answers 200 with
  an empty protobuf body (a valid `ExportTraceServiceResponse`) and counts the export
  requests, their bytes and the spans in them, so the runner can check that every request
  left a span. Decoding needs the otel extra, imported only when a trace arrives.
- `GET /_bench/stats`, `POST /_bench/reset`: what was recorded, for the runner. Reset
  leaves the trace counts alone: they cover the engine's life, which is one round.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Any, cast

import uvloop

from bench.http1 import LAST_CHUNK, BodyDecoder, Head, body_decoder, chunk, parse_head
from proxy.engines import REQUEST_ID_HEADER, Route, vllm


@dataclass(frozen=True, slots=True)
class IdRule:
    """What vLLM makes of a request's `X-Request-Id` on one route: the engine request ID an
    abort names and the `id` its answer carries, each as the text around that ID."""

    engine_id: tuple[str, str]
    answer_id: tuple[str, str]

    @classmethod
    def of(cls, route: Route) -> IdRule:
        marker = "\x00"  # stands for the request's ID while the route's templates are split
        before, _, after = route.engine_request_ids(marker)[0].partition(marker)
        answer_before, _, answer_after = route.answer_id(marker).partition(marker)
        return cls((before, after), (answer_before, answer_after))

    def engine_request_id(self, request_id: str) -> str:
        return self.engine_id[0] + request_id + self.engine_id[1]

    def answer(self, request_id: str) -> str:
        return self.answer_id[0] + request_id + self.answer_id[1]


# The routes served, with tether's own vLLM table read once: no template is read per request.
ID_RULES = {
    route.path.encode(): IdRule.of(route)
    for route in vllm.ROUTES
    if route.path in ("/v1/chat/completions", "/v1/completions")
}
ABORT_PATH = vllm.ABORT_PATHS[0].encode()  # the dev-mode route
REQUEST_ID = REQUEST_ID_HEADER.lower().encode()
SSE_HEAD = (
    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncache-control: no-cache\r\n"
    b"transfer-encoding: chunked\r\n\r\n"
)
DONE_EVENT = chunk(b"data: [DONE]\n\n") + LAST_CHUNK
# The one model served: a router (smg) registers a worker only once this answers.
MODEL = "bench-model"
TRACES_OK = b"HTTP/1.1 200 OK\r\ncontent-type: application/x-protobuf\r\ncontent-length: 0\r\n\r\n"
ABORT_EVENT = b'","object":"chat.completion.chunk","choices":[{"index":0,"delta":{"content":""},"finish_reason":"abort"}]}\n\n'  # noqa: E501
CHUNK_BODY = (
    '","object":"chat.completion.chunk","created":1764460800,"model":"bench-model",'
    '"choices":[{"index":0,"delta":{"content":" token"},"finish_reason":null}],'
    '"bench_ts":'
)
# The last event names its finish reason, as vLLM's does; the usage event (when the body asks
# for it, `stream_options.include_usage`) follows it, before `[DONE]`.
LAST_BODY = CHUNK_BODY.replace('"finish_reason":null', '"finish_reason":"length"').encode()
USAGE_BODY = (
    b'","object":"chat.completion.chunk","created":1764460800,"model":"bench-model",'
    b'"choices":[],"usage":{"prompt_tokens":5,"total_tokens":%d,"completion_tokens":%d}}\n\n'
)


@dataclass(slots=True)
class Recorder:
    """What the runner reads back: per tag, when the engine saw the abort or the drop; what
    the trace sink received."""

    aborts: dict[str, int] = field(default_factory=dict)
    drops: dict[str, int] = field(default_factory=dict)
    tag_by_engine_id: dict[str, str] = field(default_factory=dict)
    streams: dict[str, Stream] = field(default_factory=dict)  # by engine request ID
    unknown_aborts: int = 0
    duplicate_aborts: int = 0
    streams_started: int = 0
    trace_exports: int = 0
    trace_bytes: int = 0
    spans: int = 0

    def record_abort(self, engine_request_id: str, now_ns: int) -> None:
        stream = self.streams.pop(engine_request_id, None)
        if stream is not None:
            stream.abort()
        tag = self.tag_by_engine_id.get(engine_request_id)
        if tag is None:
            self.unknown_aborts += 1
        elif tag in self.aborts:
            self.duplicate_aborts += 1
        else:
            self.aborts[tag] = now_ns

    def record_traces(self, body: bytes) -> None:
        # Imported here: only a run with tether_otel needs the otel extra.
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
            ExportTraceServiceRequest,
        )

        request = ExportTraceServiceRequest.FromString(body)
        self.trace_exports += 1
        self.trace_bytes += len(body)
        self.spans += sum(
            len(scope.spans)
            for resource in request.resource_spans
            for scope in resource.scope_spans
        )

    def reset(self) -> None:
        self.streams.clear()
        self.aborts.clear()
        self.drops.clear()
        self.tag_by_engine_id.clear()
        self.unknown_aborts = self.duplicate_aborts = self.streams_started = 0

    def as_json(self) -> dict[str, Any]:
        return {
            "aborts": self.aborts,
            "drops": self.drops,
            "unknown_aborts": self.unknown_aborts,
            "duplicate_aborts": self.duplicate_aborts,
            "streams_started": self.streams_started,
            "trace_exports": self.trace_exports,
            "trace_bytes": self.trace_bytes,
            "spans": self.spans,
        }


def json_response(status: str, payload: object) -> bytes:
    body = json.dumps(payload, separators=(",", ":")).encode()
    return b"HTTP/1.1 %b\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%b" % (
        status.encode(),
        len(body),
        body,
    )


MODELS = json_response(
    "200 OK", {"object": "list", "data": [{"id": MODEL, "object": "model", "owned_by": "bench"}]}
)


def completion_response(answer_id: str) -> bytes:
    return json_response(
        "200 OK",
        {
            "id": answer_id,
            "object": "chat.completion",
            "created": 1764460800,
            "model": "bench-model",
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": "ok"},
                    "finish_reason": "stop",
                }
            ],
            "usage": {"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6},
        },
    )


class Stream:
    """One SSE response in progress on a connection."""

    def __init__(
        self,
        conn: EngineConnection,
        event_prefix: bytes,
        events: int,
        rate: float,
        hold: bool,
        tag: str | None,
        engine_request_id: str,
        answer_id: str,
        usage: bool,
    ) -> None:
        self._conn = conn
        self._prefix = event_prefix
        self.engine_request_id = engine_request_id
        self._answer_id = answer_id.encode()
        self._events = self._left = events
        self._usage = usage
        self._interval = 1.0 / rate if rate > 0 else 0.0
        self._hold = hold
        self.tag = tag
        self._loop = asyncio.get_running_loop()
        self._next_at = self._loop.time()
        self._timer: asyncio.TimerHandle | asyncio.Handle | None = None
        self.finished = False

    def start(self) -> None:
        self._conn.transport.write(SSE_HEAD)
        self._send()

    def _send(self) -> None:
        self._timer = None
        if self._conn.paused:
            return  # resume() is called from resume_writing
        self._left -= 1
        if self._left <= 0:
            self.finished = True
            answer_id = self._answer_id
            last = b'data: {"id":"%b%b%d}\n\n' % (answer_id, LAST_BODY, time.monotonic_ns())
            if self._usage:
                usage = USAGE_BODY % (5 + self._events, self._events)
                last += b'data: {"id":"' + answer_id + usage
            self._conn.transport.write(chunk(last) + DONE_EVENT)
            self._conn.stream_finished()
            return
        event = b"%b%d}\n\n" % (self._prefix, time.monotonic_ns())
        self._conn.transport.write(chunk(event))
        if self._hold:
            return
        if self._interval:
            self._next_at += self._interval
            self._timer = self._loop.call_at(self._next_at, self._send)
        else:
            # One event per loop turn keeps concurrent streams interleaved, as a batching
            # engine's would be, instead of one stream filling the socket at a time.
            self._timer = self._loop.call_soon(self._send)

    def resume(self) -> None:
        if self._timer is None and not self.finished and not self._hold:
            self._send()

    def cancel(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def abort(self) -> None:
        """Named by an abort call: end as vLLM does (the abort event, then `[DONE]`)."""
        if self.finished:
            return
        self.cancel()
        self.finished = True
        answer_id = self._answer_id
        self._conn.transport.write(chunk(b'data: {"id":"' + answer_id + ABORT_EVENT) + DONE_EVENT)
        self._conn.stream_finished()


class EngineConnection(asyncio.Protocol):
    """One client connection; requests on it are served one after another (keep-alive)."""

    def __init__(self, recorder: Recorder) -> None:
        self._recorder = recorder
        self._buffer = b""
        self._head: Head | None = None
        self._body: BodyDecoder | None = None
        self._body_parts: list[bytes] = []
        self._stream: Stream | None = None
        self.paused = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports implement asyncio.Transport without subclassing it.
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        self._buffer += data
        while self._stream is None and self._parse_one():
            pass

    def eof_received(self) -> bool | None:
        self._dropped()
        return None

    def connection_lost(self, exc: Exception | None) -> None:
        self._dropped()

    def pause_writing(self) -> None:
        self.paused = True

    def resume_writing(self) -> None:
        self.paused = False
        if self._stream is not None:
            self._stream.resume()

    def stream_finished(self) -> None:
        if self._stream is not None:
            self._recorder.streams.pop(self._stream.engine_request_id, None)
        self._stream = None
        while self._stream is None and self._parse_one():
            pass

    def _dropped(self) -> None:
        stream, self._stream = self._stream, None
        if stream is None:
            return
        stream.cancel()
        self._recorder.streams.pop(stream.engine_request_id, None)
        if stream.tag is not None:
            self._recorder.drops.setdefault(stream.tag, time.monotonic_ns())

    def _parse_one(self) -> bool:
        """Serve the next complete request in the buffer; False when more bytes are needed."""
        if self._head is None:
            end = self._buffer.find(b"\r\n\r\n")
            if end < 0:
                return False
            self._head = parse_head(self._buffer[:end])
            self._body = body_decoder(self._head.headers, is_response=False)
            self._buffer = self._buffer[end + 4 :]
        assert self._body is not None
        payload, rest = self._body.feed(self._buffer)
        self._body_parts.append(payload)
        if rest is None:
            self._buffer = b""
            return False
        self._buffer = rest
        head, body = self._head, b"".join(self._body_parts)
        self._head, self._body, self._body_parts = None, None, []
        self._dispatch(head, body)
        return True

    def _dispatch(self, head: Head, body: bytes) -> None:
        method, target = head.start[0], head.start[1]
        path = target.partition(b"?")[0]
        ids = ID_RULES.get(path)
        if method == b"POST" and ids is not None:
            self._complete(head, body, ids)
        elif path == b"/health":
            self.transport.write(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n")
        elif path == b"/v1/models":
            self.transport.write(MODELS)
        elif method == b"POST" and path == ABORT_PATH:
            now_ns = time.monotonic_ns()
            for engine_request_id in json.loads(body)["request_ids"]:
                self._recorder.record_abort(engine_request_id, now_ns)
            self.transport.write(json_response("200 OK", {}))
        elif method == b"POST" and path == b"/v1/traces":
            self._recorder.record_traces(body)
            self.transport.write(TRACES_OK)
        elif path == b"/_bench/stats":
            self.transport.write(json_response("200 OK", self._recorder.as_json()))
        elif method == b"POST" and path == b"/_bench/reset":
            self._recorder.reset()
            self.transport.write(json_response("200 OK", {}))
        else:
            self.transport.write(json_response("404 Not Found", {"error": "not found"}))

    def _complete(self, head: Head, body: bytes, ids: IdRule) -> None:
        request_id = head.headers.get(REQUEST_ID, b"none").decode()
        payload = json.loads(body or b"{}")
        answer_id = ids.answer(request_id)
        if not payload.get("stream", False):
            self.transport.write(completion_response(answer_id))
            return
        engine_request_id = ids.engine_request_id(request_id)
        knobs = payload.get("bench") or {}
        tag = knobs.get("tag")
        if tag is not None:
            self._recorder.tag_by_engine_id[engine_request_id] = tag
        self._recorder.streams_started += 1
        event_prefix = f'data: {{"id":"{answer_id}{CHUNK_BODY}'.encode()
        self._stream = Stream(
            self,
            event_prefix,
            events=int(knobs.get("events", 16)),
            rate=float(knobs.get("rate", 0)),
            hold=bool(knobs.get("hold", False)),
            tag=tag,
            engine_request_id=engine_request_id,
            answer_id=answer_id,
            usage=bool((payload.get("stream_options") or {}).get("include_usage")),
        )
        self._recorder.streams[engine_request_id] = self._stream
        self._stream.start()


async def serve(host: str, port: int) -> None:
    recorder = Recorder()
    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: EngineConnection(recorder), host, port, backlog=4096)
    async with server:
        await server.serve_forever()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args()
    uvloop.run(serve(args.host, args.port))


if __name__ == "__main__":
    main()
