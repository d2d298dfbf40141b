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

from .plan import deal_run, epoch_block, epoch_sequence, shuffle_block, split_ranks
from .resume import Segment, SequenceAfter, sequence_after
from .sampling import (Sampling, class_sample_weights, distinct_draws, drawn_samples, mixed_sequence, sized_sequence,
                       stream_slice, weighted_sequence)
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
        # `_left` can be megabytes: a DataLoader worker that needs it makes it again.
        return {**self.__dict__, "_left": None}

    def ids(self, epoch: int) -> np.ndarray:
        """Epoch `epoch`'s sequence of global sample ids."""
        counts, seed, shuffle = self.counts, self.seed, self.shuffle
        n = self.sampling.samples_per_epoch if self.sampling is not None else None
        if self.mix_weights is not None:
            sizes = [len(part.shards) for part in self.source.parts]
            bounds = np.concatenate([[0], np.cumsum(sizes)])
            offsets = np.concatenate([[0], np.cumsum(counts)])[bounds[:-1]]
            part_counts = [counts[a:b] for a, b in zip(bounds[:-1], bounds[1:])]
            for part, part_count in zip(self.source.parts, part_counts):
                # Its share of the mix cannot be drawn: said at once, naming it (a mix of empty
                # sources gave epochs of nothing, silently; one empty source failed when first drawn).
                if not part_count.sum():
                    raise ValueError(f"mixed source {part.url} has no samples")
        elif not counts.sum() and (n is not None or (self.sampling is not None and self.sampling.weighted)):
            # Else n samples of none was an epoch of none, silently, and weights said "all 0".
            asked = f"samples_per_epoch={n}" if n is not None else "sampling by weight"
            raise ValueError(f"{asked}, but the dataset {self.source.url} has no samples")
        if self.mix_weights is not None:
            total = n or int(counts.sum())

            def stream(i: int) -> Callable[[int, int], np.ndarray]:
                # Source i's own stream, pass after pass, read on from where its picks of earlier
                # epochs stopped (`sampling.mix_schedule`): a source a mix reads less of than it
                # holds has its tail read too.
                size = int(part_counts[i].sum())

                def pass_of(p: int) -> np.ndarray:
                    if not shuffle:
                        return offsets[i] + np.arange(size, dtype=np.int64)
                    return offsets[i] + epoch_sequence(part_counts[i], seed, p, shuffle, salt=i << 20,
                                                       block=self.blocks[i])

                return lambda first, count: stream_slice(pass_of, size, first, count)

            return mixed_sequence([stream(i) for i in range(len(sizes))], self.mix_weights, total, start=epoch * total)
        if self.sampling is not None and self.sampling.weighted:
            return weighted_sequence(counts, self._draw_weights(), seed, epoch, shuffle, n or int(counts.sum()),
                                     self.blocks[0])
        if n is not None:
            return sized_sequence(counts, seed, epoch, shuffle, n, self.blocks[0])
        return epoch_sequence(counts, seed, epoch, shuffle, block=self.blocks[0])

    def draws(self, epoch: int) -> np.ndarray:
        """Epoch `epoch`'s sequence as the plan splits it: sample ids, where a sequence may
        hold a sample more than once (weighted draws, an epoch larger than the data, a mix)
        with each draw of a sample told apart (`sampling.distinct_draws`; `samples_of`
        gives back the samples), so that each gets its own augmentations."""
        ids = self.ids(epoch)
        return ids if self._each_once else distinct_draws(ids, self.total)

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
        """The length of every epoch's sequence (`ids`), without drawing one."""
        n = self.sampling.samples_per_epoch if self.sampling is not None else None
        return n if n is not None else self.total

    def rank_block(self, epoch: int, finished: tuple[Segment, ...], world_size: int, rank: int,
                   partial: str) -> np.ndarray:
        """Rank `rank`'s block of what the `finished` segments left of `epoch`'s sequence
        (`plan.split_ranks`). A plain epoch's is made without the whole sequence: a DataLoader
        worker of one rank in 256 then holds its rank's ids, not the epoch's."""
        sampling = self.sampling
        drawn = sampling is not None and (sampling.weighted or sampling.samples_per_epoch is not None)
        if finished or drawn or self.mix_weights is not None:
            return split_ranks(self.after(epoch)(finished), world_size, partial)[rank]
        return epoch_block(self.counts, self.seed, epoch, self.shuffle, world_size, rank, partial, self.blocks[0])

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

    def _draw_weights(self) -> np.ndarray:
        """Each sample's draw weight: its class weight times its own weight (either may be absent)."""
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
