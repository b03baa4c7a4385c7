"""The per-phase table the suite prints: SGLang idle after a client's close, with and without
tether (rows collected with the real-vLLM suite's Measurements)."""

from __future__ import annotations

import statistics

from ..support.real_engine.measurements import Measurements

IDLE_TOPIC = "client close -> SGLang idle: "
VIA_SGLANG_ALONE = "SGLang alone (s)"
VIA_TETHER = "through tether (s)"


def idle_table(measurements: Measurements) -> list[str]:
    """One line per phase: median and worst of each way, in the order phases were measured."""
    runs: dict[str, dict[str, list[float]]] = {}
    for topic, name, value in measurements.rows:
        if topic.startswith(IDLE_TOPIC):
            runs.setdefault(topic.removeprefix(IDLE_TOPIC), {}).setdefault(name, []).append(value)
    if not runs:
        return []
    lines = [
        f"{'phase':<26} {'SGLang alone: median / worst':>30} {'through tether: median / worst':>32}"
    ]
    for phase, ways in runs.items():
        cells = []
        for way in (VIA_SGLANG_ALONE, VIA_TETHER):
            values = ways.get(way, [])
            cells.append(
                f"{statistics.median(values):.3f} / {max(values):.3f} s (n={len(values)})"
                if values
                else "-"
            )
        lines.append(f"{phase:<26} {cells[0]:>30} {cells[1]:>32}")
    return lines
