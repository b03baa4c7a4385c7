"""Cancel by ID through tether on the real SGLang 0.5.23: a request cancelled by its client's ID
with its own credential stops in SGLang within a disconnect's bound (SGLang logs the abort of
tether's rid and runs nothing), a streaming client's response ends after a whole event, a
waiting non-streaming client gets 499 `request_cancelled`; another caller's cancel is a 404
and the request runs to its end."""

from __future__ import annotations

import json
import time
from typing import Any

import pytest

from ..support.blocking_http import http_post_json
from ..support.raw_http import RawExchange
from ..support.real_engine.measurements import Measurements
from ..support.waiting import wait_until
from .processes import Stack
from .scenarios import (
    CHAT_PATH,
    LONG,
    PROMPTLY,
    aborted_rids,
    chat,
    finished_rids,
    on_default,
    tether_events,
    wait_abort_logged,
    wait_load,
    wait_sglang_idle,
)

ALICE = {"Authorization": "Bearer alice-key"}
MALLORY = {"Authorization": "Bearer mallory-key"}
# Tokens of a stream that must still be running when the cancels are answered, yet end within
# seconds (SGLang makes 90-160 a second here, fewer under load).
MEDIUM = 600


def _send(stack: Stack, payload: dict[str, Any], headers: dict[str, str]) -> RawExchange:
    return RawExchange(stack.tether.port, CHAT_PATH, payload, headers)


def _cancel(stack: Stack, request_id: str, headers: dict[str, str]) -> tuple[int, dict[str, Any]]:
    """`POST /v1/requests/<request_id>/cancel` on tether's serving port; (status, JSON)."""
    url = f"{stack.tether.url}/v1/requests/{request_id}/cancel"
    status, _, body = http_post_json(url, None, headers=headers, timeout=15)
    return status, json.loads(body)


def _abort_sent(stack: Stack, mark: int, client_request_id: str) -> list[dict[str, Any]]:
    return [
        entry
        for entry in tether_events(stack.tether, mark, "abort_sent")
        if entry.get("client_request_id") == client_request_id
    ]


def _wait_finished(stack: Stack, mark: int, rid: str, reason: str) -> None:
    """Wait for SGLang's request log to say it finished `rid` with `reason`."""
    wait_until(
        lambda: rid in finished_rids(stack, mark, reason), 10, f"SGLang to finish {rid}: {reason}"
    )


@on_default
@pytest.mark.parametrize("named_by", ["x-request-id", "body-rid"])
def test_a_stream_cancelled_by_its_id_stops_in_sglang_and_ends_cleanly(
    stack: Stack, named_by: str, measurements: Measurements
) -> None:
    """POST /v1/requests/<client id>/cancel with the stream's own credential (the ID sent as
    X-Request-Id, or as SGLang's body `rid`): SGLang logs the abort of tether's rid and runs
    nothing within a disconnect's bound, the canceller is told `confirmed`, and the stream's
    client reads whole events to the chunked body's end."""
    client_request_id = f"cancel-stream-{named_by}"
    if named_by == "body-rid":
        payload, headers = chat(LONG, stream=True, rid=client_request_id), ALICE
    else:
        payload, headers = chat(LONG, stream=True), {"X-Request-Id": client_request_id, **ALICE}
    wait_sglang_idle(stack)
    sglang_mark, tether_mark = stack.sglang.log.mark(), stack.tether.log.mark()
    with _send(stack, payload, headers) as exchange:
        assert exchange.read_head() == 200
        exchange.chunks(10)
        internal = str(stack.tether.wait_in_flight(client_request_id)["internal_request_id"])
        started = time.monotonic()
        status, answer = _cancel(stack, client_request_id, ALICE)
        answered = time.monotonic() - started
        wait_sglang_idle(stack)
        stopped = time.monotonic() - started
        exchange.set_timeout(10)
        rest = list(exchange.events())
        unended = exchange.body()  # bytes after the last whole event
        complete = exchange.complete

    assert status == 200, answer
    assert answer["id"] == client_request_id and answer["object"] == "request.cancellation"
    assert (answer["cancelled"], answer["engine"]) == (1, "confirmed"), answer
    wait_abort_logged(stack, sglang_mark, internal, kind="running")
    _wait_finished(stack, sglang_mark, internal, "abort")
    (abort,) = _abort_sent(stack, tether_mark, client_request_id)
    assert abort["engine_request_ids"] == [internal] and abort["result"] == "confirmed"
    assert stopped < PROMPTLY
    assert complete, "the stream was cut: its chunked body never ended"
    assert unended == b"", f"the stream ended inside an event: {unended[-200:]!r}"
    assert len(rest) < LONG // 2  # cut short, not run to its end
    for event in rest:
        json.loads(event)  # every event whole JSON (tether ends it before SGLang's `[DONE]`)
    measurements.add("cancel by ID", f"stream ({named_by}): cancel -> answered (s)", answered)
    measurements.add("cancel by ID", f"stream ({named_by}): cancel -> SGLang idle (s)", stopped)


@on_default
def test_another_callers_cancel_gets_404_and_the_stream_runs_to_its_end(stack: Stack) -> None:
    """The same cancel with another credential and with none: both the same 404
    `request_not_found` while the stream is in flight, tether asks SGLang to abort nothing,
    and the stream runs to SGLang's `length` finish and `[DONE]`."""
    client_request_id = "cancel-not-yours"
    wait_sglang_idle(stack)
    sglang_mark, tether_mark = stack.sglang.log.mark(), stack.tether.log.mark()
    headers = {"X-Request-Id": client_request_id, **ALICE}
    with _send(stack, chat(MEDIUM, stream=True), headers) as exchange:
        assert exchange.read_head() == 200
        exchange.chunks(5)
        internal = str(stack.tether.wait_in_flight(client_request_id)["internal_request_id"])
        (mallory, mallorys), (nobody, nobodys) = (
            _cancel(stack, client_request_id, MALLORY),
            _cancel(stack, client_request_id, {}),
        )
        in_flight = [r["client_request_id"] for r in stack.tether.in_flight_requests()]
        exchange.set_timeout(60)
        events = list(exchange.events())

    # Still in flight once both were answered: the 404s were not for a finished request.
    assert client_request_id in in_flight
    assert (mallory, nobody) == (404, 404)
    assert mallorys == nobodys and mallorys["error"]["code"] == "request_not_found"
    assert events[-1] == "[DONE]"
    finishes = [c["finish_reason"] for e in events[:-1] for c in json.loads(e)["choices"]]
    assert finishes[-1] == "length"
    _wait_finished(stack, sglang_mark, internal, "length")
    assert internal not in aborted_rids(stack, sglang_mark)
    assert _abort_sent(stack, tether_mark, client_request_id) == []


@on_default
def test_a_finished_requests_id_gets_404(stack: Stack) -> None:
    """Once SGLang has answered a request, its owner's cancel of that ID is a 404
    `request_not_found`, as for an ID never seen."""
    client_request_id = "cancel-finished"
    headers = {"X-Request-Id": client_request_id, **ALICE}
    with _send(stack, chat(8, stream=False), headers) as exchange:
        assert exchange.read_head() == 200
        exchange.body()

    status, answer = _cancel(stack, client_request_id, ALICE)
    assert status == 404 and answer["error"]["code"] == "request_not_found"
    assert answer == _cancel(stack, "cancel-never-sent", ALICE)[1]


@on_default
def test_a_waiting_non_streaming_client_gets_499_and_sglang_stops(
    stack: Stack, measurements: Measurements
) -> None:
    """A non-streaming request cancelled by its ID while SGLang generates (SGLang alone would
    notice a gone client only at its 4 s poll): its waiting client gets 499 with the
    OpenAI-style `request_cancelled` error, the canceller `confirmed`, and SGLang logs the
    abort of tether's rid and runs nothing within a disconnect's bound."""
    client_request_id = "cancel-waiting"
    wait_sglang_idle(stack)
    sglang_mark = stack.sglang.log.mark()
    headers = {"X-Request-Id": client_request_id, **ALICE}
    with _send(stack, chat(LONG, stream=False), headers) as exchange:
        internal = str(stack.tether.wait_in_flight(client_request_id)["internal_request_id"])
        wait_load(stack, "the request to run", lambda load: load.running == 1)
        started = time.monotonic()
        status, answer = _cancel(stack, client_request_id, ALICE)
        wait_sglang_idle(stack)
        stopped = time.monotonic() - started
        exchange.set_timeout(10)
        client_status = exchange.read_head()
        body = json.loads(exchange.body())

    assert status == 200 and (answer["cancelled"], answer["engine"]) == (1, "confirmed"), answer
    assert client_status == 499
    assert body["error"]["code"] == "request_cancelled", body
    wait_abort_logged(stack, sglang_mark, internal, kind="running")
    _wait_finished(stack, sglang_mark, internal, "abort")
    assert stopped < PROMPTLY
    measurements.add("cancel by ID", "non-streaming: cancel -> SGLang idle (s)", stopped)
