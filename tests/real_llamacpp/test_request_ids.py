"""Request IDs on llama-server: it ignores every ID a client sends and names each answer with a
random `chatcmpl-<32 alphanumerics>`; through tether the client gets its own ID back, in the
`X-Request-Id` header and as `chatcmpl-<client id>` in the body, as vLLM answers."""

from __future__ import annotations

import json
import re

from .processes import Stack
from .scenarios import chat, direct, on_two_slots, via_tether

LLAMACPP_ID = re.compile(r"^chatcmpl-[A-Za-z0-9]{32}$")


@on_two_slots
def test_answer_id_straight_is_llamacpps_own_random_one(stack: Stack) -> None:
    """Straight, a non-streaming answer's `id` is llama-server's random `chatcmpl-<32
    alphanumerics>`, a new one each time (it ignores `X-Request-Id`)."""
    ids = []
    for _ in range(2):
        with direct(stack, chat(5, stream=False), {"X-Request-Id": "my-id"}) as exchange:
            assert exchange.read_head() == 200
            ids.append(json.loads(exchange.body())["id"])
    assert all(LLAMACPP_ID.match(answer_id) for answer_id in ids), ids
    assert len(set(ids)) == 2, ids


@on_two_slots
def test_tether_answers_with_the_clients_id_in_its_header(stack: Stack) -> None:
    """Through tether the response's `X-Request-Id` is the client's ID, streaming and not."""
    for stream in (False, True):
        with via_tether(stack, f"header-{stream}", chat(5, stream=stream)) as exchange:
            assert exchange.read_head() == 200
            exchange.body()
        assert exchange.headers["x-request-id"] == f"header-{stream}"


@on_two_slots
def test_answer_id_is_the_clients_through_tether(stack: Stack) -> None:
    """Through tether a non-streaming answer's `id` is `chatcmpl-<client id>`, as vLLM's is."""
    with via_tether(stack, "mapped-back", chat(5, stream=False)) as exchange:
        assert exchange.read_head() == 200
        answer_id = json.loads(exchange.body())["id"]
    assert answer_id == "chatcmpl-mapped-back"


@on_two_slots
def test_every_chunk_id_is_the_clients_through_tether(stack: Stack) -> None:
    """Through tether every streamed chunk's `id` is `chatcmpl-<client id>`."""
    with via_tether(stack, "mapped-stream", chat(5, stream=True)) as exchange:
        assert exchange.read_head() == 200
        ids = {chunk["id"] for chunk in exchange.chunks(10)}
    assert ids == {"chatcmpl-mapped-stream"}


@on_two_slots
def test_duplicate_client_ids_stay_apart(stack: Stack) -> None:
    """Two streams through tether under the same client ID at once: each gets its own whole
    stream under `chatcmpl-<that id>`, nothing of the other's."""
    with via_tether(stack, "twin", chat(20, stream=True)) as one:
        with via_tether(stack, "twin", chat(25, stream=True)) as other:
            assert one.read_head() == other.read_head() == 200
            second = [event for event in other.events() if event != "[DONE]"]
        first = [event for event in one.events() if event != "[DONE]"]
    for events, tokens in ((first, 20), (second, 25)):
        chunks = [json.loads(event) for event in events]
        assert {chunk["id"] for chunk in chunks} == {"chatcmpl-twin"}
        content = [c for c in chunks if c["choices"] and c["choices"][0]["delta"].get("content")]
        assert len(content) == tokens
