"""The on-disk metadata of a dataset: the manifest and the per-shard index (FORMAT.md).

Both are msgpack maps, unpacked with explicit size limits so that a hostile file
cannot make the reader allocate without bound, and validated field by field so that
a damaged one fails here with a message naming the file, not later with a KeyError.
"""

from __future__ import annotations

import itertools
import re
from dataclasses import dataclass, field
from typing import Any

import msgpack
import numpy as np

from ._version import __version__
from .columns import read_labels, read_weights
from .errors import CorruptIndexError, ManifestError, ShardstreamError
from .shardtable import ShardInfo as ShardInfo, ShardTable  # ShardInfo: re-exported, where it always was

FORMAT_VERSION = 1
MANIFEST_NAME = "manifest.msgpack"
# A part's manifest (`pack --part I/N`): its number and the number of parts, five digits each.
PART_MANIFEST = re.compile(r"manifest\.part-(\d{5})-of-(\d{5})\.msgpack")
INDEX_SUFFIX = ".idx"
MAX_MANIFEST_BYTES = 1 << 30
MAX_INDEX_BYTES = 256 << 20
_INDEX_HEAD = 1 << 10  # an index's fields besides its per-sample and per-frame ones, and their headers
# Uncompressed, a zstd frame's most; a frame holds whole samples, so a sample's tar bytes (its
# members, headers and padding) may be no more, in either compression: writers refuse a larger
# sample, which readers would refuse to read.
MAX_FRAME_BYTES = 1 << 31
# What a shard's index may hold, by the reader's msgpack limits (`unpack_limited`): at most
# `MAX_INDEX_BYTES` in all, a key of at most `MAX_KEY_BYTES` UTF-8 bytes, and fewer keys than
# `MAX_SHARD_SAMPLES`. Writers end a shard before its index would pass them (`ShardFill`).
MAX_KEY_BYTES = 1 << 20
MAX_SHARD_SAMPLES = (1 << 26) - 1
COMPRESSIONS = ("zstd", "none")
SHARD_SUFFIX = {"zstd": ".tar.zst", "none": ".tar"}


def unpack_limited(data: bytes, *, max_bytes: int, url: str, error: type[ShardstreamError]) -> Any:
    """Unpack msgpack without trusting it: bounded sizes, no extension types, str map keys."""
    if len(data) > max_bytes:
        raise error(f"{len(data)} bytes exceeds the limit of {max_bytes}", url=url)
    try:
        return msgpack.unpackb(
            data,
            raw=False,
            strict_map_key=True,
            max_bin_len=max_bytes,
            max_str_len=1 << 20,
            # Every item takes a byte at least: no more than the data holds, so that a claim of
            # 2^26 items in 21 bytes is refused, not met with 512 MiB (msgpack before 1.2.4
            # allocates a list as long as it claims before reading an item).
            max_array_len=min(1 << 26, len(data)),
            max_map_len=min(1 << 16, len(data) // 2),
            max_ext_len=0,
        )
    except (ValueError, msgpack.UnpackException) as e:
        raise error(f"not valid msgpack: {e}", url=url) from e


class ShardFill:
    """The writers' rule for where a shard ends: what the shard being filled holds, against
    `shard_size`, `max_samples` and what its index may hold (the reader's limits). Slotted,
    with plain attributes: `pack` asks it once a file of its listing."""

    __slots__ = ("shard_size", "max_samples", "samples", "raw_bytes", "index_bytes")

    def __init__(self, shard_size: int, max_samples: int | None = None) -> None:
        self.shard_size = shard_size
        self.max_samples = min(max_samples, MAX_SHARD_SAMPLES) if max_samples is not None else MAX_SHARD_SAMPLES
        self.start_next()

    def takes(self, size: int, cost: int) -> bool:
        """Whether the shard takes one more sample of `size` tar bytes whose `index_cost` is
        `cost`; an empty one takes any."""
        return not self.samples or (self.raw_bytes + size <= self.shard_size and self.samples < self.max_samples
                                    and self.index_bytes + cost <= MAX_INDEX_BYTES)

    def add(self, size: int, cost: int) -> None:
        self.samples += 1
        self.raw_bytes += size
        self.index_bytes += cost

    def start_next(self) -> None:
        """A new, empty shard."""
        self.samples, self.raw_bytes, self.index_bytes = 0, 0, _INDEX_HEAD


def index_cost(key: str) -> int:
    """The most one sample adds to its shard's index: its key (a msgpack str: at most 5 bytes
    of header), its offset (8), its label (4) and weight (4), and a frame's two offsets (16),
    as if it began a frame of its own. A key that is no UTF-8 (a file name's lone
    surrogate, which `pack` refuses later, naming the file) is counted as it stands."""
    return len(key.encode("utf-8", "surrogatepass")) + 37


def _require(raw: Any, name: str, kind: type | tuple[type, ...], url: str, error: type[ShardstreamError]) -> Any:
    if not isinstance(raw, dict) or name not in raw:
        raise error(f"missing field {name!r}", url=url)
    value = raw[name]
    if not isinstance(value, kind) or isinstance(value, bool) and kind is int:
        raise error(f"field {name!r} has the wrong type ({type(value).__name__})", url=url)
    return value


# -- manifest -------------------------------------------------------------------


@dataclass(frozen=True)
class Manifest:
    """Everything a reader needs to plan an epoch without opening a shard.

    `shards` may be given as any sequence of `ShardInfo`; it is kept as a `ShardTable`.
    """

    shards: ShardTable
    compression: str
    classes: tuple[str, ...] = ()
    class_counts: tuple[int, ...] = ()
    skipped: tuple[tuple[str, str], ...] = ()  # (file, reason) left out at pack time
    ignored: int = 0  # files in the source that are not images
    options: dict[str, Any] = field(default_factory=dict)
    writer: str = f"shardstream {__version__}"
    version: int = FORMAT_VERSION

    def __post_init__(self) -> None:
        if not isinstance(self.shards, ShardTable):
            object.__setattr__(self, "shards", ShardTable.of(self.shards))

    @property
    def samples(self) -> int:
        return int(self.shards.samples.sum())

    @property
    def counts(self) -> np.ndarray:
        """Samples per shard, in manifest order."""
        return self.shards.samples.copy()

    def to_bytes(self) -> bytes:
        t = self.shards
        shards = [{"name": name, "samples": samples, "bytes": size, "raw_bytes": raw, "sha256": sha256,
                   "index": index, "index_bytes": index_bytes, "index_sha256": index_sha256, "fields": list(fields)}
                  for name, samples, size, raw, sha256, index, index_bytes, index_sha256, fields
                  in zip(t.names, t.samples.tolist(), t.bytes.tolist(), t.raw_bytes.tolist(), t.sha256_hex(),
                         t.indexes, t.index_bytes.tolist(), t.index_sha256_hex(), t.fields())]
        body = {
            "format": "shardstream",
            "version": self.version,
            "writer": self.writer,
            "compression": self.compression,
            "samples": self.samples,
            "shards": shards,
            "classes": list(self.classes),
            "class_counts": list(self.class_counts),
            "skipped": [{"file": f, "reason": r} for f, r in self.skipped],
            "ignored": self.ignored,
            "options": self.options,
        }
        return msgpack.packb(body, use_bin_type=True)

    @classmethod
    def from_bytes(cls, data: bytes, url: str) -> "Manifest":
        raw = unpack_limited(data, max_bytes=MAX_MANIFEST_BYTES, url=url, error=ManifestError)
        E = ManifestError
        if _require(raw, "format", str, url, E) != "shardstream":
            raise E("not a shardstream manifest", url=url)
        version = _require(raw, "version", int, url, E)
        if version > FORMAT_VERSION:
            raise E(f"format version {version} is newer than this reader ({FORMAT_VERSION}); upgrade shardstream", url=url)
        compression = _require(raw, "compression", str, url, E)
        if compression not in COMPRESSIONS:
            raise E(f"unknown compression {compression!r}", url=url)
        manifest = cls(
            shards=_shard_table(_require(raw, "shards", list, url, E), url),
            compression=compression,
            classes=_items(_require(raw, "classes", list, url, E), str, "classes", url),
            class_counts=_items(_require(raw, "class_counts", list, url, E), int, "class_counts", url),
            skipped=tuple(
                (_require(d, "file", str, url, E), _require(d, "reason", str, url, E))
                for d in _require(raw, "skipped", list, url, E)
            ),
            ignored=_require(raw, "ignored", int, url, E),
            options=_require(raw, "options", dict, url, E),
            writer=_require(raw, "writer", str, url, E),
            version=version,
        )
        if _require(raw, "samples", int, url, E) != manifest.samples:
            raise E("sample total disagrees with the shard list", url=url)
        if manifest.ignored < 0 or any(count < 0 for count in manifest.class_counts):
            raise E("negative count", url=url)
        if manifest.classes and len(manifest.class_counts) != len(manifest.classes):
            raise E("class_counts and classes differ in length", url=url)
        if len(set(manifest.classes)) != len(manifest.classes):  # a label would have two names, or none
            raise E("a class name is listed twice", url=url)
        if version < 1:
            raise E(f"format version {version} does not exist (the first is 1)", url=url)
        return manifest


# What each shard entry holds. Entries are read column by column, since a manifest can
# list 400k shards; only a manifest at fault is walked entry by entry, to name the entry.
_ENTRY = {"name": str, "samples": int, "bytes": int, "raw_bytes": int, "sha256": str, "index": str,
          "index_bytes": int, "index_sha256": str, "fields": list}


def _shard_table(entries: list, url: str) -> ShardTable:
    E = ManifestError
    try:
        columns = {key: [entry[key] for entry in entries] for key in _ENTRY}
    except (KeyError, TypeError):  # an entry lacks a key, or is not a map
        columns = None
    if columns is None or not all(set(map(type, columns[key])) <= {kind} for key, kind in _ENTRY.items()):
        for i, entry in enumerate(entries):  # raises, naming the first entry at fault
            for key, kind in _ENTRY.items():
                _require(entry, key, kind, f"{url} (shard entry {i})", E)
        raise AssertionError("a shard entry is at fault but none was found")  # pragma: no cover
    for key in ("name", "index"):
        if not _plain_names(columns[key]):
            for i, name in enumerate(columns[key]):
                _safe_name(name, f"{url} (shard entry {i})")
    if not set(map(type, itertools.chain.from_iterable(columns["fields"]))) <= {str}:
        raise E("a shard's fields must be strings", url=url)
    try:
        table = ShardTable(names=columns["name"], samples=columns["samples"], bytes=columns["bytes"],
                           raw_bytes=columns["raw_bytes"], sha256=columns["sha256"], indexes=columns["index"],
                           index_bytes=columns["index_bytes"], index_sha256=columns["index_sha256"],
                           fields=[tuple(f) for f in columns["fields"]])
    except (ValueError, OverflowError) as e:  # a digest that is not one, a number beyond 64 bits
        raise E(f"a shard entry is invalid: {e}", url=url) from e
    if (table.samples < 0).any() or (table.bytes < 0).any() or (table.raw_bytes < 0).any() \
            or (table.index_bytes < 0).any():
        raise E("negative count", url=url)
    if (table.samples > table.raw_bytes // 512).any():
        # every sample is at least one member, a 512-byte header at the least
        raise E("a shard lists more samples than its bytes could hold", url=url)
    # The counts are claims, and an epoch is planned from them before a shard is opened: an
    # 853-byte shard said to hold 2**40 samples (its raw bytes raised to match) was planned
    # to a bare MemoryError. An index holds each sample's offset (8 bytes) and key (2 at the
    # least), within the limits every reader has.
    if (table.samples > MAX_SHARD_SAMPLES).any() or (table.index_bytes > MAX_INDEX_BYTES).any() \
            or (table.samples * 10 > table.index_bytes).any():
        raise E(f"a shard lists more samples than an index a reader reads could hold ({MAX_SHARD_SAMPLES} "
                f"samples, {MAX_INDEX_BYTES} bytes of index, 10 bytes a sample)", url=url)
    if len(set(columns["name"])) != len(table):
        raise E("a shard is listed twice", url=url)
    return table


def shard_entry(raw: Any, url: str) -> ShardInfo:
    """One shard entry (a pack journal's record holds one), checked as a manifest's entries
    are: a ManifestError naming `url` where it is not one, or names a file outside its folder."""
    return _shard_table([raw], url)[0]


def _plain_names(names: list[str]) -> bool:
    """True when every name passes `_safe_name` (checked on all at once: one pass in C)."""
    joined = "".join(names)
    return not ("/" in joined or "\\" in joined or "\0" in joined) and {"", ".", ".."}.isdisjoint(names)


def _items(values: list, kind: type, name: str, url: str) -> tuple:
    if not all(isinstance(v, kind) and not isinstance(v, bool) for v in values):
        raise ManifestError(f"{name} must hold only {kind.__name__} values", url=url)
    return tuple(values)


def safe_name(name: str) -> bool:
    """Whether `name` is a plain file name, as every shard's is: a manifest must not point
    outside its folder."""
    return bool(name) and not ("/" in name or "\\" in name or name in (".", "..") or "\0" in name)


def _safe_name(name: str, url: str) -> str:
    if not safe_name(name):
        raise ManifestError(f"unsafe shard file name {name!r}", url=url)
    return name


# -- shard index ------------------------------------------------------------------


@dataclass(frozen=True)
class ShardIndex:
    """Where every sample of one shard lies, so that sample i costs one ranged read.

    `sample_offsets` (n + 1 values) are offsets in the uncompressed tar stream: sample
    i spans [sample_offsets[i], sample_offsets[i + 1]). For zstd shards,
    `frame_offsets` (F + 1) are the byte offsets of the frames in the file and
    `frame_raw_offsets` (F + 1) where each frame starts in the tar stream; every frame
    holds whole samples. Uncompressed shards have no frames: the tar stream is the file.
    """

    keys: tuple[str, ...]
    sample_offsets: np.ndarray
    frame_offsets: np.ndarray
    frame_raw_offsets: np.ndarray
    compression: str
    labels: np.ndarray | None = None  # each sample's class (`cls`), -1 where none; optional
    weights: np.ndarray | None = None  # each sample's sampling weight (`weight`), NaN where none; optional
    # The shard file's size as indexed; optional (indexes written before it was recorded lack
    # it). A shard written again since gives itself away by its size where no manifest would.
    shard_bytes: int | None = None

    def __len__(self) -> int:
        return len(self.keys)

    def frame_of(self, sample: int) -> int:
        """Index of the frame holding `sample` (zstd shards)."""
        return int(np.searchsorted(self.frame_raw_offsets, self.sample_offsets[sample], side="right")) - 1

    def to_bytes(self) -> bytes:
        body = {
            "format": "shardstream-index",
            "version": FORMAT_VERSION,
            "compression": self.compression,
            "keys": list(self.keys),
            "sample_offsets": _u64(self.sample_offsets),
            "frame_offsets": _u64(self.frame_offsets),
            "frame_raw_offsets": _u64(self.frame_raw_offsets),
        }
        if self.labels is not None:
            body["labels"] = np.asarray(self.labels, dtype="<i4").tobytes()
        if self.weights is not None:
            body["weights"] = np.asarray(self.weights, dtype="<f4").tobytes()
        if self.shard_bytes is not None:
            body["shard_bytes"] = int(self.shard_bytes)
        data = msgpack.packb(body, use_bin_type=True)
        # Written past the reader's limits, the index would be refused by every reader: the
        # writers end shards before (`ShardFill`); an index of a shard made elsewhere may not.
        if len(data) > MAX_INDEX_BYTES or len(self.keys) > MAX_SHARD_SAMPLES:
            raise ShardstreamError(f"the shard's index of {len(self.keys)} samples takes {len(data)} bytes, past what "
                                   f"a reader reads ({MAX_INDEX_BYTES} bytes, {MAX_SHARD_SAMPLES} samples: FORMAT.md, "
                                   "limits); write the samples in smaller shards")
        return data

    @classmethod
    def from_bytes(cls, data: bytes, url: str) -> "ShardIndex":
        E = CorruptIndexError
        raw = unpack_limited(data, max_bytes=MAX_INDEX_BYTES, url=url, error=E)
        if _require(raw, "format", str, url, E) != "shardstream-index":
            raise E("not a shardstream index", url=url)
        if _require(raw, "version", int, url, E) > FORMAT_VERSION:
            raise E("index version is newer than this reader", url=url)
        keys = tuple(_require(raw, "keys", list, url, E))
        index = cls(
            keys=keys,
            sample_offsets=_from_u64(_require(raw, "sample_offsets", bytes, url, E), url),
            frame_offsets=_from_u64(_require(raw, "frame_offsets", bytes, url, E), url),
            frame_raw_offsets=_from_u64(_require(raw, "frame_raw_offsets", bytes, url, E), url),
            compression=_require(raw, "compression", str, url, E),
            labels=read_labels(raw.get("labels"), len(keys), url),
            weights=read_weights(raw.get("weights"), len(keys), url),
            shard_bytes=_require(raw, "shard_bytes", int, url, E) if "shard_bytes" in raw else None,
        )
        if index.shard_bytes is not None and index.shard_bytes < 0:
            raise E(f"shard_bytes {index.shard_bytes} is negative", url=url)
        if index.compression not in COMPRESSIONS:
            raise E(f"unknown compression {index.compression!r}", url=url)
        index.check(url)
        return index

    def check(self, url: str) -> None:
        """Structural checks: lengths agree and offsets only grow."""
        E = CorruptIndexError
        n, f = len(self.keys), len(self.frame_offsets)
        if len(self.sample_offsets) != n + 1:
            raise E(f"{len(self.sample_offsets)} sample offsets for {n} keys", url=url)
        if np.any(np.diff(self.sample_offsets.astype(np.int64)) <= 0):
            raise E("sample offsets are not increasing", url=url)
        if self.compression == "zstd":
            # F frames have F + 1 offsets: a shard of no samples (which FORMAT.md allows) has none.
            if f < (2 if n else 1) or len(self.frame_raw_offsets) != f:
                raise E("frame tables are missing or differ in length", url=url)
            if np.any(np.diff(self.frame_offsets.astype(np.int64)) <= 0) or np.any(
                np.diff(self.frame_raw_offsets.astype(np.int64)) <= 0
            ):
                raise E("frame offsets are not increasing", url=url)
            # The frames cover the samples exactly: from the first sample's start to the last one's end.
            if n and (self.frame_raw_offsets[0] != self.sample_offsets[0] or
                      self.frame_raw_offsets[-1] != self.sample_offsets[-1]):
                raise E("frames and samples do not cover the same bytes", url=url)
            # And every frame boundary is a sample boundary (FORMAT.md): an index without one
            # read a sample across two frames as the first frame's bytes, and the next sample
            # not at all, silently. (The sample offsets grow: a binary search per frame.)
            if n:
                at = np.minimum(np.searchsorted(self.sample_offsets, self.frame_raw_offsets), n)
                if np.any(self.sample_offsets[at] != self.frame_raw_offsets):
                    raise E("a frame boundary falls inside a sample", url=url)
        if not all(isinstance(k, str) for k in self.keys):
            raise E("keys must be strings", url=url)


def _u64(values: np.ndarray) -> bytes:
    return np.asarray(values, dtype="<u8").tobytes()


def _from_u64(data: bytes, url: str) -> np.ndarray:
    if len(data) % 8:
        raise CorruptIndexError("offset table length is not a multiple of 8", url=url)
    return np.frombuffer(data, dtype="<u8").astype(np.int64)
