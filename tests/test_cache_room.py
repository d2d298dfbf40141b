"""The cache's room: when a download walks the cache, and how far a walk evicts.

A walk stats every cached file under the room lock that every process on the machine
takes in turn: 2.1 s at 50k cached shards, so downloads across the machine ran at one a
walk. Downloads that fit by the ledger (the bytes the last walk counted, plus every
reservation since) do not walk, for `LEDGER_TRUST_S` after that walk; a walk that must
evict goes down to `LOW_WATER` of the limit, so a full cache does not walk per download.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from shardstream import cacheroom
from shardstream.cacheroom import Room

MB = 1 << 20


class Counted(Room):
    """A cache's room whose walks are counted (by the bytes each made room for)."""

    walks: list[int]

    def walk(self, incoming: int) -> int:
        self.walks.append(incoming)
        return super().walk(incoming)


@pytest.fixture
def cache(tmp_path) -> Counted:
    """A cache of 10 MB holding five cached files of 1 MB, used oldest first."""
    for i in range(5):
        add_cached_file(tmp_path / "cache", i)
    made = Counted(str(tmp_path / "cache"), 10 * MB)
    object.__setattr__(made, "walks", [])  # a frozen dataclass, as Room is
    return made


# A cached shard lives at <location>/<version>/NAME, each folder named by 16 hex digits (cache.py).
LOCATION, VERSION = "0123456789abcdef", "fedcba9876543210"


def add_cached_file(root: Path, i: int) -> None:
    version = root / LOCATION / VERSION
    version.mkdir(parents=True, exist_ok=True)
    path = version / f"shard-{i:06d}.tar.zst"
    path.write_bytes(b"\0" * MB)
    os.utime(path, (1_000_000 + i, 1_000_000 + i))  # used in order: 0 least recently


def make_room(room: Room, incoming: int) -> None:
    with room.turn():
        room.make(incoming)


def cached(cache: Room) -> list[str]:
    return sorted(n for n in os.listdir(Path(cache.root) / LOCATION / VERSION) if n.endswith(".tar.zst"))


def test_downloads_that_fit_by_the_ledger_do_not_walk(cache):
    for _ in range(3):
        make_room(cache, MB)
    assert cache.walks == [MB]  # the first: no ledger yet
    make_room(cache, 3 * MB)  # 5 + 3 reserved + 3 > 10 by the ledger: a walk counts again
    assert cache.walks == [MB, 3 * MB]
    assert len(cached(cache)) == 5  # the reservations were never made into files: 5 + 3 fit, nothing goes


def test_the_ledger_is_trusted_a_while_only(cache, monkeypatch):
    make_room(cache, MB)
    for i in range(5, 9):  # put there behind the ledger's back: 9 MB on disk, 6 MB in the ledger
        add_cached_file(Path(cache.root), i)
    make_room(cache, MB)
    assert len(cache.walks) == 1
    later = time.time() + 61  # a minute on: LEDGER_TRUST_S, which README promises
    monkeypatch.setattr(cacheroom.time, "time", lambda: later)
    make_room(cache, MB)  # a minute on: the walk sees the 9 MB, and 1 more fits
    assert len(cache.walks) == 2 and len(cached(cache)) == 9


def test_a_walk_that_evicts_goes_down_to_the_low_water_mark(cache):
    for i in range(5, 9):
        add_cached_file(Path(cache.root), i)
    make_room(cache, 2 * MB)  # 9 + 2 > 10: evicting one would do; down to 9.5 MB, with the 2 coming, takes two
    assert cached(cache) == [f"shard-{i:06d}.tar.zst" for i in range(2, 9)]
    assert not os.path.exists(os.path.join(cache.root, ".over-limit"))
    make_room(cache, MB)  # 7 + 2 + 1 fit by the ledger: no walk
    assert len(cache.walks) == 1


def test_a_walk_counts_and_touches_the_caches_own_files_only(cache):
    """Regression: a cache_dir that held other files too (~/.cache, a shared scratch folder) lost them. A
    walk counted every file under the cache's folder as a cached shard, evicted them oldest first, and
    removed the folders that left empty. It looks into the cache's own folders only now."""
    root = Path(cache.root)
    theirs = [root / "notes.txt", root / "pip" / "wheel.whl", root / "pip" / "wheels" / "old.whl",
              root / LOCATION / "not-a-version" / "shard-000000.tar.zst", root / "pip" / "x.lock"]
    for path in theirs:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"\1" * MB)
        os.utime(path, (1, 1))  # older than every cached shard: first to go, were they the cache's
    (root / "empty-of-theirs").mkdir()
    make_room(cache, 6 * MB)  # the cache's own 5 MB + 6 > 10: down to low water, 2 shards of the cache's go
    assert cached(cache) == [f"shard-{i:06d}.tar.zst" for i in range(2, 5)]
    assert all(path.read_bytes() == b"\1" * MB for path in theirs)
    assert (root / "empty-of-theirs").is_dir()
    assert not os.path.exists(root / ".over-limit")  # their 5 MB are not the cache's: it fits


def test_a_process_sharing_the_cache_with_another_limit_is_warned_once(cache, caplog, monkeypatch):
    """Found by a walk of a shared cache: a job at 10 MB beside one at 200 KB on one cache_dir
    downloaded its shards 3.2 times an epoch, without a word: each walk evicts down to its own
    limit, so the smallest holds for all. The ledger records its writer's limit, and a process
    that finds another's is warned, once."""
    monkeypatch.setattr(cacheroom, "_limits_said", set())
    small = Room(cache.root, 2 * MB)
    make_room(cache, MB)
    with caplog.at_level("WARNING", logger="shardstream"):
        make_room(cache, MB)  # the ledger is its own: nothing to say
        assert not caplog.records
        make_room(small, 0)
        make_room(cache, MB)  # the small limit walked last: its limit is in the ledger
        make_room(small, 0)
        make_room(cache, MB)
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 2, said  # once in each direction
    assert f"cache_limit={2 * MB} too (this process's: {10 * MB})" in said[1]
    assert "give every job that shares a cache_dir the same cache_limit" in said[0]
    assert len(cached(cache)) <= 2  # the smallest limit held: what the warning says
