"""Exact usage without changing what a client gets, on the real vLLM: a stream whose client
did not ask for usage is the same bytes through tether (which asks, and takes the usage event
out) as straight from vLLM (not asked), system fingerprint included; the engine's own counts
reach tether's request line."""

from __future__ import annotations

import re
from typing import Any

import pytest

from ..support.raw_http import RawExchange
from ..support.real_engine.stacks import MODEL_NAME
from .processes import Stack
from .scenarios import CHAT_PATH, on_default_and_dev

COMPLETIONS_PATH = "/v1/completions"


def _normalised(stream: bytes) -> bytes:
    """Equal up to what differs between two runs of one request: the creation time, and with
    `n > 1` how vLLM interleaves the choices' events (each choice's events keep their order
    and their bytes)."""
    events = re.sub(rb'"created":\d+', b'"created":0', stream).split(b"\n\n")
    by_choice: dict[bytes, list[bytes]] = {}
    for event in events:
        index = re.search(rb'"choices":\[\{"index":(\d+)', event)
        by_choice.setdefault(index.group(1) if index else b"", []).append(event)
    return b"\n\n".join(event for key in sorted(by_choice) for event in by_choice[key])


def _stream(port: int, path: str, body: dict[str, Any], request_id: str) -> bytes:
    exchange = RawExchange(port, path, body, {"X-Request-Id": request_id})
    assert exchange.read_head() == 200
    return exchange.body()


BODIES: dict[str, tuple[str, dict[str, Any]]] = {
    "chat": (
        CHAT_PATH,
        {
            "model": MODEL_NAME,
            "messages": [{"role": "user", "content": "Tell me a story."}],
            "max_tokens": 12,
            "ignore_eos": True,
            "temperature": 0,
            "stream": True,
        },
    ),
    "chat-n2": (
        CHAT_PATH,
        {
            "model": MODEL_NAME,
            "messages": [{"role": "user", "content": "Tell me a story."}],
            "max_tokens": 8,
            "ignore_eos": True,
            # vLLM refuses n > 1 with greedy sampling; a seed makes the two runs equal.
            "temperature": 1.0,
            "seed": 7,
            "n": 2,
            "stream": True,
        },
    ),
    "completions": (
        COMPLETIONS_PATH,
        {
            "model": MODEL_NAME,
            "prompt": "Once upon a time",
            "max_tokens": 12,
            "ignore_eos": True,
            "temperature": 0,
            "stream": True,
        },
    ),
}


@on_default_and_dev
@pytest.mark.parametrize("kind", BODIES)
def test_a_stream_without_usage_asked_is_vllms_own_bytes(stack: Stack, kind: str) -> None:
    """Same request, same client ID, through tether and straight: the same bytes but for the
    creation time; vLLM's finishing chunks carry their system fingerprint both ways; tether's
    line has vLLM's usage (`tokens_counted` engine)."""
    path, body = BODIES[kind]
    mark = stack.tether.log.mark()
    through = _stream(stack.tether.port, path, body, f"usage-{kind}")
    straight = _stream(stack.vllm.port, path, body, f"usage-{kind}")

    assert _normalised(through) == _normalised(straight)
    assert b'"system_fingerprint"' in straight and b'"usage":{' not in straight
    line = stack.tether.log.wait_json(mark, "request_finished", client_request_id=f"usage-{kind}")
    choices = int(body.get("n", 1))
    assert line["tokens_counted"] == "engine"
    assert line["completion_tokens"] == int(body["max_tokens"]) * choices
    assert line["prompt_tokens"] > 0
