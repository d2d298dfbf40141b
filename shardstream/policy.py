"""The one place that decides what a bad sample does to a run.

``on_error="raise"`` (the default) stops at the first bad sample with an error naming
shard, key and offset. ``"skip"`` logs each bad sample (shard and key), counts it, and
yields a good sample of the same worker in its place, so every rank still yields the
same number of samples and batches and DDP cannot hang. The stand-in is the next good
sample after it (the last good one before it at the end of a worker's pass): a function
of the samples from the bad one on, so a run resumed anywhere before a bad sample
yields the same stand-in as the uninterrupted run. Past a cap (more than
`max_skips` samples, or more than `max_fraction` of a worker's planned samples in an
epoch) it raises, because a dataset that bad should stop a run, not quietly shrink it.

Storage failures are not bad samples: a `StorageError` (a shard that is gone, access
denied, an error that outlasted the retries) raises under either policy, since skipping
it would drop every sample of a shard without the data being at fault.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator

import numpy as np

from .errors import ShardstreamError, StorageError

__all__ = ["ErrorPolicy", "TooManyErrors", "guarded"]

log = logging.getLogger("shardstream")


class TooManyErrors(ShardstreamError):
    """More samples failed than the error policy allows."""


@dataclass(frozen=True)
class ErrorPolicy:
    """`mode` is "raise" or "skip"; the caps apply per worker and epoch in "skip" mode."""

    mode: str = "raise"
    max_skips: int | None = None
    max_fraction: float = 0.01

    def __post_init__(self) -> None:
        if self.mode not in ("raise", "skip"):
            raise ValueError(f"on_error must be 'raise' or 'skip', not {self.mode!r}")
        # Checked here, not at the first bad sample (hours in, a bare TypeError): "5", -3, NaN.
        skips = self.max_skips
        if skips is not None and (isinstance(skips, bool) or not isinstance(skips, (int, np.integer)) or skips < 0):
            raise ValueError(f"max_skips is a count of 0 or more, or None: not {skips!r}")
        fraction = self.max_fraction
        if isinstance(fraction, bool) or not isinstance(fraction, (int, float, np.number)) \
                or not 0 <= float(fraction) <= 1:
            raise ValueError(f"max_fraction is a fraction from 0 to 1: not {fraction!r}")

    @classmethod
    def of(cls, value: "str | ErrorPolicy") -> "ErrorPolicy":
        return value if isinstance(value, ErrorPolicy) else cls(mode=value)


def guarded(inputs: Iterable[Any], prepare: Callable[[Any], Any], policy: ErrorPolicy, planned: int,
            on_skip: Callable[[], None] = lambda: None,
            earlier: Callable[[], Iterable[Any]] | None = None,
            as_repeat: Callable[[Any], Any] = lambda result: result) -> Iterator[Any]:
    """`prepare` each input; under "skip", a failure is stood in for by the next good result.

    The stand-in comes after the bad sample's place has passed, so each bad place is owed
    and paid with the next good result, yielded in the bad sample's place and then in its
    own; failures with no good result after them (the end of the pass) are paid with the
    last good one. The next good one, rather than the last, because a resumed run has no
    "last" at its first place: it starts there, and must yield what the uninterrupted run did.
    Where a resumed run has nothing good left, its last good one is among the inputs the
    run before yielded: `earlier` gives them, latest first, and the first that prepares
    is the stand-in (a resume there raised, on every restart). `planned` (the worker's
    samples this epoch) sets the fraction cap. A stand-in is yielded as `as_repeat` makes
    it (marked as a repeat of a sample delivered in its own place).
    """
    skips = 0
    owed = 0
    last: Any = None
    have_good = False
    skipped: ShardstreamError | None = None  # the last skipped
    for item in inputs:
        try:
            result = prepare(item)
        except ShardstreamError as error:
            if policy.mode == "raise" or isinstance(error, StorageError):
                raise
            skips += 1
            on_skip()
            log.warning("shardstream: skipped bad sample: %s", error)
            # Raised again from where it was stored (read_tolerant), its traceback holds the
            # frame of the sample that stores it: a reference cycle, keeping that sample's
            # bytes until the cyclic GC ran. The skip is counted and logged; nothing reads it.
            error.__traceback__ = None
            skipped = error
            limit = policy.max_skips if policy.max_skips is not None else max(1, int(policy.max_fraction * planned))
            if skips > limit:
                raise TooManyErrors(f"{skips} bad samples of {planned} planned in this worker exceed the limit "
                                    f"({limit}); last: {error}", url=error.url, key=error.key) from error
            owed += 1
            continue
        if policy.mode == "skip":  # a stand-in for failures at the pass's end; "raise" needs none
            last = result
        have_good = True
        for _ in range(owed):
            yield as_repeat(result)
        owed = 0
        yield result
        # Let go of the sample before the next is made: a volume of 256 MB was held twice over.
        item = result = None
    if owed and not have_good and earlier is not None:
        have_good, last = _last_good(earlier(), prepare)
    if owed and not have_good:
        assert skipped is not None
        raise TooManyErrors(f"all {owed} samples of this worker's share of the epoch failed, whatever the caps: "
                            f"nothing good to stand in for them; last: {skipped.detail}", url=skipped.url,
                            key=skipped.key)
    for _ in range(owed):
        yield as_repeat(last)


def _last_good(earlier: Iterable[Any], prepare: Callable[[Any], Any]) -> tuple[bool, Any]:
    """(True, the first of `earlier` that prepares), or (False, None). Their failures were
    the run before's, skipped and counted then: not again."""
    for item in earlier:
        try:
            return True, prepare(item)
        except StorageError:
            raise
        except ShardstreamError:
            continue
    return False, None
