"""Token counts through tether in front of llama-server: a non-streaming answer and a stream
whose client asked for usage are counted from llama-server's own `usage`; a stream whose
client did not ask from the `timings` on its last event (nothing is asked upstream, so the
client's stream is llama-server's own)."""

from __future__ import annotations

import json
from typing import Any

from ..support.raw_http import RawExchange
from .processes import Stack
from .scenarios import chat, on_two_slots, via_tether

TOKENS = 40


def _finished(stack: Stack, mark: int, client_request_id: str) -> dict[str, Any]:
    """tether's `request_finished` line of `client_request_id`."""
    return stack.tether.log.wait_json(mark, "request_finished", client_request_id=client_request_id)


def _stream_to_end(exchange: RawExchange) -> list[Any]:
    assert exchange.read_head() == 200
    events = list(exchange.events())
    assert events[-1] == "[DONE]", events[-3:]
    return [json.loads(event) for event in events[:-1]]


@on_two_slots
def test_answer_tokens_are_counted_from_its_usage(stack: Stack) -> None:
    """A non-streaming answer through tether is counted as its own `usage` says."""
    mark = stack.tether.log.mark()
    with via_tether(stack, "usage-answer", chat(TOKENS, stream=False)) as exchange:
        assert exchange.read_head() == 200
        usage = json.loads(exchange.body())["usage"]
    line = _finished(stack, mark, "usage-answer")
    assert usage["completion_tokens"] == TOKENS
    assert (line["completion_tokens"], line["prompt_tokens"], line["tokens_counted"]) == (
        TOKENS,
        usage["prompt_tokens"],
        "engine",
    )


@on_two_slots
def test_stream_with_usage_asked_is_counted_from_it(stack: Stack) -> None:
    """A stream whose client asked for usage (`stream_options.include_usage`) is counted as
    llama-server's usage event says."""
    mark = stack.tether.log.mark()
    payload = chat(TOKENS, stream=True, stream_options={"include_usage": True})
    with via_tether(stack, "usage-asked", payload) as exchange:
        usage = _stream_to_end(exchange)[-1]["usage"]
    line = _finished(stack, mark, "usage-asked")
    assert usage["completion_tokens"] == TOKENS
    assert (line["completion_tokens"], line["tokens_counted"]) == (TOKENS, "engine")


@on_two_slots
def test_stream_without_usage_asked_is_counted_from_the_engine(stack: Stack) -> None:
    """A stream whose client did not ask for usage is counted from llama-server's own figures
    through tether, and the client's stream carries no usage (as straight)."""
    mark = stack.tether.log.mark()
    with via_tether(stack, "usage-not-asked", chat(TOKENS, stream=True)) as exchange:
        chunks = _stream_to_end(exchange)
    assert not any(chunk.get("usage") for chunk in chunks), chunks[-1]
    line = _finished(stack, mark, "usage-not-asked")
    assert (line["completion_tokens"], line["tokens_counted"]) == (TOKENS, "engine"), line
