"""I/O counters: what this process has asked of storage, for telling a slow run's cause.

One `IOStats`, `io_stats`, per process, added to from every thread that reads: the
store's reads, the retries of `RetryPolicy`, the shard cache's hits and misses. A
dataset reports the difference between two snapshots (`StreamingDataset.io_stats`).
A thread that reads for a dataset between its iterations (the head start on the next
one, headstart.py) counts into an `IOStats` of its own instead (`count_into`), which
the dataset's next count takes (`drain`): between two iterations no snapshot of the
process's counters can tell its reads from another dataset's.
It imports nothing of shardstream, so that every layer doing storage work (the store,
the retries, the cache) counts into it without depending on the others.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass

__all__ = ["IOStats", "count_into", "io_stats"]


@dataclass
class IOStats:
    """What this process asked of storage: read them to tell a slow run's cause.

    `wait_s` is time spent inside storage calls (in the worker's reading thread or its
    prefetch threads); `cache_*` count shard lookups in a local cache; `readahead_waits`
    counts the pieces a reader had to wait for with its read-ahead window at its largest
    (readahead.py): storage latency the window could not cover at the reader's rate.
    """

    requests: int = 0
    bytes: int = 0
    retries: int = 0
    wait_s: float = 0.0
    cache_hits: int = 0
    cache_misses: int = 0
    readahead_waits: int = 0

    def add(self, **amounts: float) -> None:
        into = self
        if self is io_stats:  # the process's counters, unless this thread counts elsewhere
            into = getattr(_counting, "into", None) or self
        with _stats_lock:
            for name, amount in amounts.items():
                setattr(into, name, getattr(into, name) + amount)

    def snapshot(self) -> dict[str, float]:
        with _stats_lock:
            return dict(self.__dict__)

    def drain(self) -> dict[str, float]:
        """The counts so far, and start again from zero, in one step."""
        with _stats_lock:
            counts = dict(self.__dict__)
            for name in self.__dict__:
                setattr(self, name, type(getattr(self, name))())
            return counts

    def reset(self) -> None:
        with _stats_lock:
            for name in self.__dict__:
                setattr(self, name, type(getattr(self, name))())


_stats_lock = threading.Lock()
io_stats = IOStats()
_counting = threading.local()


def count_into(stats: IOStats | None) -> None:
    """Count what the calling thread asks of storage into `stats` from now on, not into the
    process's `io_stats` (None: into `io_stats` again)."""
    _counting.into = stats


def _new_lock_in_child() -> None:
    """A forked child gets a lock of its own: a thread of the parent may have held this one
    at the fork (a reading thread counting), and the child's first snapshot would wait on
    it forever."""
    global _stats_lock
    _stats_lock = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_new_lock_in_child)
