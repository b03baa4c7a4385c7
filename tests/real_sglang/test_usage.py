"""Exact usage on real SGLang 0.5.23: a stream whose client did not ask for usage is SGLang's
own bytes through tether (which asks, and takes the usage event out); over a run of 100
streaming clients, about half of which leave (before the first token or mid-stream), tether's
request lines add up to what SGLang counted itself: completion tokens to its
`generation_tokens_total` delta, prompt tokens to its `prompt_tokens_total` delta. tether asks
for the usage the clients did not, and reads each aborted stream to its end, where SGLang
reports it."""

from __future__ import annotations

import random
import re
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import pytest

from ..support.real_engine.measurements import Measurements
from ..support.waiting import wait_until
from .processes import Stack
from .scenarios import (
    CHAT_PATH,
    COMPLETIONS_PATH,
    chat,
    completion,
    direct,
    on_admin_key,
    received_rids,
    sglang_metrics,
    via_tether,
    wait_sglang_idle,
)

REQUESTS = 100
CONCURRENCY = 8
SEED = 23


@dataclass(frozen=True)
class Client:
    """One client of the run: what it asks and when it leaves (None: it reads to the end;
    0: before the first event)."""

    client_request_id: str
    path: str
    max_tokens: int
    leave_after: int | None

    def body(self) -> dict[str, Any]:
        build = chat if self.path == CHAT_PATH else completion
        return build(self.max_tokens, stream=True)


def _clients(rng: random.Random) -> list[Client]:
    clients = []
    for index in range(REQUESTS):
        path = rng.choice((CHAT_PATH, COMPLETIONS_PATH))
        max_tokens = rng.randint(48, 160)
        draw = rng.random()
        leave_after = None if draw < 0.5 else 0 if draw < 0.62 else rng.randint(1, max_tokens - 20)
        clients.append(Client(f"usage-{index}", path, max_tokens, leave_after))
    return clients


def _run(stack: Stack, client: Client) -> None:
    with via_tether(stack, client.client_request_id, client.path, client.body()) as exchange:
        if client.leave_after == 0:
            return  # sent, and gone before anything came back
        assert exchange.read_head() == 200
        for read, _ in enumerate(exchange.events(), start=1):
            if read == client.leave_after:
                return


@on_admin_key
def test_tethers_usage_of_a_hundred_clients_half_of_them_leaving_is_sglangs_own(
    stack: Stack, measurements: Measurements, capsys: pytest.CaptureFixture[str]
) -> None:
    """Every request line of a request SGLang received is counted from its usage, and the
    sums are SGLang's deltas."""
    clients = _clients(random.Random(SEED))
    wait_sglang_idle(stack)  # SGLang counts a request's tokens when it finishes
    before = sglang_metrics(stack)
    mark, sglang_mark = stack.tether.log.mark(), stack.sglang.log.mark()
    started = time.monotonic()
    with ThreadPoolExecutor(max_workers=CONCURRENCY, thread_name_prefix="client") as pool:
        list(pool.map(lambda client: _run(stack, client), clients))
    ran = time.monotonic() - started
    ours = {client.client_request_id for client in clients}

    def lines() -> dict[str, dict[str, Any]]:
        return {
            str(line["client_request_id"]): line
            for line in stack.tether.log.json_lines(mark, "request_finished")
            if line.get("client_request_id") in ours
        }

    # A leaver's line is written once tether's stop of it ended (SGLang's stream ended).
    wait_until(lambda: len(lines()) == REQUESTS, 15, "tether's line for every request")
    wait_sglang_idle(stack)
    after = sglang_metrics(stack)
    finished = lines()
    generated = after.value("sglang:generation_tokens_total") - before.value(
        "sglang:generation_tokens_total"
    )
    prompted = after.value("sglang:prompt_tokens_total") - before.value(
        "sglang:prompt_tokens_total"
    )
    completion_total = sum(int(line.get("completion_tokens", 0)) for line in finished.values())
    prompt_total = sum(int(line.get("prompt_tokens", 0)) for line in finished.values())
    # A client that closed while tether was still sending its body: dropped before SGLang had
    # a whole request, so nothing to count (and nothing SGLang received).
    received = set(received_rids(stack, sglang_mark))
    by_events = sorted(
        name
        for name, line in finished.items()
        if line.get("tokens_counted") != "engine" and line["internal_request_id"] in received
    )
    never_sent = sum(1 for line in finished.values() if line["internal_request_id"] not in received)
    leavers = sum(1 for client in clients if client.leave_after is not None)
    rows = [
        (f"clients that left (of {REQUESTS})", leavers),
        ("run time (s)", ran),
        ("SGLang generated tokens", generated),
        ("completion tokens, sum of tether's request lines", completion_total),
        ("SGLang prompt tokens", prompted),
        ("prompt tokens, sum of tether's request lines", prompt_total),
        ("requests dropped before SGLang had them whole", never_sent),
        ("request lines of the others counted from events", len(by_events)),
    ]
    topic = f"usage sglang {stack.name}"
    with capsys.disabled():
        print(f"\n{topic}: {REQUESTS} streams, concurrency {CONCURRENCY}")
        for name, value in rows:
            measurements.add(topic, name, value)
            print(f"  {name:<50} {value:>10.3f}")

    assert not by_events, by_events
    assert completion_total == generated, (completion_total, generated)
    assert prompt_total == prompted, (prompt_total, prompted)


_TEXT = re.compile(rb'"(content|text)":"((?:[^"\\]|\\.)*)"')


def _normalised(stream: bytes) -> tuple[bytes, list[bytes]]:
    """A stream up to what differs between two runs of one request: its ID, its creation time
    and where SGLang cut the text into events (tokens it merges into one event when its HTTP
    handler falls behind). The whole text, and the events with their text taken out, runs of
    equal ones as one."""
    stream = re.sub(rb'"id":"[^"]*"', b'"id":"-"', stream)
    stream = re.sub(rb'"created":\d+', b'"created":0', stream)
    text = b"".join(match.group(2) for match in _TEXT.finditer(stream))
    shapes: list[bytes] = []
    for event in stream.split(b"\n\n"):
        shape = _TEXT.sub(rb'"\1":"-"', event)
        if not shapes or shapes[-1] != shape:
            shapes.append(shape)
    return text, shapes


@on_admin_key
@pytest.mark.parametrize("path", [CHAT_PATH, COMPLETIONS_PATH], ids=["chat", "completions"])
def test_a_stream_without_usage_asked_is_sglangs_own_bytes(stack: Stack, path: str) -> None:
    """Same request through tether and straight: the same bytes but for ID, creation time and
    SGLang's own cuts between events (its chunks say `"usage":null` both ways, no usage event
    reaches the client); tether's line has SGLang's usage."""
    body = {**(chat if path == CHAT_PATH else completion)(12, stream=True), "temperature": 0}
    mark = stack.tether.log.mark()
    exchange = via_tether(stack, f"bytes-{path[4:]}", path, body)
    assert exchange.read_head() == 200
    through = exchange.body()
    exchange = direct(stack, path, body)
    assert exchange.read_head() == 200
    straight = exchange.body()

    assert b'"usage":{' not in straight
    assert _normalised(through) == _normalised(straight)
    line = stack.tether.log.wait_json(
        mark, "request_finished", client_request_id=f"bytes-{path[4:]}"
    )
    assert (line["tokens_counted"], line["completion_tokens"]) == ("engine", 12)
    assert line["prompt_tokens"] > 0
