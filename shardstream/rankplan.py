"""One rank's reads of an iteration: what each DataLoader worker reads, in what order, from where.

plan.py splits an epoch sequence across ranks and workers; epochs.py makes the epoch
sequences; roundrobin.py and resume.py say where a worker stands after items were
delivered. `RankPlan` puts them together for one rank reading with one layout: the
rank's block of an epoch, the plan worker a DataLoader worker serves and how far it
got, the samples that worker reads in the order they are read and yielded, the first
reads of the next epoch (for a head start), and an endless stream's epochs one after
another. It takes values and returns arrays; the dataset wires it to reading, decoding
and batching.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

import numpy as np

from .epochs import EpochSequences
from .plan import Layout, read_order, repeated_positions, worker_items, worker_plan, worker_positions
from .resume import Segment, endless_deal, endless_place
from .roundrobin import endless_start, loader_start

__all__ = ["RankPlan", "WorkerEpoch"]


@dataclass(frozen=True, eq=False)  # holds an array: compared by identity
class WorkerEpoch:
    """What one DataLoader worker reads of epoch `epoch`: plan worker `worker`'s share of
    `block` (the rank's samples of the epoch's segment number `segment`, one of the equal
    blocks a sequence of `sequence_length` samples was cut into), after the first `done`
    items it handed over. `next_worker`: the plan worker it serves in `epoch + 1` of an
    endless stream (None: a new pass starts at the loader worker's own place)."""

    epoch: int
    block: np.ndarray
    sequence_length: int
    segment: int
    worker: int
    done: int
    next_worker: int | None = None


@dataclass(frozen=True)
class RankPlan:
    """Rank `rank`'s reads of the epochs of `sequences` with `layout`; `endless`: a resampled
    stream, whose workers run from epoch to epoch without end."""

    sequences: EpochSequences
    layout: Layout
    rank: int
    endless: bool = False

    def block(self, epoch: int, finished: tuple[Segment, ...] = ()) -> np.ndarray:
        """This rank's samples of what the `finished` segments (earlier layouts) left of `epoch`."""
        return self.sequences.rank_block(epoch, finished, self.layout.world_size, self.rank, self.layout.partial)

    def sequence_length(self, epoch: int, finished: tuple[Segment, ...] = ()) -> int:
        """The samples of what the `finished` segments left of `epoch`, which `block` cuts into ranks."""
        return len(self.sequences.after(epoch)(finished)) if finished else self.sequences.size

    def start(self, block: int, delivered: int, loader_worker: int) -> tuple[int, int]:
        """The plan worker DataLoader worker `loader_worker` serves, and how many items that
        plan worker has already handed over, after the rank received `delivered` items of a
        rank block of `block` samples (roundrobin.py)."""
        if self.endless:
            return endless_start(self.layout.workers, delivered, loader_worker)
        return loader_start(worker_items(block, self.layout), delivered, loader_worker)

    def reads(self, part: WorkerEpoch) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The plan worker's draws of the epoch (global ids, each draw of a sample told apart
        where the epoch draws one more than once: `EpochSequences.draws`), the positions
        among them it has still to yield after its first `part.done` items, in order, and
        those positions in the order they are read."""
        mine, perm = worker_plan(part.block, self.layout, self.sequences.seed, part.epoch, self.rank, part.worker,
                                 part.segment)
        start = part.done * (self.layout.batch_size or 1)
        remaining = perm[start:]
        source = self.sequences.source
        frontier = int(perm[:start].max()) + 1 if start and source.indexed else 0
        return mine, remaining, read_order(remaining, frontier, source.samples_per_frame())

    def repeats(self, part: WorkerEpoch) -> np.ndarray:
        """Which of the plan worker's draws (`reads`) repeat a sample delivered first elsewhere:
        the padding of uneven ranks (`plan.repeated_positions`), as a bool mask."""
        places = worker_positions(len(part.block), self.layout.workers, self.layout.chunk, part.worker,
                                  self.layout.run)
        return repeated_positions(part.sequence_length, self.layout, self.sequences.seed, part.epoch, self.rank,
                                  places, part.segment)

    def epoch_share(self, part: WorkerEpoch, reads: int) -> int:
        """The samples a plan worker reads in a whole epoch of this layout, for the error
        policy's fraction cap: `reads` (its draws of `part`), or after a resume onto another
        layout (a later segment, holding what the layouts before left), its share of the
        whole epoch: the cap of what is left, 1% of it, refused a resume the uninterrupted
        run would have finished, on every restart."""
        if part.segment == 0:
            return reads
        return max(reads, -(-len(self.block(part.epoch)) // self.layout.workers))

    def yielded(self, part: WorkerEpoch) -> np.ndarray:
        """The positions among the plan worker's draws (`reads`) that it yielded before its
        first `part.done` items (a resumed run's: the run before yielded them), in order."""
        _, perm = worker_plan(part.block, self.layout, self.sequences.seed, part.epoch, self.rank, part.worker,
                              part.segment)
        return perm[: part.done * (self.layout.batch_size or 1)]

    def next_epoch_reads(self, epoch: int, worker: int | None, loader_worker: int) -> np.ndarray:
        """The samples DataLoader worker `loader_worker` will read next, in reading order, if
        what comes next is `epoch + 1` from its start: the next iteration after
        ``set_epoch(epoch + 1)``, or an endless stream's next epoch, in which it serves plan
        worker `worker` (see `endless`; None: the one a new pass starts it at)."""
        block = self.block(epoch + 1)
        if worker is None:
            worker, _ = self.start(len(block), 0, loader_worker)
        mine, _, needed = self.reads(WorkerEpoch(epoch + 1, block, self.sequences.size, 0, worker, 0))
        return self.sequences.samples_of(mine[needed])

    def endless_epochs(self, first: WorkerEpoch) -> Iterator[WorkerEpoch]:
        """Epoch after epoch from `first`, without end, for the DataLoader worker that serves
        plan worker `first.worker` after its first `first.done` items, however many epochs
        those span. In each epoch it reads the share the deal gives it (`roundrobin.EndlessDeal`),
        which keeps the workers together however long the stream runs."""
        later = len(self.block(first.epoch + 1))
        if sum(worker_items(later, self.layout)) == 0:  # no worker would ever yield again
            raise ValueError("an endless stream needs at least one item per epoch")
        deal = endless_deal(self.layout, len(first.block), later)
        k, done, _ = endless_place(deal, first.worker, first.done)
        epoch, block, segment = first.epoch, first.block, first.segment
        if k:
            epoch, segment = epoch + k, 0
            block = self.block(epoch)
        while True:
            length = first.sequence_length if segment else self.sequences.size
            yield WorkerEpoch(epoch, block, length, segment, deal.share(first.worker, k), done,
                              deal.share(first.worker, k + 1))
            epoch, k, done, segment = epoch + 1, k + 1, 0, 0
            block = self.block(epoch)
