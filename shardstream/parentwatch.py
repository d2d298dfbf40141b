"""A DataLoader worker ends when the training process does.

torch's workers look for their parent between batches (`ManagerWatchdog`), so a worker
busy when the training process died (SIGKILL by the out-of-memory killer or a
scheduler; a SIGTERM without a handler) went on until it next asked for work: one
blocked in a slow read, a stuck transform, or a queue's feeder thread writing into a
pipe nobody reads any more, lived on with its parent gone (found by review: 3 such
workers after a kill loop, one still there minutes later). A thread of the worker's
own waits on the parent's sentinel and ends the worker the moment the parent ends.
Nothing a worker holds needs cleaning when it ends so (`worker_waits_for_its_parent_on_sigterm`).
"""

from __future__ import annotations

import multiprocessing
import os
import threading

__all__ = ["end_with_parent"]

_watching_in: int | None = None  # the process whose thread watches: a forked child starts its own
_lock = threading.Lock()


def end_with_parent() -> None:
    """In a DataLoader worker: end this process at once when its parent ends (once a process;
    a process with no multiprocessing parent is left alone)."""
    global _watching_in
    with _lock:
        if _watching_in == os.getpid():
            return
        parent = multiprocessing.parent_process()
        if parent is None:
            return
        _watching_in = os.getpid()
    threading.Thread(target=_exit_with, args=(parent,), name="shardstream-parent-watch", daemon=True).start()


def _exit_with(parent: multiprocessing.process.BaseProcess) -> None:
    try:
        parent.join()  # its sentinel: returns once the parent process has ended
    except (OSError, ValueError):  # the sentinel closed under it (code of the worker's closing fds): no watch
        return
    os._exit(0)
