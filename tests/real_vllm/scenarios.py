"""Steps the tests share: building requests, reading vLLM's and tether's state, saturating vLLM."""

from __future__ import annotations

import json
import re
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest

from ..support.metrics import MetricsSnapshot, scrape
from ..support.raw_http import RawExchange, request_head
from ..support.real_engine.stacks import MODEL_NAME
from ..support.waiting import wait_until
from .processes import (
    DEFAULT,
    DEV_MODE,
    DEV_MODE_WITH_MIDDLEWARE,
    TRANSPARENCY,
    WITH_MIDDLEWARE,
    Stack,
)

CHAT_PATH = "/v1/chat/completions"
INTERNAL_ID = re.compile(r"^[0-9a-f]{32}$")
# Long enough that nothing finishes on its own during a test (about 3-6 s alone on one core).
LONG = 1900
# How long vLLM may take to stop a request after the client left; observed ~0.1 s directly.
ABORT_DEADLINE = 5.0
# A stop that must have come from tether's abort call: observed 10-100 ms, and below tether's
# TETHER_ABORT_CONFIRM_TIMEOUT (2 s), after which it would drop the connection instead.
STOPS_WITHIN = 1.5

# vLLM 0.32 with a user `--middleware` function (a Starlette BaseHTTPMiddleware) sometimes
# keeps generating for seconds after a streaming client that was reading closes its
# connection: reproduced without tether (test_abort_timing.py), so not tether's doing.
MIDDLEWARE_LAG = pytest.mark.xfail(
    strict=False,
    reason="vLLM 0.32 + BaseHTTPMiddleware: a closed streaming connection is sometimes noticed "
    "1-7 s late (reproduced with no tether in between); the dev-mode+middleware runs show "
    "that tether's explicit abort removes it",
)

on_default = pytest.mark.parametrize("stack", [DEFAULT.name], indirect=True)
on_dev_mode = pytest.mark.parametrize("stack", [DEV_MODE.name], indirect=True)
on_middleware = pytest.mark.parametrize("stack", [WITH_MIDDLEWARE.name], indirect=True)
on_transparency = pytest.mark.parametrize("stack", [TRANSPARENCY.name], indirect=True)
on_default_and_dev = pytest.mark.parametrize("stack", [DEFAULT.name, DEV_MODE.name], indirect=True)
on_all = pytest.mark.parametrize(
    "stack",
    [
        DEFAULT.name,
        pytest.param(WITH_MIDDLEWARE.name, marks=MIDDLEWARE_LAG),
        DEV_MODE.name,
        DEV_MODE_WITH_MIDDLEWARE.name,
    ],
    indirect=True,
)


def chat(max_tokens: int, stream: bool, prompt: str = "Tell me a long story.") -> dict[str, Any]:
    """A chat request that generates exactly `max_tokens` tokens (the tiny model never stops)."""
    return {
        "model": MODEL_NAME,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": stream,
    }


def completion(max_tokens: int, stream: bool, prompts: int = 1) -> dict[str, Any]:
    """A completions request generating `max_tokens` for each of `prompts` prompts."""
    texts = ["Once upon a time", "In a land far away", "It was a dark night"][:prompts]
    return {
        "model": MODEL_NAME,
        "prompt": texts[0] if prompts == 1 else texts,
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": stream,
    }


def message(max_tokens: int, stream: bool) -> dict[str, Any]:
    """An Anthropic messages request. That API has no `ignore_eos`: greedy decoding keeps the
    tiny model (random weights) from ending early with this prompt."""
    return {
        "model": MODEL_NAME,
        "messages": [{"role": "user", "content": "Tell me a long story."}],
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "stream": stream,
    }


def response(max_tokens: int, stream: bool, **fields: Any) -> dict[str, Any]:
    """An OpenAI Responses API request; `fields` adds or overrides body fields."""
    return {
        "model": MODEL_NAME,
        "input": "Tell me a long story.",
        "max_output_tokens": max_tokens,
        "ignore_eos": True,
        "stream": stream,
        **fields,
    }


@dataclass(frozen=True)
class GenerationRoute:
    """A route the tiny model generates on, and the engine request IDs vLLM runs a request
    of it under, as vLLM's log names them (`{id}`: tether's internal ID)."""

    name: str
    path: str
    make_body: Callable[[int, bool], dict[str, Any]]
    engine_ids: tuple[str, ...]
    # The `id` the client gets (`{client}`: its X-Request-Id, `{id}`: tether's ID).
    client_id: str

    def body(self, max_tokens: int, stream: bool) -> dict[str, Any]:
        return self.make_body(max_tokens, stream)

    def engine_request_ids(self, internal_request_id: str) -> list[str]:
        return [pattern.format(id=internal_request_id) for pattern in self.engine_ids]

    def id_for_client(self, client_request_id: str, internal_request_id: str) -> str:
        return self.client_id.format(client=client_request_id, id=internal_request_id)

    def __str__(self) -> str:  # the test ID
        return self.name


# Verified by the tests themselves: every ID here is the one vLLM logs as "Received request".
ROUTES = {
    route.name: route
    for route in (
        GenerationRoute("chat", CHAT_PATH, chat, ("chatcmpl-{id}",), "chatcmpl-{client}"),
        GenerationRoute(
            "completions", "/v1/completions", completion, ("cmpl-{id}-0",), "cmpl-{client}"
        ),
        GenerationRoute(
            "completions-2-prompts",
            "/v1/completions",
            lambda max_tokens, stream: completion(max_tokens, stream, prompts=2),
            ("cmpl-{id}-0", "cmpl-{id}-1"),
            "cmpl-{client}",
        ),
        GenerationRoute(
            "messages", "/v1/messages", message, ("chatcmpl-{id}",), "chatcmpl-{client}"
        ),
        # The Responses API's ID is the client's handle for follow-up calls: not mapped back.
        GenerationRoute("responses", "/v1/responses", response, ("resp_{id}_0",), "resp_{id}"),
    )
}


def response_id(event: dict[str, Any]) -> str | None:
    """The `id` a route's first event or JSON answer gives the client (chat, completions:
    `id`; Anthropic `message_start`: `message.id`; Responses `response.created`:
    `response.id`)."""
    for holder in (event, event.get("message"), event.get("response")):
        if isinstance(holder, dict) and isinstance(holder.get("id"), str):
            return str(holder["id"])
    return None


def via_tether(stack: Stack, client_request_id: str, max_tokens: int, stream: bool) -> RawExchange:
    return RawExchange(
        stack.tether.port, CHAT_PATH, chat(max_tokens, stream), {"X-Request-Id": client_request_id}
    )


def vllm_metrics(stack: Stack) -> MetricsSnapshot:
    return scrape(stack.vllm.url + "/metrics")


def tether_metrics(stack: Stack) -> MetricsSnapshot:
    return stack.tether.metrics()


def vllm_load(stack: Stack) -> float:
    """Requests vLLM is running or holding in its queue."""
    metrics = vllm_metrics(stack)
    return metrics.value("vllm:num_requests_running") + metrics.value("vllm:num_requests_waiting")


def wait_vllm_idle(stack: Stack, timeout: float = ABORT_DEADLINE) -> float:
    return wait_until(lambda: vllm_load(stack) == 0, timeout, "vLLM to run nothing")


def admin_requests(stack: Stack) -> list[dict[str, Any]]:
    return stack.tether.in_flight_requests()


def wait_in_flight(stack: Stack, client_request_id: str, timeout: float = 10.0) -> dict[str, Any]:
    """tether's in-flight entry for `client_request_id`, once it is there."""
    return stack.tether.wait_in_flight(client_request_id, timeout)


def admin_abort(stack: Stack, client_request_id: str) -> tuple[int, bytes]:
    return stack.tether.abort(client_request_id)


def received_ids(stack: Stack, mark: int) -> list[str]:
    """Request IDs (without `chatcmpl-`) vLLM logged as received after `mark`."""
    return [
        m.group(1) for m in stack.vllm.log.find_since(mark, r"Received request chatcmpl-([^\s:]+):")
    ]


def engine_ids_received(stack: Stack, mark: int, internal_request_id: str) -> list[str]:
    """The engine request IDs vLLM logged as received after `mark` that contain tether's ID."""
    return [
        m.group(1)
        for m in stack.vllm.log.find_since(mark, r"Received request (\S+): ")
        if internal_request_id in m.group(1)
    ]


def engine_aborts(stack: Stack, mark: int, internal_request_id: str) -> list[str]:
    """What each `Aborted request(s) <ids>.` line vLLM logged after `mark` that names tether's
    ID says (`<ids>`). An abort by the route logs the IDs as asked; one vLLM made itself after
    a dropped connection logs its internal form, `<engine id>-<8 hex>`."""
    return [
        m.group(1)
        for m in stack.vllm.log.find_since(mark, r"Aborted request\(s\) (\S+)\.$")
        if internal_request_id in m.group(1)
    ]


def wait_engine_abort(stack: Stack, mark: int, internal_request_id: str) -> str:
    """The `Aborted request(s)` line naming `internal_request_id` (any suffix), once logged."""
    match = stack.vllm.log.wait_for(
        mark,
        rf"^.*Aborted request\(s\)[^\n]*chatcmpl-{internal_request_id}[^\n]*$",
        timeout=ABORT_DEADLINE,
    )
    return match.group(0)


def generated_tokens(stack: Stack) -> float:
    """vLLM's `vllm:generation_tokens_total` (it counts aborted requests' tokens too)."""
    return vllm_metrics(stack).value("vllm:generation_tokens_total")


def generated_when_settled(stack: Stack) -> float:
    """The same once two reads a few steps apart agree: vLLM's counters lag its engine."""
    previous = generated_tokens(stack)
    while True:
        time.sleep(0.03)
        current = generated_tokens(stack)
        if current == previous:
            return current
        previous = current


def leave_stream(
    stack: Stack, route: GenerationRoute, client_request_id: str
) -> tuple[str, float, list[dict[str, Any]]]:
    """Stream `route` through tether, read a few events, close; (internal ID, seconds from
    the close until vLLM runs nothing, the events read)."""
    exchange = RawExchange(
        stack.tether.port,
        route.path,
        route.body(LONG, stream=True),
        {"X-Request-Id": client_request_id},
    )
    assert exchange.read_head() == 200
    assert exchange.headers.get("x-request-id") == client_request_id
    events = exchange.chunks(8)
    internal_request_id = str(wait_in_flight(stack, client_request_id)["internal_request_id"])
    closed_at = exchange.close()
    wait_vllm_idle(stack)
    return internal_request_id, time.monotonic() - closed_at, events


def leave_non_streaming(
    stack: Stack, route: GenerationRoute, client_request_id: str, after_tokens: int
) -> tuple[str, float]:
    """A non-streaming request through tether, closed once vLLM generated `after_tokens`
    for it; (internal ID, seconds from the close until vLLM runs nothing)."""
    generated_before = generated_tokens(stack)
    exchange = RawExchange(
        stack.tether.port,
        route.path,
        route.body(LONG, stream=False),
        {"X-Request-Id": client_request_id},
    )
    internal_request_id = str(wait_in_flight(stack, client_request_id)["internal_request_id"])
    wait_until(
        lambda: generated_tokens(stack) - generated_before >= after_tokens,
        20,
        f"vLLM to generate {after_tokens} tokens",
    )
    closed_at = exchange.close()
    wait_vllm_idle(stack)
    return internal_request_id, time.monotonic() - closed_at


class Saturation:
    """vLLM's 16 sequence slots filled with long streams sent straight to vLLM, so the next
    request waits in its queue before its first token (or fewer streams: a busy engine)."""

    SLOTS = 16

    def __init__(self, stack: Stack, streams: int = SLOTS) -> None:
        self._stack = stack
        self._count = streams
        self._streams: list[socket.socket] = []

    def __enter__(self) -> Saturation:
        body = json.dumps(chat(LONG, stream=True)).encode()
        for index in range(self._count):
            sock = socket.create_connection(("127.0.0.1", self._stack.vllm.port), timeout=30)
            fields = [
                ("Content-Type", "application/json"),
                ("X-Request-Id", f"saturate-{index}"),
                ("Content-Length", str(len(body))),
            ]
            sock.sendall(request_head(CHAT_PATH, headers=fields, host="127.0.0.1") + body)
            self._streams.append(sock)
        wait_until(
            lambda: vllm_metrics(self._stack).value("vllm:num_requests_running") == self._count,
            20,
            f"vLLM to run {self._count} requests",
        )
        return self

    def __exit__(self, *exc: object) -> None:
        for sock in self._streams:
            sock.close()
        wait_vllm_idle(self._stack, timeout=40)
