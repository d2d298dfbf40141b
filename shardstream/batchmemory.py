"""Shared memory for batches, reused from batch to batch in DataLoader workers.

A DataLoader worker ships each batch to the training process in shared memory: torch's
collate stacks a batch into a fresh shared-memory tensor, and the worker process sends
its file descriptor. Fresh memory is the expensive part. Every page of a 9.6 MB batch of
64 uint8 images at 224x224 faults when first written, and a kernel that hands freed
memory back to its host (cloud VMs with free page reporting, this project's machine)
faults to the host for each. Measured here: 8.9-9.2 ms to stack such a batch into fresh
shared memory against 0.7-1.1 ms into memory already touched; a DataLoader worker
decoding and cropping ImageNet-sized JPEGs ran 7-14% faster with its batches' memory
reused (BENCHMARKS.md).

So `collate_tensors` stacks (and `collate.pad_collate` pads) into a worker's
`BatchMemory`: a few shared-memory buffers (slots), each used again once the training
process has let go of the batch it held.
Letting go is seen where it happens, in the training process: a pooled buffer is
unpickled there by `rebuild_pooled`, which keeps a weak reference to its storage (torch's
`StorageWeakRef`, which lives as long as any view of the batch does) and, when that
reference has expired, writes the slot's release into a small board the worker shares.
The worker reuses a slot only when the board says it was released; when none is, it
takes another slot, up to `SLOTS`, then falls back to torch's fresh memory. So a
training loop that keeps every batch gets them all intact, only not faster.

Releases are noticed when the next batch of a worker arrives (any worker's, pooled or in
fresh memory), which is when they are needed. A slot is reused only when the worker, too,
holds nothing of it: a collate_fn may keep its last batch to mix into the next. A pooled
batch the training process sends on to another process (a torch.multiprocessing queue)
is never released: that process may read it after the training process has let go. A process forked from the training process (another
loader's worker) starts with nothing to release: the batches are its parent's. What
stays unguarded: such a child reading a batch through its inherited copy after the
parent let go of it. Only
torch's ``file_descriptor`` sharing strategy (Linux's default) is pooled; under
``file_system`` batches take torch's own path.
"""

from __future__ import annotations

import contextlib
import functools
import math
import multiprocessing.reduction
import os
import threading
from typing import Any, Callable, Iterator, Sequence

import torch
import torch.multiprocessing
from torch.multiprocessing.reductions import StorageWeakRef, reduce_storage
from torch.utils.data._utils.collate import collate_tensor_fn

__all__ = ["BatchMemory", "collate_tensors", "one_batch", "pooled_tensor", "rebuild_pooled", "rebuild_noticing"]

SLOTS = 16  # buffers per worker at most: a worker's batches in flight, with a margin
FIT = 2  # a tensor takes a slot at most this many times its size


class BatchMemory:
    """One worker process's reusable shared-memory buffers (module doc)."""

    def __init__(self, slots: int = SLOTS) -> None:
        # board[s]: how many times the training process has released slot s; a slot is
        # free when that equals how many times the worker has shipped it (sent it to the
        # training process) and nothing here holds it. Handed out but never shipped (a
        # collate_fn that calls ours and ships something made from it: MixUp), nothing
        # would ever release it: counted against handouts, such a slot stayed taken for good.
        self.board = torch.zeros(slots, dtype=torch.int64).share_memory_()
        self._released = self.board.numpy()
        self._handed_out = [0] * slots
        self._shipped = [0] * slots  # `_handed_out` as it stood when the slot was last pickled
        self._storages: list[torch.UntypedStorage | None] = [None] * slots
        self._slot_at: dict[int, int] = {}  # a slot's storage data_ptr -> the slot (never 0: see `tensor`)
        self._batch: list[int] | None = None  # slots handed out in the open `one_batch` block
        self.pid = os.getpid()  # the slots are shared memory: a forked child must not write them

    def tensor(self, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor | None:
        """A tensor of `shape` in a free slot, handed out until released; None if none is free,
        or if the tensor holds nothing (every empty storage has data_ptr 0, so empty slots
        could not be told apart; an empty tensor costs nothing to make anyway)."""
        nbytes = math.prod(shape) * dtype.itemsize
        slot = self._free_slot(nbytes) if nbytes else None
        if slot is None:
            return None
        storage = self._storages[slot]
        if storage is None or storage.nbytes() < nbytes:
            storage = self._allocate(slot, nbytes)
        self._handed_out[slot] += 1
        if self._batch is not None:
            self._batch.append(slot)
        return torch.empty(0, dtype=dtype).set_(storage, 0, tuple(shape))

    @contextlib.contextmanager
    def one_batch(self) -> Iterator[None]:
        """Slots handed out in this block are taken back if it raises: a batch that fails
        to collate is never shipped, so nothing would ever release them. Blocks nest."""
        outer, self._batch = self._batch, []
        try:
            yield
        except BaseException:
            for slot in self._batch:
                self._handed_out[slot] -= 1
            self._batch = outer
            raise
        if outer is not None:
            outer.extend(self._batch)
        self._batch = outer

    def handed_out(self, storage: torch.UntypedStorage) -> tuple[int, int] | None:
        """(slot, times handed out) if `storage` is one of the slots, else None."""
        slot = self._slot_at.get(storage.data_ptr())
        return None if slot is None else (slot, self._handed_out[slot])

    def shipping(self, storage: torch.UntypedStorage) -> tuple[int, int] | None:
        """`handed_out`, for pickling `storage` to the training process, which will release
        that count once it lets go (`rebuild_pooled`)."""
        handed = self.handed_out(storage)
        if handed is not None:
            self._shipped[handed[0]] = handed[1]
        return handed

    def _free_slot(self, nbytes: int) -> int | None:
        # Free: released by the training process as often as shipped to it, and held by
        # nothing here but the pool. A collate_fn that keeps its last batch (to mix into the
        # next) still reads it: reused, it was overwritten under that collate.
        free = [s for s, n in enumerate(self._shipped)
                if self._released[s] == n and _only_pooled(self._storages[s])]
        size = {s: (st.nbytes() if (st := self._storages[s]) is not None else -1) for s in free}
        # The closest fit, and none more than FIT times too large: a small field (labels) in
        # an image batch's slot pinned the whole slot as long as the loop kept the labels.
        fits = [s for s in free if nbytes <= size[s] <= FIT * nbytes]
        if fits:
            return min(fits, key=size.__getitem__)
        # Else a slot a little too small is grown (see `tensor`) before a new one is opened:
        # batches of varying shapes (padded to their longest) opened a slot for each new
        # largest size, up to SLOTS a worker, where the batches in flight need about four.
        near = [s for s in free if nbytes <= FIT * size[s] < FIT * nbytes]
        if near:
            return max(near, key=size.__getitem__)
        empty = [s for s in free if size[s] < 0]
        too_small = [s for s in free if 0 <= size[s] < nbytes]
        # Only slots much larger are free: they stay for the batches that fill them, and
        # this tensor takes torch's fresh memory.
        return (empty or sorted(too_small, key=size.__getitem__, reverse=True) or [None])[0]

    def _allocate(self, slot: int, nbytes: int) -> torch.UntypedStorage:
        old = self._storages[slot]
        if old is not None:
            del self._slot_at[old.data_ptr()]
        storage = torch.empty(nbytes, dtype=torch.uint8).share_memory_().untyped_storage()
        self._storages[slot] = storage
        self._slot_at[storage.data_ptr()] = slot
        return storage


# A storage's count of references (tensors viewing it, and the pool's own). CPU builds of torch
# have it from 2.8 (CUDA builds earlier); without it the pool cannot tell a slot a collate_fn
# kept (a MixUp partner) from a free one, so nothing is pooled (`_worker_memory`).
_use_count: Callable[[int], int] | None = getattr(torch._C, "_storage_Use_Count", None)


def _only_pooled(storage: torch.UntypedStorage | None) -> bool:
    """Whether nothing in this process but the pool holds `storage`."""
    assert _use_count is not None  # no pool is made without it
    return storage is None or _use_count(storage._cdata) <= 1


_memory: BatchMemory | None = None  # this worker process's, made at its first batch


def _worker_memory() -> BatchMemory | None:
    """This DataLoader worker's `BatchMemory`, or None outside a worker, under file_system sharing,
    or in a torch that cannot count a storage's references."""
    global _memory
    if (torch.utils.data.get_worker_info() is None or _use_count is None
            or torch.multiprocessing.get_sharing_strategy() != "file_descriptor"):
        return None
    if _memory is None or _memory.pid != os.getpid():  # a process forked from a worker gets its own
        _memory = BatchMemory()
        # Pickling a slot's storage must say which slot it is, so that its release can
        # come back: in this worker process only, storages pickle through `_reduce_storage`.
        multiprocessing.reduction.ForkingPickler.register(torch.UntypedStorage, _reduce_storage)
    return _memory


@contextlib.contextmanager
def one_batch() -> Iterator[None]:
    """`BatchMemory.one_batch` for this DataLoader worker's memory; nothing elsewhere. A
    collate function that takes pooled tensors runs in one, so that a failure past the
    first pooled field (a caught one: `on_error`, the user's own) does not keep its slots."""
    memory = _worker_memory()
    if memory is None:
        yield
    else:
        with memory.one_batch():
            yield


def pooled_tensor(shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor | None:
    """An uninitialised tensor in one of this DataLoader worker's reusable slots, handed out
    until the training process lets go of it; None outside a worker, or when no slot is free."""
    memory = _worker_memory()
    return None if memory is None else memory.tensor(shape, dtype)


def collate_tensors(batch: Sequence[torch.Tensor], *, collate_fn_map: dict | None = None) -> torch.Tensor:
    """Stack `batch`; in a DataLoader worker, into a reusable shared-memory slot (module doc)."""
    first = batch[0]
    if any(tensor.dtype != first.dtype for tensor in batch):
        # One dtype for all, as torch.stack promotes in the main process; stacked into the
        # first's dtype (here, and in torch's own collate in a worker), 2**40 became 0 and
        # 70000.25 inf in float16, only with workers.
        dtype = functools.reduce(torch.promote_types, (tensor.dtype for tensor in batch))
        batch = [tensor.to(dtype) for tensor in batch]
        first = batch[0]
    if type(first) is not torch.Tensor or first.layout != torch.strided:  # subclasses, sparse: torch's way
        return collate_tensor_fn(batch, collate_fn_map=collate_fn_map)
    with one_batch():  # shapes that do not stack: torch's error, and the slot stays free
        out = pooled_tensor((len(batch), *first.shape), first.dtype)
        if out is None:
            return collate_tensor_fn(batch, collate_fn_map=collate_fn_map)
        return torch.stack(list(batch), 0, out=out)


def _reduce_storage(storage: torch.UntypedStorage) -> tuple[Callable[..., Any], tuple[Any, ...]]:
    """torch's pickling of a storage; a worker's pooled slot also carries its release board.

    Registered in a worker for its batches, and in the training process once a pooled
    batch arrives: a pooled batch the training process shares on with another process
    (a torch.multiprocessing queue) is never released, as that process may read it after
    the training process has let go."""
    reduced = reduce_storage(storage)
    in_worker = _memory is not None and _memory.pid == os.getpid()
    handed = _memory.shipping(storage) if in_worker else None  # type: ignore[union-attr]
    if handed is not None:
        return rebuild_pooled, (reduced, _memory.board, *handed)  # type: ignore[union-attr]
    if in_worker:  # a batch in fresh memory, no slot being free: its arrival releases what was let go
        return rebuild_noticing, (reduced,)
    _releases.keep(storage)
    return reduced


def rebuild_pooled(reduced: tuple[Callable[..., Any], tuple[Any, ...]], board: torch.Tensor, slot: int,
                   handed_out: int) -> torch.UntypedStorage:
    """Unpickle a pooled slot's storage in the training process, and watch for its release."""
    rebuild, args = reduced
    storage = rebuild(*args)
    _releases.watch(storage, board, slot, handed_out)
    return storage


def rebuild_noticing(reduced: tuple[Callable[..., Any], tuple[Any, ...]]) -> torch.UntypedStorage:
    """Unpickle a worker's storage in fresh memory in the training process, releasing the
    slots let go of since. A worker whose slots were all held (a loop that kept more than
    `SLOTS` batches a while) ships fresh memory until one is released; releases were noticed
    only as pooled batches arrived, so none ever was, and its batches stayed in fresh
    memory for the rest of the run."""
    rebuild, args = reduced
    storage = rebuild(*args)
    _releases.notice()
    return storage


class _Releases:
    """Pooled storages the training process holds, released to their workers once let go."""

    def __init__(self) -> None:
        self._lock = threading.Lock()  # the pinning thread unpickles too
        # (weak reference, data_ptr, the worker's board, slot, times handed out)
        self._held: list[tuple[StorageWeakRef, int, torch.Tensor, int, int]] = []
        self._sharing_watched = False

    def watch(self, storage: torch.UntypedStorage, board: torch.Tensor, slot: int, handed_out: int) -> None:
        """Release `slot` to its worker (through `board`) once `storage` has expired here."""
        with self._lock:
            if not self._sharing_watched:  # see _reduce_storage
                multiprocessing.reduction.ForkingPickler.register(torch.UntypedStorage, _reduce_storage)
                self._sharing_watched = True
            self._release_expired()
            self._held.append((StorageWeakRef(storage), storage.data_ptr(), board, slot, handed_out))

    def notice(self) -> None:
        """Release the slots of the storages let go of since the last look."""
        if self._held:
            with self._lock:
                self._release_expired()

    def keep(self, storage: torch.UntypedStorage) -> None:
        """Never release `storage`'s slot, if it is a pooled one held here."""
        if not self._held:
            return
        with self._lock:
            self._release_expired()
            self._held = [held for held in self._held if held[1] != storage.data_ptr()]

    def _release_expired(self) -> None:
        still_held = []
        for held in self._held:
            ref, _, board, slot, handed_out = held
            if ref.expired():
                board[slot] = handed_out
            else:
                still_held.append(held)
        self._held = still_held


_releases = _Releases()


def _forget_in_child() -> None:
    """A process forked from the training process (a DataLoader's worker) holds none of its
    batches: it must never release their slots, nor wait on a lock the pinning thread may
    have held at the fork."""
    global _releases
    _releases = _Releases()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_in_child)
