"""The cores a process may use: its CPU affinity, capped by its cgroup's CPU quota.

``os.cpu_count()`` counts the machine's cores, not the ones a job was given: under Slurm's
``--cpus-per-task`` binding, ``taskset`` or ``numactl`` a rank may run on 4 of 128 cores,
and in a container with ``--cpus 8`` its cgroup lets it run 8 cores' worth of time on any of
them. Threads sized by the machine then oversubscribe the job's share many times over.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")
"""Where the cgroup file system is mounted (v2's ``cpu.max``, v1's ``cpu/cpu.cfs_*``)."""


def cgroup_quota(root: Path = CGROUP_ROOT) -> float | None:
    """Cores' worth of CPU time the cgroup allows (``quota / period``), or None if unlimited.

    Args:
        root: The cgroup mount (a test's stand-in).
    """
    try:
        v2 = root / "cpu.max"  # cgroup v2: "QUOTA PERIOD", or "max PERIOD" for none
        if v2.exists():
            fields = v2.read_text().split()
            if len(fields) >= 2 and fields[0] != "max":
                return int(fields[0]) / int(fields[1])
            return None
        quota_file = root / "cpu" / "cpu.cfs_quota_us"  # cgroup v1: -1 for none
        period_file = root / "cpu" / "cpu.cfs_period_us"
        if quota_file.exists() and period_file.exists():
            quota, period = int(quota_file.read_text()), int(period_file.read_text())
            return quota / period if quota > 0 and period > 0 else None
    except (OSError, ValueError, ZeroDivisionError):
        return None  # unreadable or malformed: no limit known
    return None


def usable_cpus(root: Path = CGROUP_ROOT) -> int:
    """The cores this process may use: its affinity, capped by the cgroup's quota, >= 1.

    Args:
        root: The cgroup mount (a test's stand-in).
    """
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # no affinity on this platform
        cores = os.cpu_count() or 1
    quota = cgroup_quota(root)
    if quota is not None:
        cores = min(cores, max(1, math.floor(quota)))
    return max(1, cores)


__all__ = ["CGROUP_ROOT", "cgroup_quota", "usable_cpus"]
