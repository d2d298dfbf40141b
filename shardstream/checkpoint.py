"""Checkpointing a `StreamingDataset`: `state_dict`, `load_state_dict`, and what the
dataset keeps of a loaded state while it resumes.

`Checkpointing` is the half of `StreamingDataset` that resumes. A loaded state
(resume.py says what it holds and how an epoch continues from it, on the same layout
or another) applies to the next pass over the epoch; through a DataLoader whose
workers the main process does not see begin or end a pass (torch's own), the shared
state (shared.py) says when every worker has read it to its end. Inside a DataLoader
worker, as torchdata's `StatefulDataLoader` asks, a state describes that worker's own
place instead (`_worker_state`).

It needs of the dataset: `world()`, `layout(world)`, `epoch`, `resampled`,
`_sequences()` (the epoch sequences) and `_shared` (the state its workers share);
`__iter__` reads and sets what `_init_checkpointing` makes.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import TYPE_CHECKING, Any

from torch.utils.data import get_worker_info

from .arguments import integer
from .errors import ShardstreamError
from .plan import Layout
from .resume import (ResumeState, check_counts, current_sequence, endless_onto, finished_before, plan_items,
                     rests_nothing)
from .world import World

if TYPE_CHECKING:
    from .epochs import EpochSequences
    from .shared import SharedState

__all__ = ["Checkpointing"]


class Checkpointing:
    """State dicts for a `StreamingDataset`, and the loaded state it resumes from."""

    _shared: SharedState
    epoch: int
    resampled: bool
    _loader_copy = False  # the copy shardstream.DataLoader iterates (loader.py)

    def world(self) -> World:  # the dataset's
        raise NotImplementedError

    def layout(self, world: World) -> Layout:  # the dataset's
        raise NotImplementedError

    def _sequences(self) -> EpochSequences:  # the dataset's
        raise NotImplementedError

    def _init_checkpointing(self) -> None:
        """Nothing loaded, nothing delivered yet (the dataset's constructor calls this)."""
        self._resume: ResumeState | None = None
        self._resume_id = 0
        # Set on `shardstream.DataLoader`'s copy, whose passes' ends the loader tells
        # (`finish_pass`): in its own process a loaded state is retired then, not when the
        # workers have read it to its end, which they do ahead of the loop (`rearm_resume`).
        self.passes_told = False
        # The resume state the pass in progress (or the one just completed) started from: the
        # epoch's earlier layouts stay finished for state_dict until the next pass or epoch.
        self._pass_resume: ResumeState | None = None
        self._delivered: int | None = 0
        # In a DataLoader worker: its place in the plan (epoch, plan worker, items yielded),
        # for torchdata's StatefulDataLoader, which loads each worker's own back into it.
        self._position: tuple[int, int, int] | None = None
        self._iteration: object = None  # the latest iteration begun (dataset.py)
        self._loaded_position: tuple[int, int] | None = None
        self._worker_resume = False  # the loaded state is a worker's own
        self._translated: tuple[ResumeState, Layout, ResumeState] | None = None  # see _resume_for

    def _forget_stale(self) -> None:
        """Drop a loaded state (and the state of the pass that started from one) whose epoch
        is no longer the current one. `set_epoch` forgets them only in the copy it is called
        on; the copies a DataLoader holds (its workers', `shardstream.DataLoader`'s) share the
        epoch with it, not what they loaded, and would otherwise replay the remainder of an
        epoch the training loop left early (for eval, or at a step limit) as the next one."""
        epoch = self._shared.epoch
        if self._resume is not None and self._resume.epoch != epoch:
            self._resume, self._loaded_position, self._worker_resume = None, None, False
        if self._pass_resume is not None and self._pass_resume.epoch != epoch:
            self._pass_resume = None

    def _state_not_reached(self) -> ShardstreamError | None:
        """In a DataLoader worker beginning an iteration: the error to raise where the main
        process loaded a state after this worker was started. The state stays in the main
        process (only the epoch is shared), so a persistent worker of torch's DataLoader
        would read the loaded epoch from its start while `len()` says what is left."""
        loaded = self._shared.loaded_resume
        if get_worker_info() is None or self._worker_resume or not loaded or loaded == self._resume_id:
            return None
        if self._loader_copy:
            # shardstream.DataLoader starts fresh workers for every state its copy takes (its own
            # load_state_dict, or the caller's dataset's): a state loaded since was another
            # loader's of this dataset (the slot is shared), a training loop rolled back while
            # this loader, a look at batches, kept its workers. Not this loader's to read.
            return None
        return ShardstreamError(
            "load_state_dict was called after this DataLoader's persistent workers started, and the state does "
            "not reach them (they would read the epoch from its start): make a new DataLoader after "
            "load_state_dict, or use shardstream.DataLoader, which starts fresh workers for a loaded state")

    def _active_resume(self, world: World) -> ResumeState | None:
        """The loaded resume state, unless every worker has already finished that epoch, or
        the epoch has changed since it was loaded."""
        self._forget_stale()
        if self._worker_resume:  # a worker's own state: this process's copy alone uses it
            return self._resume
        told = self.passes_told and get_worker_info() is None
        if self._resume is not None and not told and self._shared.resume_used_up(self._resume_id, world.workers):
            # Read to its end by the workers of a DataLoader that does not tell this process when
            # a pass begins or ends (torch's own): that pass started from it (see _state_resume).
            self._pass_resume = self._resume
            self._resume = None
        return self._resume

    def _resume_for(self, world: World) -> ResumeState | None:
        """The resume state that applies to reading with `world`'s layout.

        An endless stream's state taken with another layout is re-expressed for this
        one (`resume.endless_onto`): its epoch may then be a later one than the state's.
        """
        resume = self._active_resume(world)
        layout = self.layout(world)
        if resume is None or not self.resampled or resume.current.layout == layout:
            return resume
        if self._translated is None or self._translated[0] is not resume or self._translated[1] != layout:
            remaining, _, _ = current_sequence(self._sequences().after(resume.epoch), resume, resume.current.layout)
            full = self._sequences().size
            self._translated = (resume, layout, endless_onto(resume, layout, len(remaining), full))
        return self._translated[2]

    def _state_resume(self, world: World) -> ResumeState | None:
        """The resume state `state_dict` builds on: the one that applies to reading with
        `world`'s layout; once the resumed pass is complete, the one it started from (until
        the next pass or epoch), so that a state taken at the end of an epoch resumed onto
        another layout still counts the earlier layouts' items and says the epoch is complete."""
        resume = self._resume_for(world)  # stale states dropped (_active_resume)
        if resume is not None:
            return resume
        if self._pass_resume is not None and self._shared.later_pass():
            self._pass_resume = None  # a worker has begun the next pass: the epoch starts afresh
        return self._pass_resume

    def _world_with(self, num_workers: int) -> World:
        detected = self.world()
        return World(detected.rank, detected.size, 0, max(1, num_workers))

    def state_dict(self, delivered: int | None = None, num_workers: int = 0) -> dict[str, Any]:
        """A small, plain (msgpack/JSON-serialisable) description of progress.

        `delivered` is the number of items this rank's training loop has received in
        the current epoch, from its start, through a DataLoader with `num_workers`
        workers: after a restart, those received before it count too (`resumed_items`
        says how many, also after a resume onto another layout, whose items were counted
        in that layout's units). The count is read in torch's round-robin order of the
        workers' items: through a DataLoader with ``in_order=False`` it names other items,
        and the resume loses and repeats samples. By default: what this dataset yielded when iterated in
        this process, by its latest iteration where several are open (or, if not iterated
        since `load_state_dict`, what the loaded state says). `shardstream.DataLoader`
        counts and passes both for you.

        Called inside a DataLoader worker, as torchdata's `StatefulDataLoader` does for
        each worker, it describes that worker's own place in the plan instead; the
        StatefulDataLoader keeps one per worker and hands each back to its worker.
        """
        if delivered is None and get_worker_info() is not None:
            return self._worker_state()
        if delivered is None and self._loader_copy:
            # Its loader counts what it delivered and passes it: without a count this copy described
            # the epoch's start, and a resume from it repeated every batch trained on (80 of 297).
            raise ShardstreamError("this is shardstream.DataLoader's copy of the dataset (loader.dataset), which "
                                   "has not seen what the loader delivered: take the state from the loader "
                                   "(loader.state_dict())")
        if self._shared.loader_copy_iterates and not self._loader_copy and not self._own_loops_count(delivered,
                                                                                                     num_workers):
            raise ShardstreamError(
                "shardstream.DataLoader iterates a copy of this dataset, and this one has not seen what it "
                "delivered: take the state from the loader (loader.state_dict())")
        delivered = self._check_count_given(delivered, num_workers)
        world = self._world_with(num_workers)
        if delivered is None:  # counted in this layout's part of the epoch already
            segment = self._delivered if self._delivered is not None else self._resumed_in_layout(world)
        else:
            earlier = self._earlier_layouts_items(world)
            before = earlier + self._loaded_in_layout(world)  # the loaded state's count, on its own layout too
            if delivered < before:
                # A count since the restart, not since the epoch's start: taken as the epoch's, it made
                # a state that repeated what the run before the restart had trained on.
                raise ValueError(f"delivered counts the items of the epoch from its start: {before} were delivered "
                                 f"before this pass (the state it resumed from), and {delivered} is fewer (read "
                                 "resumed_items() as the pass begins, and count on from it)")
            segment = delivered - earlier
        loaded = self._resumed_from(world)
        if segment == 0 and loaded is not None:
            # Nothing read in this layout yet (a checkpoint right after a restart): the state is
            # the one loaded. Made again, it would end with an empty segment of this layout, and
            # resuming it onto the loaded layout would no longer continue that one exactly.
            return loaded.to_dict()
        state = ResumeState.current_of(self, world, segment)
        if delivered is not None:
            self._check_count_fits(state, delivered)
        return state.to_dict()

    def _check_count_fits(self, state: ResumeState, delivered: int) -> None:
        """A ValueError where a count given (`delivered`) is more than this rank's epoch holds:
        the global step passed for it made a state that every later load refused, found only
        after the restart it was for."""
        if self.resampled:
            return  # an endless stream's count runs on past the epoch
        sequences = self._sequences()
        try:
            if state.finished:  # the epoch's rest after earlier layouts: drawn (and kept) as the state loaded
                check_counts(sequences.length_after(state.epoch), state, self.resampled)
            elif delivered > (most := sum(plan_items(sequences.size, state.current.layout))):
                # Its length is all a plain epoch's bound needs: the epoch's order, drawn, took 18 s
                # and 80 MB at 10^7 samples (found by review).
                raise ShardstreamError(f"current.delivered must be at most {most} (the items per rank of the "
                                       f"{sequences.size} samples of epoch {state.epoch}), not {delivered}")
        except ShardstreamError as e:
            said = str(e).removeprefix("invalid resume state: ")
            raise ValueError(f"delivered={delivered} is more items than this rank's epoch {state.epoch} holds in "
                             f"this layout ({said}): it counts the items of the epoch from its start (a step count "
                             "since the run began is not one)") from None

    def _own_loops_count(self, delivered: Any, num_workers: int) -> bool:
        """Whether `delivered` (given where shardstream.DataLoader's copy iterated last) is the count
        of a loop of this dataset's own: a torch loop that iterated it since the last state or epoch,
        and a look through the loader beside it (`plain_iterated`); or nothing delivered since the
        state or epoch began (a checkpoint before the loop's first batch), which the count says
        whoever iterates. Without a count, or with one where only the loader iterated, the state
        is the loader's: a look at the dataset before a loader's training, then `ds.state_dict()`,
        described the look's one batch, and a resume from it repeated 72 of 240."""
        if delivered is None:
            return False
        if self._shared.plain_iterated:
            return True
        try:
            return integer(delivered, "delivered", 0) == self.resumed_items(num_workers)
        except (TypeError, ValueError):
            return False  # refused as the loader's; a bad count is told where it is checked

    def _resumed_from(self, world: World) -> ResumeState | None:
        """The state the reading with `world`'s layout resumed from (`_state_resume`), as loaded:
        an endless stream's not re-expressed for this layout; None for a worker's own state."""
        resume = self._state_resume(world)
        if resume is not None and self._translated is not None and resume is self._translated[2]:
            resume = self._translated[0]
        return resume if resume is not None and resume.position is None else None

    def _earlier_layouts_items(self, world: World) -> int:
        """Items of the current epoch delivered in layouts before the current one (the resumed
        state's earlier parts), which a state's current part does not count."""
        layout = self.layout(world)
        return sum(part.delivered for part in finished_before(self._state_resume(world), layout))

    def _loaded_in_layout(self, world: World) -> int:
        """Items the state this pass resumed from counts in this layout: as `_resumed_in_layout`,
        also once the workers have read the pass to its end (`_state_resume`), which the loop's
        count since the epoch's start cannot be below (a count since the restart was)."""
        resume = self._state_resume(world)
        if resume is None or resume.position is not None or resume.current.layout != self.layout(world):
            return 0
        return resume.current.delivered

    def _resumed_in_layout(self, world: World) -> int:
        resume = self._active_resume(world)
        if resume is None or resume.current.layout != self.layout(world):
            return 0
        return resume.current.delivered

    def _check_count_given(self, delivered: Any, num_workers: int) -> int | None:
        """`delivered` as a plain int (or None), or an error for a state this process cannot
        describe: DataLoader workers iterate the dataset, so only the training loop knows how
        many items it received, and from how many workers (a default of 0 items restarted the
        epoch; a wrong worker count changed its order)."""
        if delivered is not None:
            delivered = integer(delivered, "delivered", 0)
        workers = self._shared.iterating_workers
        if not workers or self._loader_copy:
            # shardstream.DataLoader gives its own counts, whatever loader iterated the dataset last
            # (the slot is the dataset's, shared by every loader of it: a look at a batch through
            # another loader with workers made the training loader's state_dict refuse its count).
            return delivered
        if delivered is None:
            raise ShardstreamError(
                f"DataLoader workers ({workers}) iterate this dataset, and this process cannot count what they "
                f"delivered: pass state_dict(delivered=<items the loop received this epoch>, num_workers={workers}), "
                "or take the state from shardstream.DataLoader (loader.state_dict()), which passes both")
        if num_workers != workers:
            raise ShardstreamError(
                f"the DataLoader iterating this dataset has {workers} workers, and num_workers={num_workers} was "
                f"given: pass num_workers={workers} (items are dealt to workers in turn, so the count decides "
                "which items were delivered)")
        return delivered

    def resumed_items(self, num_workers: int = 0) -> int:
        """Items of the current epoch already delivered before the next iteration starts,
        counted from the epoch's start (in earlier layouts too, after an elastic resume):
        where a training loop's count of the epoch's items stands."""
        world = self._world_with(num_workers)
        if self._active_resume(world) is None:
            return 0
        return self._earlier_layouts_items(world) + self._resumed_in_layout(world)

    def start_pass(self, num_workers: int = 0) -> int:
        """A DataLoader with `num_workers` workers begins an iteration driven from this process:
        its items of the current epoch already delivered (see `resumed_items`)."""
        self._pass_resume = self._active_resume(self._world_with(num_workers))
        return self.resumed_items(num_workers)

    def rearm_resume(self, num_workers: int) -> bool:
        """`shardstream.DataLoader` (`passes_told`) beginning a pass with `num_workers`: where
        the pass before, over a loaded state's remainder, was left early after its workers had
        read it to its end, the state applies to this pass again, as it does without workers
        (whether it did depended on how far ahead the workers had read). A worker that read its
        share to its end forgot it, and read its share of the whole epoch next (104 samples
        again, where it waited for all of them): it is marked anew where any has, and True says
        to start fresh ones."""
        self._forget_stale()
        if self._resume is None or self._worker_resume or num_workers == 0:
            return False
        if not self._shared.resume_begun_to_end(self._resume_id):
            return False  # no worker has read it to its end: they all hold it and read it again
        self._resume_id = self._shared.new_resume()
        self._shared.loaded_resume = self._resume_id
        return True

    def finish_pass(self) -> None:
        """The iteration is complete: the next starts the epoch afresh. Until it does, or
        another epoch is set, `state_dict` still describes the completed one."""
        self._shared.finished_epoch = self._shared.epoch + 1
        self._resume = None
        self._delivered = 0
        self._iteration = None  # an iteration still open no longer counts (another epoch, or it ended)

    def forget_resume(self) -> None:
        """Start the next iteration at the beginning of the epoch."""
        self.finish_pass()
        self._pass_resume = None
        self._shared.loaded_unread = False
        self._shared.loaded_resume = 0  # dropped: no worker misses it

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from `state` on the next iteration (exactly, or elastically if the layout changed).

        A state that is not one of this dataset's, or whose counts do not fit in its epoch,
        is refused here, naming the field, and leaves the dataset as it was."""
        resume = ResumeState.from_dict(state, self)
        # The counts' bounds need the epoch's size: the fingerprint has just read the sample counts.
        # What earlier layouts left of the epoch is kept for `len()` and the iteration (epochs.py).
        after = self._sequences().after(resume.epoch)
        check_counts(self._sequences().length_after(resume.epoch), resume, self.resampled)
        if resume.position is not None:
            self._load_worker_state(resume)
            return
        self._shared.epoch = resume.epoch
        self._shared.iterating_workers = 0  # until workers iterate again, the loaded state describes progress
        self._shared.plain_iterated = False
        # A state taken at its epoch's end has nothing to read: the next epoch set drops nothing.
        self._shared.loaded_unread = not rests_nothing(after, resume, self.resampled)
        self._take_resume(resume, self._shared.new_resume())
        self._shared.loaded_resume = self._resume_id

    def _take_resume(self, resume: ResumeState | None, resume_id: int) -> None:
        self._resume = resume
        self._pass_resume = None
        self._resume_id = resume_id
        self._delivered = None
        self._iteration = None  # the loaded state is the place now, not an iteration still open

    def adopt_loaded(self, other: Checkpointing) -> bool:
        """Take the state loaded into `other`, a copy of this dataset sharing its epoch, if it was
        loaded after this one's: `shardstream.DataLoader`'s copy follows the caller's dataset
        (``loader = DataLoader(ds); ds.load_state_dict(state)``). Whether it did."""
        if other._resume_id <= self._resume_id:  # ids count the loads of the state both share
            return False
        self._take_resume(other._resume, other._resume_id)
        return True

    def _worker_state(self) -> dict[str, Any]:
        world = self.world()
        state = ResumeState.current_of(self, world, 0)
        if self._loaded_position is not None:  # loaded, not iterated yet
            position = self._loaded_position
        elif self._position is not None and self._position[0] == state.epoch:  # this epoch's place, to its end
            position = self._position[1:]
        else:
            position = (world.worker, 0)
        return dataclasses.replace(state, position=position).to_dict()

    def _load_worker_state(self, resume: ResumeState) -> None:
        world = self.world()
        taken, mine = resume.current.layout, self.layout(world)
        if taken != mine:
            differ = ", ".join(f"{f.name} {getattr(taken, f.name)!r} there, {getattr(mine, f.name)!r} here"
                               for f in dataclasses.fields(Layout) if getattr(taken, f.name) != getattr(mine, f.name))
            raise ShardstreamError(
                f"this worker state was taken with another layout ({differ}): torchdata's StatefulDataLoader "
                "resumes a worker state onto the layout it was taken with only: its world size, num_workers, "
                "batching and shuffle buffer, and its run, the chunks a shuffled epoch deals a worker at a time (1 "
                "in states before version 5: resume those with the shardstream that took them, or start the epoch "
                "afresh); for an elastic resume, checkpoint shardstream.DataLoader's state_dict() instead")
        if self._shared.epoch_chosen and resume.epoch != self._shared.epoch:
            # torchdata's StatefulDataLoader loads each worker's state as its iteration begins, after
            # the loop's set_epoch: another epoch there is the loop's choice (the next epoch after an
            # end-of-epoch checkpoint), which the state overrode, in every process through the shared
            # epoch: an epoch skipped, or a finished one replayed under the next one's number.
            warnings.warn(f"the state loaded for epoch {resume.epoch} is dropped: set_epoch({self._shared.epoch}) "
                          "chose another epoch", stacklevel=2)
            return
        self._shared.epoch = resume.epoch  # the same value from every worker
        self._resume = resume
        self._pass_resume = None
        self._loaded_position = resume.position
        self._worker_resume = True
        self._delivered = None
        self._iteration = None
