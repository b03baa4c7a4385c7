"""The OpenAI Responses API through tether on the real vLLM (its response store on): the
`resp_…` ID the client gets is its handle for every follow-up call, IDs never collide, and
`background: true` requests outlive their connection."""

from __future__ import annotations

import json
import re
import time
from typing import Any

from ..support.blocking_http import http_get, http_post_json
from ..support.raw_http import RawExchange
from ..support.waiting import wait_until
from .processes import Stack
from .scenarios import (
    LONG,
    STOPS_WITHIN,
    engine_aborts,
    engine_ids_received,
    on_dev_mode,
    response,
    tether_metrics,
    vllm_load,
    wait_in_flight,
    wait_vllm_idle,
)

PATH = "/v1/responses"
RESPONSE_ID = re.compile(r"^resp_[0-9a-f]{32}$")
# Long enough that vLLM is still generating when tether lets go of the connection,
# TETHER_ABORT_CONFIRM_TIMEOUT (2 s) after the client left: about 5 s alone on one core.
BACKGROUND_TOKENS = 1500


def _post(stack: Stack, client_request_id: str, **fields: Any) -> tuple[dict[str, str], Any]:
    status, headers, body = http_post_json(
        stack.tether.url + PATH,
        response(16, stream=False, **fields),
        headers={"X-Request-Id": client_request_id},
    )
    assert status == 200, body[:300]
    return {k.lower(): v for k, v in headers.items()}, json.loads(body)


def _get(stack: Stack, response_id: str) -> Any:
    status, body = http_get(stack.tether.url + f"{PATH}/{response_id}")
    assert status == 200, body[:300]
    return json.loads(body)


def _internal_id(stack: Stack, mark: int, client_request_id: str) -> str:
    line = stack.tether.log.wait_json(mark, "request_finished", client_request_id=client_request_id)
    return str(line["internal_request_id"])


def _output_text(answer: dict[str, Any]) -> str:
    return "".join(
        part.get("text", "") for item in answer["output"] for part in item.get("content", [])
    )


def _aborts_total(stack: Stack) -> float:
    return tether_metrics(stack).value("tether_aborts_total")


@on_dev_mode
def test_stored_response_is_fetched_by_the_id_the_client_got(stack: Stack) -> None:
    """A stored response created through tether comes back from GET /v1/responses/{id} with
    the id the client got (resp_<tether's ID>), the client's own body request_id unused."""
    vllm_mark, tether_mark = stack.vllm.log.mark(), stack.tether.log.mark()
    headers, created = _post(stack, "resp-store-1", store=True, request_id="resp_client-chosen")
    internal_request_id = _internal_id(stack, tether_mark, "resp-store-1")
    assert headers.get("x-request-id") == "resp-store-1"
    assert created["id"] == f"resp_{internal_request_id}"
    assert engine_ids_received(stack, vllm_mark, internal_request_id) == [
        f"resp_{internal_request_id}_0"
    ]
    assert "resp_client-chosen" not in stack.vllm.log.text_since(vllm_mark)
    fetched = _get(stack, created["id"])
    assert fetched["id"] == created["id"]
    assert fetched["status"] == created["status"]
    assert _output_text(fetched) == _output_text(created) != ""


@on_dev_mode
def test_previous_response_id_continues_the_stored_response(stack: Stack) -> None:
    """A follow-up naming previous_response_id (the id the client got) continues that
    conversation: vLLM reads the earlier turn as part of the prompt."""
    _, first = _post(stack, "resp-turn-1", store=True)
    _, fresh = _post(stack, "resp-turn-fresh", input="And then?", store=True)
    _, follow_up = _post(
        stack, "resp-turn-2", input="And then?", store=True, previous_response_id=first["id"]
    )
    assert follow_up["previous_response_id"] == first["id"]
    assert RESPONSE_ID.match(follow_up["id"]) and follow_up["id"] != first["id"]
    # The earlier input and its 16-token answer are in the follow-up's prompt.
    assert follow_up["usage"]["input_tokens"] >= fresh["usage"]["input_tokens"] + 16
    assert _get(stack, follow_up["id"])["previous_response_id"] == first["id"]


@on_dev_mode
def test_one_client_id_twice_at_once_gets_two_engine_ids(stack: Stack) -> None:
    """Two concurrent streams with the same X-Request-Id and the same body request_id run in
    vLLM under two different IDs, and each client's handle fetches its own response."""
    vllm_mark = stack.vllm.log.mark()
    body = response(200, stream=True, store=True, request_id="resp_dup")
    first = RawExchange(stack.tether.port, PATH, body, {"X-Request-Id": "resp-dup"})
    second = RawExchange(stack.tether.port, PATH, body, {"X-Request-Id": "resp-dup"})
    with first, second:
        assert first.read_head() == 200 and second.read_head() == 200
        created = [first.chunks(1)[0], second.chunks(1)[0]]  # both running at once
        in_flight = [
            r for r in stack.tether.in_flight_requests() if r["client_request_id"] == "resp-dup"
        ]
        endings = [json.loads(list(first.events())[-1]), json.loads(list(second.events())[-1])]
    ids = [event["response"]["id"] for event in created]
    assert len(in_flight) == 2
    assert {f"resp_{r['internal_request_id']}" for r in in_flight} == set(ids)
    assert all(RESPONSE_ID.match(i) for i in ids) and ids[0] != ids[1], ids
    received = {
        m.group(1) for m in stack.vllm.log.find_since(vllm_mark, r"Received request (resp_\S+): ")
    }
    assert received == {f"{i}_0" for i in ids}
    assert "resp_dup" not in stack.vllm.log.text_since(vllm_mark)
    assert [e["type"] for e in endings] == ["response.completed"] * 2
    assert [_get(stack, i)["id"] for i in ids] == ids


@on_dev_mode
def test_background_request_outlives_its_connection(stack: Stack) -> None:
    """A `background: true` stream whose client leaves is never aborted: tether lets go of
    the connection after the confirm timeout, vLLM generates on, and GET shows it done."""
    aborts_before = _aborts_total(stack)
    vllm_mark, tether_mark = stack.vllm.log.mark(), stack.tether.log.mark()
    exchange = RawExchange(
        stack.tether.port,
        PATH,
        response(BACKGROUND_TOKENS, stream=True, store=True, background=True),
        {"X-Request-Id": "resp-background-1"},
    )
    assert exchange.read_head() == 200
    events = exchange.chunks(6)
    response_id = events[0]["response"]["id"]
    internal_request_id = str(wait_in_flight(stack, "resp-background-1")["internal_request_id"])
    assert response_id == f"resp_{internal_request_id}"
    exchange.close()
    stack.tether.log.wait_json(
        tether_mark, "background_request_left_running", internal_request_id=internal_request_id
    )
    assert vllm_load(stack) == 1, "tether's closing the connection stopped the request"

    def done() -> bool:
        return _get(stack, response_id)["status"] not in ("queued", "in_progress")

    wait_until(done, 60, "the background response to complete", interval=0.2)
    finished = _get(stack, response_id)
    assert finished["status"] in ("completed", "incomplete"), finished["status"]
    assert finished["usage"]["output_tokens"] == BACKGROUND_TOKENS
    assert _aborts_total(stack) == aborts_before
    assert stack.tether.log.json_lines(tether_mark, "abort_sent") == []
    assert engine_aborts(stack, vllm_mark, internal_request_id) == []
    assert '"POST /abort_requests' not in stack.vllm.log.text_since(vllm_mark)


@on_dev_mode
def test_cancel_through_tether_stops_a_background_response(stack: Stack) -> None:
    """POST /v1/responses/{id}/cancel through tether, with the id the client got, stops the
    background work in vLLM at once and the response reads as cancelled."""
    aborts_before = _aborts_total(stack)
    vllm_mark, tether_mark = stack.vllm.log.mark(), stack.tether.log.mark()
    _, queued = _post(stack, "resp-cancel-1", max_output_tokens=LONG, store=True, background=True)
    internal_request_id = _internal_id(stack, tether_mark, "resp-cancel-1")
    assert queued["id"] == f"resp_{internal_request_id}" and queued["status"] == "queued"
    wait_until(lambda: vllm_load(stack) == 1, 10, "vLLM to run the background request")
    started = time.monotonic()
    status, _, body = http_post_json(stack.tether.url + f"{PATH}/{queued['id']}/cancel", None)
    assert status == 200, body[:300]
    assert json.loads(body)["status"] == "cancelled"
    wait_vllm_idle(stack)
    assert time.monotonic() - started < STOPS_WITHIN
    aborted = engine_aborts(stack, vllm_mark, internal_request_id)
    assert [re.sub(r"-[0-9a-f]{8}$", "", one) for one in aborted] == [f"{queued['id']}_0"]
    assert _get(stack, queued["id"])["status"] == "cancelled"
    assert _aborts_total(stack) == aborts_before
