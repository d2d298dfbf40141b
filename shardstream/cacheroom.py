"""The room in a shard cache: how many bytes it holds, which shards to evict, and when to look.

`ShardCache` (cache.py) downloads a shard only after `Room.make` has made room for it,
in the room lock's turn (`Room.turn`), which every thread and process on the machine
takes in turn. Making room is a walk of the whole cache (every cached file, download
in flight and leftover, in the cache's own folders, `<location>/<version>/NAME`, each
named by 16 hex digits: nothing else in the folder is counted or touched; `Room.walk`),
which evicts the least recently used shards that no process holds, deletes what killed
processes left, and marks the cache over its limit where the shards in use alone
exceed it. A walk of a large cache is long (2.1 s
at 50k shards), so a ledger of the bytes it counted, plus every reservation since,
spares the walk while it shows room, for a minute; and a walk that must evict goes
down to `LOW_WATER` of the limit. The ledger only errs high: a download given up, a
damaged copy replaced, a killed process's reservation stay counted until the next walk.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import re
import shutil
import threading
import time
from dataclasses import dataclass
from typing import BinaryIO, Iterator

from .errors import CacheFullError, ShardstreamError, StorageError

try:
    import fcntl
except ImportError:  # Windows: the cache is not offered there (`ShardCache`)
    fcntl = None  # type: ignore[assignment]

__all__ = ["Room", "names_file", "writing", "ROOM_LOCK", "OVER_LIMIT", "LEDGER", "LIMIT"]

# A live download writes its file a `cache.CHUNK` at a time. One try of a 16 MB read may take 350 s
# on a slow link (`deadlines.deadline_s`, counted in its share of the time when reads
# share the link, so a few times that with prefetch): a temporary file untouched for an
# hour has no live download behind it.
ABANDONED_PART_S = 3600
# The threads of this process take turns at the room lock file: a POSIX lock (`lockf`) is held by a
# process, not a thread, and is not inherited by a forked child (a forked DataLoader worker must not
# keep a lock its parent's thread held at the fork, as an inherited `flock` would).
_room = threading.Lock()
# What lives beside a cached shard NAME: its lock file, its index, its download lock (cache.py).
COMPANIONS = (".lock", ".idx", ".dl")
ROOM_LOCK = ".room.lock"  # at the cache's root: one walk, or one landing, at a time
OVER_LIMIT = ".over-limit"  # at the cache's root while the last walk left it over its limit
# At the cache's root: the bytes the last walk counted plus every reservation since, and when it walked.
LEDGER = ".room.ledger"
# At the cache's root: the limit of the last process that made room (a file of its own: a ledger of
# another form was unreadable to earlier versions, which walked the whole cache at every handover).
LIMIT = ".room.limit"
log = logging.getLogger("shardstream")
_limits_said: set[tuple[str, int]] = set()  # (cache root, another process's limit): warned of once
# A walk of a large cache is long (2.1 s at 50k shards, a stat or two a file), and every download on the
# machine waits its turn behind it: downloads that fit by the ledger do not walk, for this long after
# the walk it starts from. The ledger only errs high (a download given up, a damaged copy replaced, a
# killed process's reservation: all still counted), which brings the next walk sooner; this bounds how
# long what it cannot see (files put there by hand, or by an older version of this module) goes unseen.
LEDGER_TRUST_S = 60.0
# A walk that has to evict goes down to this share of the limit, so that the downloads after it find
# room by the ledger: without it, a full cache (a dataset larger than the limit) walks for every download.
LOW_WATER = 0.95
# Of the cache's disk, the share kept free for others (a checkpoint written beside the cache), at
# most `DISK_HEADROOM_MAX`: on a disk smaller than the limit, the cache holds what the disk has room
# for. Without it, a download failed with ENOSPC beside shards nothing used, and left the disk full.
DISK_HEADROOM = 0.02
DISK_HEADROOM_MAX = 1 << 30
# The name of a location's folder and of a version's (16 hex digits of a SHA-256: cache.py). A walk
# looks into these alone, so other files in the cache's folder are the user's, untouched.
_FOLDER = re.compile("[0-9a-fA-F]{16}")


def _after_fork_in_child() -> None:
    global _room
    _room = threading.Lock()  # a parent's thread may have held it at the fork


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


@dataclass(frozen=True)
class Room:
    """The room in the cache at `root`, of at most `limit` bytes."""

    root: str
    limit: int

    def trim(self) -> None:
        """Evict least-recently-used shards not in use until the cache is within its limit,
        if the last walk of it (by any process) left it over: its shards in use could not be
        evicted then. A walk of the whole cache on every shard released would be work for
        nothing."""
        if os.path.exists(os.path.join(self.root, OVER_LIMIT)):
            with self.turn():
                self.make(0)

    @contextlib.contextmanager
    def turn(self) -> Iterator[None]:
        """Hold the cache's room lock: across threads by `_room`, across processes by `lockf`."""
        path = os.path.join(self.root, ROOM_LOCK)
        with _room:
            with writing(path):
                os.makedirs(self.root, exist_ok=True)  # the cache emptied by hand (`rm -rf`) meanwhile
                lock = open(path, "a+b")
            with lock:
                fcntl.lockf(lock, fcntl.LOCK_EX)
                yield  # closing the file lets go of the lock

    def make(self, incoming: int) -> None:
        """Make room for `incoming` more bytes, which the caller then reserves (0: only
        trim). Where the ledger, less than `LEDGER_TRUST_S` old, shows room for them, count
        them in it; else walk the cache (`walk`) and start the ledger anew from what it
        counted. Called in `turn`."""
        with writing(self.root):
            self._make(incoming)

    def _make(self, incoming: int) -> None:
        self._say_other_limit(_swap_limit(self.root, self.limit))
        ledger = _read_ledger(self.root)
        if incoming and ledger is not None:
            counted, walked = ledger
            if counted + incoming <= self._room_for(counted) and 0 <= time.time() - walked < LEDGER_TRUST_S:
                _write_ledger(self.root, counted + incoming, walked)
                return
        walked = time.time()
        _write_ledger(self.root, self.walk(incoming) + incoming, walked)

    def _say_other_limit(self, other: int | None) -> None:
        """Warn, once a process, that another process uses this cache with another limit:
        each walk evicts down to its own, so the smallest holds for all, and the others'
        copies are evicted as fast as they land (a job at 10 MB beside one at 200 KB
        downloaded its shards 3.2 times an epoch, without a word)."""
        if other is None or other == self.limit or (self.root, other) in _limits_said:
            return
        _limits_said.add((self.root, other))
        log.warning("the cache %s is in use with cache_limit=%d too (this process's: %d): each process evicts "
                    "down to its own limit, so the smallest holds for all, and the copies others keep beyond it "
                    "are downloaded again and again; give every job that shares a cache_dir the same cache_limit",
                    self.root, other, self.limit)

    def _room_for(self, counted: int) -> int:
        """The most the cache may hold: its limit, or where its disk is the smaller, what it
        holds (`counted`) and the disk's free space, less `DISK_HEADROOM` kept free."""
        disk = shutil.disk_usage(self.root)
        return min(self.limit, counted + disk.free - min(int(disk.total * DISK_HEADROOM), DISK_HEADROOM_MAX))

    def walk(self, incoming: int) -> int:
        """Evict least-recently-used shards not in use until `incoming` more bytes fit beside
        those on disk, downloads in flight included (down to `LOW_WATER` of the limit once
        any must go); mark the cache over its limit if they do not fit. Then sweep what
        evictions leave behind (`_sweep`). Returns the bytes counted after the evictions.
        Called in `turn`."""
        entries = []
        reserved = 0
        now = time.time()
        leftovers = []  # shards absent whose lock file or index is there
        occupied: dict[str, int] = {}  # by folder: its files other than lock files and indexes
        for base, folders, names in os.walk(self.root):
            depth = _depth(self.root, base)
            # The cache's own folders only (module doc): a cache_dir may be a folder that holds
            # other files too (~/.cache), and those are neither counted, nor evicted, nor swept.
            folders[:] = [f for f in folders if depth < 2 and _FOLDER.fullmatch(f)]
            if depth == 0:
                continue  # the root: the room's own files, and whatever else the folder holds
            occupied[base] = 0
            if depth == 1:
                continue  # a location's folder, of version folders
            leftovers += sorted({os.path.join(base, stem) for stem, suffix in map(os.path.splitext, names)
                                 if suffix in COMPANIONS and stem not in names})
            for name in names:
                full = os.path.join(base, name)
                if name.endswith(COMPANIONS):
                    continue
                if name.endswith(".part"):
                    reserved += _reserved_bytes(full, now)
                    occupied[base] += os.path.exists(full)  # unless abandoned, and deleted
                    continue
                occupied[base] += 1
                try:
                    st = os.stat(full)
                except FileNotFoundError:  # evicted meanwhile by hand
                    continue
                try:
                    index_bytes = os.path.getsize(full + ".idx")
                except FileNotFoundError:
                    index_bytes = 0
                entries.append((st.st_atime, full, st.st_size + index_bytes))  # last used (cache._mark_used)
        total = sum(size for _, _, size in entries) + reserved
        limit = self._room_for(total)
        # Where the shards in use (and downloads in flight) keep the cache above low water, this evicts
        # every shard not in use: fewer bytes than low water asks for when it can be reached, since what
        # is not in use is then under `total + incoming - LOW_WATER * limit`.
        target = limit if total + incoming <= limit else int(limit * LOW_WATER)
        for _, full, size in sorted(entries):
            if total + incoming <= target:
                break
            if self._evict(full):
                total -= size
                occupied[os.path.dirname(full)] -= 1
        marker = os.path.join(self.root, OVER_LIMIT)
        if total + incoming > limit:
            open(marker, "ab").close()
        elif os.path.exists(marker):
            os.remove(marker)
        self._sweep(leftovers, [folder for folder, n in occupied.items() if n == 0])
        return total

    def _sweep(self, leftovers: list[str], emptied: list[str]) -> None:
        """Delete the lock files and indexes of the shards in `leftovers`, which are not there
        (evicted by a walk killed midway, by hand, or by a version of this module that left
        them), and remove the location and version folders among `emptied` (found holding
        no shard and no download) that are empty now. Called in `turn`."""
        for path in leftovers:
            self._evict(path)  # unless a process holds its lock: downloading it, or about to
        # rmdir removes a folder only while it is empty, and a process about to use one that is
        # gone makes it again (cache.py's `_shared_lock`). Children first: os.walk listed parents first.
        for folder in reversed(emptied):
            if 1 <= _depth(self.root, folder) <= 2:
                with contextlib.suppress(OSError):
                    os.rmdir(folder)

    @staticmethod
    def _evict(path: str) -> bool:
        """Delete the copy at `path`, its index, its download lock and its lock file, unless a
        process holds the lock (reading the copy, or downloading it: a download lock is only
        taken while the lock is held). The lock file goes last, while this walk
        holds it: a process that opened it meanwhile finds, once it has the lock, that the
        file is no longer the one at the path (`names_file`) and starts again on a new one."""
        lock_path = path + ".lock"
        with open(lock_path, "a+b") as lock:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return False  # in use by a reader
            if not names_file(lock_path, lock):  # only walks delete lock files, and this one has the turn
                return False
            for victim in (path, path + ".idx", path + ".dl", lock_path):
                try:
                    os.remove(victim)
                except FileNotFoundError:
                    pass
            return True


@contextlib.contextmanager
def writing(path: str) -> Iterator[None]:
    """The cache's own disk failing (full, read-only, quota, I/O error) raises a `StorageError`
    naming the cache's file (the one the error names, else `path`), not a bare OSError, which
    said neither where nor that it was the cache; a full disk or quota, or a read-only one
    (remounted so after I/O errors), a `CacheFullError`: shards are then read uncached."""
    try:
        yield
    except ShardstreamError:
        raise
    except OSError as error:
        kind = CacheFullError if error.errno in (errno.ENOSPC, errno.EDQUOT, errno.EROFS) else StorageError
        raise kind(f"cannot write the cache: {error.strerror or error}",
                   url=str(error.filename) if error.filename else path) from error


def _read_ledger(root: str) -> tuple[int, float] | None:
    """(bytes counted, time of the walk they start from), or None: none yet, or unreadable
    (a process killed while writing it), which the next walk writes anew."""
    try:
        with open(os.path.join(root, LEDGER)) as f:
            counted, walked = f.read().split()
        return int(counted), float(walked)
    except (OSError, ValueError):
        return None


def _write_ledger(root: str, counted: int, walked: float) -> None:
    with open(os.path.join(root, LEDGER), "w") as f:
        f.write(f"{counted} {walked!r}\n")


def _swap_limit(root: str, limit: int) -> int | None:
    """The limit the last process that made room here had (None: none yet, or unreadable),
    `limit` written in its place where it differs. Called in `turn`."""
    path = os.path.join(root, LIMIT)
    try:
        with open(path) as f:
            found: int | None = int(f.read())
    except (OSError, ValueError):
        found = None
    if found != limit:
        with open(path, "w") as f:
            f.write(f"{limit}\n")
    return found


def _depth(root: str, folder: str) -> int:
    """How deep `folder` lies under the cache's `root`: 1 for a location's folder, 2 for a version's."""
    return 0 if folder == root else os.path.relpath(folder, root).count(os.sep) + 1


def names_file(path: str, lock: BinaryIO) -> bool:
    """Whether `path` names the file `lock` is open on, and not a later one (a walk deleted
    it). While `lock` is open its inode cannot be reused, so equal numbers are the same file."""
    try:
        there = os.stat(path)
    except FileNotFoundError:
        return False
    held = os.fstat(lock.fileno())
    return (there.st_dev, there.st_ino) == (held.st_dev, held.st_ino)


def _reserved_bytes(part: str, now: float) -> int:
    """The bytes a download's temporary file holds room for (its full size, set when it was
    created), or 0 once gone. Its download holds an exclusive `flock` on it: a walk that can
    take the lock knows the process downloading it has ended (killed, preempted, or a head
    start's thread cut off at exit) and deletes it. Where flock is not to be had (some
    network file systems), a file untouched for `ABANDONED_PART_S` is taken as abandoned."""
    try:
        with open(part, "rb") as f:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return os.fstat(f.fileno()).st_size  # a live download's
            except OSError:
                st = os.fstat(f.fileno())
                if now - st.st_mtime <= ABANDONED_PART_S:
                    return st.st_size
            os.remove(part)
    except FileNotFoundError:  # landed or given up meanwhile
        pass
    return 0
