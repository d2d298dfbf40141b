"""The shard format: round trips, random access, manifest and index, ShardWriter, zstd layout."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import io
import json
import os
import shutil
import struct
import tarfile
from pathlib import Path
from typing import Iterator

import msgpack
import numpy as np
import pytest
import torch
import zstandard
from PIL import Image

import shardstream
from shardstream import ShardWriter, StreamingDataset, open_dataset, open_shard
from shardstream import reader as reader_module
from shardstream.decode import Decoder
from shardstream.errors import CorruptIndexError, ManifestError, ShardstreamError
from shardstream.format import MANIFEST_NAME, Manifest, ShardIndex, ShardInfo

try:  # tests/ may or may not be a package
    from . import _data as D
except ImportError:
    import _data as D

SKIPPABLE_MAGIC = 0x184D2A5E
SEEKABLE_MAGIC = 0x8F92EAB1
EOA = 1024  # the end-of-archive blocks every shard's tar stream ends with


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def class_dirs(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if p.is_dir())


def images(root: Path) -> dict[str, bytes]:
    """Source images by expected sample key (relative path without extension)."""
    return {p.relative_to(root).with_suffix("").as_posix(): p.read_bytes() for p in sorted(root.rglob("*.jpg"))}


def write_samples(dst, samples, **kwargs) -> Manifest:
    with ShardWriter(str(dst), **kwargs) as writer:
        for sample in samples:
            writer.write(sample)
    return open_dataset(str(dst)).manifest


def blob_samples(n: int, seed: int = 0, lo: int = 50, hi: int = 3000) -> list[dict]:
    """`n` samples with one binary field of random size and random content, plus a label."""
    rng = np.random.default_rng(seed)
    return [
        {"__key__": f"s{i:04d}", "bin": rng.bytes(int(rng.integers(lo, hi))), "cls": i % 3}
        for i in range(n)
    ]


def parse_seek_table(data: bytes) -> tuple[list[tuple[int, int]], int]:
    """((compressed, decompressed) per frame, size of the table) of a zstd seekable file."""
    frames, descriptor, magic = struct.unpack("<IBI", data[-9:])
    assert magic == SEEKABLE_MAGIC
    assert descriptor & 0x7C == 0, "reserved descriptor bits must be zero"
    entry = 12 if descriptor & 0x80 else 8
    table = 8 + frames * entry + 9
    skip_magic, skip_size = struct.unpack("<II", data[-table : -table + 8])
    assert skip_magic == SKIPPABLE_MAGIC
    assert skip_size == table - 8
    body = data[-table + 8 : -9]
    sizes = [struct.unpack("<II", body[i : i + 8]) for i in range(0, len(body), entry)]
    return sizes, table


# -- round trip of a packed image folder -------------------------------------------------------


def test_round_trip_every_sample(packed, image_folder, read_all, cut):
    samples = read_all(packed)
    expected = images(image_folder)
    classes = class_dirs(image_folder)
    by_key = {s["__key__"]: s for s in samples}

    assert len(samples) == len(by_key) == len(expected) == 21
    assert set(by_key) == set(expected)
    for key, data in expected.items():
        sample = by_key[key]
        assert set(sample) == {"__key__", "__url__", "jpg", "cls"}
        assert sample["jpg"] == data
        assert int(sample["cls"]) == classes.index(key.split("/")[0])
        assert sample["__url__"].endswith(".tar.zst")


def test_manifest_counts_and_accounting(packed, image_folder, read_shards):
    manifest = open_dataset(packed).manifest
    classes = class_dirs(image_folder)
    shards = read_shards(packed)

    assert manifest.compression == "zstd"
    assert manifest.classes == tuple(classes)
    assert manifest.class_counts == (7, 7, 7)
    counted = [0] * len(classes)
    for s in (s for shard in shards for s in shard):
        counted[int(s["cls"])] += 1
    assert tuple(counted) == manifest.class_counts
    assert len(manifest.shards) >= 2, "the fixture is meant to span several shards"
    assert [len(shard) for shard in shards] == [s.samples for s in manifest.shards]
    assert manifest.samples == sum(manifest.counts) == 21

    files_in = [p for p in image_folder.rglob("*") if p.is_file()]
    assert len(files_in) == manifest.samples + len(manifest.skipped) + manifest.ignored
    assert manifest.skipped == () and manifest.ignored == 1


def test_manifest_describes_the_files(packed):
    manifest = open_dataset(packed).manifest
    root = Path(packed)
    names = [s.name for s in manifest.shards]
    assert names == [f"shard-{i:06d}.tar.zst" for i in range(len(names))]
    # Nothing but the dataset is left: no scratch folder, no stray parts.
    assert sorted(os.listdir(root)) == sorted([MANIFEST_NAME, *names, *(s.index for s in manifest.shards)])
    for info in manifest.shards:
        data = (root / info.name).read_bytes()
        index = (root / info.index).read_bytes()
        assert info.index == info.name + ".idx"
        assert info.bytes == len(data) and info.sha256 == sha256(data)
        assert info.index_bytes == len(index) and info.index_sha256 == sha256(index)
        raw = zstandard.ZstdDecompressor().stream_reader(io.BytesIO(data), read_across_frames=True).read()
        assert info.raw_bytes == len(raw)
        assert raw.endswith(bytes(EOA))
        assert info.fields == ("cls", "jpg")
        # Shards are cut at shard_size (uncompressed tar bytes, before end-of-archive).
        assert info.raw_bytes - EOA <= 60_000


# -- random access -----------------------------------------------------------------------------------


def check_random_access(reader, n: int) -> None:
    seq = list(reader)
    assert len(seq) == n == len(reader)
    for i in range(n):
        assert reader[i] == seq[i]
        assert reader[i - n] == seq[i]
    ranges = {(0, 0), (0, n), (0, 1), (n - 1, n), (1, n - 1), (n // 2, n), (n // 3, 2 * n // 3), (n, n)}
    for a, b in sorted(ranges):
        assert list(reader.read(a, b)) == seq[a:b], (a, b)
    for a, b in [(-1, 2), (2, 1), (0, n + 1)]:
        with pytest.raises(IndexError):
            list(reader.read(a, b))
    for i in (n, -n - 1):
        with pytest.raises(IndexError):
            reader[i]


def test_random_access_packed(packed, cut):
    source = open_dataset(packed)
    for ref in source.shards:
        check_random_access(ref.reader(), ref.info.samples)
        # A fresh reader (index not yet loaded) answers the same for one sample.
        assert ref.reader()[ref.info.samples - 1] == list(ref.reader())[-1]


@contextlib.contextmanager
def python_cut() -> Iterator[None]:
    """Read without the `_tarcut` extension: the Python parser and python-zstandard."""
    saved, reader_module._tarcut = reader_module._tarcut, None
    try:
        yield
    finally:
        reader_module._tarcut = saved


@pytest.fixture(params=["c", "python"])
def cut(request, monkeypatch) -> str:
    """Each reading test run both ways: samples cut in C (`_tarcut`, where built) and in
    Python (what an install without the extension runs)."""
    if request.param == "c" and not reader_module.TARCUT:
        pytest.skip("the _tarcut extension is not built")
    if request.param == "python":
        monkeypatch.setattr(reader_module, "_tarcut", None)
    return request.param


@pytest.mark.parametrize("compression", ["zstd", "none"])
def test_random_access_every_range_across_frames(tmp_path, compression, cut):
    samples = blob_samples(13)
    write_samples(tmp_path / "ds", samples, compression=compression, frame_size=4000)
    ref = open_dataset(str(tmp_path / "ds")).shards[0]
    reader = ref.reader()
    if compression == "zstd":
        assert len(reader.index.frame_offsets) > 4, "the test needs several frames in the shard"
    n = len(samples)
    seq = list(reader)
    assert [s["__key__"] for s in seq] == [s["__key__"] for s in samples]
    assert [s["bin"] for s in seq] == [s["bin"] for s in samples]
    for a in range(n + 1):
        for b in range(a, n + 1):
            assert list(reader.read(a, b)) == seq[a:b], (a, b)
    check_random_access(ref.reader(), n)


# -- manifest and index (de)serialisation ------------------------------------------------------------


def test_manifest_round_trip(packed):
    data = (Path(packed) / MANIFEST_NAME).read_bytes()
    manifest = Manifest.from_bytes(data, "m")
    assert Manifest.from_bytes(manifest.to_bytes(), "m") == manifest
    assert manifest.to_bytes() == data


def test_manifest_round_trip_constructed():
    info = ShardInfo("a-000000.tar.zst", 3, 100, 4096, "0" * 64, "a-000000.tar.zst.idx", 40, "1" * 64, ("cls", "jpg"))
    manifest = Manifest(
        shards=(info, info.__class__(**{**info.__dict__, "name": "a-000001.tar.zst", "samples": 2})),
        compression="zstd",
        classes=("cat", "dog"),
        class_counts=(4, 1),
        skipped=(("cat/bad.jpg", "not a readable image"), ("dog/x.jpg", "unreadable")),
        ignored=7,
        options={"shard_size": 10, "nested": {"a": [1, 2]}},
    )
    back = Manifest.from_bytes(manifest.to_bytes(), "m")
    assert back == manifest
    assert back.samples == 5 and list(back.counts) == [3, 2]


def test_index_round_trip(packed):
    for info in open_dataset(packed).manifest.shards:
        data = (Path(packed) / info.index).read_bytes()
        index = ShardIndex.from_bytes(data, "i")
        assert len(index) == info.samples
        back = ShardIndex.from_bytes(index.to_bytes(), "i")
        assert back.keys == index.keys and back.compression == index.compression == "zstd"
        for name in ("sample_offsets", "frame_offsets", "frame_raw_offsets"):
            assert np.array_equal(getattr(back, name), getattr(index, name))
        assert index.to_bytes() == data
        assert index.sample_offsets[0] == 0 and index.sample_offsets[-1] == info.raw_bytes - EOA


@pytest.fixture(scope="module")
def manifest_raw(packed) -> dict:
    return msgpack.unpackb((Path(packed) / MANIFEST_NAME).read_bytes(), raw=False)


@pytest.fixture(scope="module")
def index_raw(packed) -> dict:
    info = open_dataset(packed).manifest.shards[0]
    return msgpack.unpackb((Path(packed) / info.index).read_bytes(), raw=False)


def _pack(raw) -> bytes:
    return msgpack.packb(raw, use_bin_type=True)


def _edit(raw: dict, path: tuple, value) -> dict:
    raw = msgpack.unpackb(_pack(raw), raw=False)  # a deep copy
    target = raw
    for part in path[:-1]:
        target = target[part]
    if value is _DELETE:
        del target[path[-1]]
    else:
        target[path[-1]] = value
    return raw


_DELETE = object()

BAD_MANIFESTS = {
    "version is a string": (("version",), "1"),
    "version is a bool": (("version",), True),
    "newer version": (("version",), 2),
    "not a shardstream manifest": (("format",), "webdataset"),
    "format missing": (("format",), _DELETE),
    "unknown compression": (("compression",), "lz4"),
    "shards not a list": (("shards",), {"a": 1}),
    "shard entry not a map": (("shards", 0), "shard-000000.tar.zst"),
    "shard samples is a string": (("shards", 0, "samples"), "9"),
    "shard samples negative": (("shards", 0, "samples"), -1),
    "shard bytes is a float": (("shards", 0, "bytes"), 1.5),
    "shard sha256 missing": (("shards", 0, "sha256"), _DELETE),
    "shard name with slash": (("shards", 0, "name"), "sub/shard-000000.tar.zst"),
    "shard name absolute": (("shards", 0, "name"), "/etc/passwd"),
    "shard name parent": (("shards", 0, "name"), ".."),
    "shard name climbs": (("shards", 0, "name"), "../shard-000000.tar.zst"),
    "shard name backslash": (("shards", 0, "name"), "..\\shard-000000.tar.zst"),
    "shard name empty": (("shards", 0, "name"), ""),
    "index name climbs": (("shards", 0, "index"), "../x.idx"),
    "samples total disagrees": (("samples",), 22),
    "classes not a list": (("classes",), "class_000"),
    "class_counts wrong length": (("class_counts",), [7, 7]),
    "skipped not a list": (("skipped",), {}),
    "ignored is a string": (("ignored",), "1"),
    "ignored is negative": (("ignored",), -5),  # regression: accepted, and `verify` passed it
    "a class count is negative": (("class_counts", 0), -1),
    "options not a map": (("options",), [1]),
    "writer missing": (("writer",), _DELETE),
}


@pytest.mark.parametrize("case", sorted(BAD_MANIFESTS))
def test_manifest_rejects_damage(manifest_raw, case):
    path, value = BAD_MANIFESTS[case]
    with pytest.raises(ManifestError):
        Manifest.from_bytes(_pack(_edit(manifest_raw, path, value)), "m")


@pytest.mark.parametrize(
    "path,value",
    [
        pytest.param(("skipped",), ["class_000/a.jpg"], id="skipped entry not a map"),
        pytest.param(("skipped",), [{"file": "class_000/a.jpg"}], id="skipped entry without reason"),
    ],
)
def test_manifest_rejects_bad_skipped_entries(manifest_raw, path, value):
    with pytest.raises(ManifestError):
        Manifest.from_bytes(_pack(_edit(manifest_raw, path, value)), "m")


def test_manifest_rejects_class_counts_of_wrong_type(manifest_raw):
    with pytest.raises(ManifestError):
        Manifest.from_bytes(_pack(_edit(manifest_raw, ("class_counts",), ["7", "7", "7"])), "m")


def test_manifest_rejects_garbage(packed):
    data = (Path(packed) / MANIFEST_NAME).read_bytes()
    for cut in (0, 1, 10, len(data) // 2, len(data) - 1):
        with pytest.raises(ManifestError):
            Manifest.from_bytes(data[:cut], "m")
    for bad in (data + b"\x00", b"\xc1", _pack([1, 2, 3]), _pack("shardstream"), b"PK\x03\x04" + data):
        with pytest.raises(ManifestError):
            Manifest.from_bytes(bad, "m")


def test_manifest_error_names_the_file(tmp_path, packed):
    copy = tmp_path / "ds"
    copy.mkdir()
    data = (Path(packed) / MANIFEST_NAME).read_bytes()
    (copy / MANIFEST_NAME).write_bytes(data[: len(data) // 2])
    with pytest.raises(ManifestError, match=MANIFEST_NAME):
        open_dataset(str(copy))
    with pytest.raises(ManifestError):
        open_dataset(str(tmp_path / "nothing-here"))


BAD_INDEXES = {
    "newer version": (("version",), 2),
    "not an index": (("format",), "shardstream"),
    "keys missing": (("keys",), _DELETE),
    "keys not a list": (("keys",), "abc"),
    "keys not strings": (("keys", 0), 5),
    "offsets not bytes": (("sample_offsets",), [0, 1, 2]),
    "offsets not a multiple of 8": (("sample_offsets",), b"\x00" * 7),
    "one offset too few": (("sample_offsets",), b"\x00" * 8),
    "offsets decreasing": (("sample_offsets",), None),  # filled in below
    "frame tables missing": (("frame_offsets",), b""),
    "compression missing": (("compression",), _DELETE),
}


@pytest.mark.parametrize("case", sorted(BAD_INDEXES))
def test_index_rejects_damage(index_raw, case):
    path, value = BAD_INDEXES[case]
    if case == "offsets decreasing":
        offsets = np.frombuffer(index_raw["sample_offsets"], "<u8")[::-1]
        value = offsets.tobytes()
    with pytest.raises(CorruptIndexError):
        ShardIndex.from_bytes(_pack(_edit(index_raw, path, value)), "i")


def test_a_zstd_shard_of_no_samples_is_read_as_a_plain_one_is(tmp_path):
    """Regression (found by writing a second implementation from FORMAT.md): a .tar.zst shard of no samples,
    its frame tables one offset each (no data frame), was refused as "frame tables are missing", where the
    same shard uncompressed was read."""
    from shardstream.shardfile import seek_table
    from shardstream.tario import END_OF_ARCHIVE

    end = zstandard.ZstdCompressor(write_checksum=True).compress(END_OF_ARCHIVE)
    (tmp_path / "empty.tar.zst").write_bytes(end + seek_table([(len(end), len(END_OF_ARCHIVE))]))
    zero = np.zeros(1, np.int64)
    (tmp_path / "empty.tar.zst.idx").write_bytes(ShardIndex((), zero, zero, zero, "zstd").to_bytes())
    reader = open_shard(str(tmp_path / "empty.tar.zst"))
    assert len(reader) == 0 and list(reader) == []
    with pytest.raises(CorruptIndexError, match="frame tables are missing"):  # a shard of samples needs a frame
        ShardIndex(("a",), np.array([0, 1024]), zero, zero, "zstd").check("i")


def test_index_rejects_unknown_compression(index_raw):
    with pytest.raises(CorruptIndexError):
        ShardIndex.from_bytes(_pack(_edit(index_raw, ("compression",), "lz4")), "i")


def test_index_rejects_garbage(packed):
    info = open_dataset(packed).manifest.shards[0]
    data = (Path(packed) / info.index).read_bytes()
    for cut in (0, 1, 10, len(data) // 2, len(data) - 1):
        with pytest.raises(CorruptIndexError):
            ShardIndex.from_bytes(data[:cut], "i")
    with pytest.raises(CorruptIndexError):
        ShardIndex.from_bytes(_pack({"format": "shardstream-index"}), "i")


def test_a_huge_index_file_is_refused_by_its_size_before_it_is_read(tmp_path, packed, monkeypatch):
    """Regression (found by a review of hostile datasets): a local index was read whole before the limit was
    checked, so a sparse file of 3 GiB (a few bytes in an archive) held 3 GiB for 21 s, or failed as a bare
    MemoryError. Its size is checked first: against the manifest's, and without one against the limit."""
    from shardstream.format import MAX_INDEX_BYTES
    from shardstream.storage import Store

    copy = tmp_path / "ds"
    shutil.copytree(packed, copy)
    info = open_dataset(str(copy)).manifest.shards[0]
    with open(copy / info.index, "r+b") as f:
        f.truncate(MAX_INDEX_BYTES + 1)  # sparse: no disk taken
    read = Store.read
    monkeypatch.setattr(Store, "read", lambda self, name, *a, **k: pytest.fail(f"{name} read") if name == info.index
                        else read(self, name, *a, **k))
    with pytest.raises(CorruptIndexError, match=f"index is {MAX_INDEX_BYTES + 1} bytes, where the manifest says"):
        list(open_dataset(str(copy)).shards[0].reader())
    with pytest.raises(CorruptIndexError, match=f"past the {MAX_INDEX_BYTES} a reader reads"):
        list(open_shard(str(copy / info.name)))  # no manifest entry: the limit


@pytest.mark.parametrize("label", [2 ** 31 - 1, (1 << 24), -2])
def test_an_index_label_no_writer_stores_is_refused(packed, label):
    """Regression (found by a review of hostile datasets): one label of 2**31 - 1 passed every check, and
    class-weighted sampling then counted 2**31 classes (16 GiB). Labels are 0..2**24 - 1, or -1 for none."""
    info = open_dataset(packed).manifest.shards[0]
    raw = msgpack.unpackb((Path(packed) / info.index).read_bytes(), raw=False)
    labels = np.frombuffer(raw["labels"], "<i4").copy()
    ShardIndex.from_bytes(_pack(raw), "i")  # as written: read
    labels[len(labels) // 2] = label
    raw["labels"] = labels.tobytes()
    with pytest.raises(CorruptIndexError, match=f"labels are class indexes 0..{(1 << 24) - 1}, or -1 for none; "
                                                f"not {label}"):
        ShardIndex.from_bytes(_pack(raw), "i")


def test_tampered_index_is_caught_by_its_checksum(tmp_path, packed):
    copy = tmp_path / "ds"
    shutil.copytree(packed, copy)
    info = open_dataset(str(copy)).manifest.shards[0]
    index = ShardIndex.from_bytes((copy / info.index).read_bytes(), "i")
    # A well-formed index that disagrees with the manifest: swap two keys.
    keys = list(index.keys)
    keys[0], keys[1] = keys[1], keys[0]
    (copy / info.index).write_bytes(ShardIndex(tuple(keys), index.sample_offsets, index.frame_offsets,
                                               index.frame_raw_offsets, index.compression).to_bytes())
    with pytest.raises(CorruptIndexError, match="checksum|bytes, where the manifest says"):  # its size, first
        list(open_dataset(str(copy)).shards[0].reader())
    # Without the manifest the index is trusted, and the shard contradicts it.
    with pytest.raises(CorruptIndexError):
        list(open_shard(str(copy / info.name)))


@pytest.mark.parametrize("compression", ["none", "zstd"])
def test_index_of_another_shard_names_the_sample(tmp_path, compression):
    """An index copied from another shard (its checksum updated too, as a re-run of `index` on the wrong file
    would): the error names the sample the index says is there, so that a skip logs and pads it by key, not "#0"."""
    url = str(tmp_path / "ds")
    with ShardWriter(url, shard_size="1KB", compression=compression) as writer:
        for i in range(4):
            writer.write({"__key__": f"s{i}", "bin": bytes([i]) * 300})
    first, second = open_dataset(url).manifest.shards[:2]
    copied = ShardIndex.from_bytes(Path(url, second.index).read_bytes(), second.index)
    if Path(url, first.name).stat().st_size != copied.shard_bytes:  # told by the size it records
        Path(url, first.index).write_bytes(copied.to_bytes())
        with pytest.raises(CorruptIndexError, match=f"made for a shard of {copied.shard_bytes} bytes"):
            list(open_shard(os.path.join(url, first.name)))
    # An index that records no size (written before it was recorded), or of a shard of the same size:
    Path(url, first.index).write_bytes(dataclasses.replace(copied, shard_bytes=None).to_bytes())
    with pytest.raises(CorruptIndexError, match="the shard holds 's0'") as info:
        list(open_shard(os.path.join(url, first.name)))
    assert info.value.url.endswith(first.name) and info.value.key == "s1"


DAMAGE = {
    "byte flipped mid-file": lambda d: d[: len(d) // 2] + bytes([d[len(d) // 2] ^ 0xFF]) + d[len(d) // 2 + 1 :],
    "bit flipped in the first header": lambda d: d[:3] + bytes([d[3] ^ 0x01]) + d[4:],
    "truncated": lambda d: d[: len(d) // 2],
    "first 2 KB zeroed": lambda d: bytes(2048) + d[2048:],
}


@pytest.mark.parametrize(
    "dataset,damage",
    # Image bytes of an uncompressed shard carry no checksum the reader checks (verify does: see test_cli).
    [(d, k) for d in ("packed", "packed_plain") for k in sorted(DAMAGE)
     if (d, k) != ("packed_plain", "byte flipped mid-file")],
)
def test_damaged_shard_raises_corrupt_shard(request, tmp_path, dataset, damage, cut):
    copy = tmp_path / "ds"
    shutil.copytree(request.getfixturevalue(dataset), copy)
    name = open_dataset(str(copy)).manifest.shards[0].name
    path = copy / name
    path.write_bytes(DAMAGE[damage](path.read_bytes()))
    with pytest.raises((shardstream.CorruptShardError, CorruptIndexError), match=name):
        list(open_dataset(str(copy)).shards[0].reader())


@pytest.mark.parametrize("where", ["payload", "checksum"])
def test_damaged_frame_yields_none_of_its_samples(tmp_path, where):
    """The frame's checksum is checked before any of its samples is handed out, when it is
    read whole and when one sample of it is read alone, in C (`_tarcut`) and in Python."""
    samples = blob_samples(24, lo=500, hi=3000)
    write_samples(tmp_path / "ds", samples, frame_size=8000)
    ref = open_dataset(str(tmp_path / "ds")).shards[0]
    index = ref.reader().index
    frames = index.frame_offsets.tolist()
    assert len(frames) > 4, "the test needs several frames in the shard"
    path = tmp_path / "ds" / ref.name
    data = bytearray(path.read_bytes())
    pos = (frames[2] + frames[3]) // 2 if where == "payload" else frames[3] - 1  # frame 2's data, or its checksum
    data[pos] ^= 0x10
    path.write_bytes(bytes(data))
    in_frame = [i for i in range(len(samples)) if index.frame_of(i) == 2]
    before = in_frame[0]
    got: list[dict] = []
    with pytest.raises(shardstream.CorruptShardError, match="frame 2"):
        for sample in ref.reader():
            got.append(sample)
    assert [s["bin"] for s in got] == [s["bin"] for s in samples[:before]]
    for i in in_frame:
        with pytest.raises(shardstream.CorruptShardError, match="frame 2"):
            ref.reader()[i]
    if reader_module.TARCUT:
        with python_cut(), pytest.raises(shardstream.CorruptShardError, match="frame 2"):
            list(ref.reader())


@pytest.mark.skipif(not reader_module.TARCUT, reason="the _tarcut extension is not built")
@pytest.mark.parametrize("compression", ["zstd", "none"])
def test_tarcut_cuts_the_common_layout_and_refuses_the_rest(tmp_path, compression):
    """The C hot path really cuts what ShardWriter writes (a fallback every time would only be slow),
    and hands a damaged header back to the Python parser instead of guessing."""
    from shardstream import _tarcut

    samples = blob_samples(40, lo=50, hi=5000)
    write_samples(tmp_path / "ds", samples, compression=compression, frame_size=8000)
    ref = open_dataset(str(tmp_path / "ds")).shards[0]
    index, url = ref.reader().index, ref.reader().url
    data = (tmp_path / "ds" / ref.name).read_bytes()
    offsets, keys = index.sample_offsets.tolist(), list(index.keys)
    expected = [{"__key__": s["__key__"], "__url__": url, "bin": s["bin"], "cls": str(s["cls"]).encode()}
                for s in samples]
    if compression == "zstd":
        context, got = _tarcut.new_context(), []
        comp, raw = index.frame_offsets.tolist(), index.frame_raw_offsets.tolist()
        for f in range(len(comp) - 1):
            inside = [i for i in range(len(keys)) if raw[f] <= offsets[i] < raw[f + 1]]
            lo, hi = inside[0], inside[-1] + 1
            got += _tarcut.frame_samples(context, data[comp[f] : comp[f + 1]], raw[f + 1] - raw[f], raw[f],
                                         offsets[lo : hi + 1], keys[lo:hi], url)
        assert got == expected
        with pytest.raises(_tarcut.FrameError, match="checksum"):
            frame = bytearray(data[comp[0] : comp[1]])
            frame[len(frame) // 2] ^= 1
            _tarcut.frame_samples(context, bytes(frame), raw[1] - raw[0], 0, offsets[:2], keys[:1], url)
        return
    assert _tarcut.cut_samples(data, 0, offsets, keys, url) == expected
    damaged = bytearray(data)
    damaged[offsets[3] + 1] ^= 1  # a name byte: the header checksum no longer matches
    assert _tarcut.cut_samples(bytes(damaged), 0, offsets, keys, url) is None
    (tmp_path / "ds" / ref.name).write_bytes(bytes(damaged))
    with pytest.raises(shardstream.CorruptShardError, match="checksum"):  # the Python parser names it
        list(ref.reader())
    assert _tarcut.cut_samples(data, 0, [offsets[0], offsets[2]], keys[:1], url) is None  # sample 0 over two samples


# -- ShardWriter -------------------------------------------------------------------------------------------


def test_writer_every_field_type(tmp_path, image_folder):
    jpg = sorted(image_folder.rglob("*.jpg"))[0].read_bytes()
    array = np.arange(24, dtype=np.float32).reshape(2, 3, 4) / 7
    samples = [
        {
            "__key__": f"item{i}",
            "jpg": jpg,
            "cls": i,
            "txt": f"caption {i}: héllo ✓",
            "json": {"i": i, "tags": ["a", "b"], "nested": {"x": 1.5, "none": None}},
            "msgpack": {"i": i, "blob": b"\x00\xff", "list": [1, 2, 3]},
            "npy": array * i,
            "raw.bin": bytes(range(i + 1)),
        }
        for i in range(3)
    ]
    manifest = write_samples(tmp_path / "ds", samples, classes=("a", "b", "c"))
    assert manifest.classes == ("a", "b", "c") and manifest.class_counts == (1, 1, 1)
    assert manifest.shards[0].fields == ("cls", "jpg", "json", "msgpack", "npy", "raw.bin", "txt")

    decode = Decoder(images=None)
    reader = open_dataset(str(tmp_path / "ds")).shards[0].reader()
    got = [decode(s) for s in reader]
    assert len(got) == 3
    for i, sample in enumerate(got):
        assert sample["__key__"] == f"item{i}"
        assert sample["jpg"] == jpg
        assert sample["cls"] == i and isinstance(sample["cls"], int)
        assert sample["txt"] == f"caption {i}: héllo ✓"
        assert sample["json"] == samples[i]["json"]
        assert sample["msgpack"] == samples[i]["msgpack"]
        assert sample["npy"].dtype == np.float32 and sample["npy"].shape == (2, 3, 4)
        assert np.array_equal(sample["npy"], array * i)
        assert sample["raw.bin"] == bytes(range(i + 1))
    # Undecoded, the bytes are the documented encodings.
    raw = reader[1]
    assert raw["cls"] == b"1"
    assert json.loads(raw["json"]) == samples[1]["json"]


def test_writer_default_classes_from_cls(tmp_path):
    manifest = write_samples(tmp_path / "ds", [{"__key__": f"k{i}", "cls": c} for i, c in enumerate([2, 0, 2, 2])])
    assert manifest.classes == ("0", "1", "2")
    assert manifest.class_counts == (1, 0, 3)


def test_writer_refuses_non_integer_cls_bytes(tmp_path):
    writer = ShardWriter(str(tmp_path / "ds"))
    with pytest.raises(ShardstreamError):
        writer.write({"__key__": "a", "cls": b"cat"})
    writer.write({"__key__": "b", "cls": 1})
    writer.close()
    assert [s["__key__"] for s in open_dataset(str(tmp_path / "ds")).shards[0].reader()] == ["b"]


def test_writer_class_counts_account_for_every_label(tmp_path):
    """Every sample with a `cls` is either refused or counted in class_counts."""
    writer = ShardWriter(str(tmp_path / "ds"))
    for i, label in enumerate([0, 1, 1, 2]):
        writer.write({"__key__": f"k{i}", "cls": label})
    try:
        writer.write({"__key__": "negative", "cls": -1})
    except ShardstreamError:
        pass
    manifest = writer.close()
    written = [s for s in open_dataset(str(tmp_path / "ds")).shards[0].reader() if "cls" in s]
    assert sum(manifest.class_counts) == len(written)


def test_writer_label_outside_named_classes(tmp_path):
    """A label outside `classes` is refused, or the dataset written is still readable."""
    writer = ShardWriter(str(tmp_path / "ds"), classes=("a", "b"))
    writer.write({"__key__": "k0", "cls": 1})
    try:
        writer.write({"__key__": "k1", "cls": 4})
    except ShardstreamError:
        pass
    writer.close()
    manifest = open_dataset(str(tmp_path / "ds")).manifest
    assert len(manifest.classes) == len(manifest.class_counts)


def test_writer_max_samples(tmp_path):
    samples = blob_samples(10, lo=10, hi=200)
    manifest = write_samples(tmp_path / "ds", samples, max_samples=4)
    assert [s.samples for s in manifest.shards] == [4, 4, 2]
    assert [s.name for s in manifest.shards] == [f"shard-{i:06d}.tar.zst" for i in range(3)]
    keys = [s["__key__"] for shard in open_dataset(str(tmp_path / "ds")).shards for s in shard.reader()]
    assert keys == [s["__key__"] for s in samples]


@pytest.mark.parametrize("shard_size", [5000, "5KB", "5 kb"])
def test_writer_shard_size(tmp_path, shard_size):
    # Each sample is one member: 512 header + 1024 data = 1536 tar bytes; 3 fit in 5000, 4 do not.
    samples = [{"__key__": f"k{i:02d}", "bin": bytes([i]) * 1000} for i in range(10)]
    manifest = write_samples(tmp_path / "ds", samples, shard_size=shard_size, compression="none")
    assert [s.samples for s in manifest.shards] == [3, 3, 3, 1]
    for info in manifest.shards:
        assert info.raw_bytes - EOA <= 5000
        assert info.bytes == info.raw_bytes == (tmp_path / "ds" / info.name).stat().st_size
    got = [s["bin"] for ref in open_dataset(str(tmp_path / "ds")).shards for s in ref.reader()]
    assert got == [s["bin"] for s in samples]


def test_writer_oversized_sample_gets_its_own_shard(tmp_path):
    samples = [{"__key__": "small0", "bin": b"a" * 100}, {"__key__": "big", "bin": b"b" * 20000},
               {"__key__": "small1", "bin": b"c" * 100}]
    manifest = write_samples(tmp_path / "ds", samples, shard_size=4096)
    assert [s.samples for s in manifest.shards] == [1, 1, 1]
    got = [s["bin"] for ref in open_dataset(str(tmp_path / "ds")).shards for s in ref.reader()]
    assert got == [s["bin"] for s in samples]


def test_writer_bad_size_and_options(tmp_path):
    for kwargs in ({"shard_size": "lots"}, {"shard_size": "5XB"}, {"compression": "gzip"}, {"level": 0},
                   {"level": 23}, {"level": -101}, {"shard_size": 0}, {"max_samples": 0}, {"max_samples": -1},
                   {"frame_size": 0}):  # regression: the last four wrote a shard (or frame) a sample
        with pytest.raises(ShardstreamError):
            ShardWriter(str(tmp_path / "ds"), **kwargs)


def test_writer_duplicate_key(tmp_path):
    writer = ShardWriter(str(tmp_path / "ds"))
    writer.write({"__key__": "a", "txt": "first"})
    with pytest.raises(ShardstreamError, match="duplicate"):
        writer.write({"__key__": "a", "txt": "second"})
    writer.write({"__key__": "b", "txt": "third"})
    writer.close()
    got = [(s["__key__"], s["txt"]) for s in open_dataset(str(tmp_path / "ds")).shards[0].reader()]
    assert got == [("a", b"first"), ("b", b"third")]


def test_writer_refuses_a_key_written_to_an_earlier_shard(tmp_path):
    """A key that a finished shard holds is refused at its write, naming that shard, and the writer goes
    on (finished shards keep their keys as hashes: seenkeys.py)."""
    with ShardWriter(str(tmp_path / "ds"), max_samples=2) as writer:
        for key in ("a", "b", "c", "d", "e"):
            writer.write({"__key__": key, "txt": key})
        with pytest.raises(ShardstreamError, match=r"sample 'b': duplicate sample key: written before, to "
                                                   r"shard-000000\.tar\.zst"):
            writer.write({"__key__": "b", "txt": "again"})
        writer.write({"__key__": "f", "txt": "f"})
    got = [(s["__key__"], s["txt"]) for ref in open_dataset(str(tmp_path / "ds")).shards for s in ref.reader()]
    assert got == [(key, key.encode()) for key in "abcdef"]


def test_writer_refused_nothing_it_did_not_write(tmp_path):
    """Regression: a sample refused because the destination holds a dataset had its key counted, so
    writing it again (after choosing to overwrite) was refused as a duplicate."""
    with ShardWriter(str(tmp_path / "ds")) as writer:
        writer.write({"__key__": "a", "txt": "old"})
    writer = ShardWriter(str(tmp_path / "ds"))
    with pytest.raises(ShardstreamError, match="already holds a dataset"):
        writer.write({"__key__": "a", "txt": "new"})
    writer.overwrite = True
    writer.write({"__key__": "a", "txt": "new"})
    writer.close()
    assert [s["txt"] for s in open_dataset(str(tmp_path / "ds")).shards[0].reader()] == [b"new"]


def test_writer_refuses_shard_files_no_manifest_lists_unless_overwriting(tmp_path, write_webdataset,
                                                                        dataset_files):
    """Regression: a writer into a folder of another tool's `shard-%06d.tar` (WebDataset's usual name) wrote
    its shards over them one by one, and left the rest beside its dataset, listed by none."""
    dst = write_webdataset([{"__key__": f"mine{i:03d}", "txt": f"{i}"} for i in range(12)], tmp_path / "ds", 4)
    before = dataset_files(dst)
    for compression in ("none", "zstd"):  # the writer's .tar.zst names would not meet them: its indexes might
        with pytest.raises(ShardstreamError, match=r"shard files that no manifest lists \(shard-000000\.tar, "):
            with ShardWriter(str(dst), compression=compression) as writer:
                writer.write({"__key__": "new", "txt": "new"})
    assert dataset_files(dst) == before
    with ShardWriter(str(dst), compression="none", overwrite=True) as writer:
        writer.write({"__key__": "new", "txt": "new"})
    assert set(dataset_files(dst)) == {MANIFEST_NAME, "shard-000000.tar", "shard-000000.tar.idx"}
    assert [s["__key__"] for s in open_dataset(str(dst)).shards[0].reader()] == ["new"]


@pytest.mark.parametrize("keys", [("a", "b", "c", "c"), ("a", "b", "c", "d", "c")], ids=["next to", "apart"])
def test_writer_refuses_a_key_repeated_in_the_shard_it_opened(tmp_path, keys):
    """Regression: the sample that opened a shard had its key counted in the shard before, so a repeat
    in the new shard passed the new shard's check, and the finished one's index did not hold it."""
    writer = ShardWriter(str(tmp_path / "ds"), max_samples=2)
    with pytest.raises(ShardstreamError, match="duplicate sample key"):
        for key in keys:
            writer.write({"__key__": key, "txt": key})
        writer.close()


BAD_SAMPLES = {
    "no key": {"txt": "x"},
    "empty key": {"__key__": "", "txt": "x"},
    "key not a string": {"__key__": 7, "txt": "x"},
    "dot in key": {"__key__": "a.b", "txt": "x"},
    "dot in last part": {"__key__": "dir/a.b", "txt": "x"},
    "absolute key": {"__key__": "/etc/a", "txt": "x"},
    "parent in key": {"__key__": "../a", "txt": "x"},
    "parent inside key": {"__key__": "a/../../b", "txt": "x"},
    "NUL in key": {"__key__": "a\0b", "txt": "x"},
    "no fields": {"__key__": "a"},
    "slash in field": {"__key__": "a", "x/txt": "x"},
    "empty field": {"__key__": "a", "": b"x"},
    "unencodable value": {"__key__": "a", "bin": object()},
    "cls not an integer": {"__key__": "a", "cls": "cat"},
    "negative weight": {"__key__": "a", "txt": "x", "weight": "-1"},
    "infinite weight": {"__key__": "a", "txt": "x", "weight": "inf"},
    "weight beyond float32": {"__key__": "a", "txt": "x", "weight": "1e39"},  # the index would hold inf
    "json not serialisable": {"__key__": "a", "json": {"x": object()}},
}


@pytest.mark.parametrize("case", sorted(BAD_SAMPLES))
def test_writer_refuses_bad_samples(tmp_path, case):
    writer = ShardWriter(str(tmp_path / "ds"), compression="none")
    with pytest.raises(ShardstreamError):
        writer.write(BAD_SAMPLES[case])
    # The writer stays usable, and the refused sample is not in the output.
    writer.write({"__key__": "good", "txt": "ok"})
    writer.close()
    assert [s["__key__"] for s in open_dataset(str(tmp_path / "ds")).shards[0].reader()] == ["good"]


def test_writer_keeps_every_frame_within_what_readers_read(tmp_path, monkeypatch):
    """Regression: ShardWriter wrote a field of more than 2 GiB, and a frame of small samples of any
    frame_size, which every reader then refused ("exceeds the limit"). A sample over the limit is refused,
    and a frame is cut before a sample that would take it over. (The limit, 2 GiB, made 1 MB here.)"""
    import shardstream.writer

    limit = 1 << 20
    monkeypatch.setattr(shardstream.writer, "MAX_FRAME_BYTES", limit)
    with ShardWriter(str(tmp_path / "ds"), frame_size=64 << 20) as writer:
        with pytest.raises(ShardstreamError, match="more than the 1048576 a sample may"):
            writer.write({"__key__": "big", "bin": bytes(limit)})
        for i in range(8):
            writer.write({"__key__": f"s{i}", "bin": bytes([i]) * (300 << 10)})
    [ref] = open_dataset(str(tmp_path / "ds")).shards
    raw = ref.reader().index.frame_raw_offsets
    assert len(raw) > 3 and all(b - a <= limit for a, b in zip(raw, raw[1:]))
    assert [s["bin"][:1] for s in ref.reader()] == [bytes([i]) for i in range(8)]


def test_writer_and_open_shard_take_a_path_object(tmp_path):
    """Regression: ShardWriter(Path) and open_shard(Path) failed on `'PosixPath' object has no attribute
    'startswith'`, where pack, StreamingDataset and open_dataset take a Path."""
    with ShardWriter(tmp_path / "ds") as writer:
        writer.write({"__key__": "a", "txt": "x"})
    [ref] = open_dataset(tmp_path / "ds").shards
    assert [s["__key__"] for s in shardstream.open_shard(tmp_path / "ds" / ref.name)] == ["a"]


@pytest.mark.parametrize("prefix", ["a\\b", "sub/x", "x\0y"])
def test_writer_refuses_a_prefix_that_makes_no_plain_file_name(tmp_path, prefix):
    """Regression: ShardWriter took any prefix, and published a manifest every reader refuses ("unsafe
    shard file name"), or failed late on the scratch file. It refuses the prefix before writing anything."""
    with pytest.raises(ShardstreamError, match="would not make plain file names"):
        ShardWriter(str(tmp_path / "ds"), prefix=prefix)
    assert not (tmp_path / "ds").exists()


def check_keys_round_trip(dst: Path, keys: list[str], compression: str) -> None:
    write_samples(dst, [{"__key__": k, "txt": k} for k in keys], frame_size=600, compression=compression)
    info = open_dataset(str(dst)).manifest.shards[0]
    # The tar stream itself names the members so (tarfile agrees).
    data = (dst / info.name).read_bytes()
    if compression == "zstd":
        data = zstandard.ZstdDecompressor().stream_reader(io.BytesIO(data), read_across_frames=True).read()
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        assert tar.getnames() == [f"{k}.txt" for k in keys]
    reader = open_dataset(str(dst)).shards[0].reader()
    assert [(s["__key__"], s["txt"].decode()) for s in reader] == [(k, k) for k in keys]
    assert [reader[i]["__key__"] for i in range(len(keys))] == keys


@pytest.mark.parametrize("compression", ["zstd", "none"])
def test_writer_unusual_but_valid_keys(tmp_path, compression, cut):
    keys = [
        "v1.2/x",  # dots in folder names are fine
        "with space/a b",
        "a" * 90,  # still fits the 100-byte ustar name field
        "-dash/_under/#hash",
    ]
    check_keys_round_trip(tmp_path / "ds", keys, compression)


@pytest.mark.parametrize(
    "key",
    [
        pytest.param("deep/" * 30 + "leaf", id="long path"),
        pytest.param("x" * 120, id="long name"),
        pytest.param("café/naïve", id="non-ASCII"),
    ],
)
@pytest.mark.parametrize("compression", ["zstd", "none"])
def test_writer_keys_that_need_a_pax_record(tmp_path, compression, key, cut):
    check_keys_round_trip(tmp_path / "ds", ["short", key, "after"], compression)


def test_writer_after_close(tmp_path):
    writer = ShardWriter(str(tmp_path / "ds"))
    writer.write({"__key__": "a", "txt": "x"})
    manifest = writer.close()
    with pytest.raises(ShardstreamError):
        writer.write({"__key__": "b", "txt": "x"})
    assert writer.close() is manifest  # closing again is nothing, as when a `with` block closed it itself
    with ShardWriter(str(tmp_path / "ds2")) as inside:
        inside.write({"__key__": "a", "txt": "x"})
        inside.close()  # regression: the block's exit raised "close() called twice"
    assert shardstream.open_dataset(str(tmp_path / "ds2")).manifest.samples == 1


@pytest.mark.parametrize("sample, words", [
    ({"__key__": "k", "a\0b": b"x"}, "bad field name"),  # the tar member's name would end at the NUL
    ({"__key__": "k\udcff", "txt": "x"}, "not encodable"),  # no tar header or index can hold it
    ({"__key__": "k", "cls": 3.7}, "integer"),  # was stored as 3
    ({"__key__": "k", "cls": True}, "integer"),
    ({"__key__": "k", "cls": 1 << 40}, "class index"),  # was wrapped into int32 in the index
    ({"__key__": "k", "txt": None}, "str"),  # was stored as the text "None"
    ({"__key__": "k", "txt": np.arange(5000)}, "str"),  # was its elided printout
    ({"__key__": "k", "json": {"x": float("nan")}}, "JSON"),  # NaN is not JSON
])
def test_writer_refuses_values_it_would_store_wrongly(tmp_path, sample, words):
    """Found in review: each of these was written without an error, and read back as something else
    (or, for the key, left a shard without an index)."""
    with pytest.raises(ShardstreamError, match=words):
        with ShardWriter(str(tmp_path / "ds")) as writer:
            writer.write(sample)
    assert not (tmp_path / "ds" / MANIFEST_NAME).exists()


def test_writer_empty_dataset(tmp_path):
    with ShardWriter(str(tmp_path / "ds")):
        pass
    source = open_dataset(str(tmp_path / "ds"))
    assert len(source.shards) == 0 and source.manifest.samples == 0


def test_writer_failure_leaves_no_manifest_and_no_partial_shard(tmp_path):
    dst = tmp_path / "ds"
    samples = blob_samples(8, lo=500, hi=600)
    with pytest.raises(RuntimeError, match="boom"):
        with ShardWriter(str(dst), max_samples=3, frame_size=1000) as writer:
            for sample in samples:
                writer.write(sample)
            # Two shards are complete; the third has frames on disk under a temporary name.
            assert [s.name for s in writer.shards] == ["shard-000000.tar.zst", "shard-000001.tar.zst"]
            assert any(p.name.endswith(".part") for p in dst.rglob("*")), "expected a partial shard on disk"
            raise RuntimeError("boom")

    assert not (dst / MANIFEST_NAME).exists()
    with pytest.raises(ManifestError):
        open_dataset(str(dst))
    assert not [p for p in dst.rglob("*") if p.name.endswith(".part")]
    # Nor the shards it finished: listed by no manifest, they were of no use, and a second writer into
    # the folder refused them (thirty-sixth session: a failed repack's rerun).
    assert not [p for p in dst.rglob("shard-*")]
    with pytest.raises(ShardstreamError):
        writer.write({"__key__": "late", "txt": "x"})


# -- compression and on-disk layout ------------------------------------------------------------------------


def test_written_files_follow_the_umask_without_setting_it(tmp_path, monkeypatch):
    """Reading the umask with os.umask sets it for a moment, and a file another thread creates
    then (`index` writes from 8 threads) comes out world-writable: it is read, never set."""
    old = os.umask(0o027)
    try:
        def no_umask(mask):
            raise AssertionError("the process umask was set while writing")

        monkeypatch.setattr(os, "umask", no_umask)
        write_samples(tmp_path / "ds", blob_samples(3))
    finally:
        monkeypatch.undo()
        os.umask(old)
    modes = {p.name: p.stat().st_mode & 0o777 for p in (tmp_path / "ds").iterdir() if p.is_file()}
    assert modes and set(modes.values()) == {0o640}, modes


def test_uncompressed_shards_are_plain_tar(packed_plain, image_folder):
    manifest = open_dataset(packed_plain).manifest
    assert manifest.compression == "none"
    expected = images(image_folder)
    seen = {}
    for info in manifest.shards:
        assert info.name.endswith(".tar") and not info.name.endswith(".tar.zst")
        path = Path(packed_plain) / info.name
        assert info.bytes == info.raw_bytes == path.stat().st_size
        assert info.bytes % 512 == 0
        index = ShardIndex.from_bytes((Path(packed_plain) / info.index).read_bytes(), "i")
        assert index.compression == "none" and len(index.frame_offsets) == 0
        with tarfile.open(path) as tar:
            for member in tar.getmembers():
                assert member.isfile() and member.mtime == 0 and member.mode == 0o644
                seen[member.name] = tar.extractfile(member).read()
    assert {k: v for k, v in seen.items() if k.endswith(".jpg")} == {k + ".jpg": v for k, v in expected.items()}


def test_pack_output_is_the_same_samples_in_both_compressions(packed, packed_plain, read_all):
    strip = lambda s: {k: v for k, v in s.items() if k != "__url__"}  # noqa: E731
    assert [strip(s) for s in read_all(packed)] == [strip(s) for s in read_all(packed_plain)]


def check_seekable(path: Path, info: ShardInfo) -> int:
    data = path.read_bytes()
    sizes, table = parse_seek_table(data)
    assert sum(c for c, _ in sizes) == len(data) - table
    assert sum(d for _, d in sizes) == info.raw_bytes
    # Each entry is one independent zstd frame, declaring its size, that decompresses alone.
    index = ShardIndex.from_bytes((path.parent / info.index).read_bytes(), "i")
    assert len(index.frame_offsets) == len(sizes)  # data frames + 1: the last starts the end-of-archive frame
    dctx = zstandard.ZstdDecompressor()
    pos = raw_pos = 0
    for i, (c, d) in enumerate(sizes):
        assert index.frame_offsets[i] == pos and index.frame_raw_offsets[i] == raw_pos
        frame = data[pos : pos + c]
        assert zstandard.frame_content_size(frame) == d
        assert len(dctx.decompress(frame)) == d
        pos, raw_pos = pos + c, raw_pos + d
    # An ordinary decoder skips the table and sees the tar stream.
    assert len(dctx.stream_reader(io.BytesIO(data), read_across_frames=True).read()) == info.raw_bytes
    return len(sizes)


def test_zstd_seek_table(packed):
    for info in open_dataset(packed).manifest.shards:
        assert check_seekable(Path(packed) / info.name, info) >= 2


def test_zstd_seek_table_many_frames(tmp_path):
    manifest = write_samples(tmp_path / "ds", blob_samples(20), frame_size=3000, level=1)
    info = manifest.shards[0]
    assert check_seekable(tmp_path / "ds" / info.name, info) > 5


@pytest.mark.parametrize("compression", ["zstd", "none"])
@pytest.mark.parametrize("max_bytes", [1, 5000, 12000, 10**9])
def test_pieces_partition_a_range_without_sharing_a_frame(tmp_path, compression, max_bytes):
    """`ShardReader.pieces` cuts a range into contiguous pieces that fetch disjoint bytes (never one frame twice),
    each within `max_bytes` unless one frame (or sample) alone is larger; reading the pieces gives the range."""
    write_samples(tmp_path / "ds", blob_samples(60, hi=2500), frame_size=4000, compression=compression)
    reader = open_dataset(str(tmp_path / "ds")).shards[0].reader()
    index = reader.index
    whole = [s["bin"] for s in reader.read(0, len(reader))]
    for start, stop in [(0, len(reader)), (7, 41), (13, 14), (30, 30)]:
        cuts = list(reader.pieces(start, stop, max_bytes))
        assert [a for a, _ in cuts] == [start] + [b for _, b in cuts[:-1]] if cuts else start == stop
        assert all(a < b for a, b in cuts) and (not cuts or cuts[-1][1] == stop)
        assert [s["bin"] for a, b in cuts for s in reader.read(a, b)] == whole[start:stop]
        if compression == "zstd":
            spans = [(index.frame_of(a), index.frame_of(b - 1)) for a, b in cuts]
            assert all(last < first for (_, last), (first, _) in zip(spans, spans[1:])), f"a frame in two pieces: {spans}"
            extents = [int(index.frame_offsets[g + 1] - index.frame_offsets[f]) for f, g in spans]
            assert all(e <= max_bytes or f == g for e, (f, g) in zip(extents, spans))
        else:
            extents = [int(index.sample_offsets[b] - index.sample_offsets[a]) for a, b in cuts]
            assert all(e <= max_bytes or b == a + 1 for e, (a, b) in zip(extents, cuts))
    if max_bytes == 12000 and compression == "zstd":
        assert len(list(reader.pieces(0, len(reader), max_bytes))) > 2  # the case of several pieces was reached


@pytest.mark.parametrize("max_bytes", [5000, 12000])
def test_pieces_of_compressible_samples_hold_at_most_max_bytes_decompressed(tmp_path, max_bytes):
    """A piece is read whole into memory, decompressed: cut by its compressed bytes alone, one piece of
    well-compressed samples (arrays of zeros, masks) held the whole shard. Each piece holds at most
    `max_bytes` of samples unless one frame alone is larger, and the pieces still cover the range."""
    samples = [{"__key__": f"s{i:04d}", "bin": bytes(1500 + 10 * i), "cls": i % 3} for i in range(60)]
    write_samples(tmp_path / "ds", samples, frame_size=4000)
    reader = open_dataset(str(tmp_path / "ds")).shards[0].reader()
    index = reader.index
    assert reader.extent(0, len(reader))[1] < max_bytes, "the shard is stored in less than one piece's bytes"
    cuts = list(reader.pieces(0, len(reader), max_bytes))
    assert [a for a, _ in cuts] == [0] + [b for _, b in cuts[:-1]] and cuts[-1][1] == len(reader)
    held = [int(index.sample_offsets[b] - index.sample_offsets[a]) for a, b in cuts]
    assert all(h <= max_bytes or index.frame_of(a) == index.frame_of(b - 1) for h, (a, b) in zip(held, cuts)), held
    assert [s["bin"] for a, b in cuts for s in reader.read(a, b)] == [s["bin"] for s in samples]


def test_index_weights_round_trip_and_bad_ones_are_refused(tmp_path):
    samples = blob_samples(12)
    for i, s in enumerate(samples):
        if i != 3:
            s["weight"] = i / 4  # sample 3 has none: NaN in the index
    write_samples(tmp_path / "ds", samples)
    ref = open_dataset(str(tmp_path / "ds")).shards[0]
    weights = ref.reader().index.weights
    assert np.isnan(weights[3]) and [w for i, w in enumerate(weights.tolist()) if i != 3] == \
        [i / 4 for i in range(12) if i != 3]
    assert open_dataset(str(tmp_path / "ds")).manifest.shards[0].index_sha256  # still checksummed as a whole
    body = msgpack.unpackb(ShardIndex.from_bytes((tmp_path / "ds" / ref.info.index).read_bytes(), "x").to_bytes())
    for bad in (np.full(12, -1.0, "<f4").tobytes(), np.full(12, np.inf, "<f4").tobytes(), b"\0" * 47):
        with pytest.raises(CorruptIndexError, match="weights"):
            ShardIndex.from_bytes(msgpack.packb({**body, "weights": bad}), "idx-url")


def test_the_largest_weight_format_md_names_is_written_and_read(tmp_path):
    """Regression: FORMAT.md's "at most float32's largest (3.4028235e38)" was refused: that
    decimal lies a hair above float32's largest in float64; a weight rounding to it is within range."""
    with ShardWriter(str(tmp_path / "ds")) as writer:
        writer.write({"__key__": "a", "bin": b"x", "weight": b"3.4028235e38"})
        with pytest.raises(ShardstreamError, match="at most float32's"):
            writer.write({"__key__": "b", "bin": b"x", "weight": b"3.41e38"})
    weights = open_dataset(str(tmp_path / "ds")).shards[0].reader().index.weights
    assert weights.tolist() == [float(np.finfo(np.float32).max)]


@pytest.mark.parametrize("field, value", [("msgpack", 2**64), ("mp", -2**63 - 1), ("weight", 10**400),
                                          ("json", functools.reduce(lambda inner, _: [inner], range(5000), []))])
def test_values_no_encoding_holds_are_refused_naming_the_sample(tmp_path, field, value):
    """Regression: msgpack's ints past 64 bits and an int past float's range raised OverflowError,
    a JSON value nested past Python's recursion limit RecursionError: not ShardstreamErrors naming
    the sample and field."""
    with ShardWriter(str(tmp_path / "ds")) as writer:
        with pytest.raises(ShardstreamError, match=f"sample 'k': field '{field}': cannot encode"):
            writer.write({"__key__": "k", field: value})


@pytest.mark.parametrize("lo, hi, frame_size", [(50, 3000, 16 << 10), (20_000, 40_000, 64 << 10),
                                                (200_000, 300_000, 64 << 10)])
def test_samples_per_frame_estimates_what_the_indexes_record(tmp_path, lo, hi, frame_size):
    """A resume reads its backlog in groups of about a frame's samples; the estimate from the manifest alone
    (no index read) must be near the frames the shards really have."""
    write_samples(tmp_path / "ds", blob_samples(300, lo=lo, hi=hi), shard_size="2MB", frame_size=frame_size)
    source = open_dataset(str(tmp_path / "ds"))
    frames = sum(len(ref.reader().index.frame_offsets) - 1 for ref in source.shards)
    actual = source.manifest.samples / frames
    assert actual / 1.5 <= source.samples_per_frame() <= max(1.0, actual * 1.5), (source.samples_per_frame(), actual)


def test_writing_to_a_remote_store_leaves_no_temporary_folders(monkeypatch, tmp_path):
    """Regression: every file uploaded (shard, index, manifest) left an empty folder in /tmp."""
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # the system's temporary folder, here
    with ShardWriter("memory://leftovers/ds", max_samples=2) as writer:
        for i in range(5):
            writer.write({"__key__": f"k{i}", "txt": "x"})
    # The folder of this process's uploads goes when it empties; the one that holds such folders stays.
    assert [p.name for p in tmp_path.iterdir()] == ["shardstream-uploads"]
    assert list((tmp_path / "shardstream-uploads").iterdir()) == []
    assert len(list(StreamingDataset("memory://leftovers/ds", decode=None))) == 5


def test_read_buffers_are_reused_but_a_huge_one_is_not_kept(tmp_path):
    """Local pieces are read into a buffer the thread reuses; one grown for a frame far
    larger than a piece is dropped after use instead of pinning its memory."""
    rng = np.random.default_rng(1)
    big = reader_module._buffers.KEEP_BYTES + 1000
    samples = [{"__key__": "small", "bin": rng.bytes(1000)}, {"__key__": "huge", "bin": rng.bytes(big)}]
    write_samples(tmp_path / "ds", samples, compression="none")
    reader = open_dataset(str(tmp_path / "ds")).shards[0].reader()
    free = reader_module._buffers._free()
    free.clear()
    assert reader[0]["bin"] == samples[0]["bin"]
    assert len(free) == 1 and len(free[0]) == reader_module.LOCAL_READ_BYTES
    kept = free[0]
    assert reader[0]["bin"] == samples[0]["bin"]
    assert free == [kept] and free[0] is kept  # the same buffer again, not a fresh one
    assert reader[1]["bin"] == samples[1]["bin"]
    assert all(len(b) <= reader_module._buffers.KEEP_BYTES for b in free)


# -- _tarcut against the Python parser: unusual headers, hostile callers -------------------------------------

needs_tarcut = pytest.mark.skipif(not reader_module.TARCUT, reason="the _tarcut extension is not built")


def _raw_member(name: bytes, data: bytes, size_field: bytes | None = None) -> bytes:
    """A regular ustar member written byte by byte (tarfile would refuse some of these fields),
    with a checksum in tarfile's layout."""
    h = bytearray(512)
    h[: len(name)] = name
    h[100:124] = b"0000644\0" + b"0000000\0" + b"0000000\0"
    field = size_field if size_field is not None else b"%011o\0" % len(data)
    h[124 : 124 + len(field)] = field
    h[136:148] = b"00000000000\0"
    h[156:157] = b"0"
    h[257:265] = b"ustar\x0000"
    h[148:156] = b" " * 8
    h[148:156] = b"%06o\0 " % sum(h)
    return bytes(h) + data + bytes(-len(data) % 512)


def _raw_reader(tmp_path, samples: list[bytes], keys: list[str], compression: str,
                frame_tail: bytes = b"") -> reader_module.ShardReader:
    """A reader of a one-frame shard holding `samples` (each its tar members), indexed as `keys`;
    `frame_tail`: bytes after the zstd frame inside the span the index gives it."""
    from shardstream.storage import Store

    stream = b"".join(samples)
    offsets = np.cumsum([0] + [len(s) for s in samples]).astype(np.int64)
    if compression == "zstd":
        data = zstandard.ZstdCompressor(write_checksum=True, write_content_size=True).compress(stream) + frame_tail
        frames, raw = np.array([0, len(data)], np.int64), np.array([0, len(stream)], np.int64)
    else:
        data, frames, raw = stream + bytes(EOA), np.zeros(0, np.int64), np.zeros(0, np.int64)
    name = "s" + shardstream.format.SHARD_SUFFIX[compression]
    (tmp_path / name).write_bytes(data)
    index = ShardIndex(keys=tuple(keys), sample_offsets=offsets, frame_offsets=frames, frame_raw_offsets=raw,
                       compression=compression)
    return reader_module.ShardReader(Store(str(tmp_path)), name, index=index)


def _read_both_ways(reader: reader_module.ShardReader) -> tuple[object, object]:
    """What reading every sample gives, with `_tarcut` and with the Python parser: the samples
    (fields as bytes) or the class of the error."""
    def outcome():
        try:
            return [{k: bytes(v) if isinstance(v, (bytes, memoryview)) else v for k, v in s.items()} for s in reader]
        except ShardstreamError as e:
            return type(e).__name__
    fast = outcome()
    with python_cut():
        return fast, outcome()


_D = b"hello world"
UNUSUAL_HEADERS = {  # the C path takes some, hands the rest to the Python parser: the result is the same
    "repeated field": ([_raw_member(b"k.txt", _D) + _raw_member(b"k.txt", b"again")], ["k"]),
    "member named the key": ([_raw_member(b"k", _D)], ["k"]),
    "field named __key__": ([_raw_member(b"k.__key__", _D)], ["k"]),
    "field named __url__": ([_raw_member(b"k.txt", _D) + _raw_member(b"k.__url__", _D)], ["k"]),
    "field beginning with __": ([_raw_member(b"k.__meta__", _D) + _raw_member(b"k.txt", _D)], ["k"]),
    "key ending in a slash": ([_raw_member(b"a/.txt", _D)], ["a/"]),
    "size with leading spaces": ([_raw_member(b"k.txt", _D, b"        013\0")], ["k"]),
    "size with a tab": ([_raw_member(b"k.txt", _D, b"\t0000000013\0")], ["k"]),
    "size with +": ([_raw_member(b"k.txt", _D, b"+0000000013\0")], ["k"]),
    "size with _": ([_raw_member(b"k.txt", _D, b"0000_000013\0")], ["k"]),
    "size of 12 digits": ([_raw_member(b"k.txt", _D, b"000000000013")], ["k"]),
    "size field empty": ([_raw_member(b"k.txt", b"", b"\0" * 12)], ["k"]),
    "size then spaces": ([_raw_member(b"k.txt", _D, b"13          ")], ["k"]),
    "size over the limit": ([_raw_member(b"k.txt", _D, b"20000000001\0")], ["k"]),
    "name of 100 bytes, no NUL": ([_raw_member(b"k." + b"x" * 98, _D)], ["k"]),
    "key with a slash": ([_raw_member(b"a/b.c.d", _D)], ["a/b"]),
    "key with a dot": ([_raw_member(b"a.b.c", _D)], ["a.b"]),
    "field with a slash": ([_raw_member(b"k.x/y", _D)], ["k"]),
    "field not UTF-8": ([_raw_member(b"k.\xff", _D)], ["k"]),
    "name not UTF-8": ([_raw_member(b"\xff.txt", _D)], ["\udcff"]),
    "empty field": ([_raw_member(b"k.", _D)], ["k"]),
}


@needs_tarcut
@pytest.mark.parametrize("compression", ["zstd", "none"])
@pytest.mark.parametrize("case", list(UNUSUAL_HEADERS))
def test_tarcut_and_python_agree_on_unusual_headers(tmp_path, compression, case):
    """Regression (a key that is not UTF-8 raised UnicodeEncodeError in C, CorruptShardError in Python)."""
    samples, keys = UNUSUAL_HEADERS[case]
    fast, slow = _read_both_ways(_raw_reader(tmp_path, samples, keys, compression))
    assert fast == slow


@pytest.mark.parametrize("field", [b"__key__", b"__url__", b"__meta__"])
def test_a_member_whose_field_begins_with_two_underscores_is_refused_on_every_path(tmp_path, cut, field):
    """Names beginning with `__` are what readers call what is not a field: a member `s.__key__` read through
    an index replaced the sample's key with its bytes (and `s.__url__` its url), and read without one
    `s.__url__` was dropped silently. It is refused, naming the sample, by every reader and by `index`."""
    from shardstream.adopt import index_tars
    from shardstream.tarstream import open_shard as stream_shard

    indexed = _raw_reader(tmp_path, [_raw_member(b"s.txt", _D) + _raw_member(b"s." + field, b"EVIL")], ["s"], "none")
    with pytest.raises(shardstream.CorruptShardError, match=f"sample 's'.*field '{field.decode()}'"):
        list(indexed)
    plain = tmp_path / "plain"
    plain.mkdir()
    with tarfile.open(plain / "shard-000000.tar", "w", format=tarfile.USTAR_FORMAT) as tf:
        for name, data in (("s.txt", _D), ("s." + field.decode(), b"EVIL")):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    with pytest.raises(shardstream.CorruptShardError, match=f"sample 's'.*field '{field.decode()}'"):
        list(stream_shard(str(plain / "shard-000000.tar")))
    with pytest.raises(shardstream.CorruptShardError, match=f"field '{field.decode()}'"):
        index_tars(str(plain), progress=False)


def test_a_key_ending_in_a_slash_holds_no_member(tmp_path, cut):
    """`a/.txt` belongs to no sample (its basename begins with a dot: WebDataset's rule, `tario.member_key`);
    an index saying it is sample `a/`'s was refused by the Python parser and read by `_tarcut`."""
    with pytest.raises(CorruptIndexError, match="no members where the index points"):
        list(_raw_reader(tmp_path, [_raw_member(b"a/.txt", _D)], ["a/"], "none"))


@needs_tarcut
@pytest.mark.parametrize("tail", [b"\0garbage", b"\x28", "another frame"])
def test_tarcut_reads_only_the_first_zstd_frame_of_a_span(tmp_path, tail):
    """Regression: bytes after the frame in the span the index gives it made the C path raise
    (it decompressed every frame of the span) where python-zstandard reads the first frame."""
    if tail == "another frame":
        tail = zstandard.ZstdCompressor(write_checksum=True).compress(b"more")
    samples = [_raw_member(b"a.txt", _D), _raw_member(b"b.txt", _D * 3)]
    fast, slow = _read_both_ways(_raw_reader(tmp_path, samples, ["a", "b"], "zstd", frame_tail=tail))
    assert fast == slow and isinstance(fast, list) and fast[1]["txt"] == _D * 3


@needs_tarcut
def test_tarcut_returns_none_for_what_it_cannot_represent():
    """Regression: a key with a lone surrogate raised UnicodeEncodeError, an offset beyond
    Py_ssize_t OverflowError, and offsets near its limits overflowed `offset - base` (undefined
    behaviour); each is now None, for the Python parser to judge."""
    from shardstream import _tarcut

    buf = _raw_member(b"k.txt", _D)
    n = len(buf)
    assert _tarcut.cut_samples(buf, 0, [0, n], ["k"], "u") == [{"__key__": "k", "__url__": "u", "txt": _D}]
    assert _tarcut.cut_samples(buf, 0, [0, n], ["\udcff"], "u") is None
    assert _tarcut.cut_samples(buf, 0, [0, 2**70], ["k"], "u") is None
    assert _tarcut.cut_samples(buf, -2, [2**63 - 1, 2**63 - 1], ["k"], "u") is None
    assert _tarcut.cut_samples(buf, 2**62, [-(2**63), 0], ["k"], "u") is None
    with pytest.raises(TypeError):
        _tarcut.cut_samples(buf, 0, [0, 1.5], ["k"], "u")


@needs_tarcut
def test_tarcut_context_refuses_a_second_call_while_in_use():
    """Regression: a context used by two calls at once (two threads: the GIL is dropped while a
    frame decompresses; or a call from inside another) shared its buffer, and one call freed or
    overwrote what the other was reading (a segfault, wrong samples, checksum errors)."""
    from shardstream import _tarcut

    compress = zstandard.ZstdCompressor(write_checksum=True, write_content_size=True, level=1).compress
    small, huge = _raw_member(b"k.txt", _D), _raw_member(b"k.bin", b"\1" * (20 << 20))
    context, inner = _tarcut.new_context(), []

    def offsets():  # runs inside the outer call, once its frame is decompressed
        try:
            inner.append(_tarcut.frame_samples(context, compress(huge), len(huge), 0, [0, len(huge)], ["k"], "u"))
        except RuntimeError as e:
            inner.append(e)
        yield from (0, len(small))

    got = _tarcut.frame_samples(context, compress(small), len(small), 0, offsets(), ["k"], "u")
    assert got == [{"__key__": "k", "__url__": "u", "txt": _D}]
    assert isinstance(inner[0], RuntimeError) and "in use" in str(inner[0])
    assert _tarcut.frame_samples(context, compress(huge), len(huge), 0, [0, len(huge)], ["k"], "u")[0]["bin"][:3] == b"\1\1\1"


@needs_tarcut
def test_tarcut_survives_its_lists_changing_during_the_call():
    """Regression: the keys list was read item by item (borrowed) while samples were built; a
    finalizer run by the garbage collector inside the call that emptied it made the C code read
    freed memory (a segfault); now the call notices and raises. Run in a child process, so that a
    crash fails only this test."""
    import subprocess
    import sys

    code = f"""
import gc
from shardstream import _tarcut
buf = {b"".join(_raw_member(b"k%d.txt" % i, _D) for i in range(10))!r}
keys = ["k%d" % i for i in range(10)]
class Trap:
    def __init__(self): self.me = self  # a cycle: only the collector frees it
    def __del__(self): keys.clear()
def offsets():
    yield from range(0, 11 * 1024, 1024)
    Trap()  # garbage from now on: the next collection, inside the call, empties `keys`
gc.set_threshold(1, 1, 1)
try:
    got = _tarcut.cut_samples(buf, 0, offsets(), keys, "u")
    print([s["__key__"] for s in got])
except RuntimeError as e:
    print(e)
"""
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         cwd=Path(__file__).resolve().parent.parent)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.strip() in ("keys or offsets changed size during the call", str([f"k{i}" for i in range(10)]))


@needs_tarcut
def test_tarcut_frees_a_huge_frame_buffer_after_a_failed_frame():
    """Regression: the buffer grown for a frame over 16 MB was freed after a frame read well but
    kept (pinned for the life of the thread) after one zstd refused."""
    import ctypes

    from shardstream import _tarcut

    try:
        mallinfo2 = ctypes.CDLL(None).mallinfo2
    except (AttributeError, OSError):
        pytest.skip("needs glibc's mallinfo2")

    class MallInfo(ctypes.Structure):
        _fields_ = [(f, ctypes.c_size_t) for f in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                     "fsmblks", "uordblks", "fordblks", "keepcost")]

    mallinfo2.restype = MallInfo

    def in_use() -> int:
        info = mallinfo2()
        return info.uordblks + info.hblkhd

    huge = _raw_member(b"k.bin", b"\1" * (40 << 20))
    frame = bytearray(zstandard.ZstdCompressor(write_checksum=True, write_content_size=True, level=1).compress(huge))
    frame[-1] ^= 1  # the content checksum: the frame decompresses whole, then fails
    frame = bytes(frame)
    context = _tarcut.new_context()
    before = in_use()
    with pytest.raises(_tarcut.FrameError, match="checksum"):
        _tarcut.frame_samples(context, frame, len(huge), 0, [0, len(huge)], ["k"], "u")
    assert in_use() - before < (8 << 20)


@needs_tarcut
def test_tarcut_field_names_are_not_immortal():
    """Regression: field names were interned, and Python 3.12 makes interned strings immortal, so
    a shard with a distinct field name per sample grew the process by every name it read."""
    import sys

    from shardstream import _tarcut

    buf = _raw_member(b"k.field_0123456789_unusual", _D)
    (sample,) = _tarcut.cut_samples(buf, 0, [0, len(buf)], ["k"], "u")
    name = next(k for k in sample if k.startswith("field_"))
    assert sys.getrefcount(name) < 100


def test_a_writer_refuses_a_dataset_or_replaces_it_whole(tmp_path):
    """Written over shard by shard, an existing dataset kept its manifest over new bytes: a writer that failed
    half-way left a manifest listing shards it had rewritten (CorruptIndexError on read)."""
    def write(n, **kwargs):
        with ShardWriter(str(tmp_path / "ds"), max_samples=2, **kwargs) as writer:
            for i in range(n):
                writer.write({"__key__": f"k{i}", "txt": f"sample {i} of {n}"})

    write(9)
    with pytest.raises(ShardstreamError, match="already holds a dataset"):
        write(4)
    assert len(list(open_dataset(str(tmp_path / "ds")).shards[0].reader())) == 2  # the old dataset, whole
    write(4, overwrite=True)
    names = sorted(p.name for p in (tmp_path / "ds").iterdir() if not p.name.startswith("."))
    assert names == ["manifest.msgpack"] + sorted(f"shard-{i:06d}.tar.zst{x}" for i in range(2) for x in ("", ".idx"))
    assert [s["txt"] for ref in open_dataset(str(tmp_path / "ds")).shards for s in ref.reader()] == \
        [f"sample {i} of 4".encode() for i in range(4)]


def test_frames_built_one_after_another_in_a_thread_hold_each_its_own_samples():
    """Frames are laid out in a buffer each thread reuses (shardfile._raw_frame): a frame after a
    larger one, or after one too large to keep the buffer for, holds exactly its own members, as a
    tar of the same samples does."""
    from shardstream.shardfile import FRAME_SIZE, KEPT_RAW_BYTES, build_frame

    rng = np.random.default_rng(0)
    sizes = (FRAME_SIZE, 10, KEPT_RAW_BYTES + 1000, 700, 3 * FRAME_SIZE // 2, 1)
    for n, size in enumerate(sizes):
        payload = rng.integers(0, 256, size, dtype=np.uint8).tobytes()
        frame = build_frame([(f"k{n}", [("bin", payload), ("cls", b"3")])], "zstd", -1)
        raw = zstandard.ZstdDecompressor().decompress(frame.data)
        assert len(raw) == frame.raw_size == sum(frame.sizes)
        with tarfile.open(fileobj=io.BytesIO(raw)) as tar:
            members = {m.name: tar.extractfile(m).read() for m in tar.getmembers()}
        assert members == {f"k{n}.bin": payload, f"k{n}.cls": b"3"}, n
        assert frame.labels == [3]


def test_writers_end_a_shard_before_its_index_passes_what_readers_read(tmp_path, monkeypatch):
    """Regression: ShardWriter and pack cut shards by size and count only, so a shard of
    many small samples could get an index past the reader's limit (256 MiB), which every
    reader then refused. Both end a shard before its index would pass it; the limit is
    lowered here (for writer and reader alike) so that a few hundred samples reach it."""
    from shardstream import format as format_module

    monkeypatch.setattr(format_module, "MAX_INDEX_BYTES", 4096)
    keys = [f"sample-{i:05d}-{'x' * 40}" for i in range(300)]
    with ShardWriter(str(tmp_path / "written"), shard_size="1GB") as writer:
        for key in keys:
            writer.write({"__key__": key, "txt": "a few bytes"})
    written = open_dataset(str(tmp_path / "written"))
    assert len(written.manifest.shards) > 3  # one shard by size, several by index
    index_sizes = [os.path.getsize(tmp_path / "written" / info.index) for info in written.manifest.shards]
    assert max(index_sizes) <= 4096
    assert [s["__key__"] for s in StreamingDataset(str(tmp_path / "written"), decode=None)] == keys

    folder = tmp_path / "images"
    shardstream.synthetic.make_image_folder(folder, num_classes=2, images_per_class=40, size_range=((16, 16), (24, 24)))
    summary = shardstream.pack(str(folder), str(tmp_path / "packed"), shard_size="1GB", workers=1)
    packed = open_dataset(str(tmp_path / "packed"))
    assert len(packed.manifest.shards) > 1 and summary.samples == 80
    assert max(os.path.getsize(tmp_path / "packed" / info.index) for info in packed.manifest.shards) <= 4096
    assert sum(1 for _ in StreamingDataset(str(tmp_path / "packed"), decode=None)) == 80


def test_an_index_past_what_readers_read_is_refused_where_written_and_a_key_too_long_at_write(tmp_path, monkeypatch):
    """`shardstream index` cannot cut another tool's shard: an index that readers would
    refuse is an error naming the limit, not a file written. A key past what an index may
    hold (1 MiB) is refused at `write`."""
    from shardstream import format as format_module
    from shardstream.adopt import index_tars

    with ShardWriter(str(tmp_path / "long"), shard_size="1GB") as writer:
        with pytest.raises(ShardstreamError, match="a key may take"):
            writer.write({"__key__": "k" * ((1 << 20) + 1), "txt": "x"})
        writer.write({"__key__": "k" * (1 << 20), "txt": "x"})  # at the limit: written, and read
    assert [len(s["__key__"]) for s in StreamingDataset(str(tmp_path / "long"), decode=None)] == [1 << 20]

    folder = tmp_path / "tars"
    folder.mkdir()
    with tarfile.open(folder / "shard-000000.tar", "w") as tar:
        for i in range(200):
            data = f"sample {i}".encode()
            member = tarfile.TarInfo(f"s{i:04d}.txt")
            member.size = len(data)
            tar.addfile(member, io.BytesIO(data))
    monkeypatch.setattr(format_module, "MAX_INDEX_BYTES", 2048)
    with pytest.raises(ShardstreamError, match="past what a reader reads"):
        index_tars(str(folder))
    assert not list(folder.glob("*.idx")) and not (folder / MANIFEST_NAME).exists()


def test_shardwriter_refuses_fields_that_would_not_read_back_as_written(tmp_path):
    """Regression (found by review): bytes given for a typed field were stored unchecked (an
    npy of pickled objects, text that is no UTF-8, JSON or msgpack that does not parse), a
    msgpack map keyed by tuples was written and read back as an unhashable list, and a JSON
    object's int, bool and None keys came back as strings: each written, and then every
    read failed or differed. Each is refused at `write`, naming the sample and field."""
    pickled = io.BytesIO()
    np.save(pickled, np.array([{"a": 1}], dtype=object), allow_pickle=True)
    refused = [({"npy": pickled.getvalue()}, "do not read back as npy"),
               ({"txt": b"\xff\xfe"}, "do not read back as txt"),
               ({"json": b"{not json"}, "do not read back as json"),
               ({"mp": b"\xc1"}, "do not read back as mp"),
               ({"msgpack": {(0, 1): 0.5}}, "do not read back as msgpack"),
               ({"json": {1: "a"}}, "keys are strings"),
               ({"json": [{"ok": {True: 1}}]}, "keys are strings")]
    with ShardWriter(str(tmp_path / "ds")) as writer:
        for fields, message in refused:
            with pytest.raises(ShardstreamError, match=message) as info:
                writer.write({"__key__": "bad", **fields})
            assert info.value.key == "bad"
        good = {"__key__": "good", "json": {"a": [1, (2, 3)]}, "msgpack": {1: "one", "t": (1, 2)}, "txt": b"caf\xc3\xa9",
                "npy": np.arange(3)}
        writer.write(good)
    [sample] = list(StreamingDataset(str(tmp_path / "ds"), decode=None))
    got = Decoder()(sample)
    assert got["json"] == {"a": [1, [2, 3]]} and got["msgpack"] == {1: "one", "t": [1, 2]} and got["txt"] == "café"
    assert got["npy"].tolist() == [0, 1, 2]


def test_shardwriter_refuses_values_it_would_store_as_something_else(tmp_path):
    """Regression (found by a user's walk): a str for an image field (a path passed for the
    file's bytes) was stored as its text and failed at every read; a field named `__meta__.json`
    or `__extra` vanished; JSON bytes with NaN were taken (FORMAT.md: no NaN); a masked array
    lost its mask; a tensor that requires grad raised torch's bare RuntimeError. Each is
    refused now, naming the sample and field."""
    masked = np.ma.array([1, 2, 3], mask=[0, 1, 0])
    refused = [({"jpg": "/data/images/0001.jpg"}, "'jpg': an image field holds the file's bytes, not a str"),
               ({"__meta__.json": {"a": 1}}, "bad field name '__meta__.json': names beginning with '__'"),
               ({"__extra": b"keep me"}, "bad field name '__extra'"),
               ({"json": b'{"loss": NaN}'}, "do not read back as json .NaN is not JSON"),
               ({"npy": masked}, "npy stores no mask"),
               ({"npy": torch.ones(3, requires_grad=True)}, "'npy': cannot encode Tensor"),
               # npy bytes no reader loads (found by review: the header check took them)
               ({"npy": _npy_claiming((-1,))}, "negative dimensions"),
               ({"npy": _npy_claiming((2**32, 2**32))}, "EOF: reading array data")]
    with ShardWriter(str(tmp_path / "ds")) as writer:
        for fields, message in refused:
            with pytest.raises(ShardstreamError, match=message) as info:
                writer.write({"__key__": "bad", "cls": 0, **fields})
            assert info.value.key == "bad"
        # The readers' own names are left out, as a sample read from a shard holds them; other
        # extensions keep WebDataset's convention for a str: its UTF-8.
        writer.write({"__key__": "good", "__url__": "s3://b/x.tar", "__local_path__": "/tmp/x", "note": "café",
                      "be.npy": np.arange(3, dtype=">i4")})
    [sample] = list(StreamingDataset(str(tmp_path / "ds")))
    assert sample["note"] == "café".encode() and "__local_path__" not in sample
    assert sample["be.npy"].dtype == np.int32 and sample["be.npy"].dtype.isnative  # torch takes no other order
    assert sample["be.npy"].tolist() == [0, 1, 2]


def _npy_claiming(shape: tuple[int, ...]) -> bytes:
    """An npy file of a few float64 bytes whose header claims `shape`."""
    header = io.BytesIO()
    np.lib.format.write_array_header_1_0(header, {"descr": "<f8", "fortran_order": False, "shape": shape})
    return header.getvalue() + b"\0" * 16


def test_a_missing_field_names_the_fields_the_sample_holds(tmp_path):
    """Regression (found by review): with `fields`, the error for a missing field listed
    what was left once the fields not asked for were dropped (`has ['cls']`, or `[]`)."""
    png = io.BytesIO()
    Image.new("RGB", (4, 4)).save(png, "PNG")
    with ShardWriter(str(tmp_path / "ds")) as writer:
        writer.write({"__key__": "a", "jpg": png.getvalue(), "cls": 0})
        writer.write({"__key__": "b", "png": png.getvalue(), "txt": "caption", "cls": 1})
    for fields in (("jpg", "cls"), ("jpg",)):
        with pytest.raises(shardstream.MissingFieldError, match=r"no field 'jpg'; the sample has \['cls', 'png', 'txt'\]"):
            list(StreamingDataset(str(tmp_path / "ds"), fields=fields))


def _write_as_a_second_writer_would(folder: Path, index_path: Path, raw: dict) -> None:
    """Write the index `raw` (of the dataset's one shard) and a manifest that agrees with it:
    its checksum, size and sample count, as a second writer's bug would leave them."""
    forged = msgpack.packb(raw, use_bin_type=True)
    index_path.write_bytes(forged)
    manifest = msgpack.unpackb((folder / MANIFEST_NAME).read_bytes())
    samples = len(raw["keys"])
    manifest["shards"][0].update(samples=samples, index_bytes=len(forged), index_sha256=sha256(forged))
    manifest["samples"] = samples
    (folder / MANIFEST_NAME).write_bytes(msgpack.packb(manifest, use_bin_type=True))


def test_an_index_whose_frame_boundary_falls_inside_a_sample_is_corrupt(tmp_path):
    """Regression (found by review): the index check made the frames cover the samples at
    the two ends only. An index (of a second writer, its manifest agreeing) that left out the
    boundary between two samples each in a frame of its own read the first across both
    frames as the first frame's bytes and the second not at all, and `verify` passed it."""
    from shardstream import cli

    folder = tmp_path / "ds"
    with ShardWriter(str(folder), frame_size=512) as writer:  # a frame a sample
        for k in range(4):
            writer.write({"__key__": f"s{k}", "txt": f"sample {k}"})
    index_path = folder / "shard-000000.tar.zst.idx"
    raw = msgpack.unpackb(index_path.read_bytes())
    offsets = np.frombuffer(raw["sample_offsets"], "<u8")
    raw["sample_offsets"] = np.delete(offsets, 1).astype("<u8").tobytes()
    del raw["keys"][1]
    _write_as_a_second_writer_would(folder, index_path, raw)
    with pytest.raises(CorruptIndexError, match="a frame boundary falls inside a sample") as raised:
        list(StreamingDataset(str(folder), decode=None))
    assert raised.value.url == str(index_path)
    assert cli.main(["verify", str(folder), "--quiet"]) == 1


def test_verify_reports_a_manifest_whose_compression_its_indexes_contradict(tmp_path):
    """Regression (found by review): a manifest saying "none" over zstd shards (or the other
    way) passed `verify`, and `inspect` printed it as the dataset's compression."""
    from shardstream import cli

    folder = tmp_path / "ds"
    with ShardWriter(str(folder)) as writer:
        writer.write({"__key__": "a", "txt": "x"})
    manifest = msgpack.unpackb((folder / MANIFEST_NAME).read_bytes())
    assert manifest["compression"] == "zstd"
    manifest["compression"] = "none"
    (folder / MANIFEST_NAME).write_bytes(msgpack.packb(manifest, use_bin_type=True))
    from shardstream.verify import verify_dataset

    report = verify_dataset(str(folder), progress=False)
    assert [p.message for p in report.problems] == ["its index says compression 'zstd', the manifest 'none'"]
    assert cli.main(["verify", str(folder), "--quiet"]) == 1


@pytest.mark.parametrize("compression", ["none", "zstd"])
def test_verify_names_only_the_samples_a_truncated_shard_lost(tmp_path, compression):
    """Regression (found by review): `verify` read on after a bad sample by pieces of many
    samples, each reaching past the cut of a truncated shard: every sample was named
    damaged, those before the cut too, which a user salvaging the data took as lost."""
    from shardstream.verify import verify_dataset

    folder = D.truncated_shard(tmp_path, compression)
    report = verify_dataset(str(folder), decode_images=False)
    named = sorted({p.key for p in report.problems if p.key is not None})
    assert named == [f"s{k}" for k in range(6, 10)], [str(p) for p in report.problems]


@pytest.mark.parametrize("compression", ["none", "zstd"])
def test_reading_a_truncated_shard_names_the_first_sample_it_lost(tmp_path, compression):
    """Regression (found by a walk with large samples): streaming a shard cut short raised "shard is shorter than
    its index says" with the file and offset only, where the skip path and `verify` name the sample."""
    folder = D.truncated_shard(tmp_path, compression)
    with pytest.raises(shardstream.CorruptShardError, match="shorter than its index says") as raised:
        list(StreamingDataset(str(folder), decode=None, prefetch=0))
    assert raised.value.key == "s6" and "s6" in str(raised.value)  # s0-s5 are whole: the first lost


def test_verify_counts_the_classes_of_a_manifest_that_names_none(tmp_path):
    """Regression (found by review): `verify` compared the indexes' labels with the manifest's
    class counts only where the manifest named classes; one whose class table was emptied,
    over indexes holding labels, passed."""
    from shardstream.verify import verify_dataset

    folder = tmp_path / "ds"
    with ShardWriter(str(folder)) as writer:
        for k in range(3):
            writer.write({"__key__": f"s{k}", "txt": "x", "cls": k})
    assert verify_dataset(str(folder), decode_images=False).problems == []
    manifest = msgpack.unpackb((folder / MANIFEST_NAME).read_bytes())
    manifest["classes"], manifest["class_counts"] = [], []
    (folder / MANIFEST_NAME).write_bytes(msgpack.packb(manifest, use_bin_type=True))
    problems = verify_dataset(str(folder), decode_images=False).problems
    assert [p.message for p in problems] == ["a label is past the manifest's 0 classes"]


@pytest.mark.parametrize("dropped", ["first", "last"])
def test_verify_finds_a_sample_a_plain_tar_index_leaves_out(tmp_path, dropped):
    """Regression (found by review): `verify` read a plain tar between its index's first and
    last offsets only, so an index that left out the first or last sample (its checksums
    agreeing, as a second writer's would) passed, and no reader read that sample."""
    from shardstream.verify import verify_dataset

    folder = tmp_path / "ds"
    with ShardWriter(str(folder), compression="none") as writer:
        for k in range(4):
            writer.write({"__key__": f"s{k}", "txt": f"sample {k}"})
    index_path = folder / "shard-000000.tar.idx"
    raw = msgpack.unpackb(index_path.read_bytes())
    offsets = np.frombuffer(raw["sample_offsets"], "<u8")
    cut = slice(1, None) if dropped == "first" else slice(None, -1)
    raw["sample_offsets"] = offsets[cut].astype("<u8").tobytes()
    raw["keys"] = raw["keys"][1:] if dropped == "first" else raw["keys"][:-1]
    _write_as_a_second_writer_would(folder, index_path, raw)
    key = "s0" if dropped == "first" else "s3"
    messages = [p.message for p in verify_dataset(str(folder), decode_images=False).problems]
    assert f"holds '{key}.txt' outside every sample its index lists" in messages, messages
