"""With no TETHER_ENGINE, tether in front of a real SGLang says it is SGLang, serves it as
SGLang (a non-streaming client that leaves stops SGLang at once instead of at its own 4 s
poll) and refuses SGLang's control routes, as the default once did only with the engine
named (the default was vLLM's profile, which sent its abort to a route SGLang has not)."""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest

from ..support.blocking_http import http_get, http_post_json
from ..support.raw_http import RawExchange
from ..support.real_engine.measurements import Measurements
from ..support.real_engine.tether import Tether
from .measurements import VIA_SGLANG_ALONE, VIA_TETHER
from .processes import DEFAULT, Stack
from .scenarios import (
    CHAT_PATH,
    LONG,
    direct,
    request_for,
    tether_events,
    via_tether,
    wait_load,
    wait_sglang_idle,
)

RUNS = 3
# SGLang alone notices a non-streaming client's close only at its 4 s poll (3.45-3.55 s for
# a close at 0.5 s); identified, tether's abort stops it within tens of milliseconds.
STOPPED_WITHIN = 0.5
TOPIC = "idle after the close, non-streaming, TETHER_ENGINE unset (s)"


def _leave_non_streaming(stack: Stack, exchange: RawExchange) -> float:
    """Seconds from a non-streaming client's close, once SGLang runs its request, until
    SGLang holds nothing."""
    wait_load(stack, "SGLang to run the request", lambda load: load.running >= 1)
    closed_at = exchange.close()
    wait_sglang_idle(stack)
    return time.monotonic() - closed_at


@pytest.mark.parametrize("stack", [DEFAULT.name], indirect=True)
def test_with_no_engine_set_sglang_is_identified_and_stopped_at_once(
    stack: Stack, own_tether: Callable[[dict[str, str]], Tether], measurements: Measurements
) -> None:
    """TETHER_ENGINE unset: `engine_identified` names SGLang (and its profile serves it); a
    non-streaming client that leaves stops SGLang within 0.5 s (alone: its 4 s poll)."""
    tether = own_tether({"TETHER_ENGINE": ""})  # empty: the default, auto
    [identified] = tether_events(tether, 0, "engine_identified")
    assert (identified["engine"], identified["profile"]) == ("sglang", "sglang"), identified
    labels = {"configured": "auto", "identified": "sglang", "profile": "sglang", "version": ""}
    assert tether.metrics().value("tether_engine_info", **labels) == 1

    payload = request_for(CHAT_PATH, LONG, False)
    via, alone = [], []
    for run in range(RUNS):  # interleaved, so both see the same machine
        through = via_tether(stack, f"identified-{run}", CHAT_PATH, payload, tether)
        via.append(_leave_non_streaming(stack, through))
        alone.append(_leave_non_streaming(stack, direct(stack, CHAT_PATH, payload)))
        measurements.add(TOPIC, VIA_TETHER, via[-1])
        measurements.add(TOPIC, VIA_SGLANG_ALONE, alone[-1])
    assert max(via) < STOPPED_WITHIN, via
    assert min(alone) > 2 * STOPPED_WITHIN, alone  # SGLang alone is not prompt here


@pytest.mark.parametrize("stack", [DEFAULT.name], indirect=True)
def test_with_no_engine_set_sglangs_control_routes_are_refused(
    stack: Stack, own_tether: Callable[[dict[str, str]], Tether]
) -> None:
    """`/abort_request` (aborts every rid starting with the one named), `/get_server_info`
    (answers with SGLang's API keys) and `/flush_cache` are refused with 403; SGLang
    itself serves them."""
    tether = own_tether({"TETHER_ENGINE": ""})
    status, _, _ = http_post_json(tether.url + "/abort_request", {"rid": ""})
    assert status == 403
    assert http_get(tether.url + "/get_server_info")[0] == 403
    assert http_post_json(tether.url + "/flush_cache", {})[0] == 403
    assert http_get(stack.sglang.url + "/get_server_info")[0] == 200
