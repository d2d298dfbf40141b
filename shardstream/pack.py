"""`pack`: an image folder or a file list into shards, in parallel, reproducibly.

The work is planned before it starts, from the file listing and file sizes alone:
the sorted listing is shuffled with `seed`, cut into shards of about `shard_size`
bytes, and each shard into frames of about `frame_size`. A frame (a few images) is
the unit of parallel work: workers read, check and compress frames, and the caller
appends them in order. The output therefore depends only on the input and the
options, never on `workers`, and parallelism does not need many shards.

The workers are threads when the images are large (a mean of `THREADS_FROM_BYTES`
or more): reading, zstd, SHA-256 and writing release the GIL, and no frame then
crosses a pipe. They are processes when the images are small, where the per-image
Python work (about 50 µs) would hold the GIL for most of the time (BENCHMARKS.md).

Nothing is lost silently: every file of the source is packed, skipped with a reason
(recorded in the manifest), or counted as not an image. An image is stored under the
field its file name gives, byte for byte: where the name lies about a format pack
stores (ImageNet's PNG named .JPEG), the bytes stay what they are, and the summary
lists each such file.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import io
import multiprocessing
import multiprocessing.connection
import os
import queue
import struct
import threading
import time
import warnings
from dataclasses import dataclass, field
from multiprocessing.pool import ExceptionWithTraceback, MaybeEncodingError
from multiprocessing.reduction import ForkingPickler
from typing import Any, Callable, Iterator

try:
    import fcntl
except ImportError:  # not POSIX
    fcntl = None  # type: ignore[assignment]

import numpy as np
from PIL import Image

from . import tario
from .decode import image_size, is_jpeg
from .errors import PackError, ShardstreamError, reason
from .format import INDEX_SUFFIX, MANIFEST_NAME, Manifest, ShardInfo
from .journal import Journal
from .listing import Listing, SourceFile, list_source, printable, sniff_image
from .parts import other_packs
from .shardfile import FRAME_SIZE, IMAGE_LEVEL, Frame, ShardFileWriter, build_frame
from .shrink import DEFAULT_QUALITY, shrink_or_keep, shrunk_size
from .storage import Store
from .threads import ordered_map
from .writer import check_compression, parse_size, shard_name, write_manifest

__all__ = ["pack", "PackSummary", "check_image"]

ON_ERROR = ("fail", "skip")


@dataclass(frozen=True)
class PackOptions:
    """What decides the bytes of the output (recorded in the manifest)."""

    shard_size: int
    max_samples: int | None
    compression: str
    level: int
    seed: int
    shuffle: bool
    frame_size: int
    prefix: str
    max_side: int | None = None  # shrink larger images (shrink.py); None keeps every file's bytes
    quality: int = DEFAULT_QUALITY  # of images shrunk to JPEG or WebP

    def as_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


@dataclass
class PackSummary:
    """What a pack did.

    `misnamed` lists (file, format) for each image whose content is another stored
    format than its name says (``"PNG"`` for a PNG named .jpg): it is stored as named,
    under the field of its name (`jpg`), byte for byte, so that ``fields=("jpg", "cls")``
    finds every sample. Readers that tell the format from the bytes (shardstream's
    decoders, Pillow) read it; JPEG-only decoders (nvJPEG, DALI's JPEG path) refuse it.
    One that `max_side` shrank is encoded in its field's format and is not listed.
    `kept_whole` lists (file, why) for each image larger than `max_side` that kept its
    bytes (``"animated"``). Both cover, as `bytes_in` does, the shards this run packed:
    a resumed pack does not see the earlier run's, nor does a finished pack's rerun. The
    manifest records what was skipped.
    """

    samples: int
    shards: int
    bytes_in: int
    bytes_out: int
    seconds: float
    skipped: list[tuple[str, str]] = field(default_factory=list)
    ignored: int = 0
    misnamed: list[tuple[str, str]] = field(default_factory=list)
    kept_whole: list[tuple[str, str]] = field(default_factory=list)

    def __str__(self) -> str:
        rate = self.samples / self.seconds if self.seconds else 0.0
        lines = [
            f"packed {self.samples} samples into {self.shards} shards in {self.seconds:.2f} s ({rate:,.0f} img/s)",
            f"bytes in {self.bytes_in / 1e6:,.1f} MB, out {self.bytes_out / 1e6:,.1f} MB",
            f"skipped {len(self.skipped)}, not images {self.ignored}",
        ]
        lines += [f"  skipped {path}: {reason}" for path, reason in self.skipped]
        if self.misnamed:
            lines.append(f"content differs from its name: {len(self.misnamed)}, stored as named: shardstream's "
                         "decoders read them, JPEG-only decoders (nvJPEG, DALI's JPEG path) refuse them")
            lines += [f"  {path} is {kind}" for path, kind in self.misnamed]
        if self.kept_whole:
            lines.append(f"kept whole, larger than max_side: {len(self.kept_whole)}")
            lines += [f"  kept whole {path}: {why}" for path, why in self.kept_whole]
        return "\n".join(lines)


# -- checking images ------------------------------------------------------------------


# JPEG markers that start a frame (SOF0-15 less DHT, JPG and DAC), and that stand alone.
_SOF = frozenset(range(0xC0, 0xD0)) - {0xC4, 0xC8, 0xCC}
_STANDALONE = frozenset([0x01, *range(0xD0, 0xD8)])


def _plain_jpeg(data: bytes) -> bool:
    """True if `data` is a JPEG whose header segments are whole, with a sane frame size, ending with EOI.

    The fast path of `check_image`, for the common case: walking the segment headers
    up to the start of scan costs about 10 µs, where `Image.open` costs 150-275 µs,
    a quarter of the whole per-image cost of packing (measured with cProfile on 110 KB
    JPEGs). It only ever says yes; anything unusual goes to Pillow, which then gives
    the error (or accepts what this walk is too strict for).
    """
    if not is_jpeg(data) or b"\xff\xd9" not in data[-64:]:
        return False
    pos, end, frame = 2, len(data), False
    while pos + 4 <= end:
        if data[pos] != 0xFF:
            return False
        marker = data[pos + 1]
        if marker == 0xFF:  # fill byte
            pos += 1
            continue
        if marker in _STANDALONE:
            pos += 2
            continue
        if marker < 0xC0 or marker in (0xD8, 0xD9):  # not a segment Pillow knows, or SOI/EOI mid-header
            return False
        length = data[pos + 2] << 8 | data[pos + 3]
        if length < 2 or pos + 2 + length > end:
            return False
        if marker in _SOF:
            if frame or length < 8:
                return False
            bits, height, width, components = struct.unpack_from(">BHHB", data, pos + 4)
            if (bits != 8 or components not in (1, 3, 4) or length != 8 + 3 * components
                    or not 0 < width * height <= (Image.MAX_IMAGE_PIXELS or 1 << 62)):
                return False
            frame = True
        elif marker == 0xDB and not _whole_tables(data, pos + 4, pos + 2 + length):
            return False
        elif marker == 0xDA:  # start of scan: the header is over
            return frame
        pos += 2 + length
    return False


def _whole_tables(data: bytes, start: int, end: int) -> bool:
    """A DQT segment's body is whole quantization tables (64 entries of 1 or 2 bytes each)."""
    while start < end:
        start += 1 + 64 * (1 if data[start] >> 4 == 0 else 2)
    return start == end


def check_image(data: bytes, path: str) -> str:
    """The field of `data`'s true format (``"jpg"``, ``"png"`` or ``"webp"``), whatever
    the name of its file says (`pack` stores it under its name's field all the same, and
    reports a difference); raise PackError unless it is a readable, complete image in
    one of these formats.

    Cheap by design (a full decode would cost more than the rest of packing): the format
    is told from the first bytes, the header is parsed, PNG chunk checksums verified, and
    a JPEG that does not end with its end-of-image marker is fully decoded to tell
    truncation from trailing bytes. `verify` does the full decode of every image.
    """
    kind, name = sniff_image(data)
    if kind is None:
        if name is None:
            raise PackError("not a readable image: unknown or damaged format", url=path)
        # Pillow would read a GIF or a BMP, but the fields pack writes hold JPEG, PNG and WebP only.
        raise PackError(f"a {name} image: pack stores JPEG, PNG and WebP only", url=path)
    if kind == "jpg" and _plain_jpeg(data):
        return kind
    try:
        with Image.open(io.BytesIO(data)) as image:
            _within_bomb_limit(image.size)
            if image.format == "JPEG":
                if b"\xff\xd9" not in data[-64:]:
                    image.load()
            elif image.format == "PNG":
                image.verify()
            else:
                image.load()
    except Image.UnidentifiedImageError as e:
        raise PackError("not a readable image: unknown or damaged format", url=path) from e
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError, Image.DecompressionBombWarning) as e:
        # The reason goes into the manifest, which must be reproducible.
        raise PackError(f"not a readable image: {reason(e)}", url=path) from e
    return kind


def _within_bomb_limit(size: tuple[int, int]) -> None:
    # What Pillow warns about (DecompressionBombWarning) as an error, in Pillow's words,
    # without changing the warning filters, which threads share (`pack` turns the
    # warning itself into an error for its whole run, see `_bomb_warnings_raise`).
    pixels, limit = size[0] * size[1], Image.MAX_IMAGE_PIXELS
    if limit is not None and pixels > limit:
        raise Image.DecompressionBombWarning(
            f"Image size ({pixels} pixels) exceeds limit of {limit} pixels, could be decompression bomb DOS attack.")


# -- planning ---------------------------------------------------------------------------


def _estimated_size(entry: SourceFile, file_bytes: int | None = None) -> int:
    # The planner needs only a deterministic size, not the exact tar layout.
    file_bytes = entry.size if file_bytes is None else file_bytes
    return tario.BLOCK + tario.padded(file_bytes) + (2 * tario.BLOCK if entry.label is not None else 0)


def shrunk_estimates(entries: list[SourceFile], root: str, max_side: int) -> dict[str, int]:
    """Each file's expected size after shrinking to `max_side`, for planning only.

    The file's size scaled by the share of pixels kept, from the image header (the
    first 64 KB). Unreadable headers count at full size: the work step reports them.
    """
    estimates = {}
    for entry in entries:
        try:
            with open(os.path.join(root, entry.path), "rb") as f:
                size = image_size(f.read(1 << 16))
        except Exception:  # noqa: BLE001 - any failure means: plan it at its full size
            continue
        width, height = shrunk_size(size, max_side)
        estimates[entry.path] = max(1, entry.size * width * height // max(1, size[0] * size[1]))
    return estimates


def plan_frames(entries: list[SourceFile], opts: PackOptions,
                file_bytes: dict[str, int] | None = None) -> list[tuple[int, list[SourceFile]]]:
    """Cut the ordered entries into (shard number, frame entries) jobs.

    `file_bytes` overrides the expected size of some files (those that will shrink).
    """
    jobs: list[tuple[int, list[SourceFile]]] = []
    shard, shard_bytes, shard_count = 0, 0, 0
    frame: list[SourceFile] = []
    frame_bytes = 0
    for entry in entries:
        size = _estimated_size(entry, (file_bytes or {}).get(entry.path))
        full = shard_count and (
            shard_bytes + size > opts.shard_size or (opts.max_samples is not None and shard_count >= opts.max_samples)
        )
        if full:
            if frame:
                jobs.append((shard, frame))
            shard, shard_bytes, shard_count, frame, frame_bytes = shard + 1, 0, 0, [], 0
        frame.append(entry)
        frame_bytes += size
        shard_bytes += size
        shard_count += 1
        if frame_bytes >= opts.frame_size:
            jobs.append((shard, frame))
            frame, frame_bytes = [], 0
    if frame:
        jobs.append((shard, frame))
    return jobs


def _siblings_shard(part: tuple[int, int] | None) -> Callable[[str], bool]:
    """Whether a shard name is another part's of this pack (of the same number of parts),
    which that part, perhaps at work at once with this one (Ray), writes and must keep."""
    if part is None:
        return lambda name: False
    others = tuple(f"shard-p{i:05d}-" for i in range(part[1]) if i != part[0])
    return lambda name: name.startswith(others)


def _remove_dataset(store: Store, manifest_name: str, keep: Callable[[str], bool] = lambda name: False) -> None:
    """Remove a dataset's manifest first (so a crash cannot leave it listing replaced
    shards), then the shards and indexes it listed (but those `keep` says), so no stale
    shard stays behind."""
    try:
        old = Manifest.from_bytes(store.read(manifest_name), store.url(manifest_name))
    except ShardstreamError:
        old = None
    store.remove(manifest_name)
    if old is not None:
        for shard in old.shards:
            if keep(shard.name):
                continue
            store.remove(shard.name)
            store.remove(shard.index)


def _clear_other_packs(store: Store, part: tuple[int, int] | None, *, overwrite: bool, finished_part: bool) -> None:
    """Refuse (or, with `overwrite`, remove) what another pack left in `store` that this one
    would overwrite or mix with (`parts.other_packs`): a part's shard names do not say how
    many parts there are, so part 0 of 3 would overwrite part 0 of 2's shards."""
    manifests, shards = other_packs(store, None if part is None else part[1])
    # The merge of this very pack's parts: still true for a finished part's no-op rerun,
    # stale once a part is packed again (the last part to finish merges anew).
    stale_merge = (part is not None and not finished_part and MANIFEST_NAME not in manifests
                   and store.exists(MANIFEST_NAME))
    found = ([MANIFEST_NAME] if stale_merge else []) + manifests + shards
    if not found:
        return
    if not overwrite:
        this = "a single pack" if part is None else f"part {part[0]} of {part[1]}"
        listed = ", ".join(found[:4]) + (f" and {len(found) - 4} more" if len(found) > 4 else "")
        raise ShardstreamError(f"already holds another pack ({listed}), which {this} would overwrite or mix with; "
                               "pass overwrite=True (--overwrite) to replace it", url=store.root)
    if stale_merge:
        store.remove(MANIFEST_NAME)  # its shards are this pack's other parts: they stay
    for name in manifests:
        _remove_dataset(store, name, keep=_siblings_shard(part))
    for name in shards:
        store.remove(name)
        store.remove(name + INDEX_SUFFIX)


def part_manifest_name(index: int, parts: int) -> str:
    return f"manifest.part-{index:05d}-of-{parts:05d}.msgpack"


def part_slice(entries: list[SourceFile], index: int, parts: int) -> list[SourceFile]:
    """The index-th of `parts` contiguous slices of the (already shuffled) sample order."""
    n = len(entries)
    return entries[index * n // parts : (index + 1) * n // parts]


def _modified_stamp(root: str, entries: list[SourceFile]) -> str:
    """A digest of the files' modification times, for `--resume` to refuse a source whose
    files changed in place (one stat a file; parts do not compare it: their copies of the
    source may be made at other times)."""
    digest = hashlib.sha256()
    for e in entries:
        try:
            stamp = os.stat(os.path.join(root, e.path)).st_mtime_ns
        except OSError:
            stamp = -1  # unreadable: packing reports it under the error policy
        digest.update(f"{stamp}\n".encode())
    return digest.hexdigest()


def listing_fingerprint(entries: list[SourceFile]) -> str:
    """Identifies the ordered input, so that parts and resumes can check they agree."""
    digest = hashlib.sha256()
    for e in entries:
        # surrogateescape: a file name that is not UTF-8 is skipped later, not an error here
        digest.update(f"{e.path}\0{e.size}\0{e.label}\n".encode("utf-8", "surrogateescape"))
    return digest.hexdigest()


def order(listing: Listing, opts: PackOptions) -> list[SourceFile]:
    """The sample order: sorted by path, then shuffled by `seed` unless told not to."""
    entries = sorted(listing.files, key=lambda e: e.path)
    if opts.shuffle:
        perm = np.random.default_rng(opts.seed).permutation(len(entries))
        entries = [entries[i] for i in perm]
    return entries


# -- the work of one frame (runs in the workers) ------------------------------------------------


# The Pillow format of each image field, that a shrunk image is encoded in.
_PILLOW_FORMATS = {"jpg": "JPEG", "png": "PNG", "webp": "WEBP"}


@dataclass
class FrameResult:
    shard: int
    frame: Frame
    skipped: list[tuple[str, str]]
    bytes_in: int
    misnamed: list[tuple[str, str]] = field(default_factory=list)  # as PackSummary's
    kept_whole: list[tuple[str, str]] = field(default_factory=list)


def build_job(job: tuple[int, list[SourceFile], str, PackOptions, bool]) -> FrameResult:
    shard, entries, root, opts, skip = job
    samples, skipped, bytes_in = [], [], 0
    misnamed: list[tuple[str, str]] = []
    kept_whole: list[tuple[str, str]] = []
    for entry in entries:
        path = os.path.join(root, entry.path)
        try:
            if printable(entry.path) != entry.path:  # its key could not be written into a tar
                raise PackError("file name is not UTF-8", url=printable(path))
            with open(path, "rb") as f:
                data = f.read()
            kind = check_image(data, path)
            read = len(data)
            kept = None
            if opts.max_side is not None:
                # Encoded again, if at all, in the format of its field: then the field tells the truth.
                data, kept = shrink_or_keep(data, opts.max_side, opts.quality, path=path,
                                            as_format=_PILLOW_FORMATS[entry.field])
        except (OSError, PackError) as e:
            # The manifest records the reason, which must be reproducible: no absolute path.
            why = e.detail if isinstance(e, PackError) else f"unreadable: {reason(e)}"
            if not skip:
                raise PackError(why, url=printable(path)) from None
            skipped.append((printable(entry.path), why))
            continue
        bytes_in += read
        if kind != entry.field:  # the name lies: stored as named all the same, and reported unless shrunk
            stored, name = sniff_image(data)
            if stored != entry.field:
                misnamed.append((entry.path, name or kind))
        if kept is not None:
            kept_whole.append((entry.path, kept))
        fields = [(entry.field, data)]
        if entry.label is not None:
            fields.append(("cls", str(entry.label).encode("ascii")))
        samples.append((entry.key, sorted(fields)))
    return FrameResult(shard, build_frame(samples, opts.compression, opts.level), skipped, bytes_in, misnamed,
                       kept_whole)


def _pool_context() -> multiprocessing.context.BaseContext:
    # fork starts in milliseconds, but forking a process that runs threads can deadlock
    # the child; fall back to forkserver then (and on platforms without fork).
    methods = multiprocessing.get_all_start_methods()
    if "fork" in methods and threading.active_count() == 1:
        return multiprocessing.get_context("fork")
    return multiprocessing.get_context("forkserver" if "forkserver" in methods else "spawn")


# Threads pay from this mean image size up: measured on 4,000 JPEGs each (2 workers),
# threads took 0.83-0.89 s against 1.04-1.33 s for processes at 114 KB, broke even at
# 29 KB, and took twice as long at 2 KB (0.28-0.34 s against 0.15-0.16 s).
THREADS_FROM_BYTES = 64 << 10


def threads_pay(entries: list[SourceFile]) -> bool:
    """Whether threads beat processes as workers for these files: large images (see the module doc)."""
    return bool(entries) and sum(entry.size for entry in entries) >= THREADS_FROM_BYTES * len(entries)


def _thread_results(jobs: list[Any], workers: int) -> Iterator[FrameResult]:
    """`build_job` over `jobs` in `workers` threads, results in plan order; a job's
    exception is raised at its place in that order."""
    with contextlib.closing(ordered_map(build_job, jobs, workers, name="shardstream-pack")) as futures:
        for future in futures:
            yield future.result()


def _process_results(jobs: list[Any], workers: int, context: multiprocessing.context.BaseContext
                     ) -> Iterator[FrameResult]:
    pool = _FramePool(jobs, workers, context)
    try:
        yield from pool
        pool.close(wait=True)
    finally:
        pool.close(wait=False)


class _FramePool:
    """Worker processes that build frames; their results in plan order.

    Like `Pool.imap(build_job, jobs, chunksize=1)`: jobs go to whichever worker is free
    (at most `DEPTH` queued per worker), results come back in plan order, and a worker's
    exception is re-raised in the parent at its job's place in that order. Results that
    arrive early wait in the parent, and no job more than `window` ahead of the next one
    due is handed out, which bounds the memory that a slow worker can make the others
    hold up.

    Not `multiprocessing.Pool`: its worker-handler thread wakes up whenever a result
    waits in the result pipe, which with results of ~1 MB is nearly always, and then
    burns about as much CPU as a worker (tens of thousands of wake-ups per 4,000 images;
    BENCHMARKS.md). Here the parent sleeps in `connection.wait` until a result is there.
    """

    DEPTH = 2  # jobs sent to a worker and not yet answered

    def __init__(self, jobs: list[Any], workers: int, context: multiprocessing.context.BaseContext):
        self.jobs = jobs
        self.window = 4 * workers
        self.procs: list[Any] = []
        self.tasks: list[Any] = []  # parent -> worker: (job number, job)
        self.results: list[Any] = []  # worker -> parent
        try:
            for w in range(workers):
                task_recv, task_send = context.Pipe(duplex=False)
                result_recv, result_send = context.Pipe(duplex=False)
                _grow_pipe(result_send.fileno())
                proc = context.Process(target=_frame_worker, args=(task_recv, result_send), daemon=True,
                                       name=f"shardstream-pack-{w}")
                proc.start()
                task_recv.close()
                result_send.close()
                self.procs.append(proc)
                self.tasks.append(task_send)
                self.results.append(result_recv)
        except BaseException:
            self.close(wait=False)
            raise

    def __iter__(self) -> Iterator[FrameResult]:
        count, workers = len(self.jobs), len(self.procs)
        outstanding = [0] * workers
        early: dict[int, Any] = {}  # job number -> FrameResult, or the exception to raise there
        next_job = next_due = 0
        failed_at = count  # no job at or after a failed one is sent

        def top_up() -> None:
            nonlocal next_job
            for w in range(workers):
                while (outstanding[w] < self.DEPTH and next_job < min(count, failed_at)
                       and next_job < next_due + self.window):
                    self.tasks[w].send((next_job, self.jobs[next_job]))
                    outstanding[w] += 1
                    next_job += 1

        top_up()
        while next_due < count:
            if next_due in early:
                result = early.pop(next_due)
                if isinstance(result, BaseException):
                    raise result
                next_due += 1
                top_up()
                yield result
                continue
            for conn in multiprocessing.connection.wait(self.results):
                w = self.results.index(conn)
                try:
                    message = conn.recv()
                    if message[0] == "error":
                        _, i, error = message
                        early[i], failed_at = error, min(failed_at, i)
                    else:
                        _, i, frame_fields, result_fields = message
                        early[i] = FrameResult(frame=Frame(data=_recv_data(conn), **frame_fields), **result_fields)
                except EOFError:
                    proc = self.procs[w]
                    proc.join(5)
                    raise ShardstreamError(
                        f"pack worker process {proc.name} exited unexpectedly (exit code {proc.exitcode})"
                    ) from None
                outstanding[w] -= 1
            top_up()

    def close(self, wait: bool) -> None:
        """Stop the workers: let them exit (`wait`, after the last result), or end them now."""
        if wait:
            for conn in self.tasks:
                try:
                    conn.send(None)
                except OSError:
                    pass
        for conn in self.tasks + self.results:
            conn.close()
        for proc in self.procs:
            if wait:
                proc.join(10)
            if proc.is_alive():
                proc.terminate()
            proc.join()
        self.procs, self.tasks, self.results = [], [], []


def _grow_pipe(fd: int) -> None:
    # A result is ~1 MB; the default 64 KB pipe makes each one take 16 round trips
    # between worker and parent. Best effort (Linux only; the limit may be lower).
    if fcntl is not None and hasattr(fcntl, "F_SETPIPE_SZ"):
        for size in (4 << 20, 1 << 20):
            try:
                fcntl.fcntl(fd, fcntl.F_SETPIPE_SZ, size)
                return
            except OSError:
                continue


def _frame_worker(tasks: Any, conn: Any) -> None:
    """A worker process: build the jobs that come down `tasks`, send each result to `conn`.

    A thread sends, so that the next frame is built while the parent reads the last one,
    and so that this loop is always back at `tasks.recv()` soon: the parent may be
    blocked sending a job here, and must never wait on a worker that waits on it.
    """
    out: queue.Queue = queue.Queue()  # bounded by the parent: DEPTH jobs at a time
    broken = threading.Event()

    def send() -> None:
        while (item := out.get()) is not None:
            if broken.is_set():
                continue  # the parent has gone: drain, and let the main loop notice
            payload, data = item
            try:
                conn.send_bytes(payload)
                if data is not None:
                    _send_data(conn, data)
            except OSError:
                broken.set()

    sender = threading.Thread(target=send, daemon=True)
    sender.start()
    try:
        while not broken.is_set():
            try:
                task = tasks.recv()
            except (EOFError, OSError):
                break
            if task is None:
                break
            i, job = task
            try:
                result = build_job(job)
            except Exception as e:  # as Pool does: the parent re-raises it
                out.put((_pickle_error(i, e), None))
                continue
            frame = result.frame
            # Every field of the result and of its Frame but the data, which follows raw (see _send_data).
            message = ("ok", i, _fields_but(frame, "data"), _fields_but(result, "frame"))
            out.put((bytes(ForkingPickler.dumps(message)), frame.data))
    finally:
        out.put(None)
        sender.join()
        conn.close()


def _fields_but(instance: Any, left_out: str) -> dict[str, Any]:
    """A dataclass instance's fields by name, but one."""
    return {f.name: getattr(instance, f.name) for f in dataclasses.fields(instance) if f.name != left_out}


# Frame data goes through the pipe's file descriptor as a length and the raw bytes, and
# is read straight into its final buffer: Connection.recv_bytes would copy it twice more.
_RAW_PIPES = os.name == "posix"


def _send_data(conn: Any, data: bytes) -> None:
    if not _RAW_PIPES:
        conn.send_bytes(data)
        return
    fd = conn.fileno()
    for chunk in (struct.pack("<Q", len(data)), data):
        view = memoryview(chunk)
        while view:
            view = view[os.write(fd, view) :]


def _recv_data(conn: Any) -> bytes | bytearray:
    if not _RAW_PIPES:
        return conn.recv_bytes()
    fd = conn.fileno()
    head = b""
    while len(head) < 8:
        chunk = os.read(fd, 8 - len(head))
        if not chunk:
            raise EOFError
        head += chunk
    size = struct.unpack("<Q", head)[0]
    data = bytearray(size)
    view, got = memoryview(data), 0
    while got < size:
        n = os.readv(fd, [view[got:]])
        if not n:
            raise EOFError
        got += n
    return data


def _pickle_error(i: int, e: Exception) -> bytes:
    try:
        return bytes(ForkingPickler.dumps(("error", i, ExceptionWithTraceback(e, e.__traceback__))))
    except Exception as failed:  # an exception that does not pickle, reported as Pool reports it
        return bytes(ForkingPickler.dumps(("error", i, MaybeEncodingError(failed, e))))


# -- the whole pack ---------------------------------------------------------------------------


def pack(
    src: str,
    dst: str,
    *,
    shard_size: int | str = "256MB",
    max_samples: int | None = None,
    compression: str = "zstd",
    level: int = IMAGE_LEVEL,
    workers: int | None = None,
    seed: int = 0,
    shuffle: bool = True,
    on_error: str = "fail",
    overwrite: bool = False,
    resume: bool = False,
    part: tuple[int, int] | None = None,
    max_side: int | None = None,
    quality: int = DEFAULT_QUALITY,
    progress: bool = True,
    storage_options: dict[str, Any] | None = None,
) -> PackSummary:
    """Pack an image folder (one subfolder per class) or a file list into `dst`.

    `dst` is a path or fsspec URL. The same input and options give byte-identical
    shards and manifest, whatever `workers` is (default: all cores). `on_error="fail"`
    stops at the first unreadable or corrupt image, naming it; ``"skip"`` leaves it out
    and records it in the manifest. An image in a format pack does not store (GIF, BMP,
    TIFF, ...) is such an error, and so is a file list's row that names a file an earlier
    row names (``"skip"`` packs it once, from the first). An image in a stored format but
    named as another (a PNG named .jpg) is stored as named (under `jpg`, byte for byte)
    and listed in the summary's `misnamed`. `resume` continues an interrupted pack from
    its last complete shard, with the same result as an uninterrupted one. `part=(i, n)`
    packs only the i-th of n slices of the input and writes a part manifest; run every
    part (anywhere, in any order), then `merge` (parts.py). `max_side` shrinks every
    image whose longer side is larger to that side, encoded again in the format of its
    field at `quality` (JPEG, WebP; PNG losslessly); smaller images, and animated ones
    (listed in the summary's `kept_whole`), keep their bytes (shrink.py).
    """
    check_compression(compression, level)
    if on_error not in ON_ERROR:
        raise ShardstreamError(f"on_error must be one of {ON_ERROR}, not {on_error!r}")
    if part is not None and not 0 <= part[0] < part[1]:
        raise ShardstreamError(f"part must be I/N with 0 <= I < N, not {part[0]}/{part[1]}")
    if max_samples is not None and max_samples < 1:  # 0 packed one sample a shard: no limit anyone means
        raise ShardstreamError(f"max_samples must be a positive number of samples per shard, not {max_samples}")
    if max_side is not None and max_side < 1:
        raise ShardstreamError(f"max_side must be a positive number of pixels, not {max_side}")
    if not 1 <= quality <= 100:
        raise ShardstreamError(f"quality must be 1..100, not {quality}")
    prefix = "shard" if part is None else f"shard-p{part[0]:05d}"
    opts = PackOptions(parse_size(shard_size), max_samples, compression, level, seed, shuffle, FRAME_SIZE, prefix,
                       max_side, quality)
    store = Store(dst, storage_options or {})
    target = MANIFEST_NAME if part is None else part_manifest_name(*part)
    # A finished pack or part rerun with `resume` (a scheduler's retry after the pack, a
    # part's merge, or clearing the journal failed) has nothing left to do but tidy up; a
    # part's caller then merges as the part would have.
    finished = resume and not overwrite and store.exists(target)
    if store.exists(target) and not finished:
        if not overwrite:
            raise ShardstreamError("already holds a dataset; pass overwrite=True (--overwrite) to replace it",
                                   url=store.url(target))
        _remove_dataset(store, target)
    _clear_other_packs(store, part, overwrite=overwrite, finished_part=finished)
    listing = list_source(src)
    listed_skips = _repeated_rows(listing, src, on_error == "skip", part)
    entries = order(listing, opts)
    fingerprint = listing_fingerprint(entries)
    journal = Journal(store, "main" if part is None else f"part-{part[0]:05d}-of-{part[1]:05d}")
    if finished:
        summary = _finished_summary(store, target, opts.as_dict() if part is None else
                                    {**opts.as_dict(), "part": list(part), "listing": fingerprint})
        journal.clear(remove_folder=part is None)  # a kill between the manifest and this left it
        return summary
    if part is not None:
        entries = part_slice(entries, *part)
    shrunk = None if max_side is None else shrunk_estimates(entries, listing.root, max_side)
    planned = plan_frames(entries, opts, shrunk)
    store.makedirs()
    # on_error decides which files are skipped, so a resume must keep it; the files' times
    # catch a source edited in place (the listing has only names and sizes).
    plan_record = {"options": opts.as_dict(), "listing": fingerprint, "part": list(part or ()), "on_error": on_error,
                   "modified": _modified_stamp(listing.root, entries)}
    done = journal.start(plan_record, resume)
    jobs = [(shard, frame, listing.root, opts, on_error == "skip") for shard, frame in planned if shard not in done]
    if resume:  # a killed run's half-written shards, which this run writes again
        todo = {shard_name(opts.prefix, shard, compression) for shard, _ in planned if shard not in done}
        store.cleanup_scratch([name for shard in todo for name in (shard, shard + INDEX_SUFFIX)])
    workers = max(1, min(workers or os.cpu_count() or 1, len(jobs) or 1))

    start = time.perf_counter()
    finished: dict[int, tuple[ShardInfo, list[tuple[str, str]]]] = dict(done)
    bytes_in = 0
    misnamed: list[tuple[str, str]] = []
    kept_whole: list[tuple[str, str]] = []
    writer: ShardFileWriter | None = None
    shard_skips: list[tuple[str, str]] = []
    results: Iterator[FrameResult]
    if workers == 1:
        results = map(build_job, jobs)
    elif threads_pay(entries):
        results = _thread_results(jobs, workers)
    else:  # the context is chosen before the progress bar starts its monitor thread
        results = _process_results(jobs, workers, _pool_context())
    results = _bomb_warnings_raise(results)
    bar = _progress(len(entries), progress)
    bar.update(sum(s.samples + len(k) for s, k in done.values()))
    current = -1
    try:
        for result in results:
            if writer is not None and result.shard != current:
                _finish(writer, current, shard_skips, finished, journal)
                writer, shard_skips = None, []
            if writer is None:
                current = result.shard
                writer = ShardFileWriter(store, shard_name(opts.prefix, current, compression), compression, level)
            writer.append(result.frame)
            shard_skips += result.skipped
            bytes_in += result.bytes_in
            misnamed += result.misnamed
            kept_whole += result.kept_whole
            bar.update(len(result.frame.keys) + len(result.skipped))
            bar.set_postfix_str(f"{bytes_in / 1e6 / max(time.perf_counter() - start, 1e-9):,.0f} MB/s", refresh=False)
        if writer is not None:
            _finish(writer, current, shard_skips, finished, journal)
            writer = None
    except BaseException:
        if writer is not None:
            writer.abort()
        raise
    finally:
        bar.close()
        results.close()  # the workers stop now, not when the generator is collected

    shards = [finished[s][0] for s in sorted(finished) if finished[s][0].samples]
    skipped = [skip for s in sorted(finished) for skip in finished[s][1]]
    counts = np.zeros(len(listing.classes), dtype=np.int64)
    skipped_paths = {p for p, _ in skipped}  # not `listed_skips`: their files are packed, from their first rows
    skipped = listed_skips + skipped
    for entry in entries:
        if entry.label is not None and printable(entry.path) not in skipped_paths:
            counts[entry.label] += 1
    options = opts.as_dict() if part is None else {**opts.as_dict(), "part": list(part), "listing": fingerprint}
    manifest = Manifest(
        shards=tuple(shards),
        compression=compression,
        classes=listing.classes,
        class_counts=tuple(int(c) for c in counts),
        skipped=tuple(skipped),
        ignored=len(listing.ignored),
        options=options,
    )
    if part is None:
        write_manifest(store, manifest)
    else:
        store.write(target, manifest.to_bytes())
    journal.clear(remove_folder=part is None)
    return PackSummary(
        samples=manifest.samples,
        shards=len(shards),
        bytes_in=bytes_in,
        bytes_out=sum(s.bytes + s.index_bytes for s in shards),
        seconds=time.perf_counter() - start,
        skipped=skipped,
        ignored=len(listing.ignored),
        misnamed=misnamed,
        kept_whole=kept_whole,
    )


def _repeated_rows(listing: Listing, src: str, skip: bool, part: tuple[int, int] | None) -> list[tuple[str, str]]:
    """The skip records of a file list's rows that name a file again, or (unless `skip`)
    PackError at the first. Every part lists the source, so part 0 alone records them,
    and a merge holds each once."""
    if listing.repeated and not skip:
        first = listing.repeated[0]
        raise PackError(f"lines {first.first_line} and {first.line} both name {first.path!r}, which would be "
                        "packed twice; remove one (or pass on_error='skip' to pack the first)", url=src)
    if part is not None and part[0] != 0:
        return []
    return [(printable(r.path), r.reason) for r in listing.repeated]


def _finished_summary(store: Store, name: str, options: dict[str, Any]) -> PackSummary:
    """What the finished (part) manifest `name` holds, once it is checked to be this very
    run's (the same options; a part's, the same source listing too): a retry must not pass
    off another pack as done."""
    manifest = Manifest.from_bytes(store.read(name), store.url(name))
    if manifest.options != options:
        raise ShardstreamError("already holds a pack made from another source or with other options; "
                               "pass overwrite=True (--overwrite) to replace it", url=store.url(name))
    return PackSummary(
        samples=manifest.samples,
        shards=len(manifest.shards),
        bytes_in=0,
        bytes_out=sum(s.bytes + s.index_bytes for s in manifest.shards),
        seconds=0.0,
        skipped=list(manifest.skipped),
        ignored=manifest.ignored,
    )


def _bomb_warnings_raise(results: Iterator[FrameResult]) -> Iterator[FrameResult]:
    """`results`, with Pillow's DecompressionBombWarning an error wherever they are built:
    the filter is set once, here, for the threads (which share it) and the processes
    (which inherit it when they start, on the first result), never changed while they run."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", Image.DecompressionBombWarning)
        yield from results


def _finish(writer: ShardFileWriter, shard: int, skipped: list[tuple[str, str]],
            finished: dict[int, tuple[ShardInfo, list[tuple[str, str]]]], journal: Journal) -> None:
    """Publish a shard (or drop it if every one of its images was skipped) and journal it."""
    if writer.samples:
        info = writer.finish()
    else:
        writer.abort()
        info = ShardInfo(writer.name, 0, 0, 0, "", "", 0, "", ())
    finished[shard] = (info, list(skipped))
    journal.record(shard, info, list(skipped))


def _progress(total: int, enabled: bool) -> Any:
    from .progress import progress_bar

    return progress_bar(total=total, unit="img", desc="pack", disable=not enabled, smoothing=0.1)
