"""A stream resumed through tether in front of the real vLLM (TETHER_RESUME_GRACE): the client's
connection drops mid-answer, it resumes with `Last-Event-ID`, and the text it reads is the
text of an uninterrupted run; vLLM never hears of the drop."""

from __future__ import annotations

import http.client
import json
import pathlib
import time
from typing import Any

from ..support.real_engine.stacks import MODEL_NAME
from ..support.real_engine.tether import Tether, start_tether
from .processes import Stack
from .scenarios import CHAT_PATH, engine_aborts, on_dev_mode, wait_vllm_idle

CALLER = {"Authorization": "Bearer resume-suite-caller", "Content-Type": "application/json"}
MAX_TOKENS = 120
# Greedy decoding with a fixed seed: vLLM writes the same answer every time.
BODY = {
    "model": MODEL_NAME,
    "messages": [{"role": "user", "content": "Tell me a long story."}],
    "max_tokens": MAX_TOKENS,
    "stream": True,
    "temperature": 0,
    "seed": 1234,
    "ignore_eos": True,
}


def _events(response: http.client.HTTPResponse, count: int | None = None) -> list[bytes]:
    """The next `count` whole events (to the stream's end by default)."""
    events: list[bytes] = []
    event = b""
    while count is None or len(events) < count:
        line = response.readline()
        if not line:
            break
        event += line
        if line in (b"\n", b"\r\n"):
            events.append(event)
            event = b""
    return events


def _text(events: list[bytes]) -> str:
    text = ""
    for event in events:
        for line in event.splitlines():
            if line.startswith(b"data: {"):
                for choice in json.loads(line[len(b"data: ") :])["choices"]:
                    text += choice["delta"].get("content") or ""
    return text


def _last_id(events: list[bytes]) -> int:
    first = events[-1].split(b"\n", 1)[0]
    assert first.startswith(b"id: "), events[-1]
    return int(first[len(b"id: ") :])


def _post(tether: Tether, headers: dict[str, str]) -> tuple[http.client.HTTPConnection, Any]:
    connection = http.client.HTTPConnection("127.0.0.1", tether.port, timeout=60)
    connection.request("POST", CHAT_PATH, json.dumps(BODY), {**CALLER, **headers})
    return connection, connection.getresponse()


@on_dev_mode
def test_a_dropped_stream_resumed_reads_as_an_uninterrupted_one_and_vllm_never_knows(
    stack: Stack, log_dir: pathlib.Path
) -> None:
    """Read 10 events, drop the connection, resume with the last event's ID after a second:
    the concatenated text equals an uninterrupted run's, the events are numbered without a
    gap or a repeat, and vLLM logged no abort of the request."""
    tether = start_tether(
        stack.vllm.url, log_dir / "tether-resume.log", settings={"TETHER_RESUME_GRACE": "30"}
    )
    try:
        connection, response = _post(tether, {})
        whole = _events(response)
        connection.close()
        assert whole[-1].endswith(b"data: [DONE]\n\n"), whole[-1]

        mark, tether_mark = stack.vllm.log.mark(), tether.log.mark()
        connection, response = _post(tether, {"X-Request-Id": "resume-me"})
        assert response.status == 200
        before = _events(response, 10)
        connection.sock.close()  # the network drops it
        connection.close()
        held = tether.log.wait_json(tether_mark, "stream_held")
        time.sleep(1.0)  # the client is away; vLLM goes on

        resume = http.client.HTTPConnection("127.0.0.1", tether.port, timeout=60)
        resume.request(
            "GET",
            "/v1/requests/resume-me/stream",
            headers={**CALLER, "Last-Event-ID": str(_last_id(before))},
        )
        resumed = resume.getresponse()
        assert resumed.status == 200
        after = _events(resumed)
        resume.close()

        assert _text(before) + _text(after) == _text(whole)
        numbers = [int(event.split(b"\n", 1)[0][len(b"id: ") :]) for event in before + after]
        assert numbers == list(range(1, len(numbers) + 1))
        assert after[-1].endswith(b"data: [DONE]\n\n")
        wait_vllm_idle(stack)
        assert engine_aborts(stack, mark, held["internal_request_id"]) == []
        resumed_line = tether.log.wait_json(tether_mark, "stream_resumed")
        assert resumed_line["client_request_id"] == "resume-me"
    finally:
        tether.process.stop()
