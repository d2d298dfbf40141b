"""The deadline watchdog: one thread that stops blocks (ranged reads) outliving their deadlines.

A request's timeouts bound each wait on its socket, not the request: a server that
trickles a byte within every read timeout would hold a reader forever. deadlines.py
gives each request a deadline (`deadlines.deadline_s`) and watches its reads here;
when the deadline passes, the watchdog calls the read's `stop` (which shuts its
socket) from its own thread. Deadlines are counted in each read's share of the time,
so reads that share a slow link are not failed for sharing it. This module knows
nothing of HTTP: only blocks, deadlines and the thread that watches them;
deadlines.py holds one `Watchdog` per process (`PerProcess`).
"""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Callable, Iterator

__all__ = ["Watchdog", "Watch", "IDLE_S"]


# How often the watchdog's thread looks at the reads it watches, and how long it outlives
# the last: it ends once it has found none watched for this long. It is not woken as each
# read ends: woken so (as first written), it cost 150-210 us of CPU a read more than no
# deadlines at all (1,000 ranged reads of 4 KB one after another from a local server, 2
# busy cores: 390-440 us a read), and not woken, 30-45 us; a thread started and ended
# per read cost about 0.5 ms of CPU a read.
IDLE_S = 0.25


class Watch:
    """A watched block: when its deadline comes (in `Watchdog._shared`), what stops it, and
    whether that ran."""

    __slots__ = ("ends", "stop", "fired")

    def __init__(self, ends: float, stop: Callable[[], None]) -> None:
        self.ends, self.stop, self.fired = ends, stop, False


class Watchdog:
    """Stops reads that outlive their deadline, from one thread.

    A deadline is counted in the read's share of the time: while n watched reads are in
    flight, each one's clock runs at 1/n speed. Reads at once share a link (a DataLoader
    worker prefetches 6 pieces): counted in plain seconds, a link too slow for all of them
    failed them all, and their retries again, where each alone met its deadline.

    The thread runs only while watched reads are in flight, and ends between `IDLE_S`
    and twice that after the last: an idle process holds none, a forked child starts
    without one (`PerProcess`), and no read waits for it to end.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._watched: set[Watch] = set()
        self._thread: threading.Thread | None = None
        self._waking = float("inf")  # when the thread wakes up next, unless told
        self._shared = 0.0  # seconds of each watched read's share of the time, summed since the start
        self._counted = time.monotonic()  # when `_shared` was brought up to date

    def _count(self) -> float:
        """Bring `_shared` up to date (under the lock, before `_watched` changes); the time now."""
        now = time.monotonic()
        if self._watched:
            self._shared += (now - self._counted) / len(self._watched)
        self._counted = now
        return now

    @contextlib.contextmanager
    def watch(self, seconds: float, stop: Callable[[], None]) -> Iterator[Watch]:
        """Call `stop` from the watchdog's thread if the block still runs after `seconds` of
        its share of the time, and never once it is over; yields the watch, whose `fired`
        says, after the block, whether it did."""
        with self._cond:
            now = self._count()
            watch = Watch(self._shared + seconds, stop)
            if self._thread is None:
                thread = threading.Thread(target=self._run, name="shardstream-deadlines", daemon=True)
                thread.start()  # if it cannot (no memory for a stack), nothing is left half done
                self._thread = thread
            elif now + seconds * (len(self._watched) + 1) < self._waking:
                self._cond.notify()
            self._watched.add(watch)
        try:
            yield watch
        finally:
            with self._cond:  # `stop` runs under this lock: once this is done, it never will
                self._count()
                self._watched.discard(watch)

    def _run(self) -> None:
        with self._cond:
            try:
                idle_since = None
                while True:
                    now = self._count()
                    if self._watched:
                        idle_since = None
                        first = min(self._watched, key=lambda watch: watch.ends)
                        if first.ends <= self._shared:
                            self._watched.discard(first)
                            first.fired = True
                            first.stop()
                            continue
                        # Not woken as reads end (and the others' shares grow): it looks again in IDLE_S.
                        self._waking = now + min((first.ends - self._shared) * len(self._watched), IDLE_S)
                    else:
                        idle_since = now if idle_since is None else idle_since
                        self._waking = idle_since + IDLE_S
                        if self._waking <= now:
                            return
                    self._cond.wait(self._waking - now)
            finally:
                self._thread, self._waking = None, float("inf")  # the next watched read starts another
