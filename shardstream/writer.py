"""`ShardWriter`: write samples into a shardstream dataset, one after another.

Samples are grouped into zstd frames of about `frame_size` uncompressed bytes and
frames into shards of about `shard_size`; shards are published whole as they fill, and
the manifest is written last, on `close()`. A writer that fails or is interrupted
removes its partial shard and writes no manifest, so a crash never yields a manifest
that lists a missing or half-written shard.
"""

from __future__ import annotations

import operator
import os
import re
from typing import Any, Callable, Iterator, Sequence

from . import tario
from .arguments import flag, integer
from .columns import MAX_CLASS, check_weight
from .errors import ShardstreamError
from .fields import encode_sample
from .format import (COMPRESSIONS, INDEX_SUFFIX, MANIFEST_NAME, MAX_FRAME_BYTES, SHARD_SUFFIX, Manifest, ShardFill, ShardInfo, index_cost,
                     safe_name)
from .indexes import load_index
from .scratch import cleanup_scratch
from .seenkeys import SeenKeys
from .shardfile import FRAME_SIZE, LEVEL, MIN_LEVEL, ShardFileWriter, build_frame
from .storage import Store

__all__ = ["ShardWriter", "parse_size", "remove_dataset", "shard_name", "write_manifest"]

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}



# The most a count or size option may be: manifests and journals hold them as msgpack integers,
# and numpy as int64.
MAX_COUNT = (1 << 63) - 1


def parse_size(size: int | str) -> int:
    """Bytes from an int or a string such as ``"256MB"`` or ``"1.5GiB"``; anything else
    (a float, a bool, a negative count, more than `MAX_COUNT`) is refused in words, not
    with `re`'s TypeError or msgpack's OverflowError."""
    if not isinstance(size, str):
        try:
            count = operator.index(size) if not isinstance(size, bool) else -1
        except TypeError:
            count = -1
        if not 0 <= count <= MAX_COUNT:
            raise ShardstreamError(f"bad size {size!r}: use a count of bytes (an integer, 0 or more, below 2**63) or "
                                   "a string with a unit such as '256MB', '1GiB'")
        return count
    match = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([a-zA-Z]*)\s*", size)
    if not match or match.group(2).upper() not in _UNITS:
        raise ShardstreamError(f"bad size {size!r}: use bytes or a unit such as 256MB, 1GiB")
    count = float(match.group(1)) * _UNITS[match.group(2).upper()]
    if not count <= MAX_COUNT:  # inf too: 400 digits
        raise ShardstreamError(f"bad size {size!r}: more than 2**63 bytes")
    return int(count)


def shard_name(prefix: str, number: int, compression: str) -> str:
    return f"{prefix}-{number:06d}{SHARD_SUFFIX[compression]}"


def write_manifest(store: Store, manifest: Manifest) -> None:
    """Publish the manifest: the last file written, and the one that makes a dataset."""
    store.write(MANIFEST_NAME, manifest.to_bytes())
    cleanup_scratch(store)


def check_compression(compression: str, level: int) -> None:
    if compression not in COMPRESSIONS:
        raise ShardstreamError(f"compression must be one of {COMPRESSIONS}, not {compression!r}")
    if not MIN_LEVEL <= level <= 22 or level == 0:  # zstd reads 0 as "its default", which is 3
        raise ShardstreamError(f"zstd level must be 1..22, or {MIN_LEVEL}..-1 for zstd's fast levels, not {level}")


def check_level_used(compression: str, level: int, default: int) -> None:
    """Refuse a level other than `default` for uncompressed shards: recorded in the manifest, it
    would say something of bytes it did not decide (and `pack --resume` compares it)."""
    if compression == "none" and level != default:
        raise ShardstreamError(f"level ({level}) goes with compression 'zstd': uncompressed shards have no level")


def remove_dataset(store: Store, manifest_name: str, keep: Callable[[str], bool] = lambda name: False,
                   noting: Callable[[list[str]], None] | None = None) -> None:
    """Remove a dataset's manifest first (so a crash cannot leave it listing replaced
    shards), then the shards and indexes it listed (but those `keep` says), so no stale
    shard stays behind. `noting` is told their names first, before anything is removed."""
    try:
        old = Manifest.from_bytes(store.read(manifest_name), store.url(manifest_name))
    except ShardstreamError:
        old = None
    names = [] if old is None else [name for shard in old.shards if not keep(shard.name)
                                    for name in (shard.name, shard.index)]
    if noting is not None:
        noting(names)
    store.remove(manifest_name)
    store.remove_all(names)


class ShardWriter:
    """Write samples to `dst` (a path or fsspec URL) as shards plus a manifest.

    A sample is ``{"__key__": str, field: value, ...}``: bytes are stored as they are,
    ints, strings, dicts and arrays by the field's extension (`cls`, `txt`, `json`,
    `msgpack`, `npy`; a str for another extension as its UTF-8, but not for an image's,
    which holds the file's bytes). Bytes given for one of those extensions are refused
    where a reader would not read them back (`check_bytes=False` stores them all the same,
    as `repack` does with other tools' samples). The readers' own names (``__url__``,
    ``__local_path__``: a sample read from WebDataset; ``__pad__``: one from a
    `StreamingDataset`) are left out, and other fields
    beginning with ``__`` refused. `shard_size` counts uncompressed tar bytes; `classes`
    names the class indices found in the `cls` field, for the manifest.

    Use as a context manager: on a clean exit the manifest is written; on an exception
    the partial shard is removed and no manifest is written. A key written before is
    refused at its `write`, and the writer goes on (seenkeys.py keeps the keys: about 12
    bytes a key once its shard is finished). A destination that holds a dataset is
    refused, or with `overwrite` replaced (its manifest removed first).
    `fsync`: every file is on the disk before the manifest names it (`pack`'s `fsync`).
    """

    def __init__(
        self,
        dst: str | os.PathLike[str],
        shard_size: int | str = "256MB",
        max_samples: int | None = None,
        compression: str = "zstd",
        level: int = LEVEL,
        *,
        classes: Sequence[str] = (),
        frame_size: int = FRAME_SIZE,
        prefix: str = "shard",
        storage_options: dict[str, Any] | None = None,
        overwrite: bool = False,
        fsync: bool = False,
        check_bytes: bool = True,
    ) -> None:
        # Flags as flags ("no" replaced the dataset there), whole numbers as plain ints (10.5
        # samples went into the manifest), classes as names (a string was split into letters).
        overwrite, fsync, check_bytes = (flag(overwrite, "overwrite"), flag(fsync, "fsync"),
                                         flag(check_bytes, "check_bytes"))
        level, frame_size = integer(level, "level"), integer(frame_size, "frame_size")
        max_samples = integer(max_samples, "max_samples") if max_samples is not None else None
        if isinstance(classes, str):
            raise TypeError(f"classes must be a sequence of class names, not {classes!r}")
        classes = tuple(classes)  # once: a generator given is read here, not by the check and lost
        if not all(isinstance(name, str) for name in classes):
            raise TypeError(f"classes must be a sequence of class names, not {classes!r}")
        if not isinstance(prefix, str):
            raise TypeError(f"prefix must be a string, not {prefix!r}")
        check_compression(compression, level)
        check_level_used(compression, level, LEVEL)
        # As pack refuses them: each of 0 (or a negative number) wrote a shard a sample, or
        # a frame a sample, which no one asks for by it.
        for name, value in (("shard_size", parse_size(shard_size)), ("max_samples", max_samples),
                            ("frame_size", frame_size)):
            if value is not None and not 1 <= value <= MAX_COUNT:
                raise ShardstreamError(f"{name} must be a positive number below 2**63, not {value!r}")
        if not safe_name(shard_name(prefix, 0, compression)):  # else written, and refused by every reader
            raise ShardstreamError(f"prefix {prefix!r} would not make plain file names (no '/', '\\' or NUL): "
                                   "shards are files in the dataset's folder")
        self.overwrite = overwrite
        self.check_bytes = check_bytes
        self._claimed = False  # see _claim
        self.store = Store(os.fspath(dst), storage_options or {}, durable=fsync)
        self.shard_size = parse_size(shard_size)
        self.max_samples = max_samples
        self.compression = compression
        self.level = level
        self.classes = tuple(classes)
        self.frame_size = frame_size
        self.prefix = prefix
        self.shards: list[ShardInfo] = []
        self._class_counts: dict[int, int] = {}
        self._keys = SeenKeys(self._written_keys)
        self._shard: ShardFileWriter | None = None
        self._pending: list[tuple[str, list[tuple[str, bytes]]]] = []
        self._pending_bytes = 0
        self._fill = ShardFill(self.shard_size, max_samples)  # where the shard being filled ends
        self._closed = False
        self._manifest: Manifest | None = None

    def __enter__(self) -> "ShardWriter":
        return self

    def __exit__(self, kind: object, error: object, tb: object) -> None:
        if kind is None:
            self.close()
        else:
            self.abort()

    def write(self, sample: dict[str, Any]) -> None:
        """Add one sample."""
        if self._closed:
            raise ShardstreamError("write() after close()")
        key, fields = encode_sample(sample, check_bytes=self.check_bytes)
        self._keys.check_new(key)
        label = self._label(key, fields)
        _check_weight(key, fields)
        size = sum(tario.member_size(len(data), f"{key}.{name}") for name, data in fields)
        if size > MAX_FRAME_BYTES:  # written, it would be a frame no reader reads
            raise ShardstreamError(f"the sample takes {size} bytes in the tar, more than the {MAX_FRAME_BYTES} a "
                                   "sample may (FORMAT.md, limits)", key=key)
        cost = index_cost(key)
        if self._shard is not None and not self._fill.takes(size, cost):
            self._finish_shard()
        if self._shard is None:
            self._claim()
            self._shard = ShardFileWriter(
                self.store, shard_name(self.prefix, len(self.shards), self.compression), self.compression, self.level
            )
            self.store.makedirs()
        if self._pending_bytes + size > MAX_FRAME_BYTES:  # the frame, joined, would be one no reader reads
            self._flush_frame()
        self._keys.add(key)  # to the shard it goes to (after the one before is finished), once it is queued
        self._pending.append((key, fields))
        self._pending_bytes += size
        self._fill.add(size, cost)
        if label is not None:
            self._class_counts[label] = self._class_counts.get(label, 0) + 1
        if self._pending_bytes >= self.frame_size:
            self._flush_frame()

    def _label(self, key: str, fields: list[tuple[str, bytes]]) -> int | None:
        """The sample's class index, checked before anything is queued."""
        data = dict(fields).get("cls")
        if data is None:
            return None
        try:
            label = int(data)
        except ValueError:
            raise ShardstreamError(f"cls must be an integer class index, not {data[:20]!r}", key=key) from None
        if label < 0 or label > MAX_CLASS or (self.classes and label >= len(self.classes)):
            raise ShardstreamError(f"class index {label} outside 0..{len(self.classes) - 1 if self.classes else MAX_CLASS}",
                                   key=key)
        return label

    def _flush_frame(self) -> None:
        if self._pending and self._shard is not None:
            self._shard.append(build_frame(self._pending, self.compression, self.level))
        self._pending, self._pending_bytes = [], 0

    def _finish_shard(self) -> None:
        self._flush_frame()
        if self._shard is not None and self._shard.samples:
            self.shards.append(self._shard.finish())
        self._keys.seal()
        self._shard = None
        self._fill.start_next()

    def position(self, key: str) -> int | None:
        """Where the sample written with `key` came among the writes (0: the first), or None if
        none had it: a duplicate key's first sample, which `repack` traces to the tar it came
        from. It reads every finished shard's index: a lookup for a refusal, not a loop."""
        done = 0
        for _, keys in self._written_keys():
            if key in keys:
                return done + keys.index(key)
            done += len(keys)
        open_keys = [*(self._shard.keys if self._shard is not None else ()), *(k for k, _ in self._pending)]
        return done + open_keys.index(key) if key in open_keys else None

    def _written_keys(self) -> Iterator[tuple[str, tuple[str, ...]]]:
        """(name, keys) of each finished shard, from its index: read only where a new key's
        hash matches one of theirs (`SeenKeys`)."""
        for info in self.shards:
            yield info.name, load_index(self.store, info.index, info).keys

    def close(self) -> Manifest | None:
        """Finish the last shard and write the manifest; returns it (the same one when already
        closed, as at the end of a `with` block that called `close()` itself; None after `abort()`)."""
        if self._closed:
            return self._manifest
        self._claim()
        self._finish_shard()
        self._closed = True
        n = max([len(self.classes) - 1, *self._class_counts]) + 1 if (self.classes or self._class_counts) else 0
        manifest = Manifest(
            shards=tuple(self.shards),
            compression=self.compression,
            classes=self.classes or tuple(str(i) for i in range(n)),
            class_counts=tuple(self._class_counts.get(i, 0) for i in range(n)),
            options={"shard_size": self.shard_size, "max_samples": self.max_samples, "level": self.level,
                     "frame_size": self.frame_size},
        )
        write_manifest(self.store, manifest)
        self._manifest = manifest
        return manifest

    def _claim(self) -> None:
        """Before the first shard: refuse a destination that holds a dataset, or with
        `overwrite` remove it (its manifest first), so that no manifest ever lists a shard
        this writer is writing over."""
        if self._claimed:
            return
        if self.store.exists(MANIFEST_NAME):
            if not self.overwrite:
                raise ShardstreamError("already holds a dataset; pass overwrite=True to replace it",
                                       url=self.store.url(MANIFEST_NAME))
            remove_dataset(self.store, MANIFEST_NAME)
        # Files named as this writer names its shards, which no manifest lists (another tool's
        # `shard-%06d.tar`, or a writer's killed before its manifest): written over one by one,
        # or left mixed with the dataset, without a word.
        named = re.compile(rf"{re.escape(self.prefix)}-\d{{6}}\.tar(\.zst)?(?:{re.escape(INDEX_SUFFIX)})?")
        found = [name for name in self.store.list() if named.fullmatch(name)]
        if found and not self.overwrite:
            listed = ", ".join(found[:4]) + (f" and {len(found) - 4} more" if len(found) > 4 else "")
            raise ShardstreamError(f"already holds shard files that no manifest lists ({listed}), which this writer "
                                   "would write over or mix with; pass overwrite=True (--overwrite) to replace them",
                                   url=self.store.root)
        self.store.remove_all(found)
        self._claimed = True

    def abort(self) -> None:
        """Drop the shard being written and those finished; write no manifest (an exception in
        the `with` block does this). Finished shards no manifest lists were of no use, and a
        second run into the folder refused them ("shard files that no manifest lists")."""
        if self._shard is not None:
            self._shard.abort()
            cleanup_scratch(self.store)  # the scratch folder, if that emptied it
        if not self._closed:
            self.store.remove_all(name for info in self.shards for name in (info.name, info.index))
        self._shard, self._pending, self._closed = None, [], True


def _check_weight(key: str, fields: list[tuple[str, bytes]]) -> None:
    """A `weight` field (the sample's sampling weight, kept in the shard index) is checked
    before anything is queued."""
    data = dict(fields).get("weight")
    if data is not None:
        check_weight(data, key=key)
