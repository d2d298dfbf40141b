"""Serving a planned order of samples from shards: ranged reads in, reordering out.

The plan (plan.py) says which samples a worker yields and in what order. Reading them
in that order one at a time would cost a storage request per sample; instead the
samples are read in storage order, as runs of consecutive samples (one ranged read per
run of frames), and held until their turn. The plan guarantees that a sample's turn
comes within `buffer` samples of its arrival, which bounds the memory held.
"""

from __future__ import annotations

import threading
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, BinaryIO, Iterable, Iterator

import numpy as np

from .cache import ShardCache
from .errors import ShardstreamError
from .reader import Sample, ShardReader, StreamTarReader
from .source import Source

__all__ = ["read_samples", "reorder", "sample_runs", "pieces"]


def sample_runs(ids: np.ndarray, counts: np.ndarray) -> Iterator[tuple[int, int, int]]:
    """Split global sample ids (any order) into runs (shard, first, stop) of consecutive samples."""
    if not len(ids):
        return
    starts = np.concatenate([[0], np.cumsum(counts)])
    shards = np.searchsorted(starts, ids, side="right") - 1
    local = ids - starts[shards]
    breaks = np.flatnonzero((np.diff(shards) != 0) | (np.diff(local) != 1)) + 1
    bounds = np.concatenate([[0], breaks, [len(ids)]])
    for a, b in zip(bounds[:-1], bounds[1:]):
        yield int(shards[a]), int(local[a]), int(local[b - 1]) + 1


def pieces(runs: Iterable[tuple[int, int, int]], max_samples: int) -> Iterator[tuple[int, int, int]]:
    """Cut runs into pieces of at most `max_samples`, the unit of prefetching."""
    for shard, first, stop in runs:
        for a in range(first, stop, max_samples):
            yield shard, a, min(stop, a + max_samples)


class _Readers:
    """Shard readers of one iteration, opened once each, from any thread.

    With a cache, opening a shard downloads it (once per machine) and holds a shared
    lock on it until `close()`, so it is not evicted while in use.
    """

    def __init__(self, source: Source, cache: ShardCache | None):
        self.source = source
        self.cache = cache
        self._guard = threading.Lock()
        self._entries: dict[int, list[Any]] = {}
        self._locks: list[BinaryIO] = []
        self._shard_locks: dict[int, BinaryIO] = {}

    def get(self, shard: int) -> ShardReader | StreamTarReader:
        with self._guard:
            entry = self._entries.setdefault(shard, [threading.Lock(), None])
        with entry[0]:
            if entry[1] is None:
                ref = self.source.shards[shard]
                if self.cache is not None and not ref.store.local:
                    entry[1], lock = self.cache.open(ref)
                    with self._guard:
                        self._locks.append(lock)
                        self._shard_locks[shard] = lock
                else:
                    entry[1] = ref.reader()
            return entry[1]

    def release(self, shard: int) -> None:
        """Done with `shard`: drop its reader and let the cache evict it."""
        with self._guard:
            entry = self._entries.pop(shard, None)
            lock = self._shard_locks.pop(shard, None)
        if lock is not None:
            lock.close()
            self._locks.remove(lock)
        del entry

    def close(self) -> None:
        with self._guard:
            for lock in self._locks:
                lock.close()
            self._locks.clear()


def read_tolerant(reader: ShardReader | StreamTarReader, first: int, stop: int) -> list[Sample]:
    """Samples [first, stop); a sample that cannot be read becomes ``{"__error__": error, ...}``.

    Used under ``on_error="skip"``: the bad sample keeps its place in the plan and the
    error policy decides what to do with it.
    """
    try:
        return list(reader.read(first, stop))
    except ShardstreamError:
        out: list[Sample] = []
        for i in range(first, stop):
            try:
                out.extend(reader.read(i, i + 1))
            except ShardstreamError as error:
                out.append({"__error__": error, "__key__": error.key or f"#{i}", "__url__": reader.url})
        return out


def read_samples(source: Source, ids: np.ndarray, counts: np.ndarray, prefetch: int = 0,
                 cache: ShardCache | None = None, tolerant: bool = False,
                 piece_bytes: int = 8 << 20) -> Iterator[Sample]:
    """The samples `ids` (global ids), in that order, read run by run.

    With `prefetch` > 0 (indexed sources), up to that many pieces of about
    `piece_bytes` are fetched, decompressed and parsed ahead by background threads
    while the caller works on the current one, and with a `cache` the next `prefetch`
    shards are downloaded ahead: storage latency then overlaps decoding. The threads
    start with the iteration and are joined when it ends or is closed.
    """
    readers = _Readers(source, cache)
    runs = sample_runs(ids, counts)
    read = read_tolerant if tolerant else _read
    try:
        if prefetch <= 0 or not source.indexed:
            work = list(runs)
            last_run = {shard: i for i, (shard, _, _) in enumerate(work)}
            for i, (shard, first, stop) in enumerate(work):
                yield from read(readers.get(shard), first, stop)
                if last_run[shard] == i:
                    readers.release(shard)
            return
        work = list(pieces(runs, max(1, piece_bytes // max(1, source.mean_sample_bytes()))))
        upcoming = list(dict.fromkeys(shard for shard, _, _ in work))  # distinct shards, in order
        rank_of = {shard: i for i, shard in enumerate(upcoming)}
        last_piece = {shard: i for i, (shard, _, _) in enumerate(work)}
        with ThreadPoolExecutor(max_workers=prefetch + (1 if cache else 0),
                                thread_name_prefix="shardstream-prefetch") as pool:
            ahead: deque[tuple[int, Future[list[Sample]]]] = deque()
            opened = 0

            def finish_one() -> list[Sample]:
                i, future = ahead.popleft()
                samples = future.result()
                if last_piece[work[i][0]] == i:
                    readers.release(work[i][0])
                return samples

            try:
                for i, (shard, first, stop) in enumerate(work):
                    if cache is not None:  # download whole shards further ahead than pieces
                        while opened < len(upcoming) and opened <= rank_of[shard] + prefetch:
                            pool.submit(readers.get, upcoming[opened])
                            opened += 1
                    ahead.append((i, pool.submit(lambda s=shard, a=first, b=stop: list(read(readers.get(s), a, b)))))
                    if len(ahead) > prefetch:
                        yield from finish_one()
                while ahead:
                    yield from finish_one()
            finally:
                for _, future in ahead:
                    future.cancel()
    finally:
        readers.close()


def _read(reader: ShardReader | StreamTarReader, first: int, stop: int) -> Iterator[Sample]:
    return reader.read(first, stop)


def reorder(arrivals: Iterable[tuple[int, Sample]], order: np.ndarray) -> Iterator[Sample]:
    """Yield samples in `order` (positions) from (position, sample) pairs arriving in another order."""
    held: dict[int, Sample] = {}
    arriving = iter(arrivals)
    for position in order.tolist():
        while position not in held:
            try:
                p, sample = next(arriving)
            except StopIteration:
                raise RuntimeError(f"plan error: position {position} never arrived") from None
            held[p] = sample
        yield held.pop(position)
