"""The epoch plan (shardstream.plan): pure functions, checked over many shapes and seeds.

Every property here is checked against an independent statement of what the plan
promises (plan.py's docstring), not against the implementation: permutations are
checked by sorting, round robin by a direct simulation of a DataLoader's polling, and
resumption by a set equation over consumed and remaining samples.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from shardstream.plan import (
    BLOCK_FRAMES,
    SHUFFLE_UNITS,
    Layout,
    buffer_shuffle,
    consumed_positions,
    consumed_samples,
    deal_chunks,
    epoch_block,
    epoch_sequence,
    epoch_units,
    items_of,
    left_out_positions,
    rank_block_length,
    read_order,
    remaining_sequence,
    rng_for,
    samples_of_items,
    shuffle_block,
    split_ranks,
    worker_items,
    worker_plan,
    worker_samples,
)
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


@pytest.mark.parametrize("counts", SHAPES, ids=str)
@pytest.mark.parametrize("cut", [1, 2, 3, 5, 100])
def test_epoch_units_cut_each_shard_into_blocks_read_in_one_visit(counts, cut):
    """Units are runs of consecutive ids covering every sample once, each within one shard and
    at most `cut` long, near-equal within a shard; a shard's units come one after another, and
    the shards in the order they have uncut."""
    n, starts = sum(counts), np.cumsum([0] + counts)
    for seed, epoch in itertools.product(range(3), range(3)):
        units, order = epoch_units(counts, seed, epoch, True, block=cut)
        firsts = np.cumsum(units) - units
        assert units.sum() == n and sorted(order.tolist()) == list(range(len(units)))
        shard_of = np.searchsorted(starts, firsts, side="right") - 1
        for shard, count in enumerate(counts):
            mine = units[(shard_of == shard) & (units > 0)]  # an empty unit's place names no shard
            if count:
                assert mine.sum() == count and mine.max() <= cut and mine.max() - mine.min() <= 1
                assert len(mine) == -(-count // cut)
        assert (units == 0).sum() == counts.count(0)
        visits = shard_of[order][units[order] > 0]
        changes = visits[np.r_[True, visits[1:] != visits[:-1]][: len(visits)]]
        assert len(changes) == len(set(changes.tolist())), "a shard visited twice"
        whole, whole_order = epoch_units(counts, seed, epoch, True)
        assert changes.tolist() == [s for s in whole_order.tolist() if counts[s]]
        assert is_permutation(epoch_sequence(counts, seed, epoch, True, block=cut), n)


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
    """Shards are cut where they are fewer than SHUFFLE_UNITS and one is longer than a block; a
    block is at least BLOCK_FRAMES frames, and enough of them make about SHUFFLE_UNITS units."""
    assert shuffle_block([10] * SHUFFLE_UNITS, 1) == 0
    assert shuffle_block([], 1) == 0 and shuffle_block([0, 0], 1) == 0
    assert shuffle_block([20_000], 9) == -(-20_000 // SHUFFLE_UNITS)
    assert shuffle_block([2_200], 9) == BLOCK_FRAMES * 9
    assert shuffle_block([2_200, 3], 300) == 0  # no shard longer than 8 frames
    assert shuffle_block([5_000] * (SHUFFLE_UNITS - 1), 1) == -(-5_000 * (SHUFFLE_UNITS - 1) // SHUFFLE_UNITS)
    assert shuffle_block([100], 0) == BLOCK_FRAMES


def _delivered_order(counts: list[int], epoch: int, block: int, workers: int = 2) -> np.ndarray:
    """The ids a loader of `workers` workers hands over in `epoch`, batches of 64 taken in turn."""
    layout = Layout(workers=workers, batch_size=64, shuffle=True, buffer=2048)
    sequence = epoch_sequence(counts, 0, epoch, True, block=block)
    orders = [mine[perm] for mine, perm in (worker_plan(sequence, layout, 0, epoch, 0, w) for w in range(workers))]
    batches = [o[i:i + 64] for i in range(0, max(map(len, orders)), 64) for o in orders]
    return np.concatenate([b for b in batches if len(b)])


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

    def places(epoch: int, cut: int) -> np.ndarray:
        place = np.empty(n, dtype=np.int64)
        place[_delivered_order(counts, epoch, cut)] = np.arange(n)
        return place

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
