"""tether adds vLLM's explicit abort call where the server has one, and copes where it has not."""

from __future__ import annotations

import re

from ..support.blocking_http import http_post_json
from ..support.real_engine.measurements import Measurements
from .processes import Stack
from .scenarios import (
    LONG,
    STOPS_WITHIN,
    on_default,
    on_dev_mode,
    on_middleware,
    tether_metrics,
    via_tether,
    wait_in_flight,
    wait_vllm_idle,
)
from .user_middleware import MARK_HEADER


def _aborts(stack: Stack, result: str) -> float:
    return tether_metrics(stack).value("tether_aborts_total", engine="vllm", result=result)


def _leave_mid_stream(stack: Stack, client_request_id: str) -> tuple[str, float]:
    exchange = via_tether(stack, client_request_id, max_tokens=LONG, stream=True)
    assert exchange.read_head() == 200
    exchange.chunks(10)
    internal_request_id = wait_in_flight(stack, client_request_id)["internal_request_id"]
    exchange.close()
    return internal_request_id, wait_vllm_idle(stack)


@on_dev_mode
def test_dev_mode_abort_route_gets_prefixed_internal_id(
    stack: Stack, measurements: Measurements
) -> None:
    """With VLLM_SERVER_DEV_MODE=1 tether calls /abort_requests with chatcmpl-<internal id>
    once, vLLM answers 200 and ends the stream, and tether counts the abort confirmed."""
    before = {result: _aborts(stack, result) for result in ("confirmed", "unconfirmed")}
    mark, tether_mark = stack.vllm.log.mark(), stack.tether.log.mark()
    internal_request_id, elapsed = _leave_mid_stream(stack, "abort-route-1")
    # The route logs the ID exactly as sent (no engine suffix) and answers 200.
    stack.vllm.log.wait_for(
        mark, rf"Aborted request\(s\) chatcmpl-{internal_request_id}\.\s*$", timeout=5
    )
    stack.vllm.log.wait_for(mark, r'"POST /abort_requests HTTP/1\.1" 200', timeout=5)
    line = stack.tether.log.wait_json(
        tether_mark, "abort_sent", internal_request_id=internal_request_id
    )
    assert line["engine_request_ids"] == [f"chatcmpl-{internal_request_id}"]
    assert line["result"] == "confirmed" and line["attempts"] == 1, line
    assert line["detail"].endswith("/abort_requests: 200"), line
    assert (
        line["latency_ms"] < STOPS_WITHIN * 1000 and line["engine_stop_ms"] < STOPS_WITHIN * 1000
    ), line
    assert _aborts(stack, "confirmed") == before["confirmed"] + 1
    assert _aborts(stack, "unconfirmed") == before["unconfirmed"]
    assert elapsed < STOPS_WITHIN
    measurements.add("abort route", "dev mode: client close -> vLLM idle (s)", elapsed)


@on_default
def test_missing_abort_route_is_reported_and_drop_still_stops_work(
    stack: Stack, measurements: Measurements
) -> None:
    """Without an abort route tether counts not_supported, and dropping the connection still
    makes vLLM abort."""
    mark = stack.vllm.log.mark()
    internal_request_id, elapsed = _leave_mid_stream(stack, "no-abort-route-1")
    stack.vllm.log.wait_for(
        mark, rf"Aborted request\(s\) chatcmpl-{internal_request_id}-[0-9a-f]+", timeout=5
    )
    assert not re.search(r'"POST /abort_requests HTTP/1\.1" 200', stack.vllm.log.text_since(mark))
    assert _aborts(stack, "not_supported") >= 1
    for result in ("confirmed", "unconfirmed", "failed"):
        assert _aborts(stack, result) == 0, result
    measurements.add("abort route", "default: client close -> vLLM idle (s)", elapsed)


@on_middleware
def test_user_middleware_is_installed_in_vllm(stack: Stack) -> None:
    """The default server really runs the user --middleware the disconnect tests go through."""
    status, headers, _ = http_post_json(
        stack.vllm.url + "/v1/chat/completions",
        {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
    )
    assert status == 200
    assert {k.lower(): v for k, v in headers.items()}.get(MARK_HEADER) == "1"
