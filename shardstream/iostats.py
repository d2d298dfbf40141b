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
import weakref
from dataclasses import dataclass
from typing import Any, Generator

__all__ = ["IOStats", "Tally", "count_into", "io_stats"]


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


class Tally:
    """How far one dataset has taken this process's `io_stats` into its own counts: one mark
    for all its iterations in the process, each count taking the span from the mark to now.
    Iterations open at once (a peek with `next(iter(ds))` mid-epoch, `zip(ds, ds)`, torch
    beginning a persistent worker's next iteration before closing the last, whose reads in
    flight end as it closes) then count every read once; a snapshot per iteration counted
    them twice, and a clamp to the newest iteration's start lost what came after it ended."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._mark: dict[str, float] | None = None
        self._open: "weakref.WeakSet[Generator[Any, None, None]]" = weakref.WeakSet()

    def begin(self) -> None:
        """An iteration begins: where none of the dataset's is open in this process, what the
        process read since is not the dataset's (another dataset's, between epochs)."""
        with self._lock:
            if not any(iteration.gi_frame is not None for iteration in self._open):  # a frame: not ended
                self._mark = io_stats.snapshot()

    def track(self, iteration: Generator[Any, None, None]) -> None:
        """`iteration` is open until it ends (or, never begun, is let go)."""
        with self._lock:
            self._open.add(iteration)

    def take(self) -> tuple[dict[str, float], dict[str, float]]:
        """The span of `io_stats` not yet counted, (from, to); the mark moves to its end."""
        with self._lock:
            now = io_stats.snapshot()
            start, self._mark = self._mark if self._mark is not None else now, now
            return start, now


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
