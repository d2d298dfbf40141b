"""Sampling in a stream: class weights, epoch size, and mixing datasets. Pure functions.

A stream cannot index at random the way `WeightedRandomSampler` does, but the plan can:
every choice below is made on sample ids, from the seed and the epoch, before any data
is read. The result is an epoch sequence like `plan.epoch_sequence`'s, so everything
downstream holds unchanged: equal counts per rank, deterministic order, exact resume.

* **Class weights** (``Sampling(class_weights="balanced")`` or ``{class: weight}``):
  the epoch draws `samples_per_epoch` ids with replacement, each sample with
  probability proportional to its class's weight ("balanced" is 1 / class count, the
  PyTorch recipe), over the per-sample labels that shard indexes carry. The draws are
  then grouped by shard (shards in the epoch's seeded order; where shards are few, by
  the blocks they are cut into, `plan.epoch_units`) and sorted within a shard or block,
  so reading stays sequential, in up to `MAX_WALKS` walks over the shards: a sample's
  copies go to successive walks, so they do not sit side by side, where the shuffle
  buffer would keep them within a few batches. Cost: one pass over the labels (4 bytes
  a sample) per epoch, reading every index once, and each shard opened once a walk.
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
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from .arguments import flag, integer
from .columns import MAX_CLASS
from .plan import epoch_sequence, epoch_units, rng_for

__all__ = ["Sampling", "Mix", "sized_sequence", "stream_slice", "weighted_sequence", "distinct_draws", "drawn_samples",
           "mix_picks", "mix_schedule",
           "mixed_sequence", "class_sample_weights", "drawn_copy"]

# The most walks over the shards a weighted epoch is read in (`weighted_sequence`): each walk
# opens the shards its draws are in again, so a sample drawn more often than this has
# copies in one walk (adjacent there), about copies / MAX_WALKS of them.
MAX_WALKS = 8


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
            weights = np.asarray(self.sample_weights, dtype=np.float64)
            if weights.ndim != 1 or not np.all(np.isfinite(weights)) or np.any(weights < 0):
                raise ValueError("sample_weights must be one finite, non-negative weight per sample")
            weights.setflags(write=False)
            object.__setattr__(self, "sample_weights", weights)

    @property
    def weighted(self) -> bool:
        """Draws with replacement by weight (class or sample weights), not every sample once."""
        return self.class_weights is not None or self.sample_weights is not None

    def describe(self) -> str:
        weights = self.class_weights if isinstance(self.class_weights, (str, type(None))) else sorted(
            self.class_weights.items())
        per_sample = self.sample_weights
        if isinstance(per_sample, np.ndarray):  # identified by content: a resume state must match it
            per_sample = f"array({len(per_sample)}, sha256={hashlib.sha256(per_sample.tobytes()).hexdigest()[:16]})"
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


def sized_sequence(counts: np.ndarray, seed: int, epoch: int, shuffle: bool, n: int, block: int = 0) -> np.ndarray:
    """`n` ids: epoch `epoch`'s window of a stream of whole passes over the data.

    The stream is pass after pass (pass p in epoch p's order when shuffling, so an epoch
    of the data's size is the plain epoch), and epoch e is its positions [e n, (e + 1) n):
    epochs walk on from where the last stopped, as WebDataset's `with_epoch` does. Cut
    short at the same place every epoch instead, the samples beyond the cut of every
    shard larger than an epoch would never be read, shuffled or not."""
    total = int(counts.sum())

    def pass_of(p: int) -> np.ndarray:
        return epoch_sequence(counts, seed, p, shuffle, block=block) if shuffle else np.arange(total, dtype=np.int64)

    return stream_slice(pass_of, total, epoch * n, n)


def stream_slice(pass_of: Callable[[int], np.ndarray], size: int, start: int, n: int) -> np.ndarray:
    """Positions [start, start + n) of the stream made of the passes `pass_of(0)`, `pass_of(1)`,
    ..., each `size` long (none: an empty stream)."""
    if not size or n <= 0:
        return np.zeros(0, dtype=np.int64)
    first, last = start // size, (start + n - 1) // size
    passes = np.concatenate([pass_of(p) for p in range(first, last + 1)])
    return passes[start - first * size : start - first * size + n]


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


def weighted_sequence(counts: np.ndarray, weights: np.ndarray, seed: int, epoch: int, shuffle: bool,
                      n: int, block: int = 0) -> np.ndarray:
    """`n` ids drawn with replacement with probability ∝ `weights`, grouped by shard (with
    `block`, by a shard's blocks, in the epoch's order: `plan.epoch_units`) for reading."""
    weights = np.asarray(weights, dtype=np.float64)
    if not weights.sum() > 0:
        raise ValueError("the sampling weights (class weight times sample weight) are 0 for every sample")
    if not math.isfinite(weights.sum()):
        weights = weights / weights.max()  # each finite, their sum past float's range
    draws = sorted_choice(rng_for(seed, epoch, 2), weights / weights.sum(), n)
    # Shards in the epoch's order, each shard's draws sorted: sequential reads. In one walk
    # over the shards a sample's copies (a rare class's, drawn dozens of times) sat side by
    # side, and the shuffle buffer spread them over a few batches: 12 copies of one image
    # in a batch of 64. So the draws are dealt to `walks` walks over the shards, a sample's
    # k-th copy to walk (first + k) mod walks from a first walk drawn per sample: copies
    # walks apart, and every walk the same mix of classes, as its draws are.
    units, order = epoch_units(counts, seed, epoch, shuffle, block=block)
    starts = np.concatenate([[0], np.cumsum(units)])
    rank = np.empty(len(units), dtype=np.int64)
    rank[order] = np.arange(len(units))
    by_shard = np.argsort(rank[np.searchsorted(starts, draws, side="right") - 1], kind="stable")
    walk = _walks(draws, rng_for(seed, epoch, 3))
    # int8 walks: numpy sorts them stably by radix, and the draws' arrays stay few (10^8 draws: 0.8 GB each).
    return draws[by_shard[np.argsort(walk[by_shard], kind="stable")]]


def _walks(draws: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Each of the sorted `draws`' walk (int8): a first walk drawn per distinct sample (a draw
    per sample drawn, not per sample of the dataset), and its k-th copy k walks on."""
    copy = drawn_copy(draws)
    walks = min(int(copy.max()) + 1 if len(copy) else 1, MAX_WALKS)
    starts = np.flatnonzero(copy == 0)  # where each distinct sample's draws begin
    first = (rng.random(len(starts)) * walks).astype(np.int8)
    walk = np.repeat(first, np.diff(np.r_[starts, len(copy)]))
    copy %= walks
    walk += copy.astype(np.int8)
    walk %= walks
    return walk


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
    """
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


def mixed_sequence(sources: Sequence[Callable[[int, int], np.ndarray]], weights: Sequence[float], n: int,
                   start: int = 0) -> np.ndarray:
    """`n` ids interleaved from the sources by weight: the mixed stream's positions
    [start, start + n) (see the module docstring). `sources[i](first, count)` gives the ids
    at positions [first, first + count) of source i's own stream."""
    picked, before = mix_schedule(weights, start, n)
    out = np.empty(n, dtype=np.int64)
    for i, take in enumerate(sources):
        where = np.flatnonzero(picked == i)
        ids = take(int(before[i]), len(where)) if len(where) else np.zeros(0, dtype=np.int64)
        if len(ids) < len(where):
            raise ValueError(f"mixed source {i} has no samples")
        out[where] = ids
    return out
