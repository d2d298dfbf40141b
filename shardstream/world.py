"""Who is reading: this process's rank among the ranks, and this worker among the workers.

The environment is read once, by `World.detect()`, when iteration starts; every layer
below takes a `World` value and never looks at torch.distributed or the environment.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

__all__ = ["World"]


@dataclass(frozen=True)
class World:
    """Rank `rank` of `size` ranks; DataLoader worker `worker` of `workers` on that rank."""

    rank: int = 0
    size: int = 1
    worker: int = 0
    workers: int = 1

    def __post_init__(self) -> None:
        if not (0 <= self.rank < self.size and 0 <= self.worker < self.workers):
            raise ValueError(f"inconsistent world {self}")

    @classmethod
    def detect(cls, rank: int | None = None, world_size: int | None = None) -> "World":
        """The world of the calling process.

        Rank and size come from explicit arguments when given (so a user can always
        override), else from an initialised `torch.distributed`, else from the
        ``RANK``/``WORLD_SIZE`` environment that torchrun sets, else a single process.
        The worker comes from `torch.utils.data.get_worker_info()`.
        """
        import torch.distributed as dist
        from torch.utils.data import get_worker_info

        if rank is None or world_size is None:
            if dist.is_available() and dist.is_initialized():
                found: tuple[int, int] | None = (dist.get_rank(), dist.get_world_size())
            else:
                found = _from_environment()
            if found is None:
                if world_size is not None and world_size > 1:  # every process would be rank 0 of them
                    raise ValueError(f"world_size={world_size} without a rank: pass rank too, or run under "
                                     "torch.distributed or torchrun (RANK and WORLD_SIZE)")
                found = (0, 1)
            if rank is None and world_size is not None and world_size != found[1]:
                # A rank of another world: world_size=4 in a world of 2 put the two processes at
                # ranks 0 and 1 of 4, and half the data went unread; world_size=1 (every rank
                # reads all, to validate) failed on rank 1 of 1.
                if world_size > 1:
                    raise ValueError(f"world_size={world_size} without a rank, in a world of {found[1]} processes: "
                                     "pass rank too")
                found = (0, 1)
            # Each value given explicitly wins; the other comes from the environment.
            rank = found[0] if rank is None else rank
            world_size = found[1] if world_size is None else world_size
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        return cls(rank, world_size, worker, workers)


def _from_environment() -> tuple[int, int] | None:
    """(RANK, WORLD_SIZE) from the environment torchrun sets, or None where neither is set.
    One without the other, or a value that is not a number, is an error naming it: read as
    a single process, every process would read the whole dataset."""
    given = {name: os.environ.get(name) for name in ("RANK", "WORLD_SIZE")}
    if all(value is None for value in given.values()):
        return None
    missing = [name for name, value in given.items() if value is None]
    if missing:
        present = [name for name in given if name not in missing]
        raise ValueError(f"{present[0]} is set in the environment but {missing[0]} is not: set both (torchrun "
                         "does), or neither")
    values = []
    for name, value in given.items():
        try:
            values.append(int(value))  # type: ignore[arg-type]
        except ValueError:
            raise ValueError(f"{name}={value!r} in the environment is not a number") from None
    return values[0], values[1]
