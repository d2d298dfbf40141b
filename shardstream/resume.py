"""Resume state: what a training loop has received, as a few plain numbers.

Nothing about samples or buffers is stored. The plan is a pure function of the seed,
the epoch and the layout, and the DataLoader hands items over round robin, so the
number of items a rank has received (`delivered`) says exactly which samples every
worker of every rank has yielded; ranks move in lockstep, so one rank's count speaks
for all.

An epoch may pass through several layouts (a job restarted with another world size or
worker count). Each finished part is a `Segment`: the layout and how far it got. The
samples it consumed are recomputed from the plan and removed from the epoch sequence;
the next layout plans the rest. What a finished layout would never have delivered in
the epoch (`partial="drop"`'s tail, a batch `drop_last` drops) counts as consumed too,
so a resumed epoch yields only samples the uninterrupted run would have, and a state
taken at an epoch's end leaves nothing of it to any layout. With the same layout,
resumption is exact: the same items, bit for bit, as the uninterrupted run.
"""

from __future__ import annotations

import hashlib
import numbers
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, fields
from typing import TYPE_CHECKING, Any, Callable

import numpy as np

from .errors import ShardstreamError
from .plan import (MAX_RUN, MAX_WORLD_SIZE, PARTIAL, Layout, consumed_positions, left_out_positions,
                   rank_block_length, remaining_after, streams_digest, streams_digests_read, worker_items)
from .roundrobin import EndlessDeal
from .shared import SLOTS
from .source import KEYS

if TYPE_CHECKING:
    from .dataset import StreamingDataset
    from .world import World

__all__ = ["ResumeState", "Segment", "SequenceAfter", "check_counts", "current_place", "current_sequence", "dataset_fingerprint", "endless_deal", "finished_before",
           "endless_onto", "endless_place", "fingerprint", "sequence_after"]

STATE_VERSION = 7
MAX_EPOCH = (1 << 63) - 1  # the processes share the epoch as a signed 64-bit int (shared.py)
# Version 1 states are read as they were written: their segments' left-out samples
# remain for the layouts after them (`Segment.spends_left_out`). Those of a Mix or of
# `samples_per_epoch` are refused: their epochs were drawn otherwise (`_walks_a_stream`).
# Versions 1 and 2 of weighted epochs (class or sample weights) are refused: their draws
# were read in one walk over the shards, not spread over several (`sampling.weighted_sequence`).
# Versions 1 to 3 of shuffled epochs whose shards are now cut into blocks (`plan.shuffle_block`)
# are refused: each shard was read front to back then. Layouts of versions 1 to 4 have no
# `run`: they dealt their workers a chunk at a time, Layout's default, and replay so.
# Versions 3 to 5 of weighted epochs are refused: their draws were made for the whole epoch
# at once, not unit by unit (`sampling.WeightedDraws`), so they drew other samples.
# Version 7 states carry a digest of the weighted epochs' draws too (`plan.streams_digest`); one
# of version 6 and before, of permutations and uniforms alone, is checked as far as it goes. (The
# version says so to an earlier shardstream, which would blame another numpy build.)
READ_VERSIONS = (1, 2, 3, 4, 5, 6, 7)


@dataclass(frozen=True)
class Segment:
    layout: Layout
    delivered: int
    # Items each plan worker handed over, where `delivered` alone does not say (the
    # epoch an endless stream was resumed onto another layout in: see `endless_onto`).
    per_worker: tuple[int, ...] | None = None
    # Whether what the layout never delivers in the epoch counts as consumed when a later
    # layout reads the rest (`plan.left_out_positions`). False only for segments of
    # version 1 states, taken when it did not: the layouts after them planned with it left.
    spends_left_out: bool = True

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"layout": asdict(self.layout), "delivered": self.delivered}
        if self.per_worker is not None:
            out["per_worker"] = list(self.per_worker)
        if not self.spends_left_out:
            out["spends_left_out"] = False
        return out

    @classmethod
    def from_dict(cls, raw: Any, field: str, version: int = STATE_VERSION) -> "Segment":
        """The segment stored at `field` of a resume state of `version`, each value checked (see `_int`)."""
        raw = _dict(raw, field)
        layout = _layout(_entry(raw, "layout", field), f"{field}.layout", version)
        delivered = _int(_entry(raw, "delivered", field), f"{field}.delivered", minimum=0)
        spends = version > 1 and _bool(raw.get("spends_left_out", True), f"{field}.spends_left_out")
        per_worker = raw.get("per_worker")
        if per_worker is None:
            return cls(layout, delivered, spends_left_out=spends)
        counts = _list(per_worker, f"{field}.per_worker")
        done = tuple(_int(n, f"{field}.per_worker[{w}]", minimum=0) for w, n in enumerate(counts))
        if len(done) != layout.workers:
            raise _invalid(f"{field}.per_worker", f"one count per worker of its layout ({layout.workers})", per_worker)
        if sum(done) != delivered:
            raise _invalid(f"{field}.delivered", f"the sum of {field}.per_worker ({sum(done)})", delivered)
        return cls(layout, delivered, done, spends)


def fingerprint(counts: np.ndarray, names: list[str], contents: bytes | None = None) -> str:
    """Identifies a dataset's samples: shard names and counts, and what their `contents`
    are where known (`Source.contents`: the same folder packed again with another seed has
    the same names and counts, and other samples in each place)."""
    digest = hashlib.sha256()
    for name, count in zip(names, counts.tolist()):
        digest.update(f"{name}\0{count}\n".encode())
    keyed = contents is not None and contents.startswith(KEYS)
    if contents is not None:
        # (checksums went in under this tag before there were other contents: states kept)
        digest.update((b"" if keyed else b"sha256\0") + contents)
    # Named so: such a state may be of these shards indexed since (`ResumeState.from_dict`)
    return ("keys-" if keyed else "") + digest.hexdigest()[:16]


@dataclass(frozen=True)
class ResumeState:
    dataset: str  # fingerprint
    seed: int
    shuffle: bool
    epoch: int
    finished: tuple[Segment, ...]  # earlier layouts of this epoch
    current: Segment
    # One DataLoader worker's own place, (plan worker, items it has yielded this epoch):
    # torchdata's StatefulDataLoader keeps a state per worker and restores each itself.
    position: tuple[int, int] | None = None
    # `plan.streams_digest()` where the state was taken (None in states from before it was
    # kept): the plan it replays is the same here only where the random draws are.
    streams: str | None = None
    # The samples in a shard's block, per source (`EpochSequences.blocks`; None in states from
    # before shards were cut): another cut is another order of the epoch.
    blocks: tuple[int, ...] | None = None

    def to_dict(self) -> dict[str, Any]:
        out = {
            "version": STATE_VERSION,
            "dataset": self.dataset,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "epoch": self.epoch,
            "finished": [s.to_dict() for s in self.finished],
            "current": self.current.to_dict(),
        }
        if self.position is not None:
            out["position"] = list(self.position)
        if self.streams is not None:
            out["streams"] = self.streams
            out["numpy"] = np.__version__  # for the message where the streams differ
        if self.blocks is not None:
            out["blocks"] = list(self.blocks)
        return out

    @classmethod
    def from_dict(cls, raw: Any, dataset: "StreamingDataset") -> "ResumeState":
        """`raw` checked and read: every field's type and bounds, and that it was taken of
        `dataset` with its seed. Whether its counts fit in the epoch is `check_counts`'s part."""
        raw = _dict(raw, "the state")
        version = _int(_entry(raw, "version", ""), "version")
        if version not in READ_VERSIONS:
            raise ShardstreamError(f"resume state version {version} is not one of {READ_VERSIONS} (this "
                                   f"shardstream reads those)")
        current = Segment.from_dict(_entry(raw, "current", ""), "current", version)
        state = cls(
            dataset=_str(_entry(raw, "dataset", ""), "dataset"),
            # Any int: seeds are masked to 64 bits (plan.rng_for). An epoch is what set_epoch
            # takes (the processes share it as a signed 64-bit int: 2**64 read back as 0).
            seed=_int(_entry(raw, "seed", ""), "seed"),
            shuffle=_bool(_entry(raw, "shuffle", ""), "shuffle"),
            epoch=_int(_entry(raw, "epoch", ""), "epoch", 0, MAX_EPOCH + 1),
            finished=tuple(Segment.from_dict(s, f"finished[{i}]", version)
                           for i, s in enumerate(_list(_entry(raw, "finished", ""), "finished"))),
            current=current,
            position=_position(raw.get("position"), current.layout.workers),
            streams=None if raw.get("streams") is None else _str(raw["streams"], "streams"),
            blocks=None if raw.get("blocks") is None else tuple(
                _int(b, f"blocks[{i}]", minimum=0) for i, b in enumerate(_list(raw["blocks"], "blocks"))),
        )
        if state.streams is not None and state.streams not in (
                {streams_digest()} if version >= 7 else streams_digests_read()):
            numpy = raw.get("numpy")
            if numpy == np.__version__:  # the same version said: a build that draws otherwise, or damage
                taken = (f"numpy {numpy} as here, but its draws' digest is not this numpy's: another build of it, "
                         "or a state damaged or edited")
            else:
                taken = (f"numpy {numpy}" if isinstance(numpy, str) and len(numpy) < 40 else "another numpy") + \
                    f"; this is numpy {np.__version__}, whose permutations differ"
            raise ShardstreamError(
                f"resume state was planned with other random draws ({taken}): its epoch would be replayed onto "
                "another order, samples repeated and lost. Resume with the numpy that took it, or start the epoch "
                "afresh without the state")
        if version == 1 and _walks_a_stream(dataset):
            raise ShardstreamError(
                "resume state version 1 was taken when a Mix and samples_per_epoch drew each epoch afresh; they now "
                "walk on across epochs (each epoch a window of one stream), so its epoch holds other samples here: "
                "resume with the shardstream that took it, or start the epoch afresh without the state")
        if version < 3 and dataset.sampling is not None and dataset.sampling.weighted:
            raise ShardstreamError(
                f"resume state version {version} was taken when a weighted epoch read each sample's draws side by side "
                "in one walk over the shards; they are now spread over several walks, so its epoch holds another order "
                "here: resume with the shardstream that took it, or start the epoch afresh without the state")
        if version < 6 and dataset.sampling is not None and dataset.sampling.weighted:
            raise ShardstreamError(
                f"resume state version {version} was taken when a weighted epoch was drawn for the whole epoch at once; "
                "its draws are now made shard by shard (so that a rank draws its own share), so its epoch holds other "
                "samples here: resume with the shardstream that took it, or start the epoch afresh without the state")
        mine = _fingerprint_of(dataset)
        # States taken before the checksums counted name the shards and counts only: still accepted.
        # And a state of tars read through to count them names their keys, which this dataset (the
        # same tars since indexed, by `shardstream index`) tells apart otherwise: asked last, as it
        # reads every index.
        if state.dataset != mine and state.dataset != _fingerprint_of(dataset, contents=False) and not (
                state.dataset.startswith("keys-")
                and state.dataset == _fingerprint_of(dataset, contents=dataset.resolve().keys_read)):
            # The fingerprint folds in the epoch's draw: a changed Sampling was blamed on the data.
            raise ShardstreamError(
                f"resume state is from another dataset (fingerprint {state.dataset}, this one {mine}): its shards, "
                "their contents, or its Sampling or Mix weights differ, or it was opened otherwise (a dataset's "
                "folder, with its manifest's checksums, and a pattern or list of its shards fingerprint apart). "
                "Resume on the dataset the state was taken on, opened as then, or start the epoch afresh without "
                "the state"
            )
        if (state.seed, state.shuffle) != (dataset.seed, dataset.shuffle):
            raise ShardstreamError(
                f"resume state was taken with seed={state.seed}, shuffle={state.shuffle}; "
                f"this dataset has seed={dataset.seed}, shuffle={dataset.shuffle}: make the dataset as then "
                "(its order comes from both), or start the epoch afresh without the state"
            )
        _check_blocks(state, version, dataset)
        return state

    @classmethod
    def current_of(cls, dataset: "StreamingDataset", world: "World", delivered: int) -> "ResumeState":
        """The state of `dataset` after this rank received `delivered` items of the current layout."""
        layout = dataset.layout(world)
        resume = dataset._state_resume(world)
        epoch = resume.epoch if resume is not None else dataset.epoch
        return cls(_fingerprint_of(dataset), dataset.seed, dataset.shuffle, epoch,
                   finished_before(resume, layout), Segment(layout, delivered), streams=streams_digest(),
                   blocks=dataset._sequences().blocks)


def _check_blocks(state: ResumeState, version: int, dataset: "StreamingDataset") -> None:
    """Refuse a state whose epoch cut the shards into other blocks than `dataset`'s does (or,
    from before blocks, read them whole where `dataset` cuts them): it would be replayed onto
    another order, samples repeated and lost."""
    if not state.shuffle:  # unshuffled, shards are read whole, then and now
        return
    mine = dataset._sequences().blocks
    older = state.blocks is None and version < 4 and any(mine)
    other = state.blocks is not None and state.blocks != mine
    if not (older or other) or _consumed_none_or_all(state, dataset):  # then no order to replay
        return
    if older:
        raise ShardstreamError(
            f"resume state version {version} was taken when each shard was read front to back every epoch; a "
            "shuffled epoch of few shards now reads them in blocks in a seeded order, so its epoch holds another "
            "order here: resume with the shardstream that took it, or start the epoch afresh without the state")
    raise ShardstreamError(
        f"resume state cut the shards into blocks of {list(state.blocks or ())} samples, and this shardstream cuts "
        f"this dataset's into blocks of {list(mine)} (0: whole shards), so its epoch holds another order here: "
        "resume with the shardstream that took it, or start the epoch afresh without the state")


def _consumed_none_or_all(state: ResumeState, dataset: "StreamingDataset") -> bool:
    """Whether `state` took nothing of its epoch yet (a checkpoint before the first step) or
    the whole of it (one at the epoch's end): what remains is then the same in any order."""
    segments = state.finished + (state.current,)
    if not any(s.delivered or any(s.per_worker or ()) for s in segments):
        return True
    if state.finished or dataset.resampled:  # a resampled stream's current segment runs on
        return False
    return state.current.delivered >= sum(plan_items(dataset._sequences().size, state.current.layout))


def _position(raw: Any, workers: int) -> tuple[int, int] | None:
    """A worker state's (plan worker, items it yielded); the worker one of the current layout's."""
    if raw is None:
        return None
    pair = _list(raw, "position")
    if len(pair) != 2:
        raise _invalid("position", "[plan worker, items yielded]", raw)
    return (_int(pair[0], "position[0] (the plan worker)", minimum=0, below=workers),
            _int(pair[1], "position[1] (items yielded)", minimum=0))


# -- reading a state: each value checked, the error naming the field and what it must be ------------


def _invalid(field: str, expected: str, value: Any) -> ShardstreamError:
    return ShardstreamError(f"invalid resume state: {field} must be {expected}, not {value!r}")


def _entry(raw: Mapping[str, Any], key: str, field: str) -> Any:
    if key not in raw:
        raise ShardstreamError(f"invalid resume state: {f'{field}.' if field else ''}{key} is missing")
    return raw[key]


def _dict(raw: Any, field: str) -> Mapping[str, Any]:
    if not isinstance(raw, Mapping):
        raise _invalid(field, "a dict", raw)
    return raw


def _list(raw: Any, field: str) -> list[Any]:
    if not isinstance(raw, Sequence) or isinstance(raw, (str, bytes)):
        raise _invalid(field, "a list", raw)
    return list(raw)


def _str(raw: Any, field: str) -> str:
    if not isinstance(raw, str):
        raise _invalid(field, "a string", raw)
    return raw


def _bool(raw: Any, field: str) -> bool:
    if not isinstance(raw, (bool, np.bool_)):
        raise _invalid(field, "true or false", raw)
    return bool(raw)


def _int(raw: Any, field: str, minimum: int | None = None, below: int | None = None) -> int:
    """An int (numpy's too; not a bool, a float or a string) within [minimum, below)."""
    bounds = ([f">= {minimum}"] if minimum is not None else []) + ([f"< {below}"] if below is not None else [])
    expected = " ".join(["an int", " and ".join(bounds)]).strip()
    if isinstance(raw, (bool, np.bool_)) or not isinstance(raw, numbers.Integral):
        raise _invalid(field, expected, raw)
    if (minimum is not None and raw < minimum) or (below is not None and raw >= below):
        raise _invalid(field, expected, raw)
    return int(raw)


def _layout(raw: Any, field: str, version: int = STATE_VERSION) -> Layout:
    """A layout of a state of `version`, every key of its version there: one left out took
    Layout's default, and a state cut short (no world_size: 1) repeated and lost samples.
    Only `run`, which layouts before version 5 lack, takes its default there."""
    raw = _dict(raw, field)
    names = {f.name: f.default for f in fields(Layout)}
    unknown = sorted(set(raw) - set(names), key=str)
    if unknown:
        raise ShardstreamError(f"invalid resume state: {field} has unknown keys {unknown}; a layout has "
                               f"{sorted(names)}")
    missing = sorted(set(names) - set(raw) - ({"run"} if version < 5 else set()))
    if missing:
        raise ShardstreamError(f"invalid resume state: {field} lacks {', '.join(missing)} (a state cut short or "
                               "edited?): start the epoch afresh without the state")
    value = {**names, **raw}
    batch_size, partial = value["batch_size"], value["partial"]
    if partial not in PARTIAL:
        raise _invalid(f"{field}.partial", f"one of {PARTIAL}", partial)
    return Layout(
        # Bounded as a dataset and a loader bound them: planned, a state of 10**9 ranks or
        # workers (no run writes one) failed as a bare MemoryError, or took minutes.
        world_size=_int(value["world_size"], f"{field}.world_size", minimum=1, below=MAX_WORLD_SIZE + 1),
        workers=_int(value["workers"], f"{field}.workers", minimum=1, below=SLOTS + 1),
        batch_size=None if batch_size is None else _int(batch_size, f"{field}.batch_size", minimum=1),
        drop_last=_bool(value["drop_last"], f"{field}.drop_last"),
        partial=partial,
        shuffle=_bool(value["shuffle"], f"{field}.shuffle"),
        buffer=_int(value["buffer"], f"{field}.buffer"),  # any int: 1 or less means no buffer
        run=_int(value["run"], f"{field}.run", minimum=1, below=MAX_RUN + 1),
    )


def _walks_a_stream(dataset: "StreamingDataset") -> bool:
    """Whether the dataset's epochs are windows of a stream across epochs (`sampling.mix_schedule`,
    `sampling.sized_sequence`), which version 1 states took as drawn afresh every epoch."""
    sampling = dataset.sampling
    sized = sampling is not None and sampling.samples_per_epoch is not None and not sampling.weighted
    return sized or getattr(dataset.source, "weights", None) is not None


def dataset_fingerprint(dataset: "StreamingDataset") -> str:
    """The fingerprint `dataset`'s states name it by."""
    return _fingerprint_of(dataset)


def _fingerprint_of(dataset: "StreamingDataset", contents: bool | Callable[[], bytes | None] = True) -> str:
    """`dataset`'s fingerprint: with what `Source.contents` knows of its samples (True), with
    nothing of them (False), or with what `contents()` gives."""
    # What decides the epoch sequence besides seed and epoch: the shards, the sampling, the mix.
    extra = [repr(getattr(dataset.source, "weights", None)),
             dataset.sampling.describe() if dataset.sampling is not None else ""]
    source = dataset.resolve()
    counts = dataset.counts()  # first: counting tars without an index reads the keys `contents` names
    known = source.contents() if contents is True else contents() if callable(contents) else None
    return fingerprint(np.concatenate([counts, [0, 0]]), source.names() + extra, known)


def finished_before(resume: ResumeState | None, layout: Layout) -> tuple[Segment, ...]:
    """The segments that precede one read with `layout`."""
    if resume is None:
        return ()
    if resume.current.layout == layout:
        return resume.finished
    return resume.finished + (resume.current,)


# The samples of an epoch that remain after these segments (earlier layouts) read it, in order.
SequenceAfter = Callable[[tuple[Segment, ...]], np.ndarray]


def sequence_after(sequence: np.ndarray, finished: tuple[Segment, ...], seed: int, epoch: int,
                   first: int = 0) -> np.ndarray:
    """What is left of an epoch's `sequence` after the `finished` segments read it, in order:
    each segment reads what the segments before it left. `first` is the number of the first
    of them in the epoch (`sequence` is then what the ones before it left)."""
    for number, segment in enumerate(finished, first):
        n = len(sequence)
        spent = consumed_positions(n, segment.layout, seed, epoch, segment.delivered, number, segment.per_worker)
        if segment.spends_left_out and segment.delivered:  # a layout that delivered nothing left nothing out
            spent = np.concatenate([spent, left_out_positions(n, segment.layout, seed, epoch, number)])
        sequence = remaining_after(sequence, spent)
    return sequence


def current_sequence(after: SequenceAfter, resume: ResumeState | None, layout: Layout) -> tuple[np.ndarray, int, int]:
    """(the samples still to read this epoch, the segment number, items already delivered in
    it) for reading with `layout`, the epoch's remains given by `after` (`sequence_after`)."""
    finished, delivered = current_place(resume, layout)
    return after(finished), len(finished), delivered


def current_place(resume: ResumeState | None, layout: Layout) -> tuple[tuple[Segment, ...], int]:
    """(the segments of the epoch finished before one read with `layout`, items already
    delivered in it)."""
    finished = finished_before(resume, layout)
    return finished, resume.current.delivered if resume is not None and resume.current.layout == layout else 0


def check_counts(length_after: Callable[[tuple[Segment, ...]], int], resume: ResumeState, endless: bool) -> None:
    """Refuse a state whose counts exceed what its layouts hold of the resumed epoch, the
    length of whose remains after earlier segments `length_after` gives
    (`EpochSequences.length_after`). In an endless stream the current segment's counts run
    on into later epochs: no bound there."""
    segments = resume.finished + (resume.current,)
    for number, segment in enumerate(segments):
        current = number == len(resume.finished)
        length = length_after(resume.finished[:number])
        field = "current" if current else f"finished[{number}]"
        items = plan_items(length, segment.layout)
        left = f"{field}.layout makes of the {length} samples of epoch {resume.epoch} left to it"
        for w, done in enumerate(segment.per_worker or ()):
            if done > items[w] and not (current and endless):
                raise _invalid(f"{field}.per_worker[{w}]", f"at most {items[w]} (plan worker {w}'s items {left})", done)
        if segment.delivered > sum(items) and not (current and endless):
            raise _invalid(f"{field}.delivered", f"at most {sum(items)} (the items per rank {left})", segment.delivered)
        if current and resume.position is not None and not endless:
            worker, done = resume.position
            if done > items[worker]:
                raise _invalid("position[1] (items yielded)", f"at most {items[worker]} (plan worker {worker}'s "
                               f"items {left})", done)


def rests_nothing(after: SequenceAfter, resume: ResumeState, endless: bool) -> bool:
    """Whether a rank's state (`check_counts`'d) delivered every item of its epoch: taken at
    the end of the epoch's pass, as a checkpoint after each epoch is."""
    if endless or resume.position is not None:
        return False
    return resume.current.delivered >= sum(plan_items(len(after(resume.finished)), resume.current.layout))


def plan_items(sequence_length: int, layout: Layout) -> list[int]:
    """Items each plan worker of a rank yields from an epoch sequence of this length."""
    return worker_items(rank_block_length(sequence_length, layout), layout)


def locate(done: int, items_of_epoch: Callable[[int], int]) -> tuple[int, int]:
    """(epochs passed, items into the next) for a plan worker that handed over `done`
    items since an epoch began, epoch k holding `items_of_epoch(k)` of them.

    Epochs without items of this worker are passed while it has items left to place
    (an endless stream's deal may give a worker an empty share of an epoch); the
    caller makes sure later epochs hold items at all, or this would not end."""
    k = 0
    while done >= items_of_epoch(k) and (k == 0 or done > 0 or items_of_epoch(k) > 0):
        done -= items_of_epoch(k)
        k += 1
    return k, done


def endless_deal(layout: Layout, first: int, later: int) -> EndlessDeal:
    """The deal of an endless stream read with `layout` (`roundrobin.EndlessDeal`), whose first
    epoch's rank block (what a resume left of it) holds `first` samples and every later one `later`."""
    return EndlessDeal(worker_items(first, layout), worker_items(later, layout))


def endless_place(deal: EndlessDeal, worker: int, done: int) -> tuple[int, int, int]:
    """Where plan worker `worker` of an endless stream stands after handing over `done`
    items: (epochs passed, items into that epoch, the share of it the worker reads)."""
    passed, into = locate(done, lambda k: deal.items(worker, k))
    return passed, into, deal.share(worker, passed)


def endless_onto(resume: ResumeState, layout: Layout, remaining: int, full: int) -> ResumeState:
    """An endless stream's state, re-expressed for a new `layout`.

    In an endless stream every plan worker hands over one item per round, so after
    `delivered` items worker w has handed over ``delivered // W + (w < delivered % W)``;
    epochs are dealt by the items each worker handed over (`roundrobin.EndlessDeal`), so
    the workers cross each boundary within about a chunk of each other. The new layout continues in
    the earliest epoch some worker had not finished: it yields the samples of that epoch
    no worker had handed over, each once, then whole epochs. The few samples of the next
    epoch that workers already past the boundary had handed over (at most about a chunk
    per worker: a batch, or 64 samples unbatched) are yielded again in that epoch.

    `remaining` is the length of the resumed epoch's sequence after its earlier
    segments, `full` that of a whole epoch.
    """
    old = resume.current.layout
    deal = endless_deal(old, rank_block_length(remaining, old), rank_block_length(full, old))
    workers = old.workers
    d = resume.current.delivered
    done = [d // workers + (1 if w < d % workers else 0) for w in range(workers)]
    places = [endless_place(deal, w, done[w]) for w in range(workers)]
    k = min(epochs for epochs, _, _ in places)
    per_worker_list = [0] * workers  # by the share of epoch k each worker reads (what consumed_positions takes)
    for w, (epochs, into, _) in enumerate(places):
        per_worker_list[deal.share(w, k)] = into if epochs == k else deal.items(w, k)
    per_worker = tuple(per_worker_list)
    finished = (resume.finished if k == 0 else ()) + (Segment(old, sum(per_worker), per_worker),)
    return ResumeState(resume.dataset, resume.seed, resume.shuffle, resume.epoch + k, finished, Segment(layout, 0),
                       streams=resume.streams, blocks=resume.blocks)
