"""Running the parts of a pack on an existing distributed engine (Ray).

The parts of ``pack --part I/N`` need no coordinator, so any engine that can run N
function calls will do; Ray is the one offered here, because `ray.init()` connects to
whatever cluster the user already runs (or starts a local one) and schedules tasks
by CPU. Each part runs as one Ray task; the bar advances as parts finish, by their
sample counts; `merge` runs last. The source must be readable at the same path on
every node (a shared file system), and `dst` reachable from all of them (``s3://``,
or a shared folder).

When a part fails (or the caller is interrupted), the other parts are cancelled, and
the call returns only once they have stopped: parts left running would hold the
cluster for nothing, and race a retry that writes the same destination.

One set of options goes to every part, so a run after a failure is `resume`: finished
parts are kept, the others continue where they stopped, and a part whose earlier run
cannot be continued because of the fix (another `on_error`, an image repaired since:
where a single pack refuses and says to start over) starts over, said in a warning.
Any other difference (an option mistyped) is refused, as a single pack refuses it,
before that part's work is thrown away. Without `resume` or `overwrite`, finished parts
are refused up front with that advice: each would refuse alone, and the others be
cancelled.
"""

from __future__ import annotations

import logging
import os
import warnings
from typing import Any

from .arguments import flag
from .errors import PackError, ResumeMismatchError, ShardstreamError, reason
from .format import Manifest
from .pack import PackSummary, pack
from .journal import START_OVER
from .parts import merge, part_manifests
from .storage import Store
from .urls import expand_home

__all__ = ["pack_with_ray"]

log = logging.getLogger("shardstream")

# `ray.cancel` raises KeyboardInterrupt in a running part, which a part blocked in a
# system call (a read from a hung file system) never sees: after CANCEL_GRACE_S such a
# part is cancelled by force (its worker process killed), and waited for STOP_WAIT_S more.
CANCEL_GRACE_S = 5.0
STOP_WAIT_S = 60.0


def _pack_part(src: str, dst: str, part: tuple[int, int], options: dict[str, Any],
               pixels: int | None = None) -> tuple[PackSummary, str | None]:
    """The part packed, and why it started over rather than resume (None: it did not)."""
    # The caller's Pillow limit (`pixels`): a Ray worker started elsewhere has Pillow's default,
    # and skipped images the caller's pack would take (found by review).
    from PIL import Image

    Image.MAX_IMAGE_PIXELS = pixels
    try:
        return pack(src, dst, part=part, progress=False, **options), None
    except ResumeMismatchError as e:
        if not options.get("resume"):
            raise
        return pack(src, dst, part=part, progress=False, **{**options, "resume": False}), e.detail.removesuffix(
            START_OVER)


def _absolute(path: str) -> str:
    """A local path made absolute (a `file://` URL and remote URLs as they are)."""
    path = expand_home(path)
    return os.path.abspath(path) if "://" not in path else path


def pack_with_ray(src: str, dst: str, *, parts: int, address: str | None = None, cpus_per_part: int = 1,
                  progress: bool = True, **options: Any) -> tuple[Manifest, list[PackSummary]]:
    """Pack `src` into `dst` as `parts` Ray tasks, then merge; returns the manifest and each part's summary.

    `options` are `pack`'s (shard_size, compression, seed, on_error, resume, ...);
    `workers` defaults to `cpus_per_part`. Without `address`, `ray.init()` uses
    ``RAY_ADDRESS`` or starts a local instance.
    """
    progress = flag(progress, "progress")
    try:
        import ray
    except ImportError:  # a PackError: the command line says it in a line, as any other refusal
        raise PackError("the Ray executor needs ray: pip install 'shardstream[ray]'") from None
    from .progress import progress_bar

    if not ray.is_initialized():
        ray.init(address=address, include_dashboard=False, log_to_driver=False)
    options.setdefault("workers", cpus_per_part)
    # The tasks run in worker processes that a cluster started elsewhere, whose working folder is
    # not this one: a relative path named nothing there ("src: ... nothing is there").
    src, dst = (_absolute(path) for path in (src, dst))
    if not options.get("resume") and not options.get("overwrite"):
        _refuse_finished_parts(dst, parts, options.get("storage_options"))
    task = ray.remote(num_cpus=_cpus_to_ask(ray, cpus_per_part))(_pack_part)
    from PIL import Image

    pending = {task.remote(src, dst, (i, parts), options, Image.MAX_IMAGE_PIXELS): i for i in range(parts)}
    summaries: dict[int, PackSummary] = {}
    with progress_bar(total=parts, unit="part", desc="pack (ray)", disable=not progress) as bar:
        try:
            while pending:
                done, _ = ray.wait(list(pending), num_returns=1)
                for ref in done:
                    index = pending.pop(ref)
                    try:
                        summaries[index], restarted = ray.get(ref)
                    except Exception as e:
                        raise _part_error(ray, e, index, parts) from e
                    if restarted is not None:
                        warnings.warn(f"part {index} of {parts} was packed from its start, its earlier run differing "
                                      f"as the fix does: {restarted}", RuntimeWarning, stacklevel=2)
                    bar.update(1)
                    bar.set_postfix_str(f"{sum(s.samples for s in summaries.values()):,} samples", refresh=False)
        except BaseException:
            _stop(ray, pending)
            raise
    manifest = merge(dst, storage_options=options.get("storage_options"), fsync=options.get("fsync", False))
    return manifest, [summaries[i] for i in range(parts)]


def _refuse_finished_parts(dst: str, parts: int, storage_options: dict[str, Any] | None) -> None:
    """A `PackError` where parts of this pack are finished in `dst` (an earlier run's): each
    part's task would refuse alone, naming itself only, and the rest be cancelled."""
    finished = sorted(i for i, total in part_manifests(Store(dst, storage_options or {})) if total == parts)
    if finished:
        shown = ", ".join(map(str, finished[:8])) + (", ..." if len(finished) > 8 else "")
        raise PackError(f"parts {shown} of {parts} are packed already, by an earlier run: --resume (resume=True) "
                        "keeps them and packs the others (continued where they stopped, or from their start where "
                        "their earlier run differs); --overwrite (overwrite=True) packs every part again",
                        url=dst)


def _cpus_to_ask(ray: Any, cpus_per_part: int) -> int:
    """The CPUs each part's task asks Ray for: `cpus_per_part`, or as many as the largest node
    has, with a warning. Ray keeps a task that no node can hold pending forever, silently
    here (its warning goes to the driver's log, which is off), so the pack would never start."""
    largest = max((node.get("Resources", {}).get("CPU", 0) for node in ray.nodes() if node.get("Alive")), default=0)
    if largest >= cpus_per_part or largest < 1:  # no CPUs seen at all: left to Ray (an autoscaler may add some)
        return cpus_per_part
    warnings.warn(f"no node of the Ray cluster has {cpus_per_part} CPUs (the largest has {largest:g}): each part asks "
                  f"for {int(largest)} and runs its {cpus_per_part} pack workers there", RuntimeWarning, stacklevel=3)
    return int(largest)


def _part_error(ray: Any, error: Exception, index: int, parts: int) -> ShardstreamError:
    """What part `index` raised (Ray wraps it in a RayTaskError), saying which part it was."""
    cause = getattr(error, "cause", None) if isinstance(error, ray.exceptions.RayTaskError) else None
    cause = cause if isinstance(cause, BaseException) else error
    if isinstance(cause, ShardstreamError):  # it names the file: the same error, with the part
        return type(cause)(f"{cause.detail} (part {index} of {parts})", url=cause.url, key=cause.key,
                           offset=cause.offset)
    return PackError(f"part {index} of {parts} failed: {type(cause).__name__}: {reason(cause)}")


def _stop(ray: Any, parts: dict[Any, int]) -> None:
    """Cancel `parts` (Ray object refs -> part numbers) and wait until they have stopped:
    asked first, by force after CANCEL_GRACE_S (see there)."""
    refs = list(parts)
    for ref in refs:
        ray.cancel(ref)  # a queued part never starts; a running one gets a KeyboardInterrupt
    _, running = ray.wait(refs, num_returns=len(refs), timeout=CANCEL_GRACE_S)
    for ref in running:
        ray.cancel(ref, force=True)
    if running:
        _, running = ray.wait(running, num_returns=len(running), timeout=STOP_WAIT_S)
    if running:
        log.warning("parts %s did not stop within %.0f s of being cancelled, and may still write to the destination",
                    sorted(parts[ref] for ref in running), CANCEL_GRACE_S + STOP_WAIT_S)
