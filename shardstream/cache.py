"""A bounded local cache of whole shards, shared by every worker and rank on a machine.

For remote datasets read more than once (every epoch), downloading each shard once
to local disk beats streaming it again. The cache is a folder, safe to share between
processes:

* **One download per shard at a time.** Every reader of a shard, and every download of
  it, holds a shared `flock` on the shard's lock file (`NAME.lock`), which keeps the copy
  from being evicted. A download also holds an exclusive `flock` on the shard's download
  lock (`NAME.dl`); a second process (or thread) finding the copy absent waits for that
  lock, then finds the copy there, or the failure of the download it waited for, which it
  raises rather than spend its own retries after it (`_DownloadTurn`); where the process
  downloading is stopped (SIGSTOP, a suspended job: the lock file names it), the waiter
  reads the shard uncached after `STALLED_S` instead. A download waits
  for nothing a reader holds, so no process waits on another that waits on it, nor on
  itself: a copy found damaged while others read it, in this process or another, is
  downloaded again and renamed over it; their next reads open the file by its name, so
  they read the new copy (the same bytes, whole again), and none of them is waited for.
* **No torn files.** Shards are downloaded under a temporary name, verified against
  the manifest's SHA-256 (downloaded again on a mismatch, `DOWNLOAD_ATTEMPTS` times in
  all, then an error naming the file), and renamed into place.
* **Bounded.** Before a download, least-recently-used shards are evicted until the new
  one fits under `limit`, and its temporary files are created at their full size (sparse)
  before anyone else looks: every process's walk of the cache counts every download in
  flight, its own and the others'. Walks and landings take turns under a lock file at
  the cache's root. A shard being read holds a shared lock and is never evicted, so the
  limit is exceeded only while the shards in use (the ones being read and the `prefetch`
  downloaded ahead, in every process) alone exceed it; a walk that leaves the cache over
  its limit says so in a marker file, and every release trims while the marker is there.
  A walk stats every cached file (2.1 s at 50k shards), and every download on the machine
  waits its turn behind it: so a download that fits by the ledger (the bytes the last walk
  counted, plus every reservation since) adds itself to it and does not walk, for
  `LEDGER_TRUST_S` after that walk, and a walk that must evict goes down to `LOW_WATER`
  of the limit, so that the downloads after it fit by the ledger.
* **Self-healing.** The first use of a cached shard in each process re-hashes it, and so
  does a use after the file changed (its inode, size or modification time: use is marked
  in the access time); a file damaged on disk is fetched again and renamed over it. A download's temporary file left by
  a killed process is deleted by the next walk (its download's `flock` is gone with it),
  which comes when the ledger runs short of room, or a minute after the last one.
* **Versioned.** A shard's copy lives in a folder named by its checksum (the manifest's), so a
  dataset republished at the same location (new bytes under the same shard names) is
  never served from the old copy, and a job still reading the old version does not hold
  up one reading the new: the old copies age out as least recently used.
* **Nothing left behind.** A walk that evicts a shard deletes its lock file too, and
  removes the folders that leaves empty (the version's, then the location's): a dataset
  republished daily would otherwise leave a folder and a lock file per shard per day.
  Lock files and indexes found without their shard (a walk killed midway, a cache filled
  by an earlier version of this module) are deleted by the next walk. A lock file is
  deleted only by a walk holding its exclusive lock, last. A process that opened it just
  before waits for that lock and then holds a lock on a deleted file, while another
  process could lock a new file at the same path. So every process that takes a lock
  checks that the path still names the file it locked, and starts again if not. A
  folder is removed only while empty (`rmdir` refuses otherwise), and a download's
  folder holds the lock file it holds. A process that finds its folder gone between
  making it and opening the lock file makes it again.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import hashlib
import json
import logging
import os
import socket
import tempfile
import time
import weakref
from dataclasses import dataclass, replace
from typing import BinaryIO, Callable, Iterator

from .cacheroom import Room, names_file, writing as _writing
from .cancel import ReadCancelled, pause
from .errors import (CacheFullError, DownloadChecksumError, DownloadStalledError, RetriesSpentError, ShardstreamError,
                     StorageError, described)
from .format import INDEX_SUFFIX
from .iostats import io_stats
from .reader import ShardReader
from .source import ShardRef
from .storage import Store

try:
    import fcntl
except ImportError:  # Windows: the cache is not offered there (`ShardCache`)
    fcntl = None  # type: ignore[assignment]

__all__ = ["ShardCache"]

CHUNK = 16 << 20  # bytes per ranged request when downloading
DOWNLOAD_ATTEMPTS = 3  # whole downloads of a file before its checksum mismatch is an error
EMPTIED_ATTEMPTS = 3  # opens of a copy whose cache was emptied under it, before that is an error
# Past this long waiting for another download of the same shard, say so (a slow store, or a
# large shard; the wait goes on).
SLOW_WAIT_S = 60.0
# A download whose process has been stopped (SIGSTOP, Ctrl-Z, a job suspended: SLURM's gang
# scheduling suspends so) is waited for this long, then those waiting read the shard uncached
# instead of waiting as long as it stays stopped; later openings of that shard in the process
# do not wait again while it is. Told by the process's state, which its download holds in the
# lock file (`_DownloadTurn.hold`): a live download may write nothing for minutes (one 16 MB
# chunk's deadline on a slow link, and its retries), and is always waited for.
STALLED_S = 60.0
_stalled: set[str] = set()  # copies whose download this process gave up waiting for: its holder was stopped
_HOST = socket.gethostname()
log = logging.getLogger("shardstream")

# Cached files this process has hashed: their (inode, size, mtime) then, shard and index. A
# copy is trusted while those stay; changed in place (a plain tar has no frame checksums to
# catch it), it is hashed again. Use is marked in the access time (`_mark_used`), so that the
# modification time stays the download's.
_verified: dict[str, tuple] = {}
_damaged: dict[str, tuple] = {}  # cached files that failed the hash: their `_version` then
# Copies whose downloads never matched the manifest's checksum in this process, and when. The
# stored file is then likely the dataset's own damage, not the way's: downloading it again at
# each opening (every epoch, every visit of an interleaved shard) fetched it DOWNLOAD_ATTEMPTS
# times over to read it by ranges after all. Tried again after UNMATCHED_RETRY_S (a repaired
# upload, a proxy's burst of damage over), or at once where another process cached a good copy.
_never_matched: dict[str, float] = {}
UNMATCHED_RETRY_S = 600.0
# Every lock file `open` handed out in this process, while it is open. A forked child gets
# copies of them, and an flock is held while any copy is open: a child that kept them (a
# DataLoader worker, forked while a head start held the next epoch's first shard) would
# pin those copies in the cache for its life, and a download of one waits on it forever.
# They are opened unbuffered (`buffering=0`): closing a buffered file takes its buffer's lock,
# which a parent's thread writing a download at the fork held, and the child would wait
# for it inside `os.fork()`, forever.
_locks: "weakref.WeakSet[BinaryIO]" = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for lock in list(_locks):  # the parent's: not this process's to hold
        with contextlib.suppress(OSError):
            lock.close()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


@dataclass(frozen=True)
class ShardCache:
    """Shards of remote datasets cached under `root`, at most `limit` bytes in all."""

    root: str
    limit: int

    def __post_init__(self) -> None:
        if fcntl is None:
            # Every step above rests on flock and lockf, and on deleting and renaming files that
            # other processes hold open: none of which Windows has.
            raise ShardstreamError("cache_dir needs POSIX file locks (fcntl), which this platform does not have "
                                   "(Windows): stream the shards without cache_dir", url=self.root)

    @property
    def room(self) -> Room:
        """How full the cache is, and its evictions (cacheroom.py)."""
        return Room(self.root, self.limit)

    def trim(self) -> None:
        """Evict least-recently-used shards not in use until the cache is within its limit,
        if the last walk of it left it over (`Room.trim`)."""
        self.room.trim()

    def folder(self, store: Store) -> str:
        # One subfolder per dataset location, so datasets can share a cache folder (not per
        # token: an HTTP(S) root's query string may rotate while the files stay).
        # A trailing slash names the same location: two spellings downloaded every shard twice.
        return os.path.join(self.root, hashlib.sha256(store.location.rstrip("/").encode()).hexdigest()[:16])

    def path(self, ref: ShardRef) -> str:
        """Where the copy of `ref` lives: in its location's folder, under its version (module doc)."""
        assert ref.info is not None
        return os.path.join(self.folder(ref.store), ref.info.sha256[:16], ref.name)

    def open(self, ref: ShardRef) -> tuple[ShardReader, BinaryIO]:
        """A reader over the cached copy of `ref`, and the shared lock that keeps it there.

        Close the returned lock file when done reading.
        """
        if ref.info is None:
            raise StorageError("only datasets with a manifest can be cached (checksums are needed)", url=ref.url)
        size = ref.info.bytes + ref.info.index_bytes
        if size > self.room.limit:
            # Cached, it would evict every other shard, and the next download would evict it. And the
            # size is the manifest's claim: one of another's dataset emptied the cache and reserved
            # the disk the claim said (`fallocate`) before a byte came.
            raise CacheFullError(f"{size} bytes with its index, its manifest says: more than the cache's limit of "
                                 f"{self.room.limit}", url=ref.url)
        path = self.path(ref)
        lock = self._acquire(path, ref)
        try:
            with _writing(path):
                _mark_used(path)
        except BaseException:
            lock.close()
            raise
        info = replace(ref.info, index=_cached_index(ref))
        # Errors name the dataset's shard, not its copy: a copy that disagrees with the manifest is
        # downloaded again (`_acquire`), so bad data in one that agrees is the dataset's.
        return ShardReader(Store(os.path.dirname(path)), ref.name, info, url=ref.url), lock

    def forget(self, ref: ShardRef) -> None:
        """Check the cached copy of `ref` again at its next `open` (it was found damaged)."""
        _verified.pop(self.path(ref), None)

    def _acquire(self, path: str, ref: ShardRef) -> BinaryIO:
        """`_acquire_once`, again where the cache was emptied under it (`rm -rf` of the cache
        while a copy downloaded: its folder, temporary files and locks gone), a few times:
        that failed the epoch, where a copy gone between reads is fetched again."""
        for attempt in range(EMPTIED_ATTEMPTS):
            try:
                return self._acquire_once(path, ref)
            except StorageError as error:
                emptied = isinstance(error.__cause__, FileNotFoundError) and str(error.url).startswith(self.root)
                if not emptied or attempt + 1 == EMPTIED_ATTEMPTS:
                    raise
        raise AssertionError("unreachable")

    def _acquire_once(self, path: str, ref: ShardRef) -> BinaryIO:
        """The lock file of `path`, share-locked, with a verified copy of `ref` at `path`.

        Checking a copy only reads it, under the shared lock, so readers never wait for
        each other. A copy absent or damaged is downloaded under the download lock, the
        shared lock still held: no walk evicts the shard meanwhile, and readers of a
        damaged copy go on reading it until they let go (module doc). A walk may delete
        the lock file while nobody holds it (`_evict`): `_shared_lock` only returns one
        that is still the file at its path.
        """
        assert ref.info is not None
        with _writing(path + ".lock"):
            lock = _shared_lock(path + ".lock")
        try:
            if self._check(path, ref):
                io_stats.add(cache_hits=1)
                return lock
            if time.monotonic() - _never_matched.get(path, -UNMATCHED_RETRY_S) < UNMATCHED_RETRY_S:
                raise DownloadChecksumError(f"downloaded file did not match the manifest's checksum in "
                                            f"{DOWNLOAD_ATTEMPTS} downloads, less than {UNMATCHED_RETRY_S:.0f} s ago "
                                            "in this process", url=ref.url)
            if path in _stalled:
                if _holder_stopped(path + ".dl"):  # as it was at the last opening: not waited for again
                    raise DownloadStalledError("another process's download of this shard into the cache is still "
                                               "stopped: read uncached", url=ref.url)
                _stalled.discard(path)
            with _download_lock(path + ".dl", ref.url) as turn:
                if not self._check(path, ref):  # unless another download got there first
                    failed = turn.failed_meanwhile(self.root, ref)
                    if failed is not None:
                        if isinstance(failed, DownloadChecksumError):
                            _never_matched[path] = time.monotonic()
                        raise failed
                    turn.hold()
                    io_stats.add(cache_misses=1)
                    try:
                        self._download(ref, path)
                    except StorageError as error:
                        turn.record(error, ref)
                        raise
                    _verified[path] = _version(path, ref)
                else:
                    io_stats.add(cache_hits=1)
            return lock
        except BaseException:
            lock.close()
            raise

    def _check(self, path: str, ref: ShardRef) -> bool:
        """Whether the copy at `path` is whole: hashed once per process, then trusted while unchanged (`_version`)."""
        assert ref.info is not None
        if not self._present(path, ref):
            _verified.pop(path, None)
            return False
        try:
            version = _version(path, ref)
        except FileNotFoundError:  # evicted meanwhile
            return False
        if _verified.get(path) == version:  # hashed before, unchanged since
            return True
        if _damaged.get(path) == version:  # hashed before, unchanged since: still damaged
            return False
        index = os.path.join(os.path.dirname(path), _cached_index(ref))
        try:
            whole = _sha256(path) == ref.info.sha256 and _sha256(index) == ref.info.index_sha256
        except FileNotFoundError:  # evicted, or the cache emptied, while it was hashed: fetched again
            return False
        except OSError as e:  # the cache's disk failing (EIO): an error naming the copy, not a bare OSError
            raise StorageError(f"cannot read the cache: {described(e)}", url=e.filename or path) from e
        if whole:
            _verified[path] = version
            _damaged.pop(path, None)
            return True
        _damaged[path] = version
        return False

    @staticmethod
    def _present(path: str, ref: ShardRef) -> bool:
        assert ref.info is not None
        try:
            return os.path.getsize(path) == ref.info.bytes and os.path.exists(os.path.join(
                os.path.dirname(path), _cached_index(ref)))
        except OSError:
            return False

    def _download(self, ref: ShardRef, path: str) -> None:
        """Make room for the shard and its index, and download them into place."""
        assert ref.info is not None
        folder = os.path.dirname(path)
        files = ((ref.name, ref.name, ref.info.bytes, ref.info.sha256),  # (remote, local, ...)
                 (ref.info.index, _cached_index(ref), ref.info.index_bytes, ref.info.index_sha256))
        parts: list[tuple[str, BinaryIO]] = []
        try:
            with self.room.turn(), _writing(folder):
                self.room.make(ref.info.bytes + ref.info.index_bytes)
                for _, name, size, _ in files:  # reserved: counted by every walk from here on
                    parts.append(_reserve(folder, name, size))
            for (remote, name, size, digest), (part, f) in zip(files, parts):
                # Bytes damaged on the way, or an object caught while being replaced, download
                # whole again; a checksum that never matches is the data's, and raises.
                for attempt in range(1, DOWNLOAD_ATTEMPTS + 1):
                    if _download_into(ref.store, remote, size, digest, f, part):
                        break
                    if attempt == DOWNLOAD_ATTEMPTS:
                        _never_matched[path] = time.monotonic()
                        raise DownloadChecksumError(f"downloaded file does not match the manifest's checksum "
                                                    f"({DOWNLOAD_ATTEMPTS} downloads)", url=ref.store.url(remote))
                    io_stats.add(retries=1)
            # Both land once both are here, in one turn (a walk sees each file under one name or
            # the other): a shard is of no use without its index (`_present`), and one landed
            # alone, its download failing after, would hold its room until a later walk. Over a
            # damaged copy that others still read, they read the new one from their next read on.
            with self.room.turn():
                for (_, name, _, _), (part, _) in zip(files, parts):
                    with _writing(part):
                        os.replace(part, os.path.join(folder, name))
        finally:
            for part, f in parts:  # what did not land is no longer coming
                f.close()
                with contextlib.suppress(FileNotFoundError):
                    os.remove(part)


def _shared_lock(path: str) -> BinaryIO:
    """The lock file at `path` (made, and its folders, if absent), open and share-locked.

    A walk deletes a lock file nobody holds (`Room._evict`), so a process may open
    the file just before that and lock it just after: a lock on a deleted file, which
    the next process, making the file again, would not see. So once locked, the file is
    checked to be the one `path` names, and if not, the lock is taken again on that one.
    A walk also removes the folders it leaves empty: one gone is made again."""
    folder = os.path.dirname(path)
    while True:
        try:
            os.makedirs(folder, exist_ok=True)
            lock = open(path, "a+b", buffering=0)  # see _locks
        except (FileNotFoundError, FileExistsError):
            # A walk removed the folder between makedirs and open, or between makedirs' look
            # and its mkdir: make it again. A file where a folder goes is no race, and a link
            # to nowhere (`/scratch` to a volume not mounted) neither: those spun here forever.
            blocked = _not_a_folder(folder)
            if blocked is not None:
                raise NotADirectoryError(errno.ENOTDIR, "not a folder (a file, or a link to nothing)", blocked) \
                    from None
            continue
        _locks.add(lock)
        try:
            _take(lock, fcntl.LOCK_SH, path)  # only a walk evicting it holds it exclusively
            if names_file(path, lock):
                return lock
        except BaseException:
            lock.close()
            raise
        lock.close()


def _version(path: str, ref: ShardRef) -> tuple:
    """What tells a cached copy changed: the (inode, size, modification time) of the shard and its index."""
    index = os.path.join(os.path.dirname(path), _cached_index(ref))
    return tuple((st.st_ino, st.st_size, st.st_mtime_ns) for st in map(os.stat, (path, index)))


def _mark_used(path: str) -> None:
    """The copy at `path` is the most recently used: its access time, which eviction orders
    by (cacheroom.py); its modification time stays the download's (`_verified`)."""
    os.utime(path, ns=(time.time_ns(), os.stat(path).st_mtime_ns))


def _not_a_folder(folder: str) -> str | None:
    """The first of `folder` and the folders above it that is there but is no folder (a
    file, or a link to nothing), or None."""
    while True:
        if os.path.lexists(folder) and not os.path.isdir(folder):
            return folder
        parent = os.path.dirname(folder)
        if parent == folder:
            return None
        folder = parent


@contextlib.contextmanager
def _download_lock(path: str, url: str) -> Iterator["_DownloadTurn"]:
    """Hold the download lock at `path` (made if absent) exclusively. Taken only while the
    shard's lock file is held shared, which keeps walks from deleting either (`_evict`).
    Raises `DownloadStalledError` where its holder's process is stopped, waited for
    `STALLED_S` at least (`_holder_stopped`)."""
    with _writing(path):
        lock = open(path, "a+b", buffering=0)  # see _locks
    _locks.add(lock)
    try:
        asked = time.time()

        def slow(waited: float) -> None:
            log.warning("%s: waited %.0f s for another download of this shard into the cache; still waiting", url,
                        waited)

        def given_up(waited: float) -> bool:
            return waited >= STALLED_S and _holder_stopped(path)

        waited = _take(lock, fcntl.LOCK_EX, path, slow, given_up)
        if waited is None:
            _stalled.add(path[: -len(".dl")])
            raise DownloadStalledError(f"another process's download of this shard into the cache has been stopped "
                                       f"(SIGSTOP, a suspended job) for {STALLED_S:.0f} s or more: read uncached",
                                       url=url)
        yield _DownloadTurn(lock, asked if waited else None)
    finally:
        lock.close()


def _holder_stopped(path: str) -> bool:
    """Whether the process that holds the download lock at `path` (as it wrote there,
    `_DownloadTurn.hold`) is on this host and stopped (SIGSTOP, or traced): Linux's
    /proc says. False where that cannot be told: another host's, another system."""
    try:
        with open(path, "rb") as f:
            said = json.loads(f.read(1 << 16) or b"null")
        if not isinstance(said, dict) or said.get("host") != _HOST or not isinstance(said.get("holder"), int):
            return False
        with open(f"/proc/{said['holder']}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] in (b"T", b"t")
    except (OSError, ValueError, IndexError):
        return False


@dataclass(frozen=True)
class _DownloadTurn:
    """A held download lock, and when its holder began waiting for another's download
    (None where it did not wait).

    A download whose retries the store outlasted (5xx, timeouts, dropped connections at
    every attempt), or whose checksum never matched, writes why into the lock file before
    letting go. Each process waiting for it then took its turn and downloaded again, its
    own retries spent one after the other: 4 DataLoader workers of a rank failed in 11 s
    where one failed in 2. So a process that waited for such a download, through the same
    store (its URL's query and its options: another job's expired token is not its own),
    raises that failure at once; one that comes later tries the store afresh. A
    permanent error (404, 403) is not recorded: it comes back at once, and may be the
    asker's own (its credentials); nor are errors of the cache's own disk, which each
    process meets for itself, nor a download cancelled because its reading ended. The
    record holds no URL: a query string's token stays out of a file others can read."""

    lock: BinaryIO
    waited_from: float | None

    def hold(self) -> None:
        """Say in the lock file which process downloads now, for those waiting to tell whether
        it is stopped (`_holder_stopped`). Over an earlier download's failure record, read first."""
        with contextlib.suppress(OSError):  # only the waiters' telling is at stake
            os.ftruncate(self.lock.fileno(), 0)
            self.lock.write(json.dumps({"holder": os.getpid(), "host": _HOST}).encode())

    def record(self, error: StorageError, ref: ShardRef) -> None:
        """Say in the lock file that the download of `ref` failed with `error`, where that is
        the store's lasting word."""
        if not isinstance(error, (RetriesSpentError, DownloadChecksumError)):
            return
        record = {"at": time.time(), "checksum": isinstance(error, DownloadChecksumError), "detail": error.detail,
                  "store": _store_key(ref)}
        with contextlib.suppress(OSError):  # only the waiters' time is at stake
            os.ftruncate(self.lock.fileno(), 0)
            self.lock.write(json.dumps(record).encode())

    def failed_meanwhile(self, root: str, ref: ShardRef) -> StorageError | None:
        """The failure of the download this process waited for, through the same store, or None."""
        if self.waited_from is None:
            return None
        try:
            record = json.loads(os.pread(self.lock.fileno(), 1 << 16, 0) or b"null")
        except (OSError, ValueError):
            return None
        if not isinstance(record, dict) or record.get("at", 0) < self.waited_from \
                or record.get("store") != _store_key(ref):
            return None
        kind = DownloadChecksumError if record.get("checksum") else RetriesSpentError
        return kind(f"another download of this shard into the cache {root} failed while this one waited for it: "
                    f"{record.get('detail')}", url=ref.url)


def _store_key(ref: ShardRef) -> str:
    """Who asks the store for `ref`, in 16 hex digits: its URL whole (a query's token) and its options."""
    asked = json.dumps([ref.url, ref.store.options], sort_keys=True, default=repr)
    return hashlib.sha256(asked.encode()).hexdigest()[:16]


def _cached_index(ref: ShardRef) -> str:
    """The name of a cached shard's index, beside it: always the shard's name and `.idx`,
    whatever the manifest calls it (another tool's name for it, `a.idx` beside `a.tar`,
    read as the leftover index of a shard `a` that is not there, and a walk deleted it)."""
    return ref.name + INDEX_SUFFIX


def _take(lock: BinaryIO, kind: int, path: str, slow: Callable[[float], None] | None = None,
          given_up: Callable[[float], bool] | None = None) -> bool | None:
    """`flock` `lock` (`kind`: LOCK_SH or LOCK_EX), polled rather than blocked on, so that a
    reading that stops (cancel.py) stops waiting too, instead of holding up the end of its
    iteration until the holder is done. `slow(waited)` is called once past `SLOW_WAIT_S`;
    the wait ends where `given_up(waited)`, checked once a second. Returns whether another
    process held it first; None where the wait was given up."""
    delay, started, held_first, asked = 0.002, time.monotonic(), False, 0
    while True:
        try:
            fcntl.flock(lock, kind | fcntl.LOCK_NB)
            return held_first
        except BlockingIOError:
            held_first = True
            waited = time.monotonic() - started
            if slow is not None and waited > SLOW_WAIT_S:
                slow(waited)
                slow = None  # said once
            if given_up is not None and int(waited) > asked:
                asked = int(waited)
                if given_up(waited):
                    return None
            pause(delay, path)
            delay = min(2 * delay, 0.05)


def _reserve(folder: str, name: str, size: int) -> tuple[str, BinaryIO]:
    """A temporary file for downloading `name`, already `size` bytes long, so that walks of
    the cache count the room it will take before a byte arrives; open for writing, its
    exclusive `flock` held while the download lives (see cacheroom's `_reserved_bytes`). Called in
    the room lock's turn, so no walk sees the file before it is locked."""
    fd, part = tempfile.mkstemp(dir=folder, prefix=f".{name}.", suffix=".part")
    f = os.fdopen(fd, "r+b", buffering=0)  # see _locks
    try:
        with contextlib.suppress(OSError):  # no flock here: walks judge it by its age
            fcntl.flock(f, fcntl.LOCK_EX)
        _allocate(fd, size)
    except BaseException:
        f.close()
        os.remove(part)
        raise
    _locks.add(f)  # a forked child closes its copy (see `_after_fork_in_child`)
    return part, f


def _allocate(fd: int, size: int) -> None:
    """Make the file at `fd` `size` bytes long, its blocks taken from the disk now where the
    file system allows (Linux's fallocate), else sparse.

    The room rule (`Room._room_for`) counts a reservation as held and reads the disk's free
    space: a sparse reservation is in both, so downloads reserved side by side could each
    see room the others were about to fill (a small disk filled in 1 run of 3 in review).
    Allocated, a reservation leaves the free space, and a disk without room for it fails
    here, before a byte is fetched (ENOSPC: `writing` makes it a `CacheFullError`, and the
    shard is read uncached). fallocate(2) itself, not `posix_fallocate`: where the file
    system cannot allocate (some FUSE and NFS mounts), glibc's posix_fallocate writes a
    byte into every block instead, a slow write of the whole file."""
    if _fallocate is not None and _fallocate(fd, 0, 0, size) == 0:
        return
    code = ctypes.get_errno() if _fallocate is not None else errno.EOPNOTSUPP
    if code not in (errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):  # full, over a quota, failing: the disk's word
        raise OSError(code, os.strerror(code))
    os.ftruncate(fd, size)


def _libc_fallocate() -> Callable[[int, int, int, int], int] | None:
    """libc's fallocate(fd, mode, offset, length), or None where there is none (not Linux)."""
    try:
        function = ctypes.CDLL(None, use_errno=True).fallocate
    except (AttributeError, OSError):
        return None
    function.argtypes = (ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64)
    function.restype = ctypes.c_int
    return function


_fallocate = _libc_fallocate()


def _download_into(store: Store, name: str, size: int, digest: str, f: BinaryIO, part: str) -> bool:
    """Download `name` over the reserved file `f` (at `part`); whether its SHA-256 is `digest`."""
    hasher = hashlib.sha256()
    f.seek(0)
    for start in range(0, size, CHUNK):
        # With its size: a shard replaced by one of another size fails at the first response
        # (Content-Range), where it was downloaded whole 3 times, then called a checksum mismatch.
        data = store.read(name, start, min(size, start + CHUNK), size=size)
        hasher.update(data)
        with _writing(part):
            _write_all(f, data)
    return hasher.hexdigest() == digest  # so exactly `size` bytes arrived: no reserved zeros left


def _write_all(f: BinaryIO, data: bytes) -> None:
    """Write all of `data` to the unbuffered `f`, which may take less than all of it a call."""
    view = memoryview(data)
    while view:
        view = view[f.write(view):]


def _sha256(path: str) -> str:
    digest = hashlib.sha256()
    started = time.perf_counter()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    io_stats.add(wait_s=time.perf_counter() - started)
    return digest.hexdigest()
