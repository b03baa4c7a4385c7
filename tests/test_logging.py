"""Logs of the real process: JSON lines only, one summary per request with both IDs, one event
per disconnect and per abort."""

from __future__ import annotations

import asyncio
import json
import signal

import aiohttp

from .conftest import RawClient, chat_body
from .test_shutdown import _start_tether


async def test_every_line_is_json_and_requests_are_summarised(fake_engine) -> None:
    """A completed request and an abandoned one produce the documented events and fields."""
    engine, engine_url = await fake_engine(token_interval=0.01)
    process, port, _ = await _start_tether(engine_url, TETHER_LOG_FORMAT="json")
    async with aiohttp.ClientSession() as session:
        async with session.post(
            f"http://127.0.0.1:{port}/v1/chat/completions",
            json=chat_body(max_tokens=2),
            headers={"X-Request-Id": "done-1"},
        ) as response:
            await response.read()
    client = await RawClient.connect(port)
    await client.send_request(chat_body(max_tokens=10_000), headers={"X-Request-Id": "gone-1"})
    await client.read_until(b"tok0")
    client.close_rst()
    await engine.wait_for(lambda: engine.aborted_ids() != set())
    process.send_signal(signal.SIGTERM)
    assert await asyncio.wait_for(process.wait(), 10) == 0

    lines = (await process.stdout.read()).decode().splitlines()  # type: ignore[union-attr]
    events = [json.loads(line) for line in lines]  # every line parses
    finished = {e["client_request_id"]: e for e in events if e["event"] == "request_finished"}
    done, gone = finished["done-1"], finished["gone-1"]
    assert (done["status"], done["outcome"]) == (200, "completed")
    assert (gone["status"], gone["outcome"]) == (499, "client_disconnected")
    for event in (done, gone):
        assert len(event["internal_request_id"]) == 32
        for key in ("method", "path", "duration_ms", "ttfb_ms", "bytes_out", "timestamp", "level"):
            assert key in event
    [disconnect] = [e for e in events if e["event"] == "client_disconnected"]
    assert disconnect["phase"] == "streaming"
    assert disconnect["internal_request_id"] == gone["internal_request_id"]
    [abort] = [e for e in events if e["event"] == "abort_sent"]
    assert abort["result"] == "ok" and abort["attempts"] == 1 and abort["latency_ms"] >= 0
    assert abort["client_request_id"] == "gone-1"
