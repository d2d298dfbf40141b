"""Serving a planned order of samples from shards: ranged reads in, reordering out.

The plan (plan.py) says which samples a worker yields and in what order. Reading them
in that order one at a time would cost a storage request per sample; instead the
samples are read in storage order, as runs of consecutive samples (one ranged read per
run of frames), and held until their turn. The plan guarantees that a sample's turn
comes within `buffer` samples of its arrival, which bounds the memory held.
"""

from __future__ import annotations

from typing import Iterable, Iterator

import numpy as np

from .reader import Sample, ShardReader, StreamTarReader
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


def read_samples(source: Source, ids: np.ndarray, counts: np.ndarray) -> Iterator[Sample]:
    """The samples `ids` (global ids), in that order, read run by run."""
    readers: dict[int, ShardReader | StreamTarReader] = {}
    for shard, first, stop in sample_runs(ids, counts):
        reader = readers.get(shard)
        if reader is None:
            reader = readers[shard] = source.shards[shard].reader()
        yield from reader.read(first, stop)


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
