"""Off Linux: macOS works in full, Windows for packing and streaming without a cache.

The platforms are emulated in new Python processes (tests/_platforms.py): what they lack is
taken away before shardstream is imported, in the DataLoader and pack workers they start
as well, which start by spawn as on those platforms.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from torch.utils.data import DataLoader

import shardstream
from shardstream.testing import HTTPTestServer

try:  # tests/ may or may not be a package
    from . import _data as D
    from ._platforms import run_as
except ImportError:
    import _data as D
    from _platforms import run_as


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    return D.make_source(tmp_path_factory.mktemp("images") / "src")


@pytest.fixture(scope="module")
def url(source, tmp_path_factory):
    return D.pack_to(source, tmp_path_factory.mktemp("served") / "ds", D.MANY_SHARDS)


def keys_here(url: str, workers: int) -> list[str]:
    """The keys `_platforms.keys_read` gives, read here (Linux, fork)."""
    dataset = shardstream.StreamingDataset(url, shuffle=True, seed=5, fields=("__key__", "jpg"))
    return [key for key, image in DataLoader(dataset, batch_size=None, num_workers=workers)]


def test_macos_spawned_workers_stream_through_the_cache_as_forked_ones_do(source, url, tmp_path):
    """DataLoader workers started by spawn (macOS's default), each given the dataset pickled,
    read every sample once, in the order forked workers give, through a cache they share."""
    expected = keys_here(url, 2)
    assert sorted(expected) == sorted(D.all_keys(source))
    with HTTPTestServer(str(Path(url).parent)) as server:
        remote = ["keys_read", f"{server.url}/ds", "2", str(tmp_path / "cache")]
        assert run_as("macos", tmp_path, *remote) == expected  # downloading
        # then from the cache, in another process; and the local dataset in the loop's own process, in that one
        assert run_as("macos", tmp_path, "each", json.dumps([remote, ["keys_read", url, "0"]])) == [
            expected, keys_here(url, 0)]


def test_macos_uploads_keep_the_scratch_files_of_running_processes(tmp_path):
    """Regression: without /proc every other process was taken for ended, so each upload to remote
    storage deleted the scratch folders of the others, running ones too: a pack's parts run side by side
    (`pack --part`, Ray on one machine) lost the shards they were writing."""
    running = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    ended = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    try:
        kept = run_as("macos", tmp_path, "uploads_kept", str(running.pid), ended.stdout.strip())
    finally:
        running.communicate(b"")
    assert kept == {"running": True, "ended": False}


def test_windows_packs_with_worker_processes(source, tmp_path):
    """Regression: every file written went through os.fchmod, which Windows (before Python 3.13) lacks."""
    packed = run_as("windows", tmp_path, "packed_keys", str(source), str(tmp_path / "ds"))
    assert sorted(packed) == sorted(D.all_keys(source))


def test_windows_streams_a_local_dataset_without_and_with_spawned_workers(url, tmp_path):
    """Regression: the dataset's modules imported fcntl (for the cache) at import, and local reads
    used os.preadv: neither is on Windows, so no StreamingDataset could be made there."""
    reads = [["keys_read", url, "0"], ["keys_read", url, "2"]]  # one process: its own read, then its workers'
    assert run_as("windows", tmp_path, "each", json.dumps(reads)) == [keys_here(url, 0), keys_here(url, 2)]


def test_windows_cache_dir_is_refused_in_words(url, tmp_path):
    """The cache rests on POSIX file locks: asking for one on Windows says so when the dataset is made."""
    refusal = run_as("windows", tmp_path, "cache_refusal", url, str(tmp_path / "cache"))
    assert refusal.startswith("ShardstreamError: ") and "cache_dir" in refusal and "Windows" in refusal
