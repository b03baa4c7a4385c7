"""One table for every figure and system, the ratios, and the targets met or not.

`python -m bench.report bench/results/<time>.json` prints a saved run again.
"""

from __future__ import annotations

import json
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.workloads import Figures

Results = dict[str, dict[str, Figures]]
COLUMNS = ("direct", "nginx", "tether", "tether_info")


@dataclass(frozen=True, slots=True)
class Row:
    label: str
    workload: str
    figure: str
    digits: int = 1


def rows_for(results: Results) -> list[Row]:
    rows: list[Row] = []
    for workload in results:
        if workload.startswith("relay_"):
            streams = workload.removeprefix("relay_")
            rows += [
                Row(f"1 relay, {streams} streams: events/s", workload, "events_per_s", 0),
                Row(f"1 relay, {streams} streams: proxy core busy", workload, "proxy_core_busy", 2),
                Row(
                    f"1 relay, {streams} streams: client core busy", workload, "client_core_busy", 2
                ),
                Row(
                    f"1 relay, {streams} streams: proxy CPU s / M events",
                    workload,
                    "proxy_cpu_s_per_m_events",
                    2,
                ),
            ]
    rows += [
        Row("2 per-event latency p50 (us)", "paced", "p50_us"),
        Row("2 per-event latency p99 (us)", "paced", "p99_us"),
        Row("2 per-event latency p99.9 (us)", "paced", "p99.9_us"),
        Row("2 added latency p50 vs direct (us)", "paced", "added_p50_us"),
        Row("2 added latency p99 vs direct (us)", "paced", "added_p99_us"),
        Row("2 added latency p99.9 vs direct (us)", "paced", "added_p99.9_us"),
        Row("2 proxy CPU s / M events at this rate", "paced", "proxy_cpu_s_per_m_events", 2),
        Row("3 requests/s, 1 client", "requests_1", "requests_per_s", 0),
        Row("3 latency p50, 1 client (us)", "requests_1", "p50_us"),
        Row("3 latency p99, 1 client (us)", "requests_1", "p99_us"),
        Row("3 added latency p50 vs direct (us)", "requests_1", "added_p50_us"),
        Row("3 added latency p99 vs direct (us)", "requests_1", "added_p99_us"),
    ]
    concurrent = [w for w in results if w.startswith("requests_") and w != "requests_1"]
    for workload in concurrent:
        clients = workload.removeprefix("requests_")
        rows += [
            Row(f"3 requests/s, {clients} clients", workload, "requests_per_s", 0),
            Row(
                f"3 requests/s per proxy core, {clients} clients",
                workload,
                "requests_per_proxy_cpu_s",
                0,
            ),
        ]
    rows += [
        Row("4 abort latency p50 (ms) [nginx/direct: conn drop]", "aborts", "p50_ms", 2),
        Row("4 abort latency p99 (ms) [nginx/direct: conn drop]", "aborts", "p99_ms", 2),
        Row("4 abort latency max (ms) [nginx/direct: conn drop]", "aborts", "max_ms", 2),
        Row("4 upstream conn drop p99 (ms)", "aborts", "drop_p99_ms", 2),
        Row("4 disconnected", "aborts", "disconnected", 0),
        Row("4 missed (disconnected, never noticed)", "aborts", "missed", 0),
        Row("5 proxy RSS, low step (MiB)", "memory", "rss_low_mib"),
        Row("5 proxy RSS, high step (MiB)", "memory", "rss_high_mib"),
        Row("5 open streams, high step", "memory", "open_high", 0),
        Row("5 bytes per open stream", "memory", "bytes_per_stream", 0),
    ]
    return [row for row in rows if row.workload in results]


# Counts add up over rounds (every disconnect is checked, not a sample); the rest is a median.
SUMMED = frozenset(
    {"disconnected", "noticed", "missed", "errors", "id_mismatches", "failed_to_open"}
)


def combine_rounds(rounds: list[Results]) -> Results:
    """One result per figure: the median over rounds, which a single noisy round cannot move."""
    combined: Results = {}
    for workload, by_system in rounds[0].items():
        combined[workload] = {}
        for system, figures in by_system.items():
            combined[workload][system] = {}
            for key in figures:
                values = [value for r in rounds if (value := r[workload][system][key]) is not None]
                if not values:
                    combined[workload][system][key] = None
                elif key in SUMMED:
                    combined[workload][system][key] = sum(values)
                else:
                    combined[workload][system][key] = statistics.median(values)
    return combined


def add_deltas(results: Results) -> None:
    """Latency added by each proxy: its percentile minus the direct connection's."""
    for workload, keys in (
        ("paced", ("p50_us", "p99_us", "p99.9_us")),
        ("requests_1", ("p50_us", "p99_us")),
    ):
        direct = results.get(workload, {}).get("direct")
        if direct is None:
            continue
        for figures in results[workload].values():
            for key in keys:
                value, base = figures.get(key), direct.get(key)
                added = value - base if value is not None and base is not None else None
                figures[f"added_{key}"] = added


def ratio(results: Results, row: Row, over: str) -> float | None:
    by_system = results[row.workload]
    value = by_system.get("tether", {}).get(row.figure)
    base = by_system.get(over, {}).get(row.figure)
    if value is None or not base:
        return None
    return value / base


def cell(value: float | int | None, digits: int) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def render_table(results: Results) -> str:
    columns = [name for name in COLUMNS if any(name in by_system for by_system in results.values())]
    rows = rows_for(results)
    width = max(len(row.label) for row in rows)
    header = f"{'metric':<{width}}" + "".join(f"{name:>14}" for name in columns)
    header += f"{'tether/nginx':>14}{'tether/direct':>14}"
    lines = [header, "-" * len(header)]
    for row in rows:
        by_system = results[row.workload]
        line = f"{row.label:<{width}}"
        line += "".join(
            f"{cell(by_system.get(name, {}).get(row.figure), row.digits):>14}" for name in columns
        )
        line += "".join(f"{cell(ratio(results, row, over), 2):>14}" for over in ("nginx", "direct"))
        lines.append(line)
    return "\n".join(lines)


def figure(results: Results, workload: str, system: str, key: str) -> Any:
    return results.get(workload, {}).get(system, {}).get(key)


def targets(results: Results) -> list[dict[str, Any]]:
    """The issue's targets for tether, each with the figure it was judged on."""
    checks: list[dict[str, Any]] = []
    for workload in (w for w in results if w.startswith("relay_")):
        tether = figure(results, workload, "tether", "proxy_cpu_s_per_m_events")
        nginx = figure(results, workload, "nginx", "proxy_cpu_s_per_m_events")
        if tether is not None and nginx:
            checks.append(
                {
                    "target": f"CPU per M events within 2x nginx ({workload})",
                    "measured": f"{tether / nginx:.2f}x ({tether:.2f} vs {nginx:.2f} s)",
                    "met": tether / nginx <= 2,
                }
            )
    tether = figure(results, "paced", "tether", "proxy_cpu_s_per_m_events")
    nginx = figure(results, "paced", "nginx", "proxy_cpu_s_per_m_events")
    if tether is not None and nginx:
        checks.append(
            {
                "target": "CPU per M events within 2x nginx (paced, no coalescing)",
                "measured": f"{tether / nginx:.2f}x ({tether:.2f} vs {nginx:.2f} s)",
                "met": tether / nginx <= 2,
            }
        )
    added = figure(results, "paced", "tether", "added_p99_us")
    if added is not None:
        checks.append(
            {
                "target": "added per-event latency p99 < 1 ms",
                "measured": f"{added:.0f} us",
                "met": added < 1000,
            }
        )
    p99, missed = (
        figure(results, "aborts", "tether", "p99_ms"),
        figure(results, "aborts", "tether", "missed"),
    )
    if p99 is not None and missed is not None:
        checks.append(
            {
                "target": "abort latency p99 < 10 ms, zero missed",
                "measured": f"p99 {p99:.2f} ms, {missed} missed",
                "met": p99 < 10 and missed == 0,
            }
        )
    per_stream = figure(results, "memory", "tether", "bytes_per_stream")
    if per_stream is not None:
        checks.append(
            {
                "target": "< 30 KB per open stream",
                "measured": f"{per_stream:,.0f} B",
                "met": per_stream < 30_000,
            }
        )
    added = figure(results, "requests_1", "tether", "added_p50_us")
    if added is not None:
        checks.append(
            {
                "target": "non-streaming added latency p50 < 1 ms",
                "measured": f"{added:.0f} us",
                "met": added < 1000,
            }
        )
    return checks


def render_targets(checks: list[dict[str, Any]]) -> str:
    return "\n".join(
        f"{'MET    ' if check['met'] else 'NOT MET'}  {check['target']}: {check['measured']}"
        for check in checks
    )


def render_checks(results: Results) -> str:
    """Correctness and noise: errors, unmapped IDs, and other processes on our cores."""
    problems = [
        f"{workload}/{system}: {key}={figures[key]}"
        for workload, by_system in results.items()
        for system, figures in by_system.items()
        for key in ("errors", "id_mismatches", "failed_to_open", "unknown_aborts")
        if figures.get(key)
    ]
    lines = [
        "checks: "
        + ("; ".join(problems) if problems else "no errors; every response carried the client's ID")
    ]
    for core in ("proxy", "client"):
        shares = [
            (figures[f"foreign_share_{core}_core"], f"{workload}/{system}")
            for workload, by_system in results.items()
            for system, figures in by_system.items()
            if f"foreign_share_{core}_core" in figures
            and not (core == "proxy" and system == "direct")
        ]
        if shares:
            worst, where = max(shares)
            lines.append(
                f"noise: other processes used up to {worst:.0%} of the {core} core "
                f"in a window ({where})"
            )
    return "\n".join(lines)


def render(meta: dict[str, Any], results: Results) -> str:
    """The whole printout: the run's circumstances, the table, checks and targets."""
    return "\n".join(
        [
            f"tether benchmark, {meta['mode']} mode, {meta['date']}, "
            f"median of {meta['rounds']} round(s)",
            f"machine: {meta['cpu']}, {meta['cores']} cores, {meta['memory_gib']} GiB, "
            f"Linux {meta['kernel']}, Python {meta['python']}, nginx {meta['nginx']}",
            f"cores: {meta['core_split']}",
            f"load average before/after: {' '.join(meta['loadavg_before'])} / "
            f"{' '.join(meta['loadavg_after'])}; descriptor limit {meta['nofile']}",
            "",
            render_table(results),
            "",
            render_checks(results),
            "",
            render_targets(targets(results)),
        ]
    )


if __name__ == "__main__":
    saved = json.loads(Path(sys.argv[1]).read_text())
    print(render(saved["meta"], saved["results"]))
