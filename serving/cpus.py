"""How many cores this process may use: its CPU affinity, bounded by its cgroup's CPU quota.

torch sizes its thread pool from the host's cores, not from a container's limit: in a pod limited to
2 CPUs on a 64-core node it would start 64 threads that share 2 cores' time. A service's default
thread count comes from here instead.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

_CGROUP_V2 = Path("/sys/fs/cgroup/cpu.max")
_CGROUP_V1 = (Path("/sys/fs/cgroup/cpu/cpu.cfs_quota_us"), Path("/sys/fs/cgroup/cpu/cpu.cfs_period_us"))


def cgroup_quota(v2: Path = _CGROUP_V2, v1: tuple[Path, Path] = _CGROUP_V1) -> float | None:
    """The cgroup's CPU quota in cores (cgroup v2's cpu.max, else v1's CFS quota), or None without one."""
    try:
        quota, _, period = v2.read_text().strip().partition(" ")
        if quota != "max":
            return int(quota) / int(period or "100000")
        return None
    except (OSError, ValueError):
        pass
    try:
        quota_us = int(v1[0].read_text())
        period_us = int(v1[1].read_text())
    except (OSError, ValueError):
        return None
    return quota_us / period_us if quota_us > 0 and period_us > 0 else None


def available_cpus(quota: float | None = None, affinity: int | None = None) -> int:
    """Cores this process may use: the cores it is pinned to, at most its quota rounded up, at least 1."""
    cores = affinity if affinity is not None else len(os.sched_getaffinity(0))
    quota = cgroup_quota() if quota is None else quota
    if quota is not None:
        cores = min(cores, math.ceil(quota))
    return max(1, cores)
