"""The workloads that benchmarks/run.py times: one function per contender.

Each function does one whole run and returns the number of samples it handled, so the
caller can check that every contender did the same amount of work. Setup that is not
part of the measured work (removing a previous output folder) happens in `prepare_*`
functions, outside the timed region.
"""

from __future__ import annotations

import os
import shutil
from typing import Iterator

CHUNK = 4 << 20  # bytes per read() in the "raw bytes" ceilings
SHARD_SIZE = "256MB"  # shardstream's default; WebDataset gets the same in bytes
SHARD_BYTES = 256 * 10**6


# -- inputs -----------------------------------------------------------------------------


def image_files(root: str) -> Iterator[tuple[str, str, int]]:
    """(path, key, label) of every image of an ImageFolder tree, in sorted order.

    Mirrors what any packer has to do first: list the class folders and their files.
    """
    classes = sorted(e.name for e in os.scandir(root) if e.is_dir() and not e.name.startswith("."))
    for label, name in enumerate(classes):
        folder = os.path.join(root, name)
        for file in sorted(os.listdir(folder)):
            if file.lower().endswith((".jpg", ".jpeg")):
                yield os.path.join(folder, file), f"{name}/{file.rsplit('.', 1)[0]}", label


def reset(path: str) -> None:
    """Remove an output folder (outside the timed region) so each run writes afresh."""
    shutil.rmtree(path, ignore_errors=True)


# -- pack -------------------------------------------------------------------------------


def pack_shardstream(src: str, dst: str, compression: str, workers: int = 2) -> int:
    import shardstream

    summary = shardstream.pack(
        src, dst, compression=compression, workers=workers, shard_size=SHARD_SIZE, progress=False, overwrite=True
    )
    return summary.samples


def pack_webdataset(src: str, dst: str) -> int:
    """webdataset.ShardWriter in one process: file bytes + class label, plain tar."""
    import webdataset as wds

    os.makedirs(dst, exist_ok=True)
    n = 0
    with wds.ShardWriter(os.path.join(dst, "shard-%06d.tar"), maxsize=SHARD_BYTES, verbose=0) as sink:
        for path, key, label in image_files(src):
            with open(path, "rb") as f:
                data = f.read()
            sink.write({"__key__": key, "jpg": data, "cls": label})
            n += 1
    return n


def read_files_ceiling(src: str) -> int:
    """`cat`-like: read every image file's bytes once, one process. A ceiling for packing."""
    n = 0
    for path, _key, _label in image_files(src):
        with open(path, "rb") as f:
            f.read()
        n += 1
    return n


# -- raw read ---------------------------------------------------------------------------


def read_shardstream(dst: str) -> int:
    """Every sample of a packed dataset, via open_dataset and each shard's reader(); no decode."""
    import shardstream

    n = 0
    nbytes = 0
    for ref in shardstream.open_dataset(dst).shards:
        for sample in ref.reader():
            nbytes += len(sample["jpg"])  # type: ignore[arg-type]
            n += 1
    assert nbytes > 0
    return n


def read_webdataset(urls: list[str]) -> int:
    """webdataset.WebDataset over its own tar shards, no decoding: touch the jpg bytes."""
    import webdataset as wds

    n = 0
    nbytes = 0
    for sample in wds.WebDataset(urls, shardshuffle=False):
        nbytes += len(sample["jpg"])
        n += 1
    assert nbytes > 0
    return n


def read_bytes_ceiling(paths: list[str]) -> int:
    """Read the shard files' bytes in 4 MB chunks, nothing else. Returns bytes read."""
    total = 0
    buf = bytearray(CHUNK)
    for path in paths:
        with open(path, "rb", buffering=0) as f:
            while got := f.readinto(buf):
                total += got
    return total


def shard_files(folder: str, suffix: str) -> list[str]:
    return sorted(os.path.join(folder, n) for n in os.listdir(folder) if n.endswith(suffix))


def folder_bytes(folder: str) -> int:
    return sum(os.path.getsize(os.path.join(folder, n)) for n in os.listdir(folder) if os.path.isfile(os.path.join(folder, n)))
