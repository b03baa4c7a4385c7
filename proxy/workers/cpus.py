"""How many CPUs this process may use: what `TETHER_WORKERS=auto` resolves to.

`os.cpu_count()` is the host's count; a container is held to fewer by its CPU affinity (a
Kubernetes static CPU policy, `taskset`, `docker --cpuset-cpus`) and, more often, by a CFS
quota (`resources.limits.cpu`, `docker --cpus`), which cgroup v2 shows in `cpu.max`.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

from ..settings import AUTO, WorkerCount

CGROUP_CPU_MAX = Path("/sys/fs/cgroup/cpu.max")


def usable_cpus(cpu_max: Path = CGROUP_CPU_MAX) -> int:
    """The CPUs in this process's affinity, capped by the cgroup's quota; at least 1."""
    count = len(os.sched_getaffinity(0))
    quota = cgroup_quota_cpus(cpu_max)
    if quota is not None:
        count = min(count, quota)
    return max(1, count)


def cgroup_quota_cpus(cpu_max: Path) -> int | None:
    """`cpu.max`'s quota in whole CPUs (rounded up: a limit of 1.5 CPUs keeps 2 busy), or
    None without one (no cgroup v2, or `max`)."""
    try:
        fields = cpu_max.read_text().split()
    except OSError:
        return None
    if len(fields) != 2 or fields[0] == "max":
        return None
    quota, period = int(fields[0]), int(fields[1])
    return max(1, math.ceil(quota / period))


def worker_count(setting: WorkerCount) -> int:
    """TETHER_WORKERS as a number of processes."""
    return usable_cpus() if setting == AUTO else int(setting)
