"""The sample keys a `ShardWriter` has written: one written twice is refused, in bounded memory.

A set of every key cost 117-120 bytes a sample of a writer's peak memory: about 47 GB
for one writer of LAION's 400M samples. Here the keys of the shard being written are
held as they are (a set), and those of finished shards as sorted 64-bit hashes, 8
bytes a key, in a few runs merged as they grow (a new run joins the one before it
while that one is not larger than twice it, so there are about log2(shards) runs).

A key is still refused at its `write`, before anything of it is queued, so the writer
goes on after a refusal as before. Looking a key up in every run costs 2.3 us a run,
more than a small sample's whole write (11-16 us) once there are a few runs, so a
filter of bits goes first: one bit a hash, set for each finished key, at least 32 bits
a finished key (4 to 8 bytes a key, rebuilt as it fills), which passes 1.5-3% of new
keys on to the runs. All told, 1.2 us a key more than a set (1.6 against 0.4 us, 1M
keys in shards of 10k, one process).

Python's `hash` of a `str` is what is kept: 64 bits, cached on the string, and the same
for equal strings within a process, which is all a writer needs (it is salted per
process). A hash shared by two different keys (about once in 230 writers of 400M
samples) is told apart from a key written twice by the keys themselves, read back from
the finished shards' indexes: they must stay readable while the writer writes.
"""

from __future__ import annotations

from typing import Callable, Iterable, Iterator

import numpy as np

from .errors import DuplicateKeyError

__all__ = ["SeenKeys"]

BITS_PER_KEY = 32  # at least, in the filter over finished keys: 1 - exp(-1/32), 3% of new keys pass, at worst
_MIN_FILTER_BITS = 1 << 16


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
        self._finished = 0
        self._filter = np.zeros(_MIN_FILTER_BITS // 8, dtype=np.uint8)  # bit (hash mod size) set: maybe seen
        self._filter_bytes = memoryview(self._filter)  # indexed per key: a memoryview's ints come cheaper
        self._mask = _MIN_FILTER_BITS - 1

    def check_new(self, key: str) -> None:
        """Refuse `key` if a sample written before has it: one of the shard being written, or
        of a finished shard (naming it)."""
        if key in self._open:
            raise DuplicateKeyError("duplicate sample key", key=key)
        if self._finished:
            bit = self._hash(key) & self._mask
            if self._filter_bytes[bit >> 3] >> (bit & 7) & 1 and self._in_runs(key):
                self._refuse_if_written(key)

    def add(self, key: str) -> None:
        """Count `key` as a sample of the shard being written (checked by `check_new`)."""
        self._open.add(key)

    def seal(self) -> None:
        """The shard being written is finished: keep its keys as hashes."""
        if not self._open:
            return
        run = np.fromiter(map(self._hash, self._open), dtype=np.int64, count=len(self._open))
        run.sort()
        self._open = set()
        self._finished += len(run)
        if self._finished * BITS_PER_KEY > self._mask + 1:
            self._grow_filter()  # from the runs before this one
        self._set_bits(run)
        while self._runs and len(self._runs[-1]) <= 2 * len(run):
            # Grown in place and sorted again (timsort merges the two sorted halves in one pass):
            # a new array for the merge would hold both runs twice over, 19 bytes a key at the peak.
            merged = self._runs.pop()
            size = len(merged)
            merged.resize(size + len(run), refcheck=False)
            merged[size:] = run
            merged.sort(kind="stable")
            run = merged
        self._runs.append(run)

    def _grow_filter(self) -> None:
        bits = _MIN_FILTER_BITS
        while bits < self._finished * BITS_PER_KEY:
            bits *= 2
        self._filter = np.zeros(bits // 8, dtype=np.uint8)
        self._filter_bytes = memoryview(self._filter)
        self._mask = bits - 1
        for run in self._runs:
            self._set_bits(run)

    def _set_bits(self, hashes: np.ndarray) -> None:
        bits = hashes & self._mask  # two's complement: the low bits, also of negative hashes
        np.bitwise_or.at(self._filter, bits >> 3, (1 << (bits & 7)).astype(np.uint8))

    def _in_runs(self, key: str) -> bool:
        h = self._hash(key)
        for run in self._runs:
            at = int(np.searchsorted(run, h))
            if at < len(run) and run[at] == h:
                return True
        return False

    def _refuse_if_written(self, key: str) -> None:
        """Raise if a finished shard has `key`, whose hash one of theirs has; else it shares
        the hash with another key, and passes."""
        for shard, keys in self._written_keys():
            if key in keys:
                raise DuplicateKeyError(f"duplicate sample key: written before, to {shard}", key=key)
