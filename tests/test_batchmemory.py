"""Batches stacked into reused shared memory in DataLoader workers (batchmemory.py).

Real worker processes throughout. What must hold: a batch is never overwritten while
the training process holds it or any view of it, and memory is reused once it does not.
"""

from __future__ import annotations

import multiprocessing.resource_sharer
import os
import time

import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset

from shardstream import batchmemory
from shardstream.batchmemory import SLOTS, BatchMemory
from shardstream.collate import default_collate, pad_collate


def _image(i: int, j: int, side: int = 32) -> torch.Tensor:
    return torch.full((3, side, side), (i * 7 + j) % 251, dtype=torch.uint8)


class Batches(IterableDataset):
    """`count` batches of 4 images (the last `short_last` of 2), stacked by `collate`, with their index."""

    def __init__(self, count: int, collate=default_collate, sides: tuple[int, ...] = (32,), short_last: bool = False):
        self.count, self.collate, self.sides, self.short_last = count, collate, sides, short_last

    def __iter__(self):
        for i in range(self.count):
            side = self.sides[i % len(self.sides)]
            size = 2 if self.short_last and i == self.count - 1 else 4
            yield self.collate([(_image(i, j, side), i) for j in range(size)])


def _expected(i: int, side: int = 32, size: int = 4) -> torch.Tensor:
    return torch.stack([_image(i, j, side) for j in range(size)])


def _inode(batch: torch.Tensor) -> int:
    fd, _ = batch.untyped_storage()._share_fd_cpu_()
    return os.fstat(fd).st_ino


def test_memory_is_reused_once_the_training_process_lets_go():
    inodes, count = set(), 40
    for images, index in DataLoader(Batches(count), batch_size=None, num_workers=1):
        assert torch.equal(images, _expected(int(index[0])))
        inodes.add(_inode(images))
    assert len(inodes) <= 6  # a few slots in turn (about 4: see README), not a new buffer a batch

    # What it is measured against: torch's collate makes fresh memory for every batch.
    fresh = {_inode(images) for images, _ in DataLoader(Batches(count, collate=torch.utils.data.default_collate),
                                                         batch_size=None, num_workers=1)}
    assert len(fresh) == count


def test_batches_held_by_the_training_loop_are_never_overwritten():
    # Both workers make every batch (the dataset is not split): 2 x 48 batches held,
    # more than the two workers' 2 x 16 slots.
    held = list(DataLoader(Batches(3 * SLOTS), batch_size=None, num_workers=2, prefetch_factor=4))
    assert len(held) == 2 * 3 * SLOTS
    for images, index in held:
        assert torch.equal(images, _expected(int(index[0])))


class _Epochs(IterableDataset):
    """`Batches` epoch after epoch, through one worker's persistent iterator: `epochs` x `count` batches."""

    def __init__(self, count: int, epochs: int, collate=default_collate):
        self.count, self.epochs, self.collate = count, epochs, collate

    def __iter__(self):
        for _ in range(self.epochs):
            yield from Batches(self.count, self.collate)


def test_memory_is_reused_again_after_the_loop_held_more_batches_than_slots():
    """Regression: a loop that once held more batches than a worker's slots (a window of recent batches) left
    every slot held; the worker shipped fresh memory, whose arrival noticed no release, and so never pooled
    again: a new buffer a batch for the rest of the run."""
    held, inodes = [], []
    for k, (images, index) in enumerate(DataLoader(_Epochs(SLOTS + 8, 3), batch_size=None, num_workers=1)):
        assert torch.equal(images, _expected(int(index[0])))
        if k < SLOTS + 4:
            held.append(images)  # more than the worker's slots, at once
        else:
            held.clear()
            if k >= 2 * (SLOTS + 8):  # the last epoch
                inodes.append(_inode(images))
    assert len(inodes) == SLOTS + 8 and len(set(inodes)) <= 6


class _MixesWithThePrevious:
    """A collate_fn that keeps the batch it made, to mix into the next (MixUp with the previous batch), and
    says whether the batch it kept is still what it made."""

    def __init__(self) -> None:
        self.kept: tuple[torch.Tensor, torch.Tensor] | None = None

    def __call__(self, samples):
        images, index = default_collate(samples)
        intact = None if self.kept is None else bool(torch.equal(*self.kept))
        self.kept = (images, images.clone())
        return images, index, intact


class _SlowFirstWorker(Batches):
    """`Batches`, worker 0 making each one slowly: its slots are released when worker 1's batches arrive,
    before it makes its next one (while its collate_fn still holds its last)."""

    def __iter__(self):
        slow = torch.utils.data.get_worker_info().id == 0
        for i in range(self.count):
            if slow:  # before the collate: meanwhile the loop takes its last batch, and lets go of it
                time.sleep(0.05)
            yield self.collate([(_image(i, j), i) for j in range(4)])


def test_a_batch_the_workers_collate_keeps_is_never_reused_under_it():
    """Regression: a slot was reused as soon as the training process let go of its batch, though the worker's
    collate_fn still held it: the batch it kept to mix into the next was overwritten under it."""
    flags = [intact for _, _, intact in DataLoader(_SlowFirstWorker(2 * SLOTS, collate=_MixesWithThePrevious()),
                                                   batch_size=None, num_workers=2)]
    assert flags.count(True) == len(flags) - 2  # every batch but each worker's first had one kept before it


def test_a_torch_that_cannot_count_a_storages_references_pools_nothing(monkeypatch):
    """Regression (found by a review of the torch floor): CPU builds of torch before 2.8 have no
    `_storage_Use_Count`, and the pool then took every released slot for free, the batch a worker's collate_fn
    kept among them. Without the count nothing is pooled (the workers are forked: they inherit the patch)."""
    monkeypatch.setattr(batchmemory, "_use_count", None)
    flags = [intact for _, _, intact in DataLoader(_SlowFirstWorker(2 * SLOTS, collate=_MixesWithThePrevious()),
                                                   batch_size=None, num_workers=2, multiprocessing_context="fork")]
    assert flags.count(True) == len(flags) - 2


def test_a_view_kept_after_its_batch_is_dropped_keeps_the_memory():
    views = []
    for images, index in DataLoader(Batches(3 * SLOTS), batch_size=None, num_workers=1):
        views.append((images[1:3], int(index[0])))  # the batch itself goes at the next step
    for view, i in views:
        assert torch.equal(view, _expected(i)[1:3])


def test_shapes_that_change_and_a_short_last_batch():
    loader = DataLoader(Batches(25, sides=(16, 48, 32), short_last=True), batch_size=None, num_workers=2)
    seen = []
    for images, index in loader:
        i = int(index[0])
        side = (16, 48, 32)[i % 3]
        assert torch.equal(images, _expected(i, side, 2 if i == 24 else 4))
        seen.append(i)
    assert sorted(seen) == sorted(2 * list(range(25)))  # each worker makes them all


def test_file_system_sharing_takes_torchs_path():
    before = torch.multiprocessing.get_sharing_strategy()
    torch.multiprocessing.set_sharing_strategy("file_system")
    try:
        held = list(DataLoader(Batches(10), batch_size=None, num_workers=1))
    finally:
        torch.multiprocessing.set_sharing_strategy(before)
    for images, index in held:
        assert torch.equal(images, _expected(int(index[0])))


def test_outside_a_worker_batches_are_plain_memory():
    images, _ = default_collate([(_image(0, j), 0) for j in range(4)])
    assert not images.is_shared()
    assert torch.equal(images, _expected(0))


def test_a_slot_is_free_only_when_released():
    memory = BatchMemory(slots=2)
    first = memory.tensor((4, 8), torch.uint8)
    second = memory.tensor((4, 8), torch.uint8)
    assert first is not None and second is not None
    assert memory.tensor((4, 8), torch.uint8) is None  # both handed out, neither released
    slot, handed_out = memory.shipping(first.untyped_storage())  # pickled to the training process
    memory.board[slot] = handed_out  # what the training process writes once it let go
    assert memory.tensor((2, 8), torch.uint8) is None  # ... but this process still holds it (a collate's keep)
    where = first.untyped_storage().data_ptr()
    del first
    again = memory.tensor((2, 8), torch.uint8)
    assert again is not None and again.untyped_storage().data_ptr() == where
    memory.board[1 - slot] = memory.shipping(second.untyped_storage())[1]
    del second
    larger = memory.tensor((64, 64), torch.uint8)  # too large for the free slot: it grows
    assert larger is not None and larger.untyped_storage().nbytes() >= 64 * 64


def test_a_slot_handed_out_and_never_shipped_is_free_once_let_go():
    """Regression: a collate_fn that calls ours and ships something made from it (MixUp's
    float images) let go of the pooled stack in the worker; counted as handed out, never
    shipped, so never released, the slot stayed taken: after 16 batches no slot was free for
    the rest of the run, each worker holding 16 dead shared-memory buffers."""
    memory = BatchMemory(slots=1)
    stacked = memory.tensor((4, 8), torch.uint8)
    where = stacked.untyped_storage().data_ptr()
    assert memory.tensor((4, 8), torch.uint8) is None  # held here
    del stacked  # made into something else, which was shipped instead
    again = memory.tensor((4, 8), torch.uint8)
    assert again is not None and again.untyped_storage().data_ptr() == where
    memory.shipping(again.untyped_storage())
    del again
    assert memory.tensor((4, 8), torch.uint8) is None  # shipped: free only once the training process releases it


def test_a_tensor_takes_the_closest_slot_and_none_much_larger():
    """Regression: a small field (labels) took the first free slot large enough, an image
    batch's: a loop that kept the labels pinned the image-sized buffer, and pickling them
    (`torch.save`) wrote it whole, another batch's pixels with it."""
    memory = BatchMemory(slots=3)
    images, labels = memory.tensor((4, 1024), torch.uint8), memory.tensor((4,), torch.int64)
    sizes = {images.untyped_storage().data_ptr(): "images", labels.untyped_storage().data_ptr(): "labels"}
    del images, labels  # let go of in the worker, never shipped: free
    labels = memory.tensor((4,), torch.int64)
    images = memory.tensor((4, 1024), torch.uint8)
    assert sizes[labels.untyped_storage().data_ptr()] == "labels" and labels.untyped_storage().nbytes() == 32
    assert sizes[images.untyped_storage().data_ptr()] == "images"
    del labels
    small = memory.tensor((2,), torch.int64)  # 16 bytes: the 32-byte slot is within twice that
    assert small is not None and small.untyped_storage().nbytes() == 32
    tiny = memory.tensor((1,), torch.uint8)  # the third slot, empty, is made to its size
    assert tiny is not None and tiny.untyped_storage().nbytes() == 1
    for pooled in (small, tiny):
        memory.shipping(pooled.untyped_storage())
    del images, small, tiny
    assert memory.tensor((4,), torch.int64) is None  # only the 4 KB slot is free: fresh memory instead
    assert memory.tensor((3, 1024), torch.uint8) is not None


def test_batches_of_varying_sizes_grow_a_slot_rather_than_open_one():
    """Regression (found by a walk with padded batches of volumes): where every free slot was a little too small,
    a new slot was opened, so each new largest batch took one more, up to 16 a worker (7 and 10 slots, 584 and
    859 MB, where about four batches were in flight). A free slot within twice the size is grown instead."""
    memory, in_flight = BatchMemory(), []
    for size in [int(40_000 * 1.02 ** step) for step in range(60)]:  # ever larger, four in flight at most
        batch = memory.tensor((size,), torch.uint8)
        in_flight.append((memory.shipping(batch.untyped_storage()), batch))
        del batch
        if len(in_flight) == 4:
            slot, shipped = in_flight.pop(0)[0]
            memory.board[slot] = shipped  # the training process let go of it
    opened = [storage for storage in memory._storages if storage is not None]
    assert len(opened) == 4
    assert sum(storage.nbytes() for storage in opened) <= 4 * 40_000 * 1.02 ** 59


@pytest.mark.parametrize("workers", [1, 2])
def test_stream_batches_match_torchs_collate(packed, workers):
    from shardstream import RandomResizedCropJPEG, StreamingDataset

    def epoch(collate):
        ds = StreamingDataset(packed, shuffle=True, seed=3, decode=RandomResizedCropJPEG(24), fields=("jpg", "cls"),
                              batch_size=4, collate_fn=collate)
        return [(images.clone(), labels.clone()) for images, labels in
                DataLoader(ds, batch_size=None, num_workers=workers)]

    ours, torchs = epoch(None), epoch(torch.utils.data.default_collate)
    assert len(ours) == len(torchs) > SLOTS // 4
    for (a, la), (b, lb) in zip(ours, torchs):
        assert torch.equal(a, b) and torch.equal(la, lb)


def test_workers_started_by_spawn():
    # A spawned worker imports shardstream afresh: its memory and its pickling are its own.
    loader = DataLoader(Batches(12), batch_size=None, num_workers=1, multiprocessing_context="spawn")
    inodes = set()
    for images, index in loader:
        assert torch.equal(images, _expected(int(index[0])))
        inodes.add(_inode(images))
    assert len(inodes) < 12


class Sequences(IterableDataset):
    """Batches of 3 sequences of lengths that change from batch to batch, padded by `pad_collate`."""

    def __iter__(self):
        for i in range(30):
            yield pad_collate([(torch.full((1 + (i * 5 + j) % 11, 2), i, dtype=torch.int32), j) for j in range(3)],
                              padding_value=-7)


def test_padded_batches_reuse_memory_and_pad():
    inodes = set()
    for i, (padded, lengths, labels) in enumerate(DataLoader(Sequences(), batch_size=None, num_workers=1)):
        want = [1 + (i * 5 + j) % 11 for j in range(3)]
        assert lengths.tolist() == want and labels.tolist() == [0, 1, 2]
        assert padded.shape == (3, max(want), 2) and padded.dtype == torch.int32
        for row, length in zip(padded, want):
            assert (row[:length] == i).all() and (row[length:] == -7).all()
        inodes.add(_inode(padded))
    assert len(inodes) < 30


def _check_later(batches, ready, go, results):
    images, index = batches.get()
    ready.set()
    go.wait(60)
    results.put(bool(torch.equal(images, _expected(int(index[0])))))


def test_a_batch_shared_on_with_another_process_is_never_overwritten():
    # The training process hands batch 0 to another process, lets go of it, and reads on:
    # the worker must not write that batch's memory again, whoever else still reads it.
    ctx = torch.multiprocessing.get_context("fork")
    batches, results, ready, go = ctx.Queue(), ctx.Queue(), ctx.Event(), ctx.Event()
    reader = ctx.Process(target=_check_later, args=(batches, ready, go, results))
    reader.start()
    try:
        inodes = set()
        for i, (images, index) in enumerate(DataLoader(Batches(40), batch_size=None, num_workers=1)):
            if i == 0:
                batches.put((images, index))
                assert ready.wait(60)
            inodes.add(_inode(images))
            del images, index
        assert len(inodes) < 40  # the other batches' memory was reused
        go.set()
        assert results.get(timeout=60) is True
    finally:
        go.set()
        reader.join(60)
        # Sending a storage started this process's fd-sharing thread (multiprocessing's own).
        multiprocessing.resource_sharer.stop(timeout=5)


def test_a_batch_that_fails_to_stack_gives_its_slot_back():
    class Uneven(IterableDataset):
        def __iter__(self):
            for _ in range(2 * SLOTS):  # more failures than slots: each must give its slot back
                try:
                    default_collate([torch.zeros(3, 4, dtype=torch.uint8), torch.zeros(3, 5, dtype=torch.uint8)])
                except RuntimeError as e:
                    assert "stack expects each tensor to be equal size" in str(e)
            batch = default_collate([_image(0, j) for j in range(4)])
            yield batch, batchmemory._memory.handed_out(batch.untyped_storage()) is not None  # in a slot

    [(images, pooled)] = list(DataLoader(Uneven(), batch_size=None, num_workers=1))
    assert bool(pooled) and torch.equal(images, _expected(0))


def test_a_batch_whose_later_field_fails_gives_every_slot_back():
    class LaterFieldFails(IterableDataset):
        def __iter__(self):
            for _ in range(2 * SLOTS):  # the images stack into a slot, then the labels fail (a None)
                with pytest.raises((TypeError, RuntimeError)):
                    default_collate([(_image(0, 0), 1), (_image(0, 1), None)])
                with pytest.raises((TypeError, RuntimeError)):
                    pad_collate([(torch.zeros(3, 2), 1), (torch.zeros(5, 2), None)])
            memory = batchmemory._memory
            free = sum(int(memory._released[s]) == n for s, n in enumerate(memory._handed_out))
            batch = default_collate([_image(0, j) for j in range(4)])
            yield free, memory.handed_out(batch.untyped_storage()) is not None

    [(free, pooled)] = list(DataLoader(LaterFieldFails(), batch_size=None, num_workers=1))
    assert int(free) == SLOTS and bool(pooled)


def test_blocks_nest_and_only_a_failed_block_gives_back():
    memory = BatchMemory(slots=4)
    with memory.one_batch():
        kept = memory.tensor((4, 8), torch.uint8)
        with pytest.raises(ValueError):
            with memory.one_batch():
                memory.tensor((4, 8), torch.uint8)
                raise ValueError("the inner batch fails")
    assert kept is not None
    with pytest.raises(ValueError):
        with memory.one_batch():
            memory.tensor((4, 8), torch.uint8)
            raise ValueError("a later batch fails")
    handed = [n - int(memory._released[s]) for s, n in enumerate(memory._handed_out)]
    assert sorted(handed) == [0, 0, 0, 1]  # only the first batch's tensor is still out
    assert memory.handed_out(kept.untyped_storage())[1] == 1


def test_empty_fields_next_to_pooled_ones():
    # Detection boxes of images without objects: (0, 4) per sample, beside images of sizes
    # that change (their slots grow), with the last batches held by the loop.
    class Boxes(IterableDataset):
        def __iter__(self):
            for i in range(3 * SLOTS):
                side = 8 + i
                yield default_collate([(torch.full((3, side, side), j, dtype=torch.uint8), torch.zeros(0, 4))
                                       for j in range(4)])

    held = []
    for images, boxes in DataLoader(Boxes(), batch_size=None, num_workers=1):
        held = [*held[-2:], (images, boxes)]
        assert boxes.shape == (4, 0, 4)
        assert torch.equal(images[:, 0, 0, 0], torch.arange(4, dtype=torch.uint8))
    assert len(held) == 3 and held[-1][0].shape[-1] == 8 + 3 * SLOTS - 1


def _child_state(results):
    held = list(batchmemory._releases._held)
    free = batchmemory._releases._lock.acquire(timeout=5)
    results.put((len(held), free))


def test_a_forked_child_forgets_the_batches_its_parent_holds():
    # A validation loader's workers may be forked while the training loader's pinning
    # thread holds the release lock: the child must neither wait on it nor release slots.
    ctx = torch.multiprocessing.get_context("fork")
    results = ctx.Queue()
    board = torch.zeros(2, dtype=torch.int64)
    storage = torch.zeros(8, dtype=torch.uint8).untyped_storage()
    batchmemory._releases.watch(storage, board, 0, 1)
    with batchmemory._releases._lock:
        child = ctx.Process(target=_child_state, args=(results,))
        child.start()
        got = results.get(timeout=30)
    child.join(30)
    assert got == (0, True)
    del storage
    batchmemory._releases.keep(torch.zeros(1, dtype=torch.uint8).untyped_storage())  # releases what expired
    assert int(board[0]) == 1 and not batchmemory._releases._held
