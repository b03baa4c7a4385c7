"""Logs of the real process: JSON lines only, one summary per request with both IDs, one event
per disconnect and per abort."""

from __future__ import annotations

import asyncio
import json
import re
import select
import threading
from datetime import UTC, datetime

import aiohttp
import pytest

from proxy.observe.logging import LoopTurnLines

from .support.chat import chat_body
from .support.processes import TetherProcessFactory
from .support.raw_http import RawClient
from .support.upstreams import FakeEngineFactory

TIMESTAMP = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{6}Z")


async def test_every_line_is_json_and_requests_are_summarised(
    fake_engine: FakeEngineFactory,
    tether_process: TetherProcessFactory,
    http: aiohttp.ClientSession,
) -> None:
    """A completed request and an abandoned one produce the documented events and fields."""
    started = datetime.now(UTC)
    engine, engine_url = await fake_engine(token_interval=0.01)
    process = await tether_process(engine_url, TETHER_LOG_FORMAT="json")
    async with http.post(
        process.url(), json=chat_body(max_tokens=2), headers={"X-Request-Id": "done-1"}
    ) as response:
        await response.read()
    client = await RawClient.connect(process.port)
    await client.send_request(chat_body(max_tokens=10_000), headers={"X-Request-Id": "gone-1"})
    await client.read_until(b"tok0")
    client.close_rst()
    await engine.wait_for(lambda: engine.aborted_ids() != set())
    assert await process.stop() == 0

    events = [json.loads(line) for line in process.output().splitlines()]  # every line parses
    for event in events:  # UTC, to the microsecond, as log shippers parse it
        assert TIMESTAMP.fullmatch(event["timestamp"]), event
        written = datetime.fromisoformat(event["timestamp"].replace("Z", "+00:00"))
        assert abs((written - started).total_seconds()) < 60, (event, started)
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
    assert abort["result"] == "confirmed" and abort["attempts"] == 1 and abort["latency_ms"] >= 0
    assert abort["client_request_id"] == "gone-1"
    assert abort["engine_request_ids"] == [f"chatcmpl-{gone['internal_request_id']}"]
    assert abort["engine_stop_ms"] >= 0
    assert isinstance(abort["tokens_after_disconnect"], int)


class _Writes:
    """A stream that records each flushed write (what one system call would carry)."""

    def __init__(self) -> None:
        self.writes: list[str] = []
        self._buffer = ""

    def write(self, text: str) -> int:
        self._buffer += text
        return len(text)

    def flush(self) -> None:
        if self._buffer:
            self.writes.append(self._buffer)
            self._buffer = ""


@pytest.mark.socket_free
async def test_lines_of_one_loop_turn_go_out_together_in_order_and_whole() -> None:
    """The log stream: a turn's lines wait for its end, then go out in order, in writes no
    longer than PIPE_BUF (workers share a pipe; a longer write could be cut into by
    another's); a line written with no loop running follows what waited."""
    stream = _Writes()
    lines = LoopTurnLines(stream)  # type: ignore[arg-type]  # a TextIO for the writes it makes
    written = [f'{{"event": "line_{index}", "padding": "{"x" * 300}"}}\n' for index in range(40)]
    for line in written:
        lines.write(line)
    lines.flush()
    assert stream.writes == []  # nothing before the turn ends
    await asyncio.sleep(0)
    assert "".join(stream.writes) == "".join(written)
    assert len(stream.writes) > 1
    assert all(len(write) <= select.PIPE_BUF for write in stream.writes)
    assert all(write.endswith("\n") for write in stream.writes)  # never a line cut in two

    stream.writes.clear()
    lines.write("waiting\n")
    other = threading.Thread(target=lines.write, args=("from another thread\n",))
    other.start()  # no loop there: written at once, while this turn's line waits
    other.join(timeout=5)
    assert stream.writes == ["from another thread\n"]
    lines.write_pending()  # (at exit)
    assert stream.writes == ["from another thread\n", "waiting\n"]
