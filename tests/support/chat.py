"""The chat completion request the in-process tests send, and reading the IDs of its answer."""

from __future__ import annotations

import json
from typing import Any

from .canaries import CANARY_PROMPT


def chat_body(stream: bool = True, max_tokens: int = 5, **fake: Any) -> dict[str, Any]:
    """A chat completion request whose prompt is the canary (it must never be logged); `fake`
    is the fake engine's per-request behaviour (`tether_fake_engine`)."""
    body: dict[str, Any] = {
        "model": "fake",
        "messages": [{"role": "user", "content": CANARY_PROMPT}],
        "stream": stream,
        "max_tokens": max_tokens,
    }
    if fake:
        body["fake"] = fake
    return body


def sse_ids(text: str) -> list[str]:
    """The `id` of every JSON event in an SSE body."""
    return [
        json.loads(line[len("data: ") :])["id"]
        for line in text.splitlines()
        if line.startswith("data: {")
    ]
