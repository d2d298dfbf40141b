"""Each rank's DataLoader worker count, compared across ranks through torch.distributed's store.

A resume state holds one layout for every rank: the items the training loop received, and
one `num_workers`. Ranks that iterate with different worker counts (say `cpu_count() //
gpus` on nodes of other sizes) split an epoch exactly, but a state taken on one of them
describes the others with its count, and resuming it lost and repeated samples on them
without a word (26 of 301 in a review's 2-rank job).

Each rank's `shardstream.DataLoader` knows its count in its main process when an iteration
starts. It writes the count to the key-value store that `init_process_group` made, as the
first rank's count unless one is there already (`compare_set`, so no rank ever waits for
another: a loader iterated on one rank alone, for validation, must not hang). A rank that
finds another count there marks the mismatch. `state_dict()` on any rank then refuses to
make a state while the mark is there.

Where there is no process group (ranks given by `rank=`/`world_size=` or the environment
alone), nothing is compared: README says every rank must use the same `num_workers`.
"""

from __future__ import annotations

import collections
import warnings
from typing import Any, Callable

import torch.distributed as dist

from .errors import ShardstreamError

__all__ = ["WorkerCounts"]

PREFIX = "shardstream/num_workers"

# Loaders of one dataset in this process, in the order of their first iterations: the n-th
# loader of a dataset here is compared with the n-th of the same dataset on the other ranks.
_loaders_of: collections.Counter = collections.Counter()


def _store() -> Any:
    """The default process group's store, or None (no group, or one destroyed)."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    try:
        return dist.distributed_c10d._get_default_store()
    except (RuntimeError, ValueError, AttributeError):  # a private function: gone in another torch
        return None


class WorkerCounts:
    """One loader's worker count, told to the other ranks and checked against theirs."""

    def __init__(self) -> None:
        self._key: str | None = None  # this loader's key, from its first iteration on

    def tell(self, dataset_id: Callable[[], str], rank: int, world_size: int, num_workers: int) -> None:
        """Write this rank's count at an iteration's start; mark a count other than the first rank's.
        `dataset_id` names the dataset alike on every rank (its fingerprint), asked once."""
        store = _store()
        if store is None or world_size <= 1:
            return
        if self._key is None:
            name = dataset_id()
            self._key = f"{PREFIX}/{name}/{_loaders_of[name]}"
            _loaders_of[name] += 1
        mine = f"{rank}:{num_workers}"
        try:
            first_rank, first_count = store.compare_set(self._key, "", mine).decode().split(":")
            if first_count != str(num_workers):
                differs = (f"rank {rank} iterates it with num_workers={num_workers}, and rank {first_rank} with "
                           f"num_workers={first_count}")
                store.set(f"{self._key}/differs", differs)
        except RuntimeError:  # the store went away (the group destroyed meanwhile): nothing to compare
            return
        if first_count != str(num_workers):
            # Now, not only when a checkpoint is refused, which may come hours into the job.
            warnings.warn(f"the ranks iterate this dataset with different numbers of DataLoader workers ({differs}): "
                          "every state_dict() will be refused, on every rank; give every rank the same num_workers",
                          stacklevel=3)

    def check(self) -> None:
        """Refuse to make a state where some rank iterates with another count than another."""
        store = _store()
        if store is None or self._key is None:
            return
        try:
            differs = store.get(f"{self._key}/differs").decode() if store.check([f"{self._key}/differs"]) else None
        except RuntimeError:
            return
        if differs is not None:
            raise ShardstreamError(
                f"the ranks iterate this dataset with different numbers of DataLoader workers ({differs}): a state "
                "holds one worker count for every rank, so resuming this one would lose and repeat samples on the "
                "ranks with another; give every rank the same num_workers")
