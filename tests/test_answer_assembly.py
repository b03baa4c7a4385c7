"""A non-streaming chat answer assembled from llama-server's stream of the same request: the
answer it would have given, or none where the events do not make one faithfully."""

from __future__ import annotations

import json
from typing import Any

from proxy.wire.answer_assembly import AnswerAssembler

TOP = {"created": 7, "id": "chatcmpl-x", "model": "tiny", "system_fingerprint": "b0-unknown"}


def _event(choices: list[Any], **extra: Any) -> bytes:
    chunk = {"choices": choices, **TOP, "object": "chat.completion.chunk", **extra}
    return b"data: " + json.dumps(chunk).encode() + b"\n\n"


def _stream(*, finish: bool = True, done: bool = True, delta: Any = None) -> bytes:
    usage = {"completion_tokens": 2, "prompt_tokens": 5, "total_tokens": 7}
    events = [
        _event([{"finish_reason": None, "index": 0, "delta": {"role": "assistant"}}]),
        _event([{"finish_reason": None, "index": 0, "delta": delta or {"content": "Hé"}}]),
        _event([{"finish_reason": None, "index": 0, "delta": {"content": "llo"}}]),
    ]
    if finish:
        events.append(_event([{"finish_reason": "length", "index": 0, "delta": {}}]))
        events.append(_event([], usage=usage, timings={"predicted_n": 2}))
    if done:
        events.append(b"data: [DONE]\n\n")
    return b"".join(events)


def _assembled(stream: bytes, piece: int = 7) -> tuple[int, bytes] | None:
    assembler = AnswerAssembler()
    for start in range(0, len(stream), piece):
        assembler.feed(stream[start : start + piece])
    return assembler.answer()


def test_the_events_make_llama_servers_answer_whatever_the_reads() -> None:
    """Read in 7-byte pieces, the events make `chat.completion` with llama-server's members
    in its order, the message they add up to, its finish reason, usage and timings."""
    assembled = _assembled(_stream())
    assert assembled is not None
    status, body = assembled
    answer = json.loads(body)
    assert status == 200
    assert list(answer) == [
        "choices",
        "created",
        "model",
        "system_fingerprint",
        "object",
        "usage",
        "id",
        "timings",
    ]
    assert answer["choices"] == [
        {
            "finish_reason": "length",
            "index": 0,
            "message": {"role": "assistant", "content": "Héllo"},
        }
    ]
    assert (answer["object"], answer["id"], answer["usage"]["total_tokens"]) == (
        "chat.completion",
        "chatcmpl-x",
        7,
    )
    assert "Héllo".encode() in body  # written as llama-server writes it, not \\u-escaped


def test_a_stream_cut_short_makes_no_answer() -> None:
    """Without its finish reason or its `[DONE]`, the stream makes no answer."""
    assert _assembled(_stream(finish=False)) is None
    assert _assembled(_stream(done=False)) is None


def test_a_delta_it_does_not_know_makes_no_answer() -> None:
    """A tool call's delta (not assembled faithfully) makes no answer rather than a wrong one."""
    assert _assembled(_stream(delta={"tool_calls": [{"index": 0}]})) is None


def test_an_error_event_is_llama_servers_error_answer() -> None:
    """An error mid-stream becomes the error answer, its `code` the status."""
    error = {"code": 400, "message": "bad", "type": "invalid_request_error"}
    stream = _stream(finish=False, done=False) + b"data: " + json.dumps({"error": error}).encode()
    assembled = _assembled(stream + b"\n\n")
    assert assembled == (400, json.dumps({"error": error}, separators=(",", ":")).encode())
