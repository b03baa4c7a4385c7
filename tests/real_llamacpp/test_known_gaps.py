"""The phases where llama-server does not notice a client that left, and tether does not help
yet (issue 30): each test states the behaviour tether promises and is a strict xfail until
tether keeps it (`gaps`). Each also measures llama-server alone beside it, for the phase
table."""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest

from ..support.real_engine.measurements import Measurements
from .gaps import gap, known_gap
from .measurements import ALONE, VIA_TETHER
from .processes import TWO_SLOTS, Stack
from .scenarios import (
    PREFILL_STOP_WITHIN,
    Stop,
    leave_beside_stream,
    leave_conversation,
    leave_queued_behind_streams,
    record_stop,
)

RUNS = 3
SEED = 30

on_two_slots = pytest.mark.parametrize("stack", [TWO_SLOTS.name], indirect=True)


def _measure(
    stack: Stack,
    measurements: Measurements,
    phase: str,
    leave: Callable[[Stack, str, str, random.Random], Stop],
) -> list[Stop]:
    """RUNS leavers through tether and as many straight to llama-server, interleaved, all
    recorded; the ones through tether."""
    rng = random.Random(f"{SEED}-{phase}")
    via: list[Stop] = []
    for run in range(RUNS):
        for way in (VIA_TETHER, ALONE):
            stop = leave(stack, way, f"gap-{run}", rng)
            record_stop(measurements, phase, way, stop)
            if way == VIA_TETHER:
                via.append(stop)
    return via


@on_two_slots
@known_gap("a non-streaming request beside another client's stream is noticed only when it ends")
def test_non_streaming_beside_a_stream_stops_within_half_a_second(
    stack: Stack, measurements: Measurements
) -> None:
    """A non-streaming client that leaves while another client streams has its request
    stopped within 0.5 s through tether (alone: llama-server's one-second wait restarts with
    every token of the other stream, so it generates the whole answer for nobody)."""
    via = _measure(
        stack, measurements, "non-streaming beside another client's stream", leave_beside_stream
    )
    gap(max(stop.seconds for stop in via) < 0.5, f"not stopped within 0.5 s: {via}")


@on_two_slots
@known_gap("a request queued behind streams is generated for nobody")
def test_queued_behind_streams_never_runs(stack: Stack, measurements: Measurements) -> None:
    """A request whose client left while it waited behind other clients' streams never takes
    a slot through tether (alone: the streams' tokens keep its one-second wait from timing
    out, and it is generated in full once a slot frees)."""
    via = _measure(stack, measurements, "queued behind streams", leave_queued_behind_streams)
    gap(not any(stop.ran for stop in via), f"ran: {via}")


@on_two_slots
@known_gap("tether never stops a conversation stream (DELETE /v1/stream?conv_id=)")
def test_conversation_stream_stops_within_a_third_of_a_second(
    stack: Stack, measurements: Measurements
) -> None:
    """A streaming client with an `X-Conversation-Id` that leaves has its stream stopped
    within 0.3 s through tether (alone: llama-server detaches the stream from its client on
    purpose and generates into its replay buffer until `DELETE /v1/stream?conv_id=<id>`)."""

    def leave(stack: Stack, way: str, name: str, rng: random.Random) -> Stop:
        return leave_conversation(stack, way, name, rng, prefill=False)

    via = _measure(stack, measurements, "streaming with X-Conversation-Id", leave)
    gap(max(stop.seconds for stop in via) < 0.3, f"not stopped within 0.3 s: {via}")


@on_two_slots
@known_gap("tether never stops a conversation stream, during its prefill either")
def test_conversation_prefill_stops_as_a_plain_one_does(
    stack: Stack, measurements: Measurements
) -> None:
    """A client with an `X-Conversation-Id` that leaves during its prompt's prefill has it
    stopped through tether as soon as a plain streaming request's prefill stops (alone:
    never, the whole prompt and answer are generated into the replay buffer)."""

    def leave(stack: Stack, way: str, name: str, rng: random.Random) -> Stop:
        return leave_conversation(stack, way, name, rng, prefill=True)

    via = _measure(stack, measurements, "X-Conversation-Id during prefill", leave)
    gap(
        max(stop.seconds for stop in via) < PREFILL_STOP_WITHIN,
        f"not stopped within {PREFILL_STOP_WITHIN} s: {via}",
    )
