"""SIGTERM to tether with SGLang behind it: in-flight streams may finish within the grace
period; what is still running at its end is aborted in SGLang."""

from __future__ import annotations

import json
import signal
import time
from collections.abc import Callable

from ..support.real_engine.measurements import Measurements
from ..support.real_engine.tether import Tether
from .processes import Stack
from .scenarios import (
    CHAT_PATH,
    LONG,
    PROMPTLY,
    aborted_rids,
    chat,
    on_default,
    via_tether,
    wait_abort_logged,
    wait_sglang_idle,
)

EXIT_TIMEOUT = 15.0


@on_default
def test_stream_finishes_within_grace(
    stack: Stack, own_tether: Callable[[dict[str, str]], Tether]
) -> None:
    """A stream in flight at SIGTERM runs to its end within a 30 s grace, SGLang never aborts
    it, and tether then exits 0."""
    tether = own_tether({"TETHER_SHUTDOWN_GRACE": "30"})
    mark = stack.sglang.log.mark()
    with via_tether(stack, "drained-1", CHAT_PATH, chat(300, True), tether) as exchange:
        assert exchange.read_head() == 200
        exchange.chunks(3)
        internal_request_id = tether.wait_in_flight("drained-1")["internal_request_id"]
        tether.process.popen.send_signal(signal.SIGTERM)
        events = list(exchange.events())
    assert events[-1] == "[DONE]"
    finish = [c["finish_reason"] for e in events[:-1] for c in json.loads(e)["choices"]]
    assert finish[-1] == "length"
    assert tether.process.popen.wait(EXIT_TIMEOUT) == 0
    assert internal_request_id not in aborted_rids(stack, mark)


@on_default
def test_stream_still_running_at_end_of_grace_is_aborted(
    stack: Stack, own_tether: Callable[[dict[str, str]], Tether], measurements: Measurements
) -> None:
    """A stream longer than a 1 s grace is cut when the grace ends, SGLang aborts it under
    tether's rid and runs nothing right after."""
    grace = 1.0
    tether = own_tether({"TETHER_SHUTDOWN_GRACE": str(grace)})
    mark = stack.sglang.log.mark()
    with via_tether(stack, "cut-at-grace-1", CHAT_PATH, chat(LONG, True), tether) as exchange:
        assert exchange.read_head() == 200
        exchange.chunks(3)
        internal_request_id = tether.wait_in_flight("cut-at-grace-1")["internal_request_id"]
        signalled_at = time.monotonic()
        tether.process.popen.send_signal(signal.SIGTERM)
        exchange.set_timeout(grace + 10)
        events = list(exchange.events())  # until tether ends or cuts it
        wait_abort_logged(stack, mark, internal_request_id, timeout=grace + 5)
        wait_sglang_idle(stack, timeout=grace + 5)
        idle_after = time.monotonic() - signalled_at
    assert len(events) < LONG // 2
    assert tether.process.popen.wait(EXIT_TIMEOUT) == 0
    assert idle_after < grace + PROMPTLY
    measurements.add("shutdown", f"SIGTERM -> SGLang idle, grace {grace:.0f} s (s)", idle_after)
