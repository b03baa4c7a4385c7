"""The workloads: each builds a load-generator spec, runs it and reduces the result.

Every function returns flat figures for one system; comparisons with the other systems are
the report's job.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from typing import Any

from bench.procstat import settle, wait_for_quiet
from bench.stats import summarize_us
from bench.systems import CLIENT_CORES, REPO_ROOT, Engine, System, pinned

Figures = dict[str, float | int | None]
SPAN_WAIT_S = 10.0  # two of the SDK's default batch periods
SETTLE_GIVE_UP_S = 30.0


@dataclass(frozen=True, slots=True)
class Pace:
    """A paced streaming workload: each stream gets `rate` events/s, one event per read."""

    streams: int
    rate: float
    warmup_s: float
    window_s: float


@dataclass(frozen=True, slots=True)
class Profile:
    """Counts and durations; `QUICK` is the CI smoke test, `FULL` the published run."""

    relay_streams: tuple[int, ...]
    relay_streams_variants: int  # the relay_N that tether_info and tether_otel run as well
    relay_events_per_request: int
    relay_warmup_s: float
    relay_window_s: float
    paced: Pace
    paced_256: Pace
    requests_concurrency: int
    requests_warmup_s: float
    requests_window_s: float
    short_stream_events: int  # events per stream of `streams_C` (C: requests_concurrency)
    abort_streams: int
    abort_rate: float
    abort_warmup_s: float
    abort_window_s: float
    abort_spread_s: float
    idle_steps: tuple[int, int]
    idle_settle_s: float
    quiet_give_up_s: float


FULL = Profile(
    relay_streams=(1, 64, 512),
    relay_streams_variants=64,
    relay_events_per_request=200,
    relay_warmup_s=1.0,
    relay_window_s=6.0,
    paced=Pace(streams=64, rate=50.0, warmup_s=1.0, window_s=10.0),
    # Many streams at a decode-step pace: 25,600 events/s, each its own read and write.
    paced_256=Pace(streams=256, rate=100.0, warmup_s=1.0, window_s=10.0),
    requests_concurrency=32,
    requests_warmup_s=1.0,
    requests_window_s=5.0,
    # A short answer's stream: what a streaming request costs beyond its events shows.
    short_stream_events=16,
    abort_streams=1000,
    # 20,000 events/s in all, the abort target's figure: an abort must get through while the
    # relay is busy. Until 2026-12-01 this saturated tether's core (aborts queued behind
    # chunks for seconds), so the workload also reports the pace the relay kept with every
    # stream open.
    abort_rate=20.0,
    abort_warmup_s=0.5,
    abort_window_s=1.0,
    abort_spread_s=3.0,
    idle_steps=(1000, 10000),
    idle_settle_s=2.0,
    quiet_give_up_s=5.0,
)
QUICK = Profile(
    relay_streams=(1, 8, 32),
    relay_streams_variants=8,
    relay_events_per_request=50,
    relay_warmup_s=0.2,
    relay_window_s=0.5,
    paced=Pace(streams=16, rate=50.0, warmup_s=0.2, window_s=1.0),
    paced_256=Pace(streams=16, rate=100.0, warmup_s=0.2, window_s=0.5),
    requests_concurrency=4,
    requests_warmup_s=0.2,
    requests_window_s=0.5,
    short_stream_events=16,
    abort_streams=50,
    abort_rate=20.0,
    abort_warmup_s=0.1,
    abort_window_s=0.3,
    abort_spread_s=0.5,
    idle_steps=(20, 100),
    idle_settle_s=0.3,
    quiet_give_up_s=0.0,  # a smoke test checks that everything runs, not the figures
)


def run_loadgen(
    profile: Profile, spec: dict[str, Any], engine: Engine, system: System
) -> dict[str, Any]:
    """Run the load generator as its own pinned process and return its JSON result."""
    waited_s = wait_for_quiet(profile.quiet_give_up_s) if profile.quiet_give_up_s else 0.0
    spec = spec | {
        "host": "127.0.0.1",
        "port": system.port,
        "proxy_pid": system.proxy_pid,
        "engine_pid": engine.pid,
    }
    completed = subprocess.run(
        [sys.executable, "-m", "bench.loadgen"],
        input=json.dumps(spec).encode(),
        capture_output=True,
        cwd=REPO_ROOT,
        preexec_fn=pinned(CLIENT_CORES),
        timeout=300,
        check=False,
    )
    if completed.returncode != 0:
        raise RuntimeError(
            f"load generator failed on {system.name}: {completed.stderr.decode()[-2000:]}"
        )
    result: dict[str, Any] = json.loads(completed.stdout)
    return result | {"quiet_wait_s": waited_s}


def engine_call(engine: Engine, method: str, path: str) -> dict[str, Any]:
    request = urllib.request.Request(f"http://127.0.0.1:{engine.port}{path}", method=method)
    with urllib.request.urlopen(request, timeout=10) as response:
        result: dict[str, Any] = json.load(response)
        return result


def noise(result: dict[str, Any]) -> Figures:
    """Share of each core that other processes used during the window."""
    return {
        key: result[key]
        for key in ("foreign_share_proxy_core", "foreign_share_client_core", "quiet_wait_s")
    }


def per_million(cpu_s: float, count: int) -> float | None:
    return cpu_s / count * 1e6 if count else None


def relay(profile: Profile, engine: Engine, system: System, streams: int) -> Figures:
    """Workload 1: events/s at saturation and proxy CPU seconds per million events."""
    result = run_loadgen(
        profile,
        {
            "mode": "streams",
            "streams": streams,
            "events": profile.relay_events_per_request,
            "rate": 0,
            "warmup_s": profile.relay_warmup_s,
            "window_s": profile.relay_window_s,
        },
        engine,
        system,
    )
    return noise(result) | {
        "events_per_s": result["events"] / result["wall_s"],
        "proxy_cpu_s_per_m_events": per_million(result["proxy_cpu_s"], result["events"])
        if system.proxy_pid
        else None,
        "proxy_core_busy": result["proxy_cpu_s"] / result["wall_s"] if system.proxy_pid else None,
        "client_core_busy": (result["engine_cpu_s"] + result["loadgen_cpu_s"]) / result["wall_s"],
        "events": result["events"],
        "requests_sent": result["sent"],
        "errors": result["errors"],
        "id_mismatches": result["id_mismatches"],
        "usage_leaked": result.get("usage_leaked", 0),
    }


def paced_latency(profile: Profile, engine: Engine, system: System, pace: Pace) -> Figures:
    """Workload 2: arrival minus send stamp per event at a fixed rate per stream."""
    result = run_loadgen(
        profile,
        {
            "mode": "streams",
            "streams": pace.streams,
            # One request per stream for the whole run: its end falls after the window.
            "events": int(pace.rate * (pace.warmup_s + pace.window_s + 0.5)),
            "rate": pace.rate,
            "warmup_s": pace.warmup_s,
            "window_s": pace.window_s,
        },
        engine,
        system,
    )
    latency = result["latency_us"]
    return noise(result) | {
        "streams": pace.streams,
        "rate": pace.rate,
        "events_per_s": result["events"] / result["wall_s"],
        "proxy_core_busy": result["proxy_cpu_s"] / result["wall_s"] if system.proxy_pid else None,
        "p50_us": latency.get("p50"),
        "p99_us": latency.get("p99"),
        "p99.9_us": latency.get("p99.9"),
        "max_us": latency.get("max"),
        "events": result["events"],
        "proxy_cpu_s_per_m_events": per_million(result["proxy_cpu_s"], result["events"])
        if system.proxy_pid
        else None,
        "requests_sent": result["sent"],
        "errors": result["errors"],
        "id_mismatches": result["id_mismatches"],
        "usage_leaked": result.get("usage_leaked", 0),
    }


def request_overhead(profile: Profile, engine: Engine, system: System, clients: int) -> Figures:
    """Workload 3: small non-streaming requests from closed-loop clients."""
    result = run_loadgen(
        profile,
        {
            "mode": "requests",
            "clients": clients,
            "warmup_s": profile.requests_warmup_s,
            "window_s": profile.requests_window_s,
        },
        engine,
        system,
    )
    latency = result["latency_us"]
    return noise(result) | {
        "requests_per_s": result["requests"] / result["wall_s"],
        "requests_per_proxy_cpu_s": result["requests"] / result["proxy_cpu_s"]
        if system.proxy_pid and result["proxy_cpu_s"]
        else None,
        "p50_us": latency.get("p50"),
        "p99_us": latency.get("p99"),
        "requests_sent": result["sent"],
        "errors": result["errors"],
        "id_mismatches": result["id_mismatches"],
        "usage_leaked": result.get("usage_leaked", 0),
    }


def stream_overhead(profile: Profile, engine: Engine, system: System, clients: int) -> Figures:
    """Workload 3b: closed-loop clients on keep-alive connections, each requesting short
    streams as fast as they end; what one streaming request costs the proxy."""
    result = run_loadgen(
        profile,
        {
            "mode": "streams",
            "streams": clients,
            "events": profile.short_stream_events,
            "rate": 0,
            "warmup_s": profile.requests_warmup_s,
            "window_s": profile.requests_window_s,
        },
        engine,
        system,
    )
    measured = system.proxy_pid and result["proxy_cpu_s"] and result["requests"]
    return noise(result) | {
        "requests_per_s": result["requests"] / result["wall_s"],
        "requests_per_proxy_cpu_s": result["requests"] / result["proxy_cpu_s"]
        if measured
        else None,
        "proxy_cpu_us_per_request": result["proxy_cpu_s"] / result["requests"] * 1e6
        if measured
        else None,
        "events": result["events"],
        "requests_sent": result["sent"],
        "errors": result["errors"],
        "id_mismatches": result["id_mismatches"],
        "usage_leaked": result["usage_leaked"],
    }


def abort_latency(profile: Profile, engine: Engine, system: System) -> Figures:
    """Workload 4: client close to the engine hearing of it, for every disconnected stream.

    tether calls the engine's abort API, so its figure is close → abort received. nginx and
    a direct connection have no abort call: their figure is close → the engine seeing its
    connection drop, which is how vLLM itself notices a lost client.
    """
    engine_call(engine, "POST", "/_bench/reset")
    result = run_loadgen(
        profile,
        {
            "mode": "aborts",
            "streams": profile.abort_streams,
            "rate": profile.abort_rate,
            "spread_s": profile.abort_spread_s,
            "warmup_s": profile.abort_warmup_s,
            "window_s": profile.abort_window_s,
            "open_timeout_s": 30,
        },
        engine,
        system,
    )
    closed_ns: dict[str, int] = result["closed_ns"]
    signal = "aborts" if system.name.startswith("tether") else "drops"
    deadline = time.monotonic() + 5
    while True:
        stats = engine_call(engine, "GET", "/_bench/stats")
        if set(closed_ns) <= set(stats[signal]) or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    seen = {
        tag: stats[signal][tag] - closed
        for tag, closed in closed_ns.items()
        if tag in stats[signal]
    }
    drops = [
        stats["drops"][tag] - closed for tag, closed in closed_ns.items() if tag in stats["drops"]
    ]
    summary, drop_summary = summarize_us(list(seen.values())), summarize_us(drops)
    return noise(result) | {
        "streams_open": result["opened"],
        "offered_events_per_s": result["opened"] * profile.abort_rate,
        "events_per_s": result["events"] / result["wall_s"],
        "proxy_core_busy": result["proxy_cpu_s"] / result["wall_s"] if system.proxy_pid else None,
        "p50_ms": ms(summary.get("p50")),
        "p99_ms": ms(summary.get("p99")),
        "max_ms": ms(summary.get("max")),
        "disconnected": len(closed_ns),
        "noticed": len(seen),
        "missed": len(closed_ns) - len(seen),
        "drop_p99_ms": ms(drop_summary.get("p99")),
        "failed_to_open": result["failed_to_open"],
        "ended_early": result["ended_early"],
        "unknown_aborts": stats["unknown_aborts"],
        "duplicate_aborts": stats["duplicate_aborts"],
        "id_mismatches": result["id_mismatches"],
        "usage_leaked": result.get("usage_leaked", 0),
    }


def ms(value_us: float | None) -> float | None:
    return None if value_us is None else value_us / 1000


def memory_per_stream(
    profile: Profile, engine: Engine, system: System, max_streams: int
) -> Figures:
    """Workload 5: proxy RSS with many idle open streams; bytes per stream from the slope;
    then the proxy's CPU for all of them closing at once."""
    steps = [min(step, max_streams) for step in profile.idle_steps]
    result = run_loadgen(
        profile,
        {"mode": "idle", "steps": steps, "settle_s": profile.idle_settle_s, "open_timeout_s": 60},
        engine,
        system,
    )
    # Every client has just left at once: tether then has an abort to send for each stream,
    # which must not run into the next measurement on the proxy core.
    after_close = settle(system.proxy_pid, SETTLE_GIVE_UP_S) if system.proxy_pid else None
    low, high = result["steps"]
    per_stream = None
    if system.proxy_pid and high["open"] > low["open"]:
        per_stream = (high["proxy_rss"] - low["proxy_rss"]) / (high["open"] - low["open"])
    return {
        "cpu_after_close_s": after_close,
        "rss_low_mib": low["proxy_rss"] / 2**20 if low["proxy_rss"] else None,
        "rss_high_mib": high["proxy_rss"] / 2**20 if high["proxy_rss"] else None,
        "bytes_per_stream": per_stream,
        "open_low": low["open"],
        "open_high": high["open"],
        "failed_to_open": result["failed_to_open"],
        "id_mismatches": result["id_mismatches"],
        "usage_leaked": result.get("usage_leaked", 0),
    }


def spans_exported(engine: Engine, requests_traced: int) -> Figures:
    """What tether_otel's exporter delivered to the engine's trace sink during the round.

    The SDK's batch processor sends a batch every 5 s (`OTEL_BSP_SCHEDULE_DELAY`) or once
    512 spans are queued, so the last spans arrive after the last workload: wait until there
    is one per request sent, or give up after two batch periods and count what is missing.
    """
    deadline = time.monotonic() + SPAN_WAIT_S
    while True:
        stats = engine_call(engine, "GET", "/_bench/stats")
        if stats["spans"] >= requests_traced or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    return {
        "requests_traced": requests_traced,
        "spans": stats["spans"],
        "trace_exports": stats["trace_exports"],
        "trace_bytes": stats["trace_bytes"],
    }
