"""Reading shards: sequentially, by ranges of samples, or one sample at a time.

`ShardReader` reads an indexed shard (written by shardstream, `.tar.zst` or `.tar`).
Its one primitive is `read(start, stop)`: the samples [start, stop) of the shard, read
with one storage request per run of frames and one decompression per frame. Iteration,
`reader[i]` and the dataset's plans are all ranges.

Tars written by other tools, without our index, are read front to back by
`tarstream.StreamTarReader`.

Samples are dicts ``{"__key__": key, "__url__": shard url, field: bytes, ...}``. Field
values are `bytes`, deliberately not memoryviews of the decompressed frame: a view
would keep its whole ~1 MB frame alive, and a shuffle buffer of 10,000 samples would
then hold ~10 GB.
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Iterable, Iterator, TypeVar

import numpy as np
import zstandard

from . import tario
from .errors import CorruptIndexError, CorruptShardError, FileSizeError, ShardstreamError, StorageError
from .format import INDEX_SUFFIX, MAX_FRAME_BYTES, ShardIndex, ShardInfo
from .indexes import load_index
from .storage import Store

try:  # the C hot path for cutting samples (setup.py); without it, the same in Python
    from . import _tarcut
except ImportError:  # pragma: no cover - exercised where the extension is not built
    _tarcut = None

#: Whether samples are cut out of shards in C (the `_tarcut` extension is built).
TARCUT = _tarcut is not None

__all__ = ["ShardReader", "Sample"]

Sample = dict[str, object]

MAX_WINDOW = 1 << 27  # zstd window limit: a hostile frame cannot ask for more memory
READ_BYTES = 8 << 20  # compressed bytes fetched per storage request when reading a range
# Local files are read in smaller pieces: a request costs microseconds there, and a
# piece that stays in the CPU cache while it is decompressed and cut into samples
# makes raw reading ~10-20% cheaper than 8 MB pieces do (benchmarks/, BENCHMARKS.md).
LOCAL_READ_BYTES = 2 << 20


def _decompressor() -> zstandard.ZstdDecompressor:
    return zstandard.ZstdDecompressor(max_window_size=MAX_WINDOW)


_local = threading.local()
T = TypeVar("T")


def _per_thread(name: str, make: Callable[[], T]) -> T:
    """This thread's `name`, made on first use: prefetch threads share readers, and
    decompression contexts and read buffers are not for two threads at once."""
    value = getattr(_local, name, None)
    if value is None:
        value = make()
        setattr(_local, name, value)
    return value


def _thread_decompressor() -> zstandard.ZstdDecompressor:
    return _per_thread("dctx", _decompressor)


def _thread_tarcut() -> object:
    """This thread's `_tarcut` context (a zstd context and its reused output buffer)."""
    return _per_thread("tarcut", _tarcut.new_context)


class _PieceBuffers:
    """Read buffers handed from one range read to the next, per thread.

    A fresh 2 MB buffer for every piece costs page faults that showed up in raw
    reading (BENCHMARKS.md); a buffer is lent to one generator at a time, so two
    ranges read interleaved in one thread never share one.
    """

    KEEP = 4  # per thread: more than a thread's readers interleave in practice
    KEEP_BYTES = 4 * LOCAL_READ_BYTES  # a buffer grown for one huge frame is not kept

    def take(self, size: int) -> bytearray:
        free = self._free()
        for j, buffer in enumerate(free):
            if len(buffer) >= size:
                return free.pop(j)
        return bytearray(size)

    def give(self, buffer: bytearray) -> None:
        free = self._free()
        if len(free) < self.KEEP and len(buffer) <= self.KEEP_BYTES:
            free.append(buffer)

    @staticmethod
    def _free() -> list[bytearray]:
        return _per_thread("buffers", list)


_buffers = _PieceBuffers()


class ShardReader:
    """An indexed shard: ``len(reader)``, ``iter(reader)``, ``reader[i]``, ``reader.read(a, b)``.

    `info` (the shard's manifest entry) lets the index be checked against its checksum;
    without it the index is trusted as found. `url` is the shard's name in errors, where
    it is read from a copy (the cache's) of the shard at that URL. Nothing is read until
    first use.
    """

    def __init__(self, store: Store, name: str, info: ShardInfo | None = None, index: ShardIndex | None = None,
                 url: str | None = None):
        self.store = store
        self.name = name
        self.url = url if url is not None else store.url(name)
        self.info = info
        self._index = index
        self._index_error: tuple[ShardstreamError, Any] | None = None  # the failed load, and its traceback
        self._size_checked = False  # a local shard's size against its manifest's, at the first read
        self._lock = threading.Lock()

    @property
    def index(self) -> ShardIndex:
        if self._index is not None:
            return self._index
        with self._lock:  # prefetch threads share readers: load the index once
            if self._index is None:
                # Tried once: a reader is asked by its opener thread, by the planning of its reads
                # and by each read, and each went through every retry again (an index that timed
                # out failed after three times the retry policy's time; under on_error="skip", once
                # a sample). The reader lives an iteration: the next one tries anew.
                if self._index_error is not None:
                    error, trace = self._index_error
                    raise error.with_traceback(trace)
                try:
                    self._index = self._load_index()
                except ShardstreamError as e:
                    self._index_error = (e, e.__traceback__)
                    raise
        return self._index

    def _load_index(self) -> ShardIndex:
        index = load_index(self.store, self.name, self.info)
        # Offsets past the end of the file are corruption, not a read to attempt.
        size = self.info.bytes if self.info is not None else self.store.size(self.name)
        if self.info is None and index.shard_bytes is not None and index.shard_bytes != size:
            # Without a manifest (whose sizes and checksums are checked) nothing else tells: a tar
            # written again with more samples was read as its old samples, the rest left out silently.
            raise CorruptIndexError(
                f"made for a shard of {index.shard_bytes} bytes, where {self.name} is {size} bytes: the shard was "
                "written again since it was indexed, or the index is another shard's (tars indexed in place: "
                "`shardstream index --overwrite` indexes them again)", url=self.store.url(self.name + INDEX_SUFFIX))
        end = int(index.frame_offsets[-1]) if index.compression == "zstd" else int(index.sample_offsets[-1])
        if end > size:
            raise CorruptIndexError(f"index points to byte {end}, past the end of the shard ({size} bytes)",
                                    url=self.store.url(self.info.index if self.info else self.name + INDEX_SUFFIX))
        return index

    def _check_local_size(self, size: int) -> None:
        """A `StorageError` where the local shard has grown past its manifest's `size`:
        written again since (a tar indexed in place that its writer wrote again with more
        samples), its index reads the old samples' places and leaves the rest out, silently.
        One shorter fails as damaged data where a read finds it short (`on_error` applies).
        The direct HTTP(S) and S3 readers see a remote shard's size in every response; this
        stat, at a reader's first read of samples, does it for local ones (not as its index
        is loaded: planning by labels loads every shard's, a stat each on a network disk)."""
        found = self.store.size(self.name)
        if found > size:
            raise StorageError(f"{found} bytes, where its manifest says {size}: written again since the manifest was "
                               "(tars indexed in place: `shardstream index --overwrite` indexes them again)",
                               url=self.url)

    def __len__(self) -> int:
        return len(self.index)

    def __iter__(self) -> Iterator[Sample]:
        return self.read(0, len(self))

    def __getitem__(self, i: int) -> Sample:
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"sample {i} out of range for {self.url} ({n} samples)")
        return next(self.read(i % n, i % n + 1))

    def extent(self, start: int, stop: int) -> tuple[int, int]:
        """The bytes [lo, hi) of the shard file that reading samples [start, stop) fetches."""
        index = self.index
        if index.compression == "zstd":
            return int(index.frame_offsets[index.frame_of(start)]), int(index.frame_offsets[index.frame_of(stop - 1) + 1])
        return int(index.sample_offsets[start]), int(index.sample_offsets[stop])

    def pieces(self, start: int, stop: int, max_bytes: int = READ_BYTES) -> Iterator[tuple[int, int]]:
        """Cut samples [start, stop) into ranges that each fetch at most about `max_bytes` of
        storage and hold at most about `max_bytes` once decompressed.

        Cuts fall only between frames (zstd) or samples (plain tar), so no two ranges
        fetch the same bytes, and with `max_bytes` <= `READ_BYTES` each range is one
        storage request: the unit for prefetching in parallel. Prefetching holds a
        range's samples whole, decompressed: cut by its compressed bytes alone, a range of
        well-compressed samples (arrays of zeros, masks, text) held hundreds of times
        `max_bytes`. One frame larger than `max_bytes` is a range of its own.
        """
        index = self.index
        if start >= stop:
            return
        if index.compression == "zstd":
            comp, raw = index.frame_offsets, index.frame_raw_offsets
            first, last = index.frame_of(start), index.frame_of(stop - 1)
            f = first
            while f <= last:
                g = min(int(np.searchsorted(comp, comp[f] + max_bytes, side="right")),
                        int(np.searchsorted(raw, raw[f] + max_bytes, side="right"))) - 1
                g = min(max(g, f + 1), last + 1)
                # The samples that begin in frames [f, g), clipped to the range.
                a = max(start, int(np.searchsorted(index.sample_offsets, raw[f], side="left")))
                b = min(stop, int(np.searchsorted(index.sample_offsets, raw[g], side="left")))
                if a < b:
                    yield a, b
                f = g
            return
        offsets = index.sample_offsets
        a = start
        while a < stop:
            b = min(max(int(np.searchsorted(offsets, offsets[a] + max_bytes, side="right")) - 1, a + 1), stop)
            yield a, b
            a = b

    def read(self, start: int, stop: int) -> Iterator[Sample]:
        """The samples [start, stop) in order."""
        index = self.index
        if not self._size_checked:
            self._size_checked = True  # said once a reader: `verify` reads on sample by sample after an error
            if self.info is not None and self.store.local:
                self._check_local_size(self.info.bytes)
        if not 0 <= start <= stop <= len(index):
            raise IndexError(f"range [{start}, {stop}) out of bounds for {self.url} ({len(index)} samples)")
        if start == stop:
            return iter(())
        if index.compression == "zstd":
            return self._read_zstd(start, stop)
        return self._read_plain(start, stop)

    # -- uncompressed shards: the tar stream is the file ---------------------------

    def _read_plain(self, start: int, stop: int) -> Iterator[Sample]:
        index = self.index
        offsets = index.sample_offsets
        step = LOCAL_READ_BYTES if self.store.local else READ_BYTES
        buffer = _buffers.take(step) if self.store.local else None
        try:
            a = start
            while a < stop:
                # Fetch a run of whole samples of about READ_BYTES per request.
                b = int(np.searchsorted(offsets, offsets[a] + step, side="right")) - 1
                b = min(max(b, a + 1), stop)
                base = int(offsets[a])
                piece, buffer = self._fetch(base, int(offsets[b]) - base, buffer,
                                            lambda end: index.keys[int(np.searchsorted(offsets, end, "right")) - 1])
                samples = None
                if _tarcut is not None:  # None: a sample in another layout, or a damaged header
                    samples = _tarcut.cut_samples(piece, base, offsets[a : b + 1].tolist(), index.keys[a:b], self.url)
                yield from samples if samples is not None else self._samples(piece, base, a, b, base)
                a = b
        finally:
            if buffer is not None:
                _buffers.give(buffer)

    # -- zstd shards: whole samples per frame ----------------------------------------

    def _read_zstd(self, start: int, stop: int) -> Iterator[Sample]:
        index = self.index
        first, last = index.frame_of(start), index.frame_of(stop - 1)
        comp, raw = index.frame_offsets, index.frame_raw_offsets
        step = LOCAL_READ_BYTES if self.store.local else READ_BYTES
        buffer = _buffers.take(step) if self.store.local else None
        try:
            f = first
            while f <= last:
                # Fetch a run of frames of about READ_BYTES per request.
                g = int(np.searchsorted(comp, comp[f] + step, side="right")) - 1
                g = min(max(g, f + 1), last + 1)
                begin = int(comp[f])
                piece, buffer = self._fetch(begin, int(comp[g]) - begin, buffer, lambda end: index.keys[max(
                    start, int(np.searchsorted(index.sample_offsets, raw[np.searchsorted(comp, end, "right") - 1])))])
                for frame in range(f, g):
                    lo = max(start, int(np.searchsorted(index.sample_offsets, raw[frame], side="left")))
                    hi = min(stop, int(np.searchsorted(index.sample_offsets, raw[frame + 1], side="left")))
                    yield from self._frame_samples(piece[comp[frame] - begin : comp[frame + 1] - begin], frame, lo, hi)
                f = g
        finally:
            if buffer is not None:
                _buffers.give(buffer)

    def _fetch(self, begin: int, size: int, buffer: bytearray | None,
               key_at: Callable[[int], str]) -> tuple[memoryview, bytearray | None]:
        """Bytes [begin, begin + size) of the shard, and the buffer to pass next time.
        `key_at(offset)`: the first sample a shard cut short at `offset` loses, for the error.

        A local file is read into `buffer` (`Store.read_into`; grown for a piece larger
        than it), which the caller reuses piece after piece; a remote one into fresh bytes.
        """
        if buffer is None:
            known = self.info.bytes if self.info is not None else None
            try:
                piece = memoryview(self.store.read(self.name, begin, begin + size, size=known))
            except FileSizeError as e:
                # Named by the first sample it loses where cut short, else by this piece's first (its
                # bytes refused, as another version's). A storage error still, under "skip" too: a
                # shard replaced mid-epoch (packed again to the same place) is not bad samples.
                cut = e.offset if e.offset is not None and begin <= e.offset < begin + size else begin
                raise e.keyed(key_at(cut)) from e
        else:
            if len(buffer) < size:  # one frame or sample larger than a piece
                buffer = bytearray(size)
            piece = memoryview(buffer)[:size]
            piece = piece[: self.store.read_into(self.name, begin, piece)]
        if len(piece) != size:
            end = begin + len(piece)
            raise CorruptShardError("shard is shorter than its index says", url=self.url, key=key_at(end), offset=end)
        return piece, buffer

    def _frame_samples(self, frame: memoryview, i: int, start: int, stop: int) -> Iterable[Sample]:
        """Samples [start, stop) of zstd frame i.

        In C where `_tarcut` is built: the frame is decompressed into a buffer the thread
        reuses and each field copied out of it into its own bytes, about 1.5x faster raw
        reading than below (BENCHMARKS.md). A sample `_tarcut` does not handle sends the
        frame to the Python path, which parses every layout and raises the precise error.
        """
        index = self.index
        expected = self._check_frame(frame, i)
        base = int(index.frame_raw_offsets[i])
        if _tarcut is not None:
            try:
                samples = _tarcut.frame_samples(_thread_tarcut(), frame, expected, base,
                                                index.sample_offsets[start : stop + 1].tolist(),
                                                index.keys[start:stop], self.url)
            except _tarcut.FrameError as e:
                raise CorruptShardError(f"bad zstd frame {i}{self._frame_holds(i)}: {e}", url=self.url,
                                        offset=int(index.frame_offsets[i])) from e
            if samples is not None:
                return samples
        return self._samples(self._decompress(frame, i, expected), base, start, stop, int(index.frame_offsets[i]))

    def _check_frame(self, frame: memoryview, i: int) -> int:
        """Frame i's uncompressed size, once its header agrees with the index and the format."""
        index = self.index
        expected = int(index.frame_raw_offsets[i + 1] - index.frame_raw_offsets[i])
        offset = int(index.frame_offsets[i])
        if expected > MAX_FRAME_BYTES:
            raise CorruptIndexError(f"frame {i} of {expected} bytes exceeds the limit", url=self.url, offset=offset)
        try:
            if not zstandard.get_frame_parameters(frame).has_checksum:
                raise CorruptShardError(f"zstd frame {i} has no content checksum (the format requires one)",
                                        url=self.url, offset=offset)
            declared = zstandard.frame_content_size(frame)
        except zstandard.ZstdError as e:
            raise CorruptShardError(f"bad zstd frame {i}{self._frame_holds(i)}: {e}", url=self.url, offset=offset) from e
        if declared != expected:
            raise CorruptShardError(f"zstd frame {i} declares {declared} bytes, the index {expected}",
                                    url=self.url, offset=offset)
        return expected

    def _frame_holds(self, i: int) -> str:
        """" (samples 'a' to 'b')": the keys frame i holds by the index, for its error (a bad
        frame loses them all, and its error named none)."""
        index = self.index
        raw = index.frame_raw_offsets
        first, stop = np.searchsorted(index.sample_offsets[:-1], [raw[i], raw[i + 1]]).tolist()
        if stop <= first:
            return ""
        keys = index.keys
        return f" (sample {keys[first]!r})" if stop == first + 1 else f" (samples {keys[first]!r} to {keys[stop - 1]!r})"

    def _decompress(self, frame: memoryview, i: int, expected: int) -> bytes:
        """Frame i, whose header `_check_frame` has passed (`expected`: its size), decompressed."""
        offset = int(self.index.frame_offsets[i])
        try:
            data = _thread_decompressor().decompress(frame, max_output_size=expected)
        except zstandard.ZstdError as e:
            raise CorruptShardError(f"bad zstd frame {i}{self._frame_holds(i)}: {e}", url=self.url, offset=offset) from e
        if len(data) != expected:
            raise CorruptShardError(f"zstd frame {i} holds {len(data)} bytes, expected {expected}", url=self.url, offset=offset)
        return data

    def _samples(self, buf: bytes | memoryview, base: int, start: int, stop: int, file_offset: int) -> Iterator[Sample]:
        """Parse samples [start, stop) out of `buf`, which begins at raw offset `base`."""
        index, url = self.index, self.url
        if type(buf) is not bytes:
            buf = bytes(buf)  # slices of bytes are bytes: the fields below
        keys = index.keys
        # Python ints: numpy scalar arithmetic per sample costs more than the parsing.
        offsets = [o - base for o in index.sample_offsets[start : stop + 1].tolist()]
        # zstd frames carry their own checksum, so tar header checksums are re-checked
        # only for uncompressed shards.
        verify = index.compression != "zstd"
        scan = tario.scan_sample
        # The common layout is parsed by `tario.scan_sample`; a sample it does not
        # handle is parsed by `_parse_sample`, which raises the precise error.
        plans: list | None = None
        if verify:
            # Scan the whole buffer first, to check all its header checksums at once.
            plans = [scan(buf, offsets[j], offsets[j + 1], keys[i]) for j, i in enumerate(range(start, stop))]
            headers = [s - tario.BLOCK for plan in plans if plan is not None for _, s, _ in plan]
            if not tario.checksums_ok(buf, headers):
                plans = [None] * len(plans)
        for j, i in enumerate(range(start, stop)):
            plan = plans[j] if plans is not None else scan(buf, offsets[j], offsets[j + 1], keys[i])
            if plan is None:
                yield self._parse_sample(buf, base, i, verify, file_offset)
                continue
            sample: Sample = {"__key__": keys[i], "__url__": url}
            for field, s, e in plan:
                sample[field] = buf[s:e]
            yield sample

    def _parse_sample(self, buf: bytes, base: int, i: int, verify: bool, file_offset: int) -> Sample:
        """Sample i out of `buf` (which begins at raw offset `base`), any layout, or the error."""
        index, url = self.index, self.url
        view = memoryview(buf)
        a, b = int(index.sample_offsets[i]) - base, int(index.sample_offsets[i + 1]) - base
        key = index.keys[i]
        sample: Sample = {"__key__": key, "__url__": url}
        try:
            for name, s, e in tario.iter_members(view[a:b], url=url, base=base + a, verify=verify):
                named = tario.member_key(name)
                if named is None:
                    continue  # no sample's member (`tario.member_key`), as the index skipped it
                if named[0] != key:
                    raise CorruptIndexError(f"index says sample {i} is {key!r}, the shard holds {named[0]!r}",
                                            url=url, key=key, offset=file_offset)
                tario.check_new_field(named[1], sample, url=url, key=key, offset=base + a + s)
                sample[named[1]] = bytes(view[a + s : a + e])
        except CorruptShardError as e:
            raise CorruptShardError(e.detail, url=url, key=key, offset=e.offset) from e
        if len(sample) == 2:
            raise CorruptIndexError(f"sample {i} has no members where the index points", url=url, key=key)
        return sample
