"""The openai Node SDK (the official `openai` npm package, pinned) reads the streams tether
changes as it reads the engine's: comments from TETHER_SSE_KEEPALIVE before and after the
engine's head, an engine error after the early commit, and the `id:` lines of
TETHER_RESUME_GRACE. The Python SDK's tests are beside each feature's own
(`tests/test_sse_keepalive.py`, `tests/test_resume.py`)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from proxy.upstream.stream_keepalive import KEEPALIVE_COMMENT

from .support.chat import chat_body
from .support.in_process import TetherFactory
from .support.openai_node import (
    NODE_MODULES_VARIABLE,
    OPENAI_NODE_VERSION,
    NodeChat,
    node_sdk_missing,
    openai_node_chat,
)
from .support.upstreams import FakeEngineFactory

ROOT = Path(__file__).resolve().parents[1]
COMMENT = KEEPALIVE_COMMENT.strip()
# The Python SDK's tests' interval. The engine is silent for several of them before its head
# (tether then begins the client's stream itself) or after it (a prefill). Not both in one
# stream: the fake engine's prefill starts when the request arrives, so one no longer than the
# wait for its head leaves no silence after the head.
KEEPALIVE = 0.1
SILENT: dict[str, dict[str, Any]] = {
    "before_head": {"head_after": 0.5},
    "after_head": {"prefill": 0.5},
}

_MISSING = node_sdk_missing()
needs_node_sdk = pytest.mark.skipif(_MISSING is not None, reason=str(_MISSING))


async def _blocks(http: aiohttp.ClientSession, port: int, body: dict[str, Any]) -> list[bytes]:
    """The blocks (events and comments) of a stream as it reached a raw client."""
    async with http.post(
        f"http://127.0.0.1:{port}/v1/chat/completions",
        json=body,
        headers={"Authorization": "Bearer x"},  # the SDK's caller
    ) as response:
        return [block for block in (await response.read()).split(b"\n\n") if block]


@needs_node_sdk
@pytest.mark.parametrize("where", ["before_head", "after_head"])
async def test_the_node_sdk_reads_a_kept_alive_stream_unchanged(
    fake_engine: FakeEngineFactory, tether: TetherFactory, http: aiohttp.ClientSession, where: str
) -> None:
    """The Node SDK reads a stream with comments where its engine was silent, before the
    engine's head or after it, into the same chunks and text as without keep-alive."""
    _, engine_url = await fake_engine()
    kept = await tether(engine_url, engine="vllm", sse_keepalive=KEEPALIVE)
    plain = await tether(engine_url, engine="vllm")
    body = chat_body(**SILENT[where])

    read = await openai_node_chat(kept.port, body)
    assert read == await openai_node_chat(plain.port, body)
    assert read.text == " tok0 tok1 tok2 tok3 tok4"
    # (the stream it read began with comments)
    assert (await _blocks(http, kept.port, body))[0] == COMMENT


@needs_node_sdk
async def test_the_node_sdk_raises_an_engine_error_after_the_early_commit(
    fake_engine: FakeEngineFactory, tether: TetherFactory
) -> None:
    """An engine error that arrives after the client's stream began is the SDK's `APIError`
    carrying the engine's message, raised from the stream (no status: the head said 200)."""
    _, engine_url = await fake_engine()
    server = await tether(engine_url, engine="vllm", sse_keepalive=KEEPALIVE)

    read = await openai_node_chat(server.port, chat_body(head_after=0.5, answer_status=503))
    assert read == NodeChat(error_class="APIError", error_message="the fake engine answers 503")


@needs_node_sdk
async def test_the_node_sdk_reads_a_numbered_stream_unchanged(
    fake_engine: FakeEngineFactory, tether: TetherFactory, http: aiohttp.ClientSession
) -> None:
    """The `id:` lines resume adds are SSE fields the Node SDK reads past: its chunks and text
    are those of the same stream without them."""
    _, engine_url = await fake_engine(token_interval=0.01)
    plain = await tether(engine_url)
    numbered = await tether(engine_url, resume_grace=5.0)
    body = chat_body(max_tokens=8)

    read = await openai_node_chat(numbered.port, body)
    assert read == await openai_node_chat(plain.port, body)
    assert read.text == "".join(f" tok{i}" for i in range(8))
    # (the stream it read had every event numbered)
    raw = await _blocks(http, numbered.port, body)
    assert all(re.match(rb"id: \d+\n", block) for block in raw)


@pytest.mark.socket_free
def test_ci_installs_the_pinned_node_sdk_and_names_it_so_nothing_skips() -> None:
    """.ci/run installs the version the tests pin and the docs name, and sets the variable
    under which a missing node or package fails these tests instead of skipping them."""
    run = (ROOT / ".ci" / "run").read_text()
    assert f"openai@{OPENAI_NODE_VERSION}" in run
    assert re.search(rf"^export {NODE_MODULES_VARIABLE}=", run, re.MULTILINE)
    assert f"openai` {OPENAI_NODE_VERSION}" in (ROOT / "docs" / "streams.md").read_text()
