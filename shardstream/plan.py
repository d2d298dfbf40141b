"""The epoch plan: which sample goes to which rank and worker, in what order. Pure functions.

Everything here is a function of (sample counts, seed, epoch, layout) returning numpy
arrays, so it is tested directly over many shapes and seeds, and so that a resumed
job can recompute exactly what an interrupted one did without reading any data.

How an epoch is laid out:

1. **Epoch sequence.** Shards are put in a seeded order (shuffled per epoch when
   shuffling); the epoch sequence is every sample id, shard after shard, each shard's
   samples in file order (so reading stays sequential). Where the shards are few
   (`shuffle_block`), each is cut into blocks of several frames' worth of samples, and a
   shard's blocks come in a seeded order of their own (with 8 shards or fewer, all blocks
   interleaved): else the epoch's order would be the file order give or take the shuffle
   buffer, epoch after epoch.
2. **Ranks.** The sequence is cut into `world_size` contiguous, equal blocks. If the
   count does not divide, ``partial="pad"`` repeats samples from the start of the
   sequence (the `DistributedSampler` convention) and ``"drop"`` leaves out the tail.
   Every rank therefore yields the same number of samples and batches: DDP cannot hang.
3. **Workers.** A rank's block is dealt to its DataLoader workers in chunks of `chunk`
   samples (the batch size), round robin, in runs of `run` chunks (`Layout.run`): run j
   goes to worker j mod W, and the last round's chunks, too few for a run each, in one
   contiguous share each. Each worker then gets as many chunks as dealt one at a time, so
   the number of batches per rank depends on neither the number of workers nor the run;
   each reads runs of frames. A shuffled epoch's runs are long enough that two workers
   share a frame only at a run's edges (`deal_run`); an unshuffled epoch's are one chunk,
   so that the DataLoader, collecting round robin, yields a rank's block in order.
4. **Shuffle buffer.** Each worker draws its samples through a shuffle buffer of
   `buffer` samples, simulated here on positions: the buffer's decisions are replayed
   from the seed, never stored.

The DataLoader collects worker outputs round robin, so the items a training loop has
received (`delivered`) determine exactly which samples every worker has yielded: that
is all the state a resume needs.
"""

from __future__ import annotations

import functools
import hashlib
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from .roundrobin import round_robin_delivered

__all__ = [
    "Layout",
    "epoch_sequence",
    "epoch_block",
    "rank_stretches",
    "joined_ids",
    "sequence_between",
    "epoch_units",
    "shuffle_block",
    "split_ranks",
    "deal_chunks",
    "deal_run",
    "run_samples",
    "worker_positions",
    "yield_order",
    "worker_samples",
    "buffer_shuffle",
    "worker_plan",
    "read_order",
    "items_of",
    "worker_items",
    "rank_block_length",
    "chunks_of",
    "consumed_positions",
    "left_out_positions",
    "repeated_positions",
    "consumed_samples",
    "remaining_after",
    "remaining_sequence",
    "samples_of_items",
    "rng_for",
    "streams_digest",
    "streams_digests_read",
]

PARTIAL = ("pad", "drop")
# The most ranks a plan is made for: a plan holds arrays as long as the ranks (16 million:
# 128 MB), and a resume state claiming 10**9 failed as a bare MemoryError.
MAX_WORLD_SIZE = 1 << 24
# The longest run of chunks a worker is dealt (`deal_run`: a run of 1-sample batches of 3-byte
# samples would be 1.4 million), and the longest a resume state's layout may claim. Its cost
# does not grow with it: only the chunks a rank block holds are dealt.
MAX_RUN = 1 << 20


@dataclass(frozen=True)
class Layout:
    """How one job reads an epoch: the parts of the plan that do not depend on the data."""

    world_size: int = 1
    workers: int = 1  # DataLoader workers per rank; 1 when loading in the main process
    batch_size: int | None = None  # batches made in the workers; None yields samples
    drop_last: bool = False  # drop each worker's last partial batch
    partial: str = "pad"  # uneven ranks: "pad" (repeat samples) or "drop"
    shuffle: bool = False
    buffer: int = 0  # shuffle buffer, in samples, per worker
    run: int = 1  # chunks dealt to a worker at a time (`deal_run`; 1 in states before version 5)

    @property
    def chunk(self) -> int:
        # Dealing in whole batches keeps batch counts independent of the worker count;
        # unbatched samples are dealt in runs long enough to read whole frames.
        return self.batch_size or 64


def rng_for(seed: int, *parts: int) -> np.random.Generator:
    """A generator seeded by (seed, parts...), independent for every distinct tuple.

    Every value is spread over two fixed 32-bit words after a length word: SeedSequence
    alone would read ``[s]`` and ``[s, 0]`` (or a 64-bit seed and two small ints) alike.
    """
    words = [len(parts) + 1]
    for value in (seed, *parts):
        value &= 0xFFFFFFFFFFFFFFFF
        words += [value & 0xFFFFFFFF, value >> 32]
    # PCG64 by name, not `default_rng`'s default, which numpy may change (to PCG64DXSM):
    # every plan, and every resume state's replay, would then change with it.
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence(words)))


@functools.cache
def streams_digest() -> str:
    """A digest of draws of the kinds every plan is made of (`rng_for`'s permutations and
    uniforms, and the multinomial and bounded integers of weighted epochs,
    `sampling.WeightedDraws`): where it differs, this numpy makes other plans from the same seed.

    numpy promises the same draws only from the same build ("Compatibility policy" of
    `numpy.random`): a resume state taken under a numpy that shuffles otherwise would be
    replayed onto another order, samples repeated and lost without a word. A state
    carries the digest, and one taken under other draws is refused (`resume.ResumeState`)."""
    return _draws_digest(weighted=True)


@functools.cache
def streams_digests_read() -> frozenset[str]:
    """The digests a resume state may carry here: `streams_digest`, and the one states kept
    before it covered the weighted epochs' draws (permutations and uniforms alone), which is
    checked as far as it goes."""
    return frozenset((streams_digest(), _draws_digest(weighted=False)))


def _draws_digest(*, weighted: bool) -> str:
    rng = rng_for(0x5EED, 1, 2)
    digest = hashlib.sha256()
    for n in (2, 3, 10, 1000, 100_000):
        digest.update(rng.permutation(n).astype("<i8").tobytes())
    digest.update(rng.random(64).astype("<f8").tobytes())
    if weighted:
        # Uneven masses, so that numpy's binomials take both of their algorithms (inversion
        # for few draws, BTPE for many); walks are bounded integers below 8 (`MAX_WALKS`).
        masses = 0.5 ** np.arange(1, 41)
        digest.update(rng.multinomial(1_000_000, masses / masses.sum()).astype("<i8").tobytes())
        digest.update(rng.integers(0, 8, 1000).astype("<i8").tobytes())
    return digest.hexdigest()[:16]


# Where an epoch has fewer shards than this, its shards are cut into blocks (`shuffle_block`),
# so that it has about this many units to put in order.
SHUFFLE_UNITS = 256
# A block holds at least this many frames' worth of samples: a block starts and ends inside
# a frame, which is then fetched and decompressed once for each of the two blocks, so
# reading an epoch of blocks costs about 1 / BLOCK_FRAMES more frames than reading it whole.
BLOCK_FRAMES = 8
# And at least this many stored bytes: twice the widest gap a ranged read bridges between a
# reader's runs (pieces.planned_pieces: READ_BYTES // 4), so no bridge holds a whole block,
# to be fetched again when that block's turn comes. Smaller blocks (4 KB frames, or data
# that compresses well) cost 3-12x a shard's bytes an epoch over HTTP.
BLOCK_BYTES = 4 << 20
# Where an epoch has at most this many shards, their blocks are interleaved, each shard then
# read in several visits: the order of two shards is the same in two epochs one time in two,
# and a sample's places in them correlated at about 0.55 either way. A reader keeps a shard
# open while at most `pieces.REVISIT_HOLD` (16) other shards come between its visits: here, always.
INTERLEAVE_SHARDS = 8


def shuffle_block(counts: Sequence[int] | np.ndarray, samples_per_frame: int, sample_bytes: int = 0) -> int:
    """The samples in a block of a shuffled epoch's shards: 0 (shards are not cut) where the
    shards are `SHUFFLE_UNITS` or more or none holds two blocks, else enough blocks for about
    that many units, each of at least `BLOCK_FRAMES` frames and `BLOCK_BYTES` bytes (of
    samples of at least `sample_bytes` stored bytes each: the least of any shard).

    With few shards, a shard order is little randomness: with one shard (any dataset under
    256 MB, packed with the defaults), a sample's places in consecutive epochs correlated at
    0.71 (Spearman), and one early in the file came early in every epoch. A shard's blocks
    in a seeded order of their own make the order another each epoch, at the cost of
    reading each shard in `BLOCK_FRAMES`-frame runs rather than front to back.
    """
    counts = np.asarray(counts, dtype=np.int64)
    if len(counts) >= SHUFFLE_UNITS or not counts.sum():
        return 0
    block = max(-(-int(counts.sum()) // SHUFFLE_UNITS), BLOCK_FRAMES * max(int(samples_per_frame), 1),
                -(-BLOCK_BYTES // max(int(sample_bytes), 1)) if sample_bytes > 0 else 1)
    return block if counts.max() >= 2 * block else 0  # 0 where no shard is cut: the same order either way


def deal_run(chunk: int, samples_per_frame: int, sample_bytes: int = 0) -> int:
    """The chunks of `chunk` samples a worker is dealt at a time: enough for `BLOCK_FRAMES`
    frames' worth of samples and `BLOCK_BYTES` stored bytes (of samples of at least
    `sample_bytes` bytes each), 1 where one chunk holds that much.

    Dealt one at a time, chunks smaller than a frame put every frame in several workers'
    chunks, each of which fetches and decompresses it; and over remote storage, where a
    read bridges gaps of up to 2 MB between a worker's runs (`pieces.planned_pieces`),
    chunks of under 2 MB had each of W workers fetch all of a shard's bytes (a batch of 64
    samples of 6 KB is 0.4 MB: measured, 2 workers fetched 2.01x the dataset an epoch, 4
    workers 3.64x: BENCHMARKS.md, "Thirty-fifth session"). Runs of these sizes are what `shuffle_block` makes blocks of, for the
    same two reasons: a frame at a run's edges is fetched by two workers, and a gap of
    another worker's run is not bridged.
    """
    return min(max(1, -(-run_samples(samples_per_frame, sample_bytes) // max(int(chunk), 1))), MAX_RUN)


def run_samples(samples_per_frame: int, sample_bytes: int = 0) -> int:
    """The fewest samples a worker's run holds (`deal_run`, before rounding up to whole chunks)."""
    samples = BLOCK_FRAMES * max(int(samples_per_frame), 1)
    return max(samples, -(-BLOCK_BYTES // int(sample_bytes))) if sample_bytes > 0 else samples


def epoch_sequence(counts: Sequence[int] | np.ndarray, seed: int, epoch: int, shuffle: bool,
                   salt: int = 0, block: int = 0) -> np.ndarray:
    """Global sample ids of the epoch: shards in seeded order, samples in file order (with
    `block`, each shard's blocks of that many samples in a seeded order: `epoch_units`).

    `salt` > 0 gives further, independent orders of the same epoch (for epochs that
    need more than one pass over the data).
    """
    units, order = epoch_units(counts, seed, epoch, shuffle, salt, block)
    return sequence_between(units, order, 0, int(units.sum()))


def epoch_block(counts: Sequence[int] | np.ndarray, seed: int, epoch: int, shuffle: bool, world_size: int,
                rank: int, partial: str, block: int = 0) -> np.ndarray:
    """Rank `rank`'s block of the epoch sequence, ``split_ranks(epoch_sequence(...), world_size,
    partial)[rank]``, made without the whole sequence: each of 256 ranks' DataLoader workers
    would otherwise hold every sample id of the epoch (8 bytes each, twice over while padding)
    to keep 1/256 of them."""
    units, order = epoch_units(counts, seed, epoch, shuffle, 0, block)
    stretches = rank_stretches(int(units.sum()), world_size, rank, partial)
    return joined_ids([sequence_between(units, order, start, stop) for start, stop in stretches])


def rank_stretches(n: int, world_size: int, rank: int, partial: str) -> list[tuple[int, int]]:
    """The positions [start, stop) of a sequence of `n` that rank `rank`'s block holds
    (`split_ranks`), in order: padded, the sequence repeats from its start (np.resize), so
    one stretch per pass the block spans. A drawn epoch is made a stretch at a time from
    these, so that a rank's DataLoader worker draws its rank's share, not the epoch."""
    if partial not in PARTIAL:
        raise ValueError(f"partial must be one of {PARTIAL}, not {partial!r}")
    per_rank = rank_block_length(n, Layout(world_size=world_size, partial=partial))
    start, stop = rank * per_rank, (rank + 1) * per_rank
    if not n or start == stop:
        return []
    return [(max(start - k * n, 0), min(stop - k * n, n)) for k in range(start // n, -(-stop // n))]


def joined_ids(pieces: Sequence[np.ndarray]) -> np.ndarray:
    """The pieces of ids one after another (none: no ids, int64 as ids are)."""
    return np.concatenate(pieces) if len(pieces) else np.zeros(0, dtype=np.int64)


def epoch_units(counts: Sequence[int] | np.ndarray, seed: int, epoch: int, shuffle: bool, salt: int = 0,
                block: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(the samples of each unit, the units' order in the epoch sequence): units are runs of
    consecutive sample ids, shard after shard, and cover every sample once.

    A unit is a shard, or where `block` > 0 and shuffling, one of the near-equal blocks of
    `block` to `2 * block` samples a shard is cut into (a shard shorter than two blocks stays
    whole). The shards keep their seeded order (the same as without blocks), and each
    shard's blocks follow one another in a seeded order of their own, so that a shard is
    still read in one visit; except where the shards are `INTERLEAVE_SHARDS` or fewer, whose
    order would repeat one epoch in a few: there every block takes a seeded place of its own.
    """
    counts = np.asarray(counts, dtype=np.int64)
    shards = _shard_order(counts, seed, epoch, shuffle, salt)
    if not shuffle or block <= 0:
        return counts, shards
    cuts = np.maximum(counts // block, 1)  # blocks per shard (an empty shard: one, empty)
    if (cuts == 1).all():
        return counts, shards
    shard_of = np.repeat(np.arange(len(counts)), cuts)
    which = np.arange(len(shard_of)) - np.repeat(np.cumsum(cuts) - cuts, cuts)  # a block's place in its shard
    units = counts[shard_of] // cuts[shard_of] + (which < counts[shard_of] % cuts[shard_of])
    place = np.empty(len(counts), dtype=np.int64)
    place[shards] = np.arange(len(counts))
    rng = rng_for(seed, epoch, 4, salt) if salt else rng_for(seed, epoch, 4)
    if len(counts) <= INTERLEAVE_SHARDS:
        return units, rng.permutation(len(units))
    return units, np.lexsort((rng.random(len(units)), place[shard_of]))


def _shard_order(counts: np.ndarray, seed: int, epoch: int, shuffle: bool, salt: int) -> np.ndarray:
    """The order of the shards in the epoch sequence."""
    rng = rng_for(seed, epoch, 0, salt) if salt else rng_for(seed, epoch, 0)
    return rng.permutation(len(counts)) if shuffle else np.arange(len(counts))


def sequence_between(counts: np.ndarray, order: np.ndarray, start: int, stop: int) -> np.ndarray:
    """Positions [start, stop) of the sequence that lists the units' samples (`counts` of
    them each, consecutive ids unit after unit) in `order`."""
    if start >= stop:
        return np.zeros(0, dtype=np.int64)
    ordered = counts[order]
    ends = np.cumsum(ordered)  # where each shard's run ends in the sequence
    begins = ends - ordered
    runs = slice(int(np.searchsorted(ends, start, side="right")), int(np.searchsorted(begins, stop, side="left")))
    low, high = np.maximum(begins[runs], start), np.minimum(ends[runs], stop)
    first_ids = (np.cumsum(counts) - counts)[order[runs]] + low - begins[runs]
    lengths = high - low
    return np.repeat(first_ids - (np.cumsum(lengths) - lengths), lengths) + np.arange(stop - start, dtype=np.int64)


def split_ranks(sequence: np.ndarray, world_size: int, partial: str) -> np.ndarray:
    """Contiguous equal blocks of `sequence`, one row per rank (padded or dropped)."""
    if partial not in PARTIAL:
        raise ValueError(f"partial must be one of {PARTIAL}, not {partial!r}")
    n = len(sequence)
    if partial == "drop":
        per_rank = n // world_size
        return sequence[: per_rank * world_size].reshape(world_size, per_rank)
    per_rank = -(-n // world_size)
    pad = per_rank * world_size - n
    if pad and n:
        sequence = np.concatenate([sequence, np.resize(sequence, pad)])
    return sequence.reshape(world_size, per_rank) if n else np.zeros((world_size, 0), dtype=np.int64)


def deal_chunks(n: int, workers: int, chunk: int) -> list[np.ndarray]:
    """Positions 0..n-1 dealt to workers in chunks of `chunk`, round robin."""
    return [worker_positions(n, workers, chunk, w) for w in range(workers)]


def worker_positions(n: int, workers: int, chunk: int, worker: int, run: int = 1) -> np.ndarray:
    """`deal_chunks(n, workers, chunk)[worker]`, without dealing the other workers' chunks;
    with `run`, the chunks dealt in runs of that many (`Layout.run`)."""
    chunks = -(-n // chunk)
    rounds = chunks // (workers * run)  # full rounds of runs (a run of 1: every round)
    in_runs = (np.arange(rounds, dtype=np.int64)[:, None] * (workers * run) + worker * run
               + np.arange(run if rounds else 0, dtype=np.int64)).ravel()
    firsts = np.concatenate([in_runs, _last_round(rounds * workers * run, chunks, workers, worker)]) * chunk
    # A chunk past the positions (batch_size 2**31 over 3 samples) is cut to them: else 16 GiB.
    positions = (firsts[:, None] + np.arange(min(chunk, n), dtype=np.int64)).ravel()
    return positions[positions < n]


def _last_round(first: int, chunks: int, workers: int, worker: int) -> np.ndarray:
    """Worker `worker`'s chunks of the last round, chunks [first, chunks), too few for a run
    each: as many as dealing them one at a time gives it (the first `extra` workers one more,
    the last chunk, which may be short, to worker `extra - 1` mod W), in one contiguous share, the
    shares in the order of workers `extra`, ..., W - 1, 0, ..., `extra` - 1. Dealt one at a
    time, they would be the chunks no run spares from being fetched by several workers, all
    of them where a rank block holds under a round (4 workers' runs of 4 MB: 16 MB)."""
    each, extra = divmod(chunks - first, workers)
    if worker >= extra:  # after workers extra .. worker - 1, each `each` chunks
        start = first + (worker - extra) * each
    else:  # after workers extra .. W - 1, then 0 .. worker - 1, these with one more each
        start = first + (workers - extra) * each + worker * (each + 1)
    return np.arange(start, start + each + (worker < extra), dtype=np.int64)


def buffer_shuffle(n: int, buffer: int, rng: np.random.Generator, initial: int = 100,
                   emitted: int | None = None) -> np.ndarray:
    """The order in which a shuffle buffer of `buffer` slots emits inputs 0..n-1.

    Inputs enter in order; each step emits a uniformly chosen slot and refills it with
    the next input; at the end the buffer drains in random order. The buffer starts
    with `initial` inputs and grows by one more each step until it holds `buffer`, so
    the first batch does not wait for the whole buffer to fill (WebDataset's
    ``initial`` does the same). Output t is always among inputs < t + buffer, so a
    streaming reader needs at most `buffer` samples in memory to serve it.

    `emitted` stops after that many outputs (the first of the whole order): replaying
    what a resumed epoch's workers had yielded then costs what they yielded, not the epoch.
    """
    emitted = n if emitted is None else max(0, min(emitted, n))
    if buffer <= 1 or n <= 1:
        return np.arange(emitted, dtype=np.int64)
    size = min(buffer, n)
    slots = list(range(min(max(initial, 1), size)))
    draws = rng.random(n)
    out = np.empty(emitted, dtype=np.int64)
    nxt = len(slots)
    for t in range(emitted):
        if len(slots) < size and nxt < n:  # growing: one extra input this step
            slots.append(nxt)
            nxt += 1
        j = int(draws[t] * len(slots))
        out[t] = slots[j]
        if nxt < n:
            slots[j] = nxt
            nxt += 1
        else:  # draining: the emitted slot goes away
            slots[j] = slots[-1]
            slots.pop()
    return out


def worker_plan(rank_block: np.ndarray, layout: Layout, seed: int, epoch: int, rank: int, worker: int,
                segment: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """What worker `worker` of rank `rank` yields: (its sample ids in storage order, the
    order it yields them in, as positions into the first)."""
    mine = rank_block[worker_positions(len(rank_block), layout.workers, layout.chunk, worker, layout.run)]
    return mine, yield_order(len(mine), layout, seed, epoch, rank, worker, segment)


def yield_order(n: int, layout: Layout, seed: int, epoch: int, rank: int, worker: int, segment: int = 0,
                emitted: int | None = None) -> np.ndarray:
    """The order in which worker `worker` of rank `rank` yields its `n` samples (`worker_plan`'s
    second half); with `emitted`, only the first that many."""
    if not layout.shuffle:
        return np.arange(n if emitted is None else min(emitted, n), dtype=np.int64)
    return buffer_shuffle(n, layout.buffer, rng_for(seed, epoch, 1 + segment, rank, worker), emitted=emitted)


def read_order(remaining: np.ndarray, frontier: int, group: int = 8) -> np.ndarray:
    """The order in which to read the positions `remaining` (given in the order they are
    yielded), when positions below `frontier` were read before (by an interrupted run).

    A fresh pass (`frontier` 0) reads in storage order. A resumed pass owes the samples
    that sat in the interrupted run's shuffle buffer (the backlog, below `frontier`):
    they are scattered over the last few thousand positions, and the next batches draw
    on them at random. Read in storage order, every batch would wait for the whole
    backlog; read here, each `group` of neighbouring backlog positions (about a zstd
    frame of images) is read at the turn of its first sample, in between the rest,
    which stays in storage order: position p is read at the latest turn by which the
    interrupted run had read it (the first turn of any position >= p). Every position
    is then read before its turn, so what is held waiting stays about a shuffle
    buffer's worth. `group` should be about the samples a frame holds
    (`Source.samples_per_frame`): smaller, and one frame is fetched once per group.
    """
    positions = np.asarray(remaining, dtype=np.int64)
    if frontier <= 0 or not len(positions):
        return np.sort(positions)
    turn = np.empty(int(positions.max()) + 1, dtype=np.int64)
    turn[positions] = np.arange(len(positions))
    backlog = positions[positions < frontier]
    rest = np.sort(positions[positions >= frontier])
    # Backlog: a group's key is its first turn.
    groups = backlog // group
    first_turn = np.full(int(groups.max()) + 1 if len(groups) else 0, len(positions), dtype=np.int64)
    np.minimum.at(first_turn, groups, turn[backlog])
    # Rest, in storage order: read by the first turn of any later position (a suffix minimum).
    rest_key = np.minimum.accumulate(turn[rest][::-1])[::-1] if len(rest) else rest
    order = np.concatenate([backlog, rest])
    keys = np.concatenate([first_turn[groups], rest_key])
    return order[np.lexsort((order, keys))]


def items_of(samples: int, layout: Layout) -> int:
    """Items (batches, or samples when unbatched) a worker with `samples` samples yields."""
    if layout.batch_size is None:
        return samples
    full, rest = divmod(samples, layout.batch_size)
    return full + (1 if rest and not layout.drop_last else 0)


def rank_block_length(n: int, layout: Layout) -> int:
    """Samples in each rank's block of an epoch sequence of `n` (`split_ranks`, without the arrays)."""
    return n // layout.world_size if layout.partial == "drop" else -(-n // layout.world_size)


def chunks_of(block: int, layout: Layout) -> int:
    """Chunks dealt from a rank block of `block` samples (`deal_chunks`)."""
    return -(-block // layout.chunk)


def worker_items(block: int, layout: Layout) -> list[int]:
    """Items each plan worker yields from a rank block of `block` samples."""
    return [items_of(samples, layout) for samples in worker_samples(block, layout)]


def worker_samples(block: int, layout: Layout) -> list[int]:
    """Samples each plan worker is dealt from a rank block of `block` samples (the lengths of
    `deal_chunks`, by arithmetic: `len()` and every iteration's start ask, and a rank block
    can hold millions of samples). The same whatever `layout.run`: full rounds of runs deal
    every worker alike, and the last round's shares are what a chunk at a time deals."""
    chunks, workers = chunks_of(block, layout), layout.workers
    samples = [len(range(w, chunks, workers)) * layout.chunk for w in range(workers)]
    if chunks:  # the last chunk may be short
        samples[(chunks - 1) % workers] -= chunks * layout.chunk - block
    return samples


def samples_of_items(n_items: int, samples: int, layout: Layout) -> int:
    """Samples covered by a worker's first `n_items` items."""
    return min(samples, n_items * (layout.batch_size or 1))


def consumed_positions(n: int, layout: Layout, seed: int, epoch: int, delivered: int,
                       segment: int = 0, per_worker: Sequence[int] | None = None) -> np.ndarray:
    """Positions in an epoch sequence of length `n` that every rank had received after
    `delivered` items each (ranks move in lockstep); a padded repeat maps to its original.

    `per_worker` gives the items each plan worker had handed over instead, where the
    round robin of one epoch does not say it (an endless stream's workers cross epoch
    boundaries at different times).
    """
    if per_worker is None and delivered == 0:
        return np.zeros(0, dtype=np.int64)
    blocks = split_ranks(np.arange(n, dtype=np.int64), layout.world_size, layout.partial)
    taken = []
    # What each worker yielded depends on the block's length only, the same on every rank: worked
    # out once, not a rank at a time (a state of 4,096 ranks took seconds to load, each of their
    # workers replayed in Python whether it had yielded anything or not).
    yielded: dict[int, tuple[list[int], dict[int, int]]] = {}
    for rank in range(layout.world_size):
        block = blocks[rank]
        if len(block) not in yielded:
            samples = worker_samples(len(block), layout)
            got = (list(per_worker) if per_worker is not None
                   else round_robin_delivered([items_of(s, layout) for s in samples], delivered))
            # Only the samples yielded are replayed: the buffer's later decisions do not matter here.
            emitted = {w: samples_of_items(g, samples[w], layout) for w, g in enumerate(got)}
            yielded[len(block)] = samples, {w: e for w, e in emitted.items() if e}
        samples, emitted = yielded[len(block)]
        for w, count in emitted.items():
            order = yield_order(samples[w], layout, seed, epoch, rank, w, segment, count)
            taken.append(block[worker_positions(len(block), layout.workers, layout.chunk, w, layout.run)[order]])
    return np.concatenate(taken) if taken else np.zeros(0, dtype=np.int64)


def left_out_positions(n: int, layout: Layout, seed: int, epoch: int, segment: int = 0) -> np.ndarray:
    """Positions in an epoch sequence of length `n` that `layout` never delivers in the
    epoch: the tail ``partial="drop"`` leaves off the rank blocks, and what the last
    partial batch that `drop_last` drops holds (one per rank: only a block's last chunk
    is short), unless a padded repeat of it is delivered elsewhere."""
    if not n:
        return np.zeros(0, dtype=np.int64)
    per_rank = rank_block_length(n, layout)
    dropped = []  # positions in the (padded) rank blocks laid end to end
    for rank in range(layout.world_size):
        for w, s in enumerate(worker_samples(per_rank, layout)):
            delivers = samples_of_items(items_of(s, layout), s, layout)
            if delivers < s:  # the batch drop_last drops is the last the buffer emits: replayed whole
                order = yield_order(s, layout, seed, epoch, rank, w, segment)[delivers:]
                dropped.append(rank * per_rank
                               + worker_positions(per_rank, layout.workers, layout.chunk, w, layout.run)[order])
    # Position k of the sequence appears in the blocks at k, k + n, ... (padding repeats
    # from the start): it is left out when every appearance is dropped, or it has none.
    total = per_rank * layout.world_size
    appearances = total // n + (np.arange(n) < total % n)
    hits = np.bincount(np.concatenate(dropped) % n, minlength=n) if dropped else np.zeros(n, dtype=np.int64)
    return np.flatnonzero(hits == appearances)


def repeated_positions(n: int, layout: Layout, seed: int, epoch: int, rank: int, positions: np.ndarray,
                       segment: int = 0) -> np.ndarray:
    """Which of `positions` (in rank `rank`'s block of an epoch sequence of length `n`) deliver
    a sample that another position delivers first: the repeats ``partial="pad"`` adds, as a
    bool mask, for a loop to leave out (a validation set scored once per sample).

    Of a sample's deliveries, the first is the original (by the loop's step, ranks in
    lockstep, the lower rank first at one step); the rest are repeats. So however far a pass
    goes before a resume, every sample it delivered has exactly one delivery not marked,
    and the padding a batch that `drop_last` drops held is replaced by the delivered one.
    Only the first ``total - n`` positions of the sequence and the padding after `n` take
    part: a handful, their workers' orders replayed, whatever the epoch's length. The steps
    are those of one epoch's round robin of the plan's items. Where an endless stream's
    workers cross into the next epoch at other steps, or torch's DataLoader batches the
    samples, a whole epoch still leaves one delivery unmarked, not always the first; and
    where that DataLoader's `drop_last` drops a worker's short batch, which the plan counts
    as delivered, a sample may be left with marked deliveries only (README says so)."""
    mask = np.zeros(len(positions), dtype=bool)
    per_rank = rank_block_length(n, layout)
    total = per_rank * layout.world_size
    if layout.partial == "drop" or total == n or not n:
        return mask
    where = rank * per_rank + np.asarray(positions, dtype=np.int64)  # in the blocks laid end to end
    candidates = np.flatnonzero((where >= n) | (where < total - n)).tolist()
    if not candidates:  # most workers: none of theirs takes part
        return mask
    steps = _DeliverySteps(per_rank, layout, seed, epoch, segment)
    for i in candidates:
        own = steps.of(int(where[i]))
        if own is not None:  # (one never delivered needs no mark)
            mask[i] = own != min(filter(None, map(steps.of, range(int(where[i]) % n, total, n))))
    return mask


class _DeliverySteps:
    """When the loop receives each position of the padded rank blocks laid end to end:
    (step, rank), or None where `drop_last` drops its batch. A rank's items come round robin
    from its workers (roundrobin.py): item k of plan worker w is step
    ``sum(min(items[v], k)) + #{v < w: items[v] > k}``."""

    def __init__(self, per_rank: int, layout: Layout, seed: int, epoch: int, segment: int) -> None:
        self.per_rank, self.layout, self.seed, self.epoch, self.segment = per_rank, layout, seed, epoch, segment
        self.samples = worker_samples(per_rank, layout)
        self.items = [items_of(s, layout) for s in self.samples]
        self.owner = np.empty(per_rank, dtype=np.int64)  # the plan worker of each place in a block
        self.index = np.empty(per_rank, dtype=np.int64)  # and its place among that worker's
        for w in range(layout.workers):
            mine = worker_positions(per_rank, layout.workers, layout.chunk, w, layout.run)
            self.owner[mine], self.index[mine] = w, np.arange(len(mine))
        self._yielded_at: dict[tuple[int, int], np.ndarray] = {}

    def of(self, position: int) -> tuple[int, int] | None:
        rank, place = divmod(position, self.per_rank)
        w = int(self.owner[place])
        if (rank, w) not in self._yielded_at:  # a worker's yield order, inverted
            order = yield_order(self.samples[w], self.layout, self.seed, self.epoch, rank, w, self.segment)
            self._yielded_at[rank, w] = yielded_at = np.empty_like(order)
            yielded_at[order] = np.arange(len(order))
        k = int(self._yielded_at[rank, w][self.index[place]]) // (self.layout.batch_size or 1)
        if k >= self.items[w]:
            return None
        step = sum(min(n, k) for n in self.items) + sum(n > k for n in self.items[:w])
        return step, rank


def consumed_samples(sequence: np.ndarray, layout: Layout, seed: int, epoch: int, delivered: int,
                     segment: int = 0) -> np.ndarray:
    """Sample ids every rank had received after `delivered` items each (ranks in lockstep)."""
    return sequence[consumed_positions(len(sequence), layout, seed, epoch, delivered, segment)]


def remaining_sequence(sequence: np.ndarray, consumed: np.ndarray) -> np.ndarray:
    """`sequence` without the samples already consumed (a padded repeat counts as seen).

    By sample id: for sequences where every id is distinct. A sampled sequence (ids
    drawn with replacement) goes by position instead: `remaining_after`.
    """
    return sequence[~np.isin(sequence, consumed)]


def remaining_after(sequence: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """`sequence` without the entries at `positions` (consumed ones)."""
    keep = np.ones(len(sequence), dtype=bool)
    keep[positions] = False
    return sequence[keep]
