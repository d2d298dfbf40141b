"""The few numbers a dataset shares with its DataLoader workers, in shared memory.

`set_epoch` in the main process must reach persistent workers; workers' storage and
skip counters must be readable in the main process; a resume state must be used up
once the workers have finished the resumed epoch. All of it fits in two small arrays
with one slot per worker, so no locks are needed (each worker writes only its slot).

Shared memory crosses into workers when they are started, whatever the start method
(fork, spawn, forkserver). Pickled in any other way (``copy.deepcopy``, saving a
dataset), the state is copied into fresh shared memory instead, so a dataset stays a
value; and so does a process started with the dataset that is not a DataLoader worker
of its process (the training processes of `torch.multiprocessing.spawn`), at its first
use of the state or before it forks, whichever comes first (`SharedState._adopt`).
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.sharedctypes
import os
import weakref
from multiprocessing.context import get_spawning_popen
from typing import Any, Generic, TypeVar

import numpy as np

__all__ = ["SharedState", "IO_FIELDS", "SLOTS"]

# Workers per process that have a slot: at most this many DataLoader workers iterate a dataset
# (StreamingDataset refuses more). 64 dropped the skips, storage counts and resume bookkeeping of
# workers 64 and up without a word; this many cost 73 KB of shared memory a dataset.
SLOTS = 1024
IO_FIELDS = ("requests", "bytes", "remote_bytes", "retries", "wait_s", "cache_hits", "cache_misses", "readahead_waits")
_EPOCH, _RESUME_ID, _SKIPS, _DONE = 0, 1, 2, 2 + SLOTS  # offsets in the int array
_WORKERS, _UNREAD, _LOADER_COPY, _LOADED = 2 + 2 * SLOTS, 3 + 2 * SLOTS, 4 + 2 * SLOTS, 5 + 2 * SLOTS
_RESUMED_BY = 6 + 2 * SLOTS  # the workers of the pass that read the resumed epoch (0: none has finished it)
_EPOCH_SET = 7 + 2 * SLOTS  # 1 once the training loop has chosen the epoch with set_epoch
_FINISHED = 8 + 2 * SLOTS  # 1 + the epoch a loop last received whole (0: none yet)
_REPEAT_SAID = 9 + 2 * SLOTS  # 1 once a process has warned of an epoch's order read again
_PLAIN = 10 + 2 * SLOTS  # 1 once the dataset itself (not shardstream.DataLoader's copy) began a pass
_MIX_SAID = 11 + 2 * SLOTS  # 1 once a process has warned of a mix's sources numbering classes apart
_INTS = 12 + 2 * SLOTS


T = TypeVar("T", int, bool)


class _Slot(Generic[T]):
    """An attribute of `SharedState` kept in a slot of its shared int array, read as `kind`."""

    def __init__(self, index: int, kind: type[T], doc: str) -> None:
        self.index, self.kind, self.__doc__ = index, kind, doc

    def __get__(self, state: "SharedState | None", owner: type | None = None) -> T:
        if state is None:  # on the class: the slot itself (help(), documentation tools)
            return self  # type: ignore[return-value]
        return self.kind(state._ints[self.index])

    def __set__(self, state: "SharedState", value: T) -> None:
        state._ints[self.index] = int(value)


class SharedState:
    def __init__(self, ints: list[int] | None = None, floats: list[float] | None = None) -> None:
        self._arrays = (multiprocessing.sharedctypes.RawArray("q", ints or [0] * _INTS),
                        multiprocessing.sharedctypes.RawArray("d", floats or [0.0] * (SLOTS * len(IO_FIELDS))))
        self._owner = os.getpid()  # the process whose DataLoader workers share the memory
        _states.add(self)

    @property
    def _ints(self) -> Any:
        return self._mine()[0]

    @property
    def _floats(self) -> Any:
        return self._mine()[1]

    def _mine(self) -> tuple[Any, Any]:
        if self._owner != os.getpid():
            self._adopt()
        return self._arrays

    def _adopt(self) -> None:
        """In a process other than the one whose memory this is: a DataLoader worker of it
        shares the memory (what they tell each other goes through it); any other takes a copy
        of its own, as a value. Processes that `torch.multiprocessing.spawn` (or a fork)
        handed the dataset are training processes, each its own: sharing one memory, each
        saw the others' `set_epoch`, skips and loaded states (a rank read its share again,
        resumed by another's load, and DDP hung on the uneven batch counts)."""
        from torch.utils.data import get_worker_info

        if get_worker_info() is None:
            ints, floats = self._arrays
            self.__init__(list(ints), list(floats))  # type: ignore[misc]
        self._owner = os.getpid()

    def __getstate__(self) -> dict[str, Any]:
        ints, floats = self._mine()
        if get_spawning_popen() is not None:  # starting a process: the memory itself (`_adopt` decides)
            return {"ints": ints, "floats": floats, "owner": self._owner}
        return {"ints": list(ints), "floats": list(floats)}  # a copy, as a value

    def __setstate__(self, state: dict[str, Any]) -> None:
        if isinstance(state["ints"], list):
            self.__init__(state["ints"], state["floats"])  # type: ignore[misc]
        else:
            self._arrays, self._owner = (state["ints"], state["floats"]), state["owner"]
            _states.add(self)

    # -- epoch, and what the processes tell each other of iterations and loaded states --

    epoch = _Slot(_EPOCH, int, "The epoch the next iteration reads (`set_epoch`, or a loaded state's).")
    epoch_chosen = _Slot(_EPOCH_SET, bool, "Whether the training loop chose the epoch (`set_epoch`), rather than "
                         "a loaded state.")
    finished_epoch = _Slot(_FINISHED, int, "1 + the epoch a loop last received whole (shardstream.DataLoader's, "
                           "or one in the dataset's process); 0 before any.")
    plain_iterated = _Slot(_PLAIN, bool, "Whether an iteration of the dataset itself, not of "
                           "shardstream.DataLoader's copy (torch's loop, or the dataset's own), began since the last "
                           "state loaded or epoch set: its loop counts what it received, and may take a state.")
    repeat_said = _Slot(_REPEAT_SAID, bool, "Whether a process (a worker) has warned of a shuffled epoch's "
                        "order read again without set_epoch: said once a dataset, not once each worker.")
    mix_said = _Slot(_MIX_SAID, bool, "Whether a process has warned that a mix's sources give one label to "
                     "different classes: said once a dataset, not once each worker and epoch.")
    iterating_workers = _Slot(_WORKERS, int, """The `num_workers` of the DataLoader whose workers iterate the
        dataset last began (0: it was iterated in its own process last, or loaded since): the main
        process cannot count what such workers deliver, so `state_dict` asks for the count.""")
    loaded_unread = _Slot(_UNREAD, bool, "A state was loaded, and no iteration has begun since (in any process).")
    loader_copy_iterates = _Slot(_LOADER_COPY, bool, """The iteration begun last is that of
        `shardstream.DataLoader`'s copy of the dataset (in this process or its workers): the caller's
        dataset has not seen what it read.""")
    loaded_resume = _Slot(_LOADED, int, """The id of the state the main process loaded last and still holds
        (0: none, or it was dropped for another epoch): a persistent worker started before it was
        loaded does not have it (`Checkpointing._state_not_reached`).""")

    # -- resume: used up once every worker has finished the resumed epoch ------------
    # A worker's slot: 0 while it reads the resumed pass, 1 once it has finished it, 2 once
    # it has begun another pass after it.

    def new_resume(self) -> int:
        """Mark a newly loaded resume state; returns its id."""
        self._ints[_RESUME_ID] += 1
        for w in range(SLOTS):
            self._ints[_DONE + w] = 0
        self._ints[_RESUMED_BY] = 0
        return int(self._ints[_RESUME_ID])

    def finish_resume(self, resume_id: int, worker: int, workers: int) -> None:
        """`worker` of a pass of `workers` has read the resumed epoch to its end."""
        if self._ints[_RESUME_ID] == resume_id and worker < SLOTS:
            self._ints[_DONE + worker] = 1
            self._ints[_RESUMED_BY] = workers

    def begin_pass(self, worker: int) -> None:
        """`worker` begins a pass without a resume state: if it finished the resumed pass
        before, the epoch has started afresh (`later_pass`)."""
        if worker < SLOTS and self._ints[_DONE + worker] == 1:
            self._ints[_DONE + worker] = 2

    def later_pass(self) -> bool:
        """Whether a worker has begun a pass after finishing the resumed one."""
        return any(self._ints[_DONE + w] == 2 for w in range(SLOTS))

    def resume_begun_to_end(self, resume_id: int) -> bool:
        """Whether any worker has read the resumed epoch to its end (and so forgot it)."""
        if self._ints[_RESUME_ID] != resume_id:
            return True
        return any(self._ints[_DONE + w] for w in range(SLOTS))

    def resume_used_up(self, resume_id: int, workers: int) -> bool:
        """True once every worker of the pass that read the resumed epoch has finished it
        (later passes start afresh, with any number of workers: a pass of 3 after one of 2
        replayed the resumed remainder, its third slot never finished); before any has,
        asked of a pass of `workers`."""
        if self._ints[_RESUME_ID] != resume_id:
            return True
        readers = self._ints[_RESUMED_BY] or workers
        return all(self._ints[_DONE + w] for w in range(min(readers, SLOTS)))

    # -- counters --------------------------------------------------------------------

    def add_skip(self, worker: int) -> None:
        if worker < SLOTS:
            self._ints[_SKIPS + worker] += 1

    @property
    def skips(self) -> int:
        return int(sum(self._ints[_SKIPS : _SKIPS + SLOTS]))

    def add_io(self, worker: int, before: dict[str, float], after: dict[str, float]) -> None:
        """Add what a process's storage counters gained from `before` to `after` to `worker`'s slot.

        Differences, not the counters themselves: a forked worker starts with its parent's
        counts, later epochs' workers start afresh, and other datasets of the process count
        outside this dataset's iterations."""
        if worker < SLOTS:
            base = worker * len(IO_FIELDS)
            for i, name in enumerate(IO_FIELDS):
                self._floats[base + i] += after[name] - before[name]

    def io(self) -> dict[str, float]:
        # Summed by numpy over the shared memory itself: 18 us, where indexing every slot's
        # every field from Python took 3.3 ms (a loop logging io_stats() each step paid it).
        slots = np.frombuffer(self._floats, dtype=np.float64).reshape(SLOTS, len(IO_FIELDS))
        return dict(zip(IO_FIELDS, slots.sum(axis=0).tolist()))


# Every state of this process, for `_adopt_before_fork`.
_states: "weakref.WeakSet[SharedState]" = weakref.WeakSet()


def _adopt_before_fork() -> None:
    """A process about to fork (its DataLoader workers, most often) first adopts the states it
    was handed and has not used yet (`SharedState._adopt`): forked workers share what their
    parent holds at the fork, and a training process that `torch.multiprocessing.spawn`
    started, forking workers before it used the state, had them share the launcher's memory
    (with the other ranks' workers) while it adopted a copy of its own later: its
    `set_epoch` never reached them, and every epoch read epoch 0's order."""
    for state in list(_states):
        if state._owner != os.getpid():
            state._adopt()


if hasattr(os, "register_at_fork"):  # not on Windows, which has no fork either
    os.register_at_fork(before=_adopt_before_fork)
