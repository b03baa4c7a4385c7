"""Run every workload against every system, interleaved, so machine noise hits all alike."""

from __future__ import annotations

import datetime
import functools
import json
import os
import platform
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench import report
from bench.systems import (
    CLIENT_CORE,
    PROXY_CORE,
    Engine,
    System,
    all_systems,
    nginx_binary,
    tether_extensions,
)
from bench.workloads import (
    Figures,
    Profile,
    abort_latency,
    memory_per_stream,
    paced_latency,
    relay,
    request_overhead,
    spans_exported,
    stream_overhead,
)

NOFILE = 65536  # 10,000 idle streams take 20,000 descriptors in a proxy
# Listening sockets, logs, connections left idle by earlier workloads, and slack: nginx 1.22
# with worker_connections 20000 ran out of connection slots at ~9,400 streams, not 10,000.
DESCRIPTOR_RESERVE = 2000

Workload = Callable[[Engine, System], Figures]


def raise_nofile() -> int:
    """Raise the descriptor limit, which children inherit, as far as we may; returns it.

    Lifting the hard limit needs CAP_SYS_RESOURCE, which a container may not grant even to
    root: then the soft limit goes up to the hard one and the caller caps its stream counts.
    """
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (NOFILE, max(hard, NOFILE)))
    except (ValueError, PermissionError):
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def plan(profile: Profile, max_streams: int) -> dict[str, Workload]:
    # Memory first, on processes that are fresh for the round: a Python proxy keeps the heap
    # it grew for earlier streams, which would make later streams look nearly free.
    workloads: dict[str, Workload] = {
        "memory": functools.partial(memory_per_stream, profile, max_streams=max_streams)
    }
    for streams in profile.relay_streams:
        workloads[f"relay_{streams}"] = functools.partial(relay, profile, streams=streams)
    workloads["paced"] = functools.partial(paced_latency, profile, pace=profile.paced)
    workloads["paced_256"] = functools.partial(paced_latency, profile, pace=profile.paced_256)
    workloads["requests_1"] = functools.partial(request_overhead, profile, clients=1)
    clients = profile.requests_concurrency
    workloads[f"requests_{clients}"] = functools.partial(request_overhead, profile, clients=clients)
    workloads[f"streams_{clients}"] = functools.partial(stream_overhead, profile, clients=clients)
    workloads["aborts"] = functools.partial(abort_latency, profile)
    return workloads


def variant_workloads(profile: Profile) -> dict[str, frozenset[str]]:
    """Where tether's variants run; elsewhere they would only repeat tether's figures.

    The per-request log line matters where requests are many. A span costs per request too;
    tracing also runs at a realistic streaming pace, where any cost it adds per event shows
    undiluted by coalescing.
    """
    many_requests = {
        f"relay_{profile.relay_streams_variants}",
        "requests_1",
        f"requests_{profile.requests_concurrency}",
    }
    streams = f"streams_{profile.requests_concurrency}"
    two_workers = frozenset(
        {f"relay_{n}" for n in profile.relay_streams}
        | {"paced_256", f"requests_{profile.requests_concurrency}", streams}
    )
    return {
        "tether_info": frozenset(many_requests | {streams}),
        "tether_otel": frozenset(many_requests | {"paced"}),
        # Asking for usage costs per streaming request (the body's rewrite, the usage event
        # taken out) and, if at all, per event (the filter's look at each chunk).
        "tether_nousage": frozenset({streams, f"relay_{profile.relay_streams_variants}", "paced"}),
        # The compiled data plane saves per event (both paces: one event per read, and the
        # many streams where tether's core is busiest) and per request.
        "tether_pure": frozenset(many_requests | {streams, "paced", "paced_256"}),
        # A second worker matters where one core is the limit: saturated relays, many
        # streams, many requests.
        "nginx_2w": two_workers,
        "tether_2w": two_workers,
        # The floor relays and answers; it has no disconnect handling to measure.
        "aiohttp_floor": frozenset(many_requests | {streams, "paced", "paced_256"}),
    }


def machine() -> dict[str, Any]:
    cpu = next(
        (
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        ),
        platform.processor(),
    )
    memory_kib = int(Path("/proc/meminfo").read_text().split()[1])
    nginx = subprocess.run(
        [nginx_binary(), "-v"], capture_output=True, text=True, check=False
    ).stderr.strip()
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "memory_gib": round(memory_kib / 2**20, 1),
        "kernel": platform.release(),
        "python": platform.python_version(),
        "nginx": nginx.removeprefix("nginx version: "),
        "core_split": f"proxy (nginx master+worker, tether) on core {PROXY_CORE}; "
        f"fake engine, load generator and runner on core {CLIENT_CORE}; "
        "nginx_2w and tether_2w on both",
    }


def progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def run_round(
    number: int,
    workloads: dict[str, Workload],
    variants: dict[str, frozenset[str]],
    engine: Engine,
    systems: dict[str, System],
) -> report.Results:
    """Every workload on every system, interleaved so that noise hits all systems alike; then,
    with tether_otel, the spans its requests left at the engine's trace sink."""
    results: report.Results = {}
    for key, workload in workloads.items():
        results[key] = {}
        for name, system in systems.items():
            if name in variants and key not in variants[name]:
                continue
            began = time.monotonic()
            results[key][name] = workload(engine, system)
            progress(f"round {number}  {key:<14} {name:<12} {time.monotonic() - began:5.1f}s")
    traced = [
        by_system["tether_otel"] for by_system in results.values() if "tether_otel" in by_system
    ]
    if traced:
        # Not a workload: the round's spans, which show that tracing really exported. The
        # engine (and its count) is the round's own.
        requests_traced = sum(int(figures["requests_sent"] or 0) for figures in traced)
        results[report.SPANS] = {"tether_otel": spans_exported(engine, requests_traced)}
    return results


def keep_logs(tmp: Path, destination: Path) -> None:
    """Keep the processes' logs and nginx's config: they explain odd figures."""
    for path in tmp.rglob("*"):
        if path.suffix in (".log", ".conf"):
            target = destination / path.relative_to(tmp)
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(path, target)


def run(
    profile: Profile,
    mode: str,
    system_names: list[str],
    workload_names: list[str],
    rounds: int,
    results_dir: Path,
) -> Path:
    nofile = raise_nofile()
    # A proxy holds two descriptors per stream: the client's and the upstream's.
    max_streams = (nofile - DESCRIPTOR_RESERVE) // 2
    os.sched_setaffinity(0, {CLIENT_CORE})
    load_before = Path("/proc/loadavg").read_text().split()[:3]
    started = datetime.datetime.now(datetime.UTC)
    stem = f"{started:%Y%m%dT%H%M%SZ}"
    results_dir.mkdir(parents=True, exist_ok=True)
    workloads = {
        key: workload
        for key, workload in plan(profile, max_streams).items()
        if key.split("_")[0] in workload_names
    }
    variants = variant_workloads(profile)
    every_round: list[report.Results] = []
    with tempfile.TemporaryDirectory(prefix="tether-bench-") as tmp:
        for round_number in range(1, rounds + 1):
            round_dir = Path(tmp) / f"round-{round_number}"
            round_dir.mkdir()
            with all_systems(round_dir, system_names, nofile) as (engine, systems):
                every_round.append(run_round(round_number, workloads, variants, engine, systems))
        keep_logs(Path(tmp), results_dir / f"{stem}-logs")
    results = report.combine_rounds(every_round)
    report.add_deltas(results)
    meta = machine() | {
        "date": started.isoformat(timespec="seconds"),
        "mode": mode,
        "rounds": rounds,
        "nofile": nofile,
        # Other work on the machine shows up here; the CPU-per-event figures resist it best.
        "loadavg_before": load_before,
        "loadavg_after": Path("/proc/loadavg").read_text().split()[:3],
    }
    if any(name.startswith("tether") for name in system_names):
        meta["tether_extensions"] = f"tether {tether_extensions()}" + (
            f", tether_pure {tether_extensions(pure=True)}" if "tether_pure" in system_names else ""
        )
    print(report.render(meta, results))
    path = results_dir / f"{stem}.json"
    path.write_text(
        json.dumps(
            {
                "meta": meta,
                "results": results,
                "rounds": every_round,
                "targets": report.targets(results),
                "table": report.render_table(results),
            },
            indent=2,
        )
    )
    print(f"\nresults: {path}")
    return path
