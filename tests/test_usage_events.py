"""Taking the usage event tether asked for out of a stream (pure, no I/O): the client gets,
byte for byte, the stream the engine writes when usage is not asked, wherever the network
cuts it."""

from __future__ import annotations

import itertools
import json
import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

from proxy.wire.usage_events import UsageEventFilter

pytestmark = pytest.mark.socket_free

FINGERPRINT = "fp_3b1c0032"


def _sse(document: dict[str, object]) -> bytes:
    return b"data: " + json.dumps(document, separators=(",", ":")).encode() + b"\n\n"


def vllm_stream(*, usage: bool, choices: int = 1, finish: str = "length") -> bytes:
    """A chat stream as vLLM 0.32 writes it (`model_dump_json(exclude_unset=True)`): the
    finishing chunks carry the system fingerprint, unless usage was asked, when its usage
    event alone does."""
    head = {"id": "chatcmpl-x", "object": "chat.completion.chunk", "created": 1, "model": "m"}
    events = []
    for index in range(choices):
        events.append(_sse({**head, "choices": [{"index": index, "delta": {"role": "assistant"}}]}))
    for token in ("a", "b"):
        for index in range(choices):
            choice = {"index": index, "delta": {"content": token}, "finish_reason": None}
            events.append(_sse({**head, "choices": [choice]}))
    for index in range(choices):
        choice = {"index": index, "delta": {"content": ""}, "finish_reason": finish}
        finishing = {**head, "choices": [choice]}
        if not usage:
            finishing["system_fingerprint"] = FINGERPRINT
        events.append(_sse(finishing))
    if usage:
        numbers = {"prompt_tokens": 3, "total_tokens": 5, "completion_tokens": 2}
        events.append(
            _sse({**head, "choices": [], "usage": numbers, "system_fingerprint": FINGERPRINT})
        )
    events.append(b"data: [DONE]\n\n")
    return b"".join(events)


def sglang_stream(*, usage: bool) -> bytes:
    """A chat stream as SGLang 0.5.23 writes it (`model_dump_json()`: every chunk has
    `"usage":null`); asking adds the usage event and changes nothing else."""
    head = {"id": "rid", "object": "chat.completion.chunk", "created": 1, "model": "m"}
    events = [
        _sse({**head, "choices": [{"index": 0, "delta": {"content": t}}], "usage": None})
        for t in ("a", "b")
    ]
    events.append(
        _sse({**head, "choices": [{"index": 0, "finish_reason": "length"}], "usage": None})
    )
    if usage:
        events.append(_sse({**head, "choices": [], "usage": {"completion_tokens": 2}}))
    return b"".join(events) + b"data: [DONE]\n\n"


def filtered(stream: bytes, reads: list[bytes] | None = None, *, restore: bool = True) -> bytes:
    usage = UsageEventFilter(restore_fingerprint=restore)
    return b"".join(usage.feed(read) for read in (reads or [stream])) + usage.flush()


def _cut(stream: bytes, cuts: list[int]) -> list[bytes]:
    points = [0, *sorted(set(cuts)), len(stream)]
    return [stream[a:b] for a, b in itertools.pairwise(points) if b > a]


@pytest.mark.parametrize("finish", ["length", "stop", "abort"])
@pytest.mark.parametrize("choices", [1, 2])
def test_a_vllm_stream_comes_out_as_if_usage_was_never_asked(choices: int, finish: str) -> None:
    """The usage event goes, and every finishing chunk gets back its system fingerprint."""
    asked = vllm_stream(usage=True, choices=choices, finish=finish)
    assert filtered(asked) == vllm_stream(usage=False, choices=choices, finish=finish)


def test_wherever_the_network_cuts_the_stream_the_client_gets_the_same_bytes() -> None:
    """Two reads cut at every byte, and one byte a read: the same stream."""
    asked, unasked = vllm_stream(usage=True), vllm_stream(usage=False)
    for cut in range(1, len(asked)):
        assert filtered(asked, _cut(asked, [cut])) == unasked, cut
    assert filtered(asked, [bytes([b]) for b in asked]) == unasked


@given(st.lists(st.integers(min_value=1, max_value=2000), max_size=12))
def test_any_cuts_give_the_same_bytes(cuts: list[int]) -> None:
    asked = vllm_stream(usage=True, choices=2)
    assert filtered(asked, _cut(asked, [c for c in cuts if c < len(asked)])) == vllm_stream(
        usage=False, choices=2
    )


def test_json_written_with_spaces_loses_its_usage_event_wherever_it_is_cut() -> None:
    """An engine that writes JSON as Python's json.dumps does (a space after each colon):
    the same, at every cut; the spelling is learnt from the first read."""
    asked = vllm_stream(usage=True).replace(b'":', b'": ')
    unasked = vllm_stream(usage=False).replace(b'":', b'": ')
    assert b'"usage": {' in asked
    for cut in range(1, len(asked)):
        assert filtered(asked, _cut(asked, [cut]), restore=False) == _without_fingerprint(
            unasked
        ), cut


def _without_fingerprint(stream: bytes) -> bytes:
    return re.sub(rb',"system_fingerprint": "[^"]*"', b"", stream)


def test_before_a_finishing_event_bytes_pass_as_they_arrive() -> None:
    """No usage event can come before a choice finished: the start of an event that has not
    ended yet goes out at once (nothing is held in the middle of a stream)."""
    usage = UsageEventFilter(restore_fingerprint=True)
    assert usage.feed(b'data: {"id":"chatcmpl-x","cho') == b'data: {"id":"chatcmpl-x","cho'
    assert usage.feed(b'ices":[{"delta":{"content":"a"}}]}\n\n') == (
        b'ices":[{"delta":{"content":"a"}}]}\n\n'
    )


def test_an_sglang_stream_loses_only_its_usage_event() -> None:
    """SGLang changes nothing but the extra event; its chunks' `"usage":null` stay, at every
    cut (one between the two newlines of an event's end among them)."""
    asked, unasked = sglang_stream(usage=True), sglang_stream(usage=False)
    assert filtered(asked, restore=False) == unasked
    for cut in range(1, len(asked)):
        assert filtered(asked, _cut(asked, [cut]), restore=False) == unasked, cut


def test_an_engine_that_reports_usage_by_itself_keeps_its_stream() -> None:
    """Usage in chunks that have choices (vLLM's --enable-force-include-usage): the engine
    reports it unasked on every stream, so nothing is taken out."""
    head = b'data: {"id":"x","choices":[{"delta":{"content":"a"}}],"usage":{"completion_tokens":1}}'
    stream = head + b"\n\n" + vllm_stream(usage=True)
    usage = UsageEventFilter(restore_fingerprint=True)
    assert usage.feed(stream) + usage.flush() == stream
    assert usage.engine_reports_usage


def test_a_stream_without_the_usage_event_passes_whole() -> None:
    """An engine that did not send the usage event: what was held goes out at the end."""
    unasked = vllm_stream(usage=False)
    assert filtered(unasked) == unasked


def test_a_huge_event_at_the_end_is_never_held_whole() -> None:
    """After a finishing event, an event that grows past 64 KiB passes as it arrives."""
    usage = UsageEventFilter(restore_fingerprint=False)
    usage.feed(b'data: {"choices":[{"finish_reason":"stop"}]}\n\n')
    piece = b"x" * 70_000
    assert usage.feed(b"data: " + piece) == b"data: " + piece
    assert usage.feed(piece) == piece
