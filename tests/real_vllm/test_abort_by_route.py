"""Abort truth on the real engine, route by route: tether names exactly the engine request IDs
vLLM runs a request under, calls it `confirmed` only when vLLM's response really ended, never
guesses an ID where it cannot know it, and says `not_supported` where vLLM has no abort route.
"""

from __future__ import annotations

import json
import re
import time
from typing import Any

import pytest

from ..support.blocking_http import http_post_json
from ..support.raw_http import RawExchange
from ..support.real_engine.measurements import Measurements
from ..support.real_engine.stacks import MODEL_NAME
from ..support.waiting import wait_until
from .processes import Stack
from .scenarios import (
    LONG,
    ROUTES,
    STOPS_WITHIN,
    GenerationRoute,
    Saturation,
    chat,
    engine_aborts,
    engine_ids_received,
    generated_tokens,
    leave_non_streaming,
    leave_stream,
    on_default,
    on_dev_mode,
    response_id,
    tether_metrics,
    vllm_load,
    vllm_metrics,
    wait_in_flight,
    wait_vllm_idle,
)

STREAMING = list(ROUTES.values())  # chat, completions (1 and 2 prompts), messages, responses
NON_STREAMING = [ROUTES["chat"], ROUTES["completions"]]
ABORT_ROUTE_ACCESS = re.compile(r'"POST /abort_requests HTTP/1\.1"')


def _aborted_by_vllm_itself(aborted: list[str]) -> list[str]:
    """The engine IDs in vLLM's own abort lines (`<engine id>-<8 hex>`, logged when it stops a
    request whose connection dropped), sorted; an ID in any other form fails."""
    ids = [one for line in aborted for one in line.split(",")]
    assert all(re.fullmatch(r".+-[0-9a-f]{8}", one) for one in ids), ids
    return sorted(one[: -len("-01234567")] for one in ids)


def _aborts(stack: Stack, result: str) -> float:
    return tether_metrics(stack).value("tether_aborts_total", engine="vllm", result=result)


def _assert_confirmed_by_exact_ids(
    stack: Stack,
    route: GenerationRoute,
    internal_request_id: str,
    vllm_mark: int,
    tether_mark: int,
    idle_after: float,
) -> dict[str, Any]:
    """tether's abort_sent line says confirmed and names exactly the IDs vLLM ran the request
    under; vLLM logged an abort of exactly those and no other (none of its own after a
    dropped connection); it stopped far before the stream's natural end."""
    line = stack.tether.log.wait_json(
        tether_mark, "abort_sent", internal_request_id=internal_request_id
    )
    engine_request_ids = route.engine_request_ids(internal_request_id)
    assert engine_ids_received(stack, vllm_mark, internal_request_id) == engine_request_ids
    assert line["engine_request_ids"] == engine_request_ids, line
    assert line["result"] == "confirmed", line
    # Repeats of the same call are allowed; any other ID (or vLLM's `-<8 hex>` internal form,
    # logged when the dropped connection stops it) is not.
    assert set(engine_aborts(stack, vllm_mark, internal_request_id)) == {
        ",".join(engine_request_ids)
    }
    assert idle_after < STOPS_WITHIN, f"vLLM still ran {idle_after:.2f}s after the close"
    assert line["engine_stop_ms"] < STOPS_WITHIN * 1000, line
    return line


@on_dev_mode
@pytest.mark.parametrize("route", STREAMING, ids=str)
def test_stream_left_mid_way_is_aborted_by_its_exact_engine_ids_and_confirmed(
    stack: Stack, route: GenerationRoute, measurements: Measurements
) -> None:
    """Dev mode: a client leaving a stream gets an abort naming exactly vLLM's IDs, confirmed."""
    client_request_id = f"truth-{route.name}"
    confirmed_before = _aborts(stack, "confirmed")
    vllm_mark, tether_mark = stack.vllm.log.mark(), stack.tether.log.mark()
    internal_request_id, idle_after, events = leave_stream(stack, route, client_request_id)
    line = _assert_confirmed_by_exact_ids(
        stack, route, internal_request_id, vllm_mark, tether_mark, idle_after
    )
    assert response_id(events[0]) == route.id_for_client(client_request_id, internal_request_id)
    assert _aborts(stack, "confirmed") == confirmed_before + 1
    topic = "route abort dev-mode"
    measurements.add(topic, f"{route.name} stream: client close -> vLLM idle (s)", idle_after)
    measurements.add(
        topic, f"{route.name} stream: tether engine stop (s)", line["engine_stop_ms"] / 1000
    )


@on_dev_mode
@pytest.mark.parametrize("route", NON_STREAMING, ids=str)
def test_non_streaming_request_left_is_aborted_confirmed_and_counted_whole(
    stack: Stack, route: GenerationRoute, measurements: Measurements
) -> None:
    """Dev mode: a non-streaming request left mid-generation is aborted, confirmed, and every
    token vLLM generated for it counts as generated after the client left."""
    client_request_id = f"truth-{route.name}-non-streaming"
    finished_before = vllm_metrics(stack).value(
        "vllm:request_success_total", finished_reason="length"
    )
    generated_before = generated_tokens(stack)
    vllm_mark, tether_mark = stack.vllm.log.mark(), stack.tether.log.mark()
    internal_request_id, idle_after = leave_non_streaming(
        stack, route, client_request_id, after_tokens=40
    )
    line = _assert_confirmed_by_exact_ids(
        stack, route, internal_request_id, vllm_mark, tether_mark, idle_after
    )
    generated = generated_tokens(stack) - generated_before
    # The answer that ended was vLLM's aborted one (finish_reason "abort", its usage): cut
    # short, not finished, and its usage count is what vLLM generated.
    assert 40 <= line["tokens_after_disconnect"] < LONG, line
    assert abs(line["tokens_after_disconnect"] - generated) <= 2, (line, generated)
    assert (
        vllm_metrics(stack).value("vllm:request_success_total", finished_reason="length")
        == finished_before
    )
    topic = "route abort dev-mode"
    measurements.add(
        topic, f"{route.name} non-streaming: client close -> vLLM idle (s)", idle_after
    )
    measurements.add(
        topic,
        f"{route.name} non-streaming: tokens after disconnect",
        line["tokens_after_disconnect"],
    )


@on_dev_mode
def test_vllm_abort_route_ends_a_non_streaming_answer_as_aborted(stack: Stack) -> None:
    """Control, straight to vLLM: its abort route ends a non-streaming answer at once with
    finish_reason "abort" and the usage so far, the end tether's confirmation waits for."""
    exchange = RawExchange(
        stack.vllm.port, "/v1/chat/completions", chat(LONG, stream=False), {"X-Request-Id": "ctl"}
    )
    wait_until(lambda: vllm_load(stack) == 1, 10, "vLLM to run the request")
    status, _, _ = http_post_json(
        stack.vllm.url + "/abort_requests", {"request_ids": ["chatcmpl-ctl"]}, timeout=10
    )
    assert status == 200
    exchange.set_timeout(STOPS_WITHIN)
    answer = json.loads(exchange.body())
    exchange.close()
    assert answer["choices"][0]["finish_reason"] == "abort"
    assert 0 < answer["usage"]["completion_tokens"] < LONG


# Generation routes tether has no entry for: vLLM's SageMaker alias (chat, `chatcmpl-<id>`)
# and the chat batch route, whose engine IDs are `chatcmpl-<id>_<n>`: a guessed
# `chatcmpl-<id>` would have matched nothing.
_UNKNOWN_ROUTES = [
    pytest.param("/invocations", chat(LONG, stream=True), ("chatcmpl-{id}",), id="invocations"),
    pytest.param(
        "/v1/chat/completions/batch",
        {
            "model": MODEL_NAME,
            "messages": [
                [{"role": "user", "content": "Tell me a long story."}],
                [{"role": "user", "content": "Tell me another one."}],
            ],
            "max_tokens": LONG,
            "ignore_eos": True,
        },
        ("chatcmpl-{id}_0", "chatcmpl-{id}_1"),
        id="chat-batch",
    ),
]


@on_dev_mode
@pytest.mark.parametrize(("path", "body", "engine_ids"), _UNKNOWN_ROUTES)
def test_route_outside_the_table_is_never_aborted_by_a_guessed_id(
    stack: Stack, path: str, body: dict[str, Any], engine_ids: tuple[str, ...]
) -> None:
    """Dev mode: a generation route tether does not know gets no abort call (unknown_route),
    never a confirmed one; the dropped connection stops vLLM."""
    client_request_id = f"unknown-{path.strip('/').replace('/', '-')}"
    before = {result: _aborts(stack, result) for result in ("confirmed", "unknown_route")}
    vllm_mark, tether_mark = stack.vllm.log.mark(), stack.tether.log.mark()
    exchange = RawExchange(stack.tether.port, path, body, {"X-Request-Id": client_request_id})
    internal_request_id = str(wait_in_flight(stack, client_request_id)["internal_request_id"])
    if body.get("stream"):
        assert exchange.read_head() == 200
        exchange.chunks(3)
    else:
        wait_until(lambda: vllm_load(stack) == len(engine_ids), 10, "vLLM to run the batch")
    closed_at = exchange.close()
    wait_vllm_idle(stack)
    idle_after = time.monotonic() - closed_at
    wait_until(
        lambda: _aborts(stack, "unknown_route") == before["unknown_route"] + 1,
        5,
        "tether to count unknown_route",
    )
    expected = [pattern.format(id=internal_request_id) for pattern in engine_ids]
    assert engine_ids_received(stack, vllm_mark, internal_request_id) == expected
    assert _aborts(stack, "confirmed") == before["confirmed"]
    assert [
        line
        for line in stack.tether.log.json_lines(tether_mark, "abort_sent")
        if line.get("internal_request_id") == internal_request_id
    ] == []
    assert not ABORT_ROUTE_ACCESS.search(stack.vllm.log.text_since(vllm_mark))
    # vLLM aborted each of its requests itself (internal `-<8 hex>` form): the dropped
    # connection did it.
    aborted = engine_aborts(stack, vllm_mark, internal_request_id)
    assert _aborted_by_vllm_itself(aborted) == sorted(expected)
    assert idle_after < STOPS_WITHIN


EARLY_TRIES = 20  # clients that leave right after sending, until OVERTAKEN of them raced
OVERTAKEN = 3
PROMPT_STOP = 0.25  # seconds: the dropped connection stops vLLM in ~10-50 ms


def _early_story(
    stack: Stack, mark: int, internal_request_id: str
) -> tuple[bool, bool, float | None]:
    """From vLLM's log: (whether it received the request, whether an abort naming it arrived
    before the request itself, when vLLM stopped it: its first abort after receiving it)."""
    text = stack.vllm.log.text_since(mark)
    received = re.search(rf"Received request chatcmpl-{internal_request_id}: ", text)
    aborts = [
        (match.start(), float(match.group(1)))
        for match in re.finditer(
            rf"^t=(\d+\.\d+) .*Aborted request\(s\) chatcmpl-{internal_request_id}\S*\.$",
            text,
            re.MULTILINE,
        )
    ]
    if received is None:
        return False, False, None
    stops = [at for position, at in aborts if position > received.start()]
    overtaken = any(position < received.start() for position, _ in aborts)
    return True, overtaken, stops[0] if stops else None


def _leave_right_after_sending(stack: Stack, client_request_id: str) -> tuple[float, str] | None:
    """A client that leaves 5 ms after sending; if tether's abort reached vLLM before the
    request did, (seconds from the close until vLLM stopped it, the evidence), else None."""
    vllm_mark, tether_mark = stack.vllm.log.mark(), stack.tether.log.mark()
    exchange = RawExchange(
        stack.tether.port,
        "/v1/chat/completions",
        chat(LONG, stream=True),
        {"X-Request-Id": client_request_id},
    )
    time.sleep(0.005)  # the client's behaviour: it leaves 5 ms after sending
    closed_at = time.time()  # vLLM's log has wall-clock times
    exchange.close()
    left = stack.tether.log.wait_json(
        tether_mark, "client_disconnected", client_request_id=client_request_id
    )
    if not left["upstream_contacted"]:
        return None  # tether never sent it: nothing to stop
    internal = str(left["internal_request_id"])
    settle_by = time.monotonic() + 3.0  # a request vLLM never got shows by then

    def settled() -> bool:
        received, _, stopped = _early_story(stack, vllm_mark, internal)
        return stopped is not None or (not received and time.monotonic() > settle_by)

    wait_until(settled, 6, f"vLLM to stop {client_request_id} (or never to get it)")
    _, raced, stopped = _early_story(stack, vllm_mark, internal)
    if not raced or stopped is None:
        return None
    # tether's line comes once the engine's response ended (if it writes one at all).
    written_by = time.monotonic() + 3.0
    wait_until(
        lambda: (
            time.monotonic() > written_by
            or any(
                line.get("internal_request_id") == internal
                for line in stack.tether.log.json_lines(tether_mark)
                if line.get("event") in ("abort_sent", "abort_failed")
            )
        ),
        5,
        "tether's abort line",
    )
    evidence = [
        line[:150] for line in stack.vllm.log.text_since(vllm_mark).splitlines() if internal in line
    ] + [
        str(line)
        for line in stack.tether.log.json_lines(tether_mark)
        if line.get("internal_request_id") == internal
        and line.get("event") in ("abort_sent", "abort_failed")
    ]
    return stopped - closed_at, "\n    ".join(evidence)


@on_dev_mode
def test_request_whose_abort_overtook_it_is_still_stopped_at_once(
    stack: Stack, measurements: Measurements
) -> None:
    """Dev mode, busy engine: a client that leaves 5 ms after sending, whose abort reaches
    vLLM before its request does, is still stopped within a moment."""
    raced: list[tuple[float, str]] = []
    with Saturation(stack, streams=4):
        for index in range(EARLY_TRIES):
            found = _leave_right_after_sending(stack, f"early-leaver-{index}")
            if found is not None:
                raced.append(found)
                measurements.add(
                    "route abort dev-mode",
                    "abort overtook its request: close -> vLLM stops it (s)",
                    found[0],
                )
            if len(raced) >= OVERTAKEN:
                break
    if not raced:
        pytest.skip(f"no abort reached vLLM before its request in {EARLY_TRIES} tries")
    late = [
        f"stopped {seconds:.3f}s after the close:\n    {evidence}"
        for seconds, evidence in raced
        if seconds > PROMPT_STOP
    ]
    assert not late, "\n".join(late)


DEFAULT_CASES = [pytest.param(route, True, id=f"{route.name}-stream") for route in STREAMING] + [
    pytest.param(route, False, id=f"{route.name}-non-streaming") for route in NON_STREAMING
]


@on_default
@pytest.mark.parametrize(("route", "stream"), DEFAULT_CASES)
def test_default_server_abort_is_not_supported_and_the_drop_stops_vllm(
    stack: Stack, route: GenerationRoute, stream: bool, measurements: Measurements
) -> None:
    """Default vLLM (no abort route): tether counts not_supported, never confirmed, sees no
    tokens after the disconnect, and the dropped connection stops vLLM at once."""
    client_request_id = f"default-{route.name}-{'stream' if stream else 'plain'}"
    metrics_before = tether_metrics(stack)
    vllm_mark = stack.vllm.log.mark()
    if stream:
        internal_request_id, idle_after, _ = leave_stream(stack, route, client_request_id)
    else:
        internal_request_id, idle_after = leave_non_streaming(
            stack, route, client_request_id, after_tokens=40
        )
    not_supported_before = metrics_before.value(
        "tether_aborts_total", engine="vllm", result="not_supported"
    )
    wait_until(
        lambda: _aborts(stack, "not_supported") == not_supported_before + 1,
        5,
        "tether to count not_supported",
    )
    after = tether_metrics(stack)
    assert after.value("tether_aborts_total", result="confirmed") == 0
    assert after.value("tether_tokens_after_disconnect_total") == metrics_before.value(
        "tether_tokens_after_disconnect_total"
    )
    assert not re.search(
        r'"POST /abort_requests HTTP/1\.1" 200', stack.vllm.log.text_since(vllm_mark)
    )
    # vLLM aborted each of the route's engine requests itself, in its internal form.
    expected = route.engine_request_ids(internal_request_id)
    assert engine_ids_received(stack, vllm_mark, internal_request_id) == expected
    aborted = engine_aborts(stack, vllm_mark, internal_request_id)
    assert _aborted_by_vllm_itself(aborted) == sorted(expected)
    assert idle_after < STOPS_WITHIN, f"vLLM still ran {idle_after:.2f}s after the close"
    measurements.add(
        "route abort default",
        f"{route.name} {'stream' if stream else 'non-streaming'}: client close -> vLLM idle (s)",
        idle_after,
    )
