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
from .reader import READ_BYTES, Sample, ShardReader, StreamTarReader
from .source import Source

__all__ = ["read_samples", "reorder", "sample_runs"]


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
                 piece_bytes: int = READ_BYTES) -> Iterator[Sample]:
    """The samples `ids` (global ids), in that order, read run by run.

    With `prefetch` > 0 (indexed sources), up to that many pieces are fetched,
    decompressed and parsed ahead by background threads while the caller works on the
    current one, and with a `cache` the next `prefetch` shards are downloaded ahead:
    storage latency then overlaps decoding. A piece is one storage request of about
    `piece_bytes`, cut between frames (`ShardReader.pieces`), so no two pieces fetch
    the same frame; the next shard's index is fetched while the current shard is read.
    The threads start with the iteration and are joined when it ends or is closed.
    """
    readers = _Readers(source, cache)
    runs = list(sample_runs(ids, counts))
    read = read_tolerant if tolerant else _read
    try:
        last_run = {shard: n for n, (shard, _, _) in enumerate(runs)}
        if prefetch <= 0 or not source.indexed:
            for n, (shard, first, stop) in enumerate(runs):
                yield from read(readers.get(shard), first, stop)
                if last_run[shard] == n:
                    readers.release(shard)
            return
        upcoming = list(dict.fromkeys(shard for shard, _, _ in runs))  # distinct shards, in reading order
        rank_of = {shard: i for i, shard in enumerate(upcoming)}
        with ThreadPoolExecutor(max_workers=prefetch + (1 if cache else 0),
                                thread_name_prefix="shardstream-prefetch") as pool:
            ahead: deque[tuple[int, bool, Future[list[Sample]]]] = deque()
            opened = 0

            def open_ahead(position: int, reach: int) -> None:
                # Open (with a cache: download) shards up to `reach` places ahead, in the pool.
                nonlocal opened
                while opened < len(upcoming) and opened <= position + reach:
                    pool.submit(_open, readers, upcoming[opened])
                    opened += 1

            def finish_one() -> list[Sample]:
                shard, last, future = ahead.popleft()
                samples = future.result()
                if last:
                    readers.release(shard)
                return samples

            try:
                for n, (shard, first, stop) in enumerate(runs):
                    open_ahead(rank_of[shard], prefetch if cache is not None else 1)
                    try:
                        cuts = list(readers.get(shard).pieces(first, stop, piece_bytes))
                    except ShardstreamError:  # the read below meets the same error in its turn, or skips it
                        cuts = [(first, stop)]
                    for k, (a, b) in enumerate(cuts):
                        future = pool.submit(lambda s=shard, a=a, b=b: list(read(readers.get(s), a, b)))
                        ahead.append((shard, last_run[shard] == n and k + 1 == len(cuts), future))
                        if len(ahead) > prefetch:
                            yield from finish_one()
                while ahead:
                    yield from finish_one()
            finally:
                for _, _, future in ahead:
                    future.cancel()
    finally:
        readers.close()


def _open(readers: _Readers, shard: int) -> None:
    """Open a shard ahead of need: download it (with a cache) or fetch its index."""
    reader = readers.get(shard)
    if isinstance(reader, ShardReader):
        reader.index


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
