"""Cancel by ID through tether on the real vLLM (dev mode: its abort route and response store
on): a stream cancelled by its client's ID stops in vLLM as a disconnect's does and ends
cleanly for its client; a streaming watch of a background response that closes aborts
nothing."""

from __future__ import annotations

import json
import socket
import time

from ..support.blocking_http import http_get, http_post_json
from ..support.raw_http import RawExchange, request_head
from ..support.waiting import wait_until
from .processes import Stack
from .scenarios import (
    CHAT_PATH,
    LONG,
    STOPS_WITHIN,
    chat,
    engine_aborts,
    on_dev_mode,
    response,
    vllm_load,
    wait_in_flight,
    wait_vllm_idle,
)

ALICE = {"Authorization": "Bearer alice-key"}


@on_dev_mode
def test_a_stream_cancelled_by_its_id_stops_in_vllm_and_ends_cleanly(stack: Stack) -> None:
    """POST /v1/requests/<client id>/cancel with the stream's own credential: vLLM logs the
    abort of tether's internal ID and is idle within a disconnect's bound, the canceller is
    told `confirmed`, and the stream's client reads whole events to a complete end."""
    vllm_mark = stack.vllm.log.mark()
    exchange = RawExchange(
        stack.tether.port, CHAT_PATH, chat(LONG, stream=True), {"X-Request-Id": "cx-1", **ALICE}
    )
    with exchange:
        assert exchange.read_head() == 200
        exchange.chunks(10)
        internal_request_id = str(wait_in_flight(stack, "cx-1")["internal_request_id"])
        started = time.monotonic()
        status, _, body = http_post_json(
            stack.tether.url + "/v1/requests/cx-1/cancel", None, headers=ALICE
        )
        rest = list(exchange.events())
        unended = exchange.body()  # bytes after the last whole event
    assert exchange.complete, "the stream was cut: its chunked body never ended"
    assert unended == b"", f"the stream ended inside an event: {unended[-200:]!r}"
    elapsed = wait_vllm_idle(stack)
    answer = json.loads(body)
    assert status == 200 and answer["cancelled"] == 1 and answer["engine"] == "confirmed", answer
    assert time.monotonic() - started < STOPS_WITHIN + elapsed
    assert engine_aborts(stack, vllm_mark, internal_request_id) == [
        f"chatcmpl-{internal_request_id}"
    ]
    for event in rest:
        if event != "[DONE]":
            json.loads(event)  # every event whole


@on_dev_mode
def test_another_credential_gets_404_and_vllm_runs_on(stack: Stack) -> None:
    """The same cancel with another credential: 404, no abort in vLLM's log, still running."""
    vllm_mark = stack.vllm.log.mark()
    exchange = RawExchange(
        stack.tether.port, CHAT_PATH, chat(LONG, stream=True), {"X-Request-Id": "cx-2", **ALICE}
    )
    with exchange:
        assert exchange.read_head() == 200
        exchange.chunks(5)
        internal_request_id = str(wait_in_flight(stack, "cx-2")["internal_request_id"])
        status, _, _ = http_post_json(
            stack.tether.url + "/v1/requests/cx-2/cancel",
            None,
            headers={"Authorization": "Bearer mallory"},
        )
        exchange.chunks(20)  # the stream goes on
        assert vllm_load(stack) == 1
        assert engine_aborts(stack, vllm_mark, internal_request_id) == []
    assert status == 404
    wait_vllm_idle(stack)  # the client's close then stops it, as any disconnect


@on_dev_mode
def test_closing_a_background_stream_and_a_watch_of_it_aborts_nothing(stack: Stack) -> None:
    """A streaming `background: true` response whose creating connection closes, then a
    `GET /v1/responses/{id}?stream=true` watch of it that closes too: tether sends no abort
    for either, vLLM generates on, and the response completes."""
    vllm_mark, tether_mark = stack.vllm.log.mark(), stack.tether.log.mark()
    creating = RawExchange(
        stack.tether.port,
        "/v1/responses",
        response(1500, stream=True, store=True, background=True),
        {"X-Request-Id": "cx-bg-1"},
    )
    assert creating.read_head() == 200
    response_id = creating.chunks(1)[0]["response"]["id"]
    creating.close()
    with socket.create_connection(("127.0.0.1", stack.tether.port), timeout=30) as watch:
        watch.sendall(
            request_head(f"/v1/responses/{response_id}?stream=true", method="GET", host="t")
        )
        seen = b""
        while seen.count(b"\n\n") < 3:  # a few events of the watch, then leave
            data = watch.recv(65536)
            assert data, f"the watch ended early: {seen[:300]!r}"
            seen += data
    assert seen.startswith(b"HTTP/1.1 200"), seen[:200]

    # tether lets go of each engine connection at the confirm timeout (2 s), having read it
    # quietly: by then a dropped or aborted one would have stopped vLLM.
    def both_let_go() -> bool:
        return len(stack.tether.log.json_lines(tether_mark, "background_request_left_running")) == 2

    wait_until(both_let_go, 10, "tether to let go of both connections")
    assert vllm_load(stack) == 1, "closing a connection stopped the background response"

    def done() -> bool:
        status, raw = http_get(stack.tether.url + f"/v1/responses/{response_id}")
        return status == 200 and json.loads(raw)["status"] not in ("queued", "in_progress")

    wait_until(done, 60, "the background response to complete", interval=0.2)
    _, raw = http_get(stack.tether.url + f"/v1/responses/{response_id}")
    assert json.loads(raw)["status"] in ("completed", "incomplete")
    assert stack.tether.log.json_lines(tether_mark, "abort_sent") == []
    assert '"POST /abort_requests' not in stack.vllm.log.text_since(vllm_mark)
