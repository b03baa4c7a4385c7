"""CPU time and resident memory of a process and its descendants, read from /proc.

nginx is a master with a worker child, so a proxy's cost is always the sum over its tree.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
PAGE_SIZE = os.sysconf("SC_PAGE_SIZE")


def process_tree(pid: int) -> list[int]:
    """`pid` and every live descendant."""
    pids = [pid]
    for current in pids:
        for task in Path(f"/proc/{current}/task").glob("*"):
            try:
                pids.extend(int(child) for child in (task / "children").read_text().split())
            except OSError:
                continue  # the task exited while we walked
    return pids


def cpu_seconds(pid: int) -> float:
    """User plus system CPU seconds of the tree, all threads included."""
    ticks = 0
    for member in process_tree(pid):
        try:
            stat = Path(f"/proc/{member}/stat").read_text()
        except OSError:
            continue
        # The command name may contain spaces; fields after it are fixed (proc(5)).
        fields = stat.rsplit(")", 1)[1].split()
        ticks += int(fields[11]) + int(fields[12])
    return ticks / CLOCK_TICKS


def rss_bytes(pid: int) -> int:
    """Resident set size of the tree."""
    pages = 0
    for member in process_tree(pid):
        try:
            pages += int(Path(f"/proc/{member}/statm").read_text().split()[1])
        except OSError:
            continue
    return pages * PAGE_SIZE


def busy_seconds_per_core() -> list[float]:
    """CPU seconds each core has spent on anything but idling, since boot (proc(5))."""
    busy: list[float] = []
    for line in Path("/proc/stat").read_text().splitlines():
        name, *ticks = line.split()
        if not name.startswith("cpu") or name == "cpu":
            continue
        user, nice, system, _idle, _iowait, irq, softirq, steal = (int(t) for t in ticks[:8])
        busy.append((user + nice + system + irq + softirq + steal) / CLOCK_TICKS)
    return busy


def wait_for_quiet(give_up_s: float, threshold: float = 0.25, sample_s: float = 0.3) -> float:
    """Wait until no core is busier than `threshold` (we are idle now, so it is others' work).

    The machine may be shared; starting a measurement while another job holds a core would
    charge that job's noise to whichever system happens to run. Returns the seconds waited.
    """
    started = time.monotonic()
    while True:
        before = busy_seconds_per_core()
        time.sleep(sample_s)
        after = busy_seconds_per_core()
        if all((b - a) / sample_s <= threshold for a, b in zip(before, after, strict=True)):
            return time.monotonic() - started
        if time.monotonic() - started > give_up_s:
            return time.monotonic() - started


def settle(pid: int, give_up_s: float, threshold: float = 0.1, sample_s: float = 0.3) -> float:
    """Wait until the process tree uses under `threshold` of a core; returns the CPU seconds
    it used meanwhile (the work a burst left behind, which would leak into the next window)."""
    started, deadline = cpu_seconds(pid), time.monotonic() + give_up_s
    while True:
        before = cpu_seconds(pid)
        time.sleep(sample_s)
        after = cpu_seconds(pid)
        if (after - before) / sample_s < threshold or time.monotonic() > deadline:
            return after - started
