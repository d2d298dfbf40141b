"""What `pack` writes as the frames come in: each shard, appended to in order, published
and journaled once its last frame is in (or dropped, if every image of it was skipped),
and at the end the manifest of the shards published.

The frames come from the pool (framepool.py) in plan order (packplan.py); a shard
half written when an error comes is dropped, never published.
"""

from __future__ import annotations

import collections

import time
from dataclasses import dataclass, field
from typing import Any, Iterator

import numpy as np

from .format import Manifest, ShardInfo
from .framebuild import FrameResult
from .journal import Journal
from .sourcefile import Listing, SourceFile, printable
from .packplan import PackOptions
from .shardfile import ShardFileWriter
from .storage import Store
from .writer import shard_name

__all__ = ["Written", "dataset_manifest", "finish_shard", "write_shards"]


@dataclass
class Written:
    """What the frames written so far brought in (see `PackSummary`)."""

    bytes_in: int = 0
    misnamed: list[tuple[str, str]] = field(default_factory=list)
    kept_whole: list[tuple[str, str]] = field(default_factory=list)
    shrunk: int = 0


def write_shards(results: Iterator[FrameResult], store: Store, opts: PackOptions,
                  finished: dict[int, tuple[ShardInfo, list[tuple[str, str]]]], journal: Journal, bar: Any,
                  start: float) -> Written:
    """Append the frames, in order, to their shards, publishing (and journaling, into
    `finished`) each shard once its last frame is in; a shard half written when an error
    comes is dropped."""
    written = Written()
    writer: ShardFileWriter | None = None
    shard_skips: list[tuple[str, str]] = []
    current = -1
    try:
        for result in results:
            if writer is not None and result.shard != current:
                finish_shard(writer, current, shard_skips, finished, journal)
                writer, shard_skips = None, []
            if writer is None:
                current = result.shard
                writer = ShardFileWriter(store, shard_name(opts.prefix, current, opts.compression), opts.compression,
                                         opts.level)
            writer.append(result.frame)
            shard_skips += result.skipped
            written.bytes_in += result.bytes_in
            written.misnamed += result.misnamed
            written.kept_whole += result.kept_whole
            written.shrunk += result.shrunk
            bar.update(len(result.frame.keys) + len(result.skipped))
            bar.set_postfix_str(f"{written.bytes_in / 1e6 / max(time.perf_counter() - start, 1e-9):,.0f} MB/s",
                                refresh=False)
        if writer is not None:
            finish_shard(writer, current, shard_skips, finished, journal)
            writer = None
    except BaseException:
        if writer is not None:
            writer.abort()
        raise
    return written


def dataset_manifest(finished: dict[int, tuple[ShardInfo, list[tuple[str, str]]]], listing: Listing,
              entries: list[SourceFile], listed_skips: list[tuple[str, str]], compression: str,
              options: dict[str, Any]) -> Manifest:
    """The manifest of the shards in `finished` (those left empty by skips left out), the
    classes with the count of their images packed, and every file skipped."""
    shards = [finished[s][0] for s in sorted(finished) if finished[s][0].samples]
    skipped = [skip for s in sorted(finished) for skip in finished[s][1]]
    counts = np.zeros(len(listing.classes), dtype=np.int64)
    # Not `listed_skips`: their files are packed, from their first rows. By how many times a
    # name was skipped, not whether: two files can print alike (a name not UTF-8, escaped,
    # and one spelt as that escape), and only one of them was skipped.
    unskipped = collections.Counter(p for p, _ in skipped)
    for entry in entries:
        if entry.label is None:
            continue
        name = printable(entry.path) if unskipped else None
        if name is not None and unskipped[name] > 0:
            unskipped[name] -= 1
        else:
            counts[entry.label] += 1
    return Manifest(
        shards=tuple(shards),
        compression=compression,
        classes=listing.classes,
        class_counts=tuple(int(c) for c in counts),
        skipped=tuple(listed_skips + skipped),
        ignored=len(listing.ignored),
        options=options,
    )


def finish_shard(writer: ShardFileWriter, shard: int, skipped: list[tuple[str, str]],
            finished: dict[int, tuple[ShardInfo, list[tuple[str, str]]]], journal: Journal) -> None:
    """Publish a shard (or drop it if every one of its images was skipped) and journal it."""
    if writer.samples:
        info = writer.finish()
    else:
        writer.abort()
        info = ShardInfo(writer.name, 0, 0, 0, "", "", 0, "", ())
    finished[shard] = (info, list(skipped))
    journal.record(shard, info, list(skipped))
