"""Never worse than no tether, on SGLang's multi-process front end: with
`--tokenizer-worker-num 2` two uvicorn workers serve one port, each with its own tokenizer
manager. SGLang 0.5.23 sends an abort for a rid the receiving worker does not hold on to
the scheduler anyway (`TokenizerManager.abort_request`: it returns early only with one
worker), so tether's abort works whichever worker gets it. Clients leave one at a time,
through tether and straight to SGLang in turn: how long until SGLang runs nothing."""

from __future__ import annotations

import random
import time

import pytest

from ..support.real_engine.measurements import Measurements
from .processes import TWO_TOKENIZER_WORKERS, Stack
from .scenarios import CHAT_PATH, LONG, chat, direct, via_tether, wait_load, wait_sglang_idle

SEED = 19
LEAVERS = 8
# Through tether, in every phase: SGLang idle within this of the close (alone, a streaming
# close takes 28-41 ms; a non-streaming one its 4 s poll).
IDLE_WITHIN = 0.3


@pytest.mark.parametrize("stack", [TWO_TOKENIZER_WORKERS.name], indirect=True)
@pytest.mark.parametrize("stream", [True, False], ids=["streaming", "non-streaming"])
def test_with_two_tokenizer_workers_a_leaver_through_tether_stops_sglang_at_once(
    stack: Stack, measurements: Measurements, stream: bool
) -> None:
    """Every leaver through tether leaves SGLang idle within 0.3 s of its close, its abort
    confirmed whichever worker received the call (none `unconfirmed` or `dropped`); straight
    to SGLang the same client is measured beside it."""
    rng = random.Random(SEED)
    kind = "streaming" if stream else "non-streaming"
    topic = f"never worse sglang {stack.name} {kind}"
    mark = stack.tether.log.mark()
    via: list[float] = []
    for index in range(LEAVERS):
        for way in ("via tether", "straight"):
            payload = chat(LONG, stream)
            exchange = (
                via_tether(stack, f"leave-{index}", CHAT_PATH, payload)
                if way == "via tether"
                else direct(stack, CHAT_PATH, payload)
            )
            if stream:
                assert exchange.read_head() == 200
                exchange.chunks(rng.randint(1, 8))
            else:
                wait_load(stack, "SGLang to run the request", lambda load: load.running >= 1)
                time.sleep(rng.uniform(0.05, 0.3))  # the client's patience: the scenario
            closed_at = time.monotonic()
            exchange.close()
            wait_sglang_idle(stack)
            idle = time.monotonic() - closed_at
            measurements.add(topic, f"{way}: close -> SGLang idle (s)", idle)
            if way == "via tether":
                via.append(idle)
    assert max(via) < IDLE_WITHIN, via
    results = [line["result"] for line in stack.tether.log.json_lines(mark, "abort_sent")]
    assert len(results) == LEAVERS and set(results) == {"confirmed"}, results
