"""tether's admin port: abort by client ID, the in-flight list and metrics, checked against
what the real vLLM says."""

from __future__ import annotations

import re
import time

from ..support.blocking_http import http_post_json
from ..support.real_engine.measurements import Measurements
from .processes import Stack
from .scenarios import (
    LONG,
    admin_abort,
    admin_requests,
    on_default_and_dev,
    tether_metrics,
    via_tether,
    vllm_load,
    vllm_metrics,
    wait_engine_abort,
    wait_in_flight,
    wait_vllm_idle,
)


@on_default_and_dev
def test_admin_abort_cuts_client_stream_and_vllm_aborts(
    stack: Stack, measurements: Measurements
) -> None:
    """POST /admin/abort with the client's ID ends its stream early and vLLM stops the request."""
    mark = stack.vllm.log.mark()
    exchange = via_tether(stack, "admin-aborted-1", max_tokens=LONG, stream=True)
    assert exchange.read_head() == 200
    received = len(exchange.chunks(10))
    internal_request_id = wait_in_flight(stack, "admin-aborted-1")["internal_request_id"]
    started = time.monotonic()
    status, body = admin_abort(stack, "admin-aborted-1")
    assert 200 <= status < 300, (status, body)
    elapsed = wait_vllm_idle(stack)
    measurements.add(
        f"admin abort {stack.vllm.config.name}",
        "admin call -> vLLM idle (s)",
        time.monotonic() - started,
    )
    wait_engine_abort(stack, mark, internal_request_id)
    exchange.set_timeout(10)
    try:
        received += sum(1 for _ in exchange.events())  # the stream must end on its own
    except (TimeoutError, ConnectionError):
        pass
    finally:
        exchange.close()
    assert received < LONG // 2, f"client got {received} chunks after the abort"
    assert elapsed < 5


@on_default_and_dev
def test_admin_abort_requires_token(stack: Stack) -> None:
    """/admin/abort without the bearer token is refused and the stream goes on."""
    with via_tether(stack, "admin-unauthorised-1", max_tokens=300, stream=True) as exchange:
        assert exchange.read_head() == 200
        exchange.chunks(2)
        status, _, _ = http_post_json(
            stack.tether.admin_url + "/admin/abort",
            {"request_id": "admin-unauthorised-1"},
            timeout=10,
        )
        assert status in (401, 403)
        events = list(exchange.events())
    assert events[-1] == "[DONE]"


@on_default_and_dev
def test_admin_in_flight_view_agrees_with_vllm(stack: Stack) -> None:
    """While one stream runs, tether lists exactly it and vLLM runs exactly one request."""
    with via_tether(stack, "admin-listed-1", max_tokens=LONG, stream=True) as exchange:
        assert exchange.read_head() == 200
        exchange.chunks(10)
        entry = wait_in_flight(stack, "admin-listed-1")
        assert [r["client_request_id"] for r in admin_requests(stack)] == ["admin-listed-1"]
        assert entry["method"] == "POST" and entry["path"] == "/v1/chat/completions"
        assert entry["phase"] == "streaming"
        assert entry["bytes_out"] > 0 and entry["age_seconds"] >= 0
        assert tether_metrics(stack).value("tether_requests_in_flight") == 1
        assert vllm_metrics(stack).value("vllm:num_requests_running") == 1
    wait_vllm_idle(stack)
    assert tether_metrics(stack).value("tether_requests_in_flight") == 0
    assert admin_requests(stack) == []


@on_default_and_dev
def test_tether_disconnect_count_matches_vllm_aborts(stack: Stack) -> None:
    """Each disconnect tether counts is one request vLLM logs as aborted under tether's ID."""
    before = tether_metrics(stack).value("tether_client_disconnects_total")
    mark = stack.vllm.log.mark()
    internal_ids = []
    for index in range(3):
        exchange = via_tether(stack, f"counted-{index}", max_tokens=LONG, stream=True)
        assert exchange.read_head() == 200
        exchange.chunks(5)
        internal_ids.append(wait_in_flight(stack, f"counted-{index}")["internal_request_id"])
        exchange.close()
        wait_vllm_idle(stack)
    for internal_request_id in internal_ids:
        wait_engine_abort(stack, mark, internal_request_id)
    aborted = set(
        re.findall(r"Aborted request\(s\) chatcmpl-([0-9a-f]{32})", stack.vllm.log.text_since(mark))
    )
    assert aborted == set(internal_ids)
    assert tether_metrics(stack).value("tether_client_disconnects_total") - before == len(
        internal_ids
    )
    assert vllm_load(stack) == 0
