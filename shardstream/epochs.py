"""Which samples an epoch holds, in order: every sample once, or what `Sampling` and a `Mix` draw.

An epoch's sequence is a pure function of the source's sample counts (with weighted
draws, also its labels or per-sample weights), the seed, the epoch and the sampling
(plan.py and sampling.py make it). `EpochSequences` makes it for one dataset in one
process and keeps what is costly to make again: the draw weights, and what earlier
layouts of a resumed epoch left of it (replaying what a layout read of a million
samples takes about a second, and `load_state_dict`, every `len()` and every iteration
ask). The plan then splits the sequence across ranks and workers.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np

from .plan import deal_run, epoch_units, joined_ids, rank_stretches, sequence_between, shuffle_block, split_ranks
from .resume import Segment, SequenceAfter, sequence_after
from .sampling import (PassStream, Sampling, WeightedDraws, class_sample_weights, draw_table, drawn_samples,
                       mixed_draws)
from .source import Source

__all__ = ["EpochSequences", "shard_block"]


@dataclass(eq=False)  # holds arrays: compared by identity
class EpochSequences:
    """The epoch sequences of `source`, drawn with `seed`, `shuffle` and `sampling`;
    `mix_weights` are a `Mix`'s weights when `source` is a mix of datasets (its parts)."""

    source: Source
    counts: np.ndarray
    seed: int
    shuffle: bool
    sampling: Sampling | None = None
    mix_weights: Sequence[float] | None = None
    # Samples in a block of each shard (`plan.shuffle_block`; 0: shards whole), per mixed source for a mix.
    blocks: tuple[int, ...] = field(default=(), init=False)
    _weights: np.ndarray | None = field(default=None, init=False, repr=False)  # draw weights
    _table: tuple[np.ndarray, ...] | None = field(default=None, init=False, repr=False)  # `sampling.draw_table`
    _drawn: WeightedDraws | None = field(default=None, init=False, repr=False)  # the last epoch's
    _blocks: dict[tuple[int, int, int, str], np.ndarray] = field(default_factory=dict, init=False, repr=False)
    _left: tuple[int, tuple[Segment, ...], np.ndarray] | None = field(default=None, init=False, repr=False)
    _lengths: dict[tuple[int, tuple[Segment, ...]], int] = field(default_factory=dict, init=False, repr=False)
    _runs: dict[int, int] = field(default_factory=dict, init=False, repr=False)  # deal_run, by chunk

    def __post_init__(self) -> None:
        if self.mix_weights is None:
            self.blocks = (shard_block(self.source, self.counts, self.shuffle),)
        else:
            sizes = np.cumsum([0] + [len(part.shards) for part in self.source.parts])
            self.blocks = tuple(shard_block(part, self.counts[a:b], self.shuffle)
                                for part, a, b in zip(self.source.parts, sizes[:-1], sizes[1:]))

    def deal_run(self, chunk: int) -> int:
        """The chunks of `chunk` samples a worker is dealt at a time (`plan.deal_run`): one
        unshuffled, so that the DataLoader yields a rank's block in order, and where a shard
        without an index is read through whichever of its samples a worker wants."""
        if not self.shuffle or not self.source.indexed:
            return 1
        if chunk not in self._runs:
            self._runs[chunk] = deal_run(chunk, self.source.samples_per_frame(), self.source.least_sample_bytes())
        return self._runs[chunk]

    def __getstate__(self) -> dict[str, Any]:
        # What is kept of epochs and the draw table (the weights' running sum) can be megabytes: a
        # DataLoader worker that needs them makes them again.
        return {**self.__dict__, "_left": None, "_drawn": None, "_blocks": {}, "_table": None}

    def draws(self, epoch: int) -> np.ndarray:
        """Epoch `epoch`'s sequence as the plan splits it: sample ids, where a sequence may
        hold a sample more than once (weighted draws, an epoch larger than the data, a mix)
        with each draw of a sample told apart (`sampling.distinct_draws`; `samples_of`
        gives back the samples), so that each gets its own augmentations."""
        return self.stretch(epoch, 0, self.size)

    def stretch(self, epoch: int, start: int, stop: int) -> np.ndarray:
        """Positions [start, stop) of `draws(epoch)`, made without the rest of it."""
        self._check_drawable()
        size = self.size
        if self.mix_weights is not None:
            return mixed_draws(self._mix_streams(), self.mix_weights, epoch * size, epoch * size + start,
                               epoch * size + stop, self.total)
        if self.sampling is not None and self.sampling.weighted:
            return self._weighted(epoch).draws(start, stop, self.total)
        stream = PassStream(self.counts, self.seed, self.shuffle, block=self.blocks[0])
        if self.sampling is not None and self.sampling.samples_per_epoch is not None:
            return stream.draws(epoch * size + start, epoch * size + stop, epoch * size, self.total)
        units, order = epoch_units(self.counts, self.seed, epoch, self.shuffle, block=self.blocks[0])
        return sequence_between(units, order, start, stop)  # pass `epoch` of the stream, each sample once

    def _check_drawable(self) -> None:
        """Refuse an epoch that cannot be drawn, naming the source."""
        if self.mix_weights is not None:
            for part, streams in zip(self.source.parts, self._mix_streams()):
                # Its share of the mix cannot be drawn: said at once, naming it (a mix of empty
                # sources gave epochs of nothing, silently; one empty source failed when first drawn).
                if not streams.size:
                    raise ValueError(f"mixed source {part.url} has no samples")
            return
        n = self.sampling.samples_per_epoch if self.sampling is not None else None
        if not self.total and (n is not None or (self.sampling is not None and self.sampling.weighted)):
            # Else n samples of none was an epoch of none, silently, and weights said "all 0".
            asked = f"samples_per_epoch={n}" if n is not None else "sampling by weight"
            raise ValueError(f"{asked}, but the dataset {self.source.url} has no samples")

    def _mix_streams(self) -> list[PassStream]:
        """Each mixed source's own stream, pass after pass, read on from where its picks of
        earlier epochs stopped (`sampling.mix_schedule`): a source a mix reads less of than it
        holds has its tail read too."""
        sizes = [len(part.shards) for part in self.source.parts]
        bounds = np.concatenate([[0], np.cumsum(sizes)])
        offsets = np.concatenate([[0], np.cumsum(self.counts)])[bounds[:-1]]
        return [PassStream(self.counts[a:b], self.seed, self.shuffle, salt=i << 20, block=self.blocks[i],
                           offset=int(offsets[i]))
                for i, (a, b) in enumerate(zip(bounds[:-1], bounds[1:]))]

    def _weighted(self, epoch: int) -> WeightedDraws:
        """Epoch `epoch`'s weighted draws (the last epoch's kept: every rank block and head start asks)."""
        if self._drawn is None or self._drawn.epoch != epoch:
            units, order = epoch_units(self.counts, self.seed, epoch, self.shuffle, block=self.blocks[0])
            if self._table is None:  # units in id order are the same every epoch
                self._table = draw_table(units, self.draw_weights())
            self._drawn = WeightedDraws(units, order, *self._table, self.seed, epoch, self.size)
        return self._drawn

    def samples_of(self, draws: np.ndarray) -> np.ndarray:
        """The sample ids of the plan's `draws` (see `draws`), to read."""
        return draws if self._each_once else drawn_samples(draws, self.total)

    @property
    def _each_once(self) -> bool:
        """Whether an epoch holds every sample once, draws being ids (no sampling, no mix)."""
        return self.sampling is None and self.mix_weights is None

    @property
    def total(self) -> int:
        """The samples of the source."""
        return int(self.counts.sum())

    @property
    def size(self) -> int:
        """The length of every epoch's sequence (`draws`), without drawing one."""
        n = self.sampling.samples_per_epoch if self.sampling is not None else None
        return n if n is not None else self.total

    def rank_block(self, epoch: int, finished: tuple[Segment, ...], world_size: int, rank: int,
                   partial: str) -> np.ndarray:
        """Rank `rank`'s block of what the `finished` segments left of `epoch`'s sequence
        (`plan.split_ranks`). An epoch no earlier layout read of is made a stretch at a time
        (`stretch`), without the whole sequence: a DataLoader worker of one rank in 256 then
        draws and holds its rank's share, not the epoch's."""
        self._check_drawable()  # an empty source's epoch has no stretch to make, and is refused all the same
        if finished:
            return split_ranks(self.after(epoch)(finished), world_size, partial)[rank]
        key = (epoch, world_size, rank, partial)
        if key in self._blocks:
            return self._blocks[key]
        block = joined_ids([self.stretch(epoch, start, stop)
                            for start, stop in rank_stretches(self.size, world_size, rank, partial)])
        if self.sampling is not None and self.sampling.weighted:
            # Kept: a weighted block draws its shards whole (8 walks: 8x its samples), at the head
            # start on the next epoch and again at that epoch's start (0.2 s at 10^7, a rank of 64).
            while len(self._blocks) >= 2:
                del self._blocks[next(iter(self._blocks))]
            self._blocks[key] = block
        return block

    def after(self, epoch: int) -> SequenceAfter:
        """What earlier layouts (the finished segments of a resumed epoch) left of `epoch`'s
        sequence. The last answer is kept, and built on when more segments are asked for."""
        def after(finished: tuple[Segment, ...]) -> np.ndarray:
            kept = self._left
            if kept is not None and kept[0] == epoch and finished[:len(kept[1])] == kept[1]:
                done, sequence = kept[1], kept[2]
            else:
                # Kept too: a drawn epoch (weights, a mix, `samples_per_epoch`) took seconds to draw at
                # 10^7 samples, again at every len(), iter() and head start
                done, sequence = (), self.draws(epoch)
                self._left = (epoch, (), sequence)
            if len(finished) > len(done):
                sequence = sequence_after(sequence, finished[len(done):], self.seed, epoch, first=len(done))
                self._left = (epoch, finished, sequence)
            return sequence

        return after

    def length_after(self, epoch: int) -> Callable[[tuple[Segment, ...]], int]:
        """``len(after(epoch)(finished))``, each kept. A checkpoint's check of its counts asks
        for every segment's (resume.check_counts): asked of `after`, which keeps one answer,
        each state_dict replayed the earlier layouts again (2.4 s at 3M samples)."""
        def length(finished: tuple[Segment, ...]) -> int:
            if not finished:
                return self.size
            if (epoch, finished) not in self._lengths:
                if len(self._lengths) > 64:  # of earlier epochs, or many states loaded
                    self._lengths.clear()
                self._lengths[epoch, finished] = len(self.after(epoch)(finished))
            return self._lengths[epoch, finished]

        return length

    def draw_weights(self) -> np.ndarray:
        """Each sample's draw weight: its class weight times its own weight (either may be
        absent). Made once a process, from every shard's index: a DataLoader's own process
        makes them before its workers start (`StreamingDataset.weigh_for_workers`), so that
        they inherit them, rather than each reading every index again."""
        if self._weights is None:
            sampling, total = self.sampling, int(self.counts.sum())
            assert sampling is not None
            weights = np.ones(total)
            if sampling.class_weights is not None:
                weights *= class_sample_weights(self.source.labels(), sampling.class_weights)
            if isinstance(sampling.sample_weights, str):
                weights *= self.source.weights()
            elif sampling.sample_weights is not None:
                if len(sampling.sample_weights) != total:
                    raise ValueError(f"sample_weights has {len(sampling.sample_weights)} weights; "
                                     f"the dataset has {total} samples")
                weights *= sampling.sample_weights
            self._weights = weights
        return self._weights


def shard_block(source: Source, counts: np.ndarray, shuffle: bool = True) -> int:
    """The block its shards are cut into in a shuffled epoch (`plan.shuffle_block`): none
    where a shard is read front to back (a tar without an index, whose every block out of
    file order would be another pass over it), nor unshuffled."""
    if not shuffle or not source.indexed:
        return 0
    return shuffle_block(counts, source.samples_per_frame(), source.least_sample_bytes())
