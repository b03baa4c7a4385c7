"""Abort truth on real SGLang 0.5.23: a client that leaves is aborted by tether's rid, tether
counts the abort `confirmed` only once SGLang's response ended (finish_reason "abort" then
[DONE], or the non-streaming answer with partial usage), and the tokens SGLang generated after
the close agree with tether's `tether_tokens_after_disconnect_total`."""

from __future__ import annotations

import pytest

from ..support.real_engine.measurements import Measurements
from ..support.waiting import wait_until
from .processes import Stack
from .scenarios import (
    CHAT_PATH,
    GENERATE_PATH,
    LONG,
    PROMPTLY,
    completion,
    on_default,
    request_for,
    sglang_load,
    sglang_metrics,
    tether_events,
    via_tether,
    wait_abort_logged,
    wait_load,
    wait_sglang_idle,
)

# The client reads this many events before it leaves (a few dozen tokens).
READ_BEFORE_LEAVING = 20


def _generated(stack: Stack) -> float:
    return sglang_metrics(stack).value("sglang:generation_tokens_total")


def _tokens_after(stack: Stack, route: str) -> float:
    return stack.tether.metrics().value("tether_tokens_after_disconnect_total", route=route)


def _relayed(stack: Stack, route: str) -> float:
    return stack.tether.metrics().value("tether_tokens_relayed_total", route=route)


def _abort_line(stack: Stack, mark: int, client_request_id: str) -> dict[str, object]:
    found: list[dict[str, object]] = []

    def logged() -> bool:
        found[:] = [
            entry
            for entry in tether_events(stack.tether, mark, "abort_sent")
            if entry.get("client_request_id") == client_request_id
        ]
        return bool(found)

    wait_until(logged, 10, f"tether's abort_sent line for {client_request_id}")
    return found[0]


@on_default
@pytest.mark.parametrize(
    ("path", "usage"),
    [(CHAT_PATH, True), (GENERATE_PATH, False), (CHAT_PATH, False)],
    ids=["chat-usage", "generate", "chat-events"],
)
def test_streaming_abort_is_confirmed_and_its_waste_counted(
    stack: Stack, path: str, usage: bool, measurements: Measurements
) -> None:
    """A streaming client leaves: tether's abort names its rid, SGLang logs that abort, the
    stream ends at SGLang (confirmed) within a moment, and what SGLang generated for it is
    what tether relayed before the close plus what it counted after: exactly where SGLang
    reports the count (chat with usage, /generate's meta_info); a lower bound where tether
    counts events, because SGLang coalesces tokens into one event when its HTTP handler falls
    behind."""
    client_request_id = f"truth-{path.strip('/').replace('/', '-')}-{usage}"
    extra = {"stream_options": {"include_usage": True}} if usage else {}
    wait_sglang_idle(stack)  # SGLang counts a request's tokens when it finishes
    tether_mark, sglang_mark = stack.tether.log.mark(), stack.sglang.log.mark()
    generated_before = _generated(stack)
    after_before, relayed_before = _tokens_after(stack, path), _relayed(stack, path)
    payload = request_for(path, LONG, stream=True, **extra)
    exchange = via_tether(stack, client_request_id, path, payload)
    assert exchange.read_head() == 200
    received = len(exchange.chunks(READ_BEFORE_LEAVING))
    internal = stack.tether.wait_in_flight(client_request_id)["internal_request_id"]
    exchange.close()

    line = _abort_line(stack, tether_mark, client_request_id)
    idle_after = wait_sglang_idle(stack)
    wait_abort_logged(stack, sglang_mark, str(internal))
    assert line["result"] == "confirmed"
    assert line["engine_request_ids"] == [internal]
    assert idle_after < PROMPTLY
    counted = _tokens_after(stack, path) - after_before
    relayed = _relayed(stack, path) - relayed_before
    generated = _generated(stack) - generated_before
    case = f"{path}{' (usage)' if usage else ''}"
    measurements.add("sglang abort truth", f"{case}: SGLang generated", generated)
    measurements.add("sglang abort truth", f"{case}: tether relayed", relayed)
    measurements.add("sglang abort truth", f"{case}: tether after disconnect", counted)
    measurements.add(
        "sglang abort truth", f"{case}: engine stop (ms)", float(str(line["engine_stop_ms"]))
    )
    # Every token SGLang made was either relayed before the close or counted after it (the
    # client read `received` events of the relayed ones; the rest were in its socket buffer).
    assert relayed >= received - 1
    if path == GENERATE_PATH or usage:
        assert abs(relayed + counted - generated) <= 1, (relayed, counted, generated)
    else:
        assert 0 < relayed + counted <= generated + 1, (relayed, counted, generated)


@on_default
def test_non_streaming_abort_is_confirmed_by_the_partial_answer(
    stack: Stack, measurements: Measurements
) -> None:
    """A non-streaming client leaves while SGLang generates (SGLang alone notices only at its
    4 s poll): tether's abort ends it at once, SGLang answers with finish_reason "abort" and
    partial usage, which tether counts whole as waste."""
    wait_sglang_idle(stack)
    tether_mark = stack.tether.log.mark()
    generated_before = _generated(stack)
    after_before = _tokens_after(stack, CHAT_PATH)
    exchange = via_tether(stack, "truth-plain", CHAT_PATH, request_for(CHAT_PATH, LONG, False))
    stack.tether.wait_in_flight("truth-plain")
    # SGLang counts generated tokens when a request finishes; its KV cache in use shows them
    # while it runs.
    wait_load(stack, "the request to run", lambda load: load.running == 1)
    prompt = sglang_load(stack).used_tokens
    wait_load(stack, "SGLang to generate", lambda load: load.used_tokens >= prompt + 30)
    exchange.close()

    line = _abort_line(stack, tether_mark, "truth-plain")
    assert wait_sglang_idle(stack) < PROMPTLY
    assert line["result"] == "confirmed"
    counted = _tokens_after(stack, CHAT_PATH) - after_before
    generated = _generated(stack) - generated_before
    measurements.add("sglang abort truth", "non-streaming: tether counted / SGLang made", counted)
    assert abs(counted - generated) <= 2, (counted, generated)


@on_default
@pytest.mark.parametrize("path", [GENERATE_PATH, "/v1/completions"])
def test_batch_abort_names_every_item(stack: Stack, path: str) -> None:
    """A list of prompts runs in SGLang as `<rid>_0`, `<rid>_1`, and `/abort_request` ignores
    the batch's bare `<rid>`: tether names each item, SGLang aborts both at once and the
    abort is confirmed (not left to SGLang's own 4 s poll of the dropped connection)."""
    wait_sglang_idle(stack)
    tether_mark, sglang_mark = stack.tether.log.mark(), stack.sglang.log.mark()
    prompts = ["Once upon a time", "Long ago"]
    if path == GENERATE_PATH:
        payload = request_for(path, LONG, stream=True, text=prompts)
    else:
        payload = {**completion(LONG, stream=True), "prompt": prompts}
    client_request_id = f"batch{path.replace('/', '-')}"
    exchange = via_tether(stack, client_request_id, path, payload)
    assert exchange.read_head() == 200
    exchange.chunks(4)
    internal = stack.tether.wait_in_flight(client_request_id)["internal_request_id"]
    exchange.close()

    line = _abort_line(stack, tether_mark, client_request_id)
    assert line["engine_request_ids"] == [f"{internal}_0", f"{internal}_1"]
    for item in line["engine_request_ids"]:
        wait_abort_logged(stack, sglang_mark, str(item))
    assert line["result"] == "confirmed", line
    assert wait_sglang_idle(stack) < PROMPTLY
