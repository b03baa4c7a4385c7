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

from bench.systems import SYSTEMS
from bench.workloads import Figures

Results = dict[str, dict[str, Figures]]
# (header, numerator, denominator): tether against nginx, smg (the closest peer) and a direct
# connection, what turning tracing on costs tether, what asking the engine for usage costs
# it, what its compiled data plane saves over the pure-Python one, and what a second worker
# (on both cores) buys tether next to what it buys nginx on the same machine, and what tether
# costs above the least proxy its stack makes.
RATIOS = (
    ("tether/nginx", "tether", "nginx"),
    ("tether/smg", "tether", "smg"),
    ("tether/direct", "tether", "direct"),
    ("otel/tether", "tether_otel", "tether"),
    ("tether/nousage", "tether", "tether_nousage"),
    ("tether/pure", "tether", "tether_pure"),
    ("nginx 2w/1w", "nginx_2w", "nginx"),
    ("tether 2w/1w", "tether_2w", "tether"),
    ("tether/floor", "tether", "aiohttp_floor"),
)
SPANS = "spans"  # not a workload: the spans tether_otel exported over the round
# The relay "runs at" the offered rate when it carries at least this share of it; below,
# events queue in the proxy and the aborts meet a lighter load than the target names.
KEPT_PACE = 0.95


@dataclass(frozen=True, slots=True)
class Row:
    label: str
    workload: str
    figure: str
    digits: int = 1


def paced_name(results: Results, workload: str) -> str:
    """`paced_256 (256 x 100/s)`: the key and, from its figures, the streams and their rate."""
    figures = next(iter(results[workload].values()))
    streams, rate = figures.get("streams"), figures.get("rate")
    if streams is None or rate is None:  # saved by a bench that did not record them
        return workload
    return f"{workload} ({streams:.0f} x {rate:g}/s)"


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
    for workload in results:
        if workload.startswith("paced"):
            name = f"2 {paced_name(results, workload)}"
            rows += [
                Row(f"{name}: events/s", workload, "events_per_s", 0),
                Row(f"{name}: proxy core busy", workload, "proxy_core_busy", 2),
                Row(f"{name}: latency p50 (us)", workload, "p50_us"),
                Row(f"{name}: latency p99 (us)", workload, "p99_us"),
                Row(f"{name}: latency p99.9 (us)", workload, "p99.9_us"),
                Row(f"{name}: added p50 vs direct (us)", workload, "added_p50_us"),
                Row(f"{name}: added p99 vs direct (us)", workload, "added_p99_us"),
                Row(f"{name}: added p99.9 vs direct (us)", workload, "added_p99.9_us"),
                Row(f"{name}: proxy CPU s / M events", workload, "proxy_cpu_s_per_m_events", 2),
            ]
    rows += [
        Row("3 requests/s, 1 client", "requests_1", "requests_per_s", 0),
        Row("3 latency p50, 1 client (us)", "requests_1", "p50_us"),
        Row("3 latency p99, 1 client (us)", "requests_1", "p99_us"),
        Row("3 added latency p50 vs direct (us)", "requests_1", "added_p50_us"),
        Row("3 added latency p99 vs direct (us)", "requests_1", "added_p99_us"),
    ]
    for workload in concurrent_requests(results):
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
    for workload in (w for w in results if w.startswith("streams_")):
        clients = workload.removeprefix("streams_")
        rows += [
            Row(f"3 short streams/s, {clients} clients", workload, "requests_per_s", 0),
            Row(
                f"3 short streams/s per proxy core, {clients} clients",
                workload,
                "requests_per_proxy_cpu_s",
                0,
            ),
            Row(
                f"3 proxy CPU us per short stream, {clients} clients",
                workload,
                "proxy_cpu_us_per_request",
                1,
            ),
        ]
    rows += [
        Row("4 relay events/s, all streams open", "aborts", "events_per_s", 0),
        Row("4 proxy core busy, all streams open", "aborts", "proxy_core_busy", 2),
        Row("4 abort latency p50 (ms) [nginx, smg, direct: conn drop]", "aborts", "p50_ms", 2),
        Row("4 abort latency p99 (ms) [nginx, smg, direct: conn drop]", "aborts", "p99_ms", 2),
        Row("4 abort latency max (ms) [nginx, smg, direct: conn drop]", "aborts", "max_ms", 2),
        Row("4 upstream conn drop p99 (ms)", "aborts", "drop_p99_ms", 2),
        Row("4 disconnected", "aborts", "disconnected", 0),
        Row("4 missed (disconnected, never noticed)", "aborts", "missed", 0),
        Row("5 proxy RSS, low step (MiB)", "memory", "rss_low_mib"),
        Row("5 proxy RSS, high step (MiB)", "memory", "rss_high_mib"),
        Row("5 open streams, high step", "memory", "open_high", 0),
        Row("5 bytes per open stream", "memory", "bytes_per_stream", 0),
        Row("5 proxy CPU s after every stream closed", "memory", "cpu_after_close_s", 2),
    ]
    return [row for row in rows if row.workload in results]


def concurrent_requests(results: Results) -> list[str]:
    return [w for w in results if w.startswith("requests_") and w != "requests_1"]


# Counts add up over rounds (every disconnect is checked, not a sample); the rest is a median.
SUMMED = frozenset(
    {
        "disconnected",
        "noticed",
        "missed",
        "errors",
        "id_mismatches",
        "usage_leaked",
        "failed_to_open",
        "requests_sent",
        "requests_traced",
        "spans",
        "trace_exports",
        "trace_bytes",
    }
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
    deltas = [(w, ("p50_us", "p99_us", "p99.9_us")) for w in results if w.startswith("paced")]
    for workload, keys in [*deltas, ("requests_1", ("p50_us", "p99_us"))]:
        direct = results.get(workload, {}).get("direct")
        if direct is None:
            continue
        for figures in results[workload].values():
            for key in keys:
                value, base = figures.get(key), direct.get(key)
                added = value - base if value is not None and base is not None else None
                figures[f"added_{key}"] = added


def ratio(results: Results, row: Row, numerator: str, denominator: str) -> float | None:
    by_system = results[row.workload]
    value = by_system.get(numerator, {}).get(row.figure)
    base = by_system.get(denominator, {}).get(row.figure)
    if value is None or not base:
        return None
    return value / base


def cell(value: float | int | None, digits: int) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def render_table(results: Results) -> str:
    columns = [name for name in SYSTEMS if any(name in by_system for by_system in results.values())]
    ratios = [r for r in RATIOS if r[1] in columns and r[2] in columns]
    rows = rows_for(results)
    width = max(len(row.label) for row in rows)
    header = f"{'metric':<{width}}" + "".join(f"{name:>14}" for name in columns)
    header += "".join(f"{label:>14}" for label, _, _ in ratios)
    lines = [header, "-" * len(header)]
    for row in rows:
        by_system = results[row.workload]
        line = f"{row.label:<{width}}"
        line += "".join(
            f"{cell(by_system.get(name, {}).get(row.figure), row.digits):>14}" for name in columns
        )
        line += "".join(
            f"{cell(ratio(results, row, numerator, denominator), 2):>14}"
            for _, numerator, denominator in ratios
        )
        lines.append(line)
    return "\n".join(lines)


def figure(results: Results, workload: str, system: str, key: str) -> Any:
    return results.get(workload, {}).get(system, {}).get(key)


Check = dict[str, Any]


def cpu_per_event(results: Results, workload: str, limit: float, where: str) -> Check | None:
    tether = figure(results, workload, "tether", "proxy_cpu_s_per_m_events")
    nginx = figure(results, workload, "nginx", "proxy_cpu_s_per_m_events")
    if tether is None or not nginx:
        return None
    return {
        "target": f"proxy CPU per event at most {limit:.1f}x nginx, {where}",
        "measured": f"{tether / nginx:.2f}x ({tether:.2f} vs {nginx:.2f} s / M events)",
        "met": tether / nginx <= limit,
    }


def requests_per_cpu(results: Results, workload: str) -> Check | None:
    tether = figure(results, workload, "tether", "requests_per_proxy_cpu_s")
    nginx = figure(results, workload, "nginx", "requests_per_proxy_cpu_s")
    if tether is None or not nginx:
        return None
    return {
        "target": f"non-streaming requests per proxy CPU second at least 1/4 of nginx's, "
        f"{workload}",
        "measured": f"{tether / nginx:.2f} of nginx's ({tether:,.0f} vs {nginx:,.0f})",
        "met": tether / nginx >= 1 / 4,
    }


def below(results: Results, workload: str, key: str, limit: float, target: str) -> Check | None:
    value = figure(results, workload, "tether", key)
    if value is None:
        return None
    return {"target": target, "measured": f"{value:,.0f} us", "met": value < limit}


def abort_check(results: Results) -> Check | None:
    aborts = results.get("aborts", {}).get("tether", {})
    p99, missed = aborts.get("p99_ms"), aborts.get("missed")
    rate, offered = aborts.get("events_per_s"), aborts.get("offered_events_per_s")
    if p99 is None or missed is None or rate is None or not offered:
        return None
    kept = rate / offered
    return {
        "target": f"abort latency p99 < 10 ms, none missed, with {aborts['streams_open']:,.0f} "
        f"streams while the relay runs at {offered:,.0f} events/s",
        "measured": f"p99 {p99:,.2f} ms, {missed} missed; the relay carried "
        f"{rate:,.0f} events/s ({kept:.0%})",
        "met": p99 < 10 and missed == 0 and kept >= KEPT_PACE,
    }


def memory_check(results: Results) -> Check | None:
    per_stream = figure(results, "memory", "tether", "bytes_per_stream")
    nginx = figure(results, "memory", "nginx", "bytes_per_stream")
    if per_stream is None:
        return None
    return {
        "target": "memory per open stream < 20 KB",
        "measured": f"{per_stream:,.0f} B" + ("" if nginx is None else f" (nginx {nginx:,.0f} B)"),
        "met": per_stream < 20_000,
    }


def many_streams_check(results: Results) -> Check | None:
    """paced_256's CPU target, with its added latency beside it."""
    if "paced_256" not in results:
        return None
    check = cpu_per_event(results, "paced_256", 1.5, paced_name(results, "paced_256"))
    p50 = figure(results, "paced_256", "tether", "added_p50_us")
    p99 = figure(results, "paced_256", "tether", "added_p99_us")
    if check is not None and p50 is not None and p99 is not None:
        check["measured"] += f"; added latency p50 {p50:,.0f} us, p99 {p99:,.0f} us"
    return check


def targets(results: Results) -> list[Check]:
    """The targets for tether (bench/README.md, "Targets"), each judged on this run's figures."""
    paced = paced_name(results, "paced") if "paced" in results else ""
    # Saturated streaming: every relay but the single stream's (64 and 512 in the full run).
    saturated = [w for w in results if w.startswith("relay_") and w != "relay_1"]
    checks = [
        cpu_per_event(results, "paced", 1.5, f"{paced}, one event per read"),
        *(cpu_per_event(results, w, 1.0, f"saturated {w}") for w in saturated),
        *(requests_per_cpu(results, w) for w in concurrent_requests(results)),
        below(
            results,
            "requests_1",
            "added_p50_us",
            150,
            "non-streaming added latency p50 < 150 us (vs direct, 1 client)",
        ),
        below(
            results,
            "paced",
            "added_p99_us",
            200,
            f"added latency per event p99 < 200 us, {paced}",
        ),
        abort_check(results),
        memory_check(results),
        many_streams_check(results),
    ]
    return [check for check in checks if check is not None]


def render_targets(checks: list[Check]) -> str:
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
        for key in ("errors", "id_mismatches", "usage_leaked", "failed_to_open", "unknown_aborts")
        if figures.get(key)
    ]
    spans = results.get(SPANS, {}).get("tether_otel")
    if spans is not None and spans["spans"] != spans["requests_traced"]:
        problems.append(
            f"tether_otel: {spans['spans']:,} spans for {spans['requests_traced']:,} requests"
        )
    lines = [
        "checks: "
        + ("; ".join(problems) if problems else "no errors; every response carried the client's ID")
    ]
    if spans is not None:
        # The sink's own count: spans that reached it, not spans the SDK meant to send.
        mib = (spans["trace_bytes"] or 0) / 2**20
        lines.append(
            f"tracing: tether_otel's {spans['requests_traced']:,} requests left "
            f"{spans['spans']:,} spans at the OTLP sink, in {spans['trace_exports']:,} exports "
            f"({mib:.1f} MiB)"
        )
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
            f"tether's data plane: {meta.get('tether_extensions', 'not recorded')}",
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
