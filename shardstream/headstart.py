"""A head start on the next iteration: its first pieces read while the current one ends.

Over remote storage each iteration would begin with its worker waiting a request's
latency for the first piece (50 ms and more on S3), while the link sat idle through
the end of the iteration before, whose reads were all in and whose last samples were
only being decoded and handed over. With persistent DataLoader workers that wait comes
back every epoch. So when an iteration's reads are all in, the dataset says which
samples the next one will read (the next epoch, same layout: what a training loop's
``set_epoch(epoch + 1)`` asks for), and the first pieces of that are read then: the
window of pieces the next iteration would have in flight when its first sample is
due (`pieces.first_window`). The next iteration takes those of its pieces that are
here, and the rest are dropped. Only a process that has begun a second iteration of a
dataset reads ahead for a third: a DataLoader worker that is not persistent, or a
one-off pass, never gets the next iteration its reads would be for.

A piece is known by what it reads (`pieces.piece_key`), so a wrong guess (another
epoch, a resume, a changed seed) costs the bytes of one window and never a wrong
sample. It costs memory too: at the end of an iteration a worker may hold one window
more (`prefetch` pieces, or up to half of `prefetch` full pieces' bytes) until the next
iteration begins. With a cache (`cache_dir`), the head start downloads the next
iteration's first shard into it instead, where a cache smaller than the dataset has
evicted it since: else each epoch would begin waiting for a whole shard's download.
The copy is held (a shared lock) until the next iteration opens it, as a shard in use
is, so the cache may go over its limit by that shard meanwhile. The dataset asks for a
head start only where it pays: remote stores, with prefetch on.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from typing import BinaryIO, Callable, Iterator

import numpy as np

from .cache import ShardCache
from .cancel import Cancellation
from .errors import ShardstreamError
from .iostats import IOStats, count_into
from .pieces import PieceKey, adjacent_repeats, first_window, piece_key, sample_runs
from .reader import Sample
from .source import Source
from .stream import MAX_AHEAD, Readers, read_piece, read_tolerant, read_whole

__all__ = ["HeadStart"]

STOP_WAIT_S = 5.0  # at exit, for a download to end at its next request (one chunk)
_live: weakref.WeakSet[HeadStart] = weakref.WeakSet()


def _stop_all() -> None:
    for head in list(_live):
        head.stop()


# At interpreter exit (in DataLoader workers too: multiprocessing's exit runs it), before
# concurrent.futures joins its pools' threads: hooks run last registered first, and
# concurrent.futures registered its own on import, above. A private hook, where there is one.
_register_atexit = getattr(threading, "_register_atexit", None)
if _register_atexit is not None:
    _register_atexit(_stop_all)


class HeadStart:
    """The head start of one dataset's next iteration in one process: the pieces read
    ahead, or with a cache the download of its first shard."""

    def __init__(self) -> None:
        self.iterations = 0  # that have taken from it: the iterations of its dataset in this process
        self._planner: threading.Thread | None = None
        self._pieces: dict[PieceKey, Future[list[Sample]]] = {}
        self._held: dict[int, BinaryIO] = {}  # shard: the shared lock on its copy in the cache
        self._cache: ShardCache | None = None  # the cache of its last download, if any
        self._failure: Exception | None = None
        self._cancellation = Cancellation()  # its reads' (cancel.py): at the process's exit
        # What its threads ask of storage: the next count of its dataset's iteration takes it
        # (iostats.py), since the reads run between iterations, outside their counts.
        self.io = IOStats()
        # Called once its threads are done at `stop`, to count `io` where no next iteration will:
        # the last epoch's head start (a window of pieces, 23% of the bytes of a 3-epoch run of
        # large samples) went uncounted when the workers exited.
        self.count_at_stop: Callable[[], None] | None = None
        _live.add(self)

    def stop(self) -> None:
        """End its reads at their next request or backoff, and wait (briefly) for its
        download, which then removes its partial files, and let go of what it holds
        (`_let_go`): at exit, where no next iteration will come, and the threads would be
        waited for, or killed mid-file."""
        self._cancellation.cancel()
        planner = self._planner
        if planner is not None and planner.is_alive():
            planner.join(STOP_WAIT_S)
        if planner is None or not planner.is_alive():
            self._let_go()
            if self.count_at_stop is not None:
                with contextlib.suppress(Exception):  # at exit: counters that cannot be written stay as they are
                    self.count_at_stop()

    def _let_go(self) -> None:
        """Let go of the copies downloaded for an iteration that will not come, and trim the
        cache that they, or the room made for a download cut off, may have left over its limit:
        else a shard, and the cache's mark that it is over its limit, stayed after the process
        exited, until another came to trim."""
        _, held = self._claim()
        for lock in held.values():
            lock.close()
        if self._cache is not None:
            with contextlib.suppress(ShardstreamError):  # at exit: a cache that cannot be written is left as it is
                self._cache.trim()

    def begin(self, source: Source, next_ids: Callable[[], np.ndarray | None], counts: np.ndarray, prefetch: int,
              tolerant: bool, piece_bytes: int, cache: ShardCache | None = None) -> None:
        """Read, in threads of their own, the first window of the iteration that reads the
        samples `next_ids()` names (as `stream.read_samples` would, with these settings);
        with a `cache`, download its first shard into the cache instead. What an earlier
        `begin` read and nobody took is dropped."""
        pieces, held = self._claim()
        for future in pieces.values():
            future.cancel()
        for lock in held.values():
            lock.close()
        ids = next_ids()
        if ids is None or not len(ids):
            return
        ids = adjacent_repeats(ids)[0]  # as `stream.read_samples` plans: an id in a row read once
        if cache is not None:
            work, args = self._download, (cache, source, next(sample_runs(ids, counts))[0])
        else:
            work, args = self._read, (source, ids, counts, prefetch, tolerant, piece_bytes)
        self._planner = threading.Thread(target=work, args=args, name="shardstream-headstart", daemon=True)
        self._planner.start()

    def _bind_thread(self) -> None:
        """Make the calling thread one of this head start's: cancelled with it, counted in `io`."""
        self._cancellation.bind()
        count_into(self.io)

    def _download(self, cache: ShardCache, source: Source, shard: int) -> None:
        # The copy's shared lock is held until the next iteration opens the shard (`take`,
        # `Readers.hold`): the shards this iteration still holds may keep the cache over its
        # limit, and a trim would evict the only copy it could, this one.
        self._bind_thread()
        self._cache = cache
        with self._errors_kept():
            _, lock = cache.open(source.shards[shard])
            self._held[shard] = lock

    def _read(self, source: Source, ids: np.ndarray, counts: np.ndarray, prefetch: int, tolerant: bool,
              piece_bytes: int) -> None:
        # Planning needs the first shards' indexes (usually in the per-process memo): here, not
        # in the iterating thread, where the current iteration's last samples are wanted.
        self._bind_thread()  # the index reads of planning
        readers = Readers(source, None)
        read = read_tolerant if tolerant else read_whole
        pool = ThreadPoolExecutor(max_workers=max(prefetch, MAX_AHEAD), thread_name_prefix="shardstream-headstart",
                                  initializer=self._bind_thread)
        try:
            with self._errors_kept():
                for shard, (a, b, keep, _, _) in first_window(readers.get, list(sample_runs(ids, counts)), prefetch,
                                                              piece_bytes, MAX_AHEAD):
                    self._pieces[piece_key(shard, a, b, keep, tolerant)] = pool.submit(read_piece, read, readers,
                                                                                       shard, a, b, keep)
        finally:
            pool.shutdown(wait=False)  # its threads end when their reads do

    @contextlib.contextmanager
    def _errors_kept(self) -> Iterator[None]:
        """In the head start's thread: a storage error (or a bad index) is left to the next
        iteration, which reads the same and meets it in its own turn; anything else is a
        bug, raised to the next iteration when it takes the head start, not lost here."""
        try:
            yield
        except ShardstreamError:
            pass
        except Exception as error:
            self._failure = error

    def take(self) -> tuple[dict[PieceKey, Future[list[Sample]]], dict[int, BinaryIO]]:
        """For an iteration beginning: the pieces the last `begin` read or is reading, and
        the shared locks on the shards it downloaded into the cache, now the caller's (this
        object holds none after; close the locks when done with those shards)."""
        self.iterations += 1
        taken = self._claim()
        failure, self._failure = self._failure, None
        if failure is not None:
            for future in taken[0].values():
                future.cancel()
            for lock in taken[1].values():
                lock.close()
            raise failure
        return taken

    def _claim(self) -> tuple[dict[PieceKey, Future[list[Sample]]], dict[int, BinaryIO]]:
        if self._planner is not None:
            # Planning is quick, and its reads go on in their own threads; a download into the
            # cache is waited for, as the next iteration's first `cache.open` would wait for it.
            self._planner.join()
            self._planner = None
        pieces, self._pieces = self._pieces, {}
        held, self._held = self._held, {}
        return pieces, held
