"""tether is invisible: a catalogue of requests, each sent straight to the real vLLM and then
through tether, gets the same status, headers and body, but for what tether documents it adds
or changes (`ALLOWED` below, and tests/real_vllm/README.md). Any other difference fails, with
a diff of the two answers."""

from __future__ import annotations

import asyncio
import difflib
import json
import pathlib
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest

from ..support.raw_http import RawClient, Reply, request_head
from ..support.real_engine.stacks import MODEL_NAME
from .processes import Stack
from .scenarios import CHAT_PATH, on_transparency

COMPLETIONS_PATH = "/v1/completions"
# A whole answer of the catalogue takes well under a second; a hung one fails here.
ANSWER_TIMEOUT = 30.0
DIFF_LINES = 80


# --- what may differ, and why: nothing else may ------------------------------------------------

# Connection-specific fields (RFC 9110 §7.6.1): each hop sets its own (`Transfer-Encoding`,
# `Connection: close` on a refused handshake, ...), so a client cannot rely on them either way.
HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-connection",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
    }
)


@dataclass(frozen=True)
class Allowed:
    """A value that may differ between the two answers, put in place of it on both sides."""

    what: str
    why: str
    pattern: re.Pattern[str]
    replacement: str


ALLOWED = (
    # Headers (matched against `name: value`).
    Allowed(
        "Date header",
        "the clock: the two answers come a moment apart",
        re.compile(r"^date: .*$"),
        "date: <time>",
    ),
    # Body values (matched against every string in a JSON body or SSE event).
    Allowed(
        "chat and completions ID of a request that named none",
        "vLLM's `chatcmpl-<random>` against `chatcmpl-<tether's random ID>`: neither is the "
        "client's to know. Every request that names an ID (header or body) compares it exactly",
        re.compile(r"^(chatcmpl|cmpl)-[0-9a-f]{16,32}$"),
        r"\1-<random>",
    ),
    Allowed(
        "tool call IDs",
        "vLLM draws `chatcmpl-tool-<random>` for every tool call",
        re.compile(r"^chatcmpl-tool-[0-9a-f]+$"),
        "chatcmpl-tool-<random>",
    ),
    Allowed(
        "Responses API IDs",
        "vLLM draws `resp_<random>` and `msg_<random>`; tether writes `resp_<its internal ID>` "
        "in the body (README: the Responses API's ID is the client's handle, unmapped and made "
        "unique by tether)",
        re.compile(r"^(resp|msg|rs)_[0-9a-f]{16,}$"),
        r"\1_<random>",
    ),
    Allowed(
        "/v1/models permission IDs",
        "vLLM draws `modelperm-<random>` on every call",
        re.compile(r"^modelperm-[0-9a-f]+$"),
        "modelperm-<random>",
    ),
)
# The value of the X-Request-Id header answering a request that sent none: vLLM
# (--enable-request-id-headers) draws a random uuid4 for it, tether a random ID of its own or
# the client's body `request_id` (README: the client sees its own ID in the header). Only its
# presence is compared then; where the client sent the header, its value is compared exactly.
UNNAMED_REQUEST_ID = "x-request-id: <not named by the client>"
# Body fields holding the time in seconds: the clock may tick between the two answers.
TIME_FIELDS = frozenset({"created", "created_at", "completed_at"})
# How a stream's text is cut into events: vLLM merges tokens into one event when its HTTP
# handler falls behind the engine (timing: seen on the Responses API with no proxy involved),
# so runs of text events that differ only in these strings are compared merged into one (the
# text of each choice, every other event and their order stay exact), and the counters that
# merging changes (SSE sequence numbers, `continuous_usage_stats` usage so far) with them.
TEXT_FIELDS = frozenset(
    {"content", "text", "arguments", "delta", "partial_json", "reasoning", "reasoning_content"}
)
COUNTER_FIELDS = frozenset({"sequence_number", "usage"})


def _allow(text: str) -> str:
    for allowed in ALLOWED:
        text = allowed.pattern.sub(allowed.replacement, text)
    return text


def _masked(value: Any) -> Any:
    """A JSON value with every allowed difference put in place on its strings and times."""
    if isinstance(value, dict):
        return {
            key: "<time>" if key in TIME_FIELDS and isinstance(item, int | float) else _masked(item)
            for key, item in value.items()
        }
    if isinstance(value, list):
        return [_masked(item) for item in value]
    if isinstance(value, str):
        return _allow(value)
    return value


# --- how an answer is read -----------------------------------------------------------------------


def _headers(reply: Reply) -> list[str]:
    """Every end-to-end header as `name: value`, allowed differences put in place, sorted
    (their order carries no meaning). A `Content-Length` that is the body's length says so:
    the bodies are compared, and an allowed difference in them (an ID's length) changes it."""
    lines = []
    for name, value in reply.headers.items():
        name = name.lower()
        if name in HOP_BY_HOP:
            continue
        if name == "content-length" and value == str(len(reply.body)):
            value = "<the body's length>"
        lines.append(_allow(f"{name}: {value}"))
    return sorted(lines)


def _json_or_text(data: str) -> Any:
    try:
        return json.loads(data)
    except ValueError:
        return data


def _events(body: bytes) -> list[dict[str, Any]]:
    """Server-sent events, each as its fields (`data` parsed as JSON where it is JSON)."""
    events = []
    for block in body.decode().replace("\r\n", "\n").split("\n\n"):
        if not block.strip():
            continue
        event: dict[str, Any] = {}
        for line in block.split("\n"):
            name, _, value = line.partition(":")
            event[name] = _json_or_text(value.strip()) if name == "data" else value.strip()
        events.append(event)
    return events


def _skeleton(value: Any) -> Any:
    """An event without its text and counters: two consecutive events alike in this are one
    piece of text cut in two."""
    if isinstance(value, dict):
        return {
            key: "<text>" if key in TEXT_FIELDS and isinstance(item, str) else _skeleton(item)
            for key, item in value.items()
            if key not in COUNTER_FIELDS
        }
    if isinstance(value, list):
        return [_skeleton(item) for item in value]
    return value


def _joined(earlier: Any, later: Any) -> Any:
    """`later` (an event alike `earlier` in its skeleton) with `earlier`'s text before its own."""
    if isinstance(later, dict):
        return {
            key: item
            if key in COUNTER_FIELDS
            else earlier[key] + item
            if key in TEXT_FIELDS and isinstance(item, str)
            else _joined(earlier[key], item)
            for key, item in later.items()
        }
    if isinstance(later, list):
        return [_joined(a, b) for a, b in zip(earlier, later, strict=True)]
    return later


def _merged(events: list[Any]) -> list[Any]:
    """Runs of text events merged into one each, sequence numbers counted again."""
    merged: list[Any] = []
    for event in events:
        if merged and _skeleton(merged[-1]) == _skeleton(event):
            merged[-1] = _joined(merged[-1], event)
        else:
            merged.append(event)
    numbers = iter(range(len(merged)))
    for event in merged:
        data = event.get("data")
        if isinstance(data, dict) and "sequence_number" in data:
            data["sequence_number"] = next(numbers)
    return merged


def _choice_of(event: dict[str, Any]) -> int | None:
    data = event.get("data")
    choices = data.get("choices") if isinstance(data, dict) else None
    if isinstance(choices, list) and len(choices) == 1:
        return int(choices[0]["index"])
    return None


def stream_text(events: list[dict[str, Any]]) -> Any:
    """A stream as its text and its other events: each choice's events apart when there are
    several (how they interleave is timing too), runs of text events merged."""
    choices = sorted({index for event in events if (index := _choice_of(event)) is not None})
    if len(choices) < 2:
        return _merged(events)
    return {
        f"choice {key}" if key is not None else "other events": _merged(
            [event for event in events if _choice_of(event) == key]
        )
        for key in (*choices, None)
    }


def body_by_type(reply: Reply) -> Any:
    """The body as its Content-Type says: SSE events, JSON, or text."""
    media_type = reply.headers.get("Content-Type", "").split(";")[0].strip()
    if media_type == "text/event-stream":
        return stream_text(_masked(_events(reply.body)))
    if media_type.endswith("json"):
        return _json_or_text(reply.body.decode())
    return reply.body.decode(errors="replace")


def metric_families(reply: Reply) -> list[str]:
    """`/metrics`: the metric families and their types (values differ from scrape to scrape)."""
    return sorted(
        line.removeprefix("# TYPE ")
        for line in reply.body.decode().splitlines()
        if line.startswith("# TYPE ")
    )


def _lines(answer: dict[str, Any]) -> list[str]:
    """An answer as lines to diff: status, headers, then the body (a stream one event a line,
    under the name of each choice's events where they are apart)."""
    lines = [f"status: {answer['status']}", *answer["headers"], ""]
    body = answer["body"]
    sections = {"events": body} if isinstance(body, list) else body
    if (
        isinstance(sections, dict)
        and sections
        and all(isinstance(events, list) for events in sections.values())
    ):
        for name, events in sections.items():
            lines += [f"[{name}]", *(json.dumps(event, sort_keys=True) for event in events)]
        return lines
    return lines + json.dumps(body, indent=1, sort_keys=True).splitlines()


def _exchange(port: int, request: bytes) -> Reply:
    """One request on a fresh connection, its whole answer."""

    async def run() -> Reply:
        client = await RawClient.connect(port)
        try:
            await client.send(request)
            return await client.read_reply(timeout=ANSWER_TIMEOUT)
        finally:
            client.close_fin()

    return asyncio.run(run())


# --- the catalogue ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Entry:
    """One request of the catalogue and the status vLLM answers it with (checked first, so an
    entry cannot pass by both sides refusing it the same way)."""

    name: str
    path: str
    status: int
    body: Any = None  # JSON, or bytes as they are
    method: str = "POST"
    headers: tuple[tuple[str, str], ...] = ()
    content_type: str | None = "application/json"
    read_body: Callable[[Reply], Any] = body_by_type
    marks: tuple[pytest.MarkDecorator, ...] = field(default=())
    # Bytes vLLM's own answer must hold: the entry exercises what it is named after.
    shows: bytes = b""

    def request(self) -> bytes:
        headers = list(self.headers)
        if self.body is None:
            return request_head(self.path, method=self.method, headers=headers)
        payload = self.body if isinstance(self.body, bytes) else json.dumps(self.body).encode()
        if self.content_type is not None:
            headers.append(("Content-Type", self.content_type))
        headers.append(("Content-Length", str(len(payload))))
        return request_head(self.path, method=self.method, headers=headers) + payload

    def answer(self, reply: Reply) -> dict[str, Any]:
        """What the client notices, allowed differences put in place."""
        headers = _headers(reply)
        if not any(name.lower() == "x-request-id" for name, _ in self.headers):
            headers = [
                UNNAMED_REQUEST_ID if line.startswith("x-request-id: ") else line
                for line in headers
            ]
        return {"status": reply.status, "headers": headers, "body": _masked(self.read_body(reply))}


def _named(name: str) -> tuple[tuple[str, str], ...]:
    """The request-ID header of an entry: IDs the client chose are compared exactly."""
    return (("X-Request-Id", f"tx-{name}"),)


def _chat(stream: bool = False, **fields: Any) -> dict[str, Any]:
    """Greedy, a fixed length: the same text both ways."""
    return {
        "model": MODEL_NAME,
        "messages": [{"role": "user", "content": "Tell me a story."}],
        "max_tokens": 12,
        "ignore_eos": True,
        "temperature": 0,
        "stream": stream,
        **fields,
    }


def _completion(stream: bool = False, **fields: Any) -> dict[str, Any]:
    return {
        "model": MODEL_NAME,
        "prompt": "Once upon a time",
        "max_tokens": 12,
        "ignore_eos": True,
        "temperature": 0,
        "stream": stream,
        **fields,
    }


# vLLM refuses n > 1 with greedy sampling; a seed makes the samples the same both ways.
SAMPLED_TWICE: dict[str, Any] = {"n": 2, "temperature": 1.0, "seed": 7}
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 8}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
CITY_SCHEMA = {
    "type": "json_schema",
    "json_schema": {
        "name": "city",
        "schema": {
            "type": "object",
            "properties": {"name": {"type": "string", "maxLength": 8}},
            "required": ["name"],
            "additionalProperties": False,
        },
    },
}
ANTHROPIC_MESSAGE = {
    "model": MODEL_NAME,
    "messages": [{"role": "user", "content": "Tell me a story."}],
    "max_tokens": 12,
    "temperature": 0,
}
WEBSOCKET_HANDSHAKE = (
    ("Upgrade", "websocket"),
    ("Connection", "Upgrade"),
    ("Sec-WebSocket-Key", "dGhlIHNhbXBsZSBub25jZQ=="),
    ("Sec-WebSocket-Version", "13"),
)
# A multipart upload as the openai SDK sends one: a form field and 64 KiB of "audio".
BOUNDARY = "tether-transparency-boundary"
TRANSCRIPTION_UPLOAD = (
    (
        f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="model"\r\n\r\n{MODEL_NAME}\r\n'
        f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="file"; filename="a.wav"\r\n'
        "Content-Type: audio/wav\r\n\r\n"
    ).encode()
    + b"RIFF"
    + bytes(65536)
    + f"\r\n--{BOUNDARY}--\r\n".encode()
)


def _catalogue() -> list[Entry]:
    chat, completions = CHAT_PATH, COMPLETIONS_PATH
    return [
        # Generation, streaming and not.
        Entry("chat", chat, 200, _chat(), headers=_named("chat")),
        Entry("chat-no-id", chat, 200, _chat()),
        Entry("chat-stream", chat, 200, _chat(stream=True), headers=_named("chat-stream")),
        Entry("completions", completions, 200, _completion(), headers=_named("completions")),
        Entry(
            "completions-stream",
            completions,
            200,
            _completion(stream=True),
            headers=_named("completions-stream"),
        ),
        Entry(
            "completions-2-prompts",
            completions,
            200,
            _completion(prompt=["Once upon a time", "It was a dark night"]),
            headers=_named("completions-2-prompts"),
        ),
        # stream_options: usage asked, not asked, and in every chunk.
        *(
            Entry(
                f"{kind}-stream-usage-{label}",
                path,
                200,
                make(stream=True, stream_options=options),
                headers=_named(f"{kind}-stream-usage-{label}"),
            )
            for kind, path, make in (
                ("chat", chat, _chat),
                ("completions", completions, _completion),
            )
            for label, options in (
                ("on", {"include_usage": True}),
                ("off", {"include_usage": False}),
                ("continuous", {"include_usage": True, "continuous_usage_stats": True}),
            )
        ),
        # Usage in every chunk asked without usage: vLLM sends none (found here: tether's own
        # include_usage turned the client's continuous_usage_stats on).
        *(
            Entry(
                f"{kind}-stream-usage-continuous-only",
                path,
                200,
                make(
                    stream=True,
                    stream_options={"include_usage": False, "continuous_usage_stats": True},
                ),
                headers=_named(f"{kind}-stream-usage-continuous-only"),
            )
            for kind, path, make in (
                ("chat", chat, _chat),
                ("completions", completions, _completion),
            )
        ),
        # n > 1.
        Entry("chat-n2", chat, 200, _chat(**SAMPLED_TWICE), headers=_named("chat-n2")),
        Entry(
            "chat-n2-stream",
            chat,
            200,
            _chat(stream=True, **SAMPLED_TWICE),
            headers=_named("chat-n2-stream"),
        ),
        Entry(
            "completions-n2-stream",
            completions,
            200,
            _completion(stream=True, **SAMPLED_TWICE),
            headers=_named("completions-n2-stream"),
        ),
        # Tool calls: the parser's choice (`auto`), forced (`required`), one named.
        Entry(
            "tools-auto",
            chat,
            200,
            _chat(tools=[WEATHER_TOOL], tool_choice="auto"),
            headers=_named("tools-auto"),
        ),
        Entry(
            "tools-auto-stream",
            chat,
            200,
            _chat(stream=True, tools=[WEATHER_TOOL], tool_choice="auto"),
            headers=_named("tools-auto-stream"),
        ),
        Entry(
            "tools-required",
            chat,
            200,
            _chat(max_tokens=80, ignore_eos=False, tools=[WEATHER_TOOL], tool_choice="required"),
            headers=_named("tools-required"),
            # The forced array of calls never closes within 80 tokens of random weights: an
            # answer cut at its length (`content: ""`), compared as it is.
            shows=b'"finish_reason":"length"',
        ),
        Entry(
            "tools-named-stream",
            chat,
            200,
            _chat(
                stream=True,
                max_tokens=40,
                ignore_eos=False,
                tools=[WEATHER_TOOL],
                tool_choice={"type": "function", "function": {"name": "get_weather"}},
            ),
            headers=_named("tools-named-stream"),
            shows=b'"name":"get_weather","arguments"',
        ),
        # Structured output.
        Entry(
            "json-schema",
            chat,
            200,
            _chat(max_tokens=40, ignore_eos=False, response_format=CITY_SCHEMA),
            headers=_named("json-schema"),
            shows=b'"finish_reason":"stop"',
        ),
        Entry(
            "json-object-stream",
            completions,
            200,
            _completion(
                stream=True,
                max_tokens=20,
                ignore_eos=False,
                response_format={"type": "json_object"},
            ),
            headers=_named("json-object-stream"),
        ),
        # The client's own body `request_id` (ENGINES.md §13.3): vLLM answers with it, and
        # with the header's when both are set (vLLM 0.32 prefers the header).
        Entry(
            "chat-body-request-id",
            chat,
            200,
            _chat(request_id="client-abc"),
            shows=b'"id":"chatcmpl-client-abc"',
        ),
        Entry(
            "completions-body-request-id",
            completions,
            200,
            _completion(request_id="client-abc"),
            shows=b'"id":"cmpl-client-abc"',
        ),
        Entry(
            "chat-stream-body-request-id",
            chat,
            200,
            _chat(stream=True, request_id="client-abc"),
            shows=b'"id":"chatcmpl-client-abc"',
        ),
        Entry(
            "chat-header-and-body-request-id",
            chat,
            200,
            _chat(request_id="client-abc"),
            headers=_named("chat-header-and-body-request-id"),
            shows=b'"id":"chatcmpl-tx-chat-header-and-body-request-id"',
        ),
        # The Responses API (no response store in this configuration: `store: false`).
        Entry(
            "responses",
            "/v1/responses",
            200,
            {
                "model": MODEL_NAME,
                "input": "Tell me a story.",
                "max_output_tokens": 12,
                "temperature": 0,
                "store": False,
            },
            headers=_named("responses"),
        ),
        Entry(
            "responses-stream",
            "/v1/responses",
            200,
            {
                "model": MODEL_NAME,
                "input": "Tell me a story.",
                "max_output_tokens": 12,
                "temperature": 0,
                "store": False,
                "stream": True,
            },
            headers=_named("responses-stream"),
        ),
        # Anthropic messages (greedy: that API has no `ignore_eos`).
        Entry(
            "messages",
            "/v1/messages",
            200,
            {**ANTHROPIC_MESSAGE, "stream": False},
            headers=_named("messages"),
        ),
        Entry(
            "messages-stream",
            "/v1/messages",
            200,
            {**ANTHROPIC_MESSAGE, "stream": True},
            headers=_named("messages-stream"),
        ),
        # How the body is labelled: vLLM 0.32 (FastAPI's strict content type) refuses a JSON
        # body labelled otherwise or not at all; tether reads such a body as JSON regardless.
        Entry(
            "chat-no-content-type",
            chat,
            400,
            _chat(),
            headers=_named("chat-no-content-type"),
            content_type=None,
        ),
        Entry(
            "chat-text-plain",
            chat,
            400,
            _chat(),
            headers=_named("chat-text-plain"),
            content_type="text/plain",
        ),
        Entry(
            "chat-logprobs",
            chat,
            200,
            _chat(logprobs=True, top_logprobs=2),
            headers=_named("chat-logprobs"),
        ),
        # Tokenizer routes.
        Entry("tokenize", "/tokenize", 200, {"model": MODEL_NAME, "prompt": "Once upon a time"}),
        Entry(
            "tokenize-chat",
            "/tokenize",
            200,
            {"model": MODEL_NAME, "messages": [{"role": "user", "content": "Hello"}]},
        ),
        Entry("detokenize", "/detokenize", 200, {"model": MODEL_NAME, "tokens": [300, 301, 302]}),
        # Read-only routes.
        Entry("models", "/v1/models", 200, method="GET"),
        Entry("version", "/version", 200, method="GET"),
        Entry("load", "/load", 200, method="GET"),
        Entry("health", "/health", 200, method="GET"),
        Entry("metrics", "/metrics", 200, method="GET", read_body=metric_families),
        # Error bodies.
        Entry(
            "error-unknown-model",
            chat,
            404,
            {**_chat(), "model": "no-such-model"},
            headers=_named("error-unknown-model"),
        ),
        Entry(
            "error-bad-json",
            chat,
            400,
            b'{"model": "tiny", "messages": [',
            headers=_named("bad-json"),
        ),
        Entry(
            "error-missing-field",
            chat,
            400,
            {"model": MODEL_NAME, "max_tokens": 4},
            headers=_named("error-missing-field"),
        ),
        Entry(
            "error-bad-field-type",
            completions,
            400,
            _completion(max_tokens="many"),
            headers=_named("error-bad-field-type"),
        ),
        Entry(
            "error-embeddings-on-a-generative-model",
            "/v1/embeddings",
            404,
            {"model": MODEL_NAME, "input": "hello"},
            headers=_named("error-embeddings"),
        ),
        Entry("error-unknown-route", "/v1/no-such-route", 404, method="GET"),
        Entry("error-wrong-method", chat, 405, method="GET"),
        # A multipart upload (a text model has no transcription route: the same refusal).
        Entry(
            "transcription-multipart",
            "/v1/audio/transcriptions",
            404,
            TRANSCRIPTION_UPLOAD,
            content_type=f"multipart/form-data; boundary={BOUNDARY}",
        ),
        # The Realtime API's WebSocket handshake: a text model has no realtime route, and vLLM
        # refuses the handshake with 403 (a plain GET there is 404, ENGINES.md §13.2).
        Entry(
            "realtime-websocket-handshake",
            "/v1/realtime",
            403,
            method="GET",
            headers=WEBSOCKET_HANDSHAKE,
        ),
    ]


CATALOGUE = _catalogue()


def _drop_added_request_id(entry: Entry, expected: dict[str, Any], got: dict[str, Any]) -> None:
    """tether answers every request with the client's ID in X-Request-Id (README), also where
    vLLM's middleware adds none (its refusal of a WebSocket handshake): that addition goes, if
    it is the ID the client named."""
    if any(line.startswith("x-request-id: ") for line in expected["headers"]):
        return
    named = [value for name, value in entry.headers if name.lower() == "x-request-id"]
    added = f"x-request-id: {named[0]}" if named else UNNAMED_REQUEST_ID
    got["headers"] = [line for line in got["headers"] if line != added]


def _drop_added_server(expected: dict[str, Any], got: dict[str, Any]) -> None:
    """uvicorn names itself in `Server` on every answer but its refusal of a WebSocket
    handshake; where the engine's answer has none, tether's server (aiohttp) adds its own
    name, as any HTTP server does (nginx replaces the engine's with its own everywhere)."""
    if any(line.startswith("server: ") for line in expected["headers"]):
        return
    got["headers"] = [line for line in got["headers"] if not line.startswith("server: ")]


@on_transparency
@pytest.mark.parametrize(
    "entry", [pytest.param(entry, id=entry.name, marks=entry.marks) for entry in CATALOGUE]
)
def test_an_answer_through_tether_is_the_engines_own(
    stack: Stack, log_dir: pathlib.Path, entry: Entry
) -> None:
    """The same request straight to vLLM and through tether: the same status, headers and
    body, but for the differences in `ALLOWED`."""
    straight = _exchange(stack.vllm.port, entry.request())
    through = _exchange(stack.tether.port, entry.request())

    assert straight.status == entry.status, (
        f"vLLM itself answered {entry.method} {entry.path} with {straight.status}, the "
        f"catalogue expects {entry.status}: {straight.body[:500]!r}"
    )
    assert entry.shows in straight.body, (
        f"vLLM's own answer to {entry.name} lacks {entry.shows!r}: {straight.body[:500]!r}"
    )
    expected, got = entry.answer(straight), entry.answer(through)
    _drop_added_request_id(entry, expected, got)
    _drop_added_server(expected, got)
    if got != expected:
        diff = list(
            difflib.unified_diff(
                _lines(expected), _lines(got), "straight to vLLM", "through tether", lineterm=""
            )
        )
        shown = diff[:DIFF_LINES] + [f"... {len(diff) - DIFF_LINES} more lines"] * (
            len(diff) > DIFF_LINES
        )
        pytest.fail(
            f"{entry.method} {entry.path} ({entry.name}) through tether differs from vLLM's "
            "own answer:\n" + "\n".join(shown),
            pytrace=False,
        )
