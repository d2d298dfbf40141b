"""How a worker's samples become storage requests: runs of consecutive samples, then pieces.

A piece is one ranged read of at most about `piece_bytes`, cut between zstd frames, so
no two pieces fetch the same frame; a piece is held whole, so its samples, decompressed,
are at most about `piece_bytes` too (a frame larger than that is a piece of its own).
The first pieces of an iteration are small (`ramp`): its first samples then wait for a
short transfer, not for several full pieces sharing one link. Nothing here reads data;
a shard's index says where its samples lie.
"""

from __future__ import annotations

import itertools
from typing import Callable, Iterator, NamedTuple

import numpy as np

from .errors import ShardstreamError
from .readahead import ReadAhead
from .reader import READ_BYTES, ShardReader
from .tarstream import StreamTarReader

__all__ = ["Piece", "PieceKey", "Stretch", "adjacent_repeats", "cut", "first_window", "piece_key", "planned_pieces",
           "ramp", "sample_runs", "stretches"]

# A planned piece: (first sample, stop, which samples of it to keep (None: all), whether it
# is its stretch's last, its bytes: fetched, or held decompressed where those are more).
Piece = tuple[int, int, "np.ndarray | None", bool, int]
# What a piece's read gives: shard, first sample, stop, the samples kept, whether errors
# become samples (read_tolerant) or raise.
PieceKey = tuple[int, int, int, "bytes | None", bool]


class Stretch(NamedTuple):
    """Consecutive runs of one shard in an iteration's reading order (`stretches`)."""

    shard: int
    runs: list[tuple[int, int]]  # (first, stop) sample ranges of the shard
    final: bool  # the shard is let go after it (its reader dropped, its cached copy evictable)
    opening: int  # which opening of the shard it is read in: 0, then one more after each letting go


def piece_key(shard: int, first: int, stop: int, keep: np.ndarray | None, tolerant: bool) -> PieceKey:
    return shard, first, stop, None if keep is None else keep.tobytes(), tolerant


def adjacent_repeats(ids: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
    """`ids` with each id repeated in a row kept once, and how many times each comes in a row
    (None where no id does). Weighted sampling draws a sample again beside itself (draws are
    sorted within a shard), and each draw was read as a run of its own: its frame read and
    decompressed again (100k samples, class-balanced: 37,127 frames against 196)."""
    if len(ids) < 2:
        return ids, None
    firsts = np.flatnonzero(np.concatenate([[True], ids[1:] != ids[:-1]]))
    if len(firsts) == len(ids):
        return ids, None
    return ids[firsts], np.diff(np.append(firsts, len(ids)))


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


# A shard read again before this many other shards are (a resumed epoch's scattered
# leftovers; a few shards' interleaved blocks, plan.epoch_units) is kept open between its
# visits; read again later (a weighted epoch's next walk over the shards), it is let go in
# between, its cached copy evictable, and opened again: kept, every shard a worker reads in
# the first walk stayed open, and its cached copy locked, to the last walk. Counted in
# stretches, 8 interleaved shards were let go at one visit in eight, and with a cache smaller
# than the data, evicted and downloaded again: 29 downloads of 8 shards an epoch.
REVISIT_HOLD = 16


def stretches(runs: list[tuple[int, int, int]]) -> list[Stretch]:
    """Consecutive runs of one shard, grouped: (shard, [(first, stop), ...], whether the shard
    is let go after it, which opening of the shard it is read in: 0, then 1 after the first
    time it was let go, ...). A shard is let go after its last stretch, and after any whose
    next one comes after stretches of more than `REVISIT_HOLD` other shards."""
    grouped: list[tuple[int, list[tuple[int, int]]]] = []
    for shard, first, stop in runs:
        if grouped and grouped[-1][0] == shard:
            grouped[-1][1].append((first, stop))
        else:
            grouped.append((shard, [(first, stop)]))
    next_of: dict[int, int] = {}
    gone = [False] * len(grouped)
    for i in range(len(grouped) - 1, -1, -1):
        shard = grouped[i][0]
        later = next_of.get(shard)
        gone[i] = later is None or _others_between(grouped, i, later) > REVISIT_HOLD
        next_of[shard] = i
    out, opening = [], {}
    for (shard, stretch), last in zip(grouped, gone):
        out.append(Stretch(shard, stretch, last, opening.get(shard, 0)))
        if last:
            opening[shard] = opening.get(shard, 0) + 1
    return out


def _others_between(grouped: list[tuple[int, list[tuple[int, int]]]], i: int, later: int) -> int:
    """How many shards stretches i + 1 .. later - 1 read, counted up to `REVISIT_HOLD` + 1."""
    others: set[int] = set()
    for k in range(i + 1, later):
        others.add(grouped[k][0])
        if len(others) > REVISIT_HOLD:
            break
    return len(others)


def ramp(piece_bytes: int) -> Iterator[int]:
    """Piece sizes: the first pieces small, so the first samples arrive after a short
    transfer rather than after `prefetch` full pieces shared one link; then full size."""
    return itertools.chain((piece_bytes >> k for k in (3, 2, 1)), itertools.repeat(piece_bytes))


def planned_pieces(reader: ShardReader | StreamTarReader, stretch: list[tuple[int, int]],
                   sizes: Iterator[int]) -> Iterator[Piece]:
    """The pieces that read a stretch of runs of one shard: (first, stop, which samples to
    keep, is last, bytes fetched or held (`_piece_bytes`); a full piece's worth where unknown).

    Runs whose bytes lie close together are read as one span, and the samples between
    them dropped: for remote storage, a gap of up to 2 MB costs less than another
    request (at 100 MB/s, 2 MB take 20 ms; a request waits 20-100 ms),
    and runs that share a zstd frame then decompress it once.
    """
    try:
        if not isinstance(reader, ShardReader):
            raise ShardstreamError("no index")
        gap = 0 if reader.store.local else READ_BYTES // 4
        cuts = [(a, b, span, wanted, _piece_bytes(reader, a, b))
                for span, stop, wanted in _coalesce(reader, stretch, gap) for a, b in cut(reader, span, stop, sizes)]
    except ShardstreamError:  # no index: whole runs; a bad index: the reads meet the error in their turn
        cuts = [(first, stop, first, None, READ_BYTES) for first, stop in stretch]
    for k, (a, b, span, wanted, size) in enumerate(cuts):
        keep = None if wanted is None else wanted[a - span : b - span]
        yield a, b, (None if keep is None or keep.all() else keep), k + 1 == len(cuts), int(size)


def _piece_bytes(reader: ShardReader, a: int, b: int) -> int:
    """What reading samples [a, b) costs in memory: the bytes fetched, or the samples'
    bytes once decompressed where they are more (compressible fields)."""
    lo, hi = reader.extent(a, b)
    offsets = reader.index.sample_offsets
    return max(hi - lo, int(offsets[b] - offsets[a]))


def cut(reader: ShardReader, a: int, b: int, sizes: Iterator[int]) -> Iterator[tuple[int, int]]:
    """Samples [a, b) in pieces of the next sizes, each cut between frames."""
    while a < b:
        piece = next(reader.pieces(a, b, next(sizes)))
        yield piece
        a = piece[1]


def _coalesce(reader: ShardReader, stretch: list[tuple[int, int]], gap: int) -> list[tuple[int, int, np.ndarray]]:
    """Merge runs (of one shard) whose byte ranges lie within `gap` bytes into spans:
    (first, stop, mask of the samples the runs want, from `first`)."""
    spans: list[list] = []  # [first, stop, runs]: grown in place (a copy of the runs per merge was quadratic)
    for first, stop in stretch:
        if spans and first >= spans[-1][1] and \
                reader.extent(first, stop)[0] - reader.extent(spans[-1][0], spans[-1][1])[1] <= gap:
            spans[-1][1] = stop
            spans[-1][2].append((first, stop))
        else:
            spans.append([first, stop, [(first, stop)]])
    out = []
    for a, b, members in spans:
        wanted = np.zeros(b - a, dtype=bool)
        for first, stop in members:
            wanted[first - a : stop - a] = True
        out.append((a, b, wanted))
    return out


def first_window(reader_of: Callable[[int], ShardReader | StreamTarReader], runs: list[tuple[int, int, int]],
                 prefetch: int, piece_bytes: int, max_ahead: int) -> Iterator[tuple[int, Piece]]:
    """The pieces (shard, piece) an iteration reading `runs` has in flight when its first
    sample is due: the same pieces, in the same order, as its own planning makes first
    (`stream.read_samples` keeps `prefetch` in flight, or more while they are small, up
    to half of `prefetch` full pieces' bytes and `max_ahead` pieces)."""
    sizes, window = ramp(piece_bytes), ReadAhead.start(prefetch, piece_bytes, max_ahead)
    count = total = 0
    for shard, stretch, *_ in stretches(runs):
        for piece in planned_pieces(reader_of(shard), stretch, sizes):
            if window.full(count, total):
                return
            yield shard, piece
            count, total = count + 1, total + piece[4]
