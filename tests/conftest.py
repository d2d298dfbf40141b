"""Shared fixtures: a small synthetic image folder, a packed dataset of it, readers, hygiene.

The data is real (synthetic JPEGs written to disk, packed by the library) and small:
3 classes x 7 images of 64x48..96x80 pixels (~5 KB each), so a pack takes
milliseconds and the whole suite stays fast. Session-scoped fixtures are shared and
must not be modified by tests; tests that need to change files take a copy
(`image_folder_copy`, or `shutil.copytree` of `packed`).
"""

from __future__ import annotations

import os
import shutil
import sys
import threading
import time
from pathlib import Path

# Bytecode is cached for this run and the processes it starts, where the environment says not to
# (this project's machines set PYTHONDONTWRITEBYTECODE=1): each xdist worker then compiled and
# rewrote every test module again (18 s of collection against 7 from the cache), and each process
# a test starts (spawned workers, CLI runs, torchrun ranks: hundreds) compiled shardstream again
# (0.3 s of CPU each). Before shardstream is imported, and before xdist starts its workers.
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
sys.dont_write_bytecode = False

import pytest

import shardstream
from shardstream.synthetic import make_image_folder

NUM_CLASSES = 3
IMAGES_PER_CLASS = 7
SIZE_RANGE = ((64, 48), (96, 80))
SHARD_SIZE = "60KB"  # ~9 samples a shard: the fixture dataset has several shards
NON_IMAGE = "notes.txt"


def _make_folder(root: Path, *, num_classes: int = NUM_CLASSES, images_per_class: int = IMAGES_PER_CLASS,
                 seed: int = 0) -> Path:
    make_image_folder(root, num_classes=num_classes, images_per_class=images_per_class,
                      size_range=SIZE_RANGE, seed=seed)
    # A file that is not an image, inside a class folder: counted as ignored, never packed.
    (root / "class_001" / NON_IMAGE).write_text("not an image\n")
    return root


def source_files(root: str | Path) -> dict[str, bytes]:
    """Every file under `root`, by relative path with '/' separators."""
    root = Path(root)
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def read_all(url: str) -> list[dict]:
    """Every sample of a packed dataset, in manifest order, each read by its shard's reader."""
    source = shardstream.open_dataset(url)
    out = []
    for i in range(len(source.shards)):
        out.extend(source.shards[i].reader())
    return out


def read_shards(url: str) -> list[list[dict]]:
    """The samples of a packed dataset, shard by shard."""
    source = shardstream.open_dataset(url)
    return [list(source.shards[i].reader()) for i in range(len(source.shards))]


def dataset_files(url: str | Path) -> dict[str, bytes]:
    """The published files of a dataset folder (the scratch folder left out)."""
    root = Path(url)
    return {p.name: p.read_bytes() for p in sorted(root.iterdir()) if p.is_file()}


def write_webdataset(samples: list[dict], out: Path, per_shard: int) -> Path:
    """`samples` written by webdataset.ShardWriter into out/shard-NNNNNN.tar, `per_shard` a shard."""
    import webdataset as wds

    out.mkdir(parents=True, exist_ok=True)
    with wds.ShardWriter(str(out / "shard-%06d.tar"), maxcount=per_shard, verbose=0) as sink:
        for s in samples:
            sink.write(dict(s))
    return out


@pytest.fixture(scope="session")
def image_folder(tmp_path_factory) -> Path:
    """3 classes x 7 JPEGs plus `class_001/notes.txt`. Shared: do not modify (see image_folder_copy)."""
    return _make_folder(tmp_path_factory.mktemp("images") / "src")


@pytest.fixture
def image_folder_copy(image_folder, tmp_path) -> Path:
    """A private copy of `image_folder` that a test may change."""
    dst = tmp_path / "src"
    shutil.copytree(image_folder, dst)
    return dst


@pytest.fixture(scope="session")
def make_folder(tmp_path_factory):
    """Make another image folder: make_folder(num_classes=..., images_per_class=..., seed=...)."""

    def make(**kwargs) -> Path:
        return _make_folder(tmp_path_factory.mktemp("images") / "src", **kwargs)

    return make


@pytest.fixture(scope="session")
def packed(image_folder, tmp_path_factory) -> str:
    """`image_folder` packed (zstd, shard_size 60KB, one worker). Shared: do not modify."""
    dst = tmp_path_factory.mktemp("packed") / "ds"
    shardstream.pack(str(image_folder), str(dst), shard_size=SHARD_SIZE, workers=1, progress=False)
    return str(dst)


@pytest.fixture(scope="session")
def packed_plain(image_folder, tmp_path_factory) -> str:
    """`image_folder` packed uncompressed (`.tar` shards). Shared: do not modify."""
    dst = tmp_path_factory.mktemp("packed") / "ds"
    shardstream.pack(str(image_folder), str(dst), shard_size=SHARD_SIZE, workers=1, progress=False,
                     compression="none")
    return str(dst)


@pytest.fixture(name="read_all")
def read_all_fixture():
    """read_all(url) -> every sample of a packed dataset, in order."""
    return read_all


@pytest.fixture(name="read_shards")
def read_shards_fixture():
    """read_shards(url) -> the samples of a packed dataset, shard by shard."""
    return read_shards


@pytest.fixture(name="source_files")
def source_files_fixture():
    """source_files(root) -> {relative path: bytes} of every file under root."""
    return source_files


@pytest.fixture(name="write_webdataset")
def write_webdataset_fixture():
    """write_webdataset(samples, out, per_shard) -> out, holding WebDataset ShardWriter's tars."""
    return write_webdataset


@pytest.fixture(name="dataset_files")
def dataset_files_fixture():
    """dataset_files(url) -> {name: bytes} of the files directly in a dataset folder."""
    return dataset_files


@pytest.fixture(autouse=True)
def no_thread_leaks():
    """Fail a test that leaves a thread running (threads started before it are ignored, and so are
    asyncio's default executor's, "asyncio_N": aiohttp before 3.12 sends a request body through it,
    from fsspec's event loop, which keeps its idle threads for the loop's life)."""
    before = set(threading.enumerate())
    yield
    deadline = time.monotonic() + 2.0
    leaked = [t for t in threading.enumerate()
              if t not in before and t.is_alive() and not t.name.startswith("asyncio_")]
    for t in leaked:
        t.join(max(0.0, deadline - time.monotonic()))
    leaked = [t for t in leaked if t.is_alive()]
    if leaked:
        pytest.fail(f"test leaked threads: {[t.name for t in leaked]}", pytrace=False)
