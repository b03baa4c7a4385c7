"""What llama-server itself answers, pinned for the `llamacpp` engine profile tether is to get
(README "Facts"): how it names itself without tether leaking anything, and that a
non-streaming answer is the same as its stream assembled, for the same seeded request."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any

from ..support.blocking_http import http_get
from .processes import Stack
from .scenarios import chat, direct, on_two_slots, via_tether

# A seeded request whose answer is the same every time: no prompt cache (a prompt partly
# served from a slot's cache is computed in other batches, and its first logprob differs in
# the last digits), logprobs asked.
SEEDED: dict[str, Any] = {"seed": 42, "cache_prompt": False, "logprobs": True, "top_logprobs": 2}
TOKENS = 12


@on_two_slots
def test_llamacpp_names_itself(stack: Stack) -> None:
    """llama-server says who it is in its `Server` header, `/v1/models`' `owned_by` and
    `/health`'s body, on every answer."""
    status, body = http_get(stack.llamacpp.url + "/v1/models")
    assert status == 200
    (model,) = json.loads(body)["data"]
    assert (model["id"], model["owned_by"]) == ("tiny", "llamacpp")
    assert http_get(stack.llamacpp.url + "/health") == (200, b'{"status":"ok"}')
    for path in ("/health", "/v1/models", "/no-such-route"):
        assert _server_header(stack.llamacpp.url + path) == "llama.cpp", path


def _server_header(url: str) -> str | None:
    """The `Server` header of a GET, whatever its status."""
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            server: str | None = response.headers.get("Server")
    except urllib.error.HTTPError as error:
        server = error.headers.get("Server")
    return server


def _answer(stack: Stack) -> dict[str, Any]:
    with direct(stack, chat(TOKENS, stream=False, **SEEDED)) as exchange:
        assert exchange.read_head() == 200
        answer: dict[str, Any] = json.loads(exchange.body())
    return answer


def _stream(stack: Stack) -> list[dict[str, Any]]:
    payload = chat(TOKENS, stream=True, stream_options={"include_usage": True}, **SEEDED)
    with direct(stack, payload) as exchange:
        assert exchange.read_head() == 200
        events = list(exchange.events())
    assert events[-1] == "[DONE]"
    return [json.loads(event) for event in events[:-1]]


@on_two_slots
def test_answer_is_its_stream_assembled(stack: Stack) -> None:
    """For the same seeded request, the non-streaming answer's message, logprobs, finish
    reason and usage are what its stream's events add up to; both carry `timings`, the stream
    on its last event."""
    answer = _answer(stack)
    chunks = _stream(stack)
    choices = [chunk["choices"][0] for chunk in chunks if chunk["choices"]]
    deltas = [choice["delta"] for choice in choices]
    assembled = {
        "role": deltas[0]["role"],
        "content": "".join(delta.get("content") or "" for delta in deltas),
    }
    logprobs = [p for choice in choices for p in (choice.get("logprobs") or {}).get("content", [])]
    (choice,) = answer["choices"]
    assert choice["message"] == assembled
    assert choice["logprobs"]["content"] == logprobs
    assert choice["finish_reason"] == choices[-1]["finish_reason"] == "length"
    assert answer["usage"] == chunks[-1]["usage"]
    assert answer["usage"]["completion_tokens"] == TOKENS
    assert set(answer["timings"]) == set(chunks[-1]["timings"])
    assert {chunk["id"] for chunk in chunks} != {answer["id"]}  # each its own random ID


@on_two_slots
def test_tethers_answer_is_llamacpps_own(stack: Stack) -> None:
    """Through tether a non-streaming request goes upstream as a stream, and the answer
    assembled from it equals llama-server's own for the same seeded request in every member
    but the ones each response draws or times anew (`id`, `created`, `timings`' values):
    the same members in the same order, message, logprobs, finish reason, usage."""
    straight = _answer(stack)
    with via_tether(stack, "assembled", chat(TOKENS, stream=False, **SEEDED)) as exchange:
        assert exchange.read_head() == 200
        assert exchange.headers["content-type"] == "application/json; charset=utf-8"
        assembled: dict[str, Any] = json.loads(exchange.body())
    assert list(assembled) == list(straight)
    assert assembled["id"] == "chatcmpl-assembled"
    assert set(assembled["timings"]) == set(straight["timings"])
    for answer in (assembled, straight):
        for drawn in ("id", "created", "timings"):
            answer.pop(drawn)
    assert assembled == straight
