"""Sampling in a stream: class weights, epoch size, and mixing datasets. Pure functions.

A stream cannot index at random the way `WeightedRandomSampler` does, but the plan can:
every choice below is made on sample ids, from the seed and the epoch, before any data
is read. The result is an epoch sequence like `plan.epoch_sequence`'s, so everything
downstream holds unchanged: equal counts per rank, deterministic order, exact resume.

* **Class weights** (``Sampling(class_weights="balanced")`` or ``{class: weight}``):
  the epoch draws `samples_per_epoch` ids with replacement, each sample with
  probability proportional to its class's weight ("balanced" is 1 / class count, the
  PyTorch recipe), over the per-sample labels that shard indexes carry. The draws are
  made shard by shard (where shards are few, by the blocks they are cut into,
  `plan.epoch_units`; shards in the epoch's seeded order) and sorted within a shard or
  block, so reading stays sequential, in `MAX_WALKS` walks over the shards: a sample's
  copies go to successive walks, so they do not sit side by side, where the shuffle
  buffer would keep them within a few batches (`WeightedDraws`). A rank draws the
  shards its share of the epoch meets, not the epoch. Cost: the weights' running sum
  (8 bytes a sample) per process, reading every index once, and each shard opened once
  a walk.
* **Sample weights** (``Sampling(sample_weights="weight")``, or an array with one weight
  per sample in dataset order): the same draw, each sample with probability
  proportional to its own weight, times its class weight if both are given. "weight"
  is the per-sample `weight` field, which the shard indexes record (FORMAT.md), so
  the epoch is planned without reading any sample.
* **Epoch size** (``samples_per_epoch``) without weights: epoch e is positions
  [e n, (e + 1) n) of one stream of whole passes over the data (pass p shuffled as
  epoch p; in order unshuffled), so epochs go on from where the last stopped, and
  every sample is read once a pass (`sized_sequence`); a `Mix`'s sources too. Cut
  short at the same place every epoch, shards larger than an epoch would have their
  tails never read.
* **Endless** (``resampled=True``): the stream runs epoch after epoch (seed, epoch
  + 1, ...) and never ends; ranks stay in lockstep, and so do a rank's workers:
  each epoch is dealt by the items each worker has handed over (`roundrobin.EndlessDeal`),
  so with whole batches the first E epochs' worth of batches holds epochs 0..E-1 whole,
  and otherwise (unbatched, `drop_last`) the workers stay within a chunk. Resume is exact
  with the same layout; `len()` raises TypeError. Resumed onto another layout, it
  continues in the earliest epoch an old worker had not finished, with the samples
  of that epoch no worker had yielded, each once; the few samples of the next epoch
  that workers already past the boundary had yielded (about a batch per old worker)
  come again in that epoch (`resume.endless_onto`).
* **Mixing** (`Mix`): each source has its own epoch sequence; the mixed sequence takes
  source i's k-th sample at time (k + 1/2) / w_i, merged in time order. That is a
  low-discrepancy interleaving: any window of the sequence holds each source within one
  sample of its share when two sources mix. With more sources the error grows with their
  number (measured worst cases over random weights: 1.9 samples with 3 sources, 2.6 with
  4, 3.3 with 6 to 10; 4.5 with one source at 0.908 and six tiny ones, whose first picks
  fall together). The picks run on across epochs: an epoch is a window of one mixed
  stream (`mix_schedule`), so the shares hold across epochs too, and a source too
  small for a pick an epoch gets one every few. A source that runs out starts another
  pass of its own stream.
"""

from __future__ import annotations

import hashlib
import math
import numbers
import os
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import numpy as np

from .arguments import flag, integer
from .columns import MAX_CLASS
from .plan import epoch_units, joined_ids, rng_for, sequence_between

__all__ = ["Sampling", "Mix", "PassStream", "WeightedDraws", "sized_sequence", "weighted_draws", "weighted_sequence",
           "draw_table", "distinct_draws", "drawn_samples", "mix_picks", "mix_schedule", "mixed_draws",
           "class_sample_weights", "drawn_copy"]

# The walks over the shards a weighted epoch is read in (`WeightedDraws`): each walk opens
# the shards its draws are in again, so a sample drawn more often than this has copies in
# one walk (adjacent there), about copies / MAX_WALKS of them.
MAX_WALKS = 8
# The draws `WeightedDraws` makes at a time (their arrays, about 100 bytes a draw, at once).
DRAW_GROUP = 1 << 20
# The positions of a mixed stream `mix_schedule` places: its times are float64.
MIX_POSITIONS = 1 << 53


@dataclass(frozen=True)
class Sampling:
    """How an epoch draws from the data (see the module docstring)."""

    # "balanced", {class index: weight}, or one weight per class index in order ([2.0, 1.0, 1.0]).
    class_weights: str | Mapping[int, float] | Sequence[float] | None = None
    samples_per_epoch: int | None = None
    resampled: bool = False  # endless: epoch after epoch, never StopIteration
    # "weight": each sample's `weight` field, as the shard indexes record it; or one
    # weight per sample of the dataset, in its order (shards as listed, samples in order).
    sample_weights: str | Sequence[float] | np.ndarray | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "resampled", flag(self.resampled, "resampled"))  # "no" made an endless epoch
        if isinstance(self.class_weights, str) and self.class_weights != "balanced":
            raise ValueError(f"class_weights must be 'balanced' or a mapping, not {self.class_weights!r}")
        if isinstance(self.class_weights, (Sequence, np.ndarray)) and not isinstance(self.class_weights, str):
            # A weight per class in order, as a list (it failed on a bare "no attribute 'items'")
            object.__setattr__(self, "class_weights", dict(enumerate(np.asarray(self.class_weights).tolist())))
        if self.class_weights is not None and not isinstance(self.class_weights, (str, Mapping)):
            raise ValueError("class_weights must be 'balanced', a mapping of class index to weight, or a weight "
                             f"per class in order, not a {type(self.class_weights).__name__}")
        if self.class_weights is not None and not isinstance(self.class_weights, str):
            # Checked here, not at the first draw in a DataLoader worker: a key of -1 weighted the
            # last class, one of 1e9 asked for an 8 GB table, NaN failed deep in numpy.
            for label, weight in self.class_weights.items():
                if isinstance(label, bool) or not isinstance(label, numbers.Integral) or not 0 <= label <= MAX_CLASS:
                    raise ValueError(f"class_weights keys are class indices 0..{MAX_CLASS}, not {label!r}")
                if not (isinstance(weight, numbers.Real) and math.isfinite(weight) and weight >= 0):
                    raise ValueError(f"class_weights must be finite and non-negative, not {weight!r} for class {label}")
            # Plain numbers: numpy's (from np.bincount, or a weights array) describe the sampling
            # by their repr ("np.float64(5.0)"), and a state saved with them was refused by a run
            # given the same weights as literals, as if from another dataset.
            object.__setattr__(self, "class_weights",
                               {int(label): float(weight) for label, weight in self.class_weights.items()})
        if self.samples_per_epoch is not None:  # a float from a config (1e6) failed at the first plan, in a worker
            object.__setattr__(self, "samples_per_epoch", integer(self.samples_per_epoch, "samples_per_epoch", 1))
        if isinstance(self.sample_weights, str):
            if self.sample_weights != "weight":
                raise ValueError(f"sample_weights must be 'weight' (the field) or an array, not {self.sample_weights!r}")
        elif self.sample_weights is not None:
            # A copy, kept read-only: the caller's own array, made read-only in place, refused the
            # caller's next change to it (weights updated between epochs), and changed, it would
            # draw otherwise than the sampling's fingerprint says.
            weights = np.array(self.sample_weights, dtype=np.float64)
            if weights.ndim != 1 or not np.all(np.isfinite(weights)) or np.any(weights < 0):
                raise ValueError("sample_weights must be one finite, non-negative weight per sample")
            weights.setflags(write=False)
            object.__setattr__(self, "sample_weights", weights)
            # Its digest, made once: each state_dict names the sampling by it (0.13 s at 10^7 weights).
            object.__setattr__(self, "_weights_digest", hashlib.sha256(weights.tobytes()).hexdigest()[:16])

    @property
    def weighted(self) -> bool:
        """Draws with replacement by weight (class or sample weights), not every sample once."""
        return self.class_weights is not None or self.sample_weights is not None

    def describe(self) -> str:
        weights = self.class_weights if isinstance(self.class_weights, (str, type(None))) else sorted(
            self.class_weights.items())
        per_sample = self.sample_weights
        if isinstance(per_sample, np.ndarray):  # identified by content: a resume state must match it
            per_sample = f"array({len(per_sample)}, sha256={self._weights_digest})"
        return (f"class_weights={weights!r}, samples_per_epoch={self.samples_per_epoch}, resampled={self.resampled}"
                + (f", sample_weights={per_sample}" if per_sample is not None else ""))


@dataclass(frozen=True)
class Mix:
    """Several datasets read as one, each contributing `weights[i]` of every window.

    The epoch is the sum of the sources' sizes, unless `Sampling(samples_per_epoch=...)`
    says. Sources on different kinds of store take the dataset's `storage_options` by
    protocol (``{"s3": {...}, "http": {...}}``), each its own protocol's. Sources of one
    protocol with options of their own (two S3 endpoints, two accounts) take them here,
    `storage_options[i]` for source i (None: the dataset's), which are never printed."""

    sources: tuple[str | tuple[str, ...], ...]
    weights: tuple[float, ...] = field(default=())
    # Credentials: left out of repr and of comparisons (a state's check compares the weights).
    storage_options: tuple[dict[str, Any] | None, ...] = field(default=(), repr=False, compare=False)

    def __init__(self, sources: Sequence[str | os.PathLike[str] | Sequence[str | os.PathLike[str]]],
                 weights: Sequence[float], storage_options: Sequence[Mapping[str, Any] | None] | None = None):
        if len(sources) != len(weights) or not sources:
            raise ValueError("Mix needs one weight per source")
        if storage_options is not None and (len(storage_options) != len(sources) or not all(
                options is None or isinstance(options, Mapping) for options in storage_options)):
            raise ValueError("Mix's storage_options are one dict (or None) per source")
        if not all(isinstance(w, numbers.Real) and math.isfinite(w) and w > 0 for w in weights):
            raise ValueError(f"Mix weights must be finite and positive, not {list(weights)}")
        top = float(max(weights))  # each finite, their sum may not be (1e308 twice)
        total = sum(w / top for w in weights)
        object.__setattr__(self, "sources", tuple(source_urls(s) for s in sources))
        object.__setattr__(self, "weights", tuple(float(w / top / total) for w in weights))  # plain: see Sampling
        object.__setattr__(self, "storage_options", tuple(
            None if options is None else dict(options) for options in storage_options or [None] * len(sources)))


def source_urls(source: "str | os.PathLike[str] | Sequence[str | os.PathLike[str]]") -> str | tuple[str, ...]:
    """A source as the library keeps it: a location (a path given as `pathlib.Path` too) or a tuple of shard URLs."""
    if isinstance(source, (str, os.PathLike)):
        return os.fspath(source)
    return tuple(os.fspath(url) for url in source)


@dataclass(frozen=True, eq=False)  # holds an array: compared by identity
class PassStream:
    """Pass after pass over the samples of `counts` (ids from `offset`): pass p in epoch p's
    order when shuffling (with `salt`, an independent order; with `block`, the shards cut
    into blocks: `plan.epoch_units`), in id order unshuffled. An epoch larger or smaller than
    the data is a window of it (`sized_sequence`), and so is a mixed source's share of an
    epoch (`mixed_draws`); either is made a stretch at a time, for one rank's share."""

    counts: np.ndarray
    seed: int
    shuffle: bool
    salt: int = 0
    block: int = 0
    offset: int = 0

    @property
    def size(self) -> int:
        return int(self.counts.sum())

    def ids(self, start: int, stop: int) -> np.ndarray:
        """The ids at positions [start, stop) of the stream (none: an empty stream)."""
        return joined_ids([ids for _, ids in self._passes(start, stop)])

    def draws(self, start: int, stop: int, window: int, total: int) -> np.ndarray:
        """The ids at positions [start, stop), each draw of a sample told apart as
        `distinct_draws` tells apart those of the window of positions from `window` on
        (which holds [start, stop)): the k-th of a sample's draws since `window` is its
        id + k `total`. Made without the window: in pass p after the window's first pass f,
        a sample was drawn once in each pass between, and in pass f if its place there is
        inside the window."""
        size = self.size
        first = window // size if size else 0
        pieces = []
        for p, ids in self._passes(start, stop):
            if p > first:
                # Python ints for the passes: an epoch's window of a stream starts at epoch x n.
                inside = self._places(first, ids - self.offset) >= window - first * size
                ids = ids + (p - first - 1 + inside.astype(np.int64)) * total
            pieces.append(ids)
        return joined_ids(pieces)

    def _passes(self, start: int, stop: int) -> list[tuple[int, np.ndarray]]:
        size = self.size
        if not size or stop <= start:
            return []
        out = []
        for p in range(start // size, (stop - 1) // size + 1):
            units, order = self._units(p)
            out.append((p, self.offset + sequence_between(units, order, max(start - p * size, 0),
                                                          min(stop - p * size, size))))
        return out

    def _units(self, p: int) -> tuple[np.ndarray, np.ndarray]:
        return epoch_units(self.counts, self.seed, p, self.shuffle, self.salt, self.block)

    def _places(self, p: int, ids: np.ndarray) -> np.ndarray:
        """Where each of `ids` (from 0) stands in pass `p`."""
        units, order = self._units(p)
        starts = np.cumsum(units) - units  # each unit's first id
        unit = np.searchsorted(starts, ids, side="right") - 1  # an empty unit's start is the next one's
        place = np.empty(len(order), dtype=np.int64)
        place[order] = np.arange(len(order))
        begins = np.cumsum(units[order]) - units[order]  # where each unit's run begins in the pass
        return begins[place[unit]] + ids - starts[unit]


def sized_sequence(counts: np.ndarray, seed: int, epoch: int, shuffle: bool, n: int, block: int = 0) -> np.ndarray:
    """`n` ids: epoch `epoch`'s window of a stream of whole passes over the data (`PassStream`).

    The stream is pass after pass (pass p in epoch p's order when shuffling, so an epoch
    of the data's size is the plain epoch), and epoch e is its positions [e n, (e + 1) n):
    epochs walk on from where the last stopped, as WebDataset's `with_epoch` does. Cut
    short at the same place every epoch instead, the samples beyond the cut of every
    shard larger than an epoch would never be read, shuffled or not."""
    return PassStream(np.asarray(counts, dtype=np.int64), seed, shuffle, block=block).ids(epoch * n, (epoch + 1) * n)


def mixed_draws(streams: Sequence[PassStream], weights: Sequence[float], window: int, start: int, stop: int,
                total: int) -> np.ndarray:
    """Positions [start, stop) of the mixed stream (see the module docstring) as draws, each
    draw of a sample told apart within the window of positions from `window` on (an epoch;
    see `PassStream.draws`): source i's picks are the positions of `streams[i]` that come
    next, each source's window starting where its picks before `window` stop."""
    picked, before = mix_schedule(weights, start, stop - start)
    _, window_before = mix_schedule(weights, window, 0)
    out = np.empty(len(picked), dtype=np.int64)
    for i, stream in enumerate(streams):
        where = np.flatnonzero(picked == i)
        if len(where) and not stream.size:
            raise ValueError(f"mixed source {i} has no samples")
        first = int(before[i])
        out[where] = stream.draws(first, first + len(where), int(window_before[i]), total)
    return out


def class_sample_weights(labels: np.ndarray, class_weights: str | Mapping[int, float]) -> np.ndarray:
    """Per-sample weights from per-class weights ("balanced": 1 / class count)."""
    labels = np.asarray(labels, dtype=np.int64)
    if (labels < 0).any():
        raise ValueError("class weights need a class label (cls) on every sample")
    if isinstance(class_weights, str):
        table = 1.0 / np.maximum(np.bincount(labels), 1)
    else:
        table = np.full(int(max(labels.max(initial=0), max(class_weights, default=0))) + 1, np.nan)
        for c, w in class_weights.items():
            table[c] = w
        unlisted = np.unique(labels[np.isnan(table[labels])])
        if len(unlisted):
            # Weight 0 by default would leave a class out of every epoch without a word (Keras
            # weighs an unlisted class 1): say which, and let the mapping say 0 where that is meant.
            raise ValueError(f"class_weights gives no weight for class {int(unlisted[0])}, which samples have"
                             f"{f' (nor for {len(unlisted) - 1} more)' if len(unlisted) > 1 else ''}: give every "
                             "class present a weight (0 leaves it out)")
    return table[labels]


@dataclass(frozen=True, eq=False)  # holds arrays: compared by identity
class WeightedDraws:
    """Epoch `epoch`'s `n` draws with replacement, each sample with probability ∝ its weight,
    in reading order, made a stretch at a time (`draws`).

    The draws are made unit by unit (`units`: the samples of each shard, or of each block a
    shard is cut into, in id order; `order`: the units' order in the epoch, `plan.epoch_units`):
    how many fall in each unit is one multinomial draw over the units' weights (`masses`),
    and which samples, a draw within the unit from a stream of uniforms of its own, sorted,
    so that a unit is read front to back. That is the same distribution as `n` independent
    draws, and it lets a rank's DataLoader worker draw its rank's share only: drawn whole,
    each of them drew every sample's share of the epoch (3.3-5.1 s and 560 MB a worker at
    10^7 draws: BENCHMARKS.md, "Forty-first session").

    A unit's draws are dealt round robin to `MAX_WALKS` walks over the units, from a seeded
    walk per unit; the sequence is walk after walk, each walk the units in the epoch's order.
    Sorted, a sample's copies (a rare class's, drawn dozens of times) are side by side, so
    they go to successive walks, a walk apart: read in one walk they sat together, and the
    shuffle buffer spread them over a few batches only (12 copies of one image in a batch of
    64). Each walk holds the same mix of classes as the draws, and reads each unit's samples
    in order; a unit is visited once a walk."""

    units: np.ndarray
    order: np.ndarray
    cumulative: np.ndarray  # the weights' running sum, from 0: sample i's draws land in [c[i], c[i + 1])
    masses: np.ndarray  # the weights of each unit's samples, summed
    last_drawable: np.ndarray  # each unit's last sample with a weight above 0
    seed: int
    epoch: int
    n: int

    def __post_init__(self) -> None:
        drawn = rng_for(self.seed, self.epoch, 2).multinomial(self.n, self.masses / self.masses.sum())
        first_walk = rng_for(self.seed, self.epoch, 3).integers(0, MAX_WALKS, len(self.units))
        placed = drawn[self.order]
        # cells[w, i]: the draws of the epoch's i-th unit in walk w, the sequence's runs in order.
        cells = placed // MAX_WALKS + ((np.arange(MAX_WALKS)[:, None] - first_walk[self.order]) % MAX_WALKS
                                       < placed % MAX_WALKS)
        for name, value in (("_drawn", drawn), ("_drawn_before", np.cumsum(drawn) - drawn),
                            ("_first_walk", first_walk), ("_first_ids", np.cumsum(self.units) - self.units),
                            ("_cell_counts", cells.ravel()), ("_cell_ends", np.cumsum(cells.ravel())),
                            ("_uniforms", rng_for(self.seed, self.epoch, 5).bit_generator.state)):
            object.__setattr__(self, name, value)

    def draws(self, start: int, stop: int, total: int) -> np.ndarray:
        """Positions [start, stop) of the sequence: sample ids, the k-th draw of a sample
        (in sequence order) as id + k `total` (`distinct_draws`). A sample's draws are all
        in its unit: the units whose runs the stretch meets are drawn, whole."""
        if stop <= start:
            return np.zeros(0, dtype=np.int64)
        counts, ends = self._cell_counts, self._cell_ends
        begins = ends - counts
        cells = np.arange(np.searchsorted(ends, start, side="right"), np.searchsorted(begins, stop, side="left"))
        units = np.unique(self.order[cells[counts[cells] > 0] % len(self.units)])  # in id order
        place = np.empty(len(self.order), dtype=np.int64)
        place[self.order] = np.arange(len(self.order))
        out = np.empty(stop - start, dtype=np.int64)
        # A group of units at a time: a dozen arrays as long as their draws (a peak of 800 MB at 10^7
        # draws at once, measured; 160 MB a group at a time).
        drawn = np.cumsum(self._drawn[units])
        for group in np.split(units, np.flatnonzero(np.diff(drawn // DRAW_GROUP)) + 1):
            self._place(group, begins, place, start, stop, total, out)
        return out

    def _place(self, units: np.ndarray, begins: np.ndarray, place: np.ndarray, start: int, stop: int, total: int,
               out: np.ndarray) -> None:
        """Draw `units` (consecutive in id order, each whole) and put those of their draws
        whose places in the sequence are in [start, stop) into `out` (which starts at `start`)."""
        drawn = self._drawn[units]
        # Each draw lands at the running sum at the unit's start plus a uniform times the unit's
        # mass; sorted, the units' in id order, each unit's in order, so the lookup is one sweep
        # (see `sorted_choice`: numpy's `choice`, without its cache miss a draw). Landing at or
        # past the unit's start, it is a sample of the unit; rounding can land it at the unit's
        # end, past its last sample with a weight.
        landing = np.repeat(self.cumulative[self._first_ids[units]], drawn)
        landing += self._unit_uniforms(units) * np.repeat(self.masses[units], drawn)
        landing.sort()
        ids = np.searchsorted(self.cumulative, landing, side="right") - 1
        del landing
        np.minimum(ids, np.repeat(self.last_drawable[units], drawn), out=ids)
        within = np.arange(len(ids))  # a draw's place in its unit
        within -= np.repeat(np.cumsum(drawn) - drawn, drawn)
        walk = (within + np.repeat(self._first_walk[units], drawn)) % MAX_WALKS
        # Its place in the sequence: its cell's start, then the unit's draws of that walk in order.
        cell = np.repeat(place[units], drawn)
        cell += walk * len(self.units)
        where = begins[cell]
        del cell
        within //= MAX_WALKS
        where += within
        del within
        # Told apart in sequence order: a sample's copies (side by side, in one unit) by walk.
        copies = np.argsort(ids * MAX_WALKS + walk, kind="stable")  # nearly sorted already: timsort's runs
        del walk
        copy = np.empty_like(ids)
        copy[copies] = drawn_copy(ids[copies])
        del copies
        ids += copy * total
        inside = (where >= start) & (where < stop)
        out[where[inside] - start] = ids[inside]

    def _unit_uniforms(self, units: np.ndarray) -> np.ndarray:
        """The uniforms of `units` (in id order), one after another. Each unit's are its
        stretch of one stream, the units' in id order, so consecutive units' are one stretch,
        reached by `advance` (PCG64 makes a float64 of one 64-bit output): 3 us, where a
        generator seeded per unit costs 34 us (3 s an epoch of 100,000 shards)."""
        stream = np.random.PCG64(0)
        pieces = []
        for run in np.split(units, np.flatnonzero(np.diff(units) != 1) + 1):
            if len(run):
                stream.state = self._uniforms
                stream.advance(int(self._drawn_before[run[0]]))
                pieces.append(np.random.Generator(stream).random(int(self._drawn[run].sum())))
        return np.concatenate(pieces) if pieces else np.zeros(0)


def weighted_draws(counts: np.ndarray, weights: np.ndarray, seed: int, epoch: int, shuffle: bool, n: int,
                   block: int = 0) -> WeightedDraws:
    """Epoch `epoch`'s `n` draws by `weights` (one per sample of `counts`' shards), grouped by
    shard (with `block`, by a shard's blocks, in the epoch's order: `plan.epoch_units`)."""
    units, order = epoch_units(counts, seed, epoch, shuffle, block=block)
    return WeightedDraws(units, order, *draw_table(units, weights), seed, epoch, n)


def draw_table(units: np.ndarray, weights: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """What `WeightedDraws` draws from, the same every epoch (as units in id order are): the
    weights' running sum from 0, each unit's sum, and each unit's last sample with a weight
    above 0 (-1 where none)."""
    weights = np.asarray(weights, dtype=np.float64)
    if not weights.sum() > 0:
        raise ValueError("the sampling weights (class weight times sample weight) are 0 for every sample")
    cumulative = np.zeros(len(weights) + 1)
    np.cumsum(weights, out=cumulative[1:])
    if not math.isfinite(cumulative[-1]):  # each finite, their sum past float's range (the running sum's
        # rounding can pass it where numpy's pairwise sum does not)
        np.cumsum(weights / weights.max(), out=cumulative[1:])
    ends = np.cumsum(units)
    weighed = np.flatnonzero(weights > 0)
    last = weighed[np.maximum(np.searchsorted(weighed, ends) - 1, 0)]  # the last before each unit's end
    last = np.where(last >= ends - units, last, -1)  # none in the unit
    return cumulative, cumulative[ends] - cumulative[ends - units], last


def weighted_sequence(counts: np.ndarray, weights: np.ndarray, seed: int, epoch: int, shuffle: bool,
                      n: int, block: int = 0) -> np.ndarray:
    """The sample ids of `weighted_draws`, whole."""
    return drawn_samples(weighted_draws(counts, weights, seed, epoch, shuffle, n, block).draws(0, n, len(weights)),
                         len(weights))


def drawn_copy(draws: np.ndarray) -> np.ndarray:
    """For sorted sample ids `draws`, which copy of its sample each is: 0 for the first, 1 for the next..."""
    places = np.arange(len(draws), dtype=np.int64)
    first = np.maximum.accumulate(np.where(np.r_[True, draws[1:] != draws[:-1]], places, 0))
    return places - first


def sorted_choice(rng: np.random.Generator, p: np.ndarray, n: int) -> np.ndarray:
    """``np.sort(rng.choice(len(p), size=n, p=p))``, the same draws, 10x faster at 10^7:
    numpy's `choice` looks each uniform up in the table of cumulative weights, which at
    millions of samples is a cache miss a draw (14 s at 10^7 here); the same uniforms,
    sorted first, are looked up in one sweep (1.3 s). (numpy's algorithm, its steps kept:
    the cumulative sum normalised by its last value, `random`, `searchsorted` to the right.)"""
    cdf = np.cumsum(p)
    cdf /= cdf[-1]
    uniforms = rng.random(n)
    uniforms.sort()
    return cdf.searchsorted(uniforms, side="right").astype(np.int64, copy=False)


def distinct_draws(sequence: np.ndarray, total: int) -> np.ndarray:
    """`sequence` (sample ids below `total`, a sample possibly drawn more than once) with each
    draw told apart: the k-th draw of sample i (k from 0, in sequence order) becomes
    ``i + k * total``, so a first draw keeps its id. A sample's augmentations are seeded by
    its id (prepare.py): without this, every draw of a sample oversampled by its class
    weight, or met again on a second pass of an epoch larger than the data, got the same
    crop and flip. Which draw is the k-th is fixed by the epoch's whole sequence, so it
    holds for any layout and any resume. `drawn_samples` undoes it."""
    sequence = np.asarray(sequence, dtype=np.int64)
    order = np.argsort(sequence, kind="stable")
    draw = np.empty_like(sequence)
    draw[order] = drawn_copy(sequence[order])  # k: the draws of the same sample before it
    return sequence + draw * total


def drawn_samples(draws: np.ndarray, total: int) -> np.ndarray:
    """The sample ids of `distinct_draws`'s draws."""
    return np.asarray(draws, dtype=np.int64) % total


def mix_picks(weights: Sequence[float], n: int, start: int = 0) -> np.ndarray:
    """Which source each of the mixed picks at positions [start, start + n) comes from (see the
    module docstring)."""
    return mix_schedule(weights, start, n)[0]


def mix_schedule(weights: Sequence[float], start: int, n: int) -> tuple[np.ndarray, np.ndarray]:
    """(the sources of the picks at positions [start, start + n) of the mixed stream, and how
    many picks of each source come before `start`).

    Source i's k-th pick is at time (k + 1/2) / w_i, and the stream is every pick in time
    order (the lower source first at equal times), over all epochs: an epoch is a window
    of it, so shares hold across epochs too, and a source too small for one pick an
    epoch gets one every few epochs. Picks before a time `tau` a little ahead of the
    start are counted from the formula, those after merged: the count of picks before
    time t is within a source count of t, so `tau = start - sources - 1` is early enough.

    Times are floats: past 2^53 picks they no longer tell the picks apart (an epoch of 2^62,
    set by `set_epoch`, spun for good), so a window there is refused.
    """
    if start + n > MIX_POSITIONS:
        raise ValueError(f"a mix's epochs are windows of one stream of picks, and position {start + n:,} (the epoch "
                         f"times its size) is past the {MIX_POSITIONS:,} it can place: set a smaller epoch")
    w = np.asarray(weights, dtype=np.float64)
    w = w / w.sum()
    tau = max(0.0, float(start) - len(w) - 1)
    before = np.maximum(0, np.ceil(tau * w - 0.5)).astype(np.int64)
    for i, wi in enumerate(w):  # exactly the picks whose (float) time is below tau, as merged below
        while before[i] > 0 and (before[i] - 1 + 0.5) / wi >= tau:
            before[i] -= 1
        while (before[i] + 0.5) / wi < tau:
            before[i] += 1
    skip = start - int(before.sum())
    assert skip >= 0
    quota = np.floor(w * (skip + n + len(w))).astype(np.int64) + 2
    while True:
        times = np.concatenate([(before[i] + np.arange(q) + 0.5) / wi for i, (q, wi) in enumerate(zip(quota, w))])
        source = np.concatenate([np.full(q, i) for i, q in enumerate(quota)])
        picked = source[np.argsort(times, kind="stable")[: skip + n]]
        if (np.bincount(picked, minlength=len(w)) < quota).all():  # no source ran out of candidates
            break
        quota = quota * 2 + 2
    return picked[skip:], before + np.bincount(picked[:skip], minlength=len(w))
