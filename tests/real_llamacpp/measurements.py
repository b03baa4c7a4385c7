"""The per-phase table the suite prints: seconds from a client's close until llama-server let
the request go, alone and through tether, with how each run ended (rows collected with the
real-engine suites' Measurements)."""

from __future__ import annotations

import statistics
from collections import Counter

from ..support.real_engine.measurements import Measurements

STOP_TOPIC = "client close -> llama-server let go: "
NOBODY_TOPIC = "tokens generated for nobody: "
# A conversation stream llama-server did not stop: its own stop, straight to it.
DELETE_TOPIC = "DELETE /v1/stream -> released (s)"
# How a run ended when llama-server had not let go when the measurement gave up.
NOT_STOPPED = "not stopped"
ALONE = "llama.cpp alone"
VIA_TETHER = "through tether"
WAYS = (ALONE, VIA_TETHER)
# Between a way and how the run ended, in a row's name.
_SEPARATOR = " | "


def record(
    measurements: Measurements,
    phase: str,
    way: str,
    seconds: float,
    ending: str,
    nobody: int,
    deleted_in: float | None = None,
) -> None:
    """One run: the seconds until llama-server let go (or the measurement gave up), how it
    ended, the tokens it generated that no client received, and for a conversation stream
    stopped by the suite, how soon its DELETE took effect."""
    measurements.add(STOP_TOPIC + phase, way + _SEPARATOR + ending, seconds)
    measurements.add(NOBODY_TOPIC + phase, way, nobody)
    if deleted_in is not None:
        measurements.add(DELETE_TOPIC, phase, deleted_in)


def _cell(values: list[float], endings: Counter[str]) -> str:
    if not values:
        return "-"
    if set(endings) == {NOT_STOPPED}:
        return f"not stopped within {min(values):.0f} s (all {len(values)})"
    how = ", ".join(f"{count} {ending}" for ending, count in endings.most_common())
    return f"{statistics.median(values):.3f} / {max(values):.3f} s ({how})"


def stop_table(measurements: Measurements) -> list[str]:
    """One line per phase, in the order phases were measured: median and worst of each way,
    with how its runs ended; then the tokens generated for nobody."""
    seconds: dict[str, dict[str, list[float]]] = {}
    endings: dict[str, dict[str, Counter[str]]] = {}
    nobody: dict[str, dict[str, list[float]]] = {}
    for topic, name, value in measurements.rows:
        if topic.startswith(STOP_TOPIC):
            phase = topic.removeprefix(STOP_TOPIC)
            way, _, ending = name.partition(_SEPARATOR)
            seconds.setdefault(phase, {}).setdefault(way, []).append(value)
            endings.setdefault(phase, {}).setdefault(way, Counter())[ending] += 1
        elif topic.startswith(NOBODY_TOPIC):
            nobody.setdefault(topic.removeprefix(NOBODY_TOPIC), {}).setdefault(name, []).append(
                value
            )
    if not seconds:
        return []
    lines = [f"{'phase':<46} {'llama.cpp alone: median / worst':<48} through tether"]
    for phase, ways in seconds.items():
        cells = [_cell(ways.get(way, []), endings[phase].get(way, Counter())) for way in WAYS]
        lines.append(f"{phase:<46} {cells[0]:<48} {cells[1]}")
    lines += ["", f"{'tokens generated for nobody':<46} {'alone: median / max':<48} through tether"]
    for phase, ways in nobody.items():
        cells = []
        for way in WAYS:
            values = ways.get(way, [])
            cells.append(f"{statistics.median(values):.0f} / {max(values):.0f}" if values else "-")
        lines.append(f"{phase:<46} {cells[0]:<48} {cells[1]}")
    return lines
