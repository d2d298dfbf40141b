"""Each rank's DataLoader worker count, compared across ranks through torch.distributed's store.

A resume state holds one layout for every rank: the items the training loop received, and
one `num_workers`. Ranks that iterate with different worker counts (say `cpu_count() //
gpus` on nodes of other sizes) split an epoch exactly, but a state taken on one of them
describes the others with its count, and resuming it lost and repeated samples on them
without a word (26 of 301 in a review's 2-rank job).

Each rank's `shardstream.DataLoader` knows its count in its main process when an iteration
starts, and writes it to the key-value store that `init_process_group` made, under a key
of its own rank and of the stream (the dataset's fingerprint and what else a state depends
on: seed, shuffle, batching, `partial`, buffer). A later iteration of any loader of the same
stream on that rank writes over it, so a loader one rank alone iterates first (a preview, a
sanity check) does not stand for that rank's training loader. `state_dict()` writes its own
count again, then compares the counts every rank wrote, and warns where they differ; so does
a loader's second and later iteration as it begins. No rank ever waits for another (no
collective; a rank that has not written yet is not compared), so a loader iterated on one
rank alone cannot hang.

With its count, each rank writes the digest of its numpy's random draws
(`plan.streams_digest`), from which every rank plans the epoch alike: ranks whose numpys draw
otherwise (nodes whose environments were built apart) deal the epoch in other orders, samples
repeated and lost on every rank without a word. That is refused, at the first iteration that
sees it: the digest is the process's, not a loader's, so no loader can stand for it wrongly.

It warns of counts, and does not refuse the state, because which loader stands for a rank is a guess:
a loader of the same stream that one rank alone iterates in the middle of training (a look
at a batch to log it) writes its count over the training loader's, and another rank's
checkpoint then finds a difference that is not there (found by a review: a correct job
crashed at its checkpoint). A wrong warning costs a line of log; a wrong refusal cost the job.

Where there is no process group (ranks given by `rank=`/`world_size=` or the environment
alone), in a process forked from a rank (it shares the rank's connection to the store), and
through torch's own DataLoader, nothing is compared: README says every rank must use the
same `num_workers`. This module imports no torch, so that `import shardstream` registers its
fork hook without it (`shardstream pack` starts without torch).
"""

from __future__ import annotations

import os
import sys
import warnings
from typing import Any, Callable

import numpy as np

from .errors import ShardstreamError
from .plan import streams_digest

__all__ = ["WorkerCounts"]

PREFIX = "shardstream/num_workers"

# A process forked from a rank shares the rank's connection to a TCP store: its requests and
# the rank's interleave on one socket, and both fail (`DistStoreError`, a rank hung). A process
# forked where a process group existed leaves the store alone; ranks forked by a launcher before
# any group exists (notebook launchers) make their own, and compare. `shardstream/__init__`
# imports this module, so the hook covers every fork after `import shardstream`; a child forked
# from a rank before the rank imported shardstream cannot be told from the rank, and a loader of
# its own would use the rank's connection (README says to import shardstream before forking).
_forked = False
_group_at_fork = False


def _group_exists() -> bool:
    dist = sys.modules.get("torch.distributed")  # never imported: no group
    return dist is not None and dist.is_available() and dist.is_initialized()


def _before_fork() -> None:
    global _group_at_fork
    _group_at_fork = _group_exists()


def _after_fork_in_child() -> None:
    global _forked
    _forked = _forked or _group_at_fork


if hasattr(os, "register_at_fork"):  # not on Windows, which has no fork
    os.register_at_fork(before=_before_fork, after_in_child=_after_fork_in_child)


def _store() -> Any:
    """The default process group's store, or None (none, one destroyed, or a forked process)."""
    if _forked or not _group_exists():
        return None
    try:
        return sys.modules["torch.distributed"].distributed_c10d._get_default_store()
    except Exception:  # a private function: gone, or another kind of group, in another torch
        return None


def _counted(num_workers: int) -> int:
    """The count a state holds: 0 workers (the loop's own process) plans as 1."""
    return max(1, num_workers)


class WorkerCounts:
    """One loader's worker count, told to the other ranks and compared with theirs."""

    def __init__(self) -> None:
        self._keys: list[str] | None = None  # every rank's key of this stream, from the first iteration on
        self._rank = 0

    def tell(self, stream: Callable[[], str], rank: int, world_size: int, num_workers: int) -> None:
        """Write this rank's count as an iteration starts; from this loader's second iteration on,
        warn where another rank's differs, rather than only at a checkpoint, which may come hours
        into the job. (At the first, another rank's count may still be that of a loader of its
        own it looked through first.) `stream` names what this loader reads alike on every rank,
        asked once."""
        store = _store()
        if store is None or world_size <= 1:
            return
        first = self._keys is None
        if first:
            # An elastic restart keeps torchrun's store, and the last attempt's counts in it.
            base = f"{PREFIX}/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/{stream()}"
            self._keys, self._rank = [f"{base}/{r}" for r in range(world_size)], rank
        differ = self._differing(store, num_workers)  # raises where a rank draws otherwise
        if differ and not first:
            warnings.warn(f"{differ}: a state_dict() of this loader would resume the other ranks wrongly while they "
                          "differ; give every rank the same num_workers", stacklevel=3)

    def check(self, num_workers: int) -> None:
        """Warn, as a state is made, where a rank's count differs from this one's."""
        store = _store()
        if store is None or self._keys is None:
            return
        differ = self._differing(store, num_workers)
        if differ:
            warnings.warn(f"{differ}: a state holds one worker count for every rank, so resuming this one would "
                          "lose and repeat samples on the ranks with another; give every rank the same num_workers "
                          "(where one rank alone last iterated a loader of this dataset and settings, to look at a "
                          "batch, that loader's count stood for it: then nothing differs)", stacklevel=3)

    def _differing(self, store: Any, num_workers: int) -> str | None:
        """Write this rank's count and draws; then which ranks wrote another count, said in words
        (None: none, or not every rank has written yet, or the store failed: nothing to compare).
        Raises where a rank's numpy draws otherwise."""
        assert self._keys is not None
        mine = _counted(num_workers)
        try:
            store.set(self._keys[self._rank], f"{mine} {streams_digest()} {np.__version__}")
            if not store.check(self._keys):  # a rank that has not begun: not waited for
                return None
            # An earlier shardstream wrote the count alone: its draws are not compared.
            told = [v.decode(errors="replace").split() for v in store.multi_get(self._keys)]
            counts = [int(words[0]) for words in told]
        except Exception:  # the store gone (the group destroyed meanwhile) or unable: nothing to compare
            return None
        _refuse_other_draws(self._rank, {r: words[1:3] for r, words in enumerate(told) if len(words) == 3})
        other = {r: n for r, n in enumerate(counts) if n != mine}
        if not other:
            return None
        shown = ", ".join(f"rank {r} with {n}" for r, n in list(other.items())[:4]) + (", ..." if len(other) > 4 else "")
        return (f"the ranks iterate this dataset with different numbers of DataLoader workers (this rank, "
                f"{self._rank}, with {mine}; {shown}; 0 counts as 1)")


def _refuse_other_draws(rank: int, draws: dict[int, list[str]]) -> None:
    """Raise where a rank's numpy draws otherwise than this one's (`draws`: rank -> [digest, numpy version])."""
    other = {r: version for r, (digest, version) in draws.items() if digest != streams_digest()}
    if other:
        shown = ", ".join(f"rank {r} with numpy {v}" for r, v in list(other.items())[:4]) + (
            ", ..." if len(other) > 4 else "")
        raise ShardstreamError(
            f"the ranks' numpys draw random numbers otherwise (this rank, {rank}, with numpy {np.__version__}; "
            f"{shown}): every rank plans the epoch from the same seeded draws, and these would deal it in other "
            "orders, samples repeated and lost on every rank. Install the same numpy on every node")
