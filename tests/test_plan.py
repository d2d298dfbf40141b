"""The epoch plan (shardstream.plan): pure functions, checked over many shapes and seeds.

Every property here is checked against an independent statement of what the plan
promises (plan.py's docstring), not against the implementation: permutations are
checked by sorting, round robin by a direct simulation of a DataLoader's polling, and
resumption by a set equation over consumed and remaining samples.
"""

from __future__ import annotations

import functools
import itertools

import numpy as np
import pytest

from shardstream.plan import (
    BLOCK_BYTES,
    BLOCK_FRAMES,
    INTERLEAVE_SHARDS,
    MAX_RUN,
    SHUFFLE_UNITS,
    Layout,
    buffer_shuffle,
    consumed_positions,
    consumed_samples,
    deal_chunks,
    deal_run,
    epoch_block,
    epoch_sequence,
    epoch_units,
    items_of,
    left_out_positions,
    rank_block_length,
    read_order,
    remaining_sequence,
    repeated_positions,
    rng_for,
    samples_of_items,
    shuffle_block,
    split_ranks,
    worker_items,
    worker_plan,
    worker_positions,
    worker_samples,
)
from shardstream.pieces import REVISIT_HOLD, stretches
from shardstream.reader import READ_BYTES
from shardstream.roundrobin import endless_start, loader_start, round_robin_delivered

SHAPES = [
    [],
    [0],
    [1],
    [5],
    [3, 3, 3, 2, 3, 2, 2, 2, 1],
    [11, 10],
    [1, 0, 4, 0, 7],
    [64, 1, 63, 2],
    [2] * 10 + [1],
    [17, 5, 9, 1, 1, 3],
]


def random_counts(rng: np.random.Generator) -> list[int]:
    return rng.integers(0, 12, size=int(rng.integers(1, 9))).tolist()


def is_permutation(a: np.ndarray, n: int) -> bool:
    return len(a) == n and np.array_equal(np.sort(a), np.arange(n))


# -- epoch_sequence --------------------------------------------------------------------------


@pytest.mark.parametrize("counts", SHAPES, ids=str)
@pytest.mark.parametrize("shuffle", [False, True])
def test_epoch_sequence_is_a_permutation_of_all_ids(counts, shuffle):
    n = sum(counts)
    for seed, epoch in itertools.product([0, 1, 12345, 2**63 + 7], [0, 1, 5]):
        seq = epoch_sequence(counts, seed, epoch, shuffle)
        assert seq.dtype == np.int64
        assert is_permutation(seq, n)


@pytest.mark.parametrize("counts", SHAPES, ids=str)
def test_epoch_sequence_keeps_shards_whole_and_in_file_order(counts):
    starts = np.concatenate([[0], np.cumsum(counts)]).astype(int)
    shard_of = np.repeat(np.arange(len(counts)), counts)
    for seed, epoch in itertools.product(range(4), range(3)):
        seq = epoch_sequence(counts, seed, epoch, True)
        # shard by shard: each shard's ids appear as one contiguous ascending run
        shards_seen = [s for s, _ in itertools.groupby(shard_of[seq].tolist())]
        assert len(shards_seen) == len(set(shards_seen)) == sum(1 for c in counts if c)
        pos = 0
        for s in shards_seen:
            run = seq[pos : pos + counts[s]]
            assert run.tolist() == list(range(starts[s], starts[s + 1]))
            pos += counts[s]


def test_epoch_sequence_unshuffled_is_the_identity():
    for counts in SHAPES:
        for epoch in range(3):
            assert epoch_sequence(counts, 7, epoch, False).tolist() == list(range(sum(counts)))


def test_epoch_sequence_deterministic_for_seed_and_epoch():
    counts = [3, 3, 3, 2, 3, 2, 2, 2, 1]
    for seed, epoch in itertools.product([0, 1, 99], [0, 1, 2]):
        a = epoch_sequence(counts, seed, epoch, True)
        b = epoch_sequence(np.asarray(counts), seed, epoch, True)
        assert np.array_equal(a, b)


def test_epoch_sequence_differs_across_epochs_and_seeds_when_shuffling():
    counts = [3, 3, 3, 2, 3, 2, 2, 2, 1]  # 9 shards: 9! orders, collisions are negligible
    for seed in range(5):
        orders = {tuple(epoch_sequence(counts, seed, epoch, True).tolist()) for epoch in range(6)}
        assert len(orders) == 6
    by_seed = {tuple(epoch_sequence(counts, seed, 0, True).tolist()) for seed in range(6)}
    assert len(by_seed) == 6


# -- split_ranks -----------------------------------------------------------------------------


SPLIT_SHAPES = list(itertools.product([0, 1, 2, 3, 5, 7, 8, 21, 64, 65], [1, 2, 3, 4, 5, 8]))


def test_split_ranks_pad():
    for n, world_size in SPLIT_SHAPES:
        check_split_pad(n, world_size)


def check_split_pad(n, world_size):
    seq = np.random.default_rng(n * 31 + world_size).permutation(n).astype(np.int64)
    blocks = split_ranks(seq, world_size, "pad")
    per_rank = -(-n // world_size)
    assert blocks.shape == (world_size, per_rank)
    flat = blocks.reshape(-1)
    pad = per_rank * world_size - n
    # contiguous blocks in sequence order, then the padding
    assert flat[:n].tolist() == seq.tolist()
    # padding repeats samples from the start of the sequence (cyclically if n < pad)
    if n:
        assert flat[n:].tolist() == [int(seq[i % n]) for i in range(pad)]
    else:
        assert pad == 0
    assert set(flat.tolist()) == set(seq.tolist())
    assert 0 <= pad < world_size


def test_split_ranks_drop():
    for n, world_size in SPLIT_SHAPES:
        check_split_drop(n, world_size)


def check_split_drop(n, world_size):
    seq = np.random.default_rng(n * 17 + world_size).permutation(n).astype(np.int64)
    blocks = split_ranks(seq, world_size, "drop")
    per_rank = n // world_size
    assert blocks.shape == (world_size, per_rank)
    flat = blocks.reshape(-1).tolist()
    assert flat == seq[: per_rank * world_size].tolist()
    assert len(set(flat)) == len(flat)  # nothing repeated
    assert n - len(flat) < world_size  # fewer than world_size left out


def test_split_ranks_rejects_unknown_partial():
    with pytest.raises(ValueError):
        split_ranks(np.arange(5), 2, "wrap")



@pytest.mark.parametrize("counts", SHAPES, ids=str)
@pytest.mark.parametrize("shuffle", [False, True])
@pytest.mark.parametrize("partial", ["pad", "drop"])
def test_epoch_block_is_the_ranks_block_of_the_epoch_sequence(counts, shuffle, partial):
    """A rank's block made alone (without the whole sequence) is the one split_ranks cuts,
    with shards whole and cut into blocks."""
    for world_size, epoch, cut in itertools.product([1, 2, 3, 7, 64], [0, 3], [0, 2, 5]):
        blocks = split_ranks(epoch_sequence(counts, 5, epoch, shuffle, block=cut), world_size, partial)
        for rank in range(world_size):
            block = epoch_block(counts, 5, epoch, shuffle, world_size, rank, partial, block=cut)
            assert block.dtype == np.int64 and block.tolist() == blocks[rank].tolist()


# -- shards cut into blocks ------------------------------------------------------------------


MANY_SHAPES = SHAPES + [[3] * 9, [7, 0, 12, 5, 1, 9, 30, 2, 4, 11, 6, 0, 8], [40] * 20]


@pytest.mark.parametrize("counts", MANY_SHAPES, ids=str)
@pytest.mark.parametrize("cut", [1, 2, 3, 5, 100])
def test_epoch_units_cut_each_shard_into_blocks(counts, cut):
    """Units are runs of consecutive ids covering every sample once, each within one shard,
    near-equal within a shard and of `cut` to 2 `cut` - 1 samples (a shorter shard whole).
    Past INTERLEAVE_SHARDS shards, a shard's units come one after another and the shards in
    the order they have uncut; with fewer, the units of all shards are interleaved."""
    n, starts = sum(counts), np.cumsum([0] + counts)
    interleaved = 0
    for seed, epoch in itertools.product(range(3), range(3)):
        units, order = epoch_units(counts, seed, epoch, True, block=cut)
        firsts = np.cumsum(units) - units
        assert units.sum() == n and sorted(order.tolist()) == list(range(len(units)))
        assert (units == 0).sum() == counts.count(0)
        shard_of = np.searchsorted(starts, firsts, side="right") - 1
        for shard, count in enumerate(counts):
            mine = units[(shard_of == shard) & (units > 0)]  # an empty unit's place names no shard
            if count:
                assert mine.sum() == count and mine.max() - mine.min() <= 1
                assert len(mine) == max(count // cut, 1)
                assert (mine >= cut).all() and (mine < 2 * cut).all() if count >= cut else len(mine) == 1
        visits = shard_of[order][units[order] > 0]
        changes = visits[np.r_[True, visits[1:] != visits[:-1]][: len(visits)]]
        whole, whole_order = epoch_units(counts, seed, epoch, True)
        if len(counts) > INTERLEAVE_SHARDS:
            assert len(changes) == len(set(changes.tolist())), "a shard visited twice"
            assert changes.tolist() == [s for s in whole_order.tolist() if counts[s]]
        else:
            interleaved += len(changes) > len(set(changes.tolist()))
        assert is_permutation(epoch_sequence(counts, seed, epoch, True, block=cut), n)
    if len(counts) <= INTERLEAVE_SHARDS and sum(c >= 2 * cut for c in counts) >= 2:
        assert interleaved, "several shards cut, and never interleaved"


def test_a_shards_blocks_come_in_another_order_each_epoch():
    """Cut into blocks, one shard's epochs are other orders: each block's place drawn per epoch
    and seed, reproducibly; unshuffled or with no block, the shard is read in file order."""
    counts = [1000]
    firsts = {tuple(epoch_sequence(counts, seed, epoch, True, block=100)[::100].tolist())
              for seed in range(3) for epoch in range(4)}
    assert len(firsts) == 12
    assert np.array_equal(epoch_sequence(counts, 1, 2, True, block=100), epoch_sequence(counts, 1, 2, True, block=100))
    assert epoch_sequence(counts, 1, 2, False, block=100).tolist() == list(range(1000))
    assert epoch_sequence(counts, 1, 2, True).tolist() == list(range(1000))
    salted = epoch_sequence(counts, 1, 2, True, salt=1 << 20, block=100)
    assert not np.array_equal(salted, epoch_sequence(counts, 1, 2, True, block=100)) and is_permutation(salted, 1000)


def test_shuffle_block_cuts_only_where_the_shards_are_few():
    """Shards are cut where they are fewer than SHUFFLE_UNITS and one holds two blocks (equal
    shards: at most half SHUFFLE_UNITS); a block is at least BLOCK_FRAMES frames, and
    enough of them make about SHUFFLE_UNITS units."""
    assert shuffle_block([10] * SHUFFLE_UNITS, 1) == 0
    assert shuffle_block([], 1) == 0 and shuffle_block([0, 0], 1) == 0
    assert shuffle_block([20_000], 9) == -(-20_000 // SHUFFLE_UNITS)
    assert shuffle_block([2_200], 9) == BLOCK_FRAMES * 9
    assert shuffle_block([2_200, 3], 300) == 0  # no shard of two blocks of 8 frames
    assert shuffle_block([5_000] * 100, 1) == -(-500_000 // SHUFFLE_UNITS)
    assert shuffle_block([5_000] * (SHUFFLE_UNITS // 2 + 1), 1) == 0 and shuffle_block([143], 9) == 0
    assert shuffle_block([144], 9) == 72
    assert shuffle_block([100], 0) == BLOCK_FRAMES
    # And at least BLOCK_BYTES of stored bytes: twice the widest gap a ranged read bridges.
    assert shuffle_block([20_000], 9, 4096) == BLOCK_BYTES // 4096 and shuffle_block([2_047], 9, 4096) == 0
    assert shuffle_block([20_000], 9, 114_000) == -(-20_000 // SHUFFLE_UNITS)
    assert BLOCK_BYTES >= 2 * (READ_BYTES // 4)


def test_a_shard_is_kept_open_while_few_other_shards_come_between_its_visits():
    """pieces.stretches: a shard is let go after a visit whose next one comes after more than
    REVISIT_HOLD other shards' stretches, however many stretches that is (a few shards'
    interleaved blocks: 8 shards were let go one visit in eight when stretches were counted)."""
    rng = np.random.default_rng(0)
    few = [(int(shard), 0, 1) for shard in rng.integers(0, 8, 2000)]  # 8 shards visited in any order
    out = stretches(few)
    assert [s.shard for s in out if s.final] == sorted({s.shard for s in out}, key=lambda k: max(
        i for i, t in enumerate(out) if t.shard == k)) and {s.opening for s in out} == {0}
    walks = [(shard, 0, 1) for _ in range(2) for shard in range(REVISIT_HOLD + 2)]  # two walks over 18 shards
    assert [s.final for s in stretches(walks)] == [True] * len(walks)
    held = [(shard, 0, 1) for _ in range(2) for shard in range(REVISIT_HOLD + 1)]  # 16 others between: held
    assert [s.final for s in stretches(held)] == [False] * (REVISIT_HOLD + 1) + [True] * (REVISIT_HOLD + 1)


def _delivered_order(counts: list[int], epoch: int, block: int, workers: int = 2) -> np.ndarray:
    """The ids a loader of `workers` workers hands over in `epoch`, batches of 64 taken in turn."""
    layout = Layout(workers=workers, batch_size=64, shuffle=True, buffer=2048)
    sequence = epoch_sequence(counts, 0, epoch, True, block=block)
    orders = [mine[perm] for mine, perm in (worker_plan(sequence, layout, 0, epoch, 0, w) for w in range(workers))]
    batches = [o[i:i + 64] for i in range(0, max(map(len, orders)), 64) for o in orders]
    return np.concatenate([b for b in batches if len(b)])


def _places(counts: list[int], epoch: int, block: int) -> np.ndarray:
    """Each sample's place in what the loader hands over in `epoch` (`_delivered_order`)."""
    place = np.empty(sum(counts), dtype=np.int64)
    place[_delivered_order(counts, epoch, block)] = np.arange(sum(counts))
    return place


def test_one_shards_epochs_are_not_the_file_order_again():
    """Regression (RELIABILITY.md item 357's Left, found by a review of the shuffle's statistics):
    with one shard read front to back every epoch, a sample's places in one epoch and the next
    correlated at 0.71 (Spearman, 20,000 samples, 2 workers, the default buffer), and a sample in
    the shard's first quarter came in an epoch's first tenth far more often than one in its last.
    Its blocks in a seeded order each epoch: about 0, and about as often."""
    from scipy.stats import spearmanr

    counts, n = [20_000], 20_000
    block = shuffle_block(counts, 9)
    assert block
    places = functools.partial(_places, counts)

    def early(runs: list[np.ndarray]) -> float:
        """How much more often the shard's first quarter comes in an epoch's first tenth than its last."""
        first, last = (np.mean([np.mean(p[part] < n // 10) for p in runs]) for part in (slice(n // 4), slice(-n // 4, None)))
        return first / max(last, 1e-9)

    whole = [places(e, 0) for e in range(8)]
    cut = [places(e, block) for e in range(8)]
    assert min(spearmanr(a, b)[0] for a, b in zip(whole, whole[1:])) > 0.6  # what it was
    correlations = [spearmanr(a, b)[0] for a, b in zip(cut, cut[1:])]
    assert abs(np.mean(correlations)) < 0.05 and max(map(abs, correlations)) < 0.2, correlations
    assert early(whole) > 3 and 0.6 < early(cut) < 1.6, (early(whole), early(cut))


# -- deal_chunks -----------------------------------------------------------------------------


def test_deal_chunks_partitions_positions_round_robin():
    for n, workers, chunk in itertools.product([0, 1, 5, 21, 64, 65, 130, 200], [1, 2, 3, 4], [1, 2, 3, 8, 64]):
        check_deal(n, workers, chunk)


def test_a_chunk_larger_than_the_positions_costs_only_the_positions():
    """Regression (found by review): `batch_size=2**31` over 3 samples allocated 16 GiB (a MemoryError, or the
    OOM killer) dealing them; here 2**40, which no machine has."""
    assert [d.tolist() for d in deal_chunks(3, 2, 1 << 40)] == [[0, 1, 2], []]


def check_deal(n, workers, chunk):
    dealt = deal_chunks(n, workers, chunk)
    assert len(dealt) == workers
    together = np.concatenate(dealt) if dealt else np.zeros(0)
    assert is_permutation(together, n)
    # Direct statement: chunk j (positions j*chunk .. ) belongs to worker j mod workers,
    # and each worker's positions are in ascending order.
    expected = [[] for _ in range(workers)]
    for j, start in enumerate(range(0, n, chunk)):
        expected[j % workers].extend(range(start, min(n, start + chunk)))
    assert [d.tolist() for d in dealt] == expected



def test_runs_deal_every_worker_as_many_chunks_as_one_at_a_time():
    """Dealt in runs (Layout.run), each worker gets the same chunks' worth as dealt one at a time
    (the batch counts, the round robin's arithmetic and every resume replay rest on it), the last,
    short chunk to the same worker; a run of 1 is the round robin itself."""
    for n, workers, chunk, run in itertools.product([0, 1, 5, 21, 64, 65, 130, 200, 1001], [1, 2, 3, 4, 7],
                                                    [1, 3, 8, 64], [1, 2, 3, 5, 40]):
        dealt = [worker_positions(n, workers, chunk, w, run) for w in range(workers)]
        one_at_a_time = deal_chunks(n, workers, chunk)
        assert is_permutation(np.concatenate(dealt), n)
        assert [len(d) for d in dealt] == [len(d) for d in one_at_a_time]
        assert [n - 1 in d for d in dealt] == [n - 1 in d for d in one_at_a_time]
        assert worker_samples(n, Layout(workers=workers, batch_size=chunk, run=run)) == [len(d) for d in dealt]
        if run == 1:
            assert all(np.array_equal(a, b) for a, b in zip(dealt, one_at_a_time))


def test_runs_are_whole_and_the_last_round_one_share_a_worker():
    """Run j of a full round goes to worker j mod W; the last round's chunks, too few for a run
    each, go in one contiguous share a worker, so that no worker reads every other chunk of it."""
    n, workers, chunk, run = 1000, 3, 8, 5  # 125 chunks: 8 rounds of 15, then 5 chunks
    dealt = [worker_positions(n, workers, chunk, w, run) for w in range(workers)]
    for w, mine in enumerate(dealt):
        runs = mine[: 8 * run * chunk].reshape(8, run * chunk)
        assert all(np.array_equal(r, np.arange(r[0], r[0] + run * chunk)) for r in runs)
        assert runs[:, 0].tolist() == [(k * workers + w) * run * chunk for k in range(8)]
        tail = mine[8 * run * chunk :]
        assert np.array_equal(tail, np.arange(tail[0], tail[0] + len(tail)))
    # 5 chunks over 3 workers: 2, 2, 1, the last (short) one where one at a time puts it (worker 1),
    # so the shares go in the order of workers 2, 0, 1.
    assert [len(d) - 8 * run * chunk for d in dealt] == [16, 16, 8]
    assert dealt[2][-8:].tolist() == list(range(960, 968))  # chunk 120
    assert dealt[0][-16:].tolist() == list(range(968, 984)) and dealt[1][-16:].tolist() == list(range(984, 1000))


def test_deal_run_is_eight_frames_and_4_mb_of_chunks():
    """A run holds BLOCK_FRAMES frames' worth of samples and BLOCK_BYTES of the smallest, in whole chunks."""
    assert deal_run(64, 9, 114_000) == 2  # ImageNet's JPEGs: 72 samples (8 frames), 2 batches of 64
    assert deal_run(64, 170, 6_000) == -(-(BLOCK_FRAMES * 170) // 64)  # 6 KB samples: 22 batches
    assert deal_run(8, 1, 20_000) == -(-(-(-BLOCK_BYTES // 20_000)) // 8)  # the bytes decide
    assert deal_run(4096, 9, 114_000) == 1 and deal_run(64, 9, 0) == 2  # no bytes known: the frames
    # Capped where a resume state's layout is bounded (found by review: 1-sample batches of 3-byte samples
    # made runs of 1.4 million, and the library refused its own state).
    assert deal_run(1, 1024, 3) == MAX_RUN


def test_worker_samples_are_the_lengths_of_the_deal():
    for n, workers, chunk in itertools.product([0, 1, 5, 21, 64, 65, 130, 200], [1, 2, 3, 4], [1, 2, 3, 8, 64]):
        layout = Layout(workers=workers, batch_size=chunk)
        assert worker_samples(n, layout) == [len(d) for d in deal_chunks(n, workers, chunk)]

def test_batch_counts_do_not_depend_on_workers():
    """Dealing in whole batches: the batches a rank yields are the same for any worker count."""
    for n, bs, drop_last in itertools.product([0, 1, 5, 11, 21, 40], [1, 2, 3, 5], [False, True]):
        totals = set()
        for workers in [1, 2, 3, 4]:
            layout = Layout(workers=workers, batch_size=bs, drop_last=drop_last)
            totals.add(sum(items_of(len(p), layout) for p in deal_chunks(n, workers, layout.chunk)))
        assert totals == {n // bs if drop_last else -(-n // bs)}


# -- buffer_shuffle --------------------------------------------------------------------------


def test_buffer_shuffle_is_a_bounded_permutation():
    for n, buffer, seed in itertools.product([0, 1, 2, 3, 10, 33, 100], [0, 1, 2, 3, 7, 50, 1000], range(5)):
        out = buffer_shuffle(n, buffer, np.random.default_rng(seed))
        assert is_permutation(out, n)
        # output t is among inputs < t + buffer: a reader never holds more than `buffer`
        if buffer > 1:
            assert all(int(v) < t + buffer for t, v in enumerate(out))



def test_buffer_shuffle_stopped_early_is_the_start_of_the_whole_order():
    for n, buffer, emitted in itertools.product([0, 1, 2, 10, 100], [0, 1, 3, 50, 1000], [0, 1, 7, 99, 100, 500]):
        whole = buffer_shuffle(n, buffer, rng_for(3, 1, 2))
        assert buffer_shuffle(n, buffer, rng_for(3, 1, 2), emitted=emitted).tolist() == whole[:emitted].tolist()

def test_buffer_shuffle_identity_for_buffer_le_1():
    for n, buffer in itertools.product([0, 1, 2, 17], [-1, 0, 1]):
        rng = np.random.default_rng(0)
        assert buffer_shuffle(n, buffer, rng).tolist() == list(range(n))


def test_buffer_shuffle_deterministic_from_rng_and_actually_shuffles():
    for seed in range(5):
        a = buffer_shuffle(50, 8, rng_for(seed, 0, 1))
        b = buffer_shuffle(50, 8, rng_for(seed, 0, 1))
        assert np.array_equal(a, b)
        assert not np.array_equal(a, np.arange(50))
    outs = {tuple(buffer_shuffle(50, 8, rng_for(seed, 0, 1)).tolist()) for seed in range(5)}
    assert len(outs) == 5
    # a buffer as large as the input is a full shuffle: any input can come first
    firsts = {int(buffer_shuffle(10, 10, np.random.default_rng(s))[0]) for s in range(200)}
    assert firsts == set(range(10))


# -- read_order ------------------------------------------------------------------------------


def _serving(read: np.ndarray, remaining: np.ndarray, first: int) -> tuple[int, int]:
    """Serve `remaining` turn by turn from positions arriving in `read` order: the most positions held waiting
    at once, and how many reads the first `first` turns waited for."""
    arrived: set[int] = set()
    turn, held, waited = 0, 0, len(read)
    for k, position in enumerate(read.tolist()):
        arrived.add(position)
        while turn < len(remaining) and int(remaining[turn]) in arrived:
            arrived.discard(int(remaining[turn]))
            turn += 1
            if turn == first:
                waited = min(waited, k + 1)
        held = max(held, len(arrived))
    assert turn == len(remaining), "a position was never read"
    return held, waited


def test_read_order_of_a_fresh_pass_is_storage_order():
    perm = buffer_shuffle(500, 64, np.random.default_rng(0))
    assert read_order(perm, 0).tolist() == list(range(500))


@pytest.mark.parametrize("n, buffer, done", [(4000, 512, 3000), (2000, 2048, 1856), (20000, 2048, 10000),
                                             (5000, 100, 4000), (300, 50, 1)])
def test_read_order_of_a_resume_serves_the_next_batch_from_a_part_of_the_backlog(n, buffer, done):
    """A resumed pass owes the interrupted run's shuffle buffer (the backlog); its next batch draws on it at
    random. Read in storage order the batch waits for the whole backlog; read_order serves it after a fraction,
    keeps the rest in storage order, and holds no more than a shuffle buffer's worth waiting."""
    for seed in range(3):
        perm = buffer_shuffle(n, buffer, np.random.default_rng(seed))
        remaining, frontier = perm[done:], int(perm[:done].max()) + 1
        read = read_order(remaining, frontier)
        assert sorted(read.tolist()) == sorted(remaining.tolist())
        rest = read[read >= frontier]
        assert np.array_equal(rest, np.sort(rest))  # the unread part streams in storage order
        backlog = int((remaining < frontier).sum())
        held, waited = _serving(read, remaining, 64)
        held_sorted, waited_sorted = _serving(np.sort(remaining), remaining, 64)
        assert held <= min(buffer, len(remaining))
        if backlog >= 4 * 64:
            assert waited < waited_sorted / 2, (waited, waited_sorted)
        else:
            assert waited <= waited_sorted


def test_rng_for_distinct_for_the_tuples_the_plan_uses():
    """The plan draws shard orders from (seed, epoch, 0) and buffers from (seed, epoch, 1 + segment, rank, worker)."""
    tuples = [(epoch, 0) for epoch in range(3)] + [
        (epoch, 1 + segment, rank, worker)
        for epoch in range(3) for segment in range(2) for rank in range(3) for worker in range(3)
    ]
    for seed in [0, 1, 12345]:
        draws = {tuple(rng_for(seed, *parts).integers(0, 2**62, 4).tolist()) for parts in tuples}
        assert len(draws) == len(tuples)
    assert np.array_equal(rng_for(3, 1, 2).random(5), rng_for(3, 1, 2).random(5))
    assert not np.array_equal(rng_for(3, 1, 2).random(5), rng_for(4, 1, 2).random(5))


def test_rng_for_independent_for_every_distinct_tuple():
    def draw(seed, *parts):
        return tuple(rng_for(seed, *parts).integers(0, 2**62, 4).tolist())

    tuples = [(), (0,), (1,), (0, 1), (1, 0), (0, 0), (0, 1, 0, 0)]
    for seed in [0, 1]:
        assert len({draw(seed, *parts) for parts in tuples}) == len(tuples)
    assert draw(5 + 2**32, 0) != draw(5, 1, 0)
    counts = [3, 3, 3, 2, 3, 2, 2, 2, 1]
    assert not np.array_equal(epoch_sequence(counts, 5 + 2**32, 0, True), epoch_sequence(counts, 5, 1, True))


# -- round_robin_delivered -------------------------------------------------------------------


def simulate_round_robin(items: list[int], delivered: int) -> list[int]:
    """A DataLoader's polling, step by step: ask worker 0, 1, ..., skipping exhausted ones."""
    got = [0] * len(items)
    exhausted = [n == 0 for n in items]
    w = 0
    for _ in range(delivered):
        if all(exhausted):
            raise ValueError("more delivered than the workers have")
        while exhausted[w]:
            w = (w + 1) % len(items)
        got[w] += 1
        if got[w] == items[w]:
            exhausted[w] = True
        w = (w + 1) % len(items)
    return got


def test_round_robin_delivered_matches_simulation_exhaustively():
    for workers in range(1, 5):
        for items in itertools.product(range(5), repeat=workers):
            items = list(items)
            for delivered in range(sum(items) + 1):
                assert round_robin_delivered(items, delivered) == simulate_round_robin(items, delivered), (
                    items, delivered)


def test_round_robin_delivered_random_large():
    rng = np.random.default_rng(0)
    for _ in range(200):
        items = rng.integers(0, 40, size=int(rng.integers(1, 9))).tolist()
        delivered = int(rng.integers(0, sum(items) + 1))
        assert round_robin_delivered(items, delivered) == simulate_round_robin(items, delivered)


def polled(queues: list[list[tuple[int, int]]]) -> list[tuple[int, int]]:
    """What a fresh DataLoader receives from workers holding these queues of items."""
    out, rounds = [], max(map(len, queues), default=0)
    for r in range(rounds):
        out += [queue[r] for queue in queues if len(queue) > r]
    return out


def test_a_resumed_round_robin_continues_the_interrupted_one_exactly():
    # plan worker w's items are (w, 0), (w, 1), ...; a DataLoader interrupted after
    # `delivered` items is replaced by one whose loader worker i serves the plan worker
    # and the position `loader_start` gives: it must receive exactly the rest
    for workers in range(1, 5):
        for items in itertools.product(range(4), repeat=workers):
            whole = polled([[(w, i) for i in range(n)] for w, n in enumerate(items)])
            for delivered in range(len(whole) + 1):
                starts = [loader_start(items, delivered, i) for i in range(workers)]
                assert sorted(w for w, _ in starts) == list(range(workers))  # each plan worker served once
                resumed = polled([[(w, i) for i in range(done, items[w])] for w, done in starts])
                assert resumed == whole[delivered:], (items, delivered)


def test_an_endless_round_robin_resumes_regularly():
    for workers in range(1, 5):
        whole = polled([[(w, i) for i in range(9)] for w in range(workers)])  # never exhausted in the range
        for delivered in range(3 * workers):
            starts = [endless_start(workers, delivered, i) for i in range(workers)]
            resumed = polled([[(w, i) for i in range(done, 9)] for w, done in starts])
            assert resumed[: 2 * workers] == whole[delivered : delivered + 2 * workers]


def test_an_endless_deal_of_whole_chunks_deals_the_epochs_as_one_sequence():
    # With every chunk whole, epoch k's chunk i (share i mod W of its own deal) must be chunk
    # `offset_k + i` of the whole stream, and that goes to worker (offset_k + i) mod W.
    from shardstream.roundrobin import EndlessDeal

    rng = np.random.default_rng(5)
    for _ in range(300):
        workers, first, later = int(rng.integers(1, 9)), int(rng.integers(0, 30)), int(rng.integers(1, 30))
        deal = EndlessDeal([len(range(w, first, workers)) for w in range(workers)],
                           [len(range(w, later, workers)) for w in range(workers)])
        offset = 0
        for k in range(6):
            chunks = first if k == 0 else later
            for i in range(chunks):
                assert deal.share((offset + i) % workers, k) == i % workers
            offset += chunks


@pytest.mark.parametrize("layout", [Layout(workers=2), Layout(workers=3, batch_size=7, drop_last=True),
                                    Layout(workers=4, batch_size=5), Layout(workers=2, batch_size=3, drop_last=True)])
def test_an_endless_deal_keeps_the_workers_together_whatever_the_last_chunk_yields(layout):
    """A last chunk that yields fewer items (64 samples unbatched, a batch drop_last drops): dealt by chunks, the
    worker that had it every epoch ran ahead without bound. The spread of items handed over stays within a chunk."""
    from shardstream.roundrobin import EndlessDeal

    for block in (90, 128, 400, 63):
        deal = EndlessDeal(worker_items(block, layout), worker_items(block, layout))
        handed = [0] * layout.workers
        for k in range(200):
            for w in range(layout.workers):
                handed[w] += deal.items(w, k)
            assert max(handed) - min(handed) <= (layout.batch_size and 1 or layout.chunk), (block, k, handed)


def test_round_robin_delivered_rejects_too_many():
    with pytest.raises(ValueError):
        round_robin_delivered([2, 1], 4)
    assert round_robin_delivered([], 0) == []


# -- worker plans, consumed and remaining samples -----------------------------------------------


def random_layout(rng: np.random.Generator) -> Layout:
    batch = [None, 1, 2, 3, 5][int(rng.integers(0, 5))]
    return Layout(
        world_size=int(rng.integers(1, 5)),
        workers=int(rng.integers(1, 4)),
        batch_size=batch,
        drop_last=bool(rng.integers(0, 2)) and batch is not None,
        partial=["pad", "drop"][int(rng.integers(0, 2))],
        shuffle=bool(rng.integers(0, 2)),
        buffer=int(rng.integers(0, 9)),
        run=[1, 1, 2, 3][int(rng.integers(0, 4))],
    )


def random_case(rng: np.random.Generator) -> tuple[Layout, int, int, np.ndarray]:
    """A random layout, seed and epoch, and the epoch sequence of random shard counts."""
    counts = random_counts(rng)
    layout = random_layout(rng)
    seed, epoch = int(rng.integers(0, 1000)), int(rng.integers(0, 4))
    return layout, seed, epoch, epoch_sequence(counts, seed, epoch, layout.shuffle)


def rank_items(seq: np.ndarray, layout: Layout, seed: int, epoch: int, rank: int, segment: int = 0):
    """Per worker: the samples it yields, in its order, and its items (as lists of sample ids)."""
    block = split_ranks(seq, layout.world_size, layout.partial)[rank]
    out = []
    for w in range(layout.workers):
        mine, perm = worker_plan(block, layout, seed, epoch, rank, w, segment)
        order = mine[perm].tolist()
        size = layout.batch_size or 1
        items = [order[i : i + size] for i in range(0, len(order), size)]
        if layout.batch_size is not None and layout.drop_last and items and len(items[-1]) < size:
            items = items[:-1]
        assert len(items) == items_of(len(mine), layout)
        out.append(items)
    return out


def test_worker_plans_cover_the_rank_block():
    rng = np.random.default_rng(1)
    for _ in range(150):
        layout, seed, epoch, seq = random_case(rng)
        blocks = split_ranks(seq, layout.world_size, layout.partial)
        for rank in range(layout.world_size):
            yielded = []
            for w in range(layout.workers):
                mine, perm = worker_plan(blocks[rank], layout, seed, epoch, rank, w)
                assert is_permutation(perm, len(mine))
                assert np.array_equal(perm, worker_plan(blocks[rank], layout, seed, epoch, rank, w)[1])
                yielded += mine.tolist()
            assert sorted(yielded) == sorted(blocks[rank].tolist())


def test_consumed_matches_what_the_round_robin_delivered():
    """consumed_samples == the samples in the first `delivered` items of every rank, polled round robin."""
    rng = np.random.default_rng(2)
    for _ in range(150):
        layout, seed, epoch, seq = random_case(rng)
        per_rank = [rank_items(seq, layout, seed, epoch, r) for r in range(layout.world_size)]
        total = len(list(itertools.chain.from_iterable(per_rank[0])))
        assert all(sum(map(len, p)) == total for p in per_rank)  # equal item counts per rank
        delivered = int(rng.integers(0, total + 1))
        expected = []
        for workers_items in per_rank:
            # poll round robin over workers, skipping exhausted ones
            queues = [list(items) for items in workers_items]
            got = 0
            while got < delivered:
                for q in queues:
                    if q and got < delivered:
                        expected += q.pop(0)
                        got += 1
        consumed = consumed_samples(seq, layout, seed, epoch, delivered)
        assert sorted(consumed.tolist()) == sorted(expected)


def test_consumed_and_remaining_partition_the_epoch():
    rng = np.random.default_rng(3)
    for _ in range(300):
        layout, seed, epoch, seq = random_case(rng)
        blocks = split_ranks(seq, layout.world_size, layout.partial)
        items = worker_items(blocks.shape[1], layout)
        delivered = int(rng.integers(0, sum(items) + 1))
        consumed = consumed_samples(seq, layout, seed, epoch, delivered)
        remaining = remaining_sequence(seq, consumed)
        c, r = set(consumed.tolist()), remaining.tolist()
        assert len(r) == len(set(r))  # no repeats in what is left
        assert not (c & set(r))  # disjoint
        assert c | set(r) == set(seq.tolist())  # together: everything
        assert set(consumed.tolist()) <= set(blocks.reshape(-1).tolist())
        # remaining keeps the epoch order
        assert r == [x for x in seq.tolist() if x not in c]
        # consumption is monotone in `delivered`
        if delivered:
            before = set(consumed_samples(seq, layout, seed, epoch, delivered - 1).tolist())
            assert before <= c
        # everything delivered: only the samples that "drop" left out remain
        everything = consumed_samples(seq, layout, seed, epoch, sum(items))
        if layout.batch_size is None or not layout.drop_last:
            assert set(remaining_sequence(seq, everything).tolist()) == set(seq.tolist()) - set(
                blocks.reshape(-1).tolist())


def test_left_out_positions_are_what_a_whole_epoch_never_delivers():
    """Replayed alone (one worker's whole buffer where drop_last cuts its last batch), the
    positions a layout leaves out are exactly those the whole epoch's deliveries miss,
    padded repeats counted where they are delivered."""
    rng = np.random.default_rng(11)
    seen_out = 0
    for _ in range(300):
        counts = random_counts(rng)
        layout = random_layout(rng)
        seed, epoch, segment = int(rng.integers(0, 1000)), int(rng.integers(0, 4)), int(rng.integers(0, 3))
        n = int(np.sum(counts))
        items = sum(worker_items(rank_block_length(n, layout), layout))
        delivered = set(consumed_positions(n, layout, seed, epoch, items, segment).tolist())
        left_out = left_out_positions(n, layout, seed, epoch, segment).tolist()
        assert left_out == sorted(set(range(n)) - delivered)
        seen_out += bool(left_out)
    assert seen_out > 30, "the random layouts leave samples out often enough to test"


def loop_timeline(n: int, layout: Layout, seed: int, epoch: int, segment: int) -> list[list[list[tuple[int, bool]]]]:
    """Per rank, the items its loop receives, in order, each a list of (position in the
    epoch sequence, marked as a repeat): workers polled round robin, skipping finished ones."""
    blocks = split_ranks(np.arange(n, dtype=np.int64), layout.world_size, layout.partial)
    timeline = []
    for rank in range(layout.world_size):
        queues = []
        for w in range(layout.workers):
            places = worker_positions(blocks.shape[1], layout.workers, layout.chunk, w, layout.run)
            mine, perm = worker_plan(blocks[rank], layout, seed, epoch, rank, w, segment)
            marks = repeated_positions(n, layout, seed, epoch, rank, places, segment)
            order = list(zip(mine[perm].tolist(), marks[perm].tolist()))
            size = layout.batch_size or 1
            items = [order[i : i + size] for i in range(0, len(order), size)]
            if layout.drop_last and items and len(items[-1]) < size:
                items.pop()
            queues.append(items)
        received = []
        while any(queues):
            for queue in queues:
                if queue:
                    received.append(queue.pop(0))
        timeline.append(received)
    return timeline


def test_repeats_marked_leave_every_delivered_sample_once_however_far_the_pass_went():
    """Where a pass stops (a resume's state, or its end), the deliveries not marked as
    repeats hold every sample delivered so far exactly once, and a whole pass's marks are
    exactly its deliveries beyond the distinct samples (the padding, less what drop_last dropped)."""
    rng = np.random.default_rng(12)
    marked_seen = cut_between = 0
    for case in range(400):
        counts = random_counts(rng)
        layout = random_layout(rng)
        if case % 3 == 0:  # more ranks than samples too: 10 samples on 8 ranks hold 6 repeats
            layout = Layout(**{**layout.__dict__, "world_size": int(rng.integers(5, 12))})
        seed, epoch, segment = int(rng.integers(0, 1000)), int(rng.integers(0, 4)), int(rng.integers(0, 3))
        n = int(np.sum(counts))
        timeline = loop_timeline(n, layout, seed, epoch, segment)
        steps = len(timeline[0])
        assert all(len(received) == steps for received in timeline)
        for stop in sorted({int(rng.integers(0, steps + 1)), steps}):
            delivered: list[int] = []
            unmarked: list[int] = []
            for received in timeline:
                for item in received[:stop]:
                    delivered += [p for p, _ in item]
                    unmarked += [p for p, marked in item if not marked]
            assert sorted(unmarked) == sorted(set(delivered)), (layout, n, stop)
            cut_between += stop < steps and len(delivered) > len(set(delivered))
        marked_seen += len(delivered) > len(set(delivered))
        if layout.partial == "drop":
            assert len(delivered) == len(set(delivered))
    assert marked_seen > 60 and cut_between > 10, "the random layouts repeat samples, and stop among them, often enough"


def test_repeated_positions_mark_the_padding_of_an_unshuffled_pass():
    """10 samples on 8 ranks of one worker: blocks of 2, positions 10-15 repeat 0-5 in the
    blocks of ranks 5 to 7, received at the same steps as ranks 0 to 2 receive 0-5."""
    layout = Layout(world_size=8)
    marks = [repeated_positions(10, layout, 0, 0, rank, np.arange(2)).tolist() for rank in range(8)]
    assert marks == [[False, False]] * 5 + [[True, True]] * 3
    assert not repeated_positions(10, Layout(world_size=8, partial="drop"), 0, 0, 7, np.arange(1)).any()
    assert not repeated_positions(16, layout, 0, 0, 7, np.arange(2)).any()


def test_samples_of_items():
    assert samples_of_items(3, 10, Layout(batch_size=4)) == 10
    assert samples_of_items(2, 10, Layout(batch_size=4)) == 8
    assert samples_of_items(7, 10, Layout()) == 7
    assert samples_of_items(0, 10, Layout(batch_size=4)) == 0


def test_items_of():
    assert items_of(10, Layout()) == 10
    assert items_of(10, Layout(batch_size=4)) == 3
    assert items_of(10, Layout(batch_size=4, drop_last=True)) == 2
    assert items_of(0, Layout(batch_size=4)) == 0
    assert Layout().chunk == 64 and Layout(batch_size=3).chunk == 3


def test_two_shards_epochs_are_not_their_order_again():
    """Found by a review of the blocks: with two shards each read in one visit, the same shard
    came first in two epochs in a row one time in two, and a sample's places in them then
    correlated at about 0.55 (the mean over pairs hid it: +0.55 and -0.55 cancel). A few shards'
    blocks interleaved: small in every pair."""
    from scipy.stats import spearmanr

    counts = [10_000, 10_000]
    block = shuffle_block(counts, 9)
    places = functools.partial(_places, counts)

    whole = [places(e, 0) for e in range(8)]
    cut = [places(e, block) for e in range(8)]
    assert np.mean([abs(spearmanr(a, b)[0]) for a, b in zip(whole, whole[1:])]) > 0.3  # what it was
    assert max(abs(spearmanr(a, b)[0]) for a, b in zip(cut, cut[1:])) < 0.2

