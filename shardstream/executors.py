"""Running the parts of a pack on an existing distributed engine (Ray).

The parts of ``pack --part I/N`` need no coordinator, so any engine that can run N
function calls will do; Ray is the one offered here, because `ray.init()` connects to
whatever cluster the user already runs (or starts a local one) and schedules tasks
by CPU. Each part runs as one Ray task; the bar advances as parts finish, by their
sample counts; `merge` runs last. The source must be readable at the same path on
every node (a shared file system), and `dst` reachable from all of them (``s3://``,
or a shared folder).
"""

from __future__ import annotations

from typing import Any

from .format import Manifest
from .pack import PackSummary, pack
from .parts import merge

__all__ = ["pack_with_ray"]


def _pack_part(src: str, dst: str, part: tuple[int, int], options: dict[str, Any]) -> PackSummary:
    return pack(src, dst, part=part, progress=False, **options)


def pack_with_ray(src: str, dst: str, *, parts: int, address: str | None = None, cpus_per_part: int = 1,
                  progress: bool = True, **options: Any) -> tuple[Manifest, list[PackSummary]]:
    """Pack `src` into `dst` as `parts` Ray tasks, then merge; returns the manifest and each part's summary.

    `options` are `pack`'s (shard_size, compression, seed, on_error, resume, ...);
    `workers` defaults to `cpus_per_part`. Without `address`, `ray.init()` uses
    ``RAY_ADDRESS`` or starts a local instance.
    """
    try:
        import ray
    except ImportError as e:
        raise ImportError("the Ray executor needs ray: pip install 'shardstream[ray]'") from e
    from .progress import progress_bar

    if not ray.is_initialized():
        ray.init(address=address, include_dashboard=False, log_to_driver=False)
    options.setdefault("workers", cpus_per_part)
    task = ray.remote(num_cpus=cpus_per_part)(_pack_part)
    pending = {task.remote(src, dst, (i, parts), options): i for i in range(parts)}
    summaries: dict[int, PackSummary] = {}
    with progress_bar(total=parts, unit="part", desc="pack (ray)", disable=not progress) as bar:
        while pending:
            done, _ = ray.wait(list(pending), num_returns=1)
            for ref in done:
                index = pending.pop(ref)
                summaries[index] = ray.get(ref)  # re-raises a part's error, naming the file
                bar.update(1)
                bar.set_postfix_str(f"{sum(s.samples for s in summaries.values()):,} samples", refresh=False)
    return merge(dst, storage_options=options.get("storage_options")), [summaries[i] for i in range(parts)]
