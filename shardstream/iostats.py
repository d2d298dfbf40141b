"""I/O counters: what this process has asked of storage, for telling a slow run's cause.

One `IOStats`, `io_stats`, per process, added to from every thread that reads: the
store's reads, the retries of `RetryPolicy`, the shard cache's hits and misses. A
thread that reads for a dataset counts into an `IOStats` of the dataset's as well
(`count_into`, `counted_in`; a pool's threads where the thread that made it counts,
`counting_here`): an iteration's own, which the dataset takes into its counts as it goes
(`drain`; `StreamingDataset.io_stats`), and the head start's on the next iteration
(headstart.py). Snapshots of the process's counters could not tell one iteration's reads
from another's, or another dataset's: iterations open at once (a peek mid-epoch, torch
beginning a persistent worker's next iteration before closing the last) counted reads
twice, or none.
It imports nothing of shardstream, so that every layer doing storage work (the store,
the retries, the cache) counts into it without depending on the others.
"""

from __future__ import annotations

import contextlib
import os
import threading
from dataclasses import dataclass
from typing import Callable, Iterator

__all__ = ["IOStats", "count_into", "counted_in", "counting_here", "counting_into", "io_stats"]


@dataclass
class IOStats:
    """What this process asked of storage: read them to tell a slow run's cause.

    `wait_s` is time spent inside storage calls (in the worker's reading thread or its
    prefetch threads); `cache_*` count shard lookups in a local cache; `readahead_waits`
    counts the pieces a reader had to wait for with its read-ahead window at its largest
    (readahead.py): storage latency the window could not cover at the reader's rate.
    `remote_bytes` are what remote storage sent: with a cache, `bytes` counts the cached
    copies' reads too; from a server that ignores Range, whole files for the ranges asked
    (more than `bytes`), and none for a piece of a file kept from such an answer.
    """

    requests: int = 0
    bytes: int = 0
    remote_bytes: int = 0
    retries: int = 0
    wait_s: float = 0.0
    cache_hits: int = 0
    cache_misses: int = 0
    readahead_waits: int = 0

    def add(self, **amounts: float) -> None:
        counters = [self]
        if self is io_stats:  # the process's counters, and those this thread counts for (`count_into`)
            into = getattr(_counting, "into", None)
            if into is not None:
                counters.append(into)
        with _stats_lock:
            for counted in counters:
                for name, amount in amounts.items():
                    setattr(counted, name, getattr(counted, name) + amount)

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
    """Count what the calling thread asks of storage into `stats` from now on, besides the
    process's `io_stats` (None: into `io_stats` alone again)."""
    _counting.into = stats


def counting_into() -> IOStats | None:
    """Where the calling thread counts besides `io_stats` (`count_into`), if anywhere."""
    return getattr(_counting, "into", None)


@contextlib.contextmanager
def counted_in(stats: IOStats) -> Iterator[None]:
    """Within the block, the calling thread counts into `stats`; then where it counted before."""
    before = counting_into()
    _counting.into = stats
    try:
        yield
    finally:
        _counting.into = before


def counting_here() -> Callable[[], None]:
    """A thread pool's initializer that makes its threads count where the calling thread
    counts now: a dataset's iteration counts its reads in its own `IOStats`, its reading
    threads' too, so that what another iteration or dataset of the process reads meanwhile
    is not its (dataset.py)."""
    into = getattr(_counting, "into", None)
    return lambda: count_into(into)


def _new_lock_in_child() -> None:
    """A forked child gets a lock of its own: a thread of the parent may have held this one
    at the fork (a reading thread counting), and the child's first snapshot would wait on
    it forever."""
    global _stats_lock
    _stats_lock = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_new_lock_in_child)
