"""Request IDs on llama-server: it ignores every ID a client sends and names each answer with a
random `chatcmpl-<32 alphanumerics>`, through tether as straight to it; tether gives the
client its ID back in the `X-Request-Id` header, and (a known gap) not yet in the body."""

from __future__ import annotations

import json
import re

from .gaps import gap, known_gap
from .processes import Stack
from .scenarios import chat, direct, on_two_slots, via_tether

LLAMACPP_ID = re.compile(r"^chatcmpl-[A-Za-z0-9]{32}$")


@on_two_slots
def test_answer_id_is_llamacpps_own_random_one(stack: Stack) -> None:
    """A non-streaming answer's `id` is llama-server's random `chatcmpl-<32 alphanumerics>`,
    a new one each time, through tether as straight (it ignores `X-Request-Id`)."""
    ids = []
    for exchange in (
        direct(stack, chat(5, stream=False), {"X-Request-Id": "my-id"}),
        via_tether(stack, "my-id", chat(5, stream=False)),
    ):
        with exchange:
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
@known_gap("the client's ID is not mapped into llama-server's answers")
def test_answer_id_is_the_clients_through_tether(stack: Stack) -> None:
    """Through tether a non-streaming answer's `id` is `chatcmpl-<client id>`, as vLLM's is."""
    with via_tether(stack, "mapped-back", chat(5, stream=False)) as exchange:
        assert exchange.read_head() == 200
        answer_id = json.loads(exchange.body())["id"]
    gap(answer_id == "chatcmpl-mapped-back", f"answer id {answer_id!r}")


@on_two_slots
@known_gap("the client's ID is not mapped into llama-server's stream")
def test_every_chunk_id_is_the_clients_through_tether(stack: Stack) -> None:
    """Through tether every streamed chunk's `id` is `chatcmpl-<client id>`."""
    with via_tether(stack, "mapped-stream", chat(5, stream=True)) as exchange:
        assert exchange.read_head() == 200
        ids = {chunk["id"] for chunk in exchange.chunks(10)}
    gap(ids == {"chatcmpl-mapped-stream"}, f"chunk ids {ids}")
