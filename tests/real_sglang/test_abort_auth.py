"""tether's abort call against SGLang's auth: accepted with the right key (admin key, or the
API key when SGLang has only that), counted `failed` with a wrong one, and the dropped
connection still stops streaming work."""

from __future__ import annotations

import time
from collections.abc import Callable

from ..support.raw_http import RawExchange
from ..support.real_engine.measurements import Measurements
from ..support.real_engine.tether import Tether
from ..support.waiting import wait_until
from .processes import Stack
from .scenarios import (
    CHAT_PATH,
    LONG,
    PROMPTLY,
    aborts,
    chat,
    on_admin_key,
    on_api_key,
    tether_events,
    via_tether,
    wait_abort_logged,
    wait_load,
    wait_sglang_idle,
)

ABORT_ACCEPTED = r'"POST /abort_request HTTP/1\.1" 200'
ABORT_REFUSED = r'"POST /abort_request HTTP/1\.1" 401'
# tether's TETHER_ABORT_DEADLINE (5 s) and some room: when a failed abort must be counted.
ABORT_DEADLINE = 8.0


def _leave_non_streaming(stack: Stack, client_request_id: str) -> tuple[str, float]:
    """A non-streaming request left while SGLang runs it (SGLang alone notices after ~4 s);
    tether's rid and the seconds from the close until SGLang runs nothing."""
    exchange = via_tether(stack, client_request_id, CHAT_PATH, chat(LONG, stream=False))
    internal_request_id = stack.tether.wait_in_flight(client_request_id)["internal_request_id"]
    wait_load(stack, "SGLang to run the request", lambda load: load.running >= 1)
    closed_at = exchange.close()
    wait_sglang_idle(stack)
    return internal_request_id, time.monotonic() - closed_at


def _abort_accepted(stack: Stack, client_request_id: str, measurements: Measurements) -> None:
    mark = stack.sglang.log.mark()
    failed_before, all_before = aborts(stack.tether, "failed"), aborts(stack.tether)
    internal_request_id, elapsed = _leave_non_streaming(stack, client_request_id)
    wait_abort_logged(stack, mark, internal_request_id)
    stack.sglang.log.wait_for(mark, ABORT_ACCEPTED)
    wait_until(lambda: aborts(stack.tether) > all_before, 5, "tether to count its abort")
    assert aborts(stack.tether, "failed") == failed_before
    assert elapsed < PROMPTLY
    measurements.add(
        "abort auth", f"{stack.sglang.config.name}: non-streaming close -> SGLang idle (s)", elapsed
    )


@on_admin_key
def test_admin_key_abort_is_accepted(stack: Stack, measurements: Measurements) -> None:
    """With `--admin-api-key K` and TETHER_UPSTREAM_ADMIN_KEY=K, SGLang accepts tether's abort
    and stops a non-streaming request whose client left at once."""
    _abort_accepted(stack, "admin-keyed-1", measurements)


@on_admin_key
def test_wrong_admin_key_counts_failed_and_the_drop_still_stops_streams(
    stack: Stack, own_tether: Callable[[dict[str, str]], Tether], measurements: Measurements
) -> None:
    """With a wrong admin key SGLang refuses the abort (401): tether counts it failed and logs
    it once, and its dropped connection still stops a stream within a second."""
    tether = own_tether({"TETHER_UPSTREAM_ADMIN_KEY": "not-the-admin-key"})
    sglang_mark, tether_mark = stack.sglang.log.mark(), tether.log.mark()
    exchange = via_tether(stack, "wrong-key-1", CHAT_PATH, chat(LONG, stream=True), tether)
    assert exchange.read_head() == 200
    exchange.chunks(10)
    internal_request_id = tether.wait_in_flight("wrong-key-1")["internal_request_id"]
    closed_at = exchange.close()
    wait_sglang_idle(stack)
    elapsed = time.monotonic() - closed_at
    stack.sglang.log.wait_for(sglang_mark, ABORT_REFUSED)
    wait_until(lambda: aborts(tether, "failed") == 1, ABORT_DEADLINE, "a failed abort")
    failures = [
        entry
        for entry in tether_events(tether, tether_mark, "abort_failed")
        if entry.get("internal_request_id") == internal_request_id
    ]
    assert len(failures) == 1, failures
    assert aborts(tether) == 1
    # SGLang stopped it itself, on the dropped connection.
    wait_abort_logged(stack, sglang_mark, internal_request_id)
    assert elapsed < PROMPTLY
    measurements.add("abort auth", "wrong admin key: stream close -> SGLang idle (s)", elapsed)


@on_api_key
def test_api_key_passes_through_tether(stack: Stack) -> None:
    """With `--api-key`, the client's Authorization header reaches SGLang through tether: with
    it the request runs, without it SGLang answers 401."""
    with via_tether(stack, "api-key-1", CHAT_PATH, chat(4, stream=False)) as exchange:
        assert exchange.read_head() == 200
    without_key = {"X-Request-Id": "api-key-2"}
    with RawExchange(stack.tether.port, CHAT_PATH, chat(4, stream=False), without_key) as ex:
        assert ex.read_head() == 401


@on_api_key
def test_api_key_abort_is_accepted(stack: Stack, measurements: Measurements) -> None:
    """With only `--api-key`, SGLang's abort route wants that key: tether holding it as
    TETHER_UPSTREAM_ADMIN_KEY gets its abort accepted and the request stopped at once."""
    _abort_accepted(stack, "api-keyed-1", measurements)
