"""Serving a planned order of samples from shards: ranged reads in, reordering out.

The plan (plan.py) says which samples a worker yields and in what order. Reading them
in that order one at a time would cost a storage request per sample; instead the
samples are read in storage order, as runs of consecutive samples (one ranged read per
run of frames), and held until their turn. The plan guarantees that a sample's turn
comes within `buffer` samples of its arrival, which bounds the memory held.
"""

from __future__ import annotations

import logging
import threading
import warnings
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, BinaryIO, Callable, Iterable, Iterator, TypeVar

import numpy as np

from .cache import ShardCache
from .cancel import Cancellation, ReadCancelled
from .errors import (CacheFullError, CorruptIndexError, CorruptShardError, DownloadChecksumError, DownloadStalledError,
                     FileSizeError, ShardstreamError, StorageError)
from .format import SHARD_SUFFIX
from .iostats import counting_here, io_stats
from .pieces import PieceKey, adjacent_repeats, piece_key, planned_pieces, ramp, sample_runs, stretches
from .reader import READ_BYTES, Sample, ShardReader
from .readahead import ReadAhead
from .tarstream import StreamTarReader
from .source import Source

if TYPE_CHECKING:
    from .headstart import HeadStart

log = logging.getLogger("shardstream")

__all__ = ["Readers", "marked", "paired", "read_piece", "read_samples", "read_tolerant", "read_whole", "reorder"]

T = TypeVar("T")
U = TypeVar("U")

OPENERS = 4  # threads that open shards ahead (fetch indexes, or download into the cache)
MAX_AHEAD = 32  # pieces in flight at most, however small


_full_caches: set[str] = set()  # the cache folders this process said had no room
_unmatched_said: set[str] = set()  # the shards this process said it reads by ranges: unmatched, or stalled


def _say_cache_full(root: str, error: CacheFullError) -> None:
    """Once a process and cache: a disk too small for the shards in use (and in flight) is a
    setting to change (a larger disk, fewer workers, smaller shards), not news at every shard."""
    if root not in _full_caches:
        _full_caches.add(root)
        log.warning("%s: shards it cannot keep (no room on its disk or under its limit, or a read-only disk) are "
                    "read uncached, by ranges (the first: %s)", root, error)


class Readers:
    """Shard readers of one iteration, opened once each, from any thread.

    With a cache, opening a shard downloads it (once per machine) and holds a shared
    lock on it until `close()`, so it is not evicted while in use.
    """

    def __init__(self, source: Source, cache: ShardCache | None):
        self.source = source
        self.cache = cache
        self._guard = threading.Lock()
        self._entries: dict[int, list[Any]] = {}
        self._locks: list[BinaryIO] = []
        self._shard_locks: dict[int, BinaryIO] = {}
        self._held: dict[int, BinaryIO] = {}  # see `hold`
        self._released: dict[int, int] = {}  # shard: how many times this iteration let it go
        # Shards whose cached copy was checked again after a read failed (see `heal`): found sound,
        # the failure is the data's own, and a later failure in it should not hash it once more.
        self.rechecked: set[int] = set()

    def get(self, shard: int) -> ShardReader | StreamTarReader:
        entry = self._entry(shard)
        assert entry is not None
        return self._opened(shard, entry)

    def _entry(self, shard: int, opening: int | None = None) -> list[Any] | None:
        """`shard`'s entry, [lock, reader or None, the error its opening raised or None], made
        if absent; for an open ahead of need, for the shard's `opening`-th opening
        (`pieces.Stretch`), None once this iteration let that opening go (told in the same
        turn of the guard as the entry is made: a release between the two would leave the
        shard held)."""
        with self._guard:
            if opening is not None and self._released.get(shard, 0) > opening:
                return None
            return self._entries.setdefault(shard, [threading.Lock(), None, None])

    def _opened(self, shard: int, entry: list[Any]) -> ShardReader | StreamTarReader:
        with entry[0]:
            if entry[2] is not None:
                # An opening ahead of need failed (a download's retries spent): opening again
                # spent them all again, one budget after the other (2 ranks x 2 workers sharing
                # a cache: 30 requests and 43 s where 10 tell). It stands for this iteration.
                raise entry[2]
            if entry[1] is None:
                try:
                    self._open(shard, entry)
                except StorageError as error:
                    if not isinstance(error, ReadCancelled):
                        entry[2] = error
                    raise
            return entry[1]

    def _open(self, shard: int, entry: list[Any]) -> None:
        """Open `shard` into `entry` (with a cache: download it, and keep its lock)."""
        ref = self.source.shards[shard]
        lock = None
        if self.cache is not None and not ref.store.local:
            entry[1], lock = self._cached(shard)
        else:
            entry[1] = self.source.reader(shard)
        if lock is not None:
            with self._guard:
                self._locks.append(lock)
                self._shard_locks[shard] = lock
                held = self._held.pop(shard, None)
                if held is not None:
                    self._locks.remove(held)
            if held is not None:
                held.close()  # this iteration's own lock keeps the copy now

    def _cached(self, shard: int) -> tuple[ShardReader | StreamTarReader, BinaryIO | None]:
        """`shard`'s reader over its cached copy, and the lock that keeps the copy; where the
        cache's disk has no room for the copy, another process's download of it has stopped
        (`cache.STALLED_S`), or the stored zstd file is not the manifest's (its download never
        matched the checksum, or it is of another size: the ranged reads then name the
        first sample it loses), a reader by ranges as without a cache (the
        frames' checksums then deciding which samples are bad: under on_error="skip" they are
        skipped, not the whole run ended), and no lock. A plain tar has no frame checksums:
        read so, its damage would pass as samples."""
        assert self.cache is not None
        ref = self.source.shards[shard]
        try:
            return self.cache.open(ref)
        except CacheFullError as e:  # a disk smaller than the shards in use (and in flight)
            _say_cache_full(self.cache.root, e)
            return self.source.reader(shard), None
        except DownloadStalledError as e:
            if ref.url not in _unmatched_said:
                _unmatched_said.add(ref.url)
                log.warning("%s", e)
            return self.source.reader(shard), None
        except (DownloadChecksumError, FileSizeError) as e:
            if not ref.name.endswith(SHARD_SUFFIX["zstd"]):
                raise
            if ref.url not in _unmatched_said:  # once a process: it is not downloaded again here (cache.py)
                _unmatched_said.add(ref.url)
                log.warning("%s; read uncached, by ranges, its frames' checksums checked", e)
            return self.source.reader(shard), None

    def hold(self, shard: int, lock: BinaryIO) -> None:
        """Keep `lock`, a shared lock on `shard`'s cached copy (a head start's download),
        until this iteration opens the shard itself, or ends: the copy is not evicted
        before it is read."""
        with self._guard:
            self._locks.append(lock)
            self._held[shard] = lock

    def open_ahead(self, shard: int, opening: int = 0) -> None:
        """Open `shard` ahead of need (download it, with a cache; else fetch its index) for
        its `opening`-th opening, unless this iteration already let that one go: an open
        queued behind slow ones can come after the shard was read, and would download it
        again and hold it to the end (or to its next letting go)."""
        entry = self._entry(shard, opening)
        if entry is None:
            return
        reader = self._opened(shard, entry)
        if isinstance(reader, ShardReader):
            reader.index

    def release(self, shard: int) -> None:
        """Done with `shard`: drop its reader and let the cache evict it."""
        with self._guard:
            self._released[shard] = self._released.get(shard, 0) + 1
            entry = self._entries.pop(shard, None)
            lock = self._shard_locks.pop(shard, None)
        if lock is not None:
            lock.close()
            self._locks.remove(lock)
            assert self.cache is not None
            self.cache.trim()  # shards in use may have pushed it over its limit: back under it now
        del entry

    def heal(self, shard: int, damaged: ShardReader | StreamTarReader) -> None:
        """Drop `shard`'s cached copy, which `damaged` (its reader) found damaged on disk after
        it was checked: the next `get` hashes it again, and downloads it again when the hash
        says so. Its lock is held until then (as `hold` holds one), so that the shard is not
        evicted under another thread reading a piece of it; the download does not wait for it
        (cache.py). Where another thread reading a piece of it healed it first, the shard is
        being opened anew already: dropping that entry too would open it twice, and the
        first of the two locks would be held to the end of the iteration."""
        assert self.cache is not None
        with self._guard:
            current = self._entries.get(shard)
            if current is None or current[1] is not damaged:
                return
            self.rechecked.add(shard)
            self.cache.forget(self.source.shards[shard])
            entry = self._entries.pop(shard, None)
            lock = self._shard_locks.pop(shard, None)
            if lock is not None and shard not in self._held:
                self._held[shard] = lock  # `get` lets go of it once it holds the copy anew
        del entry

    def close(self) -> None:
        """Let go of every shard still held (an iteration ended, or stopped early), and trim
        the cache back under its limit, as releasing them one by one would have."""
        with self._guard:
            locks, self._locks = self._locks, []
            self._shard_locks.clear()
            self._held.clear()
        for lock in locks:
            lock.close()
        if locks and self.cache is not None:
            self.cache.trim()


def read_tolerant(reader: ShardReader | StreamTarReader, first: int, stop: int) -> list[Sample]:
    """Samples [first, stop); a sample that cannot be read becomes ``{"__error__": error, ...}``.

    Used under ``on_error="skip"``: the bad sample keeps its place in the plan and the
    error policy decides what to do with it.
    """
    try:
        return list(reader.read(first, stop))
    except StorageError:
        raise  # storage, not the data: never a skip (see policy.py)
    except ShardstreamError:
        pass  # one by one below, outside this handler: else each error's context is this one
    return [sample for i in range(first, stop) for sample in _read_one_tolerant(reader, i)]


def _read_one_tolerant(reader: ShardReader | StreamTarReader, i: int) -> list[Sample]:
    """Sample `i` as `read_tolerant` gives it. A stored error keeps no traceback: its frames
    held the samples it is stored among (a reference cycle), and with them the megabytes of
    the run read, until the cyclic GC ran (8 MB an epoch of 1 MB samples with a bad one)."""
    try:
        return list(reader.read(i, i + 1))
    except StorageError:
        raise
    except ShardstreamError as error:
        # A damaged frame's or shard's error names no sample: the index names the one lost.
        key = error.key or _indexed_key(reader, i)
        if key is not None:
            error = error.keyed(key)
        return [{"__error__": error.with_traceback(None), "__key__": key or f"#{i}", "__url__": reader.url}]


def _indexed_key(reader: ShardReader | StreamTarReader, i: int) -> str | None:
    """Sample `i`'s key by `reader`'s index, where it has one that reads."""
    if not isinstance(reader, ShardReader):
        return None
    try:
        return reader.index.keys[i]
    except (ShardstreamError, IndexError):
        return None


def read_samples(source: Source, ids: np.ndarray, counts: np.ndarray, prefetch: int = 0,
                 cache: ShardCache | None = None, tolerant: bool = False,
                 piece_bytes: int = READ_BYTES, head_start: HeadStart | None = None,
                 next_ids: Callable[[], np.ndarray | None] | None = None) -> Iterator[Sample]:
    """The samples `ids` (global ids), in that order (`_read_samples`). An id repeated in a
    row (`pieces.adjacent_repeats`) is read once, and comes again as a copy of its sample:
    every id gives one item, an unreadable one's error too (`read_tolerant`)."""
    distinct, repeats = adjacent_repeats(ids)
    samples = _read_samples(source, distinct, counts, prefetch, cache, tolerant, piece_bytes, head_start, next_ids)
    return samples if repeats is None else _repeated(samples, repeats)


def _repeated(samples: Iterator[Sample], repeats: np.ndarray) -> Iterator[Sample]:
    """Each of `samples` as many times as `repeats` says, the second and later as shallow
    copies (a transform may change a sample's dict; its values are bytes)."""
    try:
        for sample, times in zip(samples, repeats.tolist()):
            yield sample
            for _ in range(times - 1):
                yield dict(sample)
    finally:
        samples.close()  # type: ignore[attr-defined]


def _read_samples(source: Source, ids: np.ndarray, counts: np.ndarray, prefetch: int = 0,
                  cache: ShardCache | None = None, tolerant: bool = False,
                  piece_bytes: int = READ_BYTES, head_start: HeadStart | None = None,
                  next_ids: Callable[[], np.ndarray | None] | None = None) -> Iterator[Sample]:
    """The samples `ids` (global ids), in that order, read run by run.

    With `prefetch` > 0 (indexed sources), pieces are fetched, decompressed and parsed
    ahead by background threads while the caller works on the current one: `prefetch`
    pieces, or more while they are small, up to half of `prefetch` full pieces' bytes
    (fetched, or held decompressed where those are more) and `MAX_AHEAD` pieces (a
    resume reads scattered single frames, whose cost is the request's latency, not its
    bytes); for remote shards that budget of bytes doubles each time the caller has to
    wait for a piece, up to four times its start (readahead.py). With a `cache` the next `prefetch`
    shards are downloaded ahead: storage latency then overlaps decoding. A piece is one
    storage request of at most about `piece_bytes`, cut between frames
    (`ShardReader.pieces`), so no two pieces fetch the same frame, and holds at most
    about `piece_bytes` of samples decompressed (or one frame, where that is larger);
    the next shards' indexes are fetched while the current shard is read. The threads start with the iteration and are joined when it
    ends or is closed.

    With a `head_start` (headstart.py), the pieces it read ahead are used where this
    iteration plans the same ones (with a cache: the shard it downloaded is held until
    this iteration opens it). With `next_ids` as well, once every read of this iteration
    is in, the head start begins on the next iteration, the one that reads `next_ids()`.
    """
    readers = Readers(source, cache)
    runs = list(sample_runs(ids, counts))
    read = read_tolerant if tolerant else read_whole
    try:
        planned = stretches(runs)
        if prefetch <= 0 or not source.indexed:
            for shard, stretch, final, _ in planned:
                for first, stop in stretch:
                    yield from _read_healing(read, readers, shard, first, stop)
                if final:
                    readers.release(shard)
            return
        # Openings of shards (a shard, opened again after it was let go), in reading order.
        upcoming = list(dict.fromkeys((shard, opening) for shard, _, _, opening in planned))
        place_of = {opening: i for i, opening in enumerate(upcoming)}
        read_here = {shard for shard, _ in upcoming}
        # Shards are opened (with a cache: downloaded; without: their index fetched) up to
        # `prefetch` places ahead, in threads of their own: an index fetch queued behind
        # pieces would hold up planning the next shard's pieces by a whole piece transfer,
        # and a resume, whose first batch draws on many shards, would fetch their indexes
        # one at a time.
        # Remote shards' window grows while this reader waits for storage (readahead.py).
        window = ReadAhead.start(prefetch, piece_bytes, MAX_AHEAD, remote=not source.local)
        # Reads still running when the iteration stops are cancelled (cancel.py): else leaving
        # the pools waits for them, through their retries' backoff when storage is failing.
        cancellation = Cancellation()
        counting = counting_here()  # the pools' reads count where this iteration's do (iostats.py)

        def bind() -> None:
            cancellation.bind()
            counting()

        with ThreadPoolExecutor(max_workers=max(prefetch, MAX_AHEAD), thread_name_prefix="shardstream-prefetch",
                                initializer=bind) as pool, \
                ThreadPoolExecutor(max_workers=min(prefetch, OPENERS), thread_name_prefix="shardstream-open",
                                   initializer=bind) as openers:
            ahead: deque[tuple[int, bool, int, Future[list[Sample]]]] = deque()
            ahead_bytes = opened = 0

            def open_ahead(position: int) -> None:
                nonlocal opened
                while opened < len(upcoming) and opened <= position + prefetch:
                    openers.submit(readers.open_ahead, *upcoming[opened])
                    opened += 1

            def finish_one(window_full: bool = False) -> list[Sample]:
                nonlocal ahead_bytes
                shard, last, size, future = ahead.popleft()
                ahead_bytes -= size
                if window_full and window.took(future.done()):
                    io_stats.add(readahead_waits=1)
                samples = future.result()
                if last:
                    readers.release(shard)
                return samples

            def begin_next() -> None:
                nonlocal next_ids
                if next_ids is not None and head_start is not None and all(f.done() for *_, f in ahead):
                    head_start.begin(source, next_ids, counts, prefetch, tolerant, piece_bytes, cache)
                    next_ids = None

            taken: dict[PieceKey, Future[list[Sample]]] = {}
            if head_start is not None:
                taken, held = head_start.take()
                for shard, lock in held.items():
                    if shard in read_here:
                        readers.hold(shard, lock)
                    else:  # another epoch than foreseen: not this iteration's, nothing to keep it for
                        lock.close()
            sizes = ramp(piece_bytes)
            try:
                for shard, stretch, final, opening in planned:
                    # With a cache, planning a shard's pieces downloads it and holds it: plan one
                    # shard at a time, so that only the `prefetch` shards `open_ahead` downloads
                    # are held beside it (its pieces are local reads, quick to have in turn).
                    while cache is not None and any(s != shard for s, *_ in ahead):
                        yield from finish_one()
                    open_ahead(place_of[shard, opening])
                    for a, b, keep, last, size in planned_pieces(readers.get(shard), stretch, sizes):
                        future = _taken(taken, piece_key(shard, a, b, keep, tolerant))
                        if future is None:
                            future = pool.submit(read_piece, read, readers, shard, a, b, keep)
                        ahead.append((shard, final and last, size, future))
                        ahead_bytes += size
                        while window.full(len(ahead), ahead_bytes):
                            yield from finish_one(window_full=True)
                while ahead:
                    samples = finish_one()
                    begin_next()  # the link is idle once this iteration's reads are in; and
                    yield from samples  # the consumer may stop asking after the last sample
                begin_next()
            finally:
                for *_, future in ahead:
                    future.cancel()
                _drop(taken)
                openers.shutdown(wait=False, cancel_futures=True)  # downloads not yet started
                cancellation.cancel()  # and those running, at their next request or backoff
    finally:
        readers.close()


def _taken(taken: dict[PieceKey, Future[list[Sample]]], key: PieceKey) -> Future[list[Sample]] | None:
    """The head start's read of the piece `key` if it has one that has not failed; the
    first piece it has not read ends the head start (a wrong guess, or the end of the
    window), and what else it read is dropped."""
    future = taken.pop(key, None)
    if future is None:
        _drop(taken)
        return None
    if future.cancelled() or (future.done() and future.exception() is not None):
        return None  # read again: the head start's error may have been transient
    return future


def _drop(taken: dict[PieceKey, Future[list[Sample]]]) -> None:
    for future in taken.values():
        future.cancel()
    taken.clear()


def read_piece(read: Any, readers: Readers, shard: int, a: int, b: int, keep: np.ndarray | None) -> list[Sample]:
    samples = list(_read_healing(read, readers, shard, a, b))
    return samples if keep is None else [s for s, k in zip(samples, keep.tolist()) if k]


def _read_healing(read: Any, readers: Readers, shard: int, a: int, b: int) -> Iterator[Sample]:
    """Samples [a, b) of `shard` by `read`. A cached copy is hashed once per process and
    then trusted; one damaged on disk after that fails its frame checksums here (or one
    removed, its reads), and is then checked and downloaded again before `read` goes on:
    it is not the data's fault, so no error policy should see it. Once an iteration: after that, the copy found
    sound, a failure is the data's."""
    if readers.cache is None or readers.source.shards[shard].store.local or shard in readers.rechecked:
        # Checked again already this iteration: a shard whose data is bad (under on_error="skip",
        # a frame in every piece) was hashed whole once per bad piece, minutes for a large one.
        yield from read(readers.get(shard), a, b)
        return
    done = 0
    reader = readers.get(shard)  # opening finds no damage: the copy is hashed (or trusted) there, read here
    try:
        for sample in read_whole(reader, a, b):
            yield sample
            done += 1
        return
    except (CorruptShardError, CorruptIndexError):
        readers.heal(shard, reader)
    except StorageError as e:
        # The copy is gone (a cleaner of old files in /tmp, a user emptying the cache): it is
        # downloaded again, as a damaged one is.
        if e.detail != "file not found":
            raise
        readers.heal(shard, reader)
    yield from read(readers.get(shard), a + done, b)


def read_whole(reader: ShardReader | StreamTarReader, first: int, stop: int) -> Iterator[Sample]:
    return reader.read(first, stop)


def paired(first: Iterable[T], second: Iterable[U]) -> Iterator[tuple[T, U]]:
    """``zip(first, second)`` without holding the last pair while the next is made: zip reuses its
    tuple, keeping the last items in it until they are replaced (a sample of hundreds of MB)."""
    second = iter(second)
    for a in first:
        try:
            b = next(second)
        except StopIteration:
            return
        yield a, b
        a = b = None  # type: ignore[assignment]


def marked(samples: Iterable[Sample], repeats: Iterable[bool]) -> Iterator[Sample]:
    """Each sample with ``__pad__``: whether it repeats a sample delivered first elsewhere
    (`plan.repeated_positions`). Each is a dict of its own (`_repeated` copies), so set in place."""
    repeats = iter(repeats)
    for sample in samples:  # not zip, whose tuple holds the last sample while the next is made
        sample["__pad__"] = next(repeats)
        yield sample
        sample = None


def reorder(arrivals: Iterable[tuple[int, Sample]], order: np.ndarray) -> Iterator[Sample]:
    """Yield samples in `order` (positions) from (position, sample) pairs arriving in another order.
    What is held meanwhile is the shuffle buffer: looked at as it doubles from 256 samples
    (`_warn_of_a_large_buffer`)."""
    held: dict[int, Sample] = {}
    look_at = 256
    arriving = iter(arrivals)
    for position in order.tolist():
        while position not in held:
            try:
                p, sample = next(arriving)
            except StopIteration:
                raise RuntimeError(f"plan error: position {position} never arrived") from None
            held[p] = sample
            sample = None  # held in `held` only: the next arrival is made without it
            if len(held) >= look_at:
                look_at *= 2
                _warn_of_a_large_buffer(held)
        yield held.pop(position)


BUFFER_WARN_BYTES = 2 << 30  # a shuffle buffer's bytes in one process past which it is warned of
_buffer_warned = False  # once a process: each DataLoader worker says it of its own buffer


def _warn_of_a_large_buffer(held: dict[int, Sample]) -> None:
    """Warn, once a process, where the shuffle buffer holds more than BUFFER_WARN_BYTES: its
    default of 2,048 samples is 220 MB of ImageNet's JPEGs, and a worker's whole share of a
    dataset of volumes or clips (2.25 GB in a walk with 2 GB of them), in each worker."""
    global _buffer_warned
    if _buffer_warned:
        return
    size = sum(len(value) for sample in held.values() for value in sample.values()
               if isinstance(value, (bytes, bytearray, memoryview)))
    if size > BUFFER_WARN_BYTES:
        _buffer_warned = True
        warnings.warn(f"the shuffle buffer holds {len(held):,} samples, {size / 2**30:.1f} GiB, in this process (each "
                      "DataLoader worker holds its own): its memory is about shuffle_buffer x the samples' size; lower "
                      "shuffle_buffer for samples this large", stacklevel=3)
