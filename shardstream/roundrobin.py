"""The DataLoader's round robin over its workers, as arithmetic on item counts.

torch's DataLoader takes one item from each worker in turn and skips workers that have
finished. So the items a training loop has received say exactly how many every worker
had handed over, and which worker hands over the next: all that resuming an epoch, or
starting a new DataLoader part-way into one, needs to know. Pure functions of lists of
ints; plan.py and the dataset build on them.
"""

from __future__ import annotations

from typing import Sequence

__all__ = ["EndlessDeal", "round_robin_delivered", "round_robin_next", "loader_start", "endless_start"]


def round_robin_delivered(items: Sequence[int], delivered: int) -> list[int]:
    """How many items each worker had handed over once `delivered` items were received.

    The DataLoader takes one item from each worker in turn, skipping workers that have
    finished: round r gives one item from every worker with more than r items.
    """
    rounds, left = _whole_rounds(items, delivered)
    got = [min(n, rounds) for n in items]
    active = [w for w, n in enumerate(items) if n > rounds]
    if left > len(active):
        raise ValueError(f"{delivered} items delivered, but the workers only have {sum(items)}")
    for w in active[:left]:
        got[w] += 1
    return got


def round_robin_next(items: Sequence[int], delivered: int) -> int:
    """The worker that hands over item number `delivered` (0-based); 0 when all are done.

    A resumed DataLoader starts its round robin at its worker 0, so plan worker
    ``(next + i) % workers`` is served by loader worker i: the rotation makes the
    resumed sequence continue exactly where the interrupted one stopped.
    """
    rounds, left = _whole_rounds(items, delivered)
    active = [w for w, n in enumerate(items) if n > rounds]
    return active[left] if left < len(active) else 0


def _whole_rounds(items: Sequence[int], delivered: int) -> tuple[int, int]:
    """(r, left): the most whole rounds `delivered` items hold (r rounds hand over
    ``sum(min(n, r))``), and the items of the next round delivered. By bisection: a
    million samples unbatched over 8 workers are 125,000 rounds, which a loop over them
    took 0.35 s to count (measured), at every iteration's start and `len()`."""
    def handed(r: int) -> int:
        return sum(min(n, r) for n in items)

    low, high = 0, max(items, default=0)
    while low < high:
        middle = (low + high + 1) // 2
        if handed(middle) <= delivered:
            low = middle
        else:
            high = middle - 1
    return low, delivered - handed(low)


def loader_start(items: Sequence[int], delivered: int, loader_worker: int) -> tuple[int, int]:
    """The plan worker that DataLoader worker `loader_worker` serves, and how many items
    that plan worker has already handed over, once the rank received `delivered` of an
    epoch whose plan workers yield `items`.

    A resumed DataLoader starts its round robin at its worker 0, so loader worker i
    serves plan worker ``(next + i) % W`` (see `round_robin_next`).
    """
    worker = (round_robin_next(items, delivered) + loader_worker) % len(items)
    return worker, round_robin_delivered(items, delivered)[worker]


def endless_start(workers: int, delivered: int, loader_worker: int) -> tuple[int, int]:
    """`loader_start` for an endless stream, which never runs out, so its round robin is
    regular: after `delivered` items, plan worker w has handed over
    ``delivered // W + (w < delivered % W)``, spread over its epochs."""
    worker = (delivered + loader_worker) % workers
    return worker, delivered // workers + (1 if worker < delivered % workers else 0)


class EndlessDeal:
    """Which share of each epoch each plan worker of an endless stream reads.

    At each epoch's start the workers are ordered by the items they have handed over
    since the stream began (then by number), and the s-th of them reads share s of the
    epoch (the shares of `plan.deal_chunks`, the first the largest). In the DataLoader's
    round robin every worker hands over one item a round, so that keeps them together:
    with whole batches it deals the epochs' batches as one sequence (batch j of the
    whole stream to worker j mod W), and the first E epochs' worth of items holds epochs
    0..E-1 whole; where an epoch's last chunk yields fewer items (64 samples unbatched,
    or a batch `drop_last` drops), the worker that had it reads first in the next epoch.
    Dealt per epoch instead, a worker whose share was a chunk shorter finished every
    epoch a round early and ran ahead of the others without bound.

    `first` and `later` are the items of each share of the stream's first epoch (what a
    resume left of it) and of every later one. Pure: the same counts give the same deal.
    """

    def __init__(self, first: Sequence[int], later: Sequence[int]) -> None:
        self._items = (list(first), list(later))
        self._loads = [0] * len(self._items[0])  # items each worker handed over so far
        self._shares: list[list[int]] = []  # epoch k: each worker's share

    def share(self, worker: int, k: int) -> int:
        """The share of epoch `k` (0: the stream's first) that plan worker `worker` reads."""
        while len(self._shares) <= k:
            items = self._items[len(self._shares) > 0]
            shares = [0] * len(self._loads)
            for s, w in enumerate(sorted(range(len(self._loads)), key=lambda w: (self._loads[w], w))):
                shares[w] = s
                self._loads[w] += items[s]
            self._shares.append(shares)
        return self._shares[k][worker]

    def items(self, worker: int, k: int) -> int:
        """The items plan worker `worker` hands over in epoch `k`."""
        return self._items[k > 0][self.share(worker, k)]

