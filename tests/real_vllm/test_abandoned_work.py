"""The closing measurement: 100 streaming clients, about half of which leave at a random
point, through tether to the real vLLM, with its abort route (dev mode) and without it
(default). How many tokens reach clients, how many vLLM generates for nobody, and how soon
it stops."""

from __future__ import annotations

import math
import re
import time
from dataclasses import dataclass
from typing import Any

import pytest

from ..support.metrics import MetricsSnapshot, histogram_quantile
from ..support.real_engine.measurements import Measurements
from ..support.waiting import wait_until
from .processes import DEV_MODE, Stack
from .scenarios import on_default_and_dev, tether_metrics, vllm_load, vllm_metrics
from .workload import Departure, Fate, mixed_plans, run_mixed

REQUESTS = 100
CONCURRENCY = 8
SEED = 11
# Every stop ends within TETHER_ABORT_CONFIRM_TIMEOUT (2 s) of its disconnect: tether then
# drops the connection, the engine's other signal.
CONFIRM_TIMEOUT = 2.0
# A leaver vLLM ran past this was not stopped by tether (a request of 320 tokens takes ~2 s
# at this concurrency, so one that ran to its end shows).
STOPPED_WITHIN = CONFIRM_TIMEOUT + 1.0
_LOG_TIME = r"^t=(\d+\.\d+) "


@dataclass(frozen=True)
class VllmTimeline:
    """When vLLM's log says it received and aborted each of tether's internal IDs."""

    received: dict[str, float]
    aborted: dict[str, list[float]]
    added: dict[str, float]  # when vLLM registered it (`Added request`), after receiving it

    def stopped_at(self, internal_request_id: str) -> float | None:
        """vLLM's first abort of the request after it received it (an abort can arrive
        before the request it names, and then matches nothing)."""
        start = self.received.get(internal_request_id)
        if start is None:
            return None
        after = [t for t in self.aborted.get(internal_request_id, []) if t >= start]
        return after[0] if after else None

    def overtaken(self, internal_request_id: str) -> bool:
        """Whether tether's first abort reached vLLM between its receiving the request and
        registering it: the abort matched nothing (tether's repeats then follow)."""
        aborts = self.aborted.get(internal_request_id, [])
        added = self.added.get(internal_request_id)
        return added is not None and bool(aborts) and aborts[0] < added


def _timeline(stack: Stack, mark: int) -> VllmTimeline:
    received: dict[str, float] = {}
    aborted: dict[str, list[float]] = {}
    added: dict[str, float] = {}
    text = stack.vllm.log.text_since(mark)
    for match in re.finditer(_LOG_TIME + r".*Received request (\S+): ", text, re.MULTILINE):
        found = re.search(r"[0-9a-f]{32}", match.group(2))
        if found:
            received.setdefault(found.group(0), float(match.group(1)))
    for match in re.finditer(_LOG_TIME + r".*Aborted request\(s\) (\S+)\.$", text, re.MULTILINE):
        for found in re.finditer(r"[0-9a-f]{32}", match.group(2)):
            aborted.setdefault(found.group(0), []).append(float(match.group(1)))
    for match in re.finditer(_LOG_TIME + r".*Added request (\S+)\.$", text, re.MULTILINE):
        found = re.search(r"[0-9a-f]{32}", match.group(2))
        if found:
            added.setdefault(found.group(0), float(match.group(1)))
    return VllmTimeline(received, aborted, added)


def _quantile(values: list[float], q: float) -> float:
    """Nearest-rank quantile (NaN with none)."""
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


def _finished(stack: Stack, mark: int) -> dict[str, dict[str, Any]]:
    """tether's request_finished lines since `mark`, by client ID."""
    return {
        str(line["client_request_id"]): line
        for line in stack.tether.log.json_lines(mark, "request_finished")
    }


def _delta(before: MetricsSnapshot, after: MetricsSnapshot, name: str, **labels: str) -> float:
    return after.value(name, **labels) - before.value(name, **labels)


@on_default_and_dev
def test_abandoned_work_of_a_hundred_clients(
    stack: Stack, measurements: Measurements, capsys: pytest.CaptureFixture[str]
) -> None:
    """100 streams, half of them abandoned: every leaver that reached vLLM is stopped, vLLM
    ends idle, and the waste, token counts and stop latencies are recorded."""
    mode = stack.vllm.config.name
    dev_mode = stack.vllm.config is DEV_MODE
    plans = mixed_plans(f"abandon-{mode}", REQUESTS, SEED)
    vllm_before, tether_before = vllm_metrics(stack), tether_metrics(stack)
    vllm_mark, tether_mark = stack.vllm.log.mark(), stack.tether.log.mark()
    started = time.monotonic()
    departures = run_mixed(stack, plans, CONCURRENCY)
    ran = time.monotonic() - started
    run_ended = time.monotonic()
    idle_after = wait_until(lambda: vllm_load(stack) == 0, 30, "vLLM to run nothing")
    leavers = [d for d in departures if d.left]
    ours = {plan.client_request_id for plan in plans}
    wait_until(
        lambda: len(_finished(stack, tether_mark).keys() & ours) == REQUESTS,
        10,
        "tether to finish every request",
    )
    finished = _finished(stack, tether_mark)
    # Each stop ends by the confirm timeout after its disconnect, and tether's counts are
    # final once every stop has: wait for them all, but no longer than tether may take.
    contacted = sum(
        1
        for line in stack.tether.log.json_lines(tether_mark, "client_disconnected")
        if line.get("client_request_id") in ours and line.get("upstream_contacted")
    )
    settle_by = run_ended + CONFIRM_TIMEOUT + 1.0

    def settled() -> bool:
        counted = _delta(tether_before, tether_metrics(stack), "tether_aborts_total")
        return counted >= contacted or time.monotonic() > settle_by

    wait_until(settled, CONFIRM_TIMEOUT + 5, "tether's stops to end")
    stops = stack.tether.log.json_lines(tether_mark, "abort_sent")
    vllm_after, tether_after = vllm_metrics(stack), tether_metrics(stack)
    timeline = _timeline(stack, vllm_mark)

    generated = _delta(vllm_before, vllm_after, "vllm:generation_tokens_total")
    prompted = _delta(vllm_before, vllm_after, "vllm:prompt_tokens_total")
    # What tether's request lines say each request used (the engine's usage where it had it).
    lines = [finished[plan.client_request_id] for plan in plans]
    completion_total = sum(int(line.get("completion_tokens", 0)) for line in lines)
    prompt_total = sum(int(line.get("prompt_tokens", 0)) for line in lines)
    counted_by_engine = sum(1 for line in lines if line.get("tokens_counted") == "engine")
    relayed = _delta(tether_before, tether_after, "tether_tokens_relayed_total")
    after_disconnect = _delta(tether_before, tether_after, "tether_tokens_after_disconnect_total")
    received = sum(d.tokens for d in departures)
    results = {
        result: _delta(tether_before, tether_after, "tether_aborts_total", result=result)
        for result in ("confirmed", "unconfirmed", "not_supported", "unknown_route", "failed")
    }
    reached: list[tuple[Departure, str]] = []
    never_reached = 0
    for departure in leavers:
        internal = finished[departure.plan.client_request_id]["internal_request_id"]
        if internal in timeline.received:
            reached.append((departure, internal))
        else:
            never_reached += 1
    stop_latencies: list[float] = []
    not_stopped: list[str] = []
    for departure, internal in reached:
        stopped = timeline.stopped_at(internal)
        assert departure.closed_at is not None
        if stopped is None or stopped - departure.closed_at > STOPPED_WITHIN:
            not_stopped.append(f"{departure.plan} ({internal}): vLLM aborted it at {stopped}")
        else:
            stop_latencies.append(stopped - departure.closed_at)
    completers = [d for d in departures if not d.left]
    finished_by_length = _delta(
        vllm_before, vllm_after, "vllm:request_success_total", finished_reason="length"
    )
    tether_stop_ms = [line["engine_stop_ms"] / 1000 for line in stops if "engine_stop_ms" in line]

    rows: list[tuple[str, float]] = [
        (f"clients that left (of {REQUESTS})", len(leavers)),
        (
            "  left before the first token",
            sum(d.plan.fate is Fate.LEAVES_BEFORE_FIRST_TOKEN for d in departures),
        ),
        ("  leavers whose request never reached vLLM", never_reached),
        ("run time (s)", ran),
        ("vLLM generated tokens", generated),
        ("tokens relayed (tether)", relayed),
        ("tokens received (clients)", received),
        ("waste: vLLM generated - tokens relayed", generated - relayed),
        ("waste: vLLM generated - tokens received", generated - received),
        ("tokens after disconnect (tether)", after_disconnect),
        ("completion tokens, sum of tether's request lines", completion_total),
        ("prompt tokens, sum of tether's request lines", prompt_total),
        ("vLLM prompt tokens", prompted),
        ("request lines counted from the engine's usage", counted_by_engine),
        ("close -> vLLM aborts it, p50 (s, vLLM log)", _quantile(stop_latencies, 0.5)),
        ("close -> vLLM aborts it, p99 (s, vLLM log)", _quantile(stop_latencies, 0.99)),
        ("close -> vLLM aborts it, max (s, vLLM log)", max(stop_latencies, default=math.nan)),
        ("last client done -> vLLM idle (s, /metrics)", idle_after),
    ]
    if dev_mode:
        by_client = {line["client_request_id"]: line for line in stops}
        rows += [
            (
                f"  tokens after disconnect: clients that {fate.value.replace('leaves', 'left')}",
                sum(
                    by_client[d.plan.client_request_id].get("tokens_after_disconnect", 0)
                    for d in leavers
                    if d.plan.fate is fate and d.plan.client_request_id in by_client
                ),
            )
            for fate in (Fate.LEAVES_BEFORE_FIRST_TOKEN, Fate.LEAVES_MID_STREAM)
        ]
        rows += [
            (
                "engine stop p50 (s, tether histogram)",
                histogram_quantile(0.5, tether_before, tether_after, "tether_engine_stop_seconds"),
            ),
            (
                "engine stop p99 (s, tether histogram)",
                histogram_quantile(0.99, tether_before, tether_after, "tether_engine_stop_seconds"),
            ),
            ("engine stop p50 (s, tether log)", _quantile(tether_stop_ms, 0.5)),
            ("engine stop p99 (s, tether log)", _quantile(tether_stop_ms, 0.99)),
            (
                "abort latency p50 (s, tether histogram)",
                histogram_quantile(
                    0.5, tether_before, tether_after, "tether_abort_latency_seconds"
                ),
            ),
        ]
    rows += [(f"aborts {result}", count) for result, count in results.items() if count]
    topic = f"abandoned {mode}"
    for name, value in rows:
        measurements.add(topic, name, value)
    with capsys.disabled():
        print(f"\n{topic}: {REQUESTS} streams, concurrency {CONCURRENCY}")
        for name, value in rows:
            print(f"  {name:<50} {value:>10.3f}")

    assert not not_stopped, "\n".join(not_stopped)
    assert finished_by_length == len(completers)
    assert vllm_load(stack) == 0
    if dev_mode:
        # vLLM 0.32: a request whose first abort reached the API server after it received the
        # request but before it registered it (tether sends the abort the moment its client
        # leaves) may never end its response, though tether's repeats reach vLLM after the
        # registration and vLLM logs them as aborts and stops generating: tether then reports
        # it unconfirmed and drops the connection at TETHER_ABORT_CONFIRM_TIMEOUT. Seen on one
        # seeded client in two runs out of two (2026-12-03); every other leaver is confirmed.
        overtaken = sum(1 for _, internal in reached if timeline.overtaken(internal))
        assert results["unconfirmed"] <= overtaken, (results, overtaken)
        assert results["confirmed"] + results["unconfirmed"] == len(reached), results
        assert results["failed"] == results["not_supported"] == 0
        # tether's books never hold more tokens than vLLM generated...
        assert relayed + after_disconnect <= generated, (relayed, after_disconnect, generated)
        # ...and miss at most one per stopped stream: the token in flight when its client
        # closed (written before tether read the close, so counted as relayed) or in the
        # engine step the abort cut short (counted by vLLM, never sent). Stops this fast
        # waste a few tokens, too few for a ratio: test_token_accounting checks the agreement
        # on leavers that waste hundreds.
        missed = generated - received - after_disconnect
        assert missed <= len(reached), (generated, received, after_disconnect)
        # With the engine's usage on every request (tether asks where the client did not),
        # its books are vLLM's own.
        assert completion_total == generated, (completion_total, generated)
        assert prompt_total == prompted, (prompt_total, prompted)
    else:
        assert results["confirmed"] == 0 and after_disconnect == 0
        assert results["not_supported"] >= len(reached), results
