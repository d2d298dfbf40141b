"""Serving a planned order of samples from shards: ranged reads in, reordering out.

The plan (plan.py) says which samples a worker yields and in what order. Reading them
in that order one at a time would cost a storage request per sample; instead the
samples are read in storage order, as runs of consecutive samples (one ranged read per
run of frames), and held until their turn. The plan guarantees that a sample's turn
comes within `buffer` samples of its arrival, which bounds the memory held.
"""

from __future__ import annotations

from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Iterable, Iterator

import numpy as np

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


def read_samples(source: Source, ids: np.ndarray, counts: np.ndarray, prefetch: int = 0,
                 piece_bytes: int = 8 << 20) -> Iterator[Sample]:
    """The samples `ids` (global ids), in that order, read run by run.

    With `prefetch` > 0 (indexed sources), up to that many pieces of about
    `piece_bytes` are fetched, decompressed and parsed ahead by background threads
    while the caller works on the current one: storage latency then overlaps decoding.
    The threads start with the iteration and are joined when it ends or is closed.
    """
    readers: dict[int, ShardReader | StreamTarReader] = {}

    def reader_of(shard: int) -> ShardReader | StreamTarReader:
        reader = readers.get(shard)
        if reader is None:
            reader = readers[shard] = source.shards[shard].reader()
        return reader

    runs = sample_runs(ids, counts)
    if prefetch <= 0 or not source.indexed:
        for shard, first, stop in runs:
            yield from reader_of(shard).read(first, stop)
        return
    per_piece = max(1, piece_bytes // max(1, source.mean_sample_bytes()))
    work = pieces(runs, per_piece)
    with ThreadPoolExecutor(max_workers=prefetch, thread_name_prefix="shardstream-prefetch") as pool:
        ahead: deque[Future[list[Sample]]] = deque()
        try:
            for shard, first, stop in work:
                reader = reader_of(shard)
                ahead.append(pool.submit(lambda r=reader, a=first, b=stop: list(r.read(a, b))))
                if len(ahead) > prefetch:
                    yield from ahead.popleft().result()
            while ahead:
                yield from ahead.popleft().result()
        finally:
            for future in ahead:
                future.cancel()


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
