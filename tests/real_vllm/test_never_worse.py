"""Never worse than no tether: clients leave at random, one at a time, through tether and
straight to vLLM, interleaved, on every topology a user runs: the default server (no abort
route), dev mode, dev mode with two API-server processes (vLLM's default for a pod serving
two data-parallel ranks, where an abort reaching the other process matches nothing), and
a user middleware. For each, how long from the client's close to vLLM running nothing, and
how many tokens vLLM generated after the close, straight and through tether."""

from __future__ import annotations

import math
import random
import re
import time
from dataclasses import dataclass, field

import pytest

from proxy.engines.vllm import CONFIRM as VLLM_CONFIRM

from ..support.raw_http import RawExchange
from ..support.real_engine.measurements import Measurements
from ..support.waiting import wait_until
from .processes import DEFAULT, DEV_MODE, DEV_MODE_TWO_API_SERVERS, WITH_MIDDLEWARE, Stack
from .scenarios import CHAT_PATH, LONG, MIDDLEWARE_LAG, chat, generated_when_settled, vllm_metrics

SEED = 19
# A stop vLLM has not made by then is tether's failure to stop it, not a slow measurement.
GIVE_UP = 10.0
# vLLM alone, on this machine: idle 0.02-0.03 s after a close; through tether the bound of
# the issue (every request idle within 0.3 s of its client's close).
IDLE_WITHIN = 0.3
# Besides the confirm window itself, what a stop that waited for it may take: the call's way
# there and back, the step in progress when the window closes, and a timer firing late on a
# loaded 2-core machine (a miss was seen cost 23 tokens at ~3.6 ms a token, 16 + 5 + 2).
WINDOW_SLACK = 0.025


@dataclass
class Departures:
    """Per way of reaching vLLM: seconds from each close to vLLM idle, tokens after it."""

    idle: dict[str, list[float]] = field(default_factory=dict)
    tokens: dict[str, list[float]] = field(default_factory=dict)

    def add(self, way: str, idle: float, tokens: float) -> None:
        self.idle.setdefault(way, []).append(idle)
        self.tokens.setdefault(way, []).append(tokens)


def _generated(stack: Stack) -> float:
    """vLLM's generated tokens (with several API-server processes, each counts its own)."""
    return vllm_metrics(stack).value("vllm:generation_tokens_total")


def _token_latency(stack: Stack) -> tuple[float, float]:
    """vLLM's inter-token latencies so far: their sum (s) and how many."""
    metrics = vllm_metrics(stack)
    return (
        metrics.value("vllm:inter_token_latency_seconds_sum"),
        metrics.value("vllm:inter_token_latency_seconds_count"),
    )


def _window_tokens(stack: Stack, since: tuple[float, float]) -> int:
    """What one confirm window (vLLM's floor, 50 ms, and its slack) costs in tokens at the
    pace vLLM made them during the test, on this machine (a stream's tokens come slower than
    a non-streaming request's, vLLM writing each): a bound in tokens taken from another
    machine's pace, or from the other mode's, fails on a faster one."""
    seconds, count = (now - then for now, then in zip(_token_latency(stack), since, strict=True))
    assert count > 0, "vLLM generated no tokens during the test"
    return math.ceil((VLLM_CONFIRM.floor + WINDOW_SLACK) / (seconds / count))


def _running(stack: Stack) -> float:
    metrics = vllm_metrics(stack)
    return metrics.value("vllm:num_requests_running") + metrics.value("vllm:num_requests_waiting")


def _leave(
    stack: Stack, port: int, request_id: str, stream: bool, rng: random.Random
) -> tuple[float, float]:
    """A client that leaves at a random point: a stream after 1-8 events, a non-streaming
    request 0.05-0.5 s after vLLM started running it. Returns (seconds from the close to the
    moment the API-server process that holds the request aborted it, by vLLM's own log;
    tokens vLLM generated after the close)."""
    mark = stack.vllm.log.mark()
    exchange = RawExchange(port, CHAT_PATH, chat(LONG, stream), {"X-Request-Id": request_id})
    if stream:
        assert exchange.read_head() == 200
        exchange.chunks(rng.randint(1, 8))
    else:
        wait_until(lambda: _running(stack) >= 1, 10, "vLLM to run the request", 0.005)
        time.sleep(rng.uniform(0.05, 0.5))  # the client's patience: the scenario, not a wait
    engine_id = request_id
    if port == stack.tether.port:
        engine_id = stack.tether.wait_in_flight(request_id)["internal_request_id"]
    before = _generated(stack)
    closed_at = time.time()
    exchange.close()
    stopped = _stopped_at(stack, mark, f"chatcmpl-{engine_id}")
    return stopped - closed_at, generated_when_settled(stack) - before


def _stopped_at(stack: Stack, mark: int, engine_id: str) -> float:
    """When (epoch seconds, vLLM's own log) the API-server process that received the
    request aborted it: `Aborted request(s) <id>` (by the abort route, as named, or after a
    dropped connection, with vLLM's internal suffix) or `Request <id> aborted.`. Another
    process logs an abort it was asked for too, matching nothing: only the owner counts."""
    received = stack.vllm.log.wait_for(mark, rf"pid=(\d+)\).*Received request {engine_id}:")
    owner = received.group(1)
    stopped = stack.vllm.log.wait_for(
        mark,
        rf"^t=(\d+\.\d+) \(\w+ pid={owner}\) .*(?:Aborted request\(s\) [^\n]*{engine_id}"
        rf"(?:-[0-9a-f]{{8}})?\.|Request {engine_id} aborted\.)$",
        timeout=GIVE_UP,
    )
    return float(stopped.group(1))


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


def _record(measurements: Measurements, topic: str, departures: Departures) -> None:
    for way, values in departures.idle.items():
        for q, name in ((0.5, "p50"), (0.99, "p99"), (1.0, "max")):
            measurements.add(
                topic, f"{way}: close -> vLLM aborts it {name} (s)", _quantile(values, q)
            )
        tokens = departures.tokens[way]
        measurements.add(topic, f"{way}: tokens after the close, mean", sum(tokens) / len(tokens))
        measurements.add(topic, f"{way}: tokens after the close, max", max(tokens))


@pytest.mark.parametrize(
    ("stack", "leavers"),
    [
        (DEFAULT.name, 10),
        pytest.param(WITH_MIDDLEWARE.name, 10, marks=MIDDLEWARE_LAG),
        (DEV_MODE.name, 10),
        (DEV_MODE_TWO_API_SERVERS.name, 20),
    ],
    indirect=["stack"],
)
@pytest.mark.parametrize("stream", [True, False], ids=["streaming", "non-streaming"])
def test_a_client_leaving_through_tether_stops_vllm_as_fast_as_a_direct_close(
    stack: Stack, measurements: Measurements, leavers: int, stream: bool
) -> None:
    """Leavers one at a time, through tether and straight to vLLM in turn: through tether
    vLLM aborts every one within 0.3 s of its close and generates no more after it than after
    the worst direct close plus one step, but for at most three leavers (the two misses that
    show the pattern of a front end with several processes, and a stop that still waits to
    confirm), which pay at most one confirm window more; tether confirms no abort vLLM did
    not act on."""
    rng = random.Random(SEED)
    departures = Departures()
    mark, vllm_mark = stack.tether.log.mark(), stack.vllm.log.mark()
    wait_until(lambda: _running(stack) == 0, GIVE_UP, "vLLM to be idle before the test")
    pace_since = _token_latency(stack)
    for index in range(leavers):
        for way, port in (("via tether", stack.tether.port), ("straight", stack.vllm.port)):
            idle, tokens = _leave(stack, port, f"leave-{way[0]}-{index}", stream, rng)
            departures.add(way, idle, tokens)
    window_tokens = _window_tokens(stack, pace_since)
    topic = f"never worse {stack.name} {'streaming' if stream else 'non-streaming'}"
    _record(measurements, topic, departures)
    measurements.add(topic, "one confirm window (tokens)", window_tokens)

    via, straight = departures.idle["via tether"], departures.idle["straight"]
    assert max(via) < IDLE_WITHIN, (via, straight)
    tokens_via, tokens_straight = departures.tokens["via tether"], departures.tokens["straight"]
    # A close through tether wastes what a direct one does, plus one step; only the misses
    # that show the pattern (two) and the stop in sixteen that still waits to confirm may
    # cost one confirm window more.
    costly = [tokens for tokens in tokens_via if tokens > max(tokens_straight) + 1]
    assert len(costly) <= 3, departures.tokens
    assert max(tokens_via) <= max(tokens_straight) + window_tokens, (window_tokens, departures)
    sent = stack.tether.log.json_lines(mark, "abort_sent")
    if not stack.vllm.config.dev_mode:
        assert sent == []  # no abort route: every stop was the dropped connection
        return
    assert {line["result"] for line in sent} <= {"confirmed", "unconfirmed", "dropped"}, sent
    if stack.vllm.config.api_servers == 1:
        assert {line["result"] for line in sent} == {"confirmed"}, sent
    # `confirmed` only where the API-server process that holds the request aborted it by
    # its route (logging the ID as tether sent it); a stop by the dropped connection logs
    # vLLM's internal form, `<id>-<8 hex>`.
    log = stack.vllm.log.text_since(vllm_mark)
    owner = dict(
        (found, pid)
        for pid, found in re.findall(r"pid=(\d+)\).*Received request chatcmpl-(\w{32}):", log)
    )
    by_route = set(re.findall(r"pid=(\d+)\).*Aborted request\(s\) chatcmpl-(\w{32})\.$", log, re.M))
    for line in sent:
        if line["result"] == "confirmed":
            internal = line["internal_request_id"]
            assert (owner[internal], internal) in by_route, line
