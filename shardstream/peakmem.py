"""Peak resident memory of a process and the processes it started, sampled in a thread,
and the CPU time they use.

`shardstream bench` reports, for each worker count, the peak RSS of the main process
plus the DataLoader workers it forked. That needs readings of a whole process tree,
often enough to catch the peak, and none while a worker is being forked:

* **The tree.** `TreeRSS.total()` sums the RSS of this process and of its descendants,
  except the pids in `exclude` (processes that are not ours to count). It reads them with
  psutil if installed, else from ``/proc`` (`proc_descendants`: each task's ``children``
  file, or one scan of ``/proc/*/stat`` where the kernel has no such files); where
  neither exists it reads None. `peak_memory_method` says which.
* **The peak.** `PeakSampler` takes a reading every `SAMPLE_INTERVAL_S` in a thread,
  keeping the maximum. `paused()` holds it off while the loader forks its workers, so
  that no fork happens mid-sample.

`TreeRSS.cpu_seconds()` reads the same tree's CPU time (user and system, every thread),
plus that of children that have ended and been waited for (`resource.RUSAGE_CHILDREN`),
so that a worker ending between two readings still counts; `bench` turns two readings
into the CPUs a worker count kept busy.

RSS counts pages shared by forked workers once per process, so the sum overstates what
they use together. Nothing here imports torch or the loader: `bench` only starts,
pauses and stops the sampler, and reads its peak.
"""

from __future__ import annotations

import os
import threading
from typing import Any, Iterable

try:
    import resource
except ImportError:  # not on Windows: ended children then go uncounted
    resource = None  # type: ignore[assignment]

__all__ = ["PeakSampler", "TreeRSS", "peak_memory_method", "proc_descendants"]

SAMPLE_INTERVAL_S = 0.05


def peak_memory_method() -> str:
    """How RSS is read here: ``"psutil"``, ``"/proc"``, or ``"unavailable"``."""
    try:
        import psutil  # noqa: F401

        return "psutil"
    except ImportError:
        pass
    return "/proc" if os.path.exists(f"/proc/{os.getpid()}/status") else "unavailable"


def _proc_rss(pid: int) -> int | None:
    """Resident bytes of `pid` from /proc/<pid>/status (None if it is gone)."""
    try:
        with open(f"/proc/{pid}/status", "rb") as f:
            for line in f:
                if line.startswith(b"VmRSS:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return 0  # a zombie has no VmRSS line


def _listed_children(pid: int) -> list[int] | None:
    """Direct children of `pid` from /proc/<pid>/task/*/children; None where the kernel has no such files."""
    found: list[int] = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return found  # gone
    listed = False
    for task in tasks:
        try:
            with open(f"/proc/{pid}/task/{task}/children", "rb") as f:
                found += [int(c) for c in f.read().split()]
            listed = True
        except OSError:
            continue
    return found if listed else None


def _stat_fields(pid: int | str) -> list[bytes] | None:
    """The fields of /proc/<pid>/stat after "pid (comm) ": state, ppid, ... (None if it is gone).
    The command name may hold spaces and parentheses, so the split starts at its last ")"."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    return stat[stat.rfind(b")") + 2:].split()


def _parents() -> dict[int, list[int]]:
    """Children by parent pid, from one scan of /proc/*/stat."""
    tree: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        fields = _stat_fields(entry)
        try:
            tree.setdefault(int(fields[1]), []).append(int(entry))  # type: ignore[index]
        except (TypeError, ValueError, IndexError):
            continue
    return tree


def proc_descendants(pid: int) -> list[int]:
    """Children, grandchildren... of `pid`, from /proc."""
    out: list[int] = []
    todo = [pid]
    tree: dict[int, list[int]] | None = None
    while todo:
        parent = todo.pop()
        children = _listed_children(parent) if tree is None else None
        if children is None:
            tree = tree if tree is not None else _parents()
            children = tree.get(parent, [])
        out += children
        todo += children
    return out


class TreeRSS:
    """Reads the RSS of this process and of its descendants (except those in `exclude`)."""

    def __init__(self, exclude: Iterable[int] = ()) -> None:
        self.method = peak_memory_method()
        self.pid = os.getpid()
        self.exclude = set(exclude)
        if self.method == "psutil":
            import psutil

            self._psutil = psutil
            self._proc = psutil.Process(self.pid)

    def descendants(self) -> list[int]:
        if self.method == "psutil":
            try:
                return [p.pid for p in self._proc.children(recursive=True)]
            except self._psutil.Error:
                return []
        if self.method == "/proc":
            return proc_descendants(self.pid)
        return []

    def total(self) -> int | None:
        """Bytes resident in this process and its descendants now (None if unavailable)."""
        if self.method == "unavailable":
            return None
        pids = [self.pid] + [p for p in self.descendants() if p not in self.exclude]
        total = 0
        for pid in pids:
            if self.method == "psutil":
                try:
                    total += self._psutil.Process(pid).memory_info().rss
                except self._psutil.Error:
                    continue
            else:
                total += _proc_rss(pid) or 0
        return total


    def cpu_seconds(self) -> float | None:
        """CPU seconds used so far by this process, its descendants (except `exclude`) and its
        ended children (None if unavailable)."""
        if self.method == "unavailable":
            return None
        total = 0.0
        if resource is not None:
            ended = resource.getrusage(resource.RUSAGE_CHILDREN)
            total = ended.ru_utime + ended.ru_stime
        for pid in [self.pid] + [p for p in self.descendants() if p not in self.exclude]:
            if self.method == "psutil":
                try:
                    times = self._psutil.Process(pid).cpu_times()
                except self._psutil.Error:
                    continue
                total += times.user + times.system
            else:
                total += _proc_cpu(pid) or 0.0
        return total


def _proc_cpu(pid: int) -> float | None:
    """User plus system CPU seconds of `pid` from /proc/<pid>/stat (None if it is gone)."""
    fields = _stat_fields(pid)
    if fields is None:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime: fields 14, 15


class PeakSampler:
    """Samples `TreeRSS.total()` in a thread, keeping the maximum.

    `paused()` holds the sampler off (and waits for a sample in progress to finish)
    while the loader forks its workers, so that no fork happens mid-sample.
    """

    def __init__(self, tree: TreeRSS, interval: float = SAMPLE_INTERVAL_S) -> None:
        self.tree = tree
        self.interval = interval
        self.peak: int | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def sample(self) -> None:
        """Take a sample now (from the measuring thread; not while paused by it)."""
        with self._lock:
            self._sample()

    def _sample(self) -> None:
        value = self.tree.total()
        if value is not None and (self.peak is None or value > self.peak):
            self.peak = value

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            with self._lock:
                if self._stop.is_set():
                    break
                self._sample()

    def __enter__(self) -> "PeakSampler":
        self.sample()
        if self.tree.method != "unavailable":
            self._thread = threading.Thread(target=self._run, name="shardstream-bench-rss", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def paused(self) -> threading.Lock:
        return self._lock

