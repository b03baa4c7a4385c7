"""A client that leaves in the phases where llama-server notices by itself: through tether
(`TETHER_ENGINE=llamacpp`: tether closes its connection to llama-server at once) llama-server
lets the request go as soon as it would for the same raw client talking to it directly,
which is measured beside it. A conversation stream (`X-Conversation-Id`), which
llama-server never stops for a client that left, tether stops with its
`DELETE /v1/stream?conv_id=`. The phases llama-server alone does not notice are in
test_unnoticed_phases.py."""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

import pytest

from ..support.real_engine.measurements import Measurements
from .measurements import ALONE, NOT_STOPPED, VIA_TETHER
from .processes import ONE_SLOT, TWO_SLOTS, Stack
from .scenarios import (
    CANCELLED,
    NOTICED_WITHIN,
    PREFILL_STOP_WITHIN,
    Stop,
    leave_conversation,
    leave_generating,
    leave_prefill,
    leave_queued_behind_answer,
    leave_stream,
    record_stop,
)

RUNS = 5
SEED = 30


@dataclass(frozen=True)
class Phase:
    """Where a request is when its client leaves, and how soon llama-server lets it go."""

    name: str
    config: str
    leave: Callable[[Stack, str, str, random.Random], Stop]
    # Seconds from the close, every run, both ways.
    within: float
    # Whether a slot ever takes the request (a queued one must never run).
    runs: bool = True


PHASES = (
    # Each token is a write; the first write after the close fails.
    Phase("streaming", TWO_SLOTS.name, leave_stream, 0.1),
    # Noticed when its one-second wait for results times out (nothing else runs).
    Phase("non-streaming, generating", TWO_SLOTS.name, leave_generating, NOTICED_WITHIN),
    Phase(
        "queued behind a non-streaming request",
        ONE_SLOT.name,
        leave_queued_behind_answer,
        NOTICED_WITHIN,
        runs=False,
    ),
    # Noticed at its one-second wait; the cancel takes effect once the prompt batch in
    # progress (2,048 tokens) is done.
    Phase("prefill (-b 2048)", TWO_SLOTS.name, leave_prefill, PREFILL_STOP_WITHIN),
)


@pytest.mark.parametrize(
    ("stack", "phase"),
    [(phase.config, phase) for phase in PHASES],
    indirect=["stack"],
    ids=[phase.name for phase in PHASES],
)
def test_client_leaving_stops_llamacpp_as_soon_as_alone(
    stack: Stack, phase: Phase, measurements: Measurements
) -> None:
    """In this phase llama-server cancels the request of a client that left within the
    phase's bound, through tether as straight to it, every run (a queued one never runs)."""
    rng = random.Random(f"{SEED}-{phase.name}")
    stops: dict[str, list[Stop]] = {ALONE: [], VIA_TETHER: []}
    for run in range(RUNS):  # interleaved, so both see the same machine
        for way in (VIA_TETHER, ALONE):
            stop = phase.leave(stack, way, f"leaves-{run}", rng)
            stops[way].append(stop)
            record_stop(measurements, phase.name, way, stop)
    for way, found in stops.items():
        assert {stop.ending for stop in found} == {CANCELLED}, (way, found)
        assert max(stop.seconds for stop in found) < phase.within, (way, found)
        assert {stop.ran for stop in found} == {phase.runs}, (way, found)


# Conversation phases: (name, whether the client leaves during prefill, seconds from the
# close until the stream is released through tether: the DELETE goes out as the close is
# seen and llama-server acts on it within tens of milliseconds, during prefill once the
# batch in progress is done, a plain prefill's bound).
CONVERSATION_PHASES = (
    ("streaming with X-Conversation-Id", False, 0.3),
    ("X-Conversation-Id during prefill", True, PREFILL_STOP_WITHIN),
)


@pytest.mark.parametrize("stack", [TWO_SLOTS.name], indirect=True)
@pytest.mark.parametrize(
    ("phase", "prefill", "within"),
    CONVERSATION_PHASES,
    ids=[name for name, _, _ in CONVERSATION_PHASES],
)
def test_conversation_stream_whose_client_left_is_stopped_by_tether(
    stack: Stack, phase: str, prefill: bool, within: float, measurements: Measurements
) -> None:
    """A streaming client with an `X-Conversation-Id` that leaves (mid-answer or during its
    prefill) has its stream stopped within the phase's bound through tether, every run;
    straight, llama-server runs it on into its replay buffer (the scenario then stops it
    with the DELETE itself)."""
    rng = random.Random(f"{SEED}-{phase}")
    stops: dict[str, list[Stop]] = {ALONE: [], VIA_TETHER: []}
    for run in range(3):
        for way in (VIA_TETHER, ALONE):
            stop = leave_conversation(stack, way, f"conversation-{run}", rng, prefill=prefill)
            stops[way].append(stop)
            record_stop(measurements, phase, way, stop)
    via = stops[VIA_TETHER]
    assert {stop.ending for stop in via} == {CANCELLED}, via
    assert max(stop.seconds for stop in via) < within, via
    assert {stop.ending for stop in stops[ALONE]} == {NOT_STOPPED}, stops[ALONE]
