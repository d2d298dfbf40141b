"""Writing one shard file: frames of whole samples, the seek table, the index, atomically.

The unit of work is a `Frame`: the tar bytes of a few consecutive samples (about 1 MB),
compressed as one independent zstd frame with its content checksum. Frames are built
anywhere (the packer builds them in worker processes, in parallel) and appended in
order by one `ShardFileWriter`, which owns the file, its checksum and its index.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import os
import struct
import threading
from collections import deque
from dataclasses import dataclass, field
from typing import BinaryIO, Callable, Iterator, Sequence

import numpy as np
import zstandard

from . import tario
from .columns import label_column, label_of, weight_column, weight_of
from .errors import StorageError, shown_name
from .format import INDEX_SUFFIX, ShardIndex, ShardInfo
from .scratch import drop_scratch, scratch_file
from .storage import Store

FRAME_SIZE = 1 << 20  # uncompressed bytes per zstd frame, before the sample that crosses it

# The default zstd level for `ShardWriter`, whose fields may be anything (arrays,
# text). On a 210 MB shard of JPEGs, level 1 wrote 0.26% more bytes than level 3
# (0.9853 vs 0.9827 of the tar) at 4x the speed (1,450 vs 360 MB/s on one core here).
LEVEL = 1

# The default for `pack`, whose payloads are JPEG, PNG and WebP files: they do not
# shrink under any level, and what zstd saves in a tar (headers, padding) every level
# removes. On 200 MB of such a tar, zstd's fast level -1 compressed at 2,732 MB/s
# against level 1's 1,366 MB/s, to the same 0.9853 of the tar (-3: 3,239 MB/s, 0.9855).
IMAGE_LEVEL = -1
MIN_LEVEL = -100  # zstd's fast levels go lower; below this they only stop compressing

SKIPPABLE_MAGIC = 0x184D2A5E
SEEKABLE_MAGIC = 0x8F92EAB1

_local = threading.local()


def _compressor(level: int) -> zstandard.ZstdCompressor:
    # Compressors are not thread-safe and cost ~50 us to build: one per thread and level.
    cache = _local.__dict__.setdefault("compressors", {})
    if level not in cache:
        cache[level] = zstandard.ZstdCompressor(level=level, write_checksum=True, write_content_size=True)
    return cache[level]


@dataclass
class Frame:
    """The tar bytes of consecutive whole samples, compressed or not, ready to append."""

    keys: list[str]
    sizes: list[int]  # uncompressed tar bytes of each sample
    fields: set[str]
    data: bytes | bytearray  # one zstd frame, or the raw tar bytes for uncompressed shards
    raw_size: int
    labels: list[int] = field(default_factory=list)  # each sample's `cls`, -1 if none
    weights: list[float] = field(default_factory=list)  # each sample's `weight`, NaN if none


def build_frame(samples: Sequence[tuple[str, list[tuple[str, bytes]]]], compression: str, level: int) -> Frame:
    """Lay out samples as tar members and compress them into one frame."""
    parts: list[bytes] = []
    keys, sizes, fields, labels, weights = [], [], set(), [], []
    member_parts = tario.member_parts
    for key, members in samples:
        size = 0
        label, weight = -1, math.nan
        for name, data in members:
            if name == "cls":
                label = label_of(data)
            elif name == "weight":
                weight = weight_of(data)
            header, data, pad = member_parts(f"{key}.{name}", data)
            parts += (header, data, pad)
            size += len(header) + len(data) + len(pad)
            fields.add(name)
        keys.append(key)
        sizes.append(size)
        labels.append(label)
        weights.append(weight)
    raw_size = sum(sizes)
    if compression != "zstd":
        return Frame(keys, sizes, fields, b"".join(parts), raw_size, labels, weights)
    # Header, data and padding are copied once, into a buffer this thread reuses from frame
    # to frame, and compressed from there. Joined into fresh bytes, each frame's megabyte
    # often came from the kernel anew, page fault by page fault: `pack` of 4,000 JPEGs of
    # 114 KB, 2 workers, made 41k page faults against 54k, and took 3% less CPU and wall
    # time per round (8 alternating rounds; BENCHMARKS.md, "Twenty-fifth session").
    with _raw_frame(raw_size) as raw:
        at = 0
        for part in parts:
            raw[at : at + len(part)] = part
            at += len(part)
        data = _compressor(level).compress(raw)
    return Frame(keys, sizes, fields, data, raw_size, labels, weights)


KEPT_RAW_BYTES = 4 * FRAME_SIZE  # a frame buffer larger than this (a huge sample's) is not kept


@contextlib.contextmanager
def _raw_frame(size: int) -> Iterator[memoryview]:
    """`size` bytes of this thread's reused frame buffer."""
    buffer = _local.__dict__.get("raw")
    if buffer is None or len(buffer) < size:
        buffer = bytearray(max(size, FRAME_SIZE + FRAME_SIZE // 4))
    with memoryview(buffer) as view, view[:size] as raw:
        yield raw
    _local.raw = buffer if len(buffer) <= KEPT_RAW_BYTES else None


def seek_table(frames: Sequence[tuple[int, int]]) -> bytes:
    """zstd's seekable-format seek table (a skippable frame) for (compressed, raw) sizes.

    Ordinary zstd decoders skip it; seekable-zstd tools use it to seek.
    """
    entries = b"".join(struct.pack("<II", c, r) for c, r in frames)
    footer = struct.pack("<IBI", len(frames), 0, SEEKABLE_MAGIC)
    body = entries + footer
    return struct.pack("<II", SKIPPABLE_MAGIC, len(body)) + body


class _InOrder:
    """Applies `step` to each item put, in order, in a thread of its own, at most
    `QUEUED_FRAMES` items and `QUEUED_BYTES` bytes waiting (but one item however large).
    An error is kept and raised by the next `put` or by `close`; later items are taken
    and dropped, so that `put` never blocks on a stage that has stopped."""

    QUEUED_FRAMES = 8  # waiting at most (frames of about 1 MB: the measured case)
    QUEUED_BYTES = 16 << 20  # and no more bytes than this, but one frame however large

    def __init__(self, step: Callable[[bytes], object], name: str):
        self._step = step
        self._queued: deque[bytes | None] = deque()  # None: the end
        self._queued_bytes = 0
        self._changed = threading.Condition()
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while (data := self._take()) is not None:
            if self.error is None:
                try:
                    self._step(data)
                except BaseException as e:  # noqa: BLE001 - raised again in the appending thread
                    self.error = e

    def _take(self) -> bytes | None:
        with self._changed:
            while not self._queued:
                self._changed.wait()
            data = self._queued.popleft()
            self._queued_bytes -= len(data or b"")
            self._changed.notify_all()
        return data

    def put(self, data: bytes | None) -> None:
        """Queue `data` (None: the end), waiting while the queue is full."""
        size = len(data or b"")
        with self._changed:
            while self._queued and (len(self._queued) >= self.QUEUED_FRAMES
                                    or self._queued_bytes + size > self.QUEUED_BYTES):
                self._changed.wait()
            self._queued.append(data)
            self._queued_bytes += size
            self._changed.notify_all()

    def join(self) -> None:
        """Wait until every item put has been through `step`."""
        if self._thread.is_alive():
            self.put(None)
            self._thread.join()


class _Appender:
    """Writes and hashes a shard file's bytes, in order, in two threads of their own.

    The process that appends frames (pack's parent) otherwise writes, hashes and
    receives the next frame one after the other; writing (page-cache allocation in the
    kernel) and SHA-256 release the GIL, so they overlap with receiving, and with each
    other: in one thread the two together were the pack's bottleneck (py-spy: the
    thread busy about 90% of a 4,000-JPEG pack with 2 workers, whose threads waited for
    work 25% of the time, and 7% with a thread each; BENCHMARKS.md, eighteenth
    session). An error (a full disk) is kept and raised by the next `put` or by `close`.

    What waits to be written is bounded in bytes as well as in frames (`_InOrder`): a
    frame holds at least one sample, and a queue of 8 frames alone held 8 images of 20
    MB (160 MB) in pack's parent, where 8 frames of about 1 MB were meant. The hash
    and the write hold the same frames, so the bound holds for both together.
    """

    def __init__(self, file: BinaryIO, digest: "hashlib._Hash"):
        self._stages = (_InOrder(file.write, "shardstream-shard-writer"),
                        _InOrder(digest.update, "shardstream-shard-hasher"))

    @property
    def error(self) -> BaseException | None:
        return next((stage.error for stage in self._stages if stage.error is not None), None)

    def put(self, data: bytes) -> None:
        if (error := self.error) is not None:
            raise error
        for stage in self._stages:
            stage.put(data)

    def close(self) -> None:
        """Wait until everything is written and hashed; raise the error if one happened."""
        for stage in self._stages:
            stage.join()
        if (error := self.error) is not None:
            raise error


@dataclass
class ShardFileWriter:
    """Appends frames to one shard under a temporary name; `finish()` publishes it.

    Nothing is visible under the shard's name until `finish()` has written the whole
    file: locally a rename, remotely a whole-object upload. `abort()` removes the part.
    """

    store: Store
    name: str
    compression: str
    level: int = LEVEL
    _file: object = field(default=None, init=False, repr=False)
    _appender: _Appender | None = field(default=None, init=False, repr=False)
    _tmp: str = field(default="", init=False, repr=False)
    _hash: "hashlib._Hash" = field(default_factory=hashlib.sha256, init=False, repr=False)
    _keys: list[str] = field(default_factory=list, init=False, repr=False)
    _labels: list[int] = field(default_factory=list, init=False, repr=False)
    _weights: list[float] = field(default_factory=list, init=False, repr=False)
    _sample_offsets: list[int] = field(default_factory=lambda: [0], init=False, repr=False)
    _frames: list[tuple[int, int]] = field(default_factory=list, init=False, repr=False)
    _fields: set[str] = field(default_factory=set, init=False, repr=False)

    @property
    def samples(self) -> int:
        return len(self._keys)

    @property
    def keys(self) -> tuple[str, ...]:
        """The keys of the samples appended so far, in order."""
        return tuple(self._keys)

    @property
    def raw_bytes(self) -> int:
        return self._sample_offsets[-1]

    def _write(self, data: bytes) -> None:
        try:
            if self._file is None:
                self._tmp, self._file = scratch_file(self.store, self.name)
                self._appender = _Appender(self._file, self._hash)  # type: ignore[arg-type]
            assert self._appender is not None
            self._appender.put(data)
        except OSError as e:  # disk full, quota, I/O error: name the shard
            raise self._write_error(e) from e

    def _drain(self) -> None:
        try:
            if self._appender is not None:
                self._appender.close()
        except OSError as e:
            raise self._write_error(e) from e

    def _write_error(self, e: OSError) -> StorageError:
        return StorageError(f"could not write: {e.strerror or e}", url=self.store.url(self.name))

    def append(self, frame: Frame) -> None:
        if not frame.keys:
            return
        self._write(frame.data)
        self._frames.append((len(frame.data), frame.raw_size))
        self._keys.extend(frame.keys)
        self._labels.extend(frame.labels or [-1] * len(frame.keys))
        self._weights.extend(frame.weights or [math.nan] * len(frame.keys))
        for size in frame.sizes:
            self._sample_offsets.append(self._sample_offsets[-1] + size)
        self._fields |= frame.fields

    def finish(self) -> ShardInfo:
        """End the archive, write the seek table and the index, publish both."""
        end = tario.END_OF_ARCHIVE
        if self.compression == "zstd":
            tail = _compressor(self.level).compress(end)
            self._write(tail)
            self._frames.append((len(tail), len(end)))
            self._write(seek_table(self._frames))
        else:
            self._write(end)
        self._drain()
        try:
            self._file.close()  # type: ignore[attr-defined]  # flushes: a full disk shows here too
        except OSError as e:
            raise self._write_error(e) from e
        try:
            size = os.path.getsize(self._tmp)
        except FileNotFoundError as e:
            # Removed by another pack's start (`cleanup_scratch` of the shards it writes): a second
            # run of the same pack or part at once, a scheduler's replacement beside the original.
            raise StorageError(f"its file in progress ({shown_name(self._tmp)}) was removed while it was written: "
                               "another run of this pack (or part) began in the same folder? Run one at a time",
                               url=self.store.url(self.name)) from e
        index = self._index(size)
        self.store.put(self._tmp, self.name)
        index_bytes = index.to_bytes()
        index_name = self.name + INDEX_SUFFIX
        self.store.write(index_name, index_bytes)
        return ShardInfo(
            name=self.name,
            samples=len(self._keys),
            bytes=size,
            raw_bytes=self.raw_bytes + len(end),
            sha256=self._hash.hexdigest(),
            index=index_name,
            index_bytes=len(index_bytes),
            index_sha256=hashlib.sha256(index_bytes).hexdigest(),
            fields=tuple(sorted(self._fields)),
        )

    def _index(self, size: int) -> ShardIndex:
        if self.compression == "zstd":
            comp = np.cumsum([0] + [c for c, _ in self._frames[:-1]])
            raw = np.cumsum([0] + [r for _, r in self._frames[:-1]])
        else:
            comp = raw = np.zeros(0, dtype=np.int64)
        return ShardIndex(
            keys=tuple(self._keys),
            labels=label_column(self._labels),
            weights=weight_column(self._weights),
            sample_offsets=np.asarray(self._sample_offsets, dtype=np.int64),
            frame_offsets=comp.astype(np.int64),
            frame_raw_offsets=raw.astype(np.int64),
            compression=self.compression,
            shard_bytes=size,
        )

    def abort(self) -> None:
        """Drop the partial file (on errors and interrupts)."""
        if self._appender is not None:
            try:
                self._appender.close()
            except Exception:  # noqa: BLE001 - the partial file goes anyway; the first error is being raised
                pass
        if self._file is not None:
            self._file.close()  # type: ignore[attr-defined]
            drop_scratch(self._tmp)
