"""Behind a real router: smg (SGLang's model gateway) → tether → the real vLLM in dev mode,
where `/abort_requests` exists. smg drops its connection to the worker when a client leaves
and calls no abort API; through tether that drop becomes vLLM's abort by tether's own ID. The
same raw client through smg straight to vLLM is measured beside it (vLLM 0.32 notices most
dropped connections itself: the difference is who stops it, and how much it generated)."""

from __future__ import annotations

import json
import pathlib
import re
import time
import uuid
from contextlib import AbstractContextManager, nullcontext

import pytest

from ..support.blocking_http import http_get
from ..support.raw_http import RawExchange, streams_side_by_side
from ..support.real_engine.measurements import Measurements
from ..support.real_engine.tether import start_tether
from ..support.smg import FAST_HEALTH_CHECKS, SKIP_REASON, Smg, smg_executable, smg_log, smg_process
from ..support.waiting import wait_until
from .processes import Stack
from .scenarios import (
    CHAT_PATH,
    INTERNAL_ID,
    LONG,
    STOPS_WITHIN,
    Saturation,
    chat,
    generated_tokens,
    generated_when_settled,
    on_dev_mode,
    received_ids,
    vllm_metrics,
    wait_vllm_idle,
)

pytestmark = pytest.mark.skipif(smg_executable() is None, reason=SKIP_REASON)

# Per phase and way, interleaved so both see the same machine; fewer where each run first
# fills vLLM's 16 slots.
RUNS = {"streaming": 3, "non-streaming": 3, "queued": 2}
# Tokens vLLM has generated for a non-streaming request when its client leaves.
NON_STREAMING_AFTER = 40
TOPIC = "behind smg"


def _setting(stack: Stack, phase: str) -> AbstractContextManager[object]:
    """For a client that leaves before its first byte, vLLM's 16 slots filled, so its request
    waits in the queue."""
    return Saturation(stack) if phase == "queued" else nullcontext()


def _leave(stack: Stack, router: Smg, phase: str, client_request_id: str) -> tuple[float, float]:
    """A raw client asks `router` for a long chat and leaves in `phase`; (seconds from its
    close until vLLM holds nothing of it, tokens vLLM generated after the close)."""
    body = chat(LONG, stream=phase == "streaming")
    exchange = RawExchange(router.port, CHAT_PATH, body, {"X-Request-Id": client_request_id})
    before = generated_tokens(stack)
    if phase == "streaming":
        assert exchange.read_head() == 200
        assert len(exchange.chunks(8)) == 8
    elif phase == "non-streaming":
        wait_until(
            lambda: generated_tokens(stack) - before >= NON_STREAMING_AFTER,
            20,
            f"vLLM to generate {NON_STREAMING_AFTER} tokens",
        )
    else:
        wait_until(
            lambda: vllm_metrics(stack).value("vllm:num_requests_waiting") == 1,
            10,
            "the request in vLLM's queue",
        )
    tokens_at_close = generated_tokens(stack)
    closed_at = exchange.close()
    if phase == "queued":
        wait_until(
            lambda: vllm_metrics(stack).value("vllm:num_requests_waiting") == 0,
            5,
            "vLLM's queue to empty",
        )
        return time.monotonic() - closed_at, 0.0
    wait_vllm_idle(stack)
    idle = time.monotonic() - closed_at
    return idle, generated_when_settled(stack) - tokens_at_close


@on_dev_mode
@pytest.mark.parametrize("phase", ["streaming", "non-streaming", "queued"])
def test_a_client_leaving_at_the_router_is_aborted_in_vllm_by_tether(
    stack: Stack,
    router: Smg,
    log_dir: pathlib.Path,
    request: pytest.FixtureRequest,
    measurements: Measurements,
    phase: str,
) -> None:
    """A client that leaves smg mid-stream, during a non-streaming answer or while queued
    (before its first byte): through tether vLLM aborts exactly tether's internal ID by its
    abort route (`Aborted request(s) chatcmpl-<id>.`), tether counts it `confirmed`, and vLLM
    holds nothing of it within 1.5 s. Through smg straight to vLLM nobody calls that route:
    vLLM stops the request itself once it sees the dropped connection."""
    straight_log = smg_log(log_dir, request, "vllm")
    with smg_process(stack.vllm.url, straight_log) as straight:
        for run in range(RUNS[phase]):
            via_id, alone_id = f"smg-{phase}-via-{run}", f"smg-{phase}-alone-{run}"
            vllm_mark, tether_mark = stack.vllm.log.mark(), stack.tether.log.mark()
            with _setting(stack, phase):
                idle, tokens = _leave(stack, router, phase, via_id)
            internal = _internal_id(stack, tether_mark, via_id)
            stack.vllm.log.wait_for(vllm_mark, rf"Aborted request\(s\) chatcmpl-{internal}\.$")
            sent = stack.tether.log.wait_json(tether_mark, "abort_sent", client_request_id=via_id)
            assert sent["result"] == "confirmed", sent
            assert sent["engine_request_ids"] == [f"chatcmpl-{internal}"], sent
            assert idle < STOPS_WITHIN, idle
            measurements.add(f"{TOPIC} {phase}", "smg -> tether: close -> vLLM idle (s)", idle)

            vllm_mark = stack.vllm.log.mark()
            with _setting(stack, phase):
                alone_idle, alone_tokens = _leave(stack, straight, phase, alone_id)
            # vLLM's own abort of a dropped connection: its internal form, `<id>-<8 hex>`.
            stack.vllm.log.wait_for(
                vllm_mark, rf"Aborted request\(s\) chatcmpl-{alone_id}-[0-9a-f]{{8}}\.$"
            )
            assert "POST /abort_requests" not in stack.vllm.log.text_since(vllm_mark)
            measurements.add(f"{TOPIC} {phase}", "smg -> vLLM: close -> vLLM idle (s)", alone_idle)
            if phase != "queued":
                measurements.add(f"{TOPIC} {phase}", "smg -> tether: tokens after close", tokens)
                measurements.add(
                    f"{TOPIC} {phase}", "smg -> vLLM: tokens after close", alone_tokens
                )


def _internal_id(stack: Stack, tether_mark: int, client_request_id: str) -> str:
    """tether's internal ID for the request smg forwarded as `client_request_id`."""
    line = stack.tether.log.wait_json(
        tether_mark, "request_finished", client_request_id=client_request_id
    )
    internal = str(line["internal_request_id"])
    assert INTERNAL_ID.match(internal), line
    return internal


def _streams(router: Smg, client_request_id: str) -> list[list[str]]:
    """Two concurrent short streams through `router` with one X-Request-Id; for each, the
    X-Request-Id answered followed by every chunk's `id`."""
    headers = {"X-Request-Id": client_request_id}
    return streams_side_by_side(router.port, CHAT_PATH, chat(200, True), headers, 5)


@on_dev_mode
def test_two_clients_with_one_id_stay_distinct_in_vllm(
    stack: Stack, router: Smg, log_dir: pathlib.Path, request: pytest.FixtureRequest
) -> None:
    """Two concurrent clients with the same X-Request-Id through smg → tether run in vLLM
    under two internal IDs and each gets its ID back in the header and every chunk; through
    smg straight to vLLM both run as `chatcmpl-<that id>`, one ID for two requests."""
    mark = stack.vllm.log.mark()
    for answer in _streams(router, "smg-shared-id"):
        assert set(answer) == {"smg-shared-id", "chatcmpl-smg-shared-id"}, answer
    ids = received_ids(stack, mark)
    assert len(ids) == 2 == len(set(ids)) and all(INTERNAL_ID.match(i) for i in ids), ids

    with smg_process(stack.vllm.url, smg_log(log_dir, request, "vllm")) as straight:
        mark = stack.vllm.log.mark()
        _streams(straight, "smg-shared-id")
    assert received_ids(stack, mark) == ["smg-shared-id", "smg-shared-id"]


@on_dev_mode
def test_router_discovers_and_health_checks_vllm_through_tether(
    stack: Stack, log_dir: pathlib.Path, request: pytest.FixtureRequest
) -> None:
    """smg with tether's port as its worker URL registers vLLM's model from `/v1/models`
    answered by vLLM through tether, and its `/health` checks pass through to vLLM; a chat
    routed by it comes back with the client's ID."""
    health_before = stack.tether.relayed("/health")
    mark = stack.vllm.log.mark()
    log = smg_log(log_dir, request, "tether")
    with smg_process(stack.tether.url, log, *FAST_HEALTH_CHECKS) as router:
        status, body = http_get(router.url("/v1/models"))
        assert status == 200 and [m["id"] for m in json.loads(body)["data"]] == ["tiny"]
        status, body = http_get(router.url("/workers"))
        [worker] = json.loads(body)["workers"]
        assert worker["url"] == stack.tether.url and worker["is_healthy"], worker
        assert re.search(r'"GET /v1/models HTTP/1\.1" 200', stack.vllm.log.text_since(mark))
        assert stack.tether.relayed("/v1/models") >= 1
        # smg checks every second here: two more checks, each one vLLM's answer.
        wait_until(lambda: stack.tether.relayed("/health") >= health_before + 2, 10, "smg's checks")
        with RawExchange(router.port, CHAT_PATH, chat(5, False), {"X-Request-Id": "smg-ok"}) as ex:
            assert ex.read_head() == 200
            assert json.loads(ex.body())["id"] == "chatcmpl-smg-ok"


@on_dev_mode
def test_preserve_mode_keeps_the_id_smg_sends_and_aborts_by_it(
    stack: Stack,
    log_dir: pathlib.Path,
    request: pytest.FixtureRequest,
    measurements: Measurements,
) -> None:
    """With TETHER_REQUEST_ID_MODE=preserve vLLM runs the request under the ID smg passed on
    (the client's, here a router-style UUID), and a client leaving is aborted by exactly that
    ID, confirmed."""
    preserving = start_tether(
        stack.vllm.url,
        log_dir / "tether-preserve-behind-smg.log",
        settings={"TETHER_REQUEST_ID_MODE": "preserve"},
    )
    try:
        with smg_process(preserving.url, smg_log(log_dir, request, "tether")) as router:
            client_request_id = uuid.uuid4().hex
            vllm_mark, tether_mark = stack.vllm.log.mark(), preserving.log.mark()
            exchange = RawExchange(
                router.port, CHAT_PATH, chat(LONG, True), {"X-Request-Id": client_request_id}
            )
            assert exchange.read_head() == 200
            assert {chunk["id"] for chunk in exchange.chunks(8)} == {
                f"chatcmpl-{client_request_id}"
            }
            stack.vllm.log.wait_for(vllm_mark, rf"Received request chatcmpl-{client_request_id}:")
            closed_at = exchange.close()
            wait_vllm_idle(stack)
            idle = time.monotonic() - closed_at
            stack.vllm.log.wait_for(
                vllm_mark, rf"Aborted request\(s\) chatcmpl-{client_request_id}\.$"
            )
            sent = preserving.log.wait_json(tether_mark, "abort_sent")
            assert sent["engine_request_ids"] == [f"chatcmpl-{client_request_id}"], sent
            assert sent["result"] == "confirmed", sent
            assert idle < STOPS_WITHIN, idle
            measurements.add(f"{TOPIC} preserve", "smg -> tether: close -> vLLM idle (s)", idle)
    finally:
        preserving.process.stop()
