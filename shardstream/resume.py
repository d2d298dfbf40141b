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
from typing import TYPE_CHECKING, Any

import numpy as np

from .errors import ShardstreamError
from .plan import Layout, consumed_positions, remaining_after

if TYPE_CHECKING:
    from .dataset import StreamingDataset
    from .world import World

__all__ = ["ResumeState", "Segment", "current_sequence", "fingerprint"]

STATE_VERSION = 1


@dataclass(frozen=True)
class Segment:
    layout: Layout
    delivered: int

    def to_dict(self) -> dict[str, Any]:
        return {"layout": asdict(self.layout), "delivered": self.delivered}

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> "Segment":
        return cls(Layout(**raw["layout"]), int(raw["delivered"]))


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
        finished = _finished_before(dataset._resume, layout)
        return cls(_fingerprint_of(dataset), dataset.seed, dataset.shuffle, dataset.epoch, finished,
                   Segment(layout, delivered))


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
        sequence = remaining_after(
            sequence, consumed_positions(len(sequence), segment.layout, seed, epoch, segment.delivered, number)
        )
    delivered = resume.current.delivered if resume is not None and resume.current.layout == layout else 0
    return sequence, len(finished), delivered
