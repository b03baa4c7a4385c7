"""Conversation streams (`X-Conversation-Id`, llama.cpp #23226): llama-server keeps a stream
with that header running into a replay buffer after its client left, replays it from any
offset (`GET /v1/stream?conv_id=<id>&from=N`) and stops it on `DELETE /v1/stream?conv_id=<id>`.
Through tether the header passes unchanged and those routes work for the client that owns
the conversation; a stream cut off by a second POST of the same conversation is reported as
cut, and cut for its client too. Stopping a stream whose client left is in
test_client_disconnect.py."""

from __future__ import annotations

import json
import urllib.request

from .processes import Stack
from .scenarios import LONG, chat, direct, on_two_slots, via_tether

TOKENS = 30


def _replay(
    url: str, conversation_id: str, offset: int = 0, headers: dict[str, str] | None = None
) -> list[str]:
    """`GET /v1/stream?conv_id=<id>&from=<offset>` read to its end: the events' data."""
    request = urllib.request.Request(
        f"{url}/v1/stream?conv_id={conversation_id}&from={offset}", headers=headers or {}
    )
    with urllib.request.urlopen(request, timeout=30) as response:
        assert response.status == 200
        text = response.read().decode()
    return [line[5:].strip() for line in text.splitlines() if line.startswith("data:")]


def _delete(url: str, conversation_id: str) -> int:
    request = urllib.request.Request(f"{url}/v1/stream?conv_id={conversation_id}", method="DELETE")
    with urllib.request.urlopen(request, timeout=10) as response:
        return int(response.status)


@on_two_slots
def test_finished_conversation_replays_through_tether(stack: Stack) -> None:
    """A conversation stream read to its end through tether replays, through tether, as the
    same events from offset 0 (under the same client ID: tether writes it in place of the
    one llama-server minted, live and replayed)."""
    headers = {"X-Conversation-Id": "replay-me"}
    with via_tether(stack, "replay", chat(TOKENS, stream=True), headers) as exchange:
        assert exchange.read_head() == 200
        events = list(exchange.events())
    assert events[-1] == "[DONE]"
    replayed = _replay(stack.tether.url, "replay-me", headers={"X-Request-Id": "replay"})
    assert replayed == events
    assert _delete(stack.tether.url, "replay-me") == 204


@on_two_slots
def test_second_post_of_a_conversation_cuts_the_first(stack: Stack) -> None:
    """Straight to llama-server, a second POST with the same `X-Conversation-Id` ends the
    first stream: a clean end of its body, no `finish_reason`, no `[DONE]`."""
    headers = {"X-Conversation-Id": "cut-straight"}
    with direct(stack, chat(LONG, stream=True), headers) as first:
        assert first.read_head() == 200
        first.chunks(3)
        with direct(stack, chat(TOKENS, stream=True), headers) as second:
            assert second.read_head() == 200
            rest = list(first.events())
            assert list(second.events())[-1] == "[DONE]"
    assert "[DONE]" not in rest
    assert not any(json.loads(event)["choices"][0].get("finish_reason") for event in rest)


@on_two_slots
def test_cut_conversation_is_not_reported_completed(stack: Stack) -> None:
    """Through tether, a stream cut off by a second POST of its conversation is reported as
    cut (`upstream_failed`, never `completed`), and its client's body is cut too (no last
    chunk), where straight it ends cleanly."""
    headers = {"X-Conversation-Id": "cut-via-tether"}
    mark = stack.tether.log.mark()
    with via_tether(stack, "cut-first", chat(LONG, stream=True), headers) as first:
        assert first.read_head() == 200
        first.chunks(3)
        with via_tether(stack, "cut-second", chat(TOKENS, stream=True), headers) as second:
            assert second.read_head() == 200
            rest = list(first.events())
            assert list(second.events())[-1] == "[DONE]"
    assert "[DONE]" not in rest
    assert not first.complete
    line = stack.tether.log.wait_json(mark, "request_finished", client_request_id="cut-first")
    assert line["outcome"] == "upstream_failed", line
