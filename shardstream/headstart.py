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
iteration begins. The dataset asks for a head start only where it pays: remote stores
read without a cache (a cache's download of the next epoch's shards would hold them in
it, beside the current ones) and with prefetch on.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable

import numpy as np

from .errors import ShardstreamError
from .pieces import PieceKey, first_window, piece_key, sample_runs
from .reader import Sample
from .source import Source
from .stream import MAX_AHEAD, Readers, read_piece, read_tolerant, read_whole

__all__ = ["HeadStart"]


class HeadStart:
    """The pieces read ahead for the next iteration of one dataset in one process."""

    def __init__(self) -> None:
        self.iterations = 0  # that have taken from it: the iterations of its dataset in this process
        self._planner: threading.Thread | None = None
        self._pieces: dict[PieceKey, Future[list[Sample]]] = {}
        self._failure: Exception | None = None

    def begin(self, source: Source, next_ids: Callable[[], np.ndarray | None], counts: np.ndarray, prefetch: int,
              tolerant: bool, piece_bytes: int) -> None:
        """Read, in threads of their own, the first window of the iteration that reads the
        samples `next_ids()` names (as `stream.read_samples` would, with these settings).
        What an earlier `begin` read and nobody took is dropped."""
        for future in self._claim().values():
            future.cancel()
        ids = next_ids()
        if ids is None or not len(ids):
            return
        self._planner = threading.Thread(target=self._read, args=(source, ids, counts, prefetch, tolerant, piece_bytes),
                                         name="shardstream-headstart", daemon=True)
        self._planner.start()

    def _read(self, source: Source, ids: np.ndarray, counts: np.ndarray, prefetch: int, tolerant: bool,
              piece_bytes: int) -> None:
        # Planning needs the first shards' indexes (usually in the per-process memo): here, not
        # in the iterating thread, where the current iteration's last samples are wanted.
        readers = Readers(source, None)
        read = read_tolerant if tolerant else read_whole
        pool = ThreadPoolExecutor(max_workers=max(prefetch, MAX_AHEAD), thread_name_prefix="shardstream-headstart")
        try:
            for shard, (a, b, keep, _, _) in first_window(readers.get, list(sample_runs(ids, counts)), prefetch,
                                                          piece_bytes, MAX_AHEAD):
                self._pieces[piece_key(shard, a, b, keep, tolerant)] = pool.submit(read_piece, read, readers, shard,
                                                                                   a, b, keep)
        except ShardstreamError:
            pass  # an index that cannot be read: the next iteration reads it too, and meets the error in its turn
        except Exception as error:  # a bug: raised to the next iteration (`take`), not lost in this thread
            self._failure = error
        finally:
            pool.shutdown(wait=False)  # its threads end when their reads do

    def take(self) -> dict[PieceKey, Future[list[Sample]]]:
        """For an iteration beginning: the pieces the last `begin` read or is reading, now
        the caller's (this object holds none after)."""
        self.iterations += 1
        pieces = self._claim()
        failure, self._failure = self._failure, None
        if failure is not None:
            raise failure
        return pieces

    def _claim(self) -> dict[PieceKey, Future[list[Sample]]]:
        if self._planner is not None:
            self._planner.join()  # the plan is quick; its reads go on in their own threads
            self._planner = None
        pieces, self._pieces = self._pieces, {}
        return pieces
