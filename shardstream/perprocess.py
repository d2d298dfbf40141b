"""Values made once per process: what a forked child must not share with its parent.

A connection pool, a botocore client or the deadline watchdog's thread belong to the
process that made them: a DataLoader worker forked from a process that has used them
must make its own (a pooled socket shared by two processes mixes their responses;
a thread does not survive a fork at all). A lock a parent's thread held at the fork
stays held in the child forever, so the child gets new locks too.
"""

from __future__ import annotations

import os
import threading
from typing import Any, Callable

__all__ = ["PerProcess"]


class PerProcess:
    """A value made on first use in each process: a forked child makes its own (connections
    must not be shared with the parent), and gets a new lock (a parent's thread may have held
    the old one at the fork)."""

    _all: list["PerProcess"] = []

    def __init__(self, make: Callable[[], Any]):
        self.make = make
        self._lock = threading.Lock()
        self._value: Any = None
        PerProcess._all.append(self)

    def get(self) -> Any:
        with self._lock:
            if self._value is None:
                self._value = self.make()
            return self._value

    def _forget(self) -> None:
        self._lock = threading.Lock()
        self._value = None


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=lambda: [holder._forget() for holder in PerProcess._all])
