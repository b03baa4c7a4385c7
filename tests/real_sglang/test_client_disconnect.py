"""A client that leaves in any phase stops the work in the real SGLang within a moment through
tether; the same raw client talking to SGLang directly is measured for comparison."""

from __future__ import annotations

import contextlib
import random
import time
from dataclasses import dataclass
from typing import Any

import pytest

from ..support.raw_http import RawExchange
from ..support.real_engine.measurements import Measurements
from .measurements import IDLE_TOPIC, VIA_SGLANG_ALONE, VIA_TETHER
from .processes import DEFAULT, ONE_SLOT, Stack
from .scenarios import (
    CHAT_PATH,
    COMPLETIONS_PATH,
    GENERATE_PATH,
    GIVE_UP,
    LONG,
    PROMPTLY,
    Occupant,
    direct,
    request_for,
    sglang_load,
    sglang_metrics,
    via_tether,
    wait_abort_logged,
    wait_load,
    wait_sglang_idle,
)

RUNS = 5
# Token IDs of a prompt whose chunked prefill (16 tokens a step) takes about a second; with
# LONG_PROMPT + its answer inside the 2048-token context.
LONG_PROMPT = 1500
PROMPT_ANSWER = 500


@dataclass(frozen=True)
class Phase:
    """Where a request is when its client leaves, and where SGLang's log says it aborted it
    from."""

    name: str
    config: str
    path: str
    stream: bool
    aborted_from: str

    def request(self, seed: str) -> dict[str, Any]:
        if self.name == "prefill":
            # Fresh token IDs every time: a cached prefix would skip the prefill.
            rng = random.Random(seed)
            prompt = [rng.randrange(10, 4000) for _ in range(LONG_PROMPT)]
            return request_for(self.path, PROMPT_ANSWER, self.stream, prompt=prompt)
        return request_for(self.path, LONG, self.stream)


PHASES = (
    # Waits in SGLang's queue behind a long stream that holds the only slot.
    Phase("queued", ONE_SLOT.name, CHAT_PATH, True, "queued"),
    # A streaming client that gives up before its first token, during a long prefill.
    Phase("prefill", ONE_SLOT.name, COMPLETIONS_PATH, True, "chunked prefill"),
    Phase("streaming", DEFAULT.name, CHAT_PATH, True, "running"),
    Phase("non-streaming", DEFAULT.name, CHAT_PATH, False, "running"),
    Phase("/generate streaming", DEFAULT.name, GENERATE_PATH, True, "running"),
    Phase("/generate non-streaming", DEFAULT.name, GENERATE_PATH, False, "running"),
)


def _close_in_phase(stack: Stack, phase: Phase, exchange: RawExchange) -> float:
    """Bring the request into `phase`, close its connection; the seconds from the close until
    SGLang no longer holds it."""
    if phase.name == "queued":
        wait_load(stack, "a queued request", lambda load: load.waiting == 1)
        closed_at = exchange.close()
        wait_load(stack, "SGLang's queue to empty", lambda load: load.waiting == 0, GIVE_UP)
        return time.monotonic() - closed_at
    if phase.name == "prefill":
        wait_load(stack, "a prefill", lambda load: load.used_tokens > 0 and load.running == 0)
    elif phase.stream:
        assert exchange.read_head() == 200
        assert len(exchange.chunks(10)) == 10
    else:
        wait_load(stack, "SGLang to run the request", lambda load: load.running >= 1)
    closed_at = exchange.close()
    wait_sglang_idle(stack)
    return time.monotonic() - closed_at


def _setting(stack: Stack, phase: Phase, name: str) -> contextlib.AbstractContextManager[object]:
    """What must run meanwhile: for a queued request, the stream that holds the only slot."""
    if phase.name == "queued":
        return Occupant(stack, name)
    return contextlib.nullcontext()


def _leave_via_tether(stack: Stack, phase: Phase, run: int) -> float:
    client_request_id = f"leaves-{phase.name.strip('/').replace(' ', '-')}-{run}"
    mark = stack.sglang.log.mark()
    aborted_before = sglang_metrics(stack).value("sglang:num_aborted_requests_total")
    exchange = via_tether(stack, client_request_id, phase.path, phase.request(client_request_id))
    internal_request_id = stack.tether.wait_in_flight(client_request_id)["internal_request_id"]
    seconds = _close_in_phase(stack, phase, exchange)
    wait_abort_logged(stack, mark, internal_request_id, phase.aborted_from)
    assert sglang_metrics(stack).value("sglang:num_aborted_requests_total") > aborted_before
    return seconds


def _leave_sglang_alone(stack: Stack, phase: Phase, run: int) -> float:
    return _close_in_phase(stack, phase, direct(stack, phase.path, phase.request(f"alone-{run}")))


@pytest.mark.parametrize(
    ("stack", "phase"),
    [(phase.config, phase) for phase in PHASES],
    indirect=["stack"],
    ids=[phase.name for phase in PHASES],
)
def test_client_leaving_stops_sglang_promptly(
    stack: Stack, phase: Phase, measurements: Measurements
) -> None:
    """Through tether, SGLang drops the request of a client that left in this phase within a
    second, every time, and logs the abort under tether's rid."""
    disconnects_before = stack.tether.metrics().value("tether_client_disconnects_total")
    via: list[float] = []
    for run in range(RUNS):  # interleaved, so both see the same machine
        with _setting(stack, phase, f"occupant-via-{run}"):
            via.append(_leave_via_tether(stack, phase, run))
        with _setting(stack, phase, f"occupant-alone-{run}"):
            alone = _leave_sglang_alone(stack, phase, run)
        measurements.add(IDLE_TOPIC + phase.name, VIA_TETHER, via[-1])
        measurements.add(IDLE_TOPIC + phase.name, VIA_SGLANG_ALONE, alone)
    assert max(via) < PROMPTLY, via
    assert (
        stack.tether.metrics().value("tether_client_disconnects_total") == disconnects_before + RUNS
    )
    assert sglang_load(stack).idle
