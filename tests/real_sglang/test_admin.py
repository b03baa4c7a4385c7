"""tether's admin port: abort by client ID, checked against what the real SGLang says."""

from __future__ import annotations

import json
import time

from ..support.real_engine.measurements import Measurements
from .processes import Stack
from .scenarios import (
    CHAT_PATH,
    LONG,
    PROMPTLY,
    chat,
    on_default,
    via_tether,
    wait_abort_logged,
    wait_sglang_idle,
)


@on_default
def test_admin_abort_by_client_id_stops_all_its_requests(
    stack: Stack, measurements: Measurements
) -> None:
    """POST /admin/abort with a client ID ends every in-flight request with that ID, SGLang
    aborts each under tether's rid, and another client's stream goes on to its end."""
    mark = stack.sglang.log.mark()
    targets = [via_tether(stack, "admin-target", CHAT_PATH, chat(LONG, True)) for _ in range(2)]
    bystander = via_tether(stack, "admin-bystander", CHAT_PATH, chat(300, True))
    try:
        for exchange in [*targets, bystander]:
            assert exchange.read_head() == 200
            exchange.chunks(3)
        stack.tether.wait_in_flight("admin-target")
        target_rids = {
            entry["internal_request_id"]
            for entry in stack.tether.in_flight_requests()
            if entry["client_request_id"] == "admin-target"
        }
        started = time.monotonic()
        status, body = stack.tether.abort("admin-target")
        assert status == 200, (status, body)
        assert set(json.loads(body)["aborted"]) == target_rids
        for rid in target_rids:
            wait_abort_logged(stack, mark, rid)
        aborted_after = time.monotonic() - started
        for exchange in targets:  # each client's stream ends now, early
            exchange.set_timeout(10)
            assert len(list(exchange.events())) < LONG // 2
        assert list(bystander.events())[-1] == "[DONE]"
    finally:
        for exchange in [*targets, bystander]:
            exchange.close()
    wait_sglang_idle(stack)
    assert len(target_rids) == 2
    assert aborted_after < PROMPTLY
    measurements.add("admin abort", "admin call -> SGLang logged both aborts (s)", aborted_after)
