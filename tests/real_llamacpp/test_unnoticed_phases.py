"""The phases where llama-server does not notice a client that left (issue 30), because
other clients' streams keep restarting its HTTP thread's one-second wait: beside another
client's stream tether makes it notice by sending a non-streaming request upstream as a
stream; queued behind streams, tether keeps the request in its own queue (it counts the
engine's slots) and drops it there. Each measures llama-server alone beside it, for the phase
table."""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest

from ..support.real_engine.measurements import Measurements
from .measurements import ALONE, VIA_TETHER
from .processes import TWO_SLOTS, Stack
from .scenarios import (
    NEVER_SENT,
    Stop,
    leave_beside_stream,
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
def test_non_streaming_beside_a_stream_stops_within_half_a_second(
    stack: Stack, measurements: Measurements
) -> None:
    """A non-streaming client that leaves while another client streams has its request
    stopped within 0.5 s through tether, which sends it upstream as a stream (alone:
    llama-server's one-second wait restarts with every token of the other stream, so it
    generates the whole answer for nobody)."""
    via = _measure(
        stack, measurements, "non-streaming beside another client's stream", leave_beside_stream
    )
    assert max(stop.seconds for stop in via) < 0.5, f"not stopped within 0.5 s: {via}"


@on_two_slots
def test_queued_behind_streams_never_runs(stack: Stack, measurements: Measurements) -> None:
    """A request whose client left while it waited behind other clients' streams never
    reaches llama-server through tether, which kept it in its own queue (alone: the streams'
    tokens keep its one-second wait from timing out, and it is generated in full once a slot
    frees)."""
    via = _measure(stack, measurements, "queued behind streams", leave_queued_behind_streams)
    assert {stop.ending for stop in via} == {NEVER_SENT}, via
    assert max(stop.seconds for stop in via) < 1.0, via  # (read by polling its admin API)
