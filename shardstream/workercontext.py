"""The multiprocessing context the loader's workers start in: the caller's, with a
lock-free "done" flag in place of torch's shared `Event`.

torch's DataLoader tells its workers that the epoch is over through a
`multiprocessing.Event` made by the context it is given. Such an event is a
condition over a lock in shared memory, and every worker takes that lock to read the
event, once a batch. A worker killed outright while it holds the lock (the
out-of-memory killer picks the moment) leaves it held forever, and the training
process, which takes it to shut the workers down, then waits forever too: torch's
own DataLoader has this hang (RELIABILITY.md, 211). The event only ever goes from
unset to set, and torch only sets it and asks whether it is set, so one byte of shared
memory does the same without a lock, and a worker can die anywhere without taking
the training process with it.
"""

from __future__ import annotations

import ctypes
import functools
import multiprocessing
import multiprocessing.context
from typing import Any

__all__ = ["SharedFlag", "lock_free_context"]


class SharedFlag:
    """The part of `multiprocessing.Event` torch's DataLoader uses (`is_set`, `set`,
    `clear`), as one byte of shared memory that no lock guards: a single byte's store
    and load cannot tear, and the flag's readers only poll it."""

    def __init__(self, context: multiprocessing.context.BaseContext):
        self._value = context.RawValue(ctypes.c_bool, False)

    def is_set(self) -> bool:
        return bool(self._value.value)

    def set(self) -> None:
        self._value.value = True

    def clear(self) -> None:
        self._value.value = False


@functools.lru_cache(maxsize=None)
def _lock_free_class(base: type) -> type:
    def event(self: Any) -> SharedFlag:
        return SharedFlag(self)

    return type(f"LockFree{base.__name__}", (base,), {"Event": event, "__module__": __name__})


def lock_free_context(context: str | multiprocessing.context.BaseContext | None) -> multiprocessing.context.BaseContext:
    """`context` (a start method's name, a context, or None for the default start method)
    as a context whose `Event()` is a `SharedFlag`; everything else is the context's own."""
    if not isinstance(context, multiprocessing.context.BaseContext):
        context = multiprocessing.get_context(context)
    lock_free = object.__new__(_lock_free_class(type(context)))
    lock_free.__dict__.update(context.__dict__)
    return lock_free
