"""Shuffled epochs of few shards: each shard cut into blocks read in a seeded order (plan.shuffle_block).

The plan's own properties are in test_plan.py; here the same promises hold through the
dataset: the order it yields is the plan's, every sample once over ranks and workers, a
resume continues exactly, a shard's blocks are read by ranges locally and over HTTP, and
a state of another cut is refused.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import shardstream
from shardstream import ShardstreamError
from shardstream import plan
from shardstream.plan import epoch_sequence, shuffle_block
from shardstream.testing import HTTPTestServer

import _data as D
import _remote_helpers as H

SAMPLES = 3072


def write_blocky(folder: Path, max_samples: int | None = None) -> str:
    """SAMPLES samples of 7-11 KB of noise, a frame each: one shard (or shards of
    `max_samples`), cut into blocks of about 4 MB (plan.BLOCK_BYTES) when shuffled."""
    rng = np.random.default_rng(0)
    with shardstream.ShardWriter(str(folder), frame_size=4000, max_samples=max_samples) as writer:
        for i in range(SAMPLES):
            writer.write({"__key__": f"s{i:04d}", "bin": rng.bytes(int(rng.integers(7000, 11000))), "cls": i % 5})
    return str(folder)


@pytest.fixture(scope="module")
def one_shard(tmp_path_factory) -> str:
    return write_blocky(tmp_path_factory.mktemp("blocks") / "one")


@pytest.fixture(scope="module")
def three_shards(tmp_path_factory) -> str:
    return write_blocky(tmp_path_factory.mktemp("blocks") / "three", max_samples=SAMPLES // 3)


def block_of(url: str) -> int:
    source = shardstream.open_dataset(url)
    return shuffle_block(source.counts(), source.samples_per_frame(), source.least_sample_bytes())


def shard_bytes(url: str) -> int:
    return sum(os.path.getsize(os.path.join(url, name)) for name in os.listdir(url) if name.endswith(".tar.zst"))


def test_the_fixture_is_cut(one_shard, three_shards):
    """What the tests below rely on: every shard of both datasets holds two blocks or more."""
    for url, shards in ((one_shard, 1), (three_shards, 3)):
        counts = shardstream.open_dataset(url).counts()
        assert len(counts) == shards and block_of(url) and (counts >= 2 * block_of(url)).all()


@pytest.mark.parametrize("which", ["one_shard", "three_shards"])
def test_a_shuffled_epoch_reads_the_shards_blocks_in_the_plans_order(which, request):
    """Without a buffer the dataset yields the plan's sequence: a shard's blocks in a seeded order,
    another each epoch, never the file order; unshuffled, the file order."""
    url = request.getfixturevalue(which)
    keys = D.manifest_keys(url)
    orders = []
    for epoch in range(3):
        ds = D.key_dataset(url, shuffle=True, shuffle_buffer=0, seed=3)
        ds.set_epoch(epoch)
        got = D.flat(D.freeze(item) for item in ds)
        assert got == D.epoch_keys(url, 3, epoch, True) and sorted(got) == sorted(keys)
        orders.append(got)
    uncut = [keys[i] for i in epoch_sequence(shardstream.open_dataset(url).counts(), 3, 0, True)]
    assert len({tuple(o) for o in orders}) == 3 and orders[0] != uncut
    assert D.flat(D.freeze(item) for item in D.key_dataset(url, shuffle=False)) == keys


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_blocks_are_split_exactly_once_over_ranks_and_workers(one_shard, world_size):
    """Every sample once over ranks and real DataLoader workers (padding aside), the same number
    of batches on every rank."""
    per_rank = []
    for rank in range(world_size):
        ds = D.key_dataset(one_shard, shuffle=True, seed=1, rank=rank, world_size=world_size, batch_size=8)
        per_rank.append(D.run(ds, 2))
    assert len({len(batches) for batches in per_rank}) == 1
    seen = D.counts(D.flat(b for batches in per_rank for b in batches))
    assert set(seen) == set(D.manifest_keys(one_shard))
    assert sum(seen.values()) == SAMPLES + D.pad_count(SAMPLES, world_size)
    assert sum(c - 1 for c in seen.values()) == D.pad_count(SAMPLES, world_size)


@pytest.mark.parametrize("workers", [0, 2])
def test_a_resume_in_the_middle_of_an_epoch_of_blocks_is_exact(three_shards, workers):
    """Stopped after 9 batches and resumed from the state: the rest of the epoch, exactly what the
    uninterrupted run yielded after them."""
    def make():
        return shardstream.DataLoader(D.key_dataset(three_shards, shuffle=True, seed=2, batch_size=16),
                                      num_workers=workers)

    full = [D.freeze(b) for b in D.listed(make())]
    head, state = D.stop_after(make(), 9)
    assert state["blocks"] == [block_of(three_shards)]
    resumed = make()
    resumed.load_state_dict(state)
    assert head + [D.freeze(b) for b in D.listed(resumed)] == full


def test_a_state_of_another_cut_is_refused(one_shard):
    """A state taken where each shard was read whole (version 3, before blocks) or cut otherwise
    would be replayed onto another order: refused, saying why, unless it took nothing of its
    epoch or all of it (found by a review: an end-of-epoch checkpoint was refused). Unshuffled,
    shards are whole either way, and a version 3 state loads."""
    def state_of(shuffle: bool) -> dict:
        ds = D.key_dataset(one_shard, shuffle=shuffle)
        D.take_main(ds, 5)
        return json.loads(json.dumps(ds.state_dict()))

    state = state_of(True)
    before = {k: v for k, v in {**state, "version": 3}.items() if k != "blocks"}
    with pytest.raises(ShardstreamError, match="front to back"):
        D.key_dataset(one_shard, shuffle=True).load_state_dict(before)
    with pytest.raises(ShardstreamError, match=r"blocks of \[7\] samples"):
        D.key_dataset(one_shard, shuffle=True).load_state_dict({**state, "blocks": [7]})
    with pytest.raises(ShardstreamError, match=r"blocks\[0\]"):
        D.key_dataset(one_shard, shuffle=True).load_state_dict({**state, "blocks": [-1]})
    # Taken before the epoch's first step or at its end, no order is replayed: accepted.
    for delivered in (0, SAMPLES):
        edge = {**before, "current": {**before["current"], "delivered": delivered}}
        ds = D.key_dataset(one_shard, shuffle=True)
        ds.load_state_dict(edge)
        assert len(D.flat(D.freeze(item) for item in ds)) == SAMPLES - delivered
    plain = state_of(False)
    assert plain["blocks"] == [0]
    ds = D.key_dataset(one_shard, shuffle=False)
    ds.load_state_dict({k: v for k, v in {**plain, "version": 3}.items() if k != "blocks"})
    assert D.flat(D.freeze(item) for item in ds) == D.manifest_keys(one_shard)[5:]


def test_blocks_over_http_read_every_sample_once_by_ranges(one_shard):
    """Over HTTP (no cache: ranged reads of each block's frames, out of file order) with two
    workers, the epoch holds every sample once, in the plan's order per worker."""
    with HTTPTestServer(str(Path(one_shard).parent)) as server:
        url = f"{server.url}/{Path(one_shard).name}"
        ds = D.key_dataset(url, shuffle=True, shuffle_buffer=0, seed=5, prefetch=4)
        got = D.flat(D.run(ds, 2))
    assert sorted(got) == sorted(D.manifest_keys(one_shard))
    local = D.flat(D.run(D.key_dataset(one_shard, shuffle=True, shuffle_buffer=0, seed=5), 2))
    assert got == local


@pytest.mark.parametrize("which", ["one_shard", "three_shards"])
def test_blocks_read_over_http_fetch_each_frame_about_once(which, request):
    """Regression (found by reviews): ranged reads bridge gaps of up to 2 MB between a reader's
    runs, and with blocks out of file order (of one shard, or of a few shards interleaved) a
    bridge held whole blocks read in their own turn, which fetched those bytes again: 3-12x a
    small shard's bytes an epoch. Blocks hold 4 MB at least now (plan.BLOCK_BYTES)."""
    url = request.getfixturevalue(which)
    with H.CountingHTTPServer(str(Path(url).parent)) as server:  # closes its kept-alive connections
        ds = D.key_dataset(f"{server.url}/{Path(url).name}", shuffle=True, seed=4)
        assert len(D.flat(D.freeze(item) for item in ds)) == SAMPLES
        fetched = ds.io_stats()["bytes"]
    assert shard_bytes(url) < fetched < 1.1 * shard_bytes(url), (fetched, shard_bytes(url))


def test_a_few_interleaved_shards_are_downloaded_once_into_a_cache_smaller_than_them(tmp_path, monkeypatch):
    """Regression (found by a review): a few shards' interleaved blocks bring a reader back to
    each shard many times. Kept open only while the next visit came within 16 stretches, 8
    shards were let go at one visit in eight, and a cache smaller than the data evicted them:
    29 downloads of 8 shards an epoch. A shard is kept open while fewer than 17 other shards
    come between its visits: each downloaded once (the cache over its limit meanwhile, as with
    any shards in use). Blocks of 8 frames here, not 4 MB: the many visits of 8 shards of
    256 MB, on a dataset a test can read."""
    monkeypatch.setattr(plan, "BLOCK_BYTES", 0)
    folder = tmp_path / "eight"
    rng = np.random.default_rng(1)
    with shardstream.ShardWriter(str(folder), frame_size=4000, max_samples=1000) as writer:
        for i in range(8000):
            writer.write({"__key__": f"s{i:05d}", "bin": rng.bytes(int(rng.integers(1000, 3000))), "cls": i % 5})
    assert len(shardstream.open_dataset(str(folder)).counts()) == 8 and block_of(str(folder))
    with H.CountingHTTPServer(str(tmp_path)) as server:
        ds = D.key_dataset(f"{server.url}/eight", shuffle=True, seed=1, cache_dir=str(tmp_path / "cache"),
                           cache_limit="6MB")
        assert len(D.flat(D.freeze(item) for item in ds)) == 8000
        stats = ds.io_stats()
        assert stats["cache_misses"] == 8
        # What the storage sent, apart from the cached copies' reads (found by a user's walk: `bytes` alone
        # could not tell them apart): each shard once, besides the manifest and the indexes.
        manifest = shardstream.open_dataset(str(folder)).manifest
        stored = int(manifest.shards.bytes.sum())
        around = int(manifest.shards.index_bytes.sum()) + (folder / "manifest.msgpack").stat().st_size
        assert stored <= stats["remote_bytes"] <= stored + around < stats["bytes"]


def test_the_byte_floor_is_the_densest_shards(tmp_path):
    """Found by a review: the 4 MB floor took the dataset's mean bytes a sample, so a shard of
    well-compressed samples beside shards of noise was cut into blocks of well under 2 MB,
    which ranged reads bridge (1.1-1.8x that shard's bytes an epoch). The floor is the
    densest shard's: every shard's blocks hold 4 MB of its own stored bytes at least."""
    rng = np.random.default_rng(2)
    with shardstream.ShardWriter(str(tmp_path / "mixed"), frame_size=4000, max_samples=400) as writer:
        for i in range(400):  # shard 0: noise
            writer.write({"__key__": f"n{i:04d}", "bin": rng.bytes(10_000)})
        for i in range(400):  # shard 1: text that zstd shrinks many times
            writer.write({"__key__": f"t{i:04d}", "txt": f"sample {i} " * 400})
    source = shardstream.open_dataset(str(tmp_path / "mixed"))
    stored = source.manifest.shards.bytes // source.counts()
    assert stored[1] * 5 < stored[0] and source.least_sample_bytes() == stored.min()
    block = shuffle_block([100_000, 100_000], 1, source.least_sample_bytes())
    assert block * stored.min() >= plan.BLOCK_BYTES > shuffle_block([100_000, 100_000], 1, source.mean_sample_bytes()) * stored.min()


def test_inspect_says_how_a_shuffled_epoch_reads_the_shards(one_shard, three_shards, packed):
    """`shardstream inspect` says whether a shuffled epoch cuts the shards, into how many
    blocks, and in what order it reads them (from the manifest alone)."""
    from shardstream.verify import inspect_dataset

    def shown(url: str) -> str:
        done = subprocess.run([sys.executable, "-m", "shardstream.cli", "inspect", url], capture_output=True,
                              text=True, timeout=120, check=True)
        return next(line for line in done.stdout.splitlines() if line.startswith("shuffled epochs read"))

    for url, order in ((one_shard, "all shards' in one seeded order"), (three_shards, "all shards' in one seeded order")):
        info = inspect_dataset(url)
        counts = shardstream.open_dataset(url).counts()
        assert info["shuffle_block"] == block_of(url) > 0
        assert info["shuffle_blocks"] == sum(c // block_of(url) for c in counts)
        assert shown(url) == (f"shuffled epochs read {info['shuffle_blocks']:,} blocks of {block_of(url):,} samples "
                              f"or more, {order}")
    assert inspect_dataset(packed)["shuffle_block"] == 0
    assert shown(packed).startswith("shuffled epochs read each of the") and shown(packed).endswith("shards whole, in a seeded order")

