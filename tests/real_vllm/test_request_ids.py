"""Through tether, clients see their own request ID while vLLM only ever sees tether's."""

from __future__ import annotations

import json

from .processes import Stack
from .scenarios import INTERNAL_ID, on_default, received_ids, via_tether, wait_in_flight


@on_default
def test_stream_chunks_carry_client_id(stack: Stack) -> None:
    """Every streamed chunk says chatcmpl-<client id> and the response header echoes it."""
    mark = stack.vllm.log.mark()
    with via_tether(stack, "client-stream-1", max_tokens=20, stream=True) as exchange:
        assert exchange.read_head() == 200
        events = list(exchange.events())
    assert exchange.headers.get("x-request-id") == "client-stream-1"
    assert events[-1] == "[DONE]"
    chunks = [json.loads(event) for event in events[:-1]]
    assert len(chunks) >= 20
    assert {chunk["id"] for chunk in chunks} == {"chatcmpl-client-stream-1"}
    assert [i for i in received_ids(stack, mark) if INTERNAL_ID.match(i)], "vLLM got no internal ID"
    assert "client-stream-1" not in stack.vllm.log.text_since(mark)


@on_default
def test_non_streaming_body_carries_client_id(stack: Stack) -> None:
    """A non-streaming answer says chatcmpl-<client id> in its body and header."""
    mark = stack.vllm.log.mark()
    with via_tether(stack, "client-plain-1", max_tokens=20, stream=False) as exchange:
        assert exchange.read_head() == 200
        answer = json.loads(exchange.body())
    assert exchange.headers.get("x-request-id") == "client-plain-1"
    assert answer["id"] == "chatcmpl-client-plain-1"
    assert answer["usage"]["completion_tokens"] == 20
    assert "client-plain-1" not in stack.vllm.log.text_since(mark)


@on_default
def test_vllm_receives_tether_internal_id(stack: Stack) -> None:
    """vLLM logs tether's 32-hex internal ID, the same one tether lists for the request."""
    mark = stack.vllm.log.mark()
    with via_tether(stack, "client-listed-1", max_tokens=400, stream=True) as exchange:
        assert exchange.read_head() == 200
        exchange.chunks(2)
        entry = wait_in_flight(stack, "client-listed-1")
        list(exchange.events())
    assert INTERNAL_ID.match(entry["internal_request_id"])
    assert received_ids(stack, mark) == [entry["internal_request_id"]]


@on_default
def test_duplicate_client_ids_reach_vllm_as_distinct_ids(stack: Stack) -> None:
    """Two concurrent requests with one client ID run in vLLM under two internal IDs."""
    mark = stack.vllm.log.mark()
    first = via_tether(stack, "dup-client-id", max_tokens=300, stream=True)
    second = via_tether(stack, "dup-client-id", max_tokens=300, stream=True)
    with first, second:
        assert first.read_head() == 200 and second.read_head() == 200
        first_chunks, second_chunks = first.chunks(5), second.chunks(5)  # both running at once
        first_rest, second_rest = list(first.events()), list(second.events())
    ids = received_ids(stack, mark)
    assert len(ids) == 2 and ids[0] != ids[1], ids
    assert all(INTERNAL_ID.match(i) for i in ids), ids
    assert {c["id"] for c in first_chunks + second_chunks} == {"chatcmpl-dup-client-id"}
    assert first_rest[-1] == second_rest[-1] == "[DONE]"
