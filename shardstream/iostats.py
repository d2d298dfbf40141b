"""I/O counters: what this process has asked of storage, for telling a slow run's cause.

One `IOStats`, `io_stats`, per process, added to from every thread that reads: the
store's reads, the retries of `RetryPolicy`, the shard cache's hits and misses. A
dataset reports the difference between two snapshots (`StreamingDataset.io_stats`).
It imports nothing of shardstream, so that every layer doing storage work (the store,
the retries, the cache) counts into it without depending on the others.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass

__all__ = ["IOStats", "io_stats"]


@dataclass
class IOStats:
    """What this process asked of storage: read them to tell a slow run's cause.

    `wait_s` is time spent inside storage calls (in the worker's reading thread or its
    prefetch threads); `cache_*` count shard lookups in a local cache.
    """

    requests: int = 0
    bytes: int = 0
    retries: int = 0
    wait_s: float = 0.0
    cache_hits: int = 0
    cache_misses: int = 0

    def add(self, **amounts: float) -> None:
        with _stats_lock:
            for name, amount in amounts.items():
                setattr(self, name, getattr(self, name) + amount)

    def snapshot(self) -> dict[str, float]:
        with _stats_lock:
            return dict(self.__dict__)

    def reset(self) -> None:
        with _stats_lock:
            for name in self.__dict__:
                setattr(self, name, type(getattr(self, name))())


_stats_lock = threading.Lock()
io_stats = IOStats()


def _new_lock_in_child() -> None:
    """A forked child gets a lock of its own: a thread of the parent may have held this one
    at the fork (a reading thread counting), and the child's first snapshot would wait on
    it forever."""
    global _stats_lock
    _stats_lock = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_new_lock_in_child)
