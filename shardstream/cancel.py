"""Ending storage work early: reads whose results nobody will take.

An iteration that stops (a `break`, an error, Ctrl-C, the process exiting) leaves reads
running in its threads, and a thread pool's exit waits for them. Against failing
storage each one sits in its retries' backoff, about 33 s by default, so stopping took
that long; a head start's download, a daemon thread, was killed at exit mid-file and
left its reserved file in the cache. A `Cancellation` ends such work at its next
storage request or backoff: the threads that do it are bound to it (a pool's
initializer), and `RetryPolicy.call` asks before each try and waits on it between tries.
A request already on the wire runs to its end (or its timeout): sockets are not
interrupted.
"""

from __future__ import annotations

import threading
import time

from .errors import StorageError

__all__ = ["Cancellation", "ReadCancelled", "pause", "raise_if_cancelled"]

_bound = threading.local()


class ReadCancelled(StorageError):
    """A storage request not made, or not retried, because its work was cancelled."""


class Cancellation:
    """A flag shared by the threads of one piece of storage work."""

    def __init__(self) -> None:
        self._event = threading.Event()

    def bind(self) -> None:
        """Make this the calling thread's cancellation (use as a thread pool's initializer)."""
        _bound.cancellation = self

    def cancel(self) -> None:
        self._event.set()

    @property
    def cancelled(self) -> bool:
        return self._event.is_set()

    def wait(self, seconds: float) -> bool:
        """Sleep up to `seconds`; True if cancelled meanwhile (or before)."""
        return self._event.wait(seconds)


def _current() -> Cancellation | None:
    return getattr(_bound, "cancellation", None)


def raise_if_cancelled(url: str) -> None:
    """Raise `ReadCancelled` if the calling thread's work has been cancelled."""
    cancellation = _current()
    if cancellation is not None and cancellation.cancelled:
        raise ReadCancelled("cancelled: the reading that asked for it has ended", url=url)


def pause(seconds: float, url: str) -> None:
    """Sleep `seconds` between tries, or raise `ReadCancelled` as soon as the work is cancelled."""
    cancellation = _current()
    if cancellation is None:
        time.sleep(seconds)
        return
    if cancellation.wait(seconds):
        raise ReadCancelled("cancelled: the reading that asked for it has ended", url=url)
