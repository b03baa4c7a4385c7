"""tether's count of tokens generated after clients left agrees with the real vLLM's: its
`vllm:generation_tokens_total` (which counts aborted requests' tokens too) less the tokens the
clients received (counted exactly, from vLLM's `return_token_ids`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import pytest

from ..support.real_engine.measurements import Measurements
from .processes import Stack
from .scenarios import (
    ROUTES,
    generated_tokens,
    leave_non_streaming,
    on_dev_mode,
    tether_metrics,
    wait_vllm_idle,
)
from .workload import Fate, Plan, run_mixed

AGREEMENT = 0.10  # in aggregate
SOME_WASTE = 100  # tokens: the comparison must rest on real numbers


@dataclass(frozen=True)
class Unit:
    """One request, or one batch run together, and its counts."""

    name: str
    generated: float  # vLLM's counter, delta
    received: int  # by the clients
    after_disconnect: float  # tether's counter, delta
    relayed: float  # tether's counter, delta

    @property
    def waste(self) -> float:
        """What vLLM generated that no client received."""
        return self.generated - self.received


def _measure(stack: Stack, name: str, run: Callable[[], tuple[int, list[str]]]) -> Unit:
    """Counters around `run`, which returns (tokens received, client IDs that left)."""
    generated_before = generated_tokens(stack)
    tether_before = tether_metrics(stack)
    mark = stack.tether.log.mark()
    received, leavers = run()
    wait_vllm_idle(stack)
    for client_request_id in leavers:  # tether counts once the engine's response ended
        line = stack.tether.log.wait_json(
            mark, "abort_sent", client_request_id=client_request_id, timeout=5
        )
        assert line["result"] == "confirmed", line
    tether_after = tether_metrics(stack)
    return Unit(
        name,
        generated_tokens(stack) - generated_before,
        received,
        tether_after.value("tether_tokens_after_disconnect_total")
        - tether_before.value("tether_tokens_after_disconnect_total"),
        tether_after.value("tether_tokens_relayed_total")
        - tether_before.value("tether_tokens_relayed_total"),
    )


def _streams(stack: Stack, plans: list[Plan]) -> Callable[[], tuple[int, list[str]]]:
    def run() -> tuple[int, list[str]]:
        departures = run_mixed(stack, plans, concurrency=len(plans))
        assert all(departure.left for departure in departures)
        return sum(d.tokens for d in departures), [p.client_request_id for p in plans]

    return run


def _non_streaming(
    stack: Stack, route: str, client_request_id: str
) -> Callable[[], tuple[int, list[str]]]:
    def run() -> tuple[int, list[str]]:
        leave_non_streaming(stack, ROUTES[route], client_request_id, after_tokens=60)
        return 0, [client_request_id]

    return run


def _leaving(name: str, route: str, leave_after: int, include_usage: bool = False) -> Plan:
    return Plan(
        name, ROUTES[route], 1900, Fate.LEAVES_MID_STREAM, leave_after, include_usage=include_usage
    )


@on_dev_mode
def test_tokens_after_disconnect_agree_with_vllm(
    stack: Stack, measurements: Measurements, capsys: pytest.CaptureFixture[str]
) -> None:
    """Dev mode: tether_tokens_after_disconnect_total matches vLLM's generated tokens less
    those the clients received, within 10 % in aggregate, over single and batched leavers."""
    cases: list[tuple[str, Callable[[], tuple[int, list[str]]]]] = []
    for route, after, usage in (
        ("chat", 10, False),
        ("chat", 25, True),
        ("completions", 15, False),
        ("completions", 40, True),
    ):
        name = f"tokens-{route}-{after}{'-usage' if usage else ''}"
        cases.append((name, _streams(stack, [_leaving(name, route, after, usage)])))
    for route in ("chat", "completions"):
        name = f"tokens-{route}-non-streaming"
        cases.append((name, _non_streaming(stack, route, name)))
    for batch, points in enumerate(((5, 20, 40, 80), (10, 30, 60, 120), (3, 50, 100, 200))):
        plans = [
            _leaving(f"tokens-batch{batch}-{index}", route, after, usage)
            for index, (route, after, usage) in enumerate(
                zip(
                    ("chat", "completions", "chat", "completions"),
                    points,
                    (False, False, True, True),
                    strict=True,
                )
            )
        ]
        cases.append((f"tokens-batch{batch} (4 streams)", _streams(stack, plans)))
    units = [_measure(stack, name, run) for name, run in cases]

    lines = [f"{'unit':<34} {'vLLM':>6} {'client':>6} {'waste':>6} {'tether':>6} {'diff':>5}"]
    for unit in units:
        difference = unit.after_disconnect - unit.waste
        lines.append(
            f"{unit.name:<34} {unit.generated:>6.0f} {unit.received:>6} {unit.waste:>6.0f} "
            f"{unit.after_disconnect:>6.0f} {difference:>+5.0f}"
        )
        measurements.add("token accounting", f"{unit.name}: tether - (vLLM - client)", difference)
    waste = sum(unit.waste for unit in units)
    counted = sum(unit.after_disconnect for unit in units)
    received = sum(unit.received for unit in units)
    relayed = sum(unit.relayed for unit in units)
    lines.append(
        f"total: vLLM - client {waste:.0f}, tether after disconnect {counted:.0f}; "
        f"client received {received}, tether relayed {relayed:.0f}"
    )
    with capsys.disabled():
        print("\n" + "\n".join(lines))
    measurements.add("token accounting", "total: vLLM generated - client received", waste)
    measurements.add("token accounting", "total: tether tokens after disconnect", counted)
    measurements.add("token accounting", "total: client received", received)
    measurements.add("token accounting", "total: tether tokens relayed", relayed)
    assert waste >= SOME_WASTE, lines
    assert abs(counted - waste) <= AGREEMENT * waste, lines
