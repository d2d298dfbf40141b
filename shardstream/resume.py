"""Resume state: what a training loop has received, as a few plain numbers.

Nothing about samples or buffers is stored. The plan is a pure function of the seed,
the epoch and the layout, and the DataLoader hands items over round robin, so the
number of items a rank has received (`delivered`) says exactly which samples every
worker of every rank has yielded; ranks move in lockstep, so one rank's count speaks
for all.

An epoch may pass through several layouts (a job restarted with another world size or
worker count). Each finished part is a `Segment`: the layout and how far it got. The
samples it consumed are recomputed from the plan and removed from the epoch sequence;
the next layout plans the rest. With the same layout, resumption is exact: the same
items, bit for bit, as the uninterrupted run.
"""

from __future__ import annotations

import hashlib
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, Callable

import numpy as np

from .errors import ShardstreamError
from .plan import Layout, consumed_positions, deal_chunks, items_of, remaining_after, split_ranks

if TYPE_CHECKING:
    from .dataset import StreamingDataset
    from .world import World

__all__ = ["ResumeState", "Segment", "current_sequence", "endless_onto", "fingerprint"]

STATE_VERSION = 1


@dataclass(frozen=True)
class Segment:
    layout: Layout
    delivered: int
    # Items each plan worker handed over, where `delivered` alone does not say (the
    # epoch an endless stream was resumed onto another layout in: see `endless_onto`).
    per_worker: tuple[int, ...] | None = None

    def to_dict(self) -> dict[str, Any]:
        out = {"layout": asdict(self.layout), "delivered": self.delivered}
        if self.per_worker is not None:
            out["per_worker"] = list(self.per_worker)
        return out

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> "Segment":
        per_worker = raw.get("per_worker")
        return cls(Layout(**raw["layout"]), int(raw["delivered"]),
                   None if per_worker is None else tuple(int(x) for x in per_worker))


def fingerprint(counts: np.ndarray, names: list[str]) -> str:
    """Identifies a dataset's sample layout: shard names and counts."""
    digest = hashlib.sha256()
    for name, count in zip(names, counts.tolist()):
        digest.update(f"{name}\0{count}\n".encode())
    return digest.hexdigest()[:16]


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
        return out

    @classmethod
    def from_dict(cls, raw: dict[str, Any], dataset: "StreamingDataset") -> "ResumeState":
        try:
            if raw["version"] != STATE_VERSION:
                raise ShardstreamError(f"resume state version {raw['version']} is not {STATE_VERSION}")
            state = cls(
                dataset=str(raw["dataset"]),
                seed=int(raw["seed"]),
                shuffle=bool(raw["shuffle"]),
                epoch=int(raw["epoch"]),
                finished=tuple(Segment.from_dict(s) for s in raw["finished"]),
                current=Segment.from_dict(raw["current"]),
                position=_position(raw.get("position")),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise ShardstreamError(f"not a shardstream resume state: {e!r}") from e
        mine = _fingerprint_of(dataset)
        if state.dataset != mine:
            raise ShardstreamError(
                f"resume state is from another dataset (fingerprint {state.dataset}, this one {mine})"
            )
        if (state.seed, state.shuffle) != (dataset.seed, dataset.shuffle):
            raise ShardstreamError(
                f"resume state was taken with seed={state.seed}, shuffle={state.shuffle}; "
                f"this dataset has seed={dataset.seed}, shuffle={dataset.shuffle}"
            )
        return state

    @classmethod
    def current_of(cls, dataset: "StreamingDataset", world: "World", delivered: int) -> "ResumeState":
        """The state of `dataset` after this rank received `delivered` items of the current layout."""
        layout = dataset.layout(world)
        resume = dataset._state_resume(world)
        epoch = resume.epoch if resume is not None else dataset.epoch
        return cls(_fingerprint_of(dataset), dataset.seed, dataset.shuffle, epoch,
                   _finished_before(resume, layout), Segment(layout, delivered))


def _position(raw: Any) -> tuple[int, int] | None:
    if raw is None:
        return None
    worker, done = (int(x) for x in raw)
    if worker < 0 or done < 0:
        raise ValueError(f"bad worker position {raw!r}")
    return worker, done


def _fingerprint_of(dataset: "StreamingDataset") -> str:
    # What decides the epoch sequence besides seed and epoch: the shards, the sampling, the mix.
    extra = [repr(getattr(dataset.source, "weights", None)),
             dataset.sampling.describe() if dataset.sampling is not None else ""]
    names = [ref.name for ref in dataset.resolve().shards]
    return fingerprint(np.concatenate([dataset.counts(), [0, 0]]), names + extra)


def _finished_before(resume: ResumeState | None, layout: Layout) -> tuple[Segment, ...]:
    """The segments that precede one read with `layout`."""
    if resume is None:
        return ()
    if resume.current.layout == layout:
        return resume.finished
    return resume.finished + (resume.current,)


def current_sequence(sequence: np.ndarray, resume: ResumeState | None, layout: Layout, seed: int, epoch: int
                     ) -> tuple[np.ndarray, int, int]:
    """(the samples still to read this epoch, the segment number, items already delivered in it)."""
    finished = _finished_before(resume, layout)
    for number, segment in enumerate(finished):
        sequence = remaining_after(sequence, consumed_positions(
            len(sequence), segment.layout, seed, epoch, segment.delivered, number, segment.per_worker))
    delivered = resume.current.delivered if resume is not None and resume.current.layout == layout else 0
    return sequence, len(finished), delivered


def plan_items(sequence_length: int, layout: Layout) -> list[int]:
    """Items each plan worker of a rank yields from an epoch sequence of this length."""
    block = len(split_ranks(np.arange(sequence_length), layout.world_size, layout.partial)[0])
    return [items_of(len(chunk), layout) for chunk in deal_chunks(block, layout.workers, layout.chunk)]


def locate(done: int, items_of_epoch: Callable[[int], int]) -> tuple[int, int]:
    """(epochs passed, items into the next) for a plan worker that handed over `done`
    items since an epoch began, epoch k holding `items_of_epoch(k)` of them.

    The first epoch, the rest of a resumed one, may hold no items of this worker: it is
    passed at once. A later, whole epoch without items stops the count (the caller
    refuses those), rather than looping forever."""
    k = 0
    while done >= items_of_epoch(k) and (k == 0 or items_of_epoch(k) > 0):
        done -= items_of_epoch(k)
        k += 1
    return k, done


def endless_onto(resume: ResumeState, layout: Layout, remaining: int, full: int) -> ResumeState:
    """An endless stream's state, re-expressed for a new `layout`.

    In an endless stream every plan worker hands over one item per round, so after
    `delivered` items worker w has handed over ``delivered // W + (w < delivered % W)``,
    and the workers cross epoch boundaries at slightly different times. The new layout
    continues in the earliest epoch some worker had not finished: it yields the samples
    of that epoch no worker had handed over, each once, then whole epochs. The few
    samples of the next epoch that workers already past the boundary had handed over (at
    most about one item per worker) are yielded again in that epoch.

    `remaining` is the length of the resumed epoch's sequence after its earlier
    segments, `full` that of a whole epoch.
    """
    old = resume.current.layout
    first, later = plan_items(remaining, old), plan_items(full, old)
    workers = old.workers
    d = resume.current.delivered
    done = [d // workers + (1 if w < d % workers else 0) for w in range(workers)]
    places = [locate(done[w], lambda k, w=w: first[w] if k == 0 else later[w]) for w in range(workers)]
    k = min(epochs for epochs, _ in places)
    items_k = first if k == 0 else later
    per_worker = tuple(n if epochs == k else items_k[w] for w, (epochs, n) in enumerate(places))
    finished = (resume.finished if k == 0 else ()) + (Segment(old, sum(per_worker), per_worker),)
    return ResumeState(resume.dataset, resume.seed, resume.shuffle, resume.epoch + k, finished, Segment(layout, 0))
