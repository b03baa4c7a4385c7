"""Behind a real router: smg (SGLang's model gateway) → tether → the real SGLang. smg drops its
connection to the worker when a client leaves and calls no abort API; SGLang alone notices a
dropped non-streaming or queued request only at its 4 s poll. Through tether the drop becomes
SGLang's `/abort_request` by tether's rid. The same raw client through smg straight to SGLang
is measured beside it."""

from __future__ import annotations

import contextlib
import json
import pathlib
import re
import time
import uuid
from collections.abc import Callable

import pytest

from ..support.blocking_http import http_get
from ..support.raw_http import RawExchange, streams_side_by_side
from ..support.real_engine.measurements import Measurements
from ..support.real_engine.tether import Tether
from ..support.smg import FAST_HEALTH_CHECKS, SKIP_REASON, Smg, smg_executable, smg_log, smg_process
from ..support.waiting import wait_until
from .processes import DEFAULT, ONE_SLOT, Stack
from .scenarios import (
    CHAT_PATH,
    GIVE_UP,
    INTERNAL_ID,
    LONG,
    PROMPTLY,
    Occupant,
    chat,
    received_rids,
    sglang_load,
    sglang_metrics,
    wait_abort_logged,
    wait_load,
    wait_sglang_idle,
)

pytestmark = pytest.mark.skipif(smg_executable() is None, reason=SKIP_REASON)

TOPIC = "behind smg"
# Per phase and way, interleaved so both see the same machine; fewer where a run straight to
# SGLang waits for its 4 s poll.
RUNS = {"streaming": 3, "non-streaming": 2, "queued": 2}
# Tokens SGLang has generated for a request when its client leaves.
GENERATED_BEFORE_LEAVING = 20


def _counters(stack: Stack) -> tuple[float, float]:
    """SGLang's (generated, prompt) token counters; it adds a request's when it ends."""
    metrics = sglang_metrics(stack)
    return (
        metrics.value("sglang:generation_tokens_total"),
        metrics.value("sglang:prompt_tokens_total"),
    )


def _leave(stack: Stack, router: Smg, phase: str, client_request_id: str) -> tuple[float, float]:
    """A raw client asks `router` for a long chat and leaves in `phase`; (seconds from its
    close until SGLang holds nothing of it, tokens SGLang generated after the close)."""
    if phase != "queued":  # (a queued one waits behind the stream that holds the slot)
        wait_sglang_idle(stack)
    generated_before, prompt_before = _counters(stack)
    body = chat(LONG, stream=phase != "non-streaming")
    exchange = RawExchange(router.port, CHAT_PATH, body, {"X-Request-Id": client_request_id})
    if phase == "queued":
        wait_load(stack, "a queued request", lambda load: load.waiting == 1)
        closed_at = exchange.close()
        wait_load(stack, "SGLang's queue to empty", lambda load: load.waiting == 0, GIVE_UP)
        return time.monotonic() - closed_at, 0.0
    if phase == "streaming":
        assert exchange.read_head() == 200
        exchange.chunks(3)
    wait_load(stack, "the request to run", lambda load: load.running == 1)
    # Its KV cache in use is its prompt plus what it generated so far.
    prompt = sglang_load(stack).used_tokens
    wait_load(
        stack,
        "SGLang to generate",
        lambda load: load.used_tokens >= prompt + GENERATED_BEFORE_LEAVING,
    )
    used_at_close = sglang_load(stack).used_tokens
    closed_at = exchange.close()
    wait_sglang_idle(stack)
    idle = time.monotonic() - closed_at
    generated_after, prompt_after = _counters(stack)
    so_far = used_at_close - (prompt_after - prompt_before)
    return idle, max(0.0, generated_after - generated_before - so_far)


def _setting(stack: Stack, phase: str, rid: str) -> contextlib.AbstractContextManager[object]:
    """For a client that leaves before its first byte, the only slot held by a long stream,
    so its request waits in SGLang's queue."""
    return Occupant(stack, rid) if phase == "queued" else contextlib.nullcontext()


@pytest.mark.parametrize(
    ("stack", "phase"),
    [(DEFAULT.name, "streaming"), (DEFAULT.name, "non-streaming"), (ONE_SLOT.name, "queued")],
    indirect=["stack"],
    ids=["streaming", "non-streaming", "queued"],
)
def test_a_client_leaving_at_the_router_is_aborted_in_sglang_by_tether(
    stack: Stack,
    router: Smg,
    log_dir: pathlib.Path,
    request: pytest.FixtureRequest,
    measurements: Measurements,
    phase: str,
) -> None:
    """A client that leaves smg mid-stream, during a non-streaming answer or while queued
    (before its first byte): through tether SGLang aborts tether's rid (its scheduler logs
    it), tether counts the abort `confirmed`, and SGLang holds nothing of it within a second.
    Through smg straight to SGLang nobody calls `/abort_request`: SGLang stops it itself, a
    non-streaming or queued one only at its 4 s poll."""
    with smg_process(stack.sglang.url, smg_log(log_dir, request, "sglang")) as straight:
        for run in range(RUNS[phase]):
            via_id = f"smg-{phase}-via-{run}"
            sglang_mark, tether_mark = stack.sglang.log.mark(), stack.tether.log.mark()
            with _setting(stack, phase, f"occupant-smg-via-{run}"):
                idle, tokens = _leave(stack, router, phase, via_id)
            internal = str(
                stack.tether.log.wait_json(
                    tether_mark, "request_finished", client_request_id=via_id
                )["internal_request_id"]
            )
            wait_abort_logged(stack, sglang_mark, internal)
            sent = stack.tether.log.wait_json(tether_mark, "abort_sent", client_request_id=via_id)
            assert sent["result"] == "confirmed" and sent["engine_request_ids"] == [internal]
            assert idle < PROMPTLY, idle

            sglang_mark = stack.sglang.log.mark()
            with _setting(stack, phase, f"occupant-smg-alone-{run}"):
                alone_idle, alone_tokens = _leave(stack, straight, phase, f"smg-alone-{run}")
                # (Read before the occupant leaves: it is aborted through SGLang's own API.)
                log = stack.sglang.log.text_since(sglang_mark)
            rids = [rid for rid in received_rids(stack, sglang_mark) if "occupant" not in rid]
            assert len(rids) == 1 and f"smg-alone-{run}" not in rids, rids  # SGLang's own rid
            assert not re.search(r'"POST /abort_request HTTP/1\.1"', log)
            wait_abort_logged(stack, sglang_mark, rids[0], timeout=GIVE_UP)

            topic = f"{TOPIC} {phase}"
            measurements.add(topic, "smg -> tether: close -> SGLang idle (s)", idle)
            measurements.add(topic, "smg -> SGLang: close -> SGLang idle (s)", alone_idle)
            if phase != "queued":
                measurements.add(topic, "smg -> tether: tokens after close", tokens)
                measurements.add(topic, "smg -> SGLang: tokens after close", alone_tokens)


def _streams(router: Smg, client_request_id: str) -> list[list[str]]:
    """Two concurrent short streams through `router` with one X-Request-Id; for each, the
    X-Request-Id answered followed by every chunk's `id`."""
    headers = {"X-Request-Id": client_request_id}
    return streams_side_by_side(router.port, CHAT_PATH, chat(100, True), headers, 3)


@pytest.mark.parametrize("stack", [DEFAULT.name], indirect=True)
def test_two_clients_with_one_id_stay_distinct_in_sglang(
    stack: Stack, router: Smg, log_dir: pathlib.Path, request: pytest.FixtureRequest
) -> None:
    """Two concurrent clients with the same X-Request-Id through smg → tether run in SGLang
    under two of tether's rids and each gets its ID back in the header and every chunk;
    through smg straight to SGLang they run under SGLang's random rids, and the chunks carry
    those instead of the client's ID."""
    mark = stack.sglang.log.mark()
    for answer in _streams(router, "smg-shared-id"):
        assert set(answer) == {"smg-shared-id"}, answer
    rids = received_rids(stack, mark)
    assert len(rids) == 2 == len(set(rids)) and all(INTERNAL_ID.match(r) for r in rids), rids

    with smg_process(stack.sglang.url, smg_log(log_dir, request, "sglang")) as straight:
        mark = stack.sglang.log.mark()
        answers = _streams(straight, "smg-shared-id")
    rids = received_rids(stack, mark)
    assert len(set(rids)) == 2, rids
    for answer in answers:
        assert answer[0] == "smg-shared-id"  # smg's header
        assert "smg-shared-id" not in answer[1:] and set(answer[1:]) <= set(rids), answer


@pytest.mark.parametrize("stack", [DEFAULT.name], indirect=True)
def test_router_discovers_and_health_checks_sglang_through_tether(
    stack: Stack, log_dir: pathlib.Path, request: pytest.FixtureRequest
) -> None:
    """smg with tether's port as its worker URL registers SGLang's model from `/v1/models`
    answered by SGLang through tether, and its `/health` checks (each one SGLang's
    `/health_generate`) pass through to SGLang; a chat routed by it comes back with the
    client's ID."""
    health_before = stack.tether.relayed("/health")
    log = smg_log(log_dir, request, "tether")
    with smg_process(stack.tether.url, log, *FAST_HEALTH_CHECKS) as router:
        status, body = http_get(router.url("/v1/models"))
        assert status == 200 and [m["id"] for m in json.loads(body)["data"]] == ["tiny"]
        status, body = http_get(router.url("/workers"))
        [worker] = json.loads(body)["workers"]
        assert worker["url"] == stack.tether.url and worker["is_healthy"], worker
        assert stack.tether.relayed("/v1/models") >= 1
        # smg checks every second here; SGLang answers each after >= 1 s.
        wait_until(lambda: stack.tether.relayed("/health") >= health_before + 2, 15, "smg's checks")
        with RawExchange(router.port, CHAT_PATH, chat(5, False), {"X-Request-Id": "smg-ok"}) as ex:
            assert ex.read_head() == 200
            assert json.loads(ex.body())["id"] == "smg-ok"


@pytest.mark.parametrize("stack", [DEFAULT.name], indirect=True)
def test_preserve_mode_keeps_the_id_smg_sends_and_aborts_by_it(
    stack: Stack,
    own_tether: Callable[[dict[str, str]], Tether],
    log_dir: pathlib.Path,
    request: pytest.FixtureRequest,
    measurements: Measurements,
) -> None:
    """With TETHER_REQUEST_ID_MODE=preserve SGLang runs the request under the ID smg passed on
    (the client's, a router-style UUID of fixed length) as its rid, and a client leaving is
    aborted by exactly that rid, confirmed."""
    preserving = own_tether({"TETHER_REQUEST_ID_MODE": "preserve"})
    with smg_process(preserving.url, smg_log(log_dir, request, "tether")) as router:
        client_request_id = uuid.uuid4().hex
        sglang_mark, tether_mark = stack.sglang.log.mark(), preserving.log.mark()
        exchange = RawExchange(
            router.port, CHAT_PATH, chat(LONG, True), {"X-Request-Id": client_request_id}
        )
        assert exchange.read_head() == 200
        assert {chunk["id"] for chunk in exchange.chunks(5)} == {client_request_id}
        assert received_rids(stack, sglang_mark) == [client_request_id]
        closed_at = exchange.close()
        wait_sglang_idle(stack)
        idle = time.monotonic() - closed_at
        wait_abort_logged(stack, sglang_mark, client_request_id)
        sent = preserving.log.wait_json(tether_mark, "abort_sent")
        assert sent["engine_request_ids"] == [client_request_id], sent
        assert sent["result"] == "confirmed", sent
        assert idle < PROMPTLY, idle
        measurements.add(f"{TOPIC} preserve", "smg -> tether: close -> SGLang idle (s)", idle)
