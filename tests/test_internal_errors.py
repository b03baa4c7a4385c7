"""A bug in tether still ends on purpose: a 500 OpenAI-style JSON (or a cut stream once the
response started), the engine's work stopped, one error-level line with the exception type
and a traceback that holds no local variables (they would hold prompts and keys)."""

from __future__ import annotations

import json
from typing import Any

import aiohttp
import pytest

from proxy.faults import RESPONSE_HEAD, STREAM_END
from tether_fake_engine import GenerationState

from .support.canaries import CANARY_SECRET
from .support.chat import chat_body
from .support.faults import BugAt
from .support.in_process import TetherFactory, drained, settled, url
from .support.metrics import metric
from .support.raw_http import RawClient
from .support.upstreams import FakeEngineFactory


def error_lines(output: str) -> list[dict[str, Any]]:
    events = [json.loads(line) for line in output.splitlines() if line.startswith("{")]
    return [event for event in events if event.get("level") == "error"]


async def test_bug_before_the_response_started_is_a_500_json_and_one_error_line(
    fake_engine: FakeEngineFactory,
    tether: TetherFactory,
    http: aiohttp.ClientSession,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The client gets 500 `internal_error` (never aiohttp's plain-text page), the request is
    counted `internal_error`, the engine is aborted, and the one error line has the
    exception type and frames but no locals (here one holds a secret)."""
    engine, engine_url = await fake_engine(token_interval=0.01)
    server = await tether(engine_url, faults=BugAt(RESPONSE_HEAD))

    async with http.post(
        url(server), json=chat_body(max_tokens=100_000), headers={"X-Request-Id": "bug-1"}
    ) as response:
        assert response.status == 500
        assert response.headers["X-Request-Id"] == "bug-1"
        error = (await response.json())["error"]
    assert error["code"] == "internal_error" and "TetherBug" in error["message"]
    await settled(server)
    await drained(server)

    registry = server.context.metrics.registry
    assert metric(registry, "tether_request_outcomes_total", outcome="internal_error") == 1
    [generation] = engine.generations.values()
    assert generation.state is GenerationState.ABORTED  # no work left running upstream
    output = capsys.readouterr().out
    [line] = error_lines(output)
    assert line["event"] == "request_finished" and line["outcome"] == "internal_error"
    [exception] = line["exception"]
    assert exception["exc_type"] == "TetherBug"
    assert exception["frames"] and all("locals" not in frame for frame in exception["frames"])
    assert CANARY_SECRET not in output


async def test_bug_after_the_response_started_cuts_the_stream(
    fake_engine: FakeEngineFactory,
    tether: TetherFactory,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Once the head went out the status cannot change: the stream is cut (no terminating
    chunk), the summary keeps its 200 and says `internal_error`."""
    _, engine_url = await fake_engine(token_interval=0.01)
    server = await tether(engine_url, faults=BugAt(STREAM_END))
    client = await RawClient.connect(server.port)
    await client.send_request(chat_body(max_tokens=3))

    received = await client.read_until_cut()

    assert received.startswith(b"HTTP/1.1 200") and b"[DONE]" in received
    assert not received.endswith(b"0\r\n\r\n")
    await settled(server)
    [line] = error_lines(capsys.readouterr().out)
    assert (line["status"], line["outcome"]) == (200, "internal_error")
