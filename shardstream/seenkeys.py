"""The sample keys a `ShardWriter` has written: one written twice is refused, in bounded memory.

A set of every key cost about 107 bytes a key: 43 GB for a writer of LAION's 400M
samples. Here the keys of the shard being written are held as they are (a key repeated
within a shard is refused at its `write`), and those of finished shards as sorted
64-bit hashes, 8 bytes a key, which each frame's keys are checked against together,
before the frame is written: checked one at a time, a key would cost more than its
write (2.3 us a lookup in one sorted array, against 16 us for a small sample's write).
Finished shards' hashes are kept in a few sorted runs, merged as they grow (a new run
joins the one before it while that one is not larger than twice its size), so that a
check makes a vectorised search in each of about log2(shards) runs.

Python's `hash` of a `str` is what is kept: 64 bits, cached on the string (the set of
the shard being written has already computed it), and the same for equal strings
within a process, which is all a writer needs (it is salted per process). A hash shared
by two different keys (about once in 230 writers of 400M samples) is told apart from a
key written twice by the keys themselves, read back from the finished shards' indexes.
"""

from __future__ import annotations

from typing import Callable, Iterable, Iterator, Sequence

import numpy as np

from .errors import ShardstreamError

__all__ = ["SeenKeys"]


class SeenKeys:
    """The keys of the samples written so far.

    `written_keys` yields (shard name, its keys) for every finished shard, in order: it
    is read only to tell a hash shared by two keys from a key written twice.
    """

    def __init__(self, written_keys: Callable[[], Iterator[tuple[str, Iterable[str]]]], *,
                 hash_key: Callable[[str], int] = hash) -> None:
        self._written_keys = written_keys
        self._hash = hash_key
        self._open: set[str] = set()  # the shard being written
        self._runs: list[np.ndarray] = []  # finished shards' hashes: sorted int64, larger runs first

    def check_new(self, key: str) -> None:
        """Refuse `key` if a sample of the shard being written has it."""
        if key in self._open:
            raise ShardstreamError("duplicate sample key", key=key)

    def add(self, key: str) -> None:
        """Count `key` as a sample of the shard being written (checked by `check_new`)."""
        self._open.add(key)

    def check_finished(self, keys: Sequence[str]) -> None:
        """Refuse the first of `keys` (a frame's) that a finished shard holds, naming it."""
        if not self._runs or not keys:
            return
        hashes = np.fromiter(map(self._hash, keys), dtype=np.int64, count=len(keys))
        seen = np.zeros(len(keys), dtype=bool)
        for run in self._runs:
            at = np.searchsorted(run, hashes).clip(max=len(run) - 1)
            seen |= run[at] == hashes
        if seen.any():
            self._refuse_if_written([keys[i] for i in np.flatnonzero(seen).tolist()])

    def seal(self) -> None:
        """The shard being written is finished: keep its keys as hashes."""
        if not self._open:
            return
        run = np.fromiter(map(self._hash, self._open), dtype=np.int64, count=len(self._open))
        run.sort()
        self._open = set()
        while self._runs and len(self._runs[-1]) <= 2 * len(run):
            run = np.sort(np.concatenate((self._runs.pop(), run)), kind="stable")
        self._runs.append(run)

    def _refuse_if_written(self, candidates: list[str]) -> None:
        """Raise for the first of `candidates` (keys whose hash a finished shard holds) that a
        finished shard has; the others share a hash with another key, and pass."""
        wanted = set(candidates)
        written_to: dict[str, str] = {}  # key -> the first finished shard that has it
        for shard, keys in self._written_keys():
            for key in wanted.intersection(keys):
                written_to.setdefault(key, shard)
        for key in candidates:
            if key in written_to:
                raise ShardstreamError(f"duplicate sample key: written before, to {written_to[key]}", key=key)
