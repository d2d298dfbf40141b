"""The head start (headstart.py): the next iteration's first pieces read, or with a cache its
first shard downloaded, while the current one ends.

Over a real HTTP server. The checks that the head start is used do not time anything:
once its reads have landed, the server is made to fail every request, and the next
epoch (one window's worth of pieces) must still arrive whole and in the planned order.
"""

from __future__ import annotations

import itertools
import os
import random
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from torch.utils.data import DataLoader

import shardstream
from shardstream.headstart import HeadStart
from shardstream.retry import RetryPolicy
from shardstream.stream import read_samples

try:
    from . import _remote_helpers as H
except ImportError:  # run as a script directory (pytest's rootdir-less import mode)
    import _remote_helpers as H

N_SAMPLES = 60
FAIL_FAST = RetryPolicy(attempts=1)


@pytest.fixture(scope="module")
def small_ds(tmp_path_factory) -> str:
    """60 samples in shards of one zstd frame each: a shard is one piece, an epoch one window."""
    dst = tmp_path_factory.mktemp("headstart") / "ds"
    rng = random.Random(0)
    with shardstream.ShardWriter(str(dst), shard_size="20KB", frame_size=1 << 20) as writer:
        for i in range(N_SAMPLES):
            writer.write({"__key__": f"s{i:03d}", "bin": rng.randbytes(rng.randrange(1000, 3000)), "cls": i % 3})
    return str(dst)


def shard_gets(server: H.CountingHTTPServer, names: list[str]) -> int:
    counts = server.get_counts()
    return sum(counts.get(name, 0) for name in names)


def wait_for(condition, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


def headstart_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("shardstream-headstart")]


def keys_through(loader) -> list[str]:
    return [item[0] for item in loader]


def key_dataset(url: str, **kwargs) -> shardstream.StreamingDataset:
    return shardstream.StreamingDataset(url, decode=None, fields=("__key__",), shuffle=True, seed=3, **kwargs)


def test_a_persistent_worker_reads_the_next_epoch_while_this_one_ends(small_ds):
    """Epoch 2 comes whole, in its planned order, from reads made at the end of epoch 1: the
    server fails every request from then on. (Epoch 0 reads nothing ahead: a worker reads
    ahead only once it has begun a second iteration.)"""
    names = [ref.name for ref in shardstream.open_dataset(small_ds).shards]
    assert len(names) >= 3
    reference_loader = DataLoader(key_dataset(small_ds), batch_size=None, num_workers=1)
    reference_loader.dataset.set_epoch(2)
    expected = keys_through(reference_loader)
    with H.CountingHTTPServer(small_ds, latency_s=0.01) as server:
        ds = key_dataset(server.url, retry=FAIL_FAST)
        loader = DataLoader(ds, batch_size=None, num_workers=1, persistent_workers=True)
        first = keys_through(loader)
        ds.set_epoch(1)
        second = keys_through(loader)
        wait_for(lambda: shard_gets(server, names) == 3 * len(names), "the head start's reads")
        server.faults.fail_fraction = 1.0
        ds.set_epoch(2)
        third = keys_through(loader)  # every request fails (epoch 3's head start's do)
        del loader
    assert sorted(first) == sorted(second) == sorted(third) == [f"s{i:03d}" for i in range(N_SAMPLES)]
    assert third == expected and third != second


def test_the_last_head_start_is_counted_when_the_workers_exit(small_ds):
    """Regression (found by a walk with large samples): a head start's reads were counted by the next iteration,
    so the last epoch's, for an iteration that never came, were never counted (23% of the bytes of a 3-epoch run of
    large samples over S3, sent and not in `io_stats()`). It counts them as its worker exits. With latency, the head
    start's reads land after the epoch's own last count."""
    names = [ref.name for ref in shardstream.open_dataset(small_ds).shards]
    with H.CountingHTTPServer(small_ds, latency_s=0.2) as server:
        ds = key_dataset(server.url)
        loader = DataLoader(ds, batch_size=None, num_workers=1, persistent_workers=True)
        for epoch in range(2):
            ds.set_epoch(epoch)
            assert len(keys_through(loader)) == N_SAMPLES
        wait_for(lambda: shard_gets(server, names) == 3 * len(names), "the head start's reads")
        del loader  # its worker exits: no next iteration
        sent = sum(server.get_counts().values())
    assert ds.io_stats()["requests"] == sent


def test_workers_that_are_not_persistent_read_nothing_ahead(small_ds):
    """A worker of a DataLoader without persistent workers serves one epoch and ends: it
    reads nothing for an epoch it will not see. Two epochs read each shard twice, no more."""
    names = [ref.name for ref in shardstream.open_dataset(small_ds).shards]
    with H.CountingHTTPServer(small_ds) as server:
        ds = key_dataset(server.url)
        for epoch in range(2):
            ds.set_epoch(epoch)
            assert len(keys_through(DataLoader(ds, batch_size=None, num_workers=1))) == N_SAMPLES
    assert shard_gets(server, names) == 2 * len(names)


def test_a_wrong_guess_costs_reads_not_samples(small_ds):
    """Rank 0 of 2: the head start reads the rank's share of epoch 2, but the next iteration
    is epoch 5, whose pieces keep other samples. Its samples are epoch 5's, exactly: the
    pieces the guess did not read are read anew."""
    reference = key_dataset(small_ds, rank=0, world_size=2)
    reference.set_epoch(5)
    expected = [item[0] for item in reference]
    with H.CountingHTTPServer(small_ds) as server:
        ds = key_dataset(server.url, rank=0, world_size=2)
        list(ds)
        ds.set_epoch(1)
        list(ds)  # the second iteration in this process: it reads ahead for epoch 2
        wait_for(lambda: not headstart_threads(), "the head start's reads")
        before = shard_gets(server, [ref.name for ref in ds.resolve().shards])
        ds.set_epoch(5)
        got = [item[0] for item in ds]
        assert shard_gets(server, [ref.name for ref in ds.resolve().shards]) > before
        wait_for(lambda: not headstart_threads(), "epoch 6's head start")  # before the server goes
    assert got == expected and len(got) == N_SAMPLES // 2


def test_a_failed_head_start_is_read_again(small_ds):
    """Reads of the head start that failed are made again by the iteration that wanted them,
    under its own retry policy: the samples come whole."""
    ids = np.arange(N_SAMPLES)
    with H.CountingHTTPServer(small_ds) as server:
        remote = shardstream.open_dataset(server.url, retry=FAIL_FAST)
        names = [ref.name for ref in remote.shards]
        for ref in remote.shards:  # the indexes, read while the server answers (the memo keeps them)
            ref.reader().index
        server.faults.fail_fraction = 1.0
        head = HeadStart()
        head.begin(remote, lambda: ids, remote.counts(), 6, False, 1 << 20)
        wait_for(lambda: server.faults.failures >= len(names), "the head start's failures")
        server.faults.fail_fraction = 0.0
        got = list(read_samples(remote, ids, remote.counts(), prefetch=6, head_start=head))
        assert shard_gets(server, names) == len(names)  # each shard read once more, by the iteration
    assert [s["__key__"] for s in got] == [f"s{i:03d}" for i in range(N_SAMPLES)]


def test_an_unreadable_index_leaves_the_error_to_the_iteration(small_ds):
    """A head start that cannot read the indexes plans whole shards, whose reads fail too:
    the next iteration, with the server answering again, plans and reads its own pieces."""
    ids = np.arange(N_SAMPLES)
    with H.CountingHTTPServer(small_ds) as server:
        remote = shardstream.StreamingDataset(server.url, retry=FAIL_FAST).resolve()  # indexes not read yet
        server.faults.fail_fraction = 1.0
        head = HeadStart()
        head.begin(remote, lambda: ids, remote.counts(), 6, False, 1 << 20)
        wait_for(lambda: not headstart_threads(), "the head start's reads")
        server.faults.fail_fraction = 0.0
        got = list(read_samples(remote, ids, remote.counts(), prefetch=6, head_start=head))
    assert [s["__key__"] for s in got] == [f"s{i:03d}" for i in range(N_SAMPLES)]


def test_a_bug_in_the_head_start_reaches_the_next_iteration(small_ds, monkeypatch):
    """Not lost in its thread: an unexpected error while planning is raised where the next
    iteration takes the head start."""
    from shardstream import headstart

    def broken(*args, **kwargs):
        raise RuntimeError("a bug in planning")

    monkeypatch.setattr(headstart, "first_window", broken)
    source = shardstream.open_dataset(small_ds)
    head = HeadStart()
    head.begin(source, lambda: np.arange(N_SAMPLES), source.counts(), 6, False, 1 << 20)
    with pytest.raises(RuntimeError, match="a bug in planning"):
        head.take()
    assert head.take() == ({}, {})  # raised once


def test_with_a_small_cache_the_next_epoch_s_first_shard_is_downloaded_ahead(small_ds, tmp_path):
    """A cache of about two shards, an unshuffled epoch of 13: the first shard was evicted
    long before an epoch ends. At the end of the second epoch in this process, the head
    start downloads it again, so the third epoch begins on a cached copy: that epoch fetches
    the first shard no more, and every shard after it once. The copy is held until then:
    the cache is over its limit meanwhile (the ending epoch's last shards), and a trim
    would evict it."""
    names = [ref.name for ref in shardstream.open_dataset(small_ds).shards]
    sizes = [os.path.getsize(os.path.join(small_ds, name)) + os.path.getsize(os.path.join(small_ds, name + ".idx"))
             for name in names]
    with H.CountingHTTPServer(small_ds) as server:
        ds = shardstream.StreamingDataset(server.url, decode=None, fields=("__key__",), prefetch=1,
                                          cache_dir=str(tmp_path / "cache"), cache_limit=2 * max(sizes))
        epochs = []
        for epoch in range(2):
            ds.set_epoch(epoch)
            epochs.append([key for (key,) in ds])
        wait_for(lambda: not headstart_threads(), "the head start's download")
        before = server.get_counts()
        assert before[names[0]] == 3  # epochs 0 and 1, and the head start
        ds.set_epoch(2)
        epochs.append([key for (key,) in ds])
        wait_for(lambda: not headstart_threads(), "the next head start's download")
        after = server.get_counts()
    assert epochs == [[f"s{i:03d}" for i in range(N_SAMPLES)]] * 3
    # Epoch 2 fetched the first shard no more; the head start of epoch 3, begun as epoch 2
    # ended (by then the cache held its last shards only), fetched it once.
    assert after[names[0]] == before[names[0]] + 1
    assert all(after[name] == before[name] + 1 for name in names[1:-1])


def test_an_endless_stream_reads_each_next_epoch_ahead_and_uses_it(small_ds):
    """`Sampling(resampled=True)`: one iteration runs epoch after epoch. From its second
    epoch on, each next epoch's pieces (here all of them: an epoch is one window) are read
    while the current one ends, and used: four epochs fetch each shard five times (epochs
    0 and 1, and the head starts of epochs 2, 3 and 4). The samples are
    those of the same stream read locally."""
    names = [ref.name for ref in shardstream.open_dataset(small_ds).shards]
    endless = shardstream.Sampling(resampled=True)
    expected = [key for (key,) in itertools.islice(key_dataset(small_ds, sampling=endless), 4 * N_SAMPLES)]
    with H.CountingHTTPServer(small_ds) as server:
        stream = iter(key_dataset(server.url, sampling=endless))
        got = [key for (key,) in itertools.islice(stream, 4 * N_SAMPLES)]
        wait_for(lambda: not headstart_threads(), "the head start's reads")
        gets = shard_gets(server, names)
        del stream
    assert got == expected
    assert sorted(got[N_SAMPLES : 2 * N_SAMPLES]) == [f"s{i:03d}" for i in range(N_SAMPLES)]
    assert gets == 5 * len(names)  # without the head start 4, with it unused 7


# -- stopping: reads nobody will take are cancelled (cancel.py) ----------------------------------------

PATIENT = RetryPolicy(attempts=10, base_delay=10.0, max_delay=10.0)  # about 45 s of backoff on average


def test_stopping_an_iteration_ends_its_reads_against_failing_storage(small_ds):
    """Regression: closing an iteration (a break, an error, Ctrl-C) waited for its reads still in flight, and
    against failing storage each sat through its retries' backoff: tens of seconds. They are cancelled at
    their next try now, so closing returns well before a single read's retries could have run out."""
    with H.CountingHTTPServer(small_ds, latency_s=0.05) as server:
        ds = key_dataset(server.url, prefetch=4, retry=PATIENT)
        it = iter(ds)
        next(it)
        server.faults.fail_fraction = 1.0  # the reads in flight fail, and would retry for ~45 s each
        wait_for(lambda: server.faults.failures > 0, "a read to fail")
        closing = threading.Thread(target=it.close)
        closing.start()
        closing.join(25.0)  # a hang check, with room: the retries would wait ~45 s
        assert not closing.is_alive(), "closing waited for reads nobody will take"
        failures = server.faults.failures
        time.sleep(0.5)
        assert server.faults.failures == failures  # and no read tries again afterwards


def test_a_head_start_is_stopped_at_exit_and_leaves_no_partial_download(small_ds, tmp_path):
    """Regression: after the last epoch, a head start's reads for an epoch that never comes kept the process
    from exiting through their retries when storage failed; with a cache, its download (a daemon thread) was
    killed at exit mid-file, leaving a reserved `.part` file in the cache. Both end at exit now."""
    import subprocess
    import sys
    import textwrap

    script = textwrap.dedent("""
        import sys, shardstream
        from shardstream.retry import RetryPolicy
        url, cache = sys.argv[1], sys.argv[2] or None
        ds = shardstream.StreamingDataset(url, decode=None, fields=("__key__",), shuffle=True, cache_dir=cache,
                                          cache_limit="30KB" if cache else None,
                                          retry=RetryPolicy(attempts=10, base_delay=10.0,
                                          max_delay=10.0))
        for epoch in range(2):  # the second iteration starts a head start on a third
            ds.set_epoch(epoch)
            for _ in ds:
                pass
        print("done", flush=True)
        sys.stdin.readline()  # the test makes storage fail, then lets the process exit
        """)
    for cache in ("", str(tmp_path / "cache")):
        with H.CountingHTTPServer(small_ds, latency_s=0.2) as server:
            proc = subprocess.Popen([sys.executable, "-c", script, server.url, cache], stdin=subprocess.PIPE,
                                    stdout=subprocess.PIPE, text=True)
            try:
                assert proc.stdout.readline().strip() == "done"
                server.faults.fail_fraction = 1.0
                proc.stdin.write("\n")
                proc.stdin.flush()
                assert proc.wait(timeout=30) == 0  # a hang check: the head start's retries would take ~45 s
            finally:
                proc.kill()
                proc.wait()
        if cache:
            assert not [p for p in (tmp_path / "cache").rglob("*.part")], "a partial download was left behind"


def test_a_cache_smaller_than_two_shards_is_left_within_its_limit_at_exit(small_ds, tmp_path):
    """Regression: with a cache limit below the shards in use (one shard's size then), the head start's download
    for an epoch that never came (held, or cut off at exit after its walk marked the cache over its limit) left
    a shard, or the cache's over-limit mark, after the process exited: its lock was dropped at exit without a
    trim. (A shard larger than the limit is not cached at all now: the limit holds one shard, not two.)"""
    import subprocess
    import sys

    from shardstream.cacheroom import OVER_LIMIT

    sizes = [os.path.getsize(p) + os.path.getsize(f"{p}.idx") for p in Path(small_ds).glob("*.tar.zst")]
    limit = max(sizes) * 3 // 2
    script = ("import sys, shardstream\n"
              "ds = shardstream.StreamingDataset(sys.argv[1], decode=None, fields=('__key__',), shuffle=True, "
              "cache_dir=sys.argv[2], cache_limit=int(sys.argv[3]))\n"
              "for epoch in range(2):\n"  # the second iteration starts a head start on a third
              "    ds.set_epoch(epoch)\n"
              "    assert len(list(ds)) == %d\n" % N_SAMPLES)
    cache = tmp_path / "cache"
    with H.CountingHTTPServer(small_ds, latency_s=0.05) as server:
        assert subprocess.run([sys.executable, "-c", script, server.url, str(cache), str(limit)],
                              timeout=120).returncode == 0
    assert limit < sum(sorted(sizes)[-2:])  # the largest two do not fit
    assert not (cache / OVER_LIMIT).exists()
    held = [p.stat().st_size for p in cache.rglob("*") if p.is_file() and p.name.endswith((".tar.zst", ".idx"))]
    assert sum(held) <= limit


def test_a_killed_downloads_reservation_is_freed_by_the_next_walk(tmp_path):
    """Regression: a download's reserved file left by a killed process (a preempted job) counted at its full
    size against the cache's limit for an hour. A download holds a lock on it, so the next walk of the cache
    knows it has no download behind it and removes it; a live download's stays counted."""
    import subprocess
    import sys

    from shardstream.cache import ShardCache, _reserve

    root = tmp_path / "cache"
    version = root / "0123456789abcdef" / "fedcba9876543210"  # a location's and a version's folder (cache.py)
    version.mkdir(parents=True)
    killed = ("import os, signal, sys; from shardstream.cache import _reserve; "
              "_reserve(sys.argv[1], 'shard-000000.tar.zst', 10_000_000); os.kill(os.getpid(), signal.SIGKILL)")
    assert subprocess.run([sys.executable, "-c", killed, str(version)]).returncode < 0
    live_part, live = _reserve(str(version), "shard-000001.tar.zst", 20_000_000)
    try:
        cache = ShardCache(str(root), 30_000_000)
        with cache.room.turn():
            cache.room.make(6_000_000)  # fits only if the killed process's 10 MB no longer counts
        assert sorted(p.name.split(".tar")[0] for p in version.glob("*.part")) == [".shard-000001"]
        assert not (root / ".over-limit").exists()
        with cache.room.turn():
            cache.room.make(10_000_001)  # the live download's 20 MB still counts
        assert (root / ".over-limit").exists()
    finally:
        live.close()
        os.remove(live_part)
