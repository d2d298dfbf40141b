"""How many CPUs this process may use: its affinity, and its cgroup's CPU quota.

`os.cpu_count()` counts the machine's: in a Kubernetes pod limited to 4 CPUs of a 128-core
node, or under `taskset`, a default of one worker a CPU started 128 (`pack`), and a rate
bounded by 4 CPUs' time read as "4 of 128 CPUs busy" (`bench`). Linux only says more;
elsewhere the machine's count stands.
"""

from __future__ import annotations

import math
import os

__all__ = ["cpu_quota", "cpus_here", "usable_cpus"]


def usable_cpus() -> int:
    """The CPUs' worth this process may use, at least 1: its affinity's, or its cgroup's
    quota where that is less (rounded up: a quota of 1.5 CPUs is work for 2 processes)."""
    cpus = cpus_here() or 1
    quota = cpu_quota()
    return max(1, min(cpus, math.ceil(quota))) if quota else cpus


def cpus_here() -> int | None:
    """CPUs this process may run on (its affinity where the OS says, else the machine's)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count()


def cpu_quota(proc_cgroup: str = "/proc/self/cgroup", mount: str = "/sys/fs/cgroup") -> float | None:
    """CPUs' worth of time this process's cgroup may use (Docker's ``--cpus``, a Kubernetes CPU
    limit), the least along its cgroup path; None where none is set or Linux has no cgroups.

    A quota leaves the affinity as it was: in a pod limited to 2 CPUs of a 64-core node this
    process may run on 64 CPUs but gets 2 CPUs' time, and a rate bounded by that read as "2 of
    64 CPUs busy: not CPU-bound". cgroup v2 says it in ``cpu.max`` ("max 100000" or "200000
    100000"), v1 in ``cpu.cfs_quota_us`` (-1: none) over ``cpu.cfs_period_us``. In a
    container the hierarchy mounted at `mount` is often the container's own cgroup while
    `proc_cgroup` names it from the host's root, so each ancestor that exists is read."""
    try:
        with open(proc_cgroup) as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    quotas = []
    for line in lines:
        _, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        if controllers == "":  # cgroup v2 (alone, or the unified one beside v1's)
            tops = [mount, os.path.join(mount, "unified")]
        elif "cpu" in controllers.split(","):
            tops = [os.path.join(mount, controllers), os.path.join(mount, "cpu")]
        else:
            continue
        parts = [p for p in path.split("/") if p]
        for top in dict.fromkeys(tops):
            for depth in range(len(parts) + 1):
                quota = quota_in(os.path.join(top, *parts[:depth]))
                if quota is not None:
                    quotas.append(quota)
    return min(quotas) if quotas else None


def quota_in(folder: str) -> float | None:
    """The CPU quota one cgroup folder sets, in CPUs (None: none, or no such folder)."""
    try:
        with open(os.path.join(folder, "cpu.max")) as f:
            limit, period = (f.read().split() + ["100000"])[:2]
        if limit == "max":
            return None
        return int(limit) / int(period) if int(limit) > 0 and int(period) > 0 else None
    except (OSError, ValueError):
        pass
    try:
        with open(os.path.join(folder, "cpu.cfs_quota_us")) as f:
            limit = f.read().strip()
        with open(os.path.join(folder, "cpu.cfs_period_us")) as f:
            period = f.read().strip()
        return int(limit) / int(period) if int(limit) > 0 and int(period) > 0 else None
    except (OSError, ValueError):
        return None
