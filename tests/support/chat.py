"""The chat completion request the in-process tests send, and reading the IDs of its answer."""

from __future__ import annotations

import json
from typing import Any

import openai

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


async def openai_chat_text(port: int, max_tokens: int = 5, **fake: Any) -> str:
    """A streamed chat completion through the openai SDK against the server on `port`: the
    text its chunks make (`fake`: the fake engine's per-request behaviour)."""
    client = openai.AsyncOpenAI(
        base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0, timeout=20
    )
    async with client:
        stream = await client.chat.completions.create(
            model="fake",
            messages=[{"role": "user", "content": "hello"}],
            stream=True,
            max_tokens=max_tokens,
            extra_body={"fake": fake},
        )
        return "".join([chunk.choices[0].delta.content or "" async for chunk in stream])
