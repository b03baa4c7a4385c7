"""vLLM's Realtime API (`/v1/realtime`: streaming transcription over a WebSocket) through
tether, against the real vLLM serving a tiny Qwen3-ASR realtime model
(tests/engines/vllm_realtime.sh, random weights): a session through tether is the session
straight, and a client whose socket resets mid-transcription ends vLLM's session as soon
through tether as straight (vLLM's cleanup aborts the engine request; its log and
`/metrics` say when).

vLLM's protocol (`entrypoints/speech_to_text/realtime/`): `session.created` on connect; the
client sends `session.update` (the model), `input_audio_buffer.commit` (start),
`input_audio_buffer.append` (base64 PCM16, 16 kHz, mono) and a final commit; vLLM
transcribes each 5 s of audio as one segment of up to 64 tokens (`transcription.delta`
events) under one engine request `rt-ws-<uuid>-<uuid>`, and ends with `transcription.done`.
"""

from __future__ import annotations

import base64
import json
import math
import os
import re
import socket
import statistics
import struct
import time
from typing import Any

import pytest
from websockets.sync.client import connect

from ..support.real_engine.measurements import Measurements
from ..support.real_engine.stacks import MODEL_NAME
from ..support.waiting import wait_until
from .processes import REALTIME, Stack
from .scenarios import generated_tokens, generated_when_settled, tether_metrics, vllm_metrics

on_realtime = pytest.mark.parametrize("stack", [REALTIME.name], indirect=True)

RATE = 16_000  # vLLM's realtime audio: PCM16, 16 kHz, mono
SESSION_SECONDS = 7  # one full 5 s segment and the rest, flushed by the final commit
LONG_SECONDS = 40  # 8 segments of 64 tokens: seconds of transcription left when a client resets
DELTAS_BEFORE_LEAVING = 5
ROUNDS = 3  # resets each way, straight and through tether
# From a client's reset to vLLM's `Aborted request(s) rt-ws-…` line; a few ms either way.
SESSION_END_BOUND = 0.5
TOKEN_SLACK = 8  # tokens after the reset beyond the worst straight run: a few engine steps
_UUID = r"[0-9a-f]{8}(?:-[0-9a-f]{4}){3}-[0-9a-f]{12}"
SESSION_ENGINE_ID = re.compile(rf"Added request (rt-ws-{_UUID}-{_UUID})")


def _one_second_of_tone() -> bytes:
    samples = (int(8000 * math.sin(2 * math.pi * 440 * i / RATE)) for i in range(RATE))
    return struct.pack(f"<{RATE}h", *samples)


SECOND = _one_second_of_tone()


def opening_events() -> list[dict[str, Any]]:
    """What a client sends after `session.created` to start transcribing."""
    return [
        {"type": "session.update", "model": MODEL_NAME},
        {"type": "input_audio_buffer.commit"},
    ]


def audio(seconds: int) -> list[dict[str, Any]]:
    """`seconds` of a 440 Hz tone as `input_audio_buffer.append` events, one per second."""
    chunk = base64.b64encode(SECOND).decode()
    return [{"type": "input_audio_buffer.append", "audio": chunk} for _ in range(seconds)]


def ws_url(base: str) -> str:
    return base.replace("http://", "ws://") + "/v1/realtime"


def transcribe(base: str, client_request_id: str) -> dict[str, Any]:
    """One whole session with a real WebSocket client (the `websockets` library, which offers
    permessage-deflate), recorded: the handshake, the events in order (runs of deltas as
    one), the transcription as the deltas spelled it, and the closing event."""
    with connect(
        ws_url(base),
        additional_headers={"X-Request-Id": client_request_id},
        max_size=None,
        open_timeout=30,
    ) as ws:
        assert ws.response is not None
        headers = ws.response.headers
        events = [json.loads(ws.recv(timeout=30))]
        for event in [*opening_events(), *audio(SESSION_SECONDS)]:
            ws.send(json.dumps(event))
        ws.send(json.dumps({"type": "input_audio_buffer.commit", "final": True}))
        while events[-1]["type"] not in ("transcription.done", "error"):
            events.append(json.loads(ws.recv(timeout=60)))
    kinds = [event["type"] for event in events]
    return {
        "request_id": headers.get("X-Request-Id"),
        "extensions": headers.get("Sec-WebSocket-Extensions"),
        "kinds": [kind for index, kind in enumerate(kinds) if kinds[index - 1 : index] != [kind]],
        "created_fields": sorted(events[0]),
        "deltas": kinds.count("transcription.delta"),
        "text": "".join(e["delta"] for e in events if e["type"] == "transcription.delta"),
        "done": events[-1],
    }


class RawRealtimeClient:
    """A WebSocket client on a plain socket (no extension offered), so a test can reset the
    connection exactly when it wants, as a crashed or killed client does."""

    def __init__(self, port: int, client_request_id: str) -> None:
        self._sock = socket.create_connection(("127.0.0.1", port), timeout=30)
        key = base64.b64encode(os.urandom(16)).decode()
        self._sock.sendall(
            (
                "GET /v1/realtime HTTP/1.1\r\nHost: 127.0.0.1\r\nUpgrade: websocket\r\n"
                f"Connection: Upgrade\r\nSec-WebSocket-Key: {key}\r\n"
                f"Sec-WebSocket-Version: 13\r\nX-Request-Id: {client_request_id}\r\n\r\n"
            ).encode()
        )
        self._buffer = b""
        while b"\r\n\r\n" not in self._buffer:
            self._fill()
        head, self._buffer = self._buffer.split(b"\r\n\r\n", 1)
        assert head.startswith(b"HTTP/1.1 101 "), head

    def _fill(self) -> None:
        data = self._sock.recv(65536)
        if not data:
            raise ConnectionError("the server closed the connection")
        self._buffer += data

    def _take(self, size: int) -> bytes:
        while len(self._buffer) < size:
            self._fill()
        taken, self._buffer = self._buffer[:size], self._buffer[size:]
        return taken

    def send(self, event: dict[str, Any]) -> None:
        """One masked text frame (RFC 6455 §5.2: every client frame is masked)."""
        payload = json.dumps(event).encode()
        size = len(payload)
        if size < 126:
            head = struct.pack("!BB", 0x81, 0x80 | size)
        elif size < 1 << 16:
            head = struct.pack("!BBH", 0x81, 0x80 | 126, size)
        else:
            head = struct.pack("!BBQ", 0x81, 0x80 | 127, size)
        mask = os.urandom(4)
        masked = bytes(byte ^ mask[index % 4] for index, byte in enumerate(payload))
        self._sock.sendall(head + mask + masked)

    def recv(self) -> dict[str, Any]:
        """The next text frame from the server, as JSON (the server's frames are unmasked
        and, without an extension, whole)."""
        while True:
            first, second = self._take(2)
            size = second & 0x7F
            if size == 126:
                (size,) = struct.unpack("!H", self._take(2))
            elif size == 127:
                (size,) = struct.unpack("!Q", self._take(8))
            payload = self._take(size)
            opcode = first & 0x0F
            if opcode == 0x8:
                raise ConnectionError(f"closed by the server: {payload!r}")
            if opcode == 0x1:
                event: dict[str, Any] = json.loads(payload)
                return event

    def reset(self) -> None:
        """Close with an RST (SO_LINGER 0): the client is gone, no close frame, no FIN."""
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self._sock.close()


def wait_vllm_session_free(stack: Stack, timeout: float = 10.0) -> float:
    """Until vLLM runs and holds no request and has no WebSocket open; the seconds taken."""

    def free() -> bool:
        metrics = vllm_metrics(stack)
        return (
            metrics.value("vllm:num_requests_running")
            + metrics.value("vllm:num_requests_waiting")
            + metrics.value("vllm:websocket_connections_active")
            == 0
        )

    return wait_until(free, timeout, "vLLM to hold no request and no WebSocket", interval=0.002)


def leave_mid_transcription(stack: Stack, port: int, client_request_id: str) -> dict[str, float]:
    """A raw client on `port` (tether's or vLLM's) transcribes 40 s of audio and resets its
    socket after 5 deltas; what vLLM then did, from its own log and `/metrics`."""
    mark = stack.vllm.log.mark()
    client = RawRealtimeClient(port, client_request_id)
    assert client.recv()["type"] == "session.created"
    for event in [*opening_events(), *audio(LONG_SECONDS)]:
        client.send(event)
    deltas = 0
    while deltas < DELTAS_BEFORE_LEAVING:
        event = client.recv()
        assert event["type"] == "transcription.delta", event
        deltas += 1
    engine_id = stack.vllm.log.wait_for(mark, SESSION_ENGINE_ID.pattern).group(1)
    assert vllm_metrics(stack).value("vllm:num_requests_running") == 1  # transcribing now
    tokens_before = generated_tokens(stack)
    left_at_epoch = time.time()
    client.reset()
    free_after = wait_vllm_session_free(stack)
    # vLLM's cleanup: `abort()` of the session's request, logged as asked, then its engine form.
    aborted = stack.vllm.log.wait_for(
        mark, rf"^t=(\d+\.\d+) [^\n]*Aborted request\(s\) {re.escape(engine_id)}\.$"
    )
    return {
        "abort_after": float(aborted.group(1)) - left_at_epoch,
        "free_after": free_after,
        "tokens_after": generated_when_settled(stack) - tokens_before,
    }


@on_realtime
def test_a_realtime_session_through_tether_is_the_session_straight(stack: Stack) -> None:
    """The same session (update, commit, 7 s of audio, final commit) straight to vLLM and
    through tether: the same handshake extensions, events, transcription and usage; the
    client's ID comes back on the `101`, and tether logs the session once with status 101."""
    mark = stack.tether.log.mark()
    vllm_mark = stack.vllm.log.mark()
    straight = transcribe(stack.vllm.url, "rt-straight")
    through = transcribe(stack.tether.url, "rt-through")

    assert through["request_id"] == "rt-through"
    assert straight["request_id"] is None  # vLLM itself sends no X-Request-Id here
    assert "permessage-deflate" in (straight["extensions"] or "")
    assert straight["kinds"] == ["session.created", "transcription.delta", "transcription.done"]
    assert straight["deltas"] >= 1 and straight["text"], straight
    assert straight["done"]["text"] == straight["text"]
    for key in ("extensions", "kinds", "created_fields", "text", "done"):
        assert through[key] == straight[key], key
    sessions = SESSION_ENGINE_ID.findall(stack.vllm.log.text_since(vllm_mark))
    assert len(set(sessions)) == 2, sessions
    wait_vllm_session_free(stack)
    [finished] = [
        line
        for line in stack.tether.log.json_lines(mark, "request_finished")
        if line.get("client_request_id") == "rt-through"
    ]
    assert (finished["status"], finished["outcome"]) == (101, "completed"), finished
    # The client's frames as it sent them: compressed (permessage-deflate; a tone packs
    # well), so fewer bytes than the base64 audio they carry.
    sent = sum(len(json.dumps(event)) for event in audio(SESSION_SECONDS))
    assert 0 < finished["websocket_bytes_in"] < sent, finished


@on_realtime
def test_a_client_that_resets_mid_session_ends_vllms_session_as_soon_as_straight(
    stack: Stack, measurements: Measurements
) -> None:
    """A client resets its socket while vLLM transcribes (35 s of audio still queued): through
    tether vLLM's session cleanup aborts the engine request as promptly as with the same
    client straight (each within 0.5 s; a few ms observed), vLLM's running count and its open
    WebSockets return to 0, it generates no more after the reset than straight but for a few
    steps (a segment left alone would run to 64 tokens, and seven more follow), and tether
    counts and logs each session as `client_disconnected`."""
    before = tether_metrics(stack).value(
        "tether_websocket_sessions_total", outcome="client_disconnected"
    )
    mark = stack.tether.log.mark()
    runs: dict[str, list[dict[str, float]]] = {"straight": [], "through tether": []}
    for round_ in range(ROUNDS):
        runs["straight"].append(leave_mid_transcription(stack, stack.vllm.port, f"rt-{round_}-s"))
        runs["through tether"].append(
            leave_mid_transcription(stack, stack.tether.port, f"rt-{round_}-t")
        )
    for way, results in runs.items():
        for result in results:
            for name, value in result.items():
                measurements.add("realtime", f"reset mid-session, {way}: {name}", value)
        for result in results:
            assert result["abort_after"] < SESSION_END_BOUND, (way, result)
            assert result["free_after"] < SESSION_END_BOUND + 0.1, (way, result)
    worst_straight = max(result["tokens_after"] for result in runs["straight"])
    for result in runs["through tether"]:
        # vLLM's token counter lags its engine by a step or two either way.
        assert result["tokens_after"] <= min(worst_straight + TOKEN_SLACK, 32), runs
    assert statistics.median(r["abort_after"] for r in runs["through tether"]) < 0.1, runs

    after = tether_metrics(stack)
    disconnected = after.value("tether_websocket_sessions_total", outcome="client_disconnected")
    assert disconnected - before == ROUNDS
    assert after.value("tether_websocket_sessions_open") == 0
    finished = {
        line["client_request_id"]: line
        for line in stack.tether.log.json_lines(mark, "request_finished")
        if str(line.get("client_request_id", "")).startswith("rt-")
    }
    assert sorted(finished) == sorted(f"rt-{round_}-t" for round_ in range(ROUNDS))
    for line in finished.values():
        assert (line["path"], line["outcome"]) == ("/v1/realtime", "client_disconnected"), line
