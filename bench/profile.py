"""Profile tether with py-spy under one workload and print where its CPU goes.

`python -m bench.profile [--workload relay|paced|requests|streams] [--log-level warning|info]
[--no-usage]` starts the
fake engine and tether as the benchmark does, samples tether with `py-spy record` while the
load generator runs, and prints the functions with the most samples: by self time (where
the CPU is spent) and inclusive (which call paths it is spent under). The raw collapsed
stacks are kept in bench/results/ for a flame graph. Needs `pip install py-spy`.
"""

from __future__ import annotations

import argparse
import collections
import datetime
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.runner import raise_nofile
from bench.systems import CLIENT_CORES, engine, pinned, tether
from bench.workloads import FULL, paced_latency, relay, request_overhead, stream_overhead

SAMPLE_RATE_HZ = 250
LINE_NUMBER = re.compile(r":\d+\)$")
SITE_PACKAGES = re.compile(r"\(/\S*?/(site-packages|python3\.\d+)/")


def function_of(frame: str) -> str:
    """`name (path:line)` → `name (short path)`, so all lines of a function count together."""
    frame = LINE_NUMBER.sub(")", frame)
    return SITE_PACKAGES.sub("(", frame.replace(str(Path.cwd()) + "/", ""))


def top_functions(collapsed: Path, count: int) -> str:
    self_samples: collections.Counter[str] = collections.Counter()
    inclusive: collections.Counter[str] = collections.Counter()
    total = 0
    for line in collapsed.read_text().splitlines():
        stack, _, samples = line.rpartition(" ")
        frames = [
            function_of(f) for f in stack.split(";") if not f.startswith(("process ", "thread "))
        ]
        if not frames:
            continue
        total += int(samples)
        self_samples[frames[-1]] += int(samples)
        for frame in set(frames):
            inclusive[frame] += int(samples)
    # Frames in every sample (the entry point, the event loop's run call) say nothing.
    shared = {frame for frame, samples in inclusive.items() if samples == total}
    lines = [f"{total} samples at {SAMPLE_RATE_HZ} Hz", "", "self (where the CPU is spent):"]
    lines += [f"{100 * n / total:5.1f}%  {f}" for f, n in self_samples.most_common(count)]
    lines += ["", "inclusive (the call paths it is spent under):"]
    lines += [
        f"{100 * n / total:5.1f}%  {f}"
        for f, n in inclusive.most_common(count + len(shared))
        if f not in shared
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.profile", description=__doc__)
    parser.add_argument(
        "--workload", choices=("relay", "paced", "requests", "streams"), default="relay"
    )
    parser.add_argument("--log-level", choices=("warning", "info"), default="warning")
    parser.add_argument(
        "--no-usage", action="store_true", help="TETHER_ASK_FOR_USAGE=false (tether_nousage)"
    )
    parser.add_argument("--top", type=int, default=15)
    parser.add_argument(
        "--native", action="store_true", help="sample C frames too (uvloop, libuv, the kernel)"
    )
    args = parser.parse_args()
    beside = Path(sys.executable).with_name("py-spy")  # the venv's, when not on PATH
    py_spy = str(beside) if beside.exists() else shutil.which("py-spy")
    if py_spy is None:
        parser.error("py-spy is not installed: pip install py-spy")
    nofile = raise_nofile()
    os.sched_setaffinity(0, CLIENT_CORES)
    stamp = f"{datetime.datetime.now(datetime.UTC):%Y%m%dT%H%M%SZ}"
    output = Path(__file__).parent / "results" / f"{stamp}-profile-{args.workload}.txt"
    output.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="tether-profile-") as tmp:
        with (
            engine(Path(tmp)) as fake_engine,
            tether(
                Path(tmp),
                fake_engine.port,
                name="tether",
                log_level=args.log_level,
                ask_for_usage=not args.no_usage,
            ) as system,
        ):
            assert system.proxy_pid is not None
            pid, rate = str(system.proxy_pid), str(SAMPLE_RATE_HZ)
            native = ["--native"] if args.native else []
            sampler = subprocess.Popen(
                [py_spy, "record", *native, "-p", pid, "-r", rate, "-f", "raw", "-o", str(output)],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                preexec_fn=pinned(CLIENT_CORES),
            )
            if args.workload == "relay":
                figures = relay(FULL, fake_engine, system, streams=64)
            elif args.workload == "paced":
                figures = paced_latency(FULL, fake_engine, system, FULL.paced)
            elif args.workload == "streams":
                figures = stream_overhead(FULL, fake_engine, system, clients=32)
            else:
                figures = request_overhead(FULL, fake_engine, system, clients=32)
            sampler.send_signal(signal.SIGINT)  # py-spy writes its file on SIGINT
            sampler.wait(timeout=30)
    print(f"tether under {args.workload} (log level {args.log_level}), descriptor limit {nofile}")
    print({key: round(value, 2) for key, value in figures.items() if isinstance(value, float)})
    print(top_functions(output, args.top))
    print(f"\ncollapsed stacks: {output}")


if __name__ == "__main__":
    main()
