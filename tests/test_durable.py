"""`fsync`: every file of a pack is on the disk before the file that names it is published.

A power loss cannot be staged in a test, so these watch the order of the system calls
that make a write durable: each published file's bytes are synced before it is renamed
into place, its folder after, and the manifest only after every shard and index. The
real `os.fsync` runs; the spy only records which file or folder it was given.
"""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

import shardstream
from shardstream import ShardWriter, open_dataset, pack
from shardstream.format import MANIFEST_NAME
from shardstream.parts import merge


@pytest.fixture
def syscalls(monkeypatch) -> list[tuple[str, str]]:
    """("fsync", path) and ("publish", final path) events, in the order they happened."""
    events: list[tuple[str, str]] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd: int) -> None:
        real_fsync(fd)
        path = os.readlink(f"/proc/self/fd/{fd}")
        events.append(("fsync-folder" if stat.S_ISDIR(os.fstat(fd).st_mode) else "fsync", path))

    def replace(src, dst) -> None:
        events.append(("rename-from", os.path.realpath(src)))
        real_replace(src, dst)
        events.append(("publish", os.path.realpath(dst)))

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    return events


def check_durable_order(events: list[tuple[str, str]], dst: Path) -> None:
    """Every file published in `dst` had its bytes synced before its rename and its folder
    synced after; the manifest was published after every other file was durable."""
    dst = Path(os.path.realpath(dst))
    published = [i for i, (kind, path) in enumerate(events) if kind == "publish" and Path(path).parent == dst]
    assert published, "nothing was published"
    names = {Path(events[i][1]).name for i in published}
    assert MANIFEST_NAME in names and any(n.endswith(".idx") or ".tar" in n for n in names), names
    for i in published:
        scratch = events[i - 1][1]
        assert events[i - 1][0] == "rename-from"
        assert ("fsync", scratch) in events[:i - 1], f"{events[i][1]} renamed before its bytes were synced"
        assert ("fsync-folder", str(dst)) in events[i + 1:], f"{events[i][1]}'s rename was never synced"
    manifest_at = max(i for i in published if Path(events[i][1]).name == MANIFEST_NAME)
    for i in published:
        if i < manifest_at:
            synced = events.index(("fsync-folder", str(dst)), i)
            assert synced < manifest_at - 1, f"the manifest was renamed before {events[i][1]} was durable"
    # Every file the manifest names is there, whole, under its final name.
    ds = open_dataset(str(dst))
    for shard in ds.manifest.shards:
        assert (dst / shard.name).stat().st_size == shard.bytes
        assert (dst / shard.index).is_file()


def test_pack_with_fsync_syncs_every_file_before_the_manifest_names_it(image_folder, tmp_path, syscalls):
    dst = tmp_path / "ds"
    summary = pack(image_folder, dst, workers=1, shard_size="20KB", fsync=True, progress=False)
    assert summary.shards >= 3  # several shards, so the order among them is checked too
    check_durable_order(syscalls, dst)


def test_pack_without_fsync_waits_for_no_disk(image_folder, tmp_path, syscalls):
    """The default stays as fast as tar and WebDataset: nothing is synced."""
    pack(image_folder, tmp_path / "ds", workers=1, shard_size="20KB", progress=False)
    assert not [e for e in syscalls if e[0].startswith("fsync")]
    assert [e for e in syscalls if e[0] == "publish"]  # the spy saw the pack's renames


def test_overwrite_with_fsync_syncs_the_old_manifests_removal_first(image_folder, tmp_path, syscalls, monkeypatch):
    """The old manifest's removal is durable before its shards go: a power loss between
    cannot bring back a manifest listing removed shards."""
    dst = tmp_path / "ds"
    pack(image_folder, dst, workers=1, shard_size="20KB", progress=False)
    removed: list[str] = []
    real_remove = os.remove

    def remove(path) -> None:
        real_remove(path)
        removed.append(os.path.realpath(path))
        syscalls.append(("removed", os.path.realpath(path)))

    monkeypatch.setattr(os, "remove", remove)
    syscalls.clear()
    pack(image_folder, dst, workers=1, shard_size="20KB", seed=1, overwrite=True, fsync=True, progress=False)
    manifest = str(Path(os.path.realpath(dst)) / MANIFEST_NAME)
    at = syscalls.index(("removed", manifest))
    assert syscalls[at + 1] == ("fsync-folder", os.path.realpath(dst))
    check_durable_order(syscalls, dst)


def test_parts_and_merge_with_fsync(image_folder, tmp_path, syscalls):
    dst = tmp_path / "ds"
    for i in range(2):
        pack(image_folder, dst, workers=1, part=(i, 2), shard_size="20KB", fsync=True, progress=False)
    merge(str(dst), fsync=True)
    check_durable_order(syscalls, dst)
    assert open_dataset(str(dst)).manifest.samples == 21


def test_shard_writer_with_fsync(tmp_path, syscalls):
    dst = tmp_path / "ds"
    with ShardWriter(str(dst), shard_size="4KB", fsync=True) as writer:
        for i in range(12):
            writer.write({"__key__": f"s{i:03d}", "txt": "x" * 900, "cls": i % 3})
    check_durable_order(syscalls, dst)


def test_the_cli_takes_fsync(image_folder, tmp_path):
    """`pack --fsync` and `merge --fsync` are accepted and give the same dataset as without."""
    env = {**os.environ, "PYTHONPATH": os.path.dirname(os.path.dirname(shardstream.__file__))}
    cli = [sys.executable, "-m", "shardstream.cli"]
    for i in range(2):
        subprocess.run([*cli, "pack", str(image_folder), str(tmp_path / "a"), "--part", f"{i}/2", "--no-merge",
                        "--fsync", "--quiet"], check=True, env=env, capture_output=True)
    subprocess.run([*cli, "merge", str(tmp_path / "a"), "--fsync"], check=True, env=env, capture_output=True)
    pack(image_folder, tmp_path / "b", part=(0, 2), progress=False)
    pack(image_folder, tmp_path / "b", part=(1, 2), progress=False)
    merge(str(tmp_path / "b"))
    assert (tmp_path / "a" / MANIFEST_NAME).read_bytes() == (tmp_path / "b" / MANIFEST_NAME).read_bytes()
